"""Batch generation from JSONL rows: the library path behind `python -m infer` and
`python -m train.generate_data` (and the trainer's data regeneration).

Reads prompts from JSONL (`input_ids`, `prompt`, `messages` or `turns`, optional `id` and
`max_new_tokens`), writes one JSON line per row as rows finish, and ends with a summary (tau,
acceptance histogram, tokens/s; with --compare-baseline the baseline's tokens/s and the
speedup). Rerunning with the same --output skips the ids already written. The CLIs only
parse flags (`add_generation_flags`) and call `run_generation`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_jax.errors import DFlashError

DEMO_DIR = Path(__file__).resolve().parent / "demo"


class InputError(DFlashError):
    pass


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


def add_generation_flags(p: argparse.ArgumentParser):
    """The flags of `python -m infer` (and `train.generate_data`)."""
    p.add_argument("--target", "--model", dest="target", metavar="DIR",
                   help="target model: Hugging Face directory or one written by dflash_jax.convert")
    p.add_argument("--drafter", "--draft-model", dest="drafter", metavar="DIR",
                   help="DFlash drafter (z-lab HF format or converted); without it, plain decoding")
    p.add_argument("--input", metavar="FILE.jsonl", help="prompts, one JSON object per line")
    p.add_argument("--output", metavar="FILE.jsonl",
                   help="results, appended as rows finish; ids already there are skipped (default: stdout)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens to generate per row, and the most a row's own max_new_tokens may ask for "
                        "(default 256; 128 for the demo pair)")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                          "whose probability reaches P (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep only the K most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampling keys (per row and position)")
    p.add_argument("--block-size", type=int, default=None,
                   help="default: the drafter's; 1 = plain autoregressive decoding (the baseline)")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="drafts the target verifies per cycle, 1..B-1 (default B-1, the whole block): the "
                        "drafter still denoises the whole block, the verify runs K+1 tokens; smaller K pays "
                        "where verify tokens cost compute (CPUs, large batches)")
    p.add_argument("--batch-size", type=int, default=8, help="rows decoded together (slots refilled as rows finish)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="parameter dtype (default: the checkpoint's)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the stop tokens")
    p.add_argument("--compare-baseline", action="store_true",
                   help="also time plain decoding of the same prompts and report the speedup")
    p.add_argument("--enable-thinking", action="store_true",
                   help="pass enable_thinking=True to the chat template (Qwen3); off by default")
    p.add_argument("--max-prompt-len", type=int, default=None,
                   help="longest prompt in tokens, which sizes the KV cache (default: the longest in the input, "
                        "rounded up); attention reads only what rows use, so a larger cache costs memory, not time")
    p.add_argument("--kv-pages", type=int, default=None, metavar="N",
                   help="keep K/V in a pool of N pages (of --page-size positions) shared by the rows: each row "
                        "holds the pages of its own prompt and max_new_tokens and returns them when it finishes, "
                        "so the cache is sized by N, not batch x the longest row, and many short rows share what "
                        "one long row would reserve; prompts wait for pages (default: per-row caches)")
    p.add_argument("--page-size", type=int, default=128, help="K/V positions per page (default 128)")
    p.add_argument("--sync-every", type=int, default=8, help="decoding cycles per host sync")
    p.add_argument("--narrow-tail", action="store_true",
                   help="once no prompt waits, move the running rows to narrower loops as they finish "
                        "(6, 4, 3, 2, 1 slots for a batch of 8). Pays where a cycle costs per row (a CPU, "
                        "large batches) and the tail is long against the compiles it adds (one loop per "
                        "width): a run has one tail")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="device mesh: batch rows over `data`, heads/MLP/vocab over `model` "
                        "(default: every device on `data`; one device: no mesh)")
    p.add_argument("--stall-timeout", type=float, default=10.0, metavar="MINUTES",
                   help="end the run with an error (exit status 3) when the device makes no progress for this "
                        "long (compiles excluded); rows finished are kept; 0 = wait forever")
    p.add_argument("--summary-json", metavar="FILE", help="also write the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress messages (the summary stays)")


def add_distributed_flags(p: argparse.ArgumentParser):
    g = p.add_argument_group("multi-host (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    g.add_argument("--num-processes", type=int, help="number of processes")
    g.add_argument("--process-id", type=int, help="this process's index")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-host run using the cluster's auto-detection (TPU pods, SLURM)")



# --------------------------------------------------------------------------- input


@dataclass
class InputRow:
    id: Any
    line: int
    kind: str  # input_ids | prompt | messages | turns
    value: Any
    position: int = 0  # index among the input's rows: keys the row's random stream
    max_new_tokens: int | None = None  # the row's own limit (None: the run's)
    turn_ids: list[list[int]] = field(default_factory=list)  # prompt ids, one per turn so far
    turn_records: list[dict] = field(default_factory=list)  # finished turns of a `turns` row


PROMPT_KEYS = ("input_ids", "prompt", "messages", "turns")
ROW_KEYS = PROMPT_KEYS + ("id", "max_new_tokens")


def read_rows(path: Path, warn=lambda message: None) -> list[InputRow]:
    """The rows of an input JSONL file (named in errors as given). Keys other than ROW_KEYS are
    ignored, each named once through `warn`; a line with no prompt key but an unknown one names
    it (a misspelt `prompt`)."""
    from dflash_jax.data import iter_jsonl_objects

    rows, seen, unknown = [], set(), {}
    for n, obj in iter_jsonl_objects(path, InputError, "input file"):
        where = f"{path} line {n}"
        kinds = [k for k in PROMPT_KEYS if k in obj]
        extra = [k for k in obj if k not in ROW_KEYS]
        if len(kinds) != 1:
            has = f" (has {', '.join(kinds)})" if kinds else ""
            if not kinds and extra:
                has = f" (unknown key{'s' if len(extra) > 1 else ''} {', '.join(map(repr, extra))})"
            raise InputError(f"{where}: needs exactly one of {', '.join(PROMPT_KEYS)}{has}")
        for k in extra:
            unknown.setdefault(k, n)
        kind, value = kinds[0], obj[kinds[0]]
        if kind == "input_ids" and not (isinstance(value, list) and value
                                        and all(isinstance(t, int) and not isinstance(t, bool) for t in value)):
            raise InputError(f"{where}: input_ids must be a non-empty list of integers")
        if kind == "prompt" and not isinstance(value, str):
            raise InputError(f"{where}: prompt must be a string")
        if kind == "messages" and not (isinstance(value, list) and value and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in value)):
            raise InputError(f"{where}: messages must be a non-empty list of {{role, content}} strings")
        if kind == "turns" and not (isinstance(value, list) and value and all(isinstance(t, str) for t in value)):
            raise InputError(f"{where}: turns must be a non-empty list of strings")
        limit = obj.get("max_new_tokens")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
            raise InputError(f"{where}: max_new_tokens must be a positive integer")
        row_id = obj.get("id", n)
        if not isinstance(row_id, (str, int)) or isinstance(row_id, bool):
            raise InputError(f"{where}: id must be a string or an integer")
        if row_id in seen:
            raise InputError(f"{where}: duplicate id {row_id!r}")
        seen.add(row_id)
        rows.append(InputRow(row_id, n, kind, value, position=len(rows), max_new_tokens=limit))
    for k, n in unknown.items():
        warn(f"warning: {path} line {n}: unknown key {k!r} ignored (keys: {', '.join(ROW_KEYS)})")
    return rows


def load_tokenizer(target_dir: Path):
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((target_dir / n).is_file() for n in names):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Without torch (the default install) transformers advises at import that its models are
    # unavailable: only its tokenizers are used here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target_dir))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise InputError(f"cannot load the tokenizer in {target_dir}: {str(e).splitlines()[0]}") from None


def encode_prompt(row: InputRow, tokenizer, messages: list[dict] | None, thinking: bool) -> list[int]:
    """Token ids of a row's (current) prompt."""
    if row.kind == "input_ids":
        return list(row.value)
    if tokenizer is None:
        raise InputError(f"line {row.line}: '{row.kind}' needs a tokenizer, and the target has none")
    if row.kind == "prompt":
        return tokenizer(row.value, add_special_tokens=True)["input_ids"]
    if getattr(tokenizer, "chat_template", None) is None:
        raise InputError(f"line {row.line}: '{row.kind}' needs a chat template, and the tokenizer has none")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                        enable_thinking=thinking)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return list(ids)


def prompt_budget(row: InputRow, tokenizer, args) -> int:
    """Longest prompt this row will need: for `turns`, the last turn's prompt holds every
    earlier answer (at most max_new_tokens each, plus a little for re-tokenising text)."""
    if row.kind != "turns" or len(row.value) == 1:
        return len(row.turn_ids[0])
    conv = []
    for turn in row.value[:-1]:
        conv += [{"role": "user", "content": turn}, {"role": "assistant", "content": ""}]
    conv.append({"role": "user", "content": row.value[-1]})
    return len(encode_prompt(row, tokenizer, conv, args.enable_thinking)) + (len(row.value) - 1) * (args.max_new_tokens + 8)


def stop_token_ids(target_dir: Path, tokenizer) -> list[int]:
    ids: list = []
    for name in ("generation_config.json", "config.json"):
        path = target_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]


# --------------------------------------------------------------------------- output


def completed_ids(path: Path) -> set:
    """Ids already in an output file. A torn last line (an interrupted write) is cut off."""
    if not path.is_file():
        return set()
    data = path.read_bytes()
    keep = data.rfind(b"\n") + 1
    if keep < len(data):
        with open(path, "r+b") as f:
            f.truncate(keep)
    done = set()
    for line in data[:keep].splitlines():
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "id" in obj and "error" not in obj:
            done.add(obj["id"])
    return done


class Writer:
    """Appends JSON lines, flushed one by one. Without a path they go to stdout, as JSON lines
    when redirected and as readable text on a terminal. In a multi-process run only process 0
    writes."""

    def __init__(self, path: Path | None, enabled: bool = True):
        self.file, self.readable = None, False
        if enabled and path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)  # --output may name a new directory
            self.file = open(path, "a", encoding="utf-8")
        elif enabled:
            self.file, self.readable = sys.stdout, sys.stdout.isatty()

    def write(self, record: dict, prompt: str | None = None):
        if self.file is None:
            return
        self.file.write(readable_record(record, prompt) if self.readable
                        else json.dumps(record, ensure_ascii=False) + "\n")
        self.file.flush()

    def close(self):
        if self.file not in (None, sys.stdout):
            self.file.close()


def prompt_text(row: InputRow) -> str | None:
    """The text a row asked about: its prompt, or its last user message."""
    if row.kind == "prompt":
        return row.value
    if row.kind == "turns":
        return row.value[-1] + "\n"
    if row.kind == "messages":
        return row.value[-1]["content"] + "\n"
    return None


def readable_record(record: dict, prompt: str | None) -> str:
    """A row for a person: its id and figures, then the prompt and the completion after >>>."""
    if "error" in record:
        return f"--- {record['id']}: error: {record['error']}\n"
    acc = record.get("acceptance_lengths") or []
    tau = f", tau {sum(acc) / len(acc):.2f}" if acc and max(acc) > 1 else ""
    head = f"--- {record['id']}: {record['num_output_tokens']} tokens ({record['finish_reason']}{tau})"
    body = record.get("text")
    if body is None:
        body = " ".join(map(str, record["output_ids"]))
    return f"{head}\n{prompt or ''}>>>{body}\n\n"


# --------------------------------------------------------------------------- main


def run_generation(args, make_record=None) -> int:
    """The whole job of `python -m infer` (args: its parsed flags, `add_generation_flags`). make_record(row, record, conversation) -> dict, if given, shapes each
    output line (train.generate_data writes conversations with it)."""
    from tqdm import tqdm

    import jax

    from dflash_jax.checkpoint import load_drafter, load_target, read_model_config
    from dflash_jax.drafter import check_pair
    from dflash_jax.sharding import make_mesh
    from dflash_jax.engine import Generator, GenerationStats, Sampling, bucket, timed
    from dflash_jax.engine.watchdog import Watchdog

    if args.target is None and args.drafter is not None:
        raise InputError("--drafter needs --target, the model it drafts for" + trained_against(Path(args.drafter)))
    demo = args.target is None
    target_dir = Path(args.target) if args.target else DEMO_DIR / "target"
    drafter_dir = Path(args.drafter) if args.drafter else (DEMO_DIR / "drafter" if demo else None)
    input_path = Path(args.input) if args.input else (DEMO_DIR / "prompts.jsonl" if demo else None)
    if input_path is None:
        raise InputError("--input is required when --target is given")
    if args.max_new_tokens is None:
        args.max_new_tokens = 128 if demo else 256
    if demo and args.input is None and args.block_size != 1:
        args.compare_baseline = True  # the demo shows the speedup
    check_flags(args)
    if args.draft_tokens is not None and (drafter_dir is None or args.block_size == 1):
        raise InputError("--draft-tokens needs a drafter (it sets how many of the drafter's tokens are verified)")
    sampling = Sampling(args.temperature, args.top_k, args.top_p)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, file=sys.stderr))

    rows = read_rows(input_path, warn=say)
    if not rows:
        raise InputError(f"{input_path} holds no rows (one JSON object per line, each with one of "
                         f"{', '.join(PROMPT_KEYS)})")
    # Checked from the configs alone, before a weight is read or a program compiled.
    tcfg = read_model_config(target_dir, "target", dtype=args.dtype)
    for r in rows:
        bad = [t for t in (r.value if r.kind == "input_ids" else ()) if not 0 <= t < tcfg.vocab_size]
        if bad:
            raise InputError(f"{input_path} line {r.line}: token id {bad[0]} is outside the target's vocabulary "
                             f"(0..{tcfg.vocab_size - 1})")
    if drafter_dir is not None and args.block_size != 1:
        for warning in check_pair(tcfg, read_model_config(drafter_dir, "drafter", dtype=args.dtype)):
            say(f"warning: {warning}")
    over = next((r for r in rows if r.max_new_tokens is not None and r.max_new_tokens > args.max_new_tokens), None)
    if over is not None:
        raise InputError(f"{input_path} line {over.line}: max_new_tokens {over.max_new_tokens} is more than "
                         f"--max-new-tokens {args.max_new_tokens}, which sizes the cache")
    out_path = Path(args.output) if args.output else None
    skip = completed_ids(out_path) if out_path else set()
    todo = [r for r in rows if r.id not in skip]
    if demo:
        say(f"no --target given: running the bundled demo pair ({DEMO_DIR})")
    if skip and not todo:
        # Nothing left: say so even with --quiet (a resumed job's log should show why it did nothing),
        # and load no model.
        if jax.process_index() == 0:
            print(f"{out_path}: all {len(rows)} rows already done, nothing to generate", file=sys.stderr)
        return 0
    if skip:
        say(f"{out_path}: {len(rows) - len(todo)} of {len(rows)} rows already done, skipping them")

    # Every row's first prompt is encoded before a weight is read: a row that cannot be fails fast.
    tokenizer = load_tokenizer(target_dir)
    stops = [] if args.ignore_eos else stop_token_ids(target_dir, tokenizer)

    # Turn 1 of every row (later turns of `turns` rows are encoded as earlier ones finish).
    conversations = {}
    for r in todo:
        if r.kind == "turns":
            conversations[r.id] = [{"role": "user", "content": r.value[0]}]
        elif r.kind == "messages":
            conversations[r.id] = list(r.value)
        r.turn_ids.append(encode_prompt(r, tokenizer, conversations.get(r.id), args.enable_thinking))
    budgets = [prompt_budget(r, tokenizer, args) for r in todo]
    max_prompt = args.max_prompt_len or min(bucket(max(budgets, default=1)), tcfg.max_position_embeddings)

    # The mesh comes first: every tensor is read straight into its shard on it, so no device ever
    # holds the whole model (one larger than a device loads on a mesh). The DFlash and baseline
    # engines share these arrays; their own shard_params is then a no-op.
    mesh = make_mesh(args.mesh) if (args.mesh or jax.device_count() > 1) else None
    tcfg, tparams = load_target(target_dir, dtype=args.dtype, progress=not args.quiet, mesh=mesh)
    dcfg = dparams = None
    if drafter_dir is not None and args.block_size != 1:
        dcfg, dparams = load_drafter(drafter_dir, dtype=args.dtype, progress=not args.quiet, mesh=mesh)
        if args.block_size is not None and args.block_size > dcfg.block_size:
            say(f"warning: --block-size {args.block_size} is larger than the drafter's trained block "
                f"({dcfg.block_size}); drafts past it are guesses it never learned")

    watchdog = Watchdog(args.stall_timeout * 60) if args.stall_timeout > 0 else None

    def engine(block_size):
        drafts = args.draft_tokens if block_size != 1 else None
        return Generator(tcfg, tparams, dcfg, dparams, block_size=block_size, batch_size=args.batch_size,
                         max_new_tokens=args.max_new_tokens, max_prompt_len=max_prompt, sampling=sampling,
                         stop_token_ids=stops, sync_every=args.sync_every, mesh=mesh, draft_tokens=drafts,
                         watchdog=watchdog, kv_pages=args.kv_pages, page_size=args.page_size,
                         narrow_tail=args.narrow_tail)

    gen = engine(args.block_size)
    block_size = gen.spec.block_size
    stats = GenerationStats(block_size)
    writer = Writer(out_path, enabled=jax.process_index() == 0)
    errors = 0
    sample = None  # the demo shows one completion as text
    try:
        drafts = f", {gen.spec.num_drafts} drafts verified" if args.draft_tokens else ""
        say(f"compiling (block size {block_size}{drafts}, batch {args.batch_size}, cache {gen.spec.cache_len}) ...")
        t0 = time.perf_counter()
        gen.warmup([len(r.turn_ids[0]) for r in todo], exact=True)
        say(f"compiled in {time.perf_counter() - t0:.1f}s")
        # Shown in logs too (nohup, CI), where a slower refresh keeps the file small.
        bar = tqdm(total=len(todo), desc="rows", unit="row", disable=args.quiet, file=sys.stderr,
                   mininterval=0.1 if sys.stderr.isatty() else 10.0)
        pending = todo
        turn = 0
        while pending:
            runnable, next_pending = [], []
            for r in pending:
                why = gen.check_prompt(r.turn_ids[turn], row_limit(r, args))
                if why:
                    writer.write({"id": r.id, "error": f"line {r.line}: {why}"})
                    say(f"warning: id {r.id!r} (line {r.line}): {why}")
                    errors += 1
                    bar.update(1)
                else:
                    runnable.append(r)
            by_position = {r.position: r for r in runnable}
            results = gen.generate([r.turn_ids[turn] for r in runnable], indices=[r.position for r in runnable],
                                   seed=args.seed, max_new_tokens=[row_limit(r, args) for r in runnable])
            for res in timed(results, stats):
                r = by_position[res.index]
                record = result_record(res, tokenizer)
                if r.kind == "turns" and turn + 1 < len(r.value):
                    # Multi-turn (z-lab benchmark format): the answer joins the conversation,
                    # the next user turn runs in the next round.
                    r.turn_records.append(record)
                    conversations[r.id] += [{"role": "assistant", "content": record.get("text", "")},
                                            {"role": "user", "content": r.value[turn + 1]}]
                    r.turn_ids.append(encode_prompt(r, tokenizer, conversations[r.id], args.enable_thinking))
                    next_pending.append(r)
                    continue
                if demo and r.kind == "prompt" and "text" in record and (sample is None or r.position < sample[0]):
                    sample = (r.position, r.value, record["text"])  # the first prompt's
                if r.turn_records:
                    record["turns"] = r.turn_records + [dict(record)]
                if make_record is not None:
                    writer.write(make_record(r, record, conversations.get(r.id)))
                else:
                    writer.write({"id": r.id, **record}, prompt_text(r))
                shown = dict(tau=f"{stats.tau:.2f}") if block_size > 1 else {}
                bar.set_postfix(tok_s=f"{stats.tokens_per_second:.1f}", **shown, refresh=False)
                bar.update(1)  # redraws at most every mininterval
            pending, turn = next_pending, turn + 1
        bar.close()
    finally:
        writer.close()

    summary = {"rows": len(todo), "errors": errors, **stats.summary(),
               "draft_tokens": gen.spec.num_drafts}
    if args.compare_baseline:
        say("compiling and timing plain decoding (block size 1) of the same prompts for the speedup ...")
        summary["baseline"] = baseline_summary(engine(1), todo, args)
        base = summary["baseline"]["tokens_per_second"]
        summary["speedup"] = round(stats.tokens_per_second / base, 3) if base else None
        if jax.default_backend() == "cpu" and block_size > 1:
            summary["note"] = cpu_note(gen.spec.verify_len)
    summary["prompts"] = "the demo's prompts" if demo and args.input is None else str(input_path)
    if demo and block_size > 1:
        summary["heldout"] = demo_figures()["heldout"]
    if jax.process_index() != 0:
        return 0
    print_summary(summary, lambda *a: print(*a, file=sys.stderr))
    if sample is not None and not args.quiet:
        print(f"\none completion (prompt, then >>> and the generated text):\n{sample[1]}>>>{sample[2]}", file=sys.stderr)
    if args.summary_json:
        Path(args.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


def trained_against(drafter_dir: Path) -> str:
    """' (trained against TARGET: ...)' for a drafter `python -m train.export` wrote, whose run
    recorded its target; '' otherwise."""
    try:
        run = Path(json.loads((drafter_dir / "dflash_training.json").read_text())["run"])
        target = json.loads((run / "train_config.json").read_text())["target"]
    except (OSError, ValueError, KeyError, TypeError):
        return ""
    return f" (this one was trained against {target}: add --target {target})"


def result_record(res, tokenizer) -> dict:
    record = {"output_ids": res.output_ids}
    if tokenizer is not None:
        record["text"] = tokenizer.decode(res.output_ids, skip_special_tokens=True)
    record.update(acceptance_lengths=res.acceptance_lengths, num_output_tokens=len(res.output_ids),
                  finish_reason=res.finish_reason)
    return record


def demo_figures() -> dict:
    """Measured figures of the bundled pair and of the engine's cost report (demo/figures.json)."""
    return json.loads((DEMO_DIR / "figures.json").read_text())


def cpu_note(verify_len: int) -> str:
    """Why a CPU shows no speedup, and what the cost report projects where a step is memory-bound."""
    cost = demo_figures()["cost_report"]
    return (f"note: a CPU computes every verified token (a {verify_len}-token verify costs several decoding steps), "
            f"so DFlash gains little or nothing here; where a step is memory-bound (GPU/TPU) the cost report "
            f"projects {cost['projected_speedup']:.1f}x for {cost['shapes']} at the paper's tau {cost['tau']} "
            f"(`{cost['command']}`)")


def check_flags(args):
    """Range checks that need no model, so a bad flag fails before anything loads."""
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--sync-every", args.sync_every), ("--block-size", args.block_size),
                        ("--draft-tokens", args.draft_tokens), ("--max-prompt-len", args.max_prompt_len),
                        ("--kv-pages", args.kv_pages), ("--page-size", args.page_size)):
        if value is not None and value < 1:
            raise InputError(f"{flag} must be >= 1, got {value}")
    if not args.stall_timeout >= 0:
        raise InputError(f"--stall-timeout must be >= 0 minutes, got {args.stall_timeout}")


def row_limit(row: InputRow, args) -> int:
    return row.max_new_tokens or args.max_new_tokens


def baseline_summary(gen, rows, args) -> dict:
    """Plain decoding of the same first-turn prompts (with the same limits), timed."""
    from dflash_jax.engine import GenerationStats, timed

    runnable = [r for r in rows if gen.check_prompt(r.turn_ids[0], row_limit(r, args)) is None]
    gen.warmup([len(r.turn_ids[0]) for r in runnable], exact=True)
    stats = GenerationStats(1)
    results = gen.generate([r.turn_ids[0] for r in runnable], indices=list(range(len(runnable))), seed=args.seed,
                           max_new_tokens=[row_limit(r, args) for r in runnable])
    for _ in timed(results, stats):
        pass
    return stats.summary()


def print_summary(s: dict, say):
    say("")
    say(f"rows {s['rows']} (errors {s['errors']}), output tokens {s['output_tokens']}, "
        f"{s['seconds']:.2f}s, {s['tokens_per_second']:.1f} tokens/s")
    if s["block_size"] == 1:  # one token per step: no acceptance to speak of
        say(f"plain autoregressive decoding (block size 1): {s['cycles']} decoding steps")
        return
    drafts = s.get("draft_tokens")
    verified = f" ({drafts} drafts verified per cycle)" if drafts and drafts != s["block_size"] - 1 else ""
    if "heldout" in s:  # the demo pair: the figure to expect first
        h = s["heldout"]
        say(f"this drafter's tau on held-out code ({h['prompts']}, block {h['block_size']}): {h['tau']}, the "
            f"figure to expect on new code (`{h['command']}`)")
    say(f"block size {s['block_size']}{verified}: tau {s['tau']:.3f} (mean tokens per cycle) over {s['cycles']} cycles "
        f"on {s.get('prompts', 'these prompts')}")
    if "heldout" in s and s["tau"] > s["heldout"]["tau"]:
        say("  (above the held-out figure: completions that repeat a line are drafted whole; each row's tau is "
            "in its output)")
    hist = s["acceptance_histogram"]
    if hist:
        total = sum(hist.values())
        say("acceptance length histogram:")
        for k, v in hist.items():
            say(f"  {int(k):3d}: {v:7d} ({100 * v / total:5.1f}%)")
    if "baseline" in s:
        say(f"baseline (block size 1): {s['baseline']['tokens_per_second']:.1f} tokens/s; speedup {s['speedup']}x")
    if "note" in s:
        say(s["note"])


