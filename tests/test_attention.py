"""The paged cache and its attention (dflash_jax.attention), and that the compiled decoding
loop updates the caches in place.

- The page walk equals dense masked softmax attention (causal target queries, the drafter's
  context plus an in-register block, sliding windows, admission rows with padding).
- It reads only live pages: pages past the longest row (and, with a window, before it) are
  filled with NaN, which any read would spread into the output.
- Writes land at each row's own offset, drop padding rows, and leave everything else alone.
- The compiled `run_cycles` holds no copy or concatenate of a cache-sized array, and its XLA
  bytes do not grow with the allocated cache.
- The GPU path (`dflash_jax.attention.cudnn`: one fused attention over the layer's cache, cuDNN on
  a GPU) is selected on GPU and equals the walk, run here through the same call with jax's reference
  implementation; where cuDNN has no equivalent it is the walk itself.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import attention
from dflash_jax.attention import AttentionMetadata, LayerKV, attend, cudnn, override, select, walk
from dflash_jax.kv import cache_length, merge_heads, write_kv
from dflash_jax.drafter import init_drafter_params
from dflash_jax.engine import BatchEngine, run_cycles
from dflash_jax.model import init_params
from fixtures import drafter_config, model_config

LAYERS, BATCH, KV, GROUPS, D, PAGE = 2, 3, 2, 2, 8, 8


def metadata(q_pos, kv_limit, chunk=None, **layout):
    """The metadata of a call over the cache below kv_limit, with a chunk (k, v, mask) of block keys
    when given (already set, as `attend` sets them for the implementations)."""
    if chunk is None:
        return AttentionMetadata(q_pos=q_pos, kv_limit=kv_limit, **layout)
    ck, cv, cmask = chunk
    return AttentionMetadata(q_pos=q_pos, kv_limit=kv_limit, block_mask=cmask, block_k=ck, block_v=cv, mask="block",
                             **layout)


def stored(buf):
    """A test's [layers, batch, len, kv, d] buffer as the cache stores it: a position's heads one
    row (`merge_heads`); a latent's [layers, batch, len, dim] as it is."""
    return merge_heads(buf) if buf.ndim == 5 else buf


def call(implementation, q, q_pos, k, v, layer, kv_limit, *, options=None, chunk=None, **layout):
    """One implementation (a module of dflash_jax.attention, say `walk`) on a layer of buffers k, v."""
    return implementation.attend(q, LayerKV(stored(k), stored(v), layer), metadata(q_pos, kv_limit, chunk, **layout),
                                 **(options or {}))


def dense_reference(q, k, v, mask):
    """float64 numpy attention: q [n, T, kv, g, d], k/v [n, S, kv, d], mask [n, T, S]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    s = np.einsum("ntkgd,nskd->nkgts", q, k) / np.sqrt(q.shape[-1])
    s = np.where(mask[:, None, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    out = np.einsum("nkgts,nskd->ntkgd", p, v)
    return out.reshape(q.shape[0], q.shape[1], -1)


def random_buffers(seed, length, stale_from=None):
    """k, v [layers, batch, length, kv, d]. Positions >= stale_from[b] hold stale values, large
    enough to change any output they leak into; whole pages past the longest row hold NaN, which
    a read of the page would spread even where the mask gives it weight 0."""
    rs = np.random.RandomState(seed)
    k = rs.randn(LAYERS, BATCH, length, KV, D).astype(np.float32)
    v = rs.randn(LAYERS, BATCH, length, KV, D).astype(np.float32)
    if stale_from is not None:
        for b, start in enumerate(stale_from):
            k[:, b, start:] = 30.0
            v[:, b, start:] = 1e3
        dead = -(-max(stale_from) // PAGE) * PAGE
        k[:, :, dead:] = np.nan
        v[:, :, dead:] = np.nan
    return k, v


@pytest.mark.parametrize("window", [None, 5])
def test_causal_page_walk_equals_dense_attention_and_skips_dead_pages(window):
    length = 6 * PAGE
    offsets = np.array([19, 33, 25])  # the rows' lengths before this chunk
    t = 4
    q_pos = offsets[:, None] + np.arange(t)[None, :]
    # Positions past the longest row's last query, rounded up to a page, are never read: NaN there.
    live_end = -(-(q_pos.max() + 1) // PAGE) * PAGE
    k, v = random_buffers(0, length)
    k[:, :, live_end:] = np.nan
    v[:, :, live_end:] = np.nan
    if window is not None:  # and neither are pages wholly before every row's window
        first = (q_pos.min() - window + 1) // PAGE * PAGE
        k[:, :, :first] = np.nan
        v[:, :, :first] = np.nan
    q = np.random.RandomState(1).randn(BATCH, t, KV, GROUPS, D).astype(np.float32)
    out, _ = attend(jnp.asarray(q), None, None, LayerKV(merge_heads(jnp.asarray(k)), merge_heads(jnp.asarray(v)), 1),
                    AttentionMetadata.causal(jnp.asarray(q_pos), window=window, page_size=PAGE))
    key_pos = np.arange(length)
    mask = key_pos[None, None, :] <= q_pos[:, :, None]
    if window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
    expected = dense_reference(q, np.nan_to_num(k[1]), np.nan_to_num(v[1]), mask)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), expected, atol=2e-5)


def test_context_pages_plus_block_chunk_equal_dense_attention():
    """The drafter's attention: every block query sees the row's context (positions < its
    length, across pages) and the whole block, whose keys are never cached."""
    lengths = np.array([1, 20, 11])
    b = 5
    k, v = random_buffers(2, 4 * PAGE, stale_from=lengths)
    rs = np.random.RandomState(3)
    q = rs.randn(BATCH, b, KV, GROUPS, D).astype(np.float32)
    bk, bv = rs.randn(BATCH, b, KV, D).astype(np.float32), rs.randn(BATCH, b, KV, D).astype(np.float32)
    positions = lengths[:, None] + np.arange(b)[None, :]
    limit = np.broadcast_to(lengths[:, None], (BATCH, b))
    out, _ = attend(jnp.asarray(q), jnp.asarray(bk), jnp.asarray(bv),
                    LayerKV(merge_heads(jnp.asarray(k)), merge_heads(jnp.asarray(v)), 0),
                    AttentionMetadata.block(jnp.asarray(positions), jnp.asarray(lengths), jnp.ones((BATCH, b, b), bool),
                                            page_size=PAGE))
    keys = np.concatenate([np.nan_to_num(k[0]), bk], 1)
    values = np.concatenate([np.nan_to_num(v[0]), bv], 1)
    mask = np.concatenate([np.arange(4 * PAGE)[None, None, :] < limit[:, :, None], np.ones((BATCH, b, b), bool)], -1)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_allclose(np.asarray(out), dense_reference(q, keys, values, mask), atol=2e-5)


def test_writes_go_to_each_rows_offset_and_padding_rows_write_nothing():
    buf = jnp.zeros((LAYERS, BATCH, 4 * PAGE, KV * D))  # a position's heads one row
    new = jnp.asarray(np.random.RandomState(4).randn(2, 3, KV, D), jnp.float32) + 10
    # Two rows written (cache rows 2 and 0) and one padding row (row index BATCH).
    rows, offsets = jnp.asarray([2, 0]), jnp.asarray([5, 20])
    out = np.asarray(write_kv(buf, 1, new, offsets, rows))
    expected = np.zeros(buf.shape, np.float32)
    expected[1, 2, 5:8] = merge_heads(new[0])
    expected[1, 0, 20:23] = merge_heads(new[1])
    np.testing.assert_array_equal(out, expected)
    padded = write_kv(buf, 1, jnp.concatenate([new, new[:1]]), jnp.asarray([5, 20, 0]), jnp.asarray([2, 0, BATCH]))
    np.testing.assert_array_equal(np.asarray(padded), expected)
    # Every layer at once (the drafter's context): new is [layers, n, T, kv, d].
    both = np.asarray(write_kv(buf, None, jnp.stack([new, 2 * new]), offsets, rows))
    assert (both[0, 2, 5:8] == merge_heads(new[0])).all() and (both[1, 0, 20:23] == merge_heads(2 * new[1])).all()
    # As stored (the rows merged already) is the same write.
    np.testing.assert_array_equal(np.asarray(write_kv(buf, 1, merge_heads(new), offsets, rows)), expected)
    assert np.count_nonzero(both) == 2 * np.count_nonzero(expected)


def test_cache_length_is_whole_pages():
    assert cache_length(5, 8) == 5 and cache_length(8, 8) == 8 and cache_length(9, 8) == 16
    assert cache_length(1056) == 1152


# --------------------------------------------------------------------------- in-place loop

CACHE_OP = re.compile(r"=\s*(\w+)\[([\d,]*)\]\S*\s+(copy|concatenate)\(")


def cache_sized_copies(hlo: str, cache_elements: int) -> list[str]:
    """copy / concatenate instructions whose result has at least cache_elements elements."""
    found = []
    for line in hlo.splitlines():
        m = CACHE_OP.search(line)
        if m and m.group(2) and np.prod([int(x) for x in m.group(2).split(",")]) >= cache_elements:
            found.append(line.strip()[:160])
    return found


def small_engine(max_prompt_len):
    target = model_config("qwen3", 64, 3)
    drafter = drafter_config(target, 2, (0, 2), block_size=4)
    return BatchEngine(target, init_params(target), drafter, init_drafter_params(drafter), batch_size=2,
                     max_new_tokens=16, max_prompt_len=max_prompt_len, page_size=PAGE, speculation="fixed")


def small_engine_tokens(prompts=((5, 9, 3, 7, 1, 4), (2, 8, 6))):
    """The small DFlash engine's output tokens and acceptance lengths for `prompts`, in order."""
    res = sorted(small_engine(16).generate([list(p) for p in prompts]), key=lambda r: r.index)
    return [r.output_ids for r in res], [r.acceptance_lengths for r in res]


def compiled_loop(gen):
    state = jax.eval_shape(gen.new_state)
    return run_cycles.lower(gen.tparams, gen.dparams, gen.spec, state, gen.stop_ids, np.int32(4),
                            np.bool_(False)).compile()


def test_run_cycles_updates_the_caches_in_place():
    gen = small_engine(64)
    state = jax.eval_shape(gen.new_state)
    smallest = min(state.target_cache.k.size, state.context_cache.k.size)
    hlo = compiled_loop(gen).as_text()
    assert "while" in hlo and "dynamic-update-slice" in hlo
    assert cache_sized_copies(hlo, smallest) == []

    # The check sees the old engine's pattern: slices updated per layer and re-stacked.
    def restack(k, new):
        return jnp.stack([jax.lax.dynamic_update_slice_in_dim(k[i], new, 3, axis=1) for i in range(k.shape[0])])

    bad = jax.jit(restack).lower(state.target_cache.k, jnp.ones((2, 1, state.target_cache.k.shape[-1]))).compile().as_text()
    assert cache_sized_copies(bad, smallest)


def test_loop_bytes_do_not_grow_with_the_allocated_cache():
    """XLA's bytes for the compiled loop, a cache of 64 + 16 + 8 positions against 1024 + ...:
    the same, because nothing reads or copies the whole cache."""
    cost = lambda c: (c[0] if isinstance(c, list) else c)["bytes accessed"]
    small, large = small_engine(64), small_engine(1024)
    assert jax.eval_shape(large.new_state).target_cache.k.shape[2] >= 8 * jax.eval_shape(
        small.new_state).target_cache.k.shape[2]
    assert cost(compiled_loop(small).cost_analysis()) == cost(compiled_loop(large).cost_analysis())


@pytest.mark.parametrize("kv,groups,d", [(2, 1, 64), (2, 4, 128), (1, 8, 256)])
@pytest.mark.parametrize("window,scale", [(None, None), (6, None), (None, 0.5)])
def test_fused_path_equals_the_page_walk(kv, groups, d, window, scale):
    """Ragged rows (their own offsets and lengths; one row with a 1-token verify at position 0),
    GQA ratios, head dims, a sliding window and a scale override: the fused call equals the walk."""
    rs = np.random.RandomState(kv * 100 + groups * 10 + d)
    length, t, n = 4 * PAGE, 5, 3
    offsets = np.array([0, 13, 21])
    q_pos = offsets[:, None] + np.arange(t)[None, :]
    k = jnp.asarray(rs.randn(LAYERS, n, length, kv, d), jnp.float32)
    v = jnp.asarray(rs.randn(LAYERS, n, length, kv, d), jnp.float32)
    q = jnp.asarray(rs.randn(n, t, kv, groups, d), jnp.float32)
    args = (q, jnp.asarray(q_pos), k, v, 1, jnp.asarray(q_pos + 1))
    walked = call(walk, *args, window=window, page_size=PAGE, scale=scale)
    fused = call(cudnn, *args, window=window, page_size=PAGE, scale=scale, options=dict(implementation="xla"))
    np.testing.assert_allclose(np.asarray(fused), np.asarray(walked), atol=2e-5, rtol=1e-5)


def test_fused_path_is_the_gpus_and_falls_back_to_the_walk():
    def selected(platform, dtype=jnp.bfloat16, **extra):
        q = jnp.zeros((BATCH, 2, KV, GROUPS, D), dtype)
        return select(metadata(jnp.zeros((BATCH, 2), jnp.int32), jnp.ones((BATCH, 2), jnp.int32), **extra), q,
                      LayerKV(jnp.zeros((LAYERS, BATCH, 2 * PAGE, KV * D)), jnp.zeros((LAYERS, BATCH, 2 * PAGE, KV * D)), 0),
                      platform)[0]

    assert selected("gpu") == "cudnn" and attention.IMPLEMENTATIONS["cudnn"] == cudnn.__name__
    assert selected("cpu") == "walk"
    rs = np.random.RandomState(7)
    k, v = (jnp.asarray(rs.randn(LAYERS, BATCH, 2 * PAGE, KV, D), jnp.float32) for _ in range(2))
    q = jnp.asarray(rs.randn(BATCH, 2, KV, GROUPS, D), jnp.float32)
    q_pos = jnp.asarray([[3, 4], [9, 10], [0, 1]])
    sinks = jnp.asarray(rs.randn(KV, GROUPS), jnp.float32)
    chunk = (jnp.asarray(rs.randn(BATCH, 2, KV, D), jnp.float32), jnp.asarray(rs.randn(BATCH, 2, KV, D), jnp.float32),
             jnp.ones((BATCH, 2, 2), bool))
    def selected_call(**extra):  # through `attend`, as the engine calls it, with the GPU path chosen
        return attention.selection.run(q, LayerKV(merge_heads(k), merge_heads(v), 0), metadata(q_pos, q_pos + 1, page_size=PAGE, **extra),
                                       "gpu")

    for extra in (dict(sinks=sinks), dict(chunk=chunk), dict(rows=jnp.asarray([2, 0, 1]))):
        assert selected("gpu", **extra) == "walk"
        walked = call(walk, q, q_pos, k, v, 0, q_pos + 1, page_size=PAGE, **extra)
        with override("cudnn", implementation="xla"):
            fused = selected_call(**extra)
        np.testing.assert_array_equal(np.asarray(fused), np.asarray(walked))  # the walk itself
    # float32 on cuDNN: the walk (cuDNN's fused kernels are bfloat16 / float16)
    assert selected("gpu", jnp.float32) == "walk"
    walked = call(walk, q, q_pos, k, v, 0, q_pos + 1, page_size=PAGE)
    np.testing.assert_array_equal(np.asarray(selected_call()), np.asarray(walked))


def test_engine_on_the_fused_path_decodes_as_on_the_walk(monkeypatch):
    """The engine with the GPU path selected (through jax's reference implementation here): the
    target's decode and verify attend through it, the drafter falls back to the walk; the tokens
    and acceptance lengths are the walk's."""
    from dflash_jax.attention import selection

    walked = small_engine_tokens()
    calls = []
    select_ = selection.select

    def recorded(*args):  # which calls the fused path served
        name, reason = select_(*args)
        calls.append(name == "cudnn")
        return name, reason

    monkeypatch.setattr(selection, "select", recorded)
    jax.clear_caches()
    with override("cudnn", implementation="xla"):
        assert small_engine_tokens() == walked
    assert any(calls) and not all(calls)  # the target's decode/verify took it; the drafter and prefill fell back
