"""Three workload measurements (figures only; nothing is asserted):

--cache-scaling: does a large allocated cache slow decoding? The same prompts through plain
decoding and DFlash with the BatchEngine's max_prompt_len small (default 128) and large (default
8192; the target's max_position_embeddings raised in memory to allow it); tokens/s of each and
the slowdown large / small (the paged attention reads only the pages rows use, and a BatchEngine
allocates and zeroes its caches once, not per generate call: goal <= 1.15x).

--mixed-workload: does continuous batching keep slots busy when rows want different lengths?
48 held-out prompts with per-row max_new_tokens drawn (seeded) from 8..256, against the same rows
all asking for the mean length (the same tokens in all); tokens/s ratio mixed / uniform for
plain decoding and DFlash (goal >= 0.85), and the slot occupancy (row cycles / (loop cycles x
batch)) of each run.

--page-pool: how many rows run at once in the same K/V memory, per-slot caches against a page
pool? The mixed-workload prompts, each cut to a length drawn (seeded, log-uniform: most rows short,
a few long, as served traffic is) from 16..--max-prompt-tokens, with per-row max_new_tokens drawn
log-uniform from --mixed-range. Per-slot caches: --batch-size slots, each
holding max_prompt_len (--max-prompt-tokens) + max_new + 2 blocks. The pool: the same K/V
memory as pages (`--kv-pages` = that memory / --page-size) shared by --pool-slots slots (default
4 x the batch), each row holding the pages of its own length. Concurrent rows: rows running per
loop cycle while prompts wait for room (the steady state; goal: the pool >= 2x per-slot), and
over the whole run (row cycles / loop cycles, the final drain included); the tokens identical,
tokens/s of each.

All run greedy with no stop tokens, each engine warmed up first, the configurations' timed runs
interleaved round by round (a change in machine load hits each alike), median of --repeats.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys

import numpy as np

from bench.pairs import directory_pair
from bench.prompts import describe_prompts
from bench.suite import describe_pair, heldout_prompts, int_list, pair_record
from bench.timing import compile_counts, counted_generate, delta, narrow_tail_default, time_generate


def _load(args):
    from dflash_jax.errors import DFlashError

    try:
        return directory_pair(args.target, args.drafter, args.dtype or "float32")
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


def _interleaved(engines: dict, prompts, repeats: int, seed: int) -> dict:
    """engines: name -> (BatchEngine, max_new_tokens per row or None). Warm each up (BatchEngine.warmup
    and one counted, untimed generate), then `repeats` rounds of one timed generate of each.
    Returns name -> figures."""
    out, warmed = {}, set()
    for name, (gen, limits) in engines.items():
        before = compile_counts()
        if id(gen) not in warmed:
            gen.warmup([len(p) for p in prompts], exact=True)  # these very prompts (the counted run compiles the rest)
            warmed.add(id(gen))
        calls = []
        results, loop_cycles, admissions = counted_generate(gen, prompts, seed, limits, calls)
        row_cycles = sum(r.cycles for r in results.values())
        waiting = [(busy, n) for busy, n, until_free, _ in calls if until_free]
        slot_cycles = sum(n * width for _, n, _, width in calls)
        waiting_cycles = sum(n for _, n in waiting)
        tokens = sum(len(r.output_ids) for r in results.values())
        out[name] = dict(loop_cycles=loop_cycles, row_cycles=row_cycles, admissions=len(admissions),
                         tokens_per_loop_cycle=tokens / loop_cycles if loop_cycles else 0.0,
                         slot_cycles=slot_cycles, slot_occupancy=row_cycles / slot_cycles if slot_cycles else 0.0,
                         concurrent_rows=row_cycles / loop_cycles if loop_cycles else 0.0,
                         concurrent_rows_while_waiting=(sum(b * n for b, n in waiting) / waiting_cycles
                                                        if waiting_cycles else None),
                         loop_cycles_while_waiting=waiting_cycles,
                         compiles_warmup=delta(compile_counts(), before), runs=[],
                         outputs=[results[i].output_ids for i in range(len(prompts))])
    before = compile_counts()
    for _ in range(repeats):
        for name, (gen, limits) in engines.items():
            stats, _ = time_generate(gen, prompts, 1, seed, limits)
            out[name]["runs"].append(stats[0])
    timed_compiles = delta(compile_counts(), before)
    for r in out.values():
        runs = r.pop("runs")
        seconds = statistics.median(s.seconds for s in runs)
        tokens = runs[-1].tokens
        r.update(tokens_per_second=tokens / seconds, tokens_per_second_runs=[s.tokens_per_second for s in runs],
                 seconds=seconds, output_tokens=tokens, tau=runs[-1].tau)
    return dict(engines=out, compiles_timed=timed_compiles)


def run_cache_scaling(args) -> dict:
    from dflash_jax.engine import BatchEngine

    pair = _load(args)
    small, large = int_list(args.cache_prompt_lens, "--cache-prompt-lens")[:2]
    top = max(pair.target.max_position_embeddings, 16384, large + args.max_new_tokens + 2 * pair.drafter.block_size)
    target = pair.target.replace(max_position_embeddings=top)
    drafter = dataclasses.replace(pair.drafter, model=pair.drafter.model.replace(max_position_embeddings=top))
    batch = args.batch_size or 8
    print(describe_pair(pair))
    print(f"target max_position_embeddings raised in memory to {top}")
    prompts, snippets, kind = heldout_prompts(args, pair)
    longest = max(len(p) for p in prompts)
    if longest > min(small, large):
        raise SystemExit(f"error: --cache-prompt-lens {small},{large}: the longest prompt has {longest} tokens, more "
                         f"than a max_prompt_len of {min(small, large)} holds; give both at least {longest}")
    print(describe_prompts(prompts, snippets, kind, args.heldout_package, args.prompt_lines))
    print(f"greedy, {args.max_new_tokens} new tokens per row, no stop tokens, batch {batch}; BatchEngine "
          f"max_prompt_len {small} vs {large}; median of {args.repeats} interleaved runs\n", flush=True)
    engines = {}
    for mpl in (small, large):
        common = dict(batch_size=batch, max_new_tokens=args.max_new_tokens, max_prompt_len=mpl, stop_token_ids=(),
                      sync_every=args.sync_every, narrow_tail=narrow_tail_default(args.narrow_tail), speculation="fixed")
        engines[("plain", mpl)] = (BatchEngine(target, pair.tparams, block_size=1, **common), None)
        engines[("dflash", mpl)] = (BatchEngine(target, pair.tparams, drafter, pair.dparams, **common), None)
    res = _interleaved(engines, prompts, args.repeats, args.seed)
    figs = res["engines"]
    rows = []
    for method in ("plain", "dflash"):
        a, b = figs[(method, small)], figs[(method, large)]
        gen_a, gen_b = engines[(method, small)][0], engines[(method, large)][0]
        slowdown = a["tokens_per_second"] / b["tokens_per_second"]
        rows.append(dict(method=method, small=dict(max_prompt_len=small, cache_len=gen_a.spec.cache_len, **a),
                         large=dict(max_prompt_len=large, cache_len=gen_b.spec.cache_len, **b), slowdown=slowdown,
                         same_outputs=a["outputs"] == b["outputs"]))
        print(f"{method:7} max_prompt_len {small} (cache {gen_a.spec.cache_len}): {a['tokens_per_second']:.1f} tok/s; "
              f"{large} (cache {gen_b.spec.cache_len}): {b['tokens_per_second']:.1f} tok/s; slowdown "
              f"{slowdown:.3f}x (goal <= 1.15x); same tokens: {a['outputs'] == b['outputs']}")
    for r in rows:
        for k in ("small", "large"):
            r[k].pop("outputs")
    return dict(pair=pair_record(pair), max_position_embeddings=top, batch_size=batch,
                max_new_tokens=args.max_new_tokens, prompts=dict(kind=kind, lengths=[len(p) for p in prompts]),
                repeats=args.repeats, rows=rows, compiles_timed=res["compiles_timed"])


def run_mixed_workload(args) -> dict:
    from dflash_jax.engine import BatchEngine

    pair = _load(args)
    batch = args.batch_size or 8
    lo, hi = int_list(args.mixed_range, "--mixed-range")[:2]
    print(describe_pair(pair))
    prompts, snippets, kind = heldout_prompts(args, pair, num=args.mixed_prompts)
    print(describe_prompts(prompts, snippets, kind, args.heldout_package, args.prompt_lines))
    limits = np.random.default_rng(args.seed).integers(lo, hi + 1, size=len(prompts)).tolist()
    mean = round(statistics.mean(limits))
    uniform = [mean] * len(prompts)
    print(f"greedy, no stop tokens, batch {batch}; mixed: per-row max_new_tokens {min(limits)}..{max(limits)} "
          f"(seeded, drawn from {lo}..{hi}; {sum(limits)} tokens); uniform: every row {mean} "
          f"({sum(uniform)} tokens); median of {args.repeats} interleaved runs\n", flush=True)
    common = dict(batch_size=batch, max_new_tokens=hi, max_prompt_len=max(len(p) for p in prompts), stop_token_ids=(),
                  sync_every=args.sync_every, narrow_tail=narrow_tail_default(args.narrow_tail), speculation="fixed")
    plain = BatchEngine(pair.target, pair.tparams, block_size=1, **common)
    dflash = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, **common)
    engines = {("plain", "mixed"): (plain, limits), ("plain", "uniform"): (plain, uniform),
               ("dflash", "mixed"): (dflash, limits), ("dflash", "uniform"): (dflash, uniform)}
    res = _interleaved(engines, prompts, args.repeats, args.seed)
    figs = res["engines"]
    rows = []
    for method in ("plain", "dflash"):
        m, u = figs[(method, "mixed")], figs[(method, "uniform")]
        ratio = m["tokens_per_second"] / u["tokens_per_second"]
        per_cycle = m["tokens_per_loop_cycle"] / u["tokens_per_loop_cycle"]
        m.pop("outputs"), u.pop("outputs")
        rows.append(dict(method=method, mixed=m, uniform=u, ratio=ratio, tokens_per_loop_cycle_ratio=per_cycle))
        print(f"{method:7} mixed {m['tokens_per_second']:.1f} tok/s (slot occupancy {m['slot_occupancy']:.1%}, "
              f"{m['loop_cycles']} loop cycles, {m['admissions']} admissions), uniform {u['tokens_per_second']:.1f} "
              f"tok/s (occupancy {u['slot_occupancy']:.1%}, {u['loop_cycles']} loop cycles, {u['admissions']} "
              f"admissions); mixed / uniform {ratio:.3f} (goal >= 0.85); tokens per loop cycle, mixed / uniform "
              f"{per_cycle:.3f} (the machine-independent part)")
    return dict(pair=pair_record(pair), batch_size=batch, max_new_tokens_range=[lo, hi], limits=limits,
                uniform_limit=mean, prompts=dict(kind=kind, lengths=[len(p) for p in prompts]), repeats=args.repeats,
                rows=rows, compiles_timed=res["compiles_timed"])


def run_page_pool(args) -> dict:
    import jax

    from dflash_jax.kv import cache_length
    from dflash_jax.engine import BatchEngine

    pair = _load(args)
    batch = args.batch_size or 8
    slots = args.pool_slots or 4 * batch
    lo, hi = int_list(args.mixed_range, "--mixed-range")[:2]
    print(describe_pair(pair))
    prompts, snippets, kind = heldout_prompts(args, pair, num=args.mixed_prompts)
    rng = np.random.default_rng(args.seed)
    cap = args.max_prompt_tokens
    log_uniform = lambda a, b: np.exp(rng.uniform(np.log(a), np.log(b + 1), size=len(prompts))).astype(int)  # noqa: E731
    prompts = [p[:n] for p, n in zip(prompts, log_uniform(min(16, cap), cap).tolist())]
    print(describe_prompts(prompts, snippets, kind, args.heldout_package, args.prompt_lines))
    limits = np.clip(log_uniform(lo, hi), lo, hi).tolist()
    common = dict(max_new_tokens=hi, max_prompt_len=cap, stop_token_ids=(), sync_every=args.sync_every,
                  page_size=args.page_size, narrow_tail=narrow_tail_default(args.narrow_tail), speculation="fixed")
    per_slot = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, batch_size=batch, **common)
    positions = batch * cache_length(per_slot.spec.cache_len, args.page_size)  # the per-slot K/V memory
    pages = positions // args.page_size
    pool = BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, batch_size=slots, kv_pages=pages,
                     **common)
    kv_bytes = {name: sum(x.size * x.dtype.itemsize for c in (s.target_cache, s.context_cache) for x in (c.k, c.v))
                for name, s in (("per_slot", jax.eval_shape(per_slot.new_state)), ("pool", jax.eval_shape(pool.new_state)))}
    print(f"greedy, no stop tokens; prompts {min(map(len, prompts))}..{max(map(len, prompts))} tokens (cap {cap}), "
          f"max_new_tokens {min(limits)}..{max(limits)} (log-uniform in {lo}..{hi}); per-slot: {batch} slots of "
          f"{per_slot.spec.cache_len} positions; pool: {pages} pages of {args.page_size} positions for {slots} slots; "
          f"K/V bytes {kv_bytes['per_slot']} vs {kv_bytes['pool']}; median of {args.repeats} interleaved runs\n",
          flush=True)
    res = _interleaved({"per_slot": (per_slot, limits), "pool": (pool, limits)}, prompts, args.repeats, args.seed)
    figs = res["engines"]
    same = figs["per_slot"].pop("outputs") == figs["pool"].pop("outputs")
    ratio = lambda key: (figs["pool"][key] / figs["per_slot"][key]  # noqa: E731
                         if figs["pool"][key] and figs["per_slot"][key] else None)
    gain, steady, speed = ratio("concurrent_rows_while_waiting"), ratio("concurrent_rows"), ratio("tokens_per_second")
    for name, f in figs.items():
        w = f["concurrent_rows_while_waiting"]
        print(f"{name:9} {w or 0:.2f} concurrent rows while prompts wait ({f['loop_cycles_while_waiting']} loop "
              f"cycles), {f['concurrent_rows']:.2f} over the whole run ({f['row_cycles']} row cycles in "
              f"{f['loop_cycles']} loop cycles, the drain included), {f['tokens_per_second']:.1f} tok/s, "
              f"tau {f['tau']:.2f}")
    print(f"pool / per-slot in the same K/V memory: {gain or 0:.2f}x the concurrent rows while prompts wait (goal "
          f">= 2x), {steady or 0:.2f}x over the whole run; {speed or 0:.2f}x the tokens/s on this machine; same "
          f"tokens: {same}")
    return dict(pair=pair_record(pair), per_slot_batch=batch, pool_slots=slots, kv_pages=pages,
                page_size=args.page_size, kv_bytes=kv_bytes, max_prompt_len=cap, max_new_tokens_range=[lo, hi],
                limits=limits, prompts=dict(kind=kind, lengths=[len(p) for p in prompts]), repeats=args.repeats,
                engines=figs, concurrency_gain=gain, concurrency_gain_whole_run=steady, tokens_per_second_ratio=speed,
                same_outputs=same,
                compiles_timed=res["compiles_timed"])
