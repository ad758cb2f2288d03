"""The page pool: K/V in one pool of pages shared by the rows, each row reaching its pages
through its page table (`BatchEngine(kv_pages=...)`).

- Attention over a pool equals attention over per-slot caches holding the same keys, for the
  portable walk and the TPU kernel (interpret mode), over every mask kind: the pages of other
  rows and the free pages hold large stale values that would change any output they leaked into.
- The paged write puts each position in its row's page, drops what falls in no page of the row
  (padding rows, positions past its reservation) and touches no other page.
- A sliding window's ring (the pages behind the window written over) attends as a full cache does.
- An engine on a pool decodes exactly the per-slot engine's tokens and acceptance lengths, with
  rows admitted only when the pool has their pages (admission waits while slots are free), pages
  handed back as rows finish (every table is empty at the end), stop tokens (a row stopped by its
  first token gives its pages back before any cycle), and every family's cache layout (heavy:
  Gemma 4's second group, gpt-oss's windows and sinks, the hybrid's states, plain decoding;
  sampling).
- In the same K/V memory, a mixed-length workload runs at least twice the concurrent rows.
- A prompt the pool can never hold, and a pool on a mesh that splits rows, are one-line errors.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import DFlashError
from dflash_jax.kv import write_kv
from dflash_jax.attention import pallas_tpu, walk
from test_attention import call
from dflash_jax.engine import BatchEngine, Sampling
from bench.timing import counted_generate
from fixtures import CHUNK, LIMITS, MAX_NEW, MAX_PROMPT, PAGE, by_index, engine, heavy, prompts, setup

LAYERS, P, PER_ROW, POOL = 2, 8, 6, 30
STALE = 50.0


def pool_of(k_slots, v_slots, lengths, rs):
    """The per-slot caches [layers, batch, PER_ROW * P, kv, d] as a pool of POOL pages: row b's
    first ceil(lengths[b] / P) pages scattered to random pool pages, every other page STALE."""
    batch = k_slots.shape[1]
    k_pool = np.full((LAYERS, POOL, P) + k_slots.shape[3:], STALE, np.float32)
    v_pool = np.full_like(k_pool, -STALE)
    table = np.full((batch, PER_ROW), POOL, np.int32)
    order = rs.permutation(POOL)
    used = 0
    for b in range(batch):
        n = -(-lengths[b] // P)
        table[b, :n] = order[used:used + n]
        used += n
        for j in range(n):
            k_pool[:, table[b, j]] = k_slots[:, b, j * P:(j + 1) * P]
            v_pool[:, table[b, j]] = v_slots[:, b, j * P:(j + 1) * P]
    return jnp.asarray(k_pool), jnp.asarray(v_pool), jnp.asarray(table)


@pytest.mark.parametrize("kind", ["verify", heavy("window"), "drafter", heavy("sinks"), "rows"])
def test_attention_over_a_pool_equals_per_slot_caches(kind):
    rs = np.random.RandomState(len(kind))
    n, t, kv, groups, d = 3, 4, 2, 4, 128
    batch = 4 if kind == "rows" else n
    offsets = np.array([0, 37, 21])
    q_pos = offsets[:, None] + np.arange(t)[None, :]
    kv_limit = q_pos + 1
    kw = {}
    if kind == "window":
        kw["window"] = 6
    elif kind == "drafter":  # the context below each row's length and the block's own keys
        kv_limit = np.broadcast_to(offsets[:, None], (n, t))
        mask = rs.rand(n, t, t) < 0.6
        mask[:, :, 0] = True
        kw["chunk"] = tuple(jnp.asarray(rs.randn(n, t, kv, d), jnp.float32) for _ in range(2)) + (jnp.asarray(mask),)
    elif kind == "sinks":
        kw["sinks"] = jnp.asarray(rs.randn(kv, groups) * 2, jnp.float32)
    elif kind == "rows":  # prefill into rows 3 and 0; the last query row is padding
        kw["rows"] = jnp.asarray([3, 0, batch])
    k_slots = rs.randn(LAYERS, batch, PER_ROW * P, kv, d).astype(np.float32)
    v_slots = rs.randn(*k_slots.shape).astype(np.float32)
    lengths = [int(kv_limit.max()) + 1] * batch  # each row holds the pages its queries can see
    k_pool, v_pool, table = pool_of(k_slots, v_slots, lengths, rs)
    args = (jnp.asarray(rs.randn(n, t, kv, groups, d), jnp.float32), jnp.asarray(q_pos))
    per_slot = call(walk, *args, jnp.asarray(k_slots), jnp.asarray(v_slots), 1, jnp.asarray(kv_limit), page_size=P, **kw)
    walked = call(walk, *args, k_pool, v_pool, 1, jnp.asarray(kv_limit), page_size=P, pages=table, **kw)
    kernel = call(pallas_tpu, *args, k_pool, v_pool, 1, jnp.asarray(kv_limit), page_size=P, pages=table, **kw)
    rows = slice(0, 2) if kind == "rows" else slice(None)
    np.testing.assert_allclose(np.asarray(walked)[rows], np.asarray(per_slot)[rows], atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(kernel)[rows], np.asarray(per_slot)[rows], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("layer", [1, None])
def test_a_paged_write_lands_in_the_rows_pages_only(layer):
    rs = np.random.RandomState(3)
    kv, d, t = 2, 4, 11
    table = np.full((3, PER_ROW), POOL, np.int32)
    table[0, :3] = [7, 2, 19]  # row 0 holds 3 pages (24 positions); row 1 none; row 2 two
    table[2, :2] = [0, 29]
    pool = jnp.full((LAYERS, POOL, P, kv * d), STALE)  # a position's heads one row
    rows, offsets = jnp.asarray([0, 2, 3]), jnp.asarray([5, 9, 0])  # row 3: padding (== batch)
    new = rs.randn(*((LAYERS,) if layer is None else ()), 3, t, kv, d).astype(np.float32)
    out = np.asarray(write_kv(pool, layer, jnp.asarray(new), offsets, rows, jnp.asarray(table)))
    expected = np.full(out.shape, STALE, np.float32)
    layers = slice(None) if layer is None else layer
    for i, (row, off) in enumerate(zip([0, 2], [5, 9])):
        for j in range(t):
            page = (off + j) // P
            if table[row, page] < POOL:  # row 2's position 16 onwards is past its two pages: dropped
                expected[layers, table[row, page], (off + j) % P] = new[..., i, j, :, :].reshape(*new.shape[:-4], -1)
    np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("rows", [None, heavy([2, 0, 1])])
def test_a_ring_holds_what_a_window_sees(rows):
    """A sliding-window group kept as a ring of 24 positions per row (window 10 plus chunks of 8):
    chunk after chunk written into it, attention over it (the walk, and the TPU kernel) equals
    attention over per-slot caches that keep every position, up to 51 positions (twice round)."""
    rs = np.random.RandomState(9)
    batch, kv, groups, d, window, t = 3, 2, 2, 128, 10, 8
    full = jnp.zeros((LAYERS, batch, 96, kv * d))
    ring = jnp.zeros((LAYERS, batch, 24, kv * d))
    caches = {"full": (full, full), "ring": (ring, ring)}
    kw = {} if rows is None else dict(rows=jnp.asarray(rows))
    for offset in range(0, 48, t):
        offsets = jnp.full((batch,), offset) + jnp.asarray([0, 3, 1])
        new = [jnp.asarray(rs.randn(batch, t, kv, d), jnp.float32) for _ in range(2)]
        for name, (k, v) in caches.items():
            caches[name] = tuple(write_kv(buf, 1, x, offsets, kw.get("rows"), ring=name == "ring")
                                 for buf, x in zip((k, v), new))
        q = jnp.asarray(rs.randn(batch, t, kv, groups, d), jnp.float32)
        q_pos = offsets[:, None] + jnp.arange(t)[None, :]  # query row i is cache row rows[i], written at offsets[i]
        want = call(walk, q, q_pos, *caches["full"], 1, q_pos + 1, window=window, page_size=P, **kw)
        walked = call(walk, q, q_pos, *caches["ring"], 1, q_pos + 1, window=window, page_size=P, ring=True, **kw)
        kernel = call(pallas_tpu, q, q_pos, *caches["ring"], 1, q_pos + 1, window=window, page_size=P, ring=True, **kw)
        np.testing.assert_allclose(np.asarray(walked), np.asarray(want), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(kernel), np.asarray(want), atol=2e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the engine


def pooled(name, block_size, batch_size, kv_pages, **kw):
    target, tparams, drafter, dparams = setup(name)
    kw = dict(dict(page_size=PAGE, speculation="fixed"), **kw)
    return BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                     block_size=block_size, batch_size=batch_size, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT,
                     prefill_chunk=CHUNK, kv_pages=kv_pages, **kw)


def run_recorded(gen, prompt_list, limits):
    """Results in order, the admissions (slots given, slots free at the time) and run calls."""
    admissions, calls = [], []
    admit = gen.admit

    def recording_admit(state, slots, *a, **kw):
        admissions.append((len(slots), int(np.asarray(state.done).sum())))
        return admit(state, slots, *a, **kw)

    gen.admit = recording_admit  # counted_generate wraps it, and removes both when done
    results, _, _ = counted_generate(gen, prompt_list, 0, limits, calls)
    assert "admit" not in vars(gen)
    return [results[i] for i in sorted(results)], admissions, calls


@pytest.mark.parametrize("name,block_size", [("qwen3-v8", 8), heavy("qwen3-v8", 1), heavy("gemma4-v8", 8),
                                             heavy("gpt_oss-v8", 8), heavy("qwen3_5-v8", 8)])
def test_a_pooled_engine_decodes_the_per_slot_tokens(name, block_size):
    """6 slots on 10 pages of 16 positions, where per-slot caches would hold 6 x 80 positions:
    prompts wait for pages while slots are free, and every row equals its per-slot run."""
    gen = pooled(name, block_size, 6, kv_pages=10)
    got, admissions, _ = run_recorded(gen, list(prompts(name)), list(LIMITS))
    ref = by_index(engine(name, block_size, 3).generate(list(prompts(name)), max_new_tokens=list(LIMITS)))
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    assert [r.acceptance_lengths for r in got] == [r.acceptance_lengths for r in ref]
    assert sum(n for n, _ in admissions) == len(LIMITS)
    assert any(n < free for n, free in admissions[1:])  # a prompt waited for pages, not for a slot
    assert (np.asarray(gen.idle_state.target_cache.pages) >= 10).all()  # every row gave its pages back
    cache = gen.idle_state.target_cache
    if name == "gemma4-v8":  # its sliding layers keep a ring of their window (6) + a chunk (16): 2 pages
        assert cache.ring and cache.k.shape[1:3] == (6, 32) and cache.k_global.shape[1:3] == (10, PAGE)
    if block_size > 1:
        assert (np.asarray(gen.idle_state.context_cache.pages) >= 10).all()


def test_rows_stopped_by_their_first_token_give_their_pages_back():
    """A stop token that some rows sample first: those rows are done at admission, before any
    cycle; their pages go to the next prompts at once, and nothing they ride along with writes
    into them (the tokens equal the per-slot engine's with the same stop token)."""
    name = "qwen3-v8"
    first = [r.output_ids[0] for r in by_index(engine(name, 8, 3).generate(list(prompts(name)),
                                                                           max_new_tokens=1))]
    stop = (max(set(first), key=first.count),)
    gen = pooled(name, 8, 4, kv_pages=8, stop_token_ids=stop)
    got, _, _ = run_recorded(gen, list(prompts(name)), list(LIMITS))
    ref = by_index(engine(name, 8, 3, stop=stop).generate(list(prompts(name)), max_new_tokens=list(LIMITS)))
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    stopped = [i for i, r in enumerate(got) if r.finish_reason == "stop" and len(r.output_ids) == 1]
    assert len(stopped) >= 2
    # On the device: admitted together, the row stopped at once holds no page, the other its own.
    going = next(i for i, r in enumerate(got) if len(r.output_ids) > 1)
    state = gen.admit(gen.new_state(), [0, 1], [prompts(name)[stopped[0]], prompts(name)[going]], [0, 1], [24, 24],
                      pages=[[0, 1, 2, 3], [4, 5, 6, 7]])
    tables = np.asarray(state.target_cache.pages)
    assert (tables[0] >= 8).all() and tables[1, :4].tolist() == [4, 5, 6, 7]
    assert (np.asarray(state.context_cache.pages) == tables).all()


def test_a_row_is_given_every_position_it_writes_and_no_more():
    """A row's cache holds prompt + generated - 1 positions, and its last cycle, started with at
    most max_new generated, writes the K + 1 verified tokens from there. With pages of one position
    the pages a row is given are exactly that bound, and the rows whose last cycle starts at
    max_new (a limit of 1, for one) reach it."""
    name, k = "qwen3-v8", 7
    results = by_index(engine(name, 8, 3).generate(list(prompts(name)), max_new_tokens=list(LIMITS)))
    gen = pooled(name, 8, 1, kv_pages=1, page_size=1)
    tight = 0
    for prompt, limit, r in zip(prompts(name), LIMITS, results):
        generated = 1 + sum(r.acceptance_lengths[:-1])  # at the start of the row's last cycle
        last = len(prompt) + generated - 1 + k  # the last position it writes
        assert last < gen.pages_needed(len(prompt), limit)
        tight += last == gen.pages_needed(len(prompt), limit) - 1
    assert tight >= 2


@pytest.mark.heavy  # a capacity figure (the bench's --page-pool); the pool's tokens are checked everyday
def test_the_same_memory_runs_twice_the_rows_of_a_mixed_workload():
    """Per-slot caches: 2 slots of 80 positions (32 prompt + 24 new + 16, in pages of 16) = 10
    pages. The pool: the same 10 pages for 8 slots. Short prompts and short limits (the mixed
    workload's common case) then run at least twice as many at a time, while prompts wait."""
    name = "qwen3-v8"
    prompt_list = [p[:max(2, len(p) // 4)] for p in prompts(name)] * 2
    limits = [2, 5, 3, 24, 4, 6, 2, 3, 8, 4, 5, 3] * 2
    per_slot = BatchEngine(*setup(name), block_size=8, batch_size=2, max_new_tokens=MAX_NEW, max_prompt_len=MAX_PROMPT,
                         page_size=PAGE, prefill_chunk=CHUNK, speculation="fixed")
    pool = pooled(name, 8, 8, kv_pages=10)
    assert per_slot.new_state().target_cache.k.size == pool.new_state().target_cache.k.size  # the same memory
    concurrency, outputs = {}, {}
    for key, gen in (("per_slot", per_slot), ("pool", pool)):
        results, _, calls = run_recorded(gen, prompt_list, limits)
        waiting = [(busy, n) for busy, n, until_free, _ in calls if until_free]
        concurrency[key] = sum(b * n for b, n in waiting) / sum(n for _, n in waiting)
        outputs[key] = [r.output_ids for r in results]
    assert outputs["pool"] == outputs["per_slot"]
    assert concurrency["per_slot"] <= 2
    assert concurrency["pool"] >= 2 * concurrency["per_slot"], concurrency


def test_what_a_pool_cannot_hold_is_refused():
    gen = pooled("qwen3-v8", 8, 2, kv_pages=2)  # 32 positions: a 30-token prompt + 24 new does not fit
    with pytest.raises(DFlashError, match=r"prompt 0: needs 4 pages of 16 positions \(30 prompt tokens \+ 24 new \+ 7 drafts\); the pool has 2: raise kv_pages"):
        list(gen.generate([list(prompts("qwen3-v8")[6])]))
    with pytest.raises(DFlashError, match="--kv-pages must be >= 1, got 0"):
        pooled("qwen3-v8", 8, 2, kv_pages=0)
    fake = type("Mesh", (), {"shape": {"data": 2, "model": 1}})()  # a mesh that splits rows (one device here)
    with pytest.raises(DFlashError, match="needs a mesh whose data axis is 1"):
        pooled("qwen3-v8", 8, 2, kv_pages=4, mesh=fake)


@pytest.mark.heavy
def test_sampling_on_a_pool_equals_per_slot_sampling():
    name = "qwen3-v8"
    sampling = Sampling(temperature=0.8, top_p=0.9)
    ref = by_index(engine(name, 8, 3, sampling=sampling).generate(list(prompts(name)), seed=4,
                                                                  max_new_tokens=list(LIMITS)))
    got = by_index(pooled(name, 8, 5, kv_pages=12, sampling=sampling).generate(list(prompts(name)), seed=4,
                                                                              max_new_tokens=list(LIMITS)))
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
