"""Training data: conversations JSONL -> fixed-length (tokens, loss_mask) batches with grain.

A conversation line is one of
  {"messages": [...]}                      chat; the target's template is applied and the
                                           loss mask covers the assistant turns only;
  {"prompt_ids": [...], "response_ids": [...]}   token ids (no tokenizer needed); the
                                           loss mask covers the response;
  {"input_ids": [...], "loss_mask": [...]}  already tokenised.
`python -m train.generate_data` writes the first two forms from the target's own outputs.

The pipeline is a grain `MapDataset`: shuffled by seed with a new order every epoch,
repeated for the epochs, sharded by process (each process reads only its rows of every
global batch, so the global batch is the same for any process count), batched. Its iterator state is a
small dict that checkpoints with the model.
"""

from __future__ import annotations

import json
from pathlib import Path

import grain
import numpy as np

from dflash_jax.chat import encode_chat
from dflash_jax.errors import DFlashError


class DataError(DFlashError):
    pass


def iter_jsonl_objects(path: str | Path, error=DFlashError, what: str = "file"):
    """(line number, object) of each non-empty line; a one-line `error` names a bad line."""
    path = Path(path)
    if path.is_dir():
        raise error(f"{what} {path} is a directory, not a JSONL file")
    if not path.is_file():
        raise error(f"{what} {path} does not exist")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise error(f"cannot read {what} {path}: {e.strerror}") from None
    with f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise error(f"{path} line {n} column {e.start + 1}: not UTF-8 text (byte 0x{raw[e.start]:02x}); "
                            f"JSONL files are UTF-8") from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                why = e.msg.removesuffix(" at")  # "Invalid control character at": the position follows
                raise error(f"{path} line {n} column {e.colno}: not valid JSON ({why})") from None
            if not isinstance(obj, dict):
                raise error(f"{path} line {n}: expected a JSON object, got {type(obj).__name__}")
            yield n, obj


def read_jsonl(path: str | Path) -> list[dict]:
    """Conversations of a JSONL file (rows that generation could not run are skipped)."""
    records = [{**obj, "_line": n} for n, obj in iter_jsonl_objects(path, DataError, "data file") if "error" not in obj]
    if not records:
        raise DataError(f"{path} holds no conversations")
    return records


def conversation_tokens(record: dict, tokenizer=None, *, thinking: bool = False) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one conversation."""
    where = f"line {record.get('_line', '?')}"
    if "input_ids" in record:
        ids, mask = list(record["input_ids"]), list(record.get("loss_mask", []))
        if len(mask) != len(ids):
            raise DataError(f"{where}: input_ids and loss_mask differ in length")
        return ids, [int(bool(m)) for m in mask]
    if "messages" in record and tokenizer is not None:
        messages = record["messages"]
        full = encode_chat(tokenizer, messages, generation_prompt=False, enable_thinking=thinking)
        mask = [0] * len(full)
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            # The assistant's tokens are what its turn adds after the generation prompt.
            before = encode_chat(tokenizer, messages[:i], generation_prompt=True, enable_thinking=thinking)
            upto = encode_chat(tokenizer, messages[:i + 1], generation_prompt=False, enable_thinking=thinking)
            if full[:len(upto)] != upto or upto[:len(before)] != before:
                raise DataError(f"{where}: the chat template does not render the conversation incrementally")
            for j in range(len(before), len(upto)):
                mask[j] = 1
        return full, mask
    if "prompt_ids" in record and "response_ids" in record:
        p, r = list(record["prompt_ids"]), list(record["response_ids"])
        return p + r, [0] * len(p) + [1] * len(r)
    raise DataError(f"{where}: needs messages (with a tokenizer), prompt_ids + response_ids, or input_ids + loss_mask")


def fit(ids: list[int], mask: list[int], seq_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """Truncate or right-pad to seq_len; padding carries no loss."""
    ids, mask = ids[:seq_len], mask[:seq_len]
    n = len(ids)
    tokens = np.full((seq_len,), pad_id, np.int32)
    loss_mask = np.zeros((seq_len,), np.int32)
    tokens[:n], loss_mask[:n] = ids, mask
    return {"tokens": tokens, "loss_mask": loss_mask}


def make_dataset(records: list[dict], tokenizer, *, seq_len: int, global_batch: int, seed: int, epochs: int,
                 process_index: int = 0, process_count: int = 1, pad_id: int = 0, thinking: bool = False):
    """grain MapDataset of this process's batches {tokens, loss_mask: [global_batch / P, S]}.

    Process p takes rows p*L..(p+1)*L-1 of every global batch (L = global_batch / P), so the
    global batch, in order, is the same for any number of processes.
    """
    if global_batch % process_count:
        raise DataError(f"global batch {global_batch} is not divisible by {process_count} processes")
    local = global_batch // process_count
    stream = grain.MapDataset.source(records).shuffle(seed=seed).repeat(epochs)
    num_batches = len(stream) // global_batch
    mine = grain.MapDataset.range(num_batches * local).map(
        lambda i: stream[(i // local) * global_batch + process_index * local + i % local])
    mine = mine.map(lambda r: fit(*conversation_tokens(r, tokenizer, thinking=thinking), seq_len, pad_id))
    return mine.batch(local, drop_remainder=True)
