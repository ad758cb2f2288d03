"""The TPU implementation: a Pallas (Mosaic) kernel with the results of the portable walk
(`dflash_jax.attention.walk`), the one `dflash_jax.attention.select` picks on a TPU.

Grid: (query row, query tile, key block). Each step copies one block of `block` cache
positions of the row's own batch row (all K/V heads, one row a position as the cache stores them,
each head a static lane slice of it) into VMEM and
folds it into an online softmax held in VMEM scratch (float32 running max, sum and values per
K/V head). The key-block axis is ragged: its index map starts at the first block a query of
the tile can see (sliding windows) and stops at the last block holding a key below the tile's
`kv_limit`; steps past the row's last block keep the same block index, so the pipeline copies
nothing and the step computes nothing. A row reads the blocks it uses, not what the cache was
sized for. With a page pool (a page table per row) a block is one page, and the index map
finds it through the row's table (scalar-prefetched with the bounds), so a row's pages may lie
anywhere in the pool. In a ring (a sliding-window group keeping only its window) logical block
b is block b % the ring's blocks, and the grid's key-block axis spans a window, not the cache.

Masks, in the kernel: a query sees cached keys at positions < its own `kv_limit` (causal at the
row's offset for the target's verify, the context length for the drafter) and, with a window,
> its position - window. The drafter's block keys (`chunk`, never cached, with their own
arbitrary [n, T, C] mask: the drafter's non-causal block, or a tree's in-block mask) and
attention sinks join the kernel's softmax statistics afterwards, outside the kernel: they are
a few keys, and merging two online-softmax states is exact.

The compiler cannot see into the kernel, so its `pl.CostEstimate` declares the bytes and flops
of the blocks a row reads: the `expected_live` option (a benchmark sets it to the context it models,
through `dflash_jax.attention.override("pallas", expected_live=n)`) says how many cache positions a
row holds; without it the kernel is charged the whole cache.

Off a TPU the kernel runs in Pallas's TPU interpret mode (the tests, on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from dflash_jax.attention.metadata import AttentionMetadata, LayerKV
from dflash_jax.attention.softmax import NEG
from dflash_jax.kv import page_size_of
from dflash_jax.platform import target_platform

Q_ROWS = 256  # at most this many query rows (queries x heads per K/V head) per tile
BLOCK = 512  # at most this many cache positions per grid step (a divisor of the cache length, at least a page)
# VMEM the pipeline's buffers may take (the default scoped VMEM limit is 16 MiB on v4 and v5): K and V
# blocks double-buffered, and a query tile's queries and output (double-buffered) and float32 sums.
KV_VMEM = 8 << 20
Q_VMEM = 4 << 20

def _block_len(max_len: int, page: int, position_bytes: int) -> int:
    """The largest multiple of the page, at most BLOCK, that divides the cache length and whose
    K and V blocks, double-buffered, fit KV_VMEM (position_bytes: one position's K/V heads)."""
    most = max(page, min(BLOCK, KV_VMEM // (4 * position_bytes) // page * page))
    if max_len <= most:
        return max_len
    for size in range(most, page - 1, -page):
        if max_len % size == 0:
            return size
    return page


def _fold(q_ref, k_ref, v_ref, mask, m_scr, l_scr, acc_scr, kv_heads: int, scale: float, latent: bool = False,
          rows: bool = True):
    """One online-softmax step per K/V head over a block of keys: the walk's `softmax.online_update`,
    with masked scores at -inf and the running max from the finite NEG. rows: a cache block,
    [keys, kv_heads * d] (head h: lanes h*d .. h*d + d, a static slice); else the block's keys,
    [keys, kv_heads, d]. latent (one head; k_ref [keys, dk], v_ref [keys, dr]): the keys are [k ; v],
    the values k."""
    d = q_ref.shape[-1]
    head = lambda ref, h: ref[:, h * d:(h + 1) * d] if rows else ref[:, h, :]  # noqa: E731
    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)  # noqa: E731
    for h in range(kv_heads):
        q = q_ref[h]  # [rows, d]
        if latent:  # the scores in two dots over the latent's two parts: no joined copy of the block
            dk = k_ref.shape[-1]
            s = (dot(q[:, :dk], k_ref[...].astype(q.dtype)) + dot(q[:, dk:], v_ref[...].astype(q.dtype))) * scale
        else:
            s = dot(q, head(k_ref, h).astype(q.dtype)) * scale
        s = jnp.where(mask, s, -jnp.inf)
        m_prev = m_scr[h]
        m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
        p = jnp.exp(s - m_new)
        alpha = jnp.exp(m_prev - m_new)
        v = k_ref[...] if latent else head(v_ref, h)
        m_scr[h] = m_new
        l_scr[h] = l_scr[h] * alpha + p.sum(axis=-1, keepdims=True)
        acc_scr[h] = acc_scr[h] * alpha + jax.lax.dot_general(
            p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)


def _kernel(rows_ref, lo_ref, hi_ref, *refs, n_tiles: int, block: int, kv_heads: int, window: int | None,
            scale: float, has_sinks: bool, has_chunk: bool, paged: bool, latent: bool = False):
    del rows_ref  # used by the index maps only (as is a pool's page table)
    refs = list(refs[1:] if paged else refs)
    q_ref, pos_ref, lim_ref = refs[:3]
    sink_ref = refs.pop(3) if has_sinks else None
    ck_ref, cv_ref, cmask_ref = (refs.pop(3), refs.pop(3), refs.pop(3)) if has_chunk else (None, None, None)
    k_ref, v_ref, out_ref, m_scr, l_scr, acc_scr = refs[3:]
    b, t, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    tile = b * n_tiles + t
    blk = lo_ref[tile] + j

    @pl.when(j == 0)
    def _init():
        if has_sinks:  # a key every query sees, with its own logit and no value
            m_scr[...] = sink_ref[...]
            l_scr[...] = jnp.ones(l_scr.shape, jnp.float32)
        else:
            m_scr[...] = jnp.full(m_scr.shape, NEG, jnp.float32)
            l_scr[...] = jnp.zeros(l_scr.shape, jnp.float32)
        acc_scr[...] = jnp.zeros(acc_scr.shape, jnp.float32)
        if has_chunk:
            _fold(q_ref, ck_ref, cv_ref, cmask_ref[...] != 0, m_scr, l_scr, acc_scr, kv_heads, scale,
                  rows=False)  # block values given

    @pl.when(blk < hi_ref[tile])
    def _cache():
        key_pos = blk * block + jax.lax.broadcasted_iota(jnp.int32, (1, block), 1)
        mask = key_pos < lim_ref[...]  # [rows, block]
        if window is not None:
            mask &= key_pos > pos_ref[...] - window
        _fold(q_ref, k_ref, v_ref, mask, m_scr, l_scr, acc_scr, kv_heads, scale, latent)

    @pl.when(j == pl.num_programs(2) - 1)
    def _store():
        out_ref[...] = (acc_scr[...] / jnp.maximum(l_scr[...], jnp.finfo(jnp.float32).tiny)).astype(out_ref.dtype)


def attend(q, cache: LayerKV, meta: AttentionMetadata, interpret=None, expected_live: int | None = None):
    """q [n, T, kv_heads, groups, head_dim] over one layer of the cache by the kernel (see the
    module's docstring) -> [n, T, kv_heads * groups * head_dim] in q's dtype. interpret=None runs the
    kernel compiled on a TPU and in TPU interpret mode elsewhere; expected_live: the positions a
    row holds, for the cost estimate (default: the whole cache).

    Under a mesh (the engine traces under its own, `jax.sharding.use_abstract_mesh`) the kernel
    runs per device in a shard_map: K/V heads over `model`, rows over `data`, as the sharding
    rules store the cache (XLA cannot partition a Mosaic kernel itself). What it cannot split
    (chosen rows or a page pool with rows over `data`) `select` sends to the walk."""
    layer, k_buf, v_buf = cache.layer, cache.k, cache.v
    chunk = (meta.block_k, meta.block_v, meta.block_mask) if meta.has_block else None
    kw = dict(window=meta.window, page_size=meta.page_size, scale=meta.scale, ring=meta.ring, interpret=interpret,
              expected_live=expected_live, latent=meta.latent)
    extra = {k: v for k, v in dict(chunk=chunk, sinks=meta.sinks, rows=meta.rows, pages=meta.pages).items()
             if v is not None}
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1:
        return _attend(q, meta.q_pos, k_buf, v_buf, layer, meta.kv_limit, **extra, **kw)
    from jax.sharding import PartitionSpec as P

    n, kv_heads, groups = q.shape[0], q.shape[2], q.shape[3]
    split = lambda axis, size: axis if axis in mesh.axis_names and size % mesh.shape[axis] == 0 else None  # noqa: E731
    heads, data = split("model", kv_heads), split("data", n if meta.pages is not None else k_buf.shape[1])
    # One K/V head (multi-query; MLA's latent) is whole on every device: its query heads split instead.
    query_heads = split("model", groups) if kv_heads == 1 else None
    if data is not None and (meta.rows is not None or meta.pages is not None or n != k_buf.shape[1]):
        assert mesh.shape["data"] == 1, "select sends rows over several data shards to the walk"
        data = None
    row_heads = P(data, None, heads, None)
    extra_specs = {k: spec for k, spec in dict(chunk=(row_heads, row_heads, P(data, None, None)),
                                               sinks=P(heads, query_heads), rows=P(), pages=P()).items() if k in extra}
    cache_spec = P(None, data, None, None if meta.latent else heads)  # a row's K/V heads (a latent: none)

    def local(q, q_pos, k_buf, v_buf, kv_limit, extra):
        return _attend(q, q_pos, k_buf, v_buf, layer, kv_limit, **extra, **kw)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(data, None, heads, query_heads, None), P(data, None), cache_spec,
                                                     cache_spec, P(data, None), extra_specs),
                         out_specs=P(data, None, heads or query_heads), check_vma=False)(
        q, meta.q_pos, k_buf, v_buf, meta.kv_limit, extra)


def _geometry(k_buf, page_size, pages):
    """(batch, max_len, block, the row table flattened or None) of one device's cache."""
    if pages is None:
        batch, max_len = k_buf.shape[1:3]
        page = page_size_of(max_len, page_size)
        return batch, max_len, _block_len(max_len, page, k_buf.shape[-1] * jnp.dtype(k_buf.dtype).itemsize), None
    # a pool: a block is a page, found through the row's page table
    num_pages, block = k_buf.shape[1], k_buf.shape[2]
    batch, per_row = pages.shape
    return batch, per_row * block, block, jnp.clip(pages.astype(jnp.int32), 0, num_pages - 1).reshape(-1)


def _query_tile(q) -> int:
    """Queries per tile: whole queries, a multiple of 8 rows (the TPU's sublanes) unless one tile.
    Each query row holds d values per K/V head: queries in, the float32 output (both
    double-buffered) and the float32 sums."""
    _, t, kv_heads, groups, d = q.shape
    most_rows = max(8, min(Q_ROWS, Q_VMEM // (kv_heads * d * (2 * q.dtype.itemsize + 12)) // 8 * 8))
    return t if t * groups <= most_rows else 8 * max(1, most_rows // (8 * groups))


def _block_bounds(q_pos, kv_limit, n_tiles, tq, block, max_len, window, ring):
    """Per (row, tile), flattened: the first and one past the last key block that can hold a
    visible key."""
    n = q_pos.shape[0]
    lim_t = kv_limit.reshape(n, n_tiles, tq).max(-1)
    if not ring:
        lim_t = jnp.minimum(lim_t, max_len)
    hi = (lim_t + block - 1) // block
    lo = jnp.zeros_like(hi)
    if window is not None:
        lo = jnp.clip((q_pos.reshape(n, n_tiles, tq).min(-1) - window + 1) // block, 0, hi)
    return lo.reshape(-1), hi.reshape(-1)


def _cost(n, t_pad, n_tiles, kv_heads, groups, d, keys, n_chunk, itemsize, q_itemsize, dv=None):
    """The kernel's declared cost: each query tile reads the K/V blocks of `keys` positions once;
    its rows' queries in and output out (both in the queries' dtype). dv: a latent cache's value width (its keys, d wide, read once:
    the values are their first part)."""
    rows_total = n * t_pad * kv_heads * groups
    buffers, dv = (2, d) if dv is None else (1, dv)
    return pl.CostEstimate(
        flops=2 * rows_total * (d + dv) * (keys + n_chunk),
        transcendentals=rows_total * (keys + n_chunk),
        bytes_accessed=(buffers * n * (n_tiles * keys + n_chunk) * kv_heads * d * itemsize
                        + rows_total * (d + dv) * q_itemsize))


def _attend(q, q_pos, k_buf, v_buf, layer, kv_limit, *, window=None, chunk=None, rows=None, page_size, sinks=None,
            scale=None, pages=None, ring=False, interpret=None, expected_live=None, latent=False):
    """The kernel on one device's arrays (latent: a latent cache's two parts in k_buf and v_buf)."""
    n, t, kv_heads, groups, d = q.shape
    dv = k_buf.shape[-1] if latent else d
    batch, max_len, block, table = _geometry(k_buf, page_size, pages)
    n_blocks = ring_blocks = max_len // block
    scale = d ** -0.5 if scale is None else scale
    tq = _query_tile(q)
    n_tiles = -(-t // tq)
    t_pad = n_tiles * tq
    pad = t_pad - t
    q_pos = q_pos.astype(jnp.int32)
    kv_limit = kv_limit.astype(jnp.int32)
    if pad:
        q = jnp.pad(q, ((0, 0), (0, pad), (0, 0), (0, 0), (0, 0)))
        q_pos = jnp.pad(q_pos, ((0, 0), (0, pad)), mode="edge")
        kv_limit = jnp.pad(kv_limit, ((0, 0), (0, pad)))  # sees nothing: no bound moves
    if ring:  # logical block b is block b % ring_blocks; a tile sees window + its queries' keys
        n_blocks = -(-(window + tq - 1) // block) + 1
    lo, hi = _block_bounds(q_pos, kv_limit, n_tiles, tq, block, max_len, window, ring)
    rows = jnp.arange(n, dtype=jnp.int32) if rows is None else jnp.clip(rows.astype(jnp.int32), 0, batch - 1)

    # Queries as [n, kv, T*groups, d] (head-major: a K/V head's queries are one matrix), the
    # per-query bounds as [n, T*groups, 1] columns.
    qk = q.transpose(0, 2, 1, 3, 4).reshape(n, kv_heads, t_pad * groups, d)
    col = lambda x: jnp.repeat(x, groups, axis=1)[..., None]  # noqa: E731
    rows_per_tile = tq * groups
    per_row = None if pages is None else pages.shape[1]

    def kv_index(b, t_, j, rows_ref, lo_ref, hi_ref, *table_ref):
        tile = b * n_tiles + t_
        last = jnp.maximum(hi_ref[tile] - 1, lo_ref[tile])
        blk = jnp.minimum(lo_ref[tile] + j, last)
        if table_ref:
            return (layer, table_ref[0][rows_ref[b] * per_row + blk], 0, 0)
        return (layer, rows_ref[b], blk % ring_blocks if ring else blk, 0)

    q_spec = pl.BlockSpec((None, kv_heads, rows_per_tile, d), lambda b, t_, j, *_: (b, 0, t_, 0))
    col_spec = pl.BlockSpec((None, rows_per_tile, 1), lambda b, t_, j, *_: (b, t_, 0))
    in_specs, inputs = [q_spec, col_spec, col_spec], [qk, col(q_pos), col(kv_limit)]
    if sinks is not None:
        sink_col = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, :], (kv_heads, t_pad, groups))
        in_specs.append(pl.BlockSpec((kv_heads, rows_per_tile, 1), lambda b, t_, j, *_: (0, t_, 0)))
        inputs.append(sink_col.reshape(kv_heads, t_pad * groups, 1))
    n_chunk = 0
    if chunk is not None:
        ck, cv, cmask = chunk
        n_chunk = ck.shape[1]
        cmask = jnp.pad(cmask.astype(jnp.int32), ((0, 0), (0, pad), (0, 0)))
        in_specs += [pl.BlockSpec((None, n_chunk, kv_heads, d), lambda b, t_, j, *_: (b, 0, 0, 0))] * 2
        in_specs.append(pl.BlockSpec((None, rows_per_tile, n_chunk), lambda b, t_, j, *_: (b, t_, 0)))
        in_specs[-2] = pl.BlockSpec((None, n_chunk, kv_heads, dv), lambda b, t_, j, *_: (b, 0, 0, 0))
        inputs += [ck.astype(q.dtype), cv.astype(k_buf.dtype), jnp.repeat(cmask, groups, axis=1)]
    # blocks of [positions, a position's row]: its K/V heads, or a latent's part (one K/V head)
    assert not latent or kv_heads == 1, kv_heads
    in_specs += [pl.BlockSpec((None, None, block, buf.shape[-1]), kv_index) for buf in (k_buf, v_buf)]
    inputs += [k_buf, v_buf]

    # Each query tile reads the K/V blocks of `live` positions (a window: the blocks it spans).
    live = min(expected_live, max_len) if expected_live is not None else max_len
    if window is not None:
        live = min(live, window + t_pad + block)
    keys = min(n_blocks, -(-live // block)) * block
    cost = _cost(n, t_pad, n_tiles, kv_heads, groups, d, keys, n_chunk, jnp.dtype(k_buf.dtype).itemsize,
                 qk.dtype.itemsize, dv if latent else None)

    if interpret is None:
        interpret = False if target_platform() == "tpu" else pltpu.InterpretParams()
    out = pl.pallas_call(
        functools.partial(_kernel, n_tiles=n_tiles, block=block, kv_heads=kv_heads, window=window, scale=scale,
                          has_sinks=sinks is not None, has_chunk=chunk is not None, paged=pages is not None,
                          latent=latent),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=3 + (pages is not None),
            grid=(n, n_tiles, n_blocks),
            in_specs=in_specs,
            out_specs=pl.BlockSpec((None, kv_heads, rows_per_tile, dv), lambda b, t_, j, *_: (b, 0, t_, 0)),
            scratch_shapes=[pltpu.VMEM((kv_heads, rows_per_tile, 1), jnp.float32),
                            pltpu.VMEM((kv_heads, rows_per_tile, 1), jnp.float32),
                            pltpu.VMEM((kv_heads, rows_per_tile, dv), jnp.float32)],
        ),
        # in q's dtype: every caller casts the output to it at once, and a bfloat16 verify's float32
        # output, converted after the kernel, cost another pass over it (4 MB a Qwen3-8B layer at 128 rows)
        out_shape=jax.ShapeDtypeStruct((n, kv_heads, t_pad * groups, dv), q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        cost_estimate=cost,
        interpret=interpret,
        name=f"dflash_attention_l{layer}",
    )(rows, lo, hi, *([] if pages is None else [table]), *inputs)
    out = out.reshape(n, kv_heads, t_pad, groups, dv)[:, :, :t]  # [n, kv, T, g, dv]
    return out.transpose(0, 2, 1, 3, 4).reshape(n, t, kv_heads * groups * dv)
