"""Speed of DFlash speculative decoding against plain autoregressive decoding of the target.

For each batch size, runs the same random prompts through two `Generator`s: the baseline
(no drafter, block size 1) and DFlash (target + drafter). Each is warmed up (compilation),
then `generate` is timed --repeats times and the median is reported: tokens/s, speedup,
tau (mean acceptance length), the acceptance histogram, the compilations seen at warm-up
and during timing (dflash_jax.engine.TRACE_COUNTS, plus every XLA backend compile),
whether DFlash reproduced the baseline's tokens, and peak memory. Stop tokens are ignored,
so every row generates exactly --max-new-tokens tokens. Prints figures; asserts nothing.

Pairs: --target DIR --drafter DIR (HF or converted directories); with neither, the tiny
fixture pair at ../shared/fixtures/tiny-qwen3-dflash (relative to the repo root) when it
exists; --random builds a random tiny Qwen3 target and random drafter in memory (tiny
random pairs; their tau is close to 1: `python -m infer.bench` measures the trained bundled pair).

    python benchmarks/spec_decode.py                      # fixture pair
    python benchmarks/spec_decode.py --random [--hidden 128 --layers 6 --vocab 1024]
    python benchmarks/spec_decode.py --target DIR --drafter DIR [--dtype bfloat16]
        [--batch-sizes 1,8] [--prompt-len 32] [--num-prompts N] [--max-new-tokens 64]
        [--block-size B] [--temperature T] [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.monitoring
import numpy as np

from dflash_jax import load_drafter, load_target
from dflash_jax.config import ModelConfig
from dflash_jax.drafter import DrafterConfig, default_target_layer_ids, init_drafter_params
from dflash_jax.model import init_params
from dflash_jax.engine import TRACE_COUNTS, GenerationStats, Generator, Sampling, timed

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO.parent / "shared" / "fixtures" / "tiny-qwen3-dflash"

# Every XLA compilation (jitted functions and eager ops alike), next to TRACE_COUNTS,
# which counts only traces of `prefill` and `run_cycles`.
BACKEND_COMPILES = {"n": 0}


def _count_compile(event: str, duration: float, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        BACKEND_COMPILES["n"] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_counts() -> dict[str, int]:
    return {**TRACE_COUNTS, "xla_compiles": BACKEND_COMPILES["n"]}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in after}


# --------------------------------------------------------------------------- pairs


def random_pair(args):
    """A random Qwen3 target and a random drafter, in memory."""
    heads = args.heads
    target = ModelConfig(
        model_type="qwen3", vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
        head_dim=args.hidden // heads, max_position_embeddings=4096, qk_norm=True,
        sliding_windows=(None,) * args.layers, dtype=args.dtype or "float32",
    )
    drafter = DrafterConfig(
        model=target.replace(num_hidden_layers=args.drafter_layers, sliding_windows=(None,) * args.drafter_layers),
        block_size=args.block_size or 8, mask_token_id=args.vocab - 1,
        target_layer_ids=default_target_layer_ids(args.layers, args.drafter_layers),
        num_target_layers=args.layers,
    )
    tparams = init_params(target, jax.random.PRNGKey(args.seed))
    dparams = init_drafter_params(drafter, jax.random.PRNGKey(args.seed + 1))
    name = f"random qwen3 (hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}) + random drafter"
    return name, target, tparams, drafter, dparams


def load_pair(args):
    if args.random:
        return random_pair(args)
    if args.target or args.drafter:
        if not (args.target and args.drafter):
            raise SystemExit("--target and --drafter go together")
        tdir, ddir = Path(args.target), Path(args.drafter)
    elif FIXTURE.is_dir():
        tdir, ddir = FIXTURE / "target", FIXTURE / "drafter"
    else:
        print(f"no fixture pair at {FIXTURE}; using a random pair")
        return random_pair(args)
    target, tparams = load_target(tdir, dtype=args.dtype)
    drafter, dparams = load_drafter(ddir, dtype=args.dtype)
    return f"{tdir} + {ddir}", target, tparams, drafter, dparams


def describe(target: ModelConfig, drafter: DrafterConfig) -> str:
    t, d = target, drafter.model
    return (f"target: {t.model_type}, vocab {t.vocab_size}, hidden {t.hidden_size}, {t.num_hidden_layers} layers, "
            f"{t.num_attention_heads}/{t.num_key_value_heads} heads x {t.head_dim}, {t.dtype}\n"
            f"drafter: {d.num_hidden_layers} layers, block size {drafter.block_size}, "
            f"mask {drafter.mask_token_id}, taps {list(drafter.target_layer_ids)}, {d.dtype}")


# --------------------------------------------------------------------------- measuring


def host_peak_rss() -> int:
    """Peak resident set size of this process so far, bytes (ru_maxrss is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def device_peak_bytes() -> int | None:
    """Peak device memory in use so far (max over local devices); None where not reported (CPU)."""
    peaks = []
    for d in jax.local_devices():
        try:
            stats = d.memory_stats()
        except Exception:  # some backends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) if peaks else None


def bench(gen: Generator, prompts, args) -> dict:
    """Warm up, then time `generate` over all prompts --repeats times."""
    before = compile_counts()
    t = time.perf_counter()
    gen.warmup([len(p) for p in prompts])
    warm = delta(compile_counts(), before)
    # One untimed pass over a single batch runs the exact host path that is timed below;
    # anything it still compiles is something `warmup` missed.
    before = compile_counts()
    for _ in gen.generate(prompts[:gen.batch_size], seed=args.seed):
        pass
    first = delta(compile_counts(), before)
    warm_seconds = time.perf_counter() - t

    before = compile_counts()
    runs, outputs = [], {}
    for _ in range(args.repeats):
        stats = GenerationStats(block_size=gen.spec.block_size)
        outputs = {r.index: r.output_ids for r in timed(gen.generate(prompts, seed=args.seed), stats)}
        runs.append(stats)
    timing = delta(compile_counts(), before)

    tps = [s.tokens_per_second for s in runs]
    median = statistics.median(tps)
    last = runs[-1]  # acceptance is the same every repeat (same prompts, same seed)
    b = gen.spec.block_size
    return dict(
        block_size=b,
        tokens_per_second=median,
        tokens_per_second_runs=tps,
        seconds_runs=[s.seconds for s in runs],
        output_tokens=last.tokens,
        cycles=last.cycles,
        tau=last.tau,
        acceptance_histogram={k: last.histogram.get(k, 0) for k in range(1, b + 1)},
        warmup_seconds=warm_seconds,
        compiles_warmup=warm,
        compiles_first_generate=first,
        compiles_timed=timing,
        host_peak_rss_bytes=host_peak_rss(),
        device_peak_bytes=device_peak_bytes(),
        outputs=[outputs[i] for i in range(len(prompts))],
    )


# --------------------------------------------------------------------------- printing


def fmt_compiles(c: dict[str, int]) -> str:
    return f"{c['prefill']}/{c['run_cycles']}/{c['xla_compiles']}"


def fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def print_table(rows: list[dict]):
    head = (f"{'batch':>5}  {'method':8}  {'block':>5}  {'tok/s (median)':>14}  {'min..max':>17}  {'speedup':>7}  "
            f"{'tau':>5}  {'cycles':>6}  {'compiles warmup()+1st':>21}  {'compiles timed':>14}  {'host RSS':>9}  "
            f"{'device':>9}")
    print(head)
    print("-" * len(head))
    for r in rows:
        tps = r["tokens_per_second_runs"]
        speedup = f"{r['speedup']:.2f}x" if "speedup" in r else ""
        print(f"{r['batch_size']:>5}  {r['method']:8}  {r['block_size']:>5}  {r['tokens_per_second']:>14.1f}  "
              f"{f'{min(tps):.1f}..{max(tps):.1f}':>17}  {speedup:>7}  {r['tau']:>5.2f}  {r['cycles']:>6}  "
              f"{fmt_compiles(r['compiles_warmup']) + ' + ' + fmt_compiles(r['compiles_first_generate']):>21}  "
              f"{fmt_compiles(r['compiles_timed']):>14}  "
              f"{fmt_bytes(r['host_peak_rss_bytes']):>9}  {fmt_bytes(r['device_peak_bytes']):>9}")
    print("compiles: prefill traces / run_cycles traces / all XLA compiles (eager ops included), in "
          "Generator.warmup() + the untimed first generate, and in the timed runs; memory: process peaks so far")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", help="target directory (HF or converted)")
    ap.add_argument("--drafter", help="drafter directory (HF or converted)")
    ap.add_argument("--random", action="store_true", help="a random tiny Qwen3 target and drafter, in memory")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: the checkpoint's (random: float32)")
    ap.add_argument("--hidden", type=int, default=128, help="--random: hidden size")
    ap.add_argument("--layers", type=int, default=6, help="--random: target layers")
    ap.add_argument("--heads", type=int, default=4, help="--random: attention heads (KV heads: half)")
    ap.add_argument("--vocab", type=int, default=1024, help="--random: vocabulary size")
    ap.add_argument("--drafter-layers", type=int, default=2, help="--random: drafter layers")
    ap.add_argument("--block-size", type=int, help="DFlash block size (default: the drafter's; --random: 8)")
    ap.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, help="default: 2 x the largest batch size")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write every figure to this JSON file")
    args = ap.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    num_prompts = args.num_prompts or 2 * max(batch_sizes)

    print(f"jax {jax.__version__}, backend {jax.default_backend()}, devices {jax.devices()}, "
          f"{os.cpu_count()} CPUs, python {platform.python_version()}")
    t = time.perf_counter()
    name, target, tparams, drafter, dparams = load_pair(args)
    print(f"pair: {name} (loaded in {time.perf_counter() - t:.1f}s)")
    print(describe(target, drafter))
    block_size = args.block_size or drafter.block_size

    rng = np.random.default_rng(args.seed)
    prompts = rng.integers(0, target.vocab_size, (num_prompts, args.prompt_len))
    prompts = np.where(prompts == drafter.mask_token_id, (prompts + 1) % target.vocab_size, prompts).tolist()
    sampling = Sampling(temperature=args.temperature)
    print(f"{num_prompts} random prompts of {args.prompt_len} tokens, {args.max_new_tokens} new tokens each "
          f"(stop tokens ignored), {'greedy' if sampling.greedy else f'temperature {args.temperature}'}, "
          f"median of {args.repeats} timed runs\n")

    rows = []
    for batch in batch_sizes:
        common = dict(batch_size=batch, max_new_tokens=args.max_new_tokens, max_prompt_len=args.prompt_len,
                      sampling=sampling)
        base = bench(Generator(target, tparams, block_size=1, **common), prompts, args)
        spec = bench(Generator(target, tparams, drafter, dparams, block_size=block_size, **common), prompts, args)
        spec["speedup"] = spec["tokens_per_second"] / base["tokens_per_second"]
        spec["rows_matching_baseline"] = sum(a == b for a, b in zip(spec["outputs"], base["outputs"]))
        for method, r in (("baseline", base), ("dflash", spec)):
            rows.append(dict(batch_size=batch, method=method, **r))
        print(f"batch {batch}: baseline {base['tokens_per_second']:.1f} tok/s, dflash "
              f"{spec['tokens_per_second']:.1f} tok/s ({spec['speedup']:.2f}x), tau {spec['tau']:.2f}", flush=True)

    print()
    print_table(rows)
    print()
    for r in rows:
        if r["method"] != "dflash":
            continue
        hist = r["acceptance_histogram"]
        total = max(1, sum(hist.values()))
        print(f"batch {r['batch_size']}: acceptance length histogram (length: cycles)  "
              + "  ".join(f"{k}: {v}" for k, v in hist.items()))
        print("         share of cycles  " + "  ".join(f"{k}: {v / total:.0%}" for k, v in hist.items()))
        print(f"         outputs identical to the baseline: {r['rows_matching_baseline']}/{num_prompts} rows")
    by_batch = {r["batch_size"]: r["outputs"] for r in rows if r["method"] == "dflash"}
    first = batch_sizes[0]
    for b in batch_sizes[1:]:
        same = sum(x == y for x, y in zip(by_batch[b], by_batch[first]))
        print(f"dflash outputs at batch {b} identical to batch {first}: {same}/{num_prompts} rows")
    leaked = [r for r in rows if any(r["compiles_timed"].values())]
    leaks = ", ".join(f"batch {r['batch_size']} {r['method']} {r['compiles_timed']}" for r in leaked)
    print(f"recompilations during timed runs: {leaks or 'none'}")
    print(f"host peak RSS {fmt_bytes(host_peak_rss())}; device peak {fmt_bytes(device_peak_bytes())}")

    if args.json:
        out = dict(
            jax_version=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
            pair=name, target=describe(target, drafter).splitlines()[0], drafter=describe(target, drafter).splitlines()[1],
            block_size=block_size, num_prompts=num_prompts, prompt_len=args.prompt_len,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, repeats=args.repeats, seed=args.seed,
            results=[{k: v for k, v in r.items() if k != "outputs"} for r in rows],
        )
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
