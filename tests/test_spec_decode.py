"""The speculative decoding engine (the decoding cycle of DFlash, arXiv 2602.06036).

- Greedy losslessness: speculative output equals plain greedy output (block size 1),
  which equals a full-recompute reference; acceptance lengths equal a from-scratch
  re-implementation of the cycle (fresh caches every cycle).
- Stop tokens accepted inside a block cut the output right after them.
- Continuous batching: with fewer slots than prompts, rows admitted into freed slots (one or
  several at a time) give the same tokens and acceptance lengths as one row at a time; a row's
  own max_new_tokens gives exactly that many tokens.
- After warm-up nothing recompiles; a new prompt bucket compiles prefill only.
- Sampling is lossless: the empirical distribution of the first tokens matches the exact
  target distribution (independent numpy top-k/top-p), and the bound used would reject
  the distributions of broken acceptance rules.
- Seeded sampling is reproducible and independent of batch, row placement and block size.
- Logit processing (temperature, top-k, top-p) against numpy.

Models are tiny and random. A random drafter almost never matches a 128-token target, so
most cases use targets with an 8- or 12-token vocabulary, where drafts match by chance
often enough that multi-token acceptance is exercised (and asserted).
Generators are built once per static shape and shared: compiling is the cost here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import DFlashError, forward, init_cache
from dflash_jax.drafter import extend_context
from dflash_jax.kv import init_context_cache
from dflash_jax.engine import EngineSpec, BatchEngine, Sampling, bucket, draft, greedy_pick, processed_logits
from bench.timing import compile_counts
from fixtures import (
    CHUNK, GREEDY_CASES, LIMITS, MAX_NEW, MAX_PROMPT, N_SAMPLES, NEG, PAGE, PROMPT_LENGTHS, SAMPLE_PROMPT, SAMPLINGS,
    SETUPS, SLOTS, V, by_index, check_lengths, engine, exact_distribution, exact_joint, exact_logits, heavy,
    numpy_distribution, numpy_top_p, prompts, sampling_setup, setup, speculative_samples, target_distribution, tv,
    tv_bound,
)


# --------------------------------------------------------------------------- models (tests/fixtures.py)


@functools.cache
def greedy(name, block_size, batch_size, stop=()):
    """Results (in prompt order) of greedy decoding of the setup's prompts."""
    return by_index(engine(name, block_size, batch_size, stop=stop).generate(list(prompts(name))))


# --------------------------------------------------------------------------- 1. greedy losslessness


@pytest.mark.parametrize("name,block_size,batch_size", GREEDY_CASES)
def test_speculative_greedy_equals_plain_greedy(name, block_size, batch_size):
    plain = greedy(name, 1, SLOTS)
    spec = greedy(name, block_size, batch_size)
    assert [r.index for r in spec] == list(range(len(PROMPT_LENGTHS)))
    for i, (s, p) in enumerate(zip(spec, plain)):
        assert s.output_ids == p.output_ids, f"prompt {i} (length {PROMPT_LENGTHS[i]})"
        assert s.finish_reason == p.finish_reason == "length"
    check_lengths(spec, block_size, MAX_NEW)
    check_lengths(plain, 1, MAX_NEW)
    assert all(r.acceptance_lengths == [1] * MAX_NEW for r in plain)
    if SETUPS[name][1] <= 16:
        # The tiny vocabulary makes chance matches common: multi-token acceptance happened.
        assert max(a for r in spec for a in r.acceptance_lengths) > 1


def reference_greedy(params, config, prompt_list, max_new):
    """Greedy decoding by re-running the whole sequence every step (a fresh cache each
    time, no reuse). Right padding to one fixed width is harmless under the causal mask."""
    width = max(len(p) for p in prompt_list) + max_new
    seqs = [list(p) for p in prompt_list]
    for _ in range(max_new):
        tokens = np.zeros((len(seqs), width), np.int32)
        for i, s in enumerate(seqs):
            tokens[i, :len(s)] = s
        logits = np.asarray(forward(params, config, jnp.asarray(tokens), init_cache(config, len(seqs), width)).logits)
        for i, s in enumerate(seqs):
            s.append(int(np.argmax(logits[i, len(s) - 1])))
    return [s[len(p):] for s, p in zip(seqs, prompt_list)]


@pytest.mark.parametrize("name", [n if n == "qwen3-v8" else heavy(n)
                                  for n in sorted(SETUPS)])  # the MoE families (their plain greedy equals transformers'
# `generate` everyday: test_moe.py), the newer families, the 128-token vocabularies and Llama (for the everyday
# suite's 10 minutes, 2026-12-08): heavy
def test_plain_greedy_equals_full_recompute_reference(name):
    target, tparams, _, _ = setup(name)
    ref = reference_greedy(tparams, target, prompts(name), MAX_NEW)
    assert [r.output_ids for r in greedy(name, 1, SLOTS)] == ref


def reference_cycles(name, block_size, prompt_list, max_new, num_drafts=None):
    """Greedy DFlash cycles recomputed from scratch each cycle (the paper's cycle): the drafter
    context is the taps of every committed position from a fresh target pass, the block
    [anchor, MASK...] sits at the anchor's position, and the verify pass reruns the whole
    sequence. No cache survives a cycle, so a wrong incremental context or rollback in the
    engine shows up as different drafts, hence different acceptance lengths.
    num_drafts K: the whole block is drafted, only its first K drafts are verified.
    Returns (outputs, acceptance lengths) per prompt."""
    target, tparams, drafter, dparams = setup(name)
    k = block_size - 1 if num_drafts is None else num_drafts
    n = len(prompt_list)
    width = max(map(len, prompt_list)) + max_new + 2 * block_size
    spec = EngineSpec(target=target, drafter=drafter, block_size=block_size, sampling=Sampling(),
                      max_new_tokens=max_new, cache_len=width)

    def run_target(seqs):
        tokens = np.zeros((n, width), np.int32)
        for i, seq in enumerate(seqs):
            tokens[i, :len(seq)] = seq
        out = forward(tparams, target, jnp.asarray(tokens), init_cache(target, n, width), taps=drafter.target_layer_ids)
        return np.asarray(out.logits), out.tap_features

    logits, _ = run_target(prompt_list)
    seqs = [list(p) + [int(np.argmax(logits[i, len(p) - 1]))] for i, p in enumerate(prompt_list)]
    acceptance = [[] for _ in range(n)]
    while any(len(s) - len(p) <= max_new for s, p in zip(seqs, prompt_list)):
        committed = np.array([len(s) - 1 for s in seqs])  # the last token is the anchor
        _, taps = run_target(seqs)
        context = extend_context(dparams, drafter, taps, init_context_cache(drafter, n, width), jnp.asarray(committed))
        anchors = jnp.asarray([s[-1] for s in seqs], jnp.int32)
        drafts = np.asarray(draft(tparams, dparams, spec, anchors, context))[:, :k]
        logits, _ = run_target([s + d.tolist() for s, d in zip(seqs, drafts)])
        for i, (s, p) in enumerate(zip(seqs, prompt_list)):
            if len(s) - len(p) > max_new:
                continue
            y = [int(np.argmax(logits[i, committed[i] + j])) for j in range(k + 1)]
            a = 0
            while a < k and drafts[i, a] == y[a]:
                a += 1
            s.extend(y[:a + 1])
            acceptance[i].append(a + 1)
    return [s[len(p):][:max_new] for s, p in zip(seqs, prompt_list)], acceptance


# llama heavy for the everyday suite's 10 minutes (its plain greedy equals a full-recompute reference everyday, above)
@pytest.mark.parametrize("name,block_size", [("qwen3-v8", 8), heavy("llama-v8", 8), heavy("qwen3-v8", 4)])
def test_acceptance_lengths_equal_from_scratch_reference(name, block_size):
    outputs, acceptance = reference_cycles(name, block_size, prompts(name), MAX_NEW)
    spec = greedy(name, block_size, SLOTS)
    assert [r.output_ids for r in spec] == outputs
    assert [r.acceptance_lengths for r in spec] == acceptance
    assert max(map(max, acceptance)) > 1


@functools.cache
def engine_k(name, block_size, batch_size, num_drafts):
    target, tparams, drafter, dparams = setup(name)
    return BatchEngine(target, tparams, drafter, dparams, block_size=block_size, batch_size=batch_size,
                     max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT, draft_tokens=num_drafts, speculation="fixed")


@pytest.mark.parametrize("name,num_drafts", [("qwen3-v8", 3), heavy("qwen3-v8", 1), heavy("llama-v8", 5)])
def test_verifying_fewer_drafts_is_lossless_and_matches_the_reference(name, num_drafts):
    """Block 8 drafted whole, K drafts verified: the output is still the target's greedy
    output, no cycle accepts more than K + 1, and every acceptance length equals the
    from-scratch reference that drafts the whole block and compares only its first K."""
    spec = by_index(engine_k(name, 8, SLOTS, num_drafts).generate(list(prompts(name))))
    assert [r.output_ids for r in spec] == [r.output_ids for r in greedy(name, 1, SLOTS)]
    check_lengths(spec, num_drafts + 1, MAX_NEW)
    outputs, acceptance = reference_cycles(name, 8, prompts(name), MAX_NEW, num_drafts)
    assert [r.acceptance_lengths for r in spec] == acceptance
    assert max(map(max, acceptance)) >= min(num_drafts + 1, 3)  # multi-token acceptance happened


@pytest.mark.heavy
def test_k_drafts_are_the_whole_blocks_first_k_and_k_b_minus_1_is_the_default():
    name = "qwen3-v8"
    target, tparams, drafter, dparams = setup(name)
    spec = engine(name, 8, 2).spec
    gen = engine(name, 8, 2)
    state = gen.admit(gen.new_state(), [0, 1], [list(prompts(name)[0]), list(prompts(name)[3])], [0, 1], [MAX_NEW] * 2)
    whole = np.asarray(draft(tparams, dparams, spec, state.anchor, state.context_cache))
    assert whole.shape == (2, 7)
    for k in (1, 4, 7):
        spec_k = engine_k(name, 8, 2, k).spec
        assert (spec_k.num_drafts, spec_k.verify_len) == (k, k + 1)
        got = np.asarray(draft(tparams, dparams, spec_k, state.anchor, state.context_cache))
        np.testing.assert_array_equal(got, whole[:, :k])
    default = greedy(name, 8, 8)
    full_k = by_index(engine_k(name, 8, 8, 7).generate(list(prompts(name))))
    assert [r.acceptance_lengths for r in full_k] == [r.acceptance_lengths for r in default]


@pytest.mark.parametrize("block_size,num_drafts,message", [
    (8, 0, "--draft-tokens must be >= 1, got 0"),
    (8, 8, r"--draft-tokens 8 is more than a block of 8 holds \(1\.\.7\)"),
    (1, 3, "--draft-tokens needs a drafter"),
])
def test_bad_draft_tokens_are_refused(block_size, num_drafts, message):
    target, tparams, drafter, dparams = setup("qwen3-v8")
    with pytest.raises(DFlashError, match=message):
        BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                  block_size=block_size, draft_tokens=num_drafts, max_new_tokens=4, max_prompt_len=8, batch_size=1, speculation="fixed")


@pytest.mark.parametrize("shape,levels", [((3, 5, 50), 4), ((7, 4096), 1000), ((2, 9), 1)])
def test_greedy_pick_is_argmax_with_first_index_on_ties(shape, levels):
    """Few distinct values make ties common (levels 1: every entry ties, index 0 wins)."""
    logits = np.random.RandomState(levels).randint(0, levels, shape).astype(np.float32) / 7
    got = np.asarray(greedy_pick(jnp.asarray(logits)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))


@pytest.mark.parametrize("name,block_size", [("qwen3-v8", 8), heavy("llama-v128", 1)])
def test_continuous_batching_equals_one_row_at_a_time(name, block_size):
    """3 slots for 12 prompts with their own limits: slots are refilled as rows finish, one or
    several prompts at a time, longest limit first (a long row admitted last would run on alone),
    and every row equals its run alone in a batch of 1."""
    gen = engine(name, block_size, 3)
    admitted, order = [], []
    admit = gen.admit

    def recording_admit(state, slots, prompts, row_ids, *a, **kw):
        admitted.append(len(slots))
        order.extend(row_ids)
        return admit(state, slots, prompts, row_ids, *a, **kw)

    gen.admit = recording_admit
    try:
        together = by_index(gen.generate(list(prompts(name)), max_new_tokens=list(LIMITS)))
    finally:
        del gen.admit
    alone = by_index(engine(name, block_size, 1).generate(list(prompts(name)), max_new_tokens=list(LIMITS)))
    assert admitted[0] == 3 and sum(admitted) == len(LIMITS) and len(admitted) > 4
    assert order == sorted(range(len(LIMITS)), key=lambda i: -LIMITS[i])  # stable: ties keep their order
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert [r.acceptance_lengths for r in together] == [r.acceptance_lengths for r in alone]
    for r, limit in zip(together, LIMITS):
        assert (len(r.output_ids), r.finish_reason) == (limit, "length")
    # A row's limit only cuts it: the tokens are the full-length run's first `limit`.
    full = greedy(name, block_size, SLOTS)
    assert [r.output_ids for r in together] == [f.output_ids[:limit] for f, limit in zip(full, LIMITS)]
    if block_size > 1:
        assert max(max(r.acceptance_lengths) for r in together) > 1


def narrowed_engine(name, block_size, **kw):
    target, tparams, drafter, dparams = setup(name)
    return BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                     block_size=block_size, batch_size=4, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT,
                     page_size=PAGE, prefill_chunk=CHUNK, narrow_tail=True, sync_every=2, speculation="fixed", **kw)


def run_widths(gen, prompt_list, **kw):
    """Results in order, and the slots of each run_cycles call."""
    widths, run = [], gen.run_cycles
    gen.run_cycles = lambda state, *a, **kw: widths.append(int(state.done.shape[0])) or run(state, *a, **kw)
    try:
        return by_index(gen.generate(prompt_list, **kw)), widths
    finally:
        del gen.run_cycles


@pytest.mark.parametrize("name,block_size,pool", [
    heavy("gpt_oss-v8", 8, 40),  # a page pool, with the sliding layers' rings: tables move, pages stay
    heavy("qwen3-v8", 8, None), heavy("qwen3_5-v8", 4, None),  # a hybrid: its recurrent states and conv tails move too
])
def test_a_narrowed_tail_decodes_as_the_full_batch(name, block_size, pool):
    """narrow_tail: once nothing waits and the running rows fit fewer slots, they move to a
    narrower state (4 slots, then 3, 2, 1 here), and every row still gives the tokens and acceptance
    lengths it gives at full width. Warm-up compiles the narrower loops: nothing compiles after."""
    ps, full = list(prompts(name)), greedy(name, block_size, SLOTS)  # every row MAX_NEW, 3 slots
    mixed = by_index(engine(name, block_size, SLOTS).generate(ps, max_new_tokens=list(LIMITS)))  # rows' own lengths
    gen = narrowed_engine(name, block_size, kv_pages=pool)
    assert gen.tail_widths == [3, 2, 1]
    programs = lambda: {k: v for k, v in compile_counts().items() if k != "xla_compiles"}
    gen.warmup(PROMPT_LENGTHS)
    warm = programs()
    runs = [(ps, list(LIMITS), mixed), (ps, [MAX_NEW] * 12, full),
            (ps[:4], [MAX_NEW, 2, 3, 2], full[:4])]  # one long row: it runs on alone, in a state of 1 slot
    for some, limits, want in runs:
        narrowed, widths = run_widths(gen, some, max_new_tokens=limits)
        assert widths[0] == 4 and widths == sorted(widths, reverse=True)  # never wider again within a call
        assert [r.output_ids for r in narrowed] == [w.output_ids[:m] for w, m in zip(want, limits)]
        assert [len(r.output_ids) for r in narrowed] == limits
        if len(some) == 12:
            assert [r.acceptance_lengths for r in narrowed] == [w.acceptance_lengths for w in want]
    assert widths[-1] == 1 and narrowed[0].acceptance_lengths == full[0].acceptance_lengths
    # The next call starts from a whole batch again (a narrowed call leaves no state behind).
    again, widths = run_widths(gen, ps[:2])
    assert widths[0] == 4 and [r.output_ids for r in again] == [r.output_ids for r in full[:2]]
    assert programs() == warm


@pytest.mark.heavy  # the everyday suite's budget; a narrowed tail's greedy tokens are checked everyday
def test_a_narrowed_tail_keeps_seeded_samples():
    """Sampled rows keep their own keys when they move: the same tokens as at full width."""
    rs = np.random.RandomState(12)
    prompt_list = [rs.randint(0, V, n).tolist() for n in (4, 9, 1, 16, 7, 12)]
    target, tparams, drafter, dparams = sampling_setup()
    narrowed = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=4, max_new_tokens=16,
                         max_prompt_len=16, sampling=Sampling(temperature=1.0), narrow_tail=True, sync_every=1, speculation="fixed")
    got, widths = run_widths(narrowed, prompt_list, seed=7, max_new_tokens=[16, 3, 9, 16, 1, 12])
    assert 1 in widths
    want = by_index(sampling_engine(4, 4).generate(prompt_list, seed=7, max_new_tokens=[16, 3, 9, 16, 1, 12]))
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_tail_widths_are_powers_of_two_and_three_times_them():
    target, tparams, drafter, dparams = setup("qwen3-v8")
    widths = lambda batch, narrow=True: BatchEngine(target, tparams, block_size=1, batch_size=batch,
                                                  narrow_tail=narrow).tail_widths
    assert widths(8) == [6, 4, 3, 2, 1] and widths(5) == [4, 3, 2, 1] and widths(16)[:3] == [12, 8, 6]
    assert widths(1) == [] and widths(8, False) == []


def test_bad_row_limits_are_refused():
    gen = engine("qwen3-v8", 1, 1)
    with pytest.raises(DFlashError, match=r"max_new_tokens must be in 1..24 \(the run's max_new_tokens\), got 25"):
        list(gen.generate([[1, 2]], max_new_tokens=[25]))
    with pytest.raises(DFlashError, match="2 max_new_tokens for 1 prompts"):
        list(gen.generate([[1, 2]], max_new_tokens=[3, 4]))


# --------------------------------------------------------------------------- 2. stop tokens


def first_occurrences(outputs, token):
    return [o.index(token) if token in o else None for o in outputs]


def mid_block_positions(result):
    """Output positions that a cycle committed but not as its last token (the anchor from
    prefill is position 0; a cycle of acceptance a + 1 adds a + 1 tokens)."""
    ends = set(np.cumsum([0] + result.acceptance_lengths).tolist())
    return {j for j in range(len(result.output_ids)) if j not in ends}


def test_stop_token_mid_block_cuts_after_first_occurrence():
    name = "qwen3-v8"
    rs = np.random.RandomState(1001)
    prompt_list = [rs.randint(0, SETUPS[name][1], n).tolist() for n in rs.randint(1, MAX_PROMPT + 1, 32)]
    plain_outputs = [r.output_ids for r in by_index(engine(name, 1, SLOTS).generate(prompt_list))]
    spec_8 = by_index(engine(name, 8, SLOTS).generate(prompt_list))
    assert [r.output_ids for r in spec_8] == plain_outputs

    # The stop token: among those some rows never produce, the one that most often lands
    # inside an accepted block of the block-8 run (so the tokens after it must be dropped).
    def inside_blocks(token):
        firsts = first_occurrences(plain_outputs, token)
        return sum(f is not None and f in mid_block_positions(r) for f, r in zip(firsts, spec_8))

    candidates = [t for t in range(SETUPS[name][1]) if first_occurrences(plain_outputs, t).count(None) >= 2]
    stop = max(candidates, key=inside_blocks)
    assert inside_blocks(stop) >= 3

    expected = [(o[:o.index(stop) + 1], "stop") if stop in o else (o, "length") for o in plain_outputs]
    assert sum(f is not None and f >= 1 for f in first_occurrences(plain_outputs, stop)) >= 3
    # 3 slots for 32 prompts (slots refilled), the shapes compiled above: only the stop ids differ.
    runs = {b: by_index(engine(name, b, SLOTS, stop=(stop,)).generate(prompt_list)) for b in (1, 8)}
    for b, results in runs.items():
        for i, (r, (ids, reason)) in enumerate(zip(results, expected)):
            assert (r.output_ids, r.finish_reason) == (ids, reason), f"block {b}, prompt {i}"
        check_lengths(results, b, MAX_NEW)
    # Stopped inside a block: more tokens were generated (1 + sum of acceptance) than kept.
    assert sum(r.finish_reason == "stop" and 1 + sum(r.acceptance_lengths) > len(r.output_ids)
               for r in runs[8]) >= 3


# --------------------------------------------------------------------------- 3. compilation


def test_no_recompilation_after_warmup():
    name = "qwen3-v8"
    vocab = SETUPS[name][1]
    rs = np.random.RandomState(7)
    ids = lambda n: rs.randint(0, vocab, n).tolist()
    # max_new 13 is used by no other test, so this spec compiles here and nowhere else.
    gen = engine(name, 4, 4, max_new=13)
    assert gen.widths == [1, 2, 4]
    before = compile_counts()
    gen.warmup([3, 14])
    assert bucket(14) == bucket(3) == 16
    # One prefill per admission width for the one bucket, one cycle loop, one empty state.
    programs = lambda: {k: v for k, v in compile_counts().items() if k != "xla_compiles"}
    assert programs() == {"prefill": before["prefill"] + 3, "run_cycles": before["run_cycles"] + 1,
                          "init_state": before["init_state"] + 1}
    warm = programs()

    # Same bucket: fewer rows than the batch, more rows than the batch (slots refilled as rows
    # finish, one or several at a time), other lengths, seed, indices and per-row limits, and
    # another stop-token set (stop ids are an array, not a static).
    list(gen.generate([ids(n) for n in (3, 9, 14, 5)]))
    list(gen.generate([ids(n) for n in (1, 16, 7)], seed=3))
    list(gen.generate([ids(n) for n in (2, 11, 16, 4, 6, 12, 9, 3, 5)], indices=range(100, 109),
                      max_new_tokens=[1, 13, 5, 2, 9, 13, 3, 7, 1]))
    stopping = engine(name, 4, 4, max_new=13, stop=(0, 1, 2, 3))
    results = list(stopping.generate([ids(n) for n in (8, 15)]))
    assert any(r.finish_reason == "stop" for r in results)
    assert programs() == warm

    # A new bucket compiles prefill (at the widths it is admitted at), the cycle loop not at all;
    # warmup(exact=True) for the very prompts of a run compiles only the widths they can be
    # admitted at: one prompt, width 1.
    assert bucket(20) == bucket(31) == 32
    gen.warmup([20], exact=True)
    assert programs() == {**warm, "prefill": warm["prefill"] + 1}
    list(gen.generate([ids(20)]))
    list(gen.generate([ids(31), ids(4)]))
    assert programs() == {**warm, "prefill": warm["prefill"] + 1}
    # Prompts the slots take at once (3 of 4): their one call is of width 4, the only one compiled.
    gen.warmup([20, 25, 31], exact=True)
    assert programs() == {**warm, "prefill": warm["prefill"] + 2}
    list(gen.generate([ids(20), ids(25), ids(31)]))
    assert programs() == {**warm, "prefill": warm["prefill"] + 2}


# --------------------------------------------------------------------------- 4. sampling distribution


@functools.cache
def first_drafts(family="qwen3"):
    """d_1 of the first cycle for each first token t1: the drafter's argmax, [V]."""
    target, tparams, drafter, dparams = sampling_setup(family)
    p = len(SAMPLE_PROMPT)
    taps = forward(tparams, target, jnp.asarray([SAMPLE_PROMPT] * V, jnp.int32), init_cache(target, V, 32),
                   taps=drafter.target_layer_ids).tap_features
    context = extend_context(dparams, drafter, taps, init_context_cache(drafter, V, 32), jnp.full((V,), p))
    spec = EngineSpec(target=target, drafter=drafter, block_size=4, sampling=Sampling(1.0), max_new_tokens=3,
                      cache_len=32)
    return np.asarray(draft(tparams, dparams, spec, jnp.arange(V, dtype=jnp.int32), context))[:, 0]


@pytest.mark.parametrize("sampling,family", [
    pytest.param(SAMPLINGS[1], "qwen3", id="t0.7-topk5"),
    pytest.param(SAMPLINGS[0], "qwen3", id="t1", marks=pytest.mark.heavy),
    pytest.param(SAMPLINGS[2], "qwen3", id="t1-topp0.8", marks=pytest.mark.heavy),
    pytest.param(SAMPLINGS[0], "gpt_oss", id="t1-gpt_oss", marks=pytest.mark.heavy),  # a MoE target
    pytest.param(SAMPLINGS[0], "qwen3_5", id="t1-qwen3_5", marks=pytest.mark.heavy),  # a hybrid: states settle per row
    pytest.param(SAMPLINGS[0], "gemma4", id="t1-gemma4", marks=pytest.mark.heavy),  # two K/V groups, soft-capping
])
def test_speculative_sampling_matches_target_distribution(sampling, family):
    exact = exact_joint(sampling, family)
    tokens, first_acceptance = speculative_samples(sampling, family)
    counts = np.zeros((V, V, V))
    np.add.at(counts, tuple(tokens.T), 1)
    empirical = counts / N_SAMPLES

    # The drafts were accepted often, so the acceptance rule was really exercised.
    assert np.mean(first_acceptance >= 2) > 0.2

    # A token the target cannot sample (top-k / top-p) is never produced.
    impossible = counts[exact == 0].sum()
    assert impossible == 0, f"{impossible:.0f} samples of zero-probability sequences"
    if sampling.top_k:
        assert np.count_nonzero(exact.sum((1, 2))) == sampling.top_k
    if sampling.top_p < 1:
        assert np.count_nonzero(exact.sum((1, 2))) < V

    # Token 2 is the first verify sample; token 3 depends on whether the draft was accepted.
    exact_12, exact_23 = exact.sum(2), exact.sum(0)
    bound_12, bound_23 = tv_bound(exact_12, N_SAMPLES), tv_bound(exact_23, N_SAMPLES)
    for which, emp, ex, bound in (("(t1, t2)", empirical.sum(2), exact_12, bound_12),
                                  ("(t2, t3)", empirical.sum(0), exact_23, bound_23)):
        assert tv(emp, ex) < bound, f"{which}: TV {tv(emp, ex):.3f} to the target's distribution >= {bound:.3f}"

    # Power: broken rules would fail these bounds (their samples would sit within their own
    # bound of their distribution, and that is farther than both bounds from the exact one).
    d1 = first_drafts(family)
    logits, p = exact_logits(family), len(SAMPLE_PROMPT)
    p1 = exact.sum((1, 2))
    p2_given_1 = exact.sum(2) / np.where(p1 > 0, p1, 1)[:, None]
    # "Accept every draft": token 3 is sampled after [t1, d1(t1)] even when t2 != d1(t1).
    p3_after_draft = exact_distribution(logits[np.arange(V), d1, p + 1], sampling)
    accept_all_23 = (p1[:, None, None] * p2_given_1[:, :, None] * p3_after_draft[:, None, :]).sum(0)
    assert tv(accept_all_23, exact_23) > bound_23 + tv_bound(accept_all_23, N_SAMPLES)
    # "The draft is token 2": the drafter's argmax replaces the target's sample.
    draft_is_token2 = p1[:, None] * np.eye(V)[d1]
    assert tv(draft_is_token2, exact_12) > bound_12 + tv_bound(draft_is_token2, N_SAMPLES)


# --------------------------------------------------------------------------- 5. reproducibility


@functools.cache
def sampling_engine(block_size, batch_size):
    target, tparams, drafter, dparams = sampling_setup()
    return BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                     block_size=block_size, batch_size=batch_size, max_new_tokens=16, max_prompt_len=16,
                     sampling=Sampling(temperature=1.0), speculation="fixed")


def test_seeded_sampling_is_reproducible_and_batch_independent():
    rs = np.random.RandomState(11)
    prompt_list = [rs.randint(0, V, n).tolist() for n in (4, 9, 1, 16, 7, 12)]
    indices = [5, 0, 17, 3, 8, 2]
    outputs = lambda gen, seed, ps=prompt_list, idx=indices: {
        r.index: r.output_ids for r in gen.generate(ps, seed=seed, indices=idx)}
    batch4 = sampling_engine(4, 4)
    first = outputs(batch4, 7)
    assert outputs(batch4, 7) == first
    assert outputs(sampling_engine(4, 1), 7) == first  # a row's output does not depend on its batch
    assert outputs(batch4, 7, prompt_list[::-1], indices[::-1]) == first  # nor on its place in it
    assert outputs(batch4, 8) != first
    assert len({tuple(o) for o in first.values()}) > 1
    # The sample for position t uses the key of (row, t) whatever the block size, so
    # speculative sampling reproduces plain sampling token for token, and so does a run
    # verifying fewer drafts per cycle.
    assert outputs(sampling_engine(1, 4), 7) == first
    target, tparams, drafter, dparams = sampling_setup()
    fewer = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=4, max_new_tokens=16,
                      max_prompt_len=16, sampling=Sampling(temperature=1.0), draft_tokens=1, speculation="fixed")
    assert outputs(fewer, 7) == first


# --------------------------------------------------------------------------- 6. logit processing


def random_logits(seed, shape=(64, 50)):
    return np.random.RandomState(seed).normal(0, 3, shape).astype(np.float32)


@pytest.mark.parametrize("k", [1, 5, 17])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = random_logits(0)
    out = np.asarray(processed_logits(jnp.asarray(logits), Sampling(temperature=0.5, top_k=k)))
    kept = out > NEG
    top = np.argsort(-logits, axis=-1)[:, :k]
    expected = np.zeros_like(kept)
    np.put_along_axis(expected, top, True, axis=-1)
    np.testing.assert_array_equal(kept, expected)
    np.testing.assert_allclose(out[kept], logits[kept] / 0.5, rtol=1e-6)


@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_keeps_smallest_prefix_reaching_p(top_p):
    logits = random_logits(1)
    temperature = 0.8
    keep, margin = numpy_top_p(logits.astype(np.float64) / temperature, top_p)
    assert margin > 1e-5
    out = np.asarray(processed_logits(jnp.asarray(logits), Sampling(temperature=temperature, top_p=top_p)))
    np.testing.assert_array_equal(out > NEG, keep)
    np.testing.assert_allclose(out[keep], logits[keep] / temperature, rtol=1e-6)
    if top_p == 0.1:
        assert (keep.sum(-1) == 1).any()  # the argmax alone can be enough


def test_top_k_then_top_p_and_target_distribution():
    logits = random_logits(2)
    sampling = Sampling(temperature=1.3, top_k=8, top_p=0.7)
    expected, margin = numpy_distribution(logits, sampling)
    assert margin > 1e-5
    assert ((expected > 0).sum(-1) < 8).any()  # top-p cut into the top-k survivors
    dist = np.asarray(target_distribution(jnp.asarray(logits), sampling))
    np.testing.assert_array_equal(dist > 0, expected > 0)
    np.testing.assert_allclose(dist, expected, atol=1e-6)
    greedy_dist = np.asarray(target_distribution(jnp.asarray(logits), Sampling()))
    np.testing.assert_array_equal(greedy_dist, np.eye(logits.shape[-1])[logits.argmax(-1)])


@pytest.mark.parametrize("kw", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)])
def test_bad_sampling_is_refused(kw):
    with pytest.raises(DFlashError):
        Sampling(**kw)


def test_top_k_beyond_the_vocabulary_keeps_everything_and_bad_indices_are_refused():
    logits = jnp.asarray(np.random.RandomState(0).randn(2, 12), jnp.float32)
    np.testing.assert_array_equal(np.asarray(processed_logits(logits, Sampling(1.0, top_k=50))), np.asarray(logits))
    gen = engine("qwen3-v8", 1, 1)
    with pytest.raises(DFlashError, match="row index -1 outside"):
        list(gen.generate([[1, 2]], indices=[-1]))
    with pytest.raises(DFlashError, match="2 indices for 1 prompts"):
        list(gen.generate([[1, 2]], indices=[0, 1]))


# --------------------------------------------------------------------------- 7. sampling per row


def test_each_row_samples_from_its_own_settings_distribution():
    """The one logits processor, with each row's own temperature, top-k and top-p (`RowSampling`
    from `rows_of`), gives each row the distribution a float64 reference of its settings gives
    (random logits: no ties at a cut-off); a greedy row's logits are left as they are."""
    from dflash_jax.engine.sampling import processed_rows, rows_of

    settings = [Sampling(0.5, top_k=5), Sampling(0.8, top_p=0.9), Sampling(1.0), Sampling(0.7, top_k=9, top_p=0.5),
                Sampling(1.0, top_k=80), Sampling()]
    logits = random_logits(3, (len(settings), 50))
    rows = jax.tree.map(jnp.asarray, rows_of(settings))
    got = np.asarray(jax.nn.softmax(processed_rows(jnp.asarray(logits)[:, None], rows), axis=-1))[:, 0]
    for row, s in enumerate(settings[:-1]):
        want, margin = numpy_distribution(logits[row:row + 1], s)
        assert margin > 1e-5
        np.testing.assert_array_equal(got[row] > 0, want[0] > 0)
        np.testing.assert_allclose(got[row], want[0], atol=1e-6)
    np.testing.assert_allclose(got[-1], np.asarray(jax.nn.softmax(logits[-1])), rtol=1e-5)


def test_logit_bias_and_a_constraint_reach_greedy_and_sampled_rows():
    """A row's logit bias (its RowSampling slots) moves its greedy pick and its sampled
    distribution, padding slots (-1) do nothing, another row is untouched; an `allowed` mask
    removes every other token from both."""
    from dflash_jax.engine.sampling import pick, processed_rows, rows_of

    logits = jnp.asarray(random_logits(4, (2, 3, 40)))  # 2 rows, 3 positions
    rows = rows_of([Sampling(), Sampling(1.0)])
    plain = jax.tree.map(jnp.asarray, rows)
    low = int(np.asarray(logits)[0, 0].argmin())
    rows.bias_ids[0, :2], rows.bias[0, :2] = (low, 7), (100.0, -100.0)
    rows.bias_ids[1, 5], rows.bias[1, 5] = low, 5.0
    biased = jax.tree.map(jnp.asarray, rows).replace(key=jnp.zeros((2, 2), jnp.uint32))
    plain = plain.replace(key=biased.key)
    positions = jnp.zeros((2, 3), jnp.int32)
    tokens = np.asarray(pick(logits, biased, positions))
    assert (tokens[0] == low).all()  # +100 makes the row's lowest logit its argmax
    np.testing.assert_array_equal(np.asarray(pick(logits, plain, positions))[0], np.asarray(logits)[0].argmax(-1))
    want = np.asarray(logits)[1].copy()
    want[:, low] += 5.0
    np.testing.assert_allclose(np.asarray(processed_rows(logits, biased))[1], want, rtol=1e-6)
    allowed = jnp.zeros((2, 3, 40), bool).at[:, :, 11].set(True)
    np.testing.assert_array_equal(np.asarray(pick(logits, biased, positions, allowed=allowed)), 11)
    probs = np.asarray(jax.nn.softmax(processed_rows(logits, biased, allowed), axis=-1))[1]
    np.testing.assert_allclose(probs[:, 11], 1.0)


def test_tied_logits_at_a_cut_off_share_their_fate():
    """Top-k and top-p keep every token tied with the cut-off (one implementation: the value
    cut), so which of two equal logits survives never depends on their index."""
    logits = np.full((1, 10), -5.0, np.float32)
    logits[0, [2, 6]] = 3.0
    logits[0, 4] = 4.0
    kept_k = np.asarray(processed_logits(jnp.asarray(logits), Sampling(1.0, top_k=2))) > NEG
    np.testing.assert_array_equal(np.flatnonzero(kept_k[0]), [2, 4, 6])
    kept_p = np.asarray(processed_logits(jnp.asarray(logits), Sampling(1.0, top_p=0.75))) > NEG
    np.testing.assert_array_equal(np.flatnonzero(kept_p[0]), [2, 4, 6])


@pytest.mark.heavy  # the everyday suite is at its budget; tests/test_streaming.py (heavy) serves such rows too
def test_rows_of_one_batch_sample_with_their_own_settings():
    """A per-row engine runs greedy and sampled rows in one batch and one compiled loop: each
    row's tokens equal those of an engine built with its setting alone, at the same key."""
    rs = np.random.RandomState(13)
    prompt_list = [rs.randint(0, V, n).tolist() for n in (4, 9, 1, 16, 7, 12)]
    target, tparams, drafter, dparams = sampling_setup()
    per_row = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=4, max_new_tokens=16,
                        max_prompt_len=16, sampling=Sampling(per_row=True), speculation="fixed")
    rows = [Sampling(), Sampling(1.0), Sampling(), Sampling(1.0), Sampling(1.0), Sampling()]
    got = by_index(per_row.generate(prompt_list, seed=7, sampling=rows))
    hot = by_index(sampling_engine(4, 4).generate(prompt_list, seed=7))
    cold = by_index(BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=4, max_new_tokens=16,
                              max_prompt_len=16, speculation="fixed").generate(prompt_list, seed=7))
    for r, s, h, c in zip(got, rows, hot, cold):
        assert r.output_ids == (c.output_ids if s.greedy else h.output_ids)
    assert [r.output_ids for r in hot] != [r.output_ids for r in cold]
    with pytest.raises(DFlashError, match="needs an engine built with Sampling"):
        list(sampling_engine(4, 4).generate(prompt_list[:1], sampling=[Sampling()]))
