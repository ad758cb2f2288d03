"""Timing: whole engines (`BatchEngine.generate`), and the engine's own pieces of a cycle, each
run n times in a `lax.fori_loop` on the device; compile counting; peak memory."""

from __future__ import annotations

import functools
import math
import resource
import statistics
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

# --------------------------------------------------------------------------- compile counting

_XLA_COMPILES = {"n": 0, "registered": False}


def _count_compile(event: str, duration: float, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        _XLA_COMPILES["n"] += 1


def compile_counts() -> dict[str, int]:
    """The programs each of the engine's jitted entry points holds (one per static shape it has
    been called with: init_state, prefill, run_cycles) and every XLA backend compile so far
    (jitted functions and eager ops alike)."""
    import jax.monitoring

    from dflash_jax.compiling import compiles
    from dflash_jax.engine import init_state, prefill, run_cycles

    if not _XLA_COMPILES["registered"]:
        jax.monitoring.register_event_duration_secs_listener(_count_compile)
        _XLA_COMPILES["registered"] = True
    programs = {f.__name__: compiles(f) for f in (init_state, prefill, run_cycles)}
    return {**programs, "xla_compiles": _XLA_COMPILES["n"]}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


# --------------------------------------------------------------------------- memory


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


# --------------------------------------------------------------------------- engines


def narrow_tail_default(flag: bool | None) -> bool:
    """`BatchEngine(narrow_tail=...)` as the bench chooses it: the flag when given, else on a CPU only,
    where a cycle's cost grows with its rows (an accelerator's reads its weights whatever the rows).
    The bench times warm engines, so the loops narrowing compiles cost it nothing."""
    return jax.default_backend() == "cpu" if flag is None else flag


def counted_generate(gen, prompts, seed: int, max_new_tokens=None, calls: list | None = None):
    """One `generate` run that also counts the engine's loop cycles (the iterations of every
    run_cycles call: the largest rise of a row's num_cycles during the call, since a row running
    at a call's last cycle ran at all of them) and records the admissions (prefill calls) the
    scheduler made. The state is read before and after each call, so this run is not timed.
    calls: a list to which each run_cycles call appends (rows running at its start, its loop
    cycles, whether prompts were waiting: then the call ends as soon as a row finishes, so those
    rows ran every cycle of it, and the slots it ran: the batch, or fewer once the tail narrows).
    Returns (results by index, loop cycles, admissions)."""
    admissions, cycles = [], []
    run, admit = gen.run_cycles, gen.admit

    def counting_run(state, cycles_=None, until_free=False, **kw):
        before = np.asarray(state.num_cycles)  # read before the call takes the state donated
        busy = int((~np.asarray(state.done)).sum())
        state, info = run(state, cycles_, until_free, **kw)
        cycles.append(int((np.asarray(state.num_cycles) - before).max(initial=0)))
        if calls is not None:
            calls.append((busy, cycles[-1], bool(until_free), int(state.done.shape[0])))
        return state, info

    def recording_admit(state, slots, prompts_, row_ids, max_new, *rest):
        admissions.append((list(slots), [list(p) for p in prompts_], list(row_ids), list(max_new)))
        return admit(state, slots, prompts_, row_ids, max_new, *rest)

    gen.run_cycles, gen.admit = counting_run, recording_admit
    try:
        results = {r.index: r for r in gen.generate(prompts, seed=seed, max_new_tokens=max_new_tokens)}
    finally:
        del gen.run_cycles, gen.admit  # the class's methods again
    return results, sum(cycles), admissions


def time_generate(gen, prompts, repeats: int, seed: int, max_new_tokens=None):
    """`generate` over all prompts `repeats` times: (GenerationStats of each run, results of the last)."""
    from dflash_jax.engine import GenerationStats, timed

    runs, results = [], {}
    for _ in range(repeats):
        stats = GenerationStats(block_size=gen.spec.block_size)
        results = {r.index: r for r in timed(gen.generate(prompts, seed=seed, max_new_tokens=max_new_tokens), stats)}
        runs.append(stats)
    return runs, results


def bench_generator(gen, prompts, repeats: int, seed: int, max_new_tokens=None) -> dict:
    """Warm up (BatchEngine.warmup for these very prompts, then one untimed generate over all
    prompts that counts the engine's loop cycles), then time `generate` over all prompts `repeats`
    times; median."""
    before = compile_counts()
    t = time.perf_counter()
    gen.warmup([len(p) for p in prompts], exact=True)
    calls = []
    counted, loop_cycles, admissions = counted_generate(gen, prompts, seed, max_new_tokens, calls)
    warm = delta(compile_counts(), before)
    warm_seconds = time.perf_counter() - t

    before = compile_counts()
    runs, results = time_generate(gen, prompts, repeats, seed, max_new_tokens)
    timed_compiles = delta(compile_counts(), before)
    ordered = [results[i] for i in range(len(prompts))]
    seconds = statistics.median(s.seconds for s in runs)
    tokens = runs[-1].tokens
    return dict(
        batch_size=gen.batch_size, block_size=gen.spec.block_size, draft_tokens=gen.spec.num_drafts,
        tree_budget=gen.spec.tree_budget, verify_len=gen.spec.verify_len,
        tokens_per_second=tokens / seconds if seconds else 0.0,
        tokens_per_second_runs=[s.tokens_per_second for s in runs],
        seconds=seconds, seconds_runs=[s.seconds for s in runs], output_tokens=tokens,
        loop_cycles=loop_cycles, slot_cycles=sum(n * width for _, n, _, width in calls), admissions=len(admissions),
        counted_run_matches=all(counted[i].output_ids == r.output_ids for i, r in enumerate(ordered)),
        warmup_seconds=warm_seconds, compiles_warmup=warm, compiles_timed=timed_compiles,
        host_peak_rss_bytes=host_peak_rss(), device_peak_bytes=device_peak_bytes(),
        outputs=[r.output_ids for r in ordered], acceptance_lengths=[r.acceptance_lengths for r in ordered],
        _admissions=admissions,
    )


def time_prefill(gen, admissions, seed: int, rounds: int) -> float:
    """Seconds of the admissions (prefill calls, host input building included) a `generate` run
    made, replayed in order on one state; median of `rounds`."""
    state = gen.new_state()
    jax.block_until_ready(state)
    times = []
    for _ in range(max(1, rounds)):
        t = time.perf_counter()
        for slots, prompts, row_ids, max_new in admissions:
            state = gen.admit(state, slots, prompts, row_ids, max_new, seed)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


# --------------------------------------------------------------------------- states


def first_state(gen, prompts, seed: int):
    """The DecodeState after the engine's prefill of the first batch of prompts into slots 0..n-1."""
    chunk = prompts[:gen.batch_size]
    slots = list(range(len(chunk)))
    return gen.admit(gen.new_state(), slots, chunk, slots, [gen.spec.max_new_tokens] * len(chunk), seed)


@functools.partial(jax.jit, static_argnames=("spec", "batch", "context"))
def synthetic_state(spec, batch: int, context: int, seed: int = 0):
    """A DecodeState from `init_state` with every row running at `context` committed positions in
    both caches (contents zero), one token generated, the anchor 1. Works under jax.eval_shape."""
    from dflash_jax.engine import init_state

    state = init_state(spec, batch)
    lengths = jnp.full((batch,), context, jnp.int32)
    ctx, pages = state.context_cache, {}
    if state.target_cache.pages is not None:  # a page pool: each row its own pages (the pool's, round robin)
        table = state.target_cache.pages
        pages = dict(pages=(jnp.arange(table.size, dtype=jnp.int32) % spec.kv_pages).reshape(table.shape))
    return state.replace(
        target_cache=state.target_cache.replace(lengths=lengths, **pages),
        context_cache=None if ctx is None else ctx.replace(lengths=lengths, **pages),
        anchor=jnp.ones((batch,), jnp.int32), num_generated=jnp.ones((batch,), jnp.int32),
        done=jnp.zeros((batch,), bool), max_new_tokens=jnp.full((batch,), spec.max_new_tokens, jnp.int32),
        sampling=state.sampling.replace(
            key=jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(seed), jnp.arange(batch))),
    )


# --------------------------------------------------------------------------- the engine's pieces


def _rewound(new, old):
    """`new` with `old`'s cache lengths and row counters, so the next iteration runs on the same
    positions (the caches' buffers, written in place, and the anchor carry on)."""
    ctx = None if new.context_cache is None else new.context_cache.replace(lengths=old.context_cache.lengths)
    return new.replace(target_cache=new.target_cache.replace(lengths=old.target_cache.lengths), context_cache=ctx,
                       num_generated=old.num_generated, num_cycles=old.num_cycles, done=old.done, stopped=old.stopped)


@functools.cache
def pieces() -> dict[str, Callable]:
    """The engine's own pieces of a cycle (dflash_jax.engine draft, verify, accept + commit, cycle,
    and dflash_jax.drafter.extend_context), each jitted in a `lax.fori_loop` of n iterations on the
    device (as the engine runs its cycles inside a while_loop), so one call times n pieces with no
    per-call dispatch. Every iteration feeds its output into the next or writes a carried cache
    (inputs that stay the same go through an optimization barrier with the carry, so nothing is
    hoisted out of the loop); pieces that write a cache take it donated and rewind its lengths
    every iteration, so they run on the same positions again and again.

      draft   (tparams, dparams, spec, anchor, context_cache, n) -> anchor
      verify  (tparams, spec, state, block, n) -> (state, block)
      extend  (dparams, spec, context_cache, features, n) -> context_cache
      commit  (dparams, spec, state, drafts, target_tokens, features, stop_ids, n) -> state
      passes  (tparams, dparams, spec, state, n) -> state: draft, verify, extend_context
      cycle   (tparams, dparams, spec, state, stop_ids, n) -> state
    """
    from dflash_jax.drafter import extend_context
    from dflash_jax.engine import accept, commit, cycle, draft, verify
    from dflash_jax.model import ForwardOutput

    barrier = jax.lax.optimization_barrier
    loop = lambda n, body, carry: jax.lax.fori_loop(0, n, lambda _, c: body(c), carry)

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("anchor",))
    def draft_loop(tparams, dparams, spec, anchor, context_cache, n):
        """n drafts; each one's drafts feed the next one's anchor."""
        def body(a):
            drafts = draft(tparams, dparams, spec, a, context_cache)
            return (drafts.sum(axis=1) % spec.target.vocab_size).astype(jnp.int32)

        return loop(n, body, anchor)

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state", "block"))
    def verify_loop(tparams, spec, state, block, n):
        """n verifies of the block; the target's tokens are the next block."""
        def body(carry):
            s, b = carry
            target_tokens, out = verify(tparams, spec, s, b)
            return s.replace(target_cache=out.cache.replace(lengths=s.target_cache.lengths)), target_tokens

        return loop(n, body, (state, block))

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("context_cache",))
    def extend_loop(dparams, spec, context_cache, features, n):
        """n extend_context calls of a verified block's tap features (a whole block's K/V written)."""
        def body(ctx):
            ctx, f = barrier((ctx, features))
            new = extend_context(dparams, spec.drafter, f, ctx, jnp.ones_like(ctx.lengths))
            return new.replace(lengths=ctx.lengths)

        return loop(n, body, context_cache)

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
    def commit_loop(dparams, spec, state, drafts, target_tokens, features, stop_ids, n):
        """n accept + commit of one verified block (commit's extend_context included)."""
        def body(s):
            s, d, tt, f = barrier((s, drafts, target_tokens, features))
            num_accepted = accept(d, tt) if spec.uses_drafter else jnp.zeros_like(s.anchor)
            verified = ForwardOutput(logits=None, tap_features=f, cache=s.target_cache)
            return _rewound(commit(dparams, spec, s, tt, num_accepted, verified, stop_ids), s)

        return loop(n, body, state)

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
    def passes_loop(tparams, dparams, spec, state, n):
        """n times the model passes of a cycle back to back, as a cycle runs them (draft, the
        verify of [anchor, drafts], extend_context of its taps) with none of accept/commit's
        bookkeeping; the verify's last token is the next anchor."""
        def body(s):
            drafts = draft(tparams, dparams, spec, s.anchor, s.context_cache)
            target_tokens, out = verify(tparams, spec, s, jnp.concatenate([s.anchor[:, None], drafts], axis=1))
            ctx = extend_context(dparams, spec.drafter, out.tap_features, s.context_cache, jnp.ones_like(s.anchor))
            return _rewound(s.replace(target_cache=out.cache, context_cache=ctx, anchor=target_tokens[:, -1]), s)

        return loop(n, body, state)

    @functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
    def cycle_loop(tparams, dparams, spec, state, stop_ids, n):
        """n whole cycles (dflash_jax.engine.cycle), each rewound to the state's lengths and counters."""
        return loop(n, lambda s: _rewound(cycle(tparams, dparams, spec, s, stop_ids), s), state)

    return dict(draft=draft_loop, verify=verify_loop, extend=extend_loop, commit=commit_loop, passes=passes_loop,
                cycle=cycle_loop)


@functools.cache
def _once():
    """The engine's draft and verify, jitted once (no loop): the inputs of the other pieces."""
    from dflash_jax.engine import draft, verify

    return (jax.jit(draft, static_argnames=("spec",)),
            jax.jit(lambda tparams, spec, state, block: verify(tparams, spec, state, block),
                    static_argnames=("spec",)))


def _copy(tree):
    return jax.tree.map(lambda x: jnp.array(x, copy=True), tree)


def piece_calls(tparams, dparams, spec, state, stop_ids, prefix: str = "") -> dict:
    """(call(n), sync()) of the pieces of a cycle of `spec` on `state` (not consumed): with a
    drafter draft, verify, extend, commit, passes and cycle; without (block size 1) verify (one
    autoregressive step), commit and cycle; with a draft tree the cycle alone (the pieces above
    are the chain's)."""
    p = pieces()
    if spec.tree_budget:
        carry = [_copy(state)]

        def call(n):
            carry[0] = p["cycle"](tparams, dparams, spec, carry[0], stop_ids, n)

        return {prefix + "cycle": (call, lambda: carry[0])}
    draft_once, verify_once = _once()
    if spec.uses_drafter:
        drafts = draft_once(tparams, dparams, spec, state.anchor, state.context_cache)
        block = jnp.concatenate([state.anchor[:, None], drafts], axis=1)
    else:
        drafts, block = None, jnp.array(state.anchor[:, None], copy=True)
    target_tokens, out = verify_once(tparams, spec, state, block)
    features = out.tap_features
    del out
    carry = {}

    def make(name, start, step):
        carry[name] = start

        def call(n):
            carry[name] = step(carry[name], n)

        return prefix + name, (call, lambda: carry[name])

    calls = []
    if spec.uses_drafter:
        calls.append(make("draft", (_copy(state.anchor),),
                          lambda c, n: (p["draft"](tparams, dparams, spec, c[0], state.context_cache, n),)))
    calls.append(make("verify", (_copy(state), block),
                      lambda c, n: p["verify"](tparams, spec, *c, n)))
    if spec.uses_drafter:
        calls.append(make("extend", _copy(state.context_cache),
                          lambda c, n: p["extend"](dparams, spec, c, features, n)))
    calls.append(make("commit", _copy(state),
                      lambda c, n: p["commit"](dparams, spec, c, drafts, target_tokens, features, stop_ids, n)))
    if spec.uses_drafter:
        calls.append(make("passes", _copy(state), lambda c, n: p["passes"](tparams, dparams, spec, c, n)))
    calls.append(make("cycle", _copy(state), lambda c, n: p["cycle"](tparams, dparams, spec, c, stop_ids, n)))
    return dict(calls)


def time_calls(calls: dict[str, tuple[Callable[[int], None], Callable[[], object]]], rounds: int,
               min_round_s: float) -> dict:
    """Median seconds per iteration of each named (call, sync) pair; call(n) runs n iterations on
    the device, sync() is what to block_until_ready on. Each call runs once to compile, then gets
    n, calibrated so a call lasts >= min_round_s; then `rounds` timed calls each, the pieces
    interleaved (a change in machine load hits every piece alike)."""
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


def time_pieces(tparams, dparams, spec, state, base_spec, base_state, stop_ids, *, rounds: int,
                min_round_s: float) -> dict:
    """Seconds of the pieces of `spec` on `state` and, interleaved with them, of the baseline
    `base_spec` (block size 1) on `base_state`, named ar_verify (one autoregressive step),
    ar_commit and ar_cycle. spec None: the baseline's pieces alone."""
    calls = {}
    if spec is not None:
        calls.update(piece_calls(tparams, dparams, spec, state, stop_ids))
    calls.update(piece_calls(tparams, None, base_spec, base_state, stop_ids, prefix="ar_"))
    return time_calls(calls, rounds, min_round_s)


def split_figures(sec: dict) -> dict:
    """Seconds of the timed pieces (time_pieces' names) -> the time split of a DFlash cycle.
    passes = draft, verify and extend_context back to back (the model work of a cycle);
    bookkeeping = cycle - passes (accept and commit without commit's extend_context), its
    share of the cycle; the same against the pieces timed apart (each alone keeps its weights
    in cache); pieces_sum = draft + verify + commit, the cycle's parts timed apart."""
    cyc, dr, ve, ex, both, com = (sec[k] for k in ("cycle", "draft", "verify", "extend", "passes", "commit"))
    return dict(draft_s=dr, verify_s=ve, extend_s=ex, commit_s=com, passes_s=both, cycle_s=cyc,
                bookkeeping_s=cyc - both, overhead_beyond_passes_fraction=(cyc - both) / cyc,
                passes_interference_s=both - dr - ve - ex,
                overhead_beyond_pieces_fraction=(cyc - dr - ve - ex) / cyc,
                pieces_sum_s=dr + ve + com, cycle_over_pieces_sum=cyc / (dr + ve + com))
