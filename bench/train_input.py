"""Does the training input pipeline keep up with a TPU step, and does each host get its own shard?

Runs `dflash_jax.data.make_dataset` (grain: shuffle, tokenise each conversation with the chat
template and its loss mask, pad/truncate, batch) exactly as `python -m train` iterates it, on
synthetic multi-turn conversations of about `--seq-len` tokens (Python standard-library source as
text), once per simulated host (`--hosts`), and prints:

- sequences/s and tokens/s one host's pipeline produces (one Python thread, as the trainer runs it);
- what one host must feed: `--chips-per-host` chips at the step rate of a `python -m train --aot`
  report (`--aot-json`; its sequences per step and the compiler's seconds per step), and the
  headroom (produced / needed);
- the shard check: over the first batches, the conversations the hosts take are disjoint and
  together are exactly the global batch, in the order one host alone would take them.

Prints figures; asserts nothing but the shard check (exit 1 if it fails).

    python bench/train_input.py --aot-json docs/results/train-aot-v5p-1x1x1-qwen3-8b.json
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def synthetic_conversations(n: int, turns: int, words_per_turn: int) -> list[dict]:
    """n conversations of `turns` user/assistant exchanges, each message about `words_per_turn`
    whitespace-separated pieces of standard-library source (deterministic)."""
    import collections
    import dataclasses
    import json as json_mod
    import typing

    words = " ".join(inspect.getsource(m) for m in (collections, dataclasses, json_mod.decoder, typing)).split()
    out = []
    at = 0
    for i in range(n):
        messages = []
        for _ in range(turns):
            for role in ("user", "assistant"):
                head = f"conversation {i}: " if not messages else ""
                messages.append({"role": role, "content": head + " ".join(words[at:at + words_per_turn])})
                at = (at + words_per_turn) % (len(words) - words_per_turn)
        out.append({"id": i, "messages": messages})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default=str(REPO / "dflash_jax/demo/target"),
                   help="a directory with a tokenizer and chat template (default: the bundled demo target's)")
    p.add_argument("--seq-len", type=int, default=3072)
    p.add_argument("--global-batch", type=int, default=32, help="sequences per step over all hosts")
    p.add_argument("--hosts", type=int, default=4, help="simulated hosts (processes) sharing the global batch")
    p.add_argument("--chips-per-host", type=int, default=4, help="chips one host feeds (v5p: 4)")
    p.add_argument("--batches", type=int, default=16, help="batches each host's pipeline is timed over")
    p.add_argument("--turns", type=int, default=2, help="user/assistant exchanges per conversation")
    p.add_argument("--aot-json", default=None, help="a `python -m train --aot ... --json` report: the step rate "
                   "one host must keep up with")
    p.add_argument("--json", default=None, help="write the figures as JSON")
    args = p.parse_args(argv)

    from transformers import AutoTokenizer

    from dflash_jax.data import make_dataset

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    local = args.global_batch // args.hosts
    if local * args.hosts != args.global_batch:
        raise SystemExit(f"error: --global-batch {args.global_batch} is not divisible by --hosts {args.hosts}")
    # about seq_len tokens per conversation: a piece of source is ~2 tokens
    words = max(8, args.seq_len // (2 * 2 * args.turns))
    records = synthetic_conversations(args.global_batch * (args.batches + 1), args.turns, words)

    def pipeline(host):
        ds = make_dataset(records, tokenizer, seq_len=args.seq_len, global_batch=args.global_batch, seed=0,
                          epochs=1, process_index=host, process_count=args.hosts)
        return iter(ds.to_iter_dataset())

    # the shard check: the hosts' batches, side by side, are one host's global batches
    whole = pipeline_rows(records, tokenizer, args, 0, 1)
    shards = [pipeline_rows(records, tokenizer, args, h, args.hosts) for h in range(args.hosts)]
    joined = [[row for h in range(args.hosts) for row in shards[h][b]] for b in range(len(whole))]
    shards_ok = joined == whole and all(
        len({r for h in range(args.hosts) for r in shards[h][b]}) == args.global_batch for b in range(len(whole)))

    # timed from the iterator's creation: grain prefetches on threads, so a warm-up batch would
    # leave the next ones already made
    start = time.perf_counter()
    it = pipeline(0)
    tokens = 0
    for _ in range(args.batches):
        tokens += int(next(it)["loss_mask"].size)
    elapsed = time.perf_counter() - start
    seqs = args.batches * local / elapsed
    fig = dict(tokenizer=args.tokenizer, seq_len=args.seq_len, global_batch=args.global_batch, hosts=args.hosts,
               turns=args.turns, sequences_per_second_per_host=seqs, tokens_per_second_per_host=tokens / elapsed,
               shards_disjoint_and_complete=shards_ok)
    print(f"input pipeline, one host ({local} of {args.global_batch} sequences per step, {args.seq_len} tokens, "
          f"{args.turns}-exchange conversations): {seqs:,.1f} sequences/s, {tokens / elapsed:,.0f} tokens/s")
    if args.aot_json:
        r = json.loads(Path(args.aot_json).read_text())
        step = r["step"]["seconds"]
        need = r["batch"] / step * args.chips_per_host  # sequences/s one host's chips consume
        fig |= dict(aot_json=args.aot_json, step_seconds=step, needed_sequences_per_second_per_host=need,
                    headroom=seqs / need)
        print(f"needed by {args.chips_per_host} {r['chip']} chips at {step * 1e3:.0f} ms per {r['batch']}-sequence "
              f"step: {need:.1f} sequences/s per host; headroom {seqs / need:.1f}x")
    print(f"shards: {args.hosts} hosts take disjoint rows that together are the global batch, in order: "
          f"{'yes' if shards_ok else 'NO'}")
    if args.json:
        Path(args.json).write_text(json.dumps(fig, indent=2) + "\n")
    return 0 if shards_ok else 1


def pipeline_rows(records, tokenizer, args, host: int, hosts: int) -> list[list[tuple]]:
    """The first tokens of each row of a host's first two batches: which conversations it took
    (each synthetic conversation opens with its number)."""
    from dflash_jax.data import make_dataset

    ds = make_dataset(records, tokenizer, seq_len=args.seq_len, global_batch=args.global_batch, seed=0, epochs=1,
                      process_index=host, process_count=hosts)
    out = []
    for b in range(2):
        batch = ds[b]
        out.append([tuple(row[:64].tolist()) for row in batch["tokens"]])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
