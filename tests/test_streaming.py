"""The serving engine (`dflash_jax.engine.streaming.StreamingEngine`), without HTTP: requests fed
through its queue while others run stream the tokens `BatchEngine.generate` gives the same prompts
(greedy, and sampled with their own settings and streams), long prompts go in piece by piece
between cycles (rows being filled keep their caches: per-slot, a page pool with ring layers, a hybrid's
recurrent states), cancelled requests free their slots, and nothing compiles after warm-up; a
draft-tree engine (`tree_budget`) and a DFlash2 drafter (its sampled rows accepted by rejection
sampling against its selector's proposal) serve the same way.

Each engine of the full matrix compiles every prompt bucket at every admission width, the streaming
loop and the pieces (about a minute on a 2-core CPU), so those run with `-m heavy`; everyday, the
smallest serving engine (a Qwen3 pair of 8 tokens, 2 slots, one prompt bucket) streams greedy rows
as `generate` gives them. The server's own tests (tests/test_serve.py) cover the engine over HTTP.
"""

from __future__ import annotations

import threading
import time

import dataclasses

import jax
import numpy as np
import pytest

from dflash_jax.compiling import compiles
from dflash_jax.engine import BatchEngine, Sampling
from dflash_jax.engine.step import prefill, prefill_part, run_cycles
from dflash_jax.engine.streaming import QueueFull, StreamRequest, StreamingEngine
from dflash_jax.errors import DFlashError
from dflash_jax.dflash2 import DFlash2Config
from dflash_jax.drafter import init_drafter_params
from fixtures import setup

# name: (setup, page pool pages or None, draft-tree budget, a DFlash2 drafter); pieces of 16 tokens,
# prompts up to 64
CASES = {"qwen3": ("qwen3-v128", None, 0, False), "gpt_oss-pool": ("gpt_oss-v8", 24, 0, False),
         "qwen3_5": ("qwen3_5-v8", None, 0, False), "gpt_oss-pool-tree": ("gpt_oss-v8", 24, 6, False),
         "qwen3-pool-dflash2": ("qwen3-v128", 24, 0, True)}
LENGTHS = (5, 30, 12, 60, 3, 17, 40, 9, 22, 14, 64, 33)
LIMITS = (24, 7, 19, 24, 1, 24, 12, 24, 3, 22, 20, 24)


def programs():
    return compiles(prefill), compiles(prefill_part), compiles(run_cycles)


def serve(engine, prompts, limits, samplings, row_ids, gap=0.002):
    """Submit every prompt (a little apart, so that they join a running batch); returns each
    one's streamed tokens and Result."""
    streamed = {i: [] for i in range(len(prompts))}
    results, all_done = {}, threading.Event()

    def emitter(i):
        def emit(tokens, result):
            streamed[i].extend(tokens)
            if result is not None:
                results[i] = result
                if len(results) == len(prompts):
                    all_done.set()
        return emit

    for i, (p, n, s, r) in enumerate(zip(prompts, limits, samplings, row_ids)):
        engine.submit(StreamRequest(list(p), n, emitter(i), s, row_id=r))
        time.sleep(gap)
    assert all_done.wait(300), f"only {len(results)} of {len(prompts)} requests ended"
    return streamed, results


def test_a_small_serving_engine_streams_what_generate_gives():
    """Everyday: greedy rows joining a running batch of 2 slots stream, token for token, what
    `BatchEngine.generate` gives the same prompts with the same limits; nothing compiles while
    serving; through a page pool, whose figures say a row's pages are back when the row's end is
    heard (a scrape that sees no row running sees no page held)."""
    target, tparams, drafter, dparams = setup("qwen3-v8")
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=2, max_new_tokens=8,
                      max_prompt_len=16, sync_every=1, prefill_chunk=16, sampling=Sampling(per_row=True),
                      speculation="fixed", kv_pages=4, page_size=16)
    rs = np.random.RandomState(3)
    prompts = [rs.randint(0, target.vocab_size, n).tolist() for n in (5, 16, 3, 11, 1)]
    limits = (8, 3, 8, 5, 2)
    want = {r.index: r for r in gen.generate(prompts, max_new_tokens=list(limits))}
    engine = StreamingEngine(gen, max_waiting=len(prompts))
    assert not engine.interleaves and engine.warmup() == [16]
    warm = programs()
    engine.start()
    try:
        streamed, results = serve(engine, prompts, limits, [gen.spec.sampling] * len(prompts), range(len(prompts)))
        for i in range(len(prompts)):
            assert streamed[i] == results[i].output_ids == want[i].output_ids, i
            assert results[i].finish_reason == want[i].finish_reason == "length", i
            assert len(streamed[i]) == limits[i], i
        assert max(a for r in results.values() for a in r.acceptance_lengths) > 1  # drafts were accepted
        assert programs() == warm  # nothing compiled while serving
        assert engine.metrics.running == 0 and engine.metrics.requests["length"] == len(prompts)
        heard, ended = {}, threading.Event()

        def emit(tokens, result):
            if result is not None:
                with engine.metrics.lock:
                    heard.update(running=engine.metrics.running, pages=dict(engine.metrics.kv_pages))
                ended.set()

        engine.submit(StreamRequest(prompts[0], 4, emit, gen.spec.sampling, row_id=9))
        assert ended.wait(120)
        assert heard["running"] == 0 and heard["pages"]["held"] == 0 and heard["pages"]["total"] == 4, heard
    finally:
        assert engine.close(timeout=60)


@pytest.mark.heavy
@pytest.mark.parametrize("case", sorted(CASES))
def test_served_rows_equal_generate_and_long_prompts_go_in_pieces(case):
    name, pool, tree, dflash2 = CASES[case]
    target, tparams, drafter, dparams = setup(name)
    if dflash2:
        drafter = dataclasses.replace(drafter, dflash2=DFlash2Config(conv_group_size=8, selector_rank=8,
                                                                     selector_top_k=8))
        dparams = init_drafter_params(drafter, jax.random.PRNGKey(41))
    rs = np.random.RandomState(5)
    prompts = [rs.randint(0, target.vocab_size, n).tolist() for n in LENGTHS]
    kw = dict(block_size=4, batch_size=4, speculation="fixed", max_new_tokens=24, max_prompt_len=64, sync_every=1, prefill_chunk=16,
              page_size=8, kv_pages=pool, stop_token_ids=[1], tree_budget=tree)
    gen = BatchEngine(target, tparams, drafter, dparams, sampling=Sampling(per_row=True), **kw)
    engine = StreamingEngine(gen, max_waiting=len(prompts))
    assert engine.interleaves and engine.warmup() == [16]  # longer prompts: pieces of 16
    warm = programs()
    greedy = {r.index: r for r in BatchEngine(target, tparams, drafter, dparams, **kw).generate(
        prompts, max_new_tokens=list(LIMITS))}
    if tree:  # a draft tree's rows are plain decoding's
        plain = BatchEngine(target, tparams, None, None, **dict(kw, block_size=1, tree_budget=0)).generate(
            prompts, max_new_tokens=list(LIMITS))
        assert all(greedy[r.index].output_ids == r.output_ids for r in plain)
    samplings = [Sampling(1.0, top_k=5, per_row=True) if i % 3 == 0 else Sampling(per_row=True)
                 for i in range(len(prompts))]
    ids = [1000 + 7 * i for i in range(len(prompts))]
    mixed = {r.index: r for r in gen.generate(prompts, max_new_tokens=list(LIMITS), sampling=samplings, indices=ids)}
    assert gen.spec.rejection == dflash2
    warm = programs()
    engine.start()
    try:
        streamed, results = serve(engine, prompts, LIMITS, [Sampling(per_row=True)] * len(prompts),
                                  range(len(prompts)))
        for i in range(len(prompts)):
            assert streamed[i] == results[i].output_ids == greedy[i].output_ids, i
            assert results[i].finish_reason == greedy[i].finish_reason, i
        # Sampled and greedy rows in one batch, each with its own stream: as generate gives them.
        streamed, results = serve(engine, prompts, LIMITS, samplings, ids)
        for i in range(len(prompts)):
            assert streamed[i] == mixed[ids[i]].output_ids, i
        assert any(s.temperature > 0 and streamed[i] != greedy[i].output_ids for i, s in enumerate(samplings))
        assert programs() == warm  # nothing compiled while serving
        assert engine.metrics.running == 0 and engine.metrics.waiting == 0
        assert engine.metrics.requests["length"] + engine.metrics.requests["stop"] == 2 * len(prompts)
    finally:
        assert engine.close(timeout=60)


@pytest.mark.heavy
def test_cancelled_requests_free_their_slots_and_the_queue_is_bounded(monkeypatch):
    """... and the rows handed to `cancel` are never written by the host afterwards: jax may read a
    host array when the call runs, behind the one in flight (on a CPU from the array's own memory),
    and a cleared mask lost the cancel, so the row ran on into pages handed to a new row."""
    import dflash_jax.engine.streaming as streaming

    handed = []  # (the array cancel got, a copy of it then)

    def recorded(spec, state, rows):
        handed.append((rows, np.array(rows, copy=True)))
        return cancel(spec, state, rows)

    cancel = streaming.cancel
    monkeypatch.setattr(streaming, "cancel", recorded)
    target, tparams, drafter, dparams = setup("qwen3-v128")
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=2, max_new_tokens=24,
                    max_prompt_len=32, sync_every=1, prefill_chunk=16, sampling=Sampling(per_row=True), speculation="fixed")
    engine = StreamingEngine(gen, max_waiting=3)
    engine.warmup()
    rs = np.random.RandomState(6)
    prompts = [rs.randint(0, target.vocab_size, n).tolist() for n in (9, 30, 4, 20, 12)]
    want = {r.index: r.output_ids for r in gen.generate(prompts)}
    # Not started: requests queue up to max_waiting, then QueueFull.
    got: dict[int, list] = {}
    ended: dict[int, str] = {}

    def emitter(i, cancel_after=None):
        def emit(tokens, result):
            got.setdefault(i, []).extend(tokens)
            if cancel_after is not None and len(got[i]) >= cancel_after:
                reqs[i].cancelled = True
            if result is not None:
                ended[i] = result.finish_reason
        return emit

    reqs = {i: StreamRequest(prompts[i], 24, emitter(i, cancel_after=1 if i < 2 else None), row_id=i) for i in range(5)}
    for i in range(3):
        engine.submit(reqs[i])
    with pytest.raises(QueueFull):
        engine.submit(reqs[3])
    with pytest.raises(DFlashError, match="longer than the context"):
        engine.submit(StreamRequest([1] * 40, 4, emitter(9), row_id=9))
    engine.start()
    try:
        for i in (3, 4):
            deadline = time.time() + 120
            while True:
                try:
                    engine.submit(reqs[i])
                    break
                except QueueFull:
                    assert time.time() < deadline
                    time.sleep(0.05)
        deadline = time.time() + 300
        while len(ended) < 5:
            assert time.time() < deadline, ended
            time.sleep(0.05)
        assert ended[0] == ended[1] == "cancelled"  # each ended at the sync after its first tokens
        assert len(got[0]) < 24 and len(got[1]) < 24
        for i in (2, 3, 4):  # the slots they freed served the rest, which run as they would alone
            assert got[i] == want[i], i
        assert engine.metrics.running == 0 and engine.metrics.requests["cancelled"] == 2
        assert any(given.any() for _, given in handed)  # the cancelled rows went to the device
        assert all(np.array_equal(rows, given) for rows, given in handed)  # and no mask changed after
    finally:
        assert engine.close(timeout=60)
    with pytest.raises(DFlashError, match="shutting down"):
        engine.submit(StreamRequest(prompts[0], 4, emitter(8), row_id=8))
