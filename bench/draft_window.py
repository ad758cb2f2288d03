"""--draft-window N,...: what a draft window (`--draft-window`, the drafter seeing only each row's
last N committed positions) does on long prompts: tau, tokens/s and the drafter's context-cache
bytes with each window and with none (every position), the tokens checked equal.

The prompts are long (--long-prompts LO,HI tokens, default 2048..3000, each length drawn seeded):
the held-out prompts (snippets of --heldout-package) tokenised one by one and joined in a seeded
order per prompt until the length is reached. The target's (and drafter's) max_position_embeddings
is raised in memory to hold them (the bundled demo target's is 1024: past that the text means
nothing to it, but every position costs what it would, as `demo-target-4k` in the serving bench).
Greedy, no stop tokens, each engine warmed up, the timed runs interleaved (median of --repeats).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from bench.suite import describe_pair, heldout_prompts, int_list, pair_record
from bench.workloads import _interleaved, _load


def long_prompts(args, pair, lo: int, hi: int) -> tuple[list[list[int]], str]:
    """args.num_prompts prompts of lo..hi tokens (seeded), each the held-out prompts joined in its
    own seeded order; and the prompts' kind (text, or random ids without a tokenizer)."""
    pool, _, kind = heldout_prompts(args, pair, max(64, args.num_prompts))
    rng = np.random.default_rng(args.seed)
    out = []
    for _ in range(args.num_prompts):
        n, ids = int(rng.integers(lo, hi + 1)), []
        while len(ids) < n:
            for i in rng.permutation(len(pool)):
                ids += pool[i]
        out.append(ids[:n])
    return out, kind


def context_cache(gen):
    """The drafter's context cache of an engine's state, abstract (shapes only)."""
    import jax

    from dflash_jax.engine.step import init_state

    return jax.eval_shape(lambda: init_state(gen.spec, gen.batch_size)).context_cache


def run_draft_window(args) -> dict:
    from dflash_jax.engine import BatchEngine
    from bench.timing import narrow_tail_default

    windows = int_list(args.draft_window, "--draft-window")
    lo, hi = int_list(args.long_prompts, "--long-prompts")[:2]
    if not 1 <= lo <= hi or min(windows) < 1:
        raise SystemExit(f"error: --long-prompts {lo},{hi} must be 1 <= LO <= HI and each --draft-window >= 1")
    pair = _load(args)
    block = pair.drafter.block_size
    top = max(pair.target.max_position_embeddings, hi + args.max_new_tokens + 2 * block)
    target = pair.target.replace(max_position_embeddings=top)
    drafter = dataclasses.replace(pair.drafter, model=pair.drafter.model.replace(max_position_embeddings=top))
    batch = args.batch_size or 8
    print(describe_pair(pair))
    print(f"max_position_embeddings raised in memory to {top}")
    prompts, kind = long_prompts(args, pair, lo, hi)
    lens = [len(p) for p in prompts]
    print(f"prompts: {len(prompts)} of {min(lens)}..{max(lens)} tokens (mean {np.mean(lens):.0f}), held-out "
          f"{args.heldout_package} snippets joined ({kind}); greedy, {args.max_new_tokens} new tokens per row, no stop "
          f"tokens, batch {batch}; median of {args.repeats} interleaved runs\n", flush=True)
    common = dict(batch_size=batch, max_new_tokens=args.max_new_tokens, max_prompt_len=hi, stop_token_ids=(),
                  sync_every=args.sync_every, narrow_tail=narrow_tail_default(args.narrow_tail),
                  page_size=args.page_size, speculation="fixed")
    engines = {w: (BatchEngine(target, pair.tparams, drafter, pair.dparams, draft_window=w, **common), None)
               for w in [None, *windows]}
    res = _interleaved(engines, prompts, args.repeats, args.seed)
    rows, want = {}, res["engines"][None]["outputs"]
    print(f"{'draft window':>14} {'tau':>6} {'tok/s':>8} {'context cache':>14} {'tokens equal':>13}")
    for w, r in res["engines"].items():
        cache = context_cache(engines[w][0])
        row = dict(tau=round(r["tau"], 4), tokens_per_second=round(r["tokens_per_second"], 2),
                   tokens_per_second_runs=[round(x, 2) for x in r["tokens_per_second_runs"]],
                   seconds=round(r["seconds"], 3), output_tokens=r["output_tokens"],
                   context_cache_bytes=int(sum(a.size * a.dtype.itemsize for a in (cache.k, cache.v))),
                   context_cache_shape=list(cache.k.shape), context_ring=cache.ring,
                   equal_to_no_window=sum(a == b for a, b in zip(r["outputs"], want)),
                   compiles_warmup=r["compiles_warmup"])
        rows["none" if w is None else str(w)] = row
        print(f"{'none' if w is None else w:>14} {row['tau']:6.2f} {row['tokens_per_second']:8.1f} "
              f"{row['context_cache_bytes'] / 2**20:11.1f} MiB {row['equal_to_no_window']:>9}/{len(prompts)}")
    return dict(pair=pair_record(pair), max_position_embeddings=top, prompt_tokens=lens, prompts_kind=kind,
                max_new_tokens=args.max_new_tokens, batch_size=batch, repeats=args.repeats,
                max_prompt_len=hi, compiles_timed=res["compiles_timed"], windows=rows)

