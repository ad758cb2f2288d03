"""Attention over a paged KV cache, and the cache writes: the one interface the target and the
drafter both attend through.

Layout. A cache buffer is `[layers, batch, max_len, kv_heads, head_dim]`, one buffer for
every layer, with a length per row kept beside it. `max_len` is a whole number of pages of
`PAGE_SIZE` positions (a cache shorter than one page is one page). A row's positions are
contiguous, so page j of row b is `buf[layer, b, j*P:(j+1)*P]`.

Writes (`write_kv`) scatter a chunk of new keys/values at each row's own offset straight into
that buffer: with the buffer donated (or carried by a loop), XLA updates it in place, and no
step copies or re-stacks the cache.

Reads (`attend`) walk the pages that can hold a visible key, `first_page .. last_page`, in a
`lax.fori_loop` whose trip count is computed on the device from the rows' live lengths
(flash-decoding: an online softmax across pages, float32 statistics). So a step costs what the
rows have used, not what the cache was sized for, and no score matrix is wider than one page.
Sliding-window layers start the walk at the first page inside the window. An optional `chunk`
(keys/values held in registers, with their own mask) joins the same softmax: the drafter's
block keys, which are never cached.

`attend` dispatches on `IMPLEMENTATIONS`, chosen by the platform traced for
(`dflash_jax.platform`): the portable plain-JAX walk below is the reference and the CPU path; on
a TPU, `attention_tpu.attend_pallas` is a Pallas kernel, ragged per row (each row reads its own
key blocks), with every mask kind and a cost estimate of the blocks it reads; on a GPU,
`attend_fused` runs cuDNN's fused attention (`jax.nn.dot_product_attention(implementation=
"cudnn")`) over the layer's cache with the same mask, and falls back to the walk for what cuDNN
cannot do (attention sinks, the drafter's uncached block keys). An implementation registers
under its backend with the same signature and must pass the same exactness tests.

An arbitrary in-block mask (a tree's) goes through `chunk`: the block's keys and values, with
their own [n, T, C] mask, beside the cached context below `kv_limit`.

Page pool. With a page table (`pages` [batch, pages per row] int32) the buffers are one pool
of pages shared by every row, `[layers, num_pages, page_size, kv_heads, head_dim]`, and page
j of row b is `buf[layer, pages[b, j]]`: rows of different lengths hold only the pages they
were given (`dflash_jax.engine.scheduler` hands them out and takes them back). An entry of
`num_pages` or more (`NO_PAGE`) is no page: writes to it are dropped and reads of it are masked
(they are past the row's length). Every implementation takes the same table; the GPU path walks
the pool (cuDNN's attention wants each row's keys contiguous).

Rings. A group whose layers all slide (Gemma 4's sliding layers; with a page pool, see
`KVCache.ring`) can keep, per row, only the last `ring` positions: position p lives at
`p % ring`, so the pages behind the window are written over by new ones and the group's memory is
its window's, not the row's length. A ring holds at least the window plus the longest chunk
written at once, so no key a query can see is overwritten before the query reads it
(`ring=True` to `write_kv` and `attend`; the buffer's length is the ring's).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from dflash_jax.kv import PAGE_SIZE, page_size_of

NEG = float(jnp.finfo(jnp.float32).min)


def _page(buf, layer, start, size, rows):
    """Keys or values of one page: [batch or len(rows), size, kv_heads, head_dim]."""
    _, batch, _, heads, dim = buf.shape
    page = jax.lax.dynamic_slice(buf, (layer, 0, start, 0, 0), (1, batch, size, heads, dim))[0]
    return page if rows is None else jnp.take(page, rows, axis=0, mode="clip")


def _scores(q, k, scale=None):
    """q [n, T, kv, groups, d], k [n, S, kv, d] -> [n, kv, groups, T, S] float32, scaled
    (by d ** -0.5 unless given)."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    return s * (q.shape[-1] ** -0.5 if scale is None else scale)


def _update(carry, scores, mask, v):
    """One step of the online softmax. carry (m, l, acc): running max [n, kv, g, T], sum of
    weights, and weighted values [n, kv, g, T, d], all float32; mask [n, T, S]."""
    m, l, acc = carry
    # Masked scores are -inf and the running max starts at the finite NEG, so exp gives them
    # weight 0 with no second select (one pass fewer over the scores).
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    m_new = jnp.maximum(m, scores.max(-1))
    p = jnp.exp(scores - m_new[..., None])
    alpha = jnp.exp(m - m_new)
    l = l * alpha + p.sum(-1)
    pv = jnp.einsum("bkgts,bskd->bkgtd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[..., None] + pv


def attend_pages_xla(q, q_pos, k_buf, v_buf, layer, kv_limit, *, window=None, chunk=None, rows=None,
                     page_size=PAGE_SIZE, sinks=None, scale=None, pages=None, ring=False):
    """The portable reference: see `attend`."""
    n, t, kv_heads, groups, d = q.shape
    if pages is None:
        max_len = k_buf.shape[2]
        page = page_size_of(max_len, page_size)
        slots = max_len // page  # a ring's pages: logical page j is page j % slots
        load = lambda buf, j: _page(buf, layer, (j % slots if ring else j) * page, page, rows)  # noqa: E731
    else:  # a pool: page j of each query row is its table's entry j (past the pool: clamped, masked)
        page = k_buf.shape[2]
        max_len = pages.shape[1] * page
        table = jnp.clip(pages if rows is None else jnp.take(pages, rows, axis=0, mode="clip"), 0, k_buf.shape[1] - 1)
        load = lambda buf, j: buf[layer, jnp.take(table, j, axis=1)]  # noqa: E731
    assert max_len % page == 0, (max_len, page)
    carry = (jnp.full((n, kv_heads, groups, t), NEG, jnp.float32), jnp.zeros((n, kv_heads, groups, t), jnp.float32),
             jnp.zeros((n, kv_heads, groups, t, d), jnp.float32))
    if sinks is not None:
        # A sink is a key every query sees, with its own logit and a zero value: the softmax
        # starts from it (running max = its logit, sum of weights = exp(0) = 1).
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, :, None], (n, kv_heads, groups, t))
        carry = (m0, jnp.ones_like(m0), carry[2])
    if chunk is not None:
        ck, cv, cmask = chunk
        carry = _update(carry, _scores(q, ck.astype(q.dtype), scale), cmask, cv.astype(v_buf.dtype))

    # Pages that can hold a visible key: key positions < kv_limit, and (sliding window)
    # > q_pos - window. Bounds over the whole batch; the mask does the per-row work.
    last_page = ((kv_limit.max() if ring else jnp.minimum(kv_limit.max(), max_len)) + page - 1) // page
    first_page = jnp.int32(0)
    if window is not None:
        first_page = jnp.clip((q_pos.min() - window + 1) // page, 0, last_page)

    def body(j, carry):
        start = j * page
        k, v = load(k_buf, j), load(v_buf, j)
        key_pos = start + jnp.arange(page)
        mask = key_pos[None, None, :] < kv_limit[:, :, None]
        if window is not None:
            mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
        return _update(carry, _scores(q, k.astype(q.dtype), scale), mask, v)

    m, l, acc = jax.lax.fori_loop(first_page, last_page, body, carry)
    out = acc / jnp.maximum(l, jnp.finfo(jnp.float32).tiny)[..., None]  # [n, kv, g, T, d]
    return out.transpose(0, 3, 1, 2, 4).reshape(n, t, kv_heads * groups * d)


def dense_attention(q, k, v, mask):
    """Attention with an arbitrary mask, every key at once (drafter training, where each block
    sees its own slice of the sequence): q [n, T, kv, groups, d], k/v [n, S, kv, d], mask
    [n, T, S] -> [n, T, kv * groups * d] float32. Not for decoding: it reads every key."""
    n, t, kv_heads, groups, d = q.shape
    scores = jnp.where(mask[:, None, None], _scores(q, k), NEG)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(n, t, kv_heads * groups * d)


def block_attention(q, ctx_k, ctx_v, ctx_mask, blk_k, blk_v, block_size: int):
    """Drafter training, every block of a sequence at once, without scoring one block against
    another: each query attends to the context keys its mask allows (the target's positions
    before its block's anchor) and to the keys of its own block (non-causally), under one
    softmax. The two score sets are merged by their common maximum (log-sum-exp), so the result
    is `dense_attention` over [context ; all blocks] with the same-block mask, at N*B*B block
    scores instead of (N*B)^2.

    q [n, T, kv, groups, d] with T = N*B (block j holds rows j*B .. j*B+B-1); ctx_k/v
    [n, S, kv, d]; ctx_mask [n, T, S]; blk_k/v [n, T, kv, d] -> [n, T, kv * groups * d] float32."""
    n, t, kv_heads, groups, d = q.shape
    nb = t // block_size
    ctx_scores = jnp.where(ctx_mask[:, None, None], _scores(q, ctx_k), NEG)  # [n, kv, g, T, S]
    # each block as a sequence of its own: [n * nb, kv, g, B, B] -> [n, kv, g, T, B]
    blk_scores = _scores(q.reshape(n * nb, block_size, kv_heads, groups, d),
                         blk_k.reshape(n * nb, block_size, kv_heads, d))
    blk_scores = blk_scores.reshape(n, nb, kv_heads, groups, block_size, block_size).transpose(0, 2, 3, 1, 4, 5)
    blk_scores = blk_scores.reshape(n, kv_heads, groups, t, block_size)
    m = jnp.maximum(ctx_scores.max(-1), blk_scores.max(-1))[..., None]  # a block always sees itself: finite
    p_ctx, p_blk = jnp.exp(ctx_scores - m), jnp.exp(blk_scores - m)
    total = p_ctx.sum(-1) + p_blk.sum(-1)
    out = jnp.einsum("bkgts,bskd->bkgtd", p_ctx.astype(ctx_v.dtype), ctx_v, preferred_element_type=jnp.float32)
    vb = blk_v.reshape(n, nb, block_size, kv_heads, d)
    p_blk = p_blk.reshape(n, kv_heads, groups, nb, block_size, block_size).astype(blk_v.dtype)
    out += jnp.einsum("bkgnij,bnjkd->bkgnid", p_blk, vb, preferred_element_type=jnp.float32).reshape(out.shape)
    out = out / total[..., None]
    return out.transpose(0, 3, 1, 2, 4).reshape(n, t, kv_heads * groups * d)


def attend_fused(q, q_pos, k_buf, v_buf, layer, kv_limit, *, window=None, chunk=None, rows=None,
                 page_size=PAGE_SIZE, sinks=None, scale=None, pages=None, ring=False, implementation: str = "cudnn"):
    """The GPU path: one fused attention (cuDNN flash attention through
    `jax.nn.dot_product_attention`) of the queries over the layer's whole cache, with the
    walk's mask (keys < kv_limit, inside the window) as a boolean mask: no score matrix in
    memory, no per-page loop. It reads the allocated cache, not only the pages in use, so it
    suits caches sized near the contexts served. Falls back to `attend_pages_xla` where cuDNN
    has no equivalent: attention sinks (gpt-oss), a chunk of uncached keys (the drafter's
    block), prefill into chosen rows (a row gather would copy their caches), a page pool or a ring
    (a row's keys are not in position order), and float32 (cuDNN's kernels are bfloat16/float16).
    `implementation="xla"` runs the same call through jax's reference implementation (the CPU
    tests)."""
    fallback = (sinks is not None or chunk is not None or rows is not None or pages is not None or ring
                or (implementation == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16)))
    if fallback:
        return attend_pages_xla(q, q_pos, k_buf, v_buf, layer, kv_limit, window=window, chunk=chunk, rows=rows,
                                page_size=page_size, sinks=sinks, scale=scale, pages=pages, ring=ring)
    n, t, kv_heads, groups, d = q.shape
    k, v = k_buf[layer], v_buf[layer]  # [batch, max_len, kv_heads, head_dim]
    key_pos = jnp.arange(k.shape[1])
    mask = key_pos[None, None, :] < kv_limit[:, :, None]
    if window is not None:
        mask &= key_pos[None, None, :] > q_pos[:, :, None] - window
    out = jax.nn.dot_product_attention(q.reshape(n, t, kv_heads * groups, d).astype(k.dtype), k, v,
                                       mask=mask[:, None], scale=d ** -0.5 if scale is None else scale,
                                       implementation=implementation)
    return out.reshape(n, t, kv_heads * groups * d).astype(jnp.float32)


def attend_tpu(*args, **kwargs):
    """The TPU path: the Pallas kernel of `dflash_jax.attention_tpu` (imported on first use)."""
    from dflash_jax.attention_tpu import attend_pallas
    return attend_pallas(*args, **kwargs)


# backend -> implementation; "default" serves every backend without its own kernel.
IMPLEMENTATIONS: dict[str, Callable] = {"default": attend_pages_xla, "gpu": attend_fused, "tpu": attend_tpu}


def implementation(backend: str | None = None) -> Callable:
    """The implementation for `backend` (default: the platform being traced for, which an
    ahead-of-time compile sets)."""
    from dflash_jax.platform import target_platform
    backend = backend or target_platform()
    return IMPLEMENTATIONS.get(backend, IMPLEMENTATIONS["default"])


def attend(q, q_pos, k_buf, v_buf, layer: int, kv_limit, *, window: int | None = None, chunk=None, rows=None,
           page_size: int = PAGE_SIZE, sinks=None, scale: float | None = None, pages=None, ring: bool = False):
    """Grouped-query attention of queries over one layer of a paged cache.

    q: [n, T, kv_heads, groups, head_dim] (rotated); q_pos: [n, T] their positions.
    k_buf, v_buf: [layers, batch, max_len, kv_heads, head_dim]; `layer` (static) picks one.
    kv_limit: [n, T] a query sees cached keys at positions < kv_limit (the target: q_pos + 1,
        causal over what it has just written; the drafter: the row's context length).
    window: sliding window, keys at positions > q_pos - window only.
    chunk: optional (k [n, C, kv_heads, head_dim], v, mask [n, T, C]) of keys not in the cache.
    rows: [n] batch rows of the buffer the queries belong to (default 0..n-1).
    page_size: the buffer's page (static): the walk reads whole pages.
    sinks: optional [kv_heads, groups] attention-sink logits (gpt-oss): one more term in each
        softmax's denominator, with no value.
    scale: the scores' scale (default head_dim ** -0.5; Gemma 4: 1, its q/k norms set the scale).
    pages: optional [batch, pages per row] page table: k_buf and v_buf are then a page pool
        [layers, num_pages, page_size, kv_heads, head_dim] (see the module's docstring).
    ring: the buffers are rings holding each row's last max_len positions (needs a window).
    Returns [n, T, kv_heads * groups * head_dim] in float32.
    """
    if ring:
        assert window is not None and pages is None, "a ring serves sliding-window layers of per-row caches"
    return implementation()(q, q_pos, k_buf, v_buf, layer, kv_limit, window=window, chunk=chunk, rows=rows,
                            page_size=page_size, sinks=sinks, scale=scale, pages=pages, ring=ring)
