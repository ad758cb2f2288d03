"""Logprobs at speculative speed (`Sampling.logprobs`, `EngineSpec.max_logprobs`): each emitted
token's logprob under the target's raw distribution (log-softmax of its logits) and its top
alternatives, read off the logits of the pass that produced the token (prefill's, the verify's at
each kept position; a tree's along its path), with no other pass. Speculative rows' logprobs equal
plain decoding's for the same tokens and a from-scratch reference (a full forward over prompt and
output), greedy and seeded sampled, rows asking and not asking in one batch; a streamed row's equal
its Result's; an engine without them (max_logprobs 0) compiles nothing for them."""

from __future__ import annotations

import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import forward, init_cache
from dflash_jax.engine import BatchEngine, Sampling
from dflash_jax.engine.sampling import MAX_LOGPROBS, SamplingError
from dflash_jax.engine.step import init_state, run_cycles
from dflash_jax.errors import DFlashError
from fixtures import V, by_index, sampling_setup, setup

ROWS = [Sampling(logprobs=3), Sampling(), Sampling(1.0, logprobs=5), Sampling(0.8, top_k=6, logprobs=0),
        Sampling(1.0), Sampling(logprobs=5)]
MAX = 5


def prompt_list(seed=13):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, V, n).tolist() for n in (4, 9, 1, 16, 7, 12)]


def reference(target, tparams, prompt, output, k):
    """(own, top ids, top logprobs) of output under a from-scratch forward over prompt + output."""
    tokens = np.asarray([list(prompt) + list(output)], np.int32)
    logits = forward(tparams, target, jnp.asarray(tokens), init_cache(target, 1, tokens.shape[1])).logits[0]
    lp = np.asarray(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))[len(prompt) - 1:-1]
    ids = np.argsort(-lp, axis=-1, kind="stable")[:, :k]
    return lp[np.arange(len(output)), output], ids, np.take_along_axis(lp, ids, axis=-1)


def check_rows(results, rows, prompts, target, tparams):
    for r, s, p in zip(results, rows, prompts):
        if s.logprobs is None:
            assert r.logprobs is None and r.top_logprobs is None
            continue
        assert len(r.logprobs) == len(r.top_logprobs) == len(r.output_ids) > 0
        assert all(len(t) == s.logprobs for t in r.top_logprobs)
        own, ids, top = reference(target, tparams, p, r.output_ids, s.logprobs)
        np.testing.assert_allclose(r.logprobs, own, atol=1e-5)
        if s.logprobs:
            np.testing.assert_array_equal([[i for i, _ in t] for t in r.top_logprobs], ids)
            np.testing.assert_allclose([[x for _, x in t] for t in r.top_logprobs], top, atol=1e-5)


def per_row_engine(block_size, **kw):
    target, tparams, drafter, dparams = sampling_setup()
    return BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                       block_size=block_size, batch_size=3, max_new_tokens=12, max_prompt_len=16,
                       sampling=Sampling(per_row=True), speculation="fixed", max_logprobs=MAX, **kw)


def test_speculative_logprobs_equal_plain_decodings_and_the_reference():
    """Greedy and seeded sampled rows, asking and not, in one batch: block 4's tokens and logprobs
    equal plain decoding's (block 1), and both equal a full forward's log-softmax."""
    target, tparams, _, _ = sampling_setup()
    prompts = prompt_list()
    runs = [by_index(per_row_engine(b).generate(prompts, seed=7, sampling=ROWS)) for b in (4, 1)]
    assert max(a for r in runs[0] for a in r.acceptance_lengths) > 1  # drafts were accepted
    for spec_row, plain_row, s in zip(*runs, ROWS):
        assert spec_row.output_ids == plain_row.output_ids
        if s.logprobs is not None:
            np.testing.assert_allclose(spec_row.logprobs, plain_row.logprobs, atol=1e-5)
            assert [[i for i, _ in t] for t in spec_row.top_logprobs] == [[i for i, _ in t] for t in plain_row.top_logprobs]
    for run in runs:
        check_rows(run, ROWS, prompts, target, tparams)


def test_a_draft_trees_logprobs_follow_its_path():
    target, tparams, _, _ = sampling_setup()
    prompts = prompt_list(5)
    results = by_index(per_row_engine(4, tree_budget=6).generate(prompts, seed=3, sampling=ROWS))
    assert max(a for r in results for a in r.acceptance_lengths) > 1
    check_rows(results, ROWS, prompts, target, tparams)


def test_logprobs_are_bounded_where_asked():
    for bad in (-1, MAX_LOGPROBS + 1, True, 2.0):
        with pytest.raises(SamplingError, match="logprobs must be an integer in 0..20"):
            Sampling(logprobs=bad)
    with pytest.raises(DFlashError, match="logprobs must be at most 5"):
        list(per_row_engine(4).generate([[1, 2]], sampling=[Sampling(logprobs=6)]))
    target, tparams, drafter, dparams = sampling_setup()
    plain = BatchEngine(target, tparams, None, None, block_size=1, batch_size=3, max_new_tokens=12,
                        max_prompt_len=16, sampling=Sampling(per_row=True))
    with pytest.raises(DFlashError, match="computes no logprobs"):
        list(plain.generate([[1, 2]], sampling=[Sampling(logprobs=0)]))


def test_an_engine_without_logprobs_computes_none():
    """max_logprobs 0: the state's logprob arrays are empty and the cycle loop holds no top-k; with it, it does."""
    texts = {}
    for n in (0, MAX):
        gen = per_row_engine(4) if n else BatchEngine(*sampling_setup(), block_size=4, batch_size=3, max_new_tokens=12,
                                                      max_prompt_len=16, sampling=Sampling(per_row=True),
                                                      speculation="fixed")
        state = jax.eval_shape(init_state, gen.spec, 3)
        assert state.top_ids.shape == ((3, 0, 0) if not n else (3, gen.spec.out_len, n))
        texts[n] = run_cycles.lower(gen.tparams, gen.dparams, gen.spec, state, gen.stop_ids, np.int32(1),
                                    np.bool_(False), stream=True).as_text()
    top_k = lambda text: len(re.findall(r"chlo\.top_k|TopK", text))
    assert top_k(texts[0]) == 0 and top_k(texts[MAX]) == 1


@pytest.mark.heavy  # the everyday suite's budget; the server's streamed shapes are checked everyday (test_serve.py)
def test_a_streamed_rows_logprobs_are_generates():
    """The serving engine emits each chunk's logprobs with its tokens: joined, they are the Result's
    and `generate`'s for the same rows; nothing compiles while serving rows that ask."""
    from dflash_jax.compiling import compiles
    from dflash_jax.engine.step import prefill
    from dflash_jax.engine.streaming import StreamRequest, StreamingEngine

    target, tparams, drafter, dparams = setup("qwen3-v8")
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=2, max_new_tokens=8,
                      max_prompt_len=16, sync_every=1, prefill_chunk=16, sampling=Sampling(per_row=True),
                      speculation="fixed", max_logprobs=4)
    rs = np.random.RandomState(3)
    prompts = [rs.randint(0, target.vocab_size, n).tolist() for n in (5, 16, 3, 11)]
    rows = [Sampling(logprobs=2), Sampling(1.0, logprobs=4), Sampling(), Sampling(1.0, logprobs=0)]
    want = by_index(gen.generate(prompts, sampling=rows, indices=range(4)))
    engine = StreamingEngine(gen, max_waiting=len(prompts))
    engine.warmup()
    warm = compiles(prefill), compiles(run_cycles)
    streamed = {i: ([], [], []) for i in range(len(prompts))}
    results, all_done = {}, threading.Event()

    def emitter(i):
        def emit(tokens, result, logprobs=None):
            streamed[i][0].extend(tokens)
            if logprobs is not None:
                assert len(logprobs[0]) == len(logprobs[1]) == len(tokens)
                streamed[i][1].extend(logprobs[0])
                streamed[i][2].extend(logprobs[1])
            if result is not None:
                results[i] = result
                if len(results) == len(prompts):
                    all_done.set()
        return emit

    engine.start()
    try:
        for i, (p, s) in enumerate(zip(prompts, rows)):
            engine.submit(StreamRequest(p, 8, emitter(i), s, row_id=i))
        assert all_done.wait(300)
        for i, s in enumerate(rows):
            tokens, own, top = streamed[i]
            assert tokens == results[i].output_ids == want[i].output_ids, i
            if s.logprobs is None:
                assert own == [] and results[i].logprobs is None
                continue
            assert own == results[i].logprobs and top == results[i].top_logprobs
            np.testing.assert_allclose(own, want[i].logprobs, atol=1e-5)
            assert [[t for t, _ in x] for x in top] == [[t for t, _ in x] for x in want[i].top_logprobs]
        check_rows([results[i] for i in range(4)], rows, prompts, target, tparams)
        assert (compiles(prefill), compiles(run_cycles)) == warm
        with pytest.raises(DFlashError, match="at most 4"):
            engine.submit(StreamRequest(prompts[0], 2, emitter(0), Sampling(logprobs=5)))
    finally:
        assert engine.close(timeout=60)


def test_dflash2_rejection_samplings_logprobs_are_the_verifys():
    """A DFlash2 drafter's sampled rows accept by rejection sampling (tokens of the target's
    distribution, not plain decoding's): their logprobs are still the target's own, a full forward's."""
    from test_dflash2 import dflash2_sampling_setup

    target, tparams, drafter, dparams = dflash2_sampling_setup()
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=3, max_new_tokens=12,
                      max_prompt_len=16, sampling=Sampling(per_row=True), speculation="fixed", max_logprobs=MAX)
    assert gen.spec.rejection
    prompts = prompt_list(8)
    results = by_index(gen.generate(prompts, seed=11, sampling=ROWS))
    assert max(a for r in results for a in r.acceptance_lengths) > 1
    check_rows(results, ROWS, prompts, target, tparams)
