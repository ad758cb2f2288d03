"""The portable implementation, the reference and the CPU path: a walk over the pages that can hold
a visible key, `first_page .. last_page`, in a `lax.fori_loop` whose trip count is computed on the
device from the rows' live lengths (flash-decoding: an online softmax across pages, float32
statistics). So a step costs what the rows have used, not what the cache was sized for, and no
score matrix is wider than one page. Sliding-window layers start the walk at the first page inside
the window. The drafter's block keys (never cached, with their own mask) and attention sinks join
the same softmax. It serves every layout: per-row caches, a page pool (through each row's page
table), a ring (logical page j at page j % the ring's pages)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.attention.metadata import AttentionMetadata, LayerKV
from dflash_jax.attention.softmax import NEG, online_update as _update, scores as _scores
from dflash_jax.kv import page_size_of, split_heads


def _page(buf, layer, start, size, rows, heads):
    """Keys or values of one page: [batch or len(rows), size, heads, head_dim] (a latent buffer: one head)."""
    _, batch, _, width = buf.shape
    page = jax.lax.dynamic_slice(buf, (layer, 0, start, 0), (1, batch, size, width))[0]
    page = page if rows is None else jnp.take(page, rows, axis=0, mode="clip")
    return split_heads(page, heads)


def attend(q, cache: LayerKV, meta: AttentionMetadata):
    """q [n, T, kv_heads, groups, head_dim] over one layer of the cache (and the block's keys,
    with the "block" kind) -> [n, T, kv_heads * groups * value dim] float32 (a latent cache: each page's
    keys are its two parts joined, its values the first, `meta.latent`)."""
    k_buf, v_buf, layer = cache.k, cache.v, cache.layer
    q_pos, kv_limit, rows, pages, sinks = meta.q_pos, meta.kv_limit, meta.rows, meta.pages, meta.sinks
    window, ring, scale = meta.window, meta.ring, meta.scale
    n, t, kv_heads, groups, d = q.shape
    if pages is None:
        max_len = k_buf.shape[2]
        page = page_size_of(max_len, meta.page_size)
        slots = max_len // page  # a ring's pages: logical page j is page j % slots
        load = lambda buf, j: _page(buf, layer, (j % slots if ring else j) * page, page, rows, kv_heads)  # noqa: E731
    else:  # a pool: page j of each query row is its table's entry j (past the pool: clamped, masked)
        page = k_buf.shape[2]
        max_len = pages.shape[1] * page
        table = jnp.clip(pages if rows is None else jnp.take(pages, rows, axis=0, mode="clip"), 0, k_buf.shape[1] - 1)
        load = lambda buf, j: split_heads(buf[layer, jnp.take(table, j, axis=1)], kv_heads)  # noqa: E731
    assert max_len % page == 0, (max_len, page)
    dv = k_buf.shape[-1] if meta.latent else d
    if meta.latent:  # a latent cache: a page's keys are its two parts, its values the first
        load_kv = lambda j: (lambda k: (jnp.concatenate([k, load(v_buf, j)], axis=-1), k))(load(k_buf, j))  # noqa: E731
    else:
        load_kv = lambda j: (load(k_buf, j), load(v_buf, j))  # noqa: E731
    carry = (jnp.full((n, kv_heads, groups, t), NEG, jnp.float32), jnp.zeros((n, kv_heads, groups, t), jnp.float32),
             jnp.zeros((n, kv_heads, groups, t, dv), jnp.float32))
    if sinks is not None:
        # A sink is a key every query sees, with its own logit and a zero value: the softmax
        # starts from it (running max = its logit, sum of weights = exp(0) = 1).
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None], (n, kv_heads, groups, t))
        carry = (m0, jnp.ones_like(m0), carry[2])
    if meta.has_block:
        carry = _update(carry, _scores(q, meta.block_k.astype(q.dtype), scale), meta.block_mask,
                        meta.block_v.astype(v_buf.dtype))

    # Pages that can hold a visible key: key positions < kv_limit, and (sliding window)
    # > q_pos - window. Bounds over the whole batch; the mask does the per-row work.
    last_page = ((kv_limit.max() if ring else jnp.minimum(kv_limit.max(), max_len)) + page - 1) // page
    first_page = jnp.int32(0)
    if window is not None:
        first_page = jnp.clip((q_pos.min() - window + 1) // page, 0, last_page)

    def body(j, carry):
        start = j * page
        k, v = load_kv(j)
        key_pos = start + jnp.arange(page)
        mask = key_pos[None, None, :] < kv_limit[:, :, None]
        if window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        if meta.selected is not None:  # sparse attention: the positions the indexer picked
            mask &= jax.lax.dynamic_slice_in_dim(meta.selected, start, page, axis=2)
        return _update(carry, _scores(q, k.astype(q.dtype), scale), mask, v)

    m, l, acc = jax.lax.fori_loop(first_page, last_page, body, carry)
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]  # [n, kv, g, T, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(n, t, kv_heads * groups * dv)
