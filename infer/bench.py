"""`python -m infer.bench`: the benchmark suite of DFlash speculative decoding.

Prints figures, writes them to JSON (and a PNG plot when matplotlib is importable); it never
asserts a timing. On one device (no mesh), greedy, stop tokens ignored so every row generates
exactly --max-new-tokens tokens.

1. Pair: --target DIR --drafter DIR (HF or converted), default the bundled demo pair.
2. Held-out prompts: snippets (the first lines of functions and classes) cut, seeded, from the
   source of an installed package the target never trained on (--heldout-package, default
   numpy; tests directories skipped). With a tokenizer they are tokenised as raw text (code
   continuation, no chat template); without one, seeded random token ids of a similar length
   stand in for them (the output says so).
3. For every batch size and block size: tau, the acceptance histogram, the per-slot acceptance
   rate P(a >= k) (k = 1..B-1), DFlash tokens/s next to the baseline's (the same engine with no
   drafter, block size 1), greedy losslessness (DFlash outputs == baseline outputs), and the
   compilations seen during the timed runs (TRACE_COUNTS deltas; should be 0). Each engine is
   warmed up (Generator.warmup + one untimed generate) and `generate` is timed --repeats times
   (median).
4. Time split of one cycle: separately jitted pieces on a state from prefill, each run n times
   in a lax.fori_loop on the device (as the engine's cycles run in a while_loop; no per-call
   dispatch), median of interleaved rounds: draft (the drafter's work in a cycle: the verified
   block's taps join its context, drafter.extend_context, then spec_decode.draft_block), verify
   (model.forward of the block with taps + the greedy pick), the two passes back to back in one
   loop body as a cycle runs them (`passes`), the full `cycle` (accept/commit = cycle - passes),
   one autoregressive step (forward of 1 token, no taps) and the baseline's whole cycle.
   cost_ratio = cycle / AR step, speedup_check = tau / cost_ratio (next to the measured
   speedup), the overhead beyond the two passes as a fraction of the cycle (also against draft
   + verify timed apart, which is lower where the two models' weights do not share a cache), and
   the host overhead per cycle = (generate wall time - prefill time) / loop cycles - device
   cycle time.
5. The same target under Hugging Face transformers `generate` (PyTorch, CPU), same prompts,
   left-padded batches (--no-transformers skips it; HF target directories only).
6. --published-shapes: a Qwen3-8B-shaped target and a 5-layer block-16 drafter with random
   bfloat16 weights built in memory; times an AR step, a verify pass, a draft pass and a full
   cycle at --context tokens, and projects the speedup at the paper's tau (6.49). --scale F
   shrinks layers and widths (head_dim kept) so it runs on a CPU.

    python -m infer.bench                                   # bundled demo pair
    python -m infer.bench --target DIR --drafter DIR [--dtype bfloat16] [--block-sizes 4,8,16]
        [--batch-sizes 1,8] [--num-prompts 16] [--max-new-tokens 128] [--repeats 3]
        [--heldout-package numpy] [--no-transformers] [--json runs/bench/bench.json] [--plot FILE]
    python -m infer.bench --published-shapes [--scale 0.05] [--context 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Callable, Sequence

PAPER_TAU = 6.49  # Qwen3-8B + DFlash (B=16), T=0, average over the paper's benchmarks (SPEC section 4)
DEFAULT_JSON = Path("runs/bench/bench.json")
SKIP_DIRS = {"tests", "test", "__pycache__"}
DEF_LINE = re.compile(r"^\s*(?:async\s+def|def|class)\s+\w")


# --------------------------------------------------------------------------- held-out prompts


def package_root(package: str) -> Path:
    """The source directory of an installed package (its first search location)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise SystemExit(f"error: package {package!r} is not installed (--heldout-package)")
    locations = list(spec.submodule_search_locations or [])
    if not locations:  # a plain module: its one file
        if not spec.origin:
            raise SystemExit(f"error: package {package!r} has no source files")
        return Path(spec.origin)
    return Path(locations[0])


def package_files(package: str) -> list[Path]:
    """The package's .py files, sorted, tests directories skipped."""
    root = package_root(package)
    if root.is_file():
        return [root]
    return sorted(f for f in root.rglob("*.py") if not SKIP_DIRS & set(f.relative_to(root).parts[:-1]))


def heldout_snippets(package: str = "numpy", num: int = 16, seed: int = 0, lines: int = 6) -> list[dict]:
    """`num` code snippets from the package's source: the first `lines` lines (dedented) of a
    function or class. Files are visited in a seeded order, one snippet per file, so the result
    depends only on (package source, num, seed, lines)."""
    files = package_files(package)
    root = package_root(package)
    base = root.parent
    rng = random.Random(seed)
    order = list(range(len(files)))
    rng.shuffle(order)
    snippets = []
    for fi in order:
        if len(snippets) >= num:
            break
        try:
            text = files[fi].read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        src = text.splitlines()
        starts = [i for i, line in enumerate(src) if DEF_LINE.match(line)]
        if not starts:
            continue
        i = rng.choice(starts)
        snippet = textwrap.dedent("\n".join(src[i:i + lines])).rstrip() + "\n"
        if len(snippet.strip()) < 20:
            continue
        snippets.append(dict(file=str(files[fi].relative_to(base)), line=i + 1, text=snippet))
    if not snippets:
        raise SystemExit(f"error: no function or class found in the source of {package!r}")
    return snippets


def prompt_ids(snippets: list[dict], tokenizer, vocab_size: int, avoid: Sequence[int], max_tokens: int,
               seed: int) -> tuple[list[list[int]], str]:
    """Token ids of the snippets: tokenised raw text, or (no tokenizer) seeded random ids of a
    similar length (about 4 characters per token), avoiding the `avoid` ids (the mask token)."""
    if tokenizer is not None:
        ids = [list(tokenizer(s["text"], add_special_tokens=True)["input_ids"])[:max_tokens] for s in snippets]
        return ids, "text"
    import numpy as np

    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(avoid), np.int64))
    out = []
    for s in snippets:
        n = int(min(max_tokens, max(4, round(len(s["text"]) / 4))))
        out.append(rng.choice(allowed, size=n).astype(int).tolist())
    return out, "random_token_ids"


# --------------------------------------------------------------------------- compile counting


_XLA_COMPILES = {"n": 0, "registered": False}


def _count_compile(event: str, duration: float, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _XLA_COMPILES["n"] += 1


def compile_counts() -> dict[str, int]:
    import jax.monitoring

    from dflash_jax.spec_decode import TRACE_COUNTS

    if not _XLA_COMPILES["registered"]:
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _XLA_COMPILES["registered"] = True
    return {**TRACE_COUNTS, "xla_compiles": _XLA_COMPILES["n"]}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


# --------------------------------------------------------------------------- acceptance figures


def acceptance_figures(acceptance_lengths: list[list[int]], block_size: int) -> dict:
    """tau, histogram (lengths 1..L, L the longest possible: the block size, or K + 1 with K
    drafts verified), per-slot rate P(a >= k) = share of cycles with length > k."""
    flat = [a for row in acceptance_lengths for a in row]
    n = len(flat)
    hist = {k: 0 for k in range(1, block_size + 1)}
    for a in flat:
        hist[a] = hist.get(a, 0) + 1
    per_slot = [sum(1 for a in flat if a > k) / n if n else 0.0 for k in range(1, block_size)]
    return dict(tau=sum(flat) / n if n else 0.0, cycles=n, acceptance_histogram={str(k): v for k, v in hist.items()},
                per_slot_acceptance=per_slot)


def config_label(r: dict) -> str:
    """A row's block size, with the drafts verified per cycle when fewer than the block's:
    "16", or "16:7" (block 16, 7 drafts verified)."""
    b, k = r["block_size"], r.get("draft_tokens")
    return str(b) if not k or k == b - 1 else f"{b}:{k}"


def loop_cycles(acceptance_lengths: list[list[int]], batch_size: int) -> int:
    """Cycles the engine ran: per batch of rows (prompts in order), its longest row's cycles."""
    total = 0
    for start in range(0, len(acceptance_lengths), batch_size):
        total += max(len(r) for r in acceptance_lengths[start:start + batch_size])
    return total


# --------------------------------------------------------------------------- timing engines


def bench_generator(gen, prompts, repeats: int, seed: int) -> dict:
    """Warm up (Generator.warmup + one untimed generate), then time `generate` over all prompts
    `repeats` times; median tokens/s."""
    from dflash_jax.spec_decode import GenerationStats, timed

    before = compile_counts()
    t = time.perf_counter()
    gen.warmup([len(p) for p in prompts])
    for _ in gen.generate(prompts[:gen.batch_size], seed=seed):
        pass
    warm = delta(compile_counts(), before)
    warm_seconds = time.perf_counter() - t

    before = compile_counts()
    runs, results = [], {}
    for _ in range(repeats):
        stats = GenerationStats(block_size=gen.spec.block_size)
        results = {r.index: r for r in timed(gen.generate(prompts, seed=seed), stats)}
        runs.append(stats)
    timed_compiles = delta(compile_counts(), before)
    ordered = [results[i] for i in range(len(prompts))]
    seconds = statistics.median(s.seconds for s in runs)
    tokens = runs[-1].tokens
    acc = [r.acceptance_lengths for r in ordered]
    return dict(
        batch_size=gen.batch_size, block_size=gen.spec.block_size, draft_tokens=gen.spec.num_drafts,
        tokens_per_second=tokens / seconds if seconds else 0.0,
        tokens_per_second_runs=[s.tokens_per_second for s in runs],
        seconds=seconds, seconds_runs=[s.seconds for s in runs], output_tokens=tokens,
        loop_cycles=loop_cycles(acc, gen.batch_size),
        warmup_seconds=warm_seconds, compiles_warmup=warm, compiles_timed=timed_compiles,
        outputs=[r.output_ids for r in ordered], acceptance_lengths=acc,
    )


# --------------------------------------------------------------------------- timing pieces


def _jitted_pieces():
    """The pieces of a cycle, each jitted on its own and run n times in a `lax.fori_loop` on the
    device (as the engine runs its cycles inside a while_loop), so one call times n pieces with no
    per-call dispatch in them. Every iteration feeds its output into the next (nothing can be
    hoisted out of the loop); pieces that write a cache take it donated and rewind its lengths
    every iteration, so they run on the same state again and again without the cache filling up."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafter import extend_context
    from dflash_jax.model import forward
    from dflash_jax.spec_decode import cycle, draft_block

    def drafter_pass(tparams, dparams, spec, anchor, ctx, taps):
        """The drafter's work in a cycle: the verified block's taps join its context
        (extend_context: fc + each layer's context K/V, a block's worth), then the block is
        denoised (draft_block). Returns (drafts, context), the context's lengths rewound."""
        new_ctx = extend_context(dparams, spec.drafter, taps, ctx, jnp.ones_like(ctx.lengths))
        return draft_block(tparams, dparams, spec, anchor, new_ctx), new_ctx.replace(lengths=ctx.lengths)

    def target_pass(tparams, spec, block, cache):
        """The verify: the target on the block (with the drafter's taps, if any) and the greedy pick.
        Returns (y, tap features, cache), the cache's lengths rewound."""
        out = forward(tparams, spec.target, block, cache, taps=spec.taps)
        return (jnp.argmax(out.logits, axis=-1).astype(jnp.int32), out.tap_features,
                out.cache.replace(lengths=cache.lengths))

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("anchor", "context_cache"))
    def draft(tparams, dparams, spec, anchor, context_cache, tap_features, n):
        """n drafter passes; every pass's drafts feed the next pass's anchor."""
        def body(_, carry):
            drafts, ctx = drafter_pass(tparams, dparams, spec, *carry, tap_features)
            return drafts.sum(axis=1) % spec.target.vocab_size, ctx

        return jax.lax.fori_loop(0, n, body, (anchor, context_cache))

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("block", "cache"))
    def verify(tparams, spec, block, cache, n):
        """n verify passes; each pass's greedy pick y is the next pass's block."""
        def body(_, carry):
            y, _taps, c = target_pass(tparams, spec, *carry)
            return y, c

        return jax.lax.fori_loop(0, n, body, (block, cache))

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("anchor", "context_cache", "cache"))
    def passes(tparams, dparams, spec, anchor, context_cache, cache, tap_features, n):
        """n pairs of the two model passes back to back, as a cycle runs them (the drafter pass,
        then the verify of [anchor, drafts]) with none of the accept/commit logic: what a cycle
        costs beyond this is the engine's own work. Each verify's taps feed the next draft."""
        def body(_, carry):
            a, ctx, c, taps = carry
            drafts, ctx = drafter_pass(tparams, dparams, spec, a, ctx, taps)
            y, taps, c = target_pass(tparams, spec, jnp.concatenate([a[:, None], drafts], axis=1), c)
            return y[:, -1], ctx, c, taps

        return jax.lax.fori_loop(0, n, body, (anchor, context_cache, cache, tap_features))

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
    def cycles(tparams, dparams, spec, state, stop_ids, n):
        """n whole cycles (spec_decode.cycle), each rewound to the state's lengths and counters."""
        def body(_, s):
            new = cycle(tparams, dparams, spec, s, stop_ids)
            ctx = None if new.context_cache is None else new.context_cache.replace(lengths=s.context_cache.lengths)
            return new.replace(target_cache=new.target_cache.replace(lengths=s.target_cache.lengths),
                               context_cache=ctx, num_generated=s.num_generated, num_cycles=s.num_cycles,
                               done=s.done, stopped=s.stopped)

        return jax.lax.fori_loop(0, n, body, state)

    @functools.partial(jax.jit, static_argnames=("spec",))
    def taps_once(tparams, spec, block, cache):
        return forward(tparams, spec.target, block, cache, taps=spec.taps, return_logits=False).tap_features

    return draft, verify, passes, cycles, jax.jit(draft_block, static_argnames=("spec",)), taps_once


_PIECES = None


def pieces():
    global _PIECES
    if _PIECES is None:
        _PIECES = _jitted_pieces()
    return _PIECES


def time_calls(calls: dict[str, tuple[Callable[[int], None], Callable[[], object]]], rounds: int,
               min_round_s: float) -> dict:
    """Median seconds per iteration of each named (call, sync) pair; call(n) runs n iterations on
    the device, sync() is what to block_until_ready on. Each call runs once to compile, then gets
    n, calibrated so a call lasts >= min_round_s; then `rounds` timed calls each, the pieces
    interleaved (a change in machine load hits every piece alike)."""
    import jax

    def timed_call(call, sync, n):
        t = time.perf_counter()
        call(n)
        jax.block_until_ready(sync())
        return time.perf_counter() - t

    counts = {}
    for name, (call, sync) in calls.items():
        timed_call(call, sync, 1)
        n = 1
        while True:
            dt = timed_call(call, sync, n)
            if dt >= min_round_s or n >= 1 << 16:
                break
            n = min(1 << 16, max(2 * n, math.ceil(n * 1.2 * min_round_s / max(dt, 1e-9))))
        counts[name] = n
    times = {name: [] for name in calls}
    for _ in range(rounds):
        for name, (call, sync) in calls.items():
            times[name].append(timed_call(call, sync, counts[name]) / counts[name])
    return {name: dict(seconds=statistics.median(times[name]), iterations=counts[name], rounds=rounds)
            for name in calls}


def _copy(tree):
    import jax
    import jax.numpy as jnp

    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def piece_calls(tparams, dparams, spec, state, stop_ids) -> dict:
    """(call, sync) of the pieces of a cycle of `spec` on `state` (a DecodeState, not consumed):
    draft (with a drafter), verify (the target on the block: [anchor, drafts] with taps, or the
    anchor alone for block size 1, i.e. one autoregressive step), passes (draft then verify in one
    loop body, as a cycle runs them, with a drafter) and the whole cycle."""
    import jax.numpy as jnp

    draft, verify, passes, cycles, draft_once, taps_once = pieces()
    calls, carry = {}, {}
    if spec.uses_drafter:
        drafts = draft_once(tparams, dparams, spec, state.anchor, state.context_cache)
        block = jnp.concatenate([state.anchor[:, None], drafts], axis=1)
        taps = taps_once(tparams, spec, block, state.target_cache)
        carry["draft"] = (_copy(state.anchor), _copy(state.context_cache))
        carry["passes"] = (_copy(state.anchor), _copy(state.context_cache), _copy(state.target_cache), taps)

        def draft_call(n):
            carry["draft"] = draft(tparams, dparams, spec, *carry["draft"], taps, n)

        def passes_call(n):
            carry["passes"] = passes(tparams, dparams, spec, *carry["passes"], n)

        calls["draft"] = (draft_call, lambda: carry["draft"])
        calls["passes"] = (passes_call, lambda: carry["passes"])
    else:
        block = jnp.array(state.anchor[:, None], copy=True)
    carry["verify"] = (block, _copy(state.target_cache))
    carry["state"] = _copy(state)

    def verify_call(n):
        carry["verify"] = verify(tparams, spec, *carry["verify"], n)

    def cycle_call(n):
        carry["state"] = cycles(tparams, dparams, spec, carry["state"], stop_ids, n)

    calls["verify"] = (verify_call, lambda: carry["verify"])
    calls["cycle"] = (cycle_call, lambda: carry["state"])
    return calls


def time_pieces(tparams, dparams, spec, state, base_spec, base_state, stop_ids, *, rounds: int,
                min_round_s: float) -> dict:
    """Seconds of draft, verify and cycle of `spec` on `state` and, interleaved with them, of the
    AR step (`ar_verify`: forward of 1 token, no taps) and the whole cycle (`ar_cycle`) of the
    baseline `base_spec` on `base_state`. spec None: the baseline's pieces alone."""
    calls = {}
    if spec is not None:
        calls.update(piece_calls(tparams, dparams, spec, state, stop_ids))
    calls.update({f"ar_{k}": v for k, v in piece_calls(tparams, None, base_spec, base_state, stop_ids).items()})
    return time_calls(calls, rounds, min_round_s)


def split_figures(sec: dict) -> dict:
    """Seconds of the timed pieces (time_pieces' draft, verify, passes, cycle) -> the time split:
    accept/commit = cycle - passes, its share of the cycle, the same against draft + verify timed
    apart, and passes_interference_s (what running the two passes together adds)."""
    cyc, dr, ve, both = sec["cycle"], sec["draft"], sec["verify"], sec["passes"]
    return dict(draft_s=dr, verify_s=ve, passes_s=both, cycle_s=cyc, accept_commit_s=cyc - both,
                overhead_beyond_passes_fraction=(cyc - both) / cyc, passes_interference_s=both - dr - ve,
                overhead_beyond_draft_verify_fraction=(cyc - dr - ve) / cyc)


def time_prefill(gen, prompts, seed: int, rounds: int) -> float:
    """Seconds of prefill (host input building included) of all batches of `prompts`, median."""
    import jax

    chunks = [prompts[i:i + gen.batch_size] for i in range(0, len(prompts), gen.batch_size)]
    times = []
    for _ in range(max(1, rounds)):
        t = time.perf_counter()
        for start, chunk in zip(range(0, len(prompts), gen.batch_size), chunks):
            jax.block_until_ready(gen.prefill(chunk, list(range(start, start + len(chunk))), seed))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def first_state(gen, prompts, seed: int):
    """The DecodeState right after prefill of the first batch of prompts (as `generate` makes it)."""
    chunk = prompts[:gen.batch_size]
    return gen.prefill(chunk, list(range(len(chunk))), seed)


# --------------------------------------------------------------------------- transformers


def bench_transformers(target_dir: Path, dtype: str, prompts, batch_sizes, max_new_tokens: int, repeats: int,
                       reference_outputs, threads: int | None) -> dict:
    """The target under Hugging Face transformers `generate` (PyTorch, CPU), greedy, exactly
    max_new_tokens per row (stop tokens off), left-padded batches."""
    try:
        import torch
        import transformers
    except ImportError as e:
        return dict(skipped=f"torch/transformers not importable ({e})")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if threads:
        torch.set_num_threads(threads)
    transformers.utils.logging.disable_progress_bar()
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    t = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch_dtype).eval()
    load_seconds = time.perf_counter() - t
    cfg = model.config
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    gen_cfg = transformers.GenerationConfig(
        do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, eos_token_id=None,
        pad_token_id=pad, bos_token_id=cfg.bos_token_id,
    )
    model.generation_config = gen_cfg  # no stop tokens: every row gets exactly max_new_tokens

    def run(batch_prompts):
        width = max(len(p) for p in batch_prompts)
        ids = torch.full((len(batch_prompts), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch_prompts), width), dtype=torch.long)
        for i, p in enumerate(batch_prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, generation_config=gen_cfg)
        return [row[width:].tolist() for row in out]

    rows = []
    for batch in batch_sizes:
        run(prompts[:batch])  # warm-up
        secs, outputs = [], []
        for _ in range(repeats):
            outputs = []
            t = time.perf_counter()
            for s in range(0, len(prompts), batch):
                outputs += run(prompts[s:s + batch])
            secs.append(time.perf_counter() - t)
        tokens = sum(len(o) for o in outputs)
        seconds = statistics.median(secs)
        rows.append(dict(
            batch_size=batch, tokens_per_second=tokens / seconds, tokens_per_second_runs=[tokens / s for s in secs],
            seconds=seconds, output_tokens=tokens,
            rows_matching_baseline=sum(a == b for a, b in zip(outputs, reference_outputs)),
            outputs=outputs,
        ))
    return dict(torch_version=torch.__version__, transformers_version=transformers.__version__,
                torch_threads=torch.get_num_threads(), dtype=dtype, load_seconds=load_seconds, rows=rows)


# --------------------------------------------------------------------------- published shapes


def published_configs(scale: float = 1.0, dtype: str = "bfloat16"):
    """Qwen3-8B target and z-lab Qwen3-8B-DFlash-b16 drafter shapes (SPEC section 2), scaled:
    layers, heads and widths times `scale` (head_dim 128 kept; at least 1 head, 2 target layers,
    1 drafter layer; widths rounded to multiples of 128)."""
    from dflash_jax.config import ModelConfig, RopeConfig
    from dflash_jax.drafter import DrafterConfig, default_target_layer_ids

    head_dim = 128
    heads = max(1, round(32 * scale))
    kv = max(1, min(heads, round(8 * scale)))
    while heads % kv:
        kv -= 1
    mult = lambda n: max(128, round(n * scale / 128) * 128)
    layers, dlayers = max(2, round(36 * scale)), max(1, round(5 * scale))
    vocab = mult(151936)
    target = ModelConfig(
        model_type="qwen3", vocab_size=vocab, hidden_size=heads * head_dim, intermediate_size=mult(12288),
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
        rms_norm_eps=1e-6, rope=RopeConfig(theta=1e6), max_position_embeddings=40960, qk_norm=True,
        sliding_windows=(None,) * layers, dtype=dtype,
    )
    drafter = DrafterConfig(
        model=target.replace(num_hidden_layers=dlayers, sliding_windows=(None,) * dlayers),
        block_size=16, mask_token_id=min(151669, vocab - 1),
        target_layer_ids=default_target_layer_ids(layers, dlayers), num_target_layers=layers,
    )
    return target, drafter


def random_params(abstract, seed: int):
    """Random parameters with the shapes/dtypes of `abstract`: normal * 0.02, norms 1. One small
    jitted generator per leaf (never the full init)."""
    import jax
    import jax.numpy as jnp

    @functools.partial(jax.jit, static_argnums=(1, 2))
    def normal(key, shape, dtype):
        return (jax.random.normal(key, shape, dtype) * 0.02).astype(dtype)

    key = jax.random.PRNGKey(seed)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    out = []
    for i, (path, leaf) in enumerate(leaves):
        name = "/".join(str(getattr(p, "key", p)) for p in path)
        if "norm" in name:
            out.append(jnp.ones(leaf.shape, leaf.dtype))
        else:
            out.append(normal(jax.random.fold_in(key, i), tuple(leaf.shape), jnp.dtype(leaf.dtype)))
    return jax.tree_util.tree_unflatten(treedef, out)


def synthetic_state(spec, batch: int, context: int, seed: int):
    """A DecodeState with `context` committed positions in both caches (contents zero)."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafter import init_context_cache
    from dflash_jax.model import init_cache
    from dflash_jax.spec_decode import DecodeState

    lengths = jnp.full((batch,), context, jnp.int32)
    target_cache = init_cache(spec.target, batch, spec.cache_len).replace(lengths=lengths)
    ctx = None
    if spec.uses_drafter:
        ctx = init_context_cache(spec.drafter, batch, spec.cache_len).replace(lengths=lengths)
    return DecodeState(
        target_cache=target_cache, context_cache=ctx, anchor=jnp.ones((batch,), jnp.int32),
        output=jnp.zeros((batch, spec.out_len), jnp.int32), num_generated=jnp.ones((batch,), jnp.int32),
        acceptance=jnp.zeros((batch, spec.max_new_tokens + 1), jnp.int32),
        num_cycles=jnp.zeros((batch,), jnp.int32), done=jnp.zeros((batch,), bool),
        stopped=jnp.zeros((batch,), bool),
        row_keys=jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(seed), jnp.arange(batch)),
    )


def run_published_shapes(args) -> dict:
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafter import abstract_drafter_params
    from dflash_jax.model import abstract_params
    from dflash_jax.spec_decode import EngineSpec, Sampling

    dtype = args.dtype or "bfloat16"
    target, drafter = published_configs(args.scale, dtype)
    t, d = target, drafter.model
    print(f"published shapes x {args.scale:g}: target qwen3 hidden {t.hidden_size}, {t.num_hidden_layers} layers, "
          f"{t.num_attention_heads}/{t.num_key_value_heads} heads x {t.head_dim}, intermediate "
          f"{t.intermediate_size}, vocab {t.vocab_size}; drafter {d.num_hidden_layers} layers, block "
          f"{drafter.block_size}, taps {list(drafter.target_layer_ids)}; random {dtype} weights; "
          f"context {args.context}, batch 1")
    t0 = time.perf_counter()
    tparams = random_params(abstract_params(target), args.seed)
    dparams = random_params(abstract_drafter_params(drafter), args.seed + 1)
    jax.block_until_ready((tparams, dparams))
    count = lambda p: sum(x.size for x in jax.tree.leaves(p))
    print(f"built {count(tparams) / 1e9:.3f}B target + {count(dparams) / 1e9:.3f}B drafter parameters "
          f"in {time.perf_counter() - t0:.1f}s")
    b = drafter.block_size
    max_new = 64
    spec = EngineSpec(target=target, drafter=drafter, block_size=b, sampling=Sampling(), max_new_tokens=max_new,
                      cache_len=args.context + 2 * b)
    base = EngineSpec(target=target, drafter=None, block_size=1, sampling=Sampling(), max_new_tokens=max_new,
                      cache_len=args.context + 2)
    stop_ids = jnp.full((8,), -1, jnp.int32)
    state = synthetic_state(spec, 1, args.context, args.seed)
    base_state = synthetic_state(base, 1, args.context, args.seed)
    split = time_pieces(tparams, dparams, spec, state, base, base_state, stop_ids, rounds=args.split_rounds,
                        min_round_s=args.split_min_time)
    ar_step, cyc = split["ar_verify"]["seconds"], split["cycle"]["seconds"]
    ratio = cyc / ar_step
    res = dict(
        scale=args.scale, context=args.context, batch_size=1, block_size=b, dtype=dtype,
        target=dataclasses.asdict(target), drafter=dict(
            layers=d.num_hidden_layers, block_size=b, taps=list(drafter.target_layer_ids),
            mask_token_id=drafter.mask_token_id),
        target_params=count(tparams), drafter_params=count(dparams),
        ar_step_s=ar_step, baseline_cycle_s=split["ar_cycle"]["seconds"],
        **split_figures({k: v["seconds"] for k, v in split.items()}),
        cost_ratio=ratio, paper_tau=args.paper_tau, projected_speedup=args.paper_tau / ratio,
        projected_speedup_vs_baseline_cycle=args.paper_tau / (cyc / split["ar_cycle"]["seconds"]),
        iterations={k: v["iterations"] for k, v in split.items()},
    )
    ms = lambda s: f"{1e3 * s:.3f} ms"
    print(f"  AR step (forward of 1 token)           {ms(ar_step)}")
    print(f"  baseline cycle (block 1, whole cycle)  {ms(res['baseline_cycle_s'])}")
    print(f"  verify (forward of {b} tokens + taps)   {ms(res['verify_s'])}")
    print(f"  draft (drafter + LM head)              {ms(res['draft_s'])}")
    print(f"  draft + verify back to back            {ms(res['passes_s'])}")
    print(f"  full cycle                             {ms(cyc)}  (accept/commit {ms(res['accept_commit_s'])}: "
          f"{res['accept_commit_s'] / cyc:.1%} beyond the two passes; "
          f"{res['overhead_beyond_draft_verify_fraction']:.1%} beyond draft + verify timed apart)")
    print(f"  cost ratio cycle / AR step = {ratio:.3f}; projected speedup at the paper's tau {args.paper_tau}: "
          f"{args.paper_tau:.2f} / {ratio:.3f} = {res['projected_speedup']:.2f}x "
          f"({res['projected_speedup_vs_baseline_cycle']:.2f}x against the baseline's whole cycle)")
    return res


# --------------------------------------------------------------------------- plot


def write_plot(result: dict, path: Path) -> str | None:
    """tokens/s per block size and batch (DFlash vs baseline vs transformers) and tau per block
    size; rows verifying K < B - 1 drafts are a second series at K + 1 tokens verified. Returns
    why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    rows = result.get("dflash") or []
    if not rows:
        return "nothing to plot"
    blocks = sorted({r["draft_tokens"] + 1 for r in rows})  # tokens verified per cycle
    batches = sorted({r["batch_size"] for r in rows})
    hf = {r["batch_size"]: r["tokens_per_second"] for r in (result.get("transformers") or {}).get("rows", [])}
    base = {r["batch_size"]: r["tokens_per_second"] for r in result.get("baseline", [])}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, batch in enumerate(batches):
        c = colors[i % len(colors)]
        mine = [r for r in rows if r["batch_size"] == batch]
        whole = [r for r in mine if r["draft_tokens"] == r["block_size"] - 1]
        pts = sorted((r["block_size"], r["tokens_per_second"], r["tau"]) for r in whole)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c, label=f"DFlash, batch {batch}")
        cut = sorted((r["draft_tokens"] + 1, r["tokens_per_second"], r["tau"], r["block_size"])
                     for r in mine if r not in whole)
        if cut:
            label = f"DFlash block {cut[0][3]}, K drafts verified, batch {batch}"
            ax1.plot([p[0] for p in cut], [p[1] for p in cut], "s--", color=c, mfc="none", label=label)
            ax2.plot([p[0] for p in cut], [p[2] for p in cut], "s--", color=c, mfc="none", label=label)
        if batch in base:
            ax1.axhline(base[batch], color=c, ls="--", lw=1, label=f"baseline (JAX AR), batch {batch}")
        if batch in hf:
            ax1.axhline(hf[batch], color=c, ls=":", lw=1, label=f"transformers, batch {batch}")
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=c, label=f"batch {batch}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks, [str(b) for b in blocks])
        ax.set_xlabel("tokens verified per cycle (block size B, or K + 1)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("output tokens/s")
    ax1.set_yscale("log")
    ax1.legend(fontsize=7)
    ax2.set_ylabel("tau (mean acceptance length)")
    ax2.legend(fontsize=7)
    env = result["env"]
    fig.suptitle(f"{result['pair']['name']}  |  {env['backend']} {env['devices'][0]}  |  "
                 f"{result['settings']['max_new_tokens']} new tokens, greedy", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- printing


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.3f}"


def print_tables(result: dict):
    base = {r["batch_size"]: r for r in result["baseline"]}
    hf = {r["batch_size"]: r for r in (result.get("transformers") or {}).get("rows", [])}
    head = (f"{'batch':>5}  {'method':12}  {'block':>5}  {'tok/s':>9}  {'min..max':>17}  {'speedup':>7}  {'tau':>5}  "
            f"{'cycles':>6}  {'loop cyc':>8}  {'== baseline':>11}  {'compiles timed':>14}")
    print(head)
    print("-" * len(head))
    for batch in result["settings"]["batch_sizes"]:
        b = base[batch]
        runs = b["tokens_per_second_runs"]
        print(f"{batch:>5}  {'baseline':12}  {1:>5}  {b['tokens_per_second']:>9.1f}  "
              f"{f'{min(runs):.1f}..{max(runs):.1f}':>17}  {'1.00x':>7}  {1.0:>5.2f}  {b['loop_cycles']:>6}  "
              f"{b['loop_cycles']:>8}  {'-':>11}  {fmt_compiles(b['compiles_timed']):>14}")
        for r in result["dflash"]:
            if r["batch_size"] != batch:
                continue
            runs = r["tokens_per_second_runs"]
            same = f"{r['rows_matching_baseline']}/{len(r['outputs'])}"
            print(f"{batch:>5}  {'dflash':12}  {config_label(r):>5}  {r['tokens_per_second']:>9.1f}  "
                  f"{f'{min(runs):.1f}..{max(runs):.1f}':>17}  {r['speedup']:>6.2f}x  {r['tau']:>5.2f}  "
                  f"{r['cycles']:>6}  {r['loop_cycles']:>8}  {same:>11}  {fmt_compiles(r['compiles_timed']):>14}")
        if batch in hf:
            h = hf[batch]
            runs = h["tokens_per_second_runs"]
            same = f"{h['rows_matching_baseline']}/{len(h['outputs'])}"
            print(f"{batch:>5}  {'transformers':12}  {'-':>5}  {h['tokens_per_second']:>9.1f}  "
                  f"{f'{min(runs):.1f}..{max(runs):.1f}':>17}  "
                  f"{h['tokens_per_second'] / b['tokens_per_second']:>6.2f}x  {'-':>5}  {'-':>6}  {'-':>8}  "
                  f"{same:>11}  {'-':>14}")
    print("block B:K = the drafter denoises blocks of B, the target verifies only the first K drafts of each; "
          "speedup: against the baseline (this engine, no drafter) at the same batch size; compiles: prefill "
          "traces / run_cycles traces / all XLA compiles during the timed runs (should be 0/0/0); "
          "== baseline: rows whose tokens equal the baseline's")

    print("\nacceptance (length a+1 of each cycle; per-slot rate of slot k = P(a >= k), the share of cycles "
          "accepting draft k):")
    for r in result["dflash"]:
        hist = r["acceptance_histogram"]
        total = max(1, sum(hist.values()))
        print(f"  batch {r['batch_size']} block {config_label(r):>4}: tau {r['tau']:.3f} over {r['cycles']} cycles")
        print("    histogram  " + "  ".join(f"{k}:{v}({v / total:.0%})" for k, v in hist.items()))
        print("    per slot   " + "  ".join(f"{k}:{p:.2f}" for k, p in enumerate(r["per_slot_acceptance"], 1)))

    splits = [r for r in result["dflash"] if r.get("time_split")]
    if splits:
        print("\ntime split of one cycle (ms; each piece jitted alone and run in a loop on the device, on a "
              "state from prefill; median):")
        head = (f"{'batch':>5}  {'block':>5}  {'draft':>8}  {'verify':>8}  {'d;v':>8}  {'acc+commit':>10}  "
                f"{'cycle':>8}  {'beyond d;v':>10}  {'beyond d+v':>10}  {'AR step':>8}  {'AR cycle':>8}  "
                f"{'cost ratio':>10}  {'tau/cost':>8}  {'measured':>8}  {'host/cycle':>10}")
        print(head)
        print("-" * len(head))
        for batch in result["settings"]["batch_sizes"]:
            bs = base[batch].get("time_split")
            if bs:
                print(f"{batch:>5}  {'base':>5}  {'-':>8}  {fmt_ms(bs['ar_step_s']):>8}  {'-':>8}  {'-':>10}  "
                      f"{fmt_ms(bs['cycle_s']):>8}  {'-':>10}  {'-':>10}  {fmt_ms(bs['ar_step_s']):>8}  "
                      f"{fmt_ms(bs['cycle_s']):>8}  "
                      f"{'-':>10}  {'-':>8}  {'-':>8}  {fmt_ms(bs['host_overhead_per_cycle_s']):>10}")
            for r in splits:
                if r["batch_size"] != batch:
                    continue
                s = r["time_split"]
                print(f"{batch:>5}  {config_label(r):>5}  {fmt_ms(s['draft_s']):>8}  {fmt_ms(s['verify_s']):>8}  "
                      f"{fmt_ms(s['passes_s']):>8}  {fmt_ms(s['accept_commit_s']):>10}  {fmt_ms(s['cycle_s']):>8}  "
                      f"{s['overhead_beyond_passes_fraction']:>10.1%}  "
                      f"{s['overhead_beyond_draft_verify_fraction']:>10.1%}  {fmt_ms(s['ar_step_s']):>8}  "
                      f"{fmt_ms(s['baseline_cycle_s']):>8}  {s['cost_ratio']:>10.3f}  {s['speedup_check']:>7.2f}x  "
                      f"{s['measured_speedup']:>7.2f}x  {fmt_ms(s['host_overhead_per_cycle_s']):>10}")
        print("d;v = draft then verify back to back in one loop body, as a cycle runs them; acc+commit = cycle - "
              "d;v; beyond d;v = that share of the cycle; beyond d+v = (cycle - draft - verify) / cycle with the "
              "two passes timed apart (each alone keeps its weights in cache); AR step = target forward "
              "of 1 token (no taps); AR cycle = the baseline's whole cycle; cost ratio = cycle / AR step; "
              "tau/cost = tau / cost ratio (the speedup the pieces predict); host/cycle = (generate wall time - "
              "prefill) / loop cycles - cycle (noise can make small figures negative); base: the baseline engine "
              "(block size 1)")


def fmt_compiles(c: dict[str, int]) -> str:
    return f"{c.get('prefill', 0)}/{c.get('run_cycles', 0)}/{c.get('xla_compiles', 0)}"


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", metavar="DIR", help="target directory, HF or converted (default: the bundled demo pair)")
    p.add_argument("--drafter", metavar="DIR", help="drafter directory, HF or converted")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="default: the checkpoint's (published: bfloat16)")
    p.add_argument("--heldout-package", default="numpy", help="installed package whose source gives the prompts")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-lines", type=int, default=6, help="lines per snippet")
    p.add_argument("--max-prompt-tokens", type=int, default=128, help="prompts are cut to this many tokens")
    p.add_argument("--block-sizes", default="4,8,16", help="comma-separated DFlash block sizes")
    p.add_argument("--draft-tokens", default="3,5,7", metavar="K,...",
                   help="also run the drafter's own block size verifying only its first K drafts per cycle "
                        "(Generator draft_tokens), for each K; '' for none")
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="timed runs of each configuration (median)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sync-every", type=int, default=8, help="cycles per host sync (Generator)")
    p.add_argument("--no-split", action="store_true", help="skip the time split of a cycle")
    p.add_argument("--split-rounds", type=int, default=7, help="time split: rounds per piece (median)")
    p.add_argument("--split-min-time", type=float, default=0.05, help="time split: seconds per round at least")
    p.add_argument("--no-transformers", action="store_true", help="skip the Hugging Face transformers comparison")
    p.add_argument("--hf-batch-sizes", default=None, help="transformers batch sizes (default: --batch-sizes)")
    p.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--published-shapes", action="store_true",
                   help="time a Qwen3-8B-shaped target + 5-layer drafter with random weights, nothing else")
    p.add_argument("--scale", type=float, default=1.0, help="--published-shapes: shrink layers and widths")
    p.add_argument("--context", type=int, default=1024, help="--published-shapes: committed context length")
    p.add_argument("--paper-tau", type=float, default=PAPER_TAU, help="--published-shapes: tau to project with")
    p.add_argument("--json", default=str(DEFAULT_JSON), metavar="PATH", help=f"figures as JSON (default {DEFAULT_JSON})")
    p.add_argument("--plot", default=None, metavar="PATH", help="PNG plot (default: bench.png next to the JSON)")
    return p


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"error: {flag} must be positive integers, got {text!r}")
    return values


def shown(path: Path) -> str:
    """A path as results files record it: relative to the working directory when inside it."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def env_info() -> dict:
    import jax

    info = dict(jax_version=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                device_kind=jax.devices()[0].device_kind, python=platform.python_version(), cpus=os.cpu_count(),
                argv=["python -m infer.bench", *sys.argv[1:]])  # no path of this machine
    print(f"jax {info['jax_version']}, backend {info['backend']}, devices {jax.devices()}, "
          f"{info['cpus']} CPUs, python {info['python']}")
    return info


def write_outputs(result: dict, args) -> None:
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    if "published_shapes" not in result:
        plot = Path(args.plot) if args.plot else path.parent / "bench.png"
        why = write_plot(result, plot)
        result["plot"] = None if why else str(plot)
        print(f"plot: not drawn ({why})" if why else f"wrote {plot}")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("num_prompts", "max_new_tokens", "repeats", "prompt_lines", "max_prompt_tokens", "split_rounds"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Dd]onat.*")  # backends that cannot donate still work
        return run(args)


def run(args) -> int:
    result = dict(env=env_info())
    if args.published_shapes:
        result["published_shapes"] = run_published_shapes(args)
        write_outputs(result, args)
        return 0

    from dflash_jax.checkpoint import is_converted, load_drafter, load_target
    from dflash_jax.errors import DFlashError
    from dflash_jax.spec_decode import Generator, Sampling

    from infer.cli import DEMO_DIR, load_tokenizer

    block_sizes = [b for b in int_list(args.block_sizes, "--block-sizes") if b > 1]
    draft_tokens = int_list(args.draft_tokens, "--draft-tokens") if args.draft_tokens.strip() else []
    batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
    hf_batches = int_list(args.hf_batch_sizes, "--hf-batch-sizes") if args.hf_batch_sizes else batch_sizes
    if (args.target is None) != (args.drafter is None):
        raise SystemExit("error: --target and --drafter go together")
    demo = args.target is None
    target_dir = Path(args.target) if args.target else DEMO_DIR / "target"
    drafter_dir = Path(args.drafter) if args.drafter else DEMO_DIR / "drafter"
    try:
        t = time.perf_counter()
        tcfg, tparams = load_target(target_dir, dtype=args.dtype)
        dcfg, dparams = load_drafter(drafter_dir, dtype=args.dtype)
        load_seconds = time.perf_counter() - t
        tokenizer = load_tokenizer(target_dir)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    d = dcfg.model
    bad = [k for k in draft_tokens if not 1 <= k <= dcfg.block_size - 1]
    if bad:
        raise SystemExit(f"error: --draft-tokens {bad[0]} is outside 1..{dcfg.block_size - 1} (the drafter's "
                         f"block size is {dcfg.block_size})")
    # (block size, drafts verified per cycle): every block size with its whole block, then the
    # drafter's own block size with fewer drafts verified
    configs = [(b, None) for b in block_sizes] + [(dcfg.block_size, k) for k in draft_tokens
                                                   if k != dcfg.block_size - 1 or dcfg.block_size not in block_sizes]
    name = "bundled demo pair" if demo else f"{target_dir.name} + {drafter_dir.name}"
    print(f"pair: {name} ({target_dir} + {drafter_dir}; loaded in {load_seconds:.1f}s)")
    print(f"  target: {tcfg.model_type}, vocab {tcfg.vocab_size}, hidden {tcfg.hidden_size}, "
          f"{tcfg.num_hidden_layers} layers, {tcfg.num_attention_heads}/{tcfg.num_key_value_heads} heads x "
          f"{tcfg.head_dim}, {tcfg.dtype}; tokenizer: {'yes' if tokenizer is not None else 'none'}")
    print(f"  drafter: {d.num_hidden_layers} layers, trained block size {dcfg.block_size}, mask {dcfg.mask_token_id}, "
          f"taps {list(dcfg.target_layer_ids)}, {d.dtype}")

    snippets = heldout_snippets(args.heldout_package, args.num_prompts, args.seed, args.prompt_lines)
    prompts, kind = prompt_ids(snippets, tokenizer, tcfg.vocab_size, [dcfg.mask_token_id], args.max_prompt_tokens,
                               args.seed)
    pkg_version = _package_version(args.heldout_package)
    lens = [len(p) for p in prompts]
    print(f"prompts: {len(prompts)} held-out snippets from {args.heldout_package} {pkg_version or ''} "
          f"({args.prompt_lines} lines from a def/class each), "
          + ("tokenised as raw text (code continuation)" if kind == "text" else
             "NO TOKENIZER: seeded random token ids of a similar length stand in for the text")
          + f"; {min(lens)}..{max(lens)} tokens (mean {statistics.mean(lens):.1f})")
    print(f"  first: {snippets[0]['file']}:{snippets[0]['line']}: {snippets[0]['text'].splitlines()[0]!r}")
    print(f"greedy, {args.max_new_tokens} new tokens per row (stop tokens ignored), median of {args.repeats} timed "
          f"runs after warm-up; block sizes {block_sizes}"
          + (f", block {dcfg.block_size} verifying {draft_tokens} drafts" if draft_tokens else "")
          + f", batch sizes {batch_sizes}\n")

    result.update(
        pair=dict(name=name, target_dir=shown(target_dir), drafter_dir=shown(drafter_dir), demo=demo,
                  tokenizer=tokenizer is not None, target_converted=is_converted(target_dir),
                  target=dataclasses.asdict(tcfg),
                  drafter=dict(layers=d.num_hidden_layers, block_size=dcfg.block_size, mask_token_id=dcfg.mask_token_id,
                               taps=list(dcfg.target_layer_ids), dtype=d.dtype)),
        prompts=dict(package=args.heldout_package, package_version=pkg_version, kind=kind, lines=args.prompt_lines,
                     lengths=lens, snippets=snippets, input_ids=prompts),
        settings=dict(block_sizes=block_sizes, draft_tokens=draft_tokens, batch_sizes=batch_sizes, max_new_tokens=args.max_new_tokens,
                      repeats=args.repeats, seed=args.seed, sync_every=args.sync_every, greedy=True,
                      stop_tokens="ignored", max_prompt_tokens=args.max_prompt_tokens),
        baseline=[], dflash=[],
    )
    max_prompt = max(lens)
    common = dict(max_new_tokens=args.max_new_tokens, max_prompt_len=max_prompt, sampling=Sampling(),
                  stop_token_ids=(), sync_every=args.sync_every)
    try:
        for batch in batch_sizes:
            gen0 = Generator(tcfg, tparams, block_size=1, batch_size=batch, **common)
            base = bench_generator(gen0, prompts, args.repeats, args.seed)
            print(f"batch {batch}: baseline {base['tokens_per_second']:.1f} tok/s", flush=True)
            base_state = None
            if not args.no_split:
                base_state = first_state(gen0, prompts, args.seed)
                ar = time_pieces(tparams, None, None, None, gen0.spec, base_state, gen0.stop_ids,
                                 rounds=args.split_rounds, min_round_s=args.split_min_time)
                prefill_s = time_prefill(gen0, prompts, args.seed, args.split_rounds)
                base["time_split"] = dict(
                    ar_step_s=ar["ar_verify"]["seconds"], cycle_s=ar["ar_cycle"]["seconds"], prefill_s=prefill_s,
                    generate_s_per_loop_cycle=base["seconds"] / base["loop_cycles"],
                    host_overhead_per_cycle_s=(base["seconds"] - prefill_s) / base["loop_cycles"]
                    - ar["ar_cycle"]["seconds"])
            result["baseline"].append(base)
            for b, k in configs:
                gen = Generator(tcfg, tparams, dcfg, dparams, block_size=b, batch_size=batch, draft_tokens=k,
                                **common)
                r = bench_generator(gen, prompts, args.repeats, args.seed)
                r.update(acceptance_figures(r["acceptance_lengths"], gen.spec.verify_len))
                r["speedup"] = r["tokens_per_second"] / base["tokens_per_second"]
                r["rows_matching_baseline"] = sum(x == y for x, y in zip(r["outputs"], base["outputs"]))
                r["lossless"] = r["rows_matching_baseline"] == len(prompts)
                if base_state is not None:
                    # the baseline's AR step and cycle are timed again, interleaved with these pieces
                    split = time_pieces(tparams, dparams, gen.spec, first_state(gen, prompts, args.seed), gen0.spec,
                                        base_state, gen.stop_ids, rounds=args.split_rounds,
                                        min_round_s=args.split_min_time)
                    sec = {k: v["seconds"] for k, v in split.items()}
                    cyc, ar_step, ar_cycle = sec["cycle"], sec["ar_verify"], sec["ar_cycle"]
                    prefill_s = time_prefill(gen, prompts, args.seed, args.split_rounds)
                    r["time_split"] = dict(
                        **split_figures(sec), ar_step_s=ar_step, baseline_cycle_s=ar_cycle,
                        cost_ratio=cyc / ar_step, speedup_check=r["tau"] / (cyc / ar_step),
                        cost_ratio_vs_baseline_cycle=cyc / ar_cycle,
                        speedup_check_vs_baseline_cycle=r["tau"] / (cyc / ar_cycle),
                        measured_speedup=r["speedup"],
                        prefill_s=prefill_s, generate_s_per_loop_cycle=r["seconds"] / r["loop_cycles"],
                        host_overhead_per_cycle_s=(r["seconds"] - prefill_s) / r["loop_cycles"] - cyc,
                        iterations={k: v["iterations"] for k, v in split.items()},
                    )
                result["dflash"].append(r)
                print(f"batch {batch} block {config_label(r)}: dflash {r['tokens_per_second']:.1f} tok/s "
                      f"({r['speedup']:.2f}x), "
                      f"tau {r['tau']:.2f}, lossless {r['rows_matching_baseline']}/{len(prompts)}", flush=True)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    if args.no_transformers:
        result["transformers"] = dict(skipped="--no-transformers")
    elif is_converted(target_dir):
        result["transformers"] = dict(skipped="the target is a converted directory; transformers needs an HF one")
    else:
        ref = result["baseline"][0]["outputs"]
        result["transformers"] = bench_transformers(target_dir, tcfg.dtype, prompts, hf_batches, args.max_new_tokens,
                                                    args.repeats, ref, args.torch_threads)
    hf = result["transformers"]
    if "skipped" in hf:
        print(f"transformers: skipped ({hf['skipped']})")
    else:
        print(f"transformers {hf['transformers_version']} / torch {hf['torch_version']} ({hf['torch_threads']} "
              f"threads, {hf['dtype']}): " + ", ".join(
                  f"batch {r['batch_size']} {r['tokens_per_second']:.1f} tok/s" for r in hf["rows"]))

    print()
    print_tables(result)
    timed_compiles = {(r["batch_size"], config_label(r)): r["compiles_timed"]
                      for r in result["baseline"] + result["dflash"]}
    leaks = {k: v for k, v in timed_compiles.items() if v.get("prefill") or v.get("run_cycles")}
    lossy = [(r["batch_size"], config_label(r)) for r in result["dflash"] if not r["lossless"]]
    print("\ngreedy losslessness (DFlash tokens == baseline tokens): "
          + ("every configuration" if not lossy else f"FAILS for (batch, block) {lossy}"))
    print("recompilations of prefill/run_cycles during timed runs: "
          + ("none" if not leaks else ", ".join(f"(batch, block) {k}: {v}" for k, v in leaks.items())))
    result["summary"] = dict(lossless=not lossy, compilations_during_timed_runs=sum(
        v.get("prefill", 0) + v.get("run_cycles", 0) for v in timed_compiles.values()))
    write_outputs(result, args)
    return 0


def _package_version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # not a distribution name, or no metadata
        return None


if __name__ == "__main__":
    sys.exit(main())
