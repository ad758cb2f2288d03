"""--published-shapes: a Qwen3-8B-shaped target and a 5-layer block-16 drafter with random
weights built in memory; the engine's pieces of a cycle timed at --context committed tokens."""

from __future__ import annotations

import dataclasses
import time

from dflash_jax.shapes import published_configs

from bench.pairs import describe_published, param_count, random_params
from bench.timing import split_figures, synthetic_state, time_pieces

PAPER_TAU = 6.49  # Qwen3-8B + DFlash (B=16), T=0, average over the paper's benchmarks (DFlash, arXiv 2602.06036)


def run_published_shapes(args) -> dict:
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafter import abstract_drafter_params
    from dflash_jax.engine import EngineSpec, Sampling
    from dflash_jax.model import abstract_params

    dtype = args.dtype or "bfloat16"
    scale = 1.0 if args.scale is None else args.scale
    batch = args.batch_size or 1
    target, drafter = published_configs(scale, dtype, args.shape)
    print(describe_published(target, drafter, scale, dtype) + f", random weights; context {args.context}, "
          f"batch {batch}")
    t0 = time.perf_counter()
    tparams = random_params(abstract_params(target), args.seed)
    dparams = random_params(abstract_drafter_params(drafter), args.seed + 1)
    jax.block_until_ready((tparams, dparams))
    print(f"built {param_count(tparams) / 1e9:.3f}B target + {param_count(dparams) / 1e9:.3f}B drafter parameters "
          f"in {time.perf_counter() - t0:.1f}s")
    b = drafter.block_size
    common = dict(target=target, sampling=Sampling(), max_new_tokens=64, page_size=args.page_size)
    spec = EngineSpec(drafter=drafter, block_size=b, cache_len=args.context + 2 * b, **common)
    base = EngineSpec(drafter=None, block_size=1, cache_len=args.context + 2, **common)
    stop_ids = jnp.full((8,), -1, jnp.int32)
    state = synthetic_state(spec, batch, args.context, args.seed)
    base_state = synthetic_state(base, batch, args.context, args.seed)
    split = time_pieces(tparams, dparams, spec, state, base, base_state, stop_ids, rounds=args.split_rounds,
                        min_round_s=args.split_min_time)
    sec = {k: v["seconds"] for k, v in split.items()}
    ar_step, cyc = sec["ar_verify"], sec["cycle"]
    ratio = cyc / ar_step
    res = dict(
        scale=scale, context=args.context, batch_size=batch, block_size=b, dtype=dtype, page_size=args.page_size,
        target=dataclasses.asdict(target), drafter=dict(
            layers=drafter.model.num_hidden_layers, block_size=b, taps=list(drafter.target_layer_ids),
            mask_token_id=drafter.mask_token_id),
        target_params=param_count(tparams), drafter_params=param_count(dparams),
        ar_step_s=ar_step, baseline_cycle_s=sec["ar_cycle"], **split_figures(sec),
        cost_ratio=ratio, paper_tau=args.paper_tau, projected_speedup=args.paper_tau / ratio,
        projected_speedup_vs_baseline_cycle=args.paper_tau / (cyc / sec["ar_cycle"]),
        iterations={k: v["iterations"] for k, v in split.items()},
    )
    ms = lambda s: f"{1e3 * s:.3f} ms"
    print(f"  AR step (engine.verify of 1 token)       {ms(ar_step)}")
    print(f"  baseline cycle (block 1, whole cycle)    {ms(res['baseline_cycle_s'])}")
    print(f"  verify (engine.verify of {b} tokens)      {ms(res['verify_s'])}")
    print(f"  draft (engine.draft)                     {ms(res['draft_s'])}")
    print(f"  extend (drafter.extend_context)          {ms(res['extend_s'])}")
    print(f"  accept + commit                          {ms(res['commit_s'])}")
    print(f"  draft, verify, extend back to back       {ms(res['passes_s'])}")
    print(f"  full cycle (engine.cycle)                {ms(cyc)}  (bookkeeping {ms(res['bookkeeping_s'])}: "
          f"{res['overhead_beyond_passes_fraction']:.1%} beyond the passes; "
          f"{res['overhead_beyond_pieces_fraction']:.1%} beyond draft + verify + extend timed apart)")
    print(f"  cost ratio cycle / AR step = {ratio:.3f}; projected speedup at the paper's tau {args.paper_tau}: "
          f"{args.paper_tau:.2f} / {ratio:.3f} = {res['projected_speedup']:.2f}x "
          f"({res['projected_speedup_vs_baseline_cycle']:.2f}x against the baseline's whole cycle)")
    return res
