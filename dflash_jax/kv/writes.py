"""Cache writes: a chunk of new keys/values at each row's own offset, straight into the buffer
(per-row slots, a page pool through each row's page table, or a ring). With the buffer donated
(or carried by a loop), XLA updates it in place, and no step copies or re-stacks the cache.
`read_kv` is the matching gather of chosen positions (a tree verify's block, and the accepted
path it compacts into place).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.kv.layout import merge_heads, split_heads


def write_kv(buf, layer: int | None, new, offsets, rows=None, pages=None, ring: bool = False):
    """Write new [n, T, kv_heads, head_dim] (or as stored, [n, T, kv_heads * head_dim]) into buf at
    positions offsets[i] + 0..T-1 of batch row rows[i] (default row i), in layer `layer` of a
    [layers, batch, len, width] buffer (or, with layer None, into every layer: new is then
    [layers, n, T, ...]). A latent buffer takes new with a unit head axis, or without.

    A loop of one dynamic-update-slice per row, which XLA performs in place on a donated or
    loop-carried buffer (a scatter is in place too, but XLA's cost analysis counts it as the
    whole buffer read and written; a loop body is counted once, so cost reports add the
    other rows' writes). Rows out of range are padding (an admission batch points them at
    row `batch`) and write back what is there. The caller keeps offsets + T <= len.

    With a page table (`pages` [batch, pages per row]; buf a pool [layers, num_pages, page,
    width]) it is one scatter of every (row, position) into its page, positions in no page of
    the row (padding rows, pages past its reservation) dropped. A ring (`ring`) is one scatter
    too, position p at p % the buffer's length."""
    if new.ndim == buf.ndim - (1 if layer is None else 2) + 2:  # heads apart: merged as the buffer holds them
        new = merge_heads(new)
    if pages is not None:
        return _write_pool(buf, layer, new, offsets, rows, pages)
    if ring:
        return _write_ring(buf, layer, new, offsets, rows)
    n = new.shape[-buf.ndim + 1]
    batch = buf.shape[1]
    new = new.astype(buf.dtype)
    rows = jnp.arange(n, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)

    def one(i, buf):
        row = rows[i]
        start = (0 if layer is None else layer, jnp.minimum(row, batch - 1), offsets[i]) + (0,) * (buf.ndim - 3)
        if layer is None:  # [layers, 1, T, width]
            update = jax.lax.dynamic_slice_in_dim(new, i, 1, axis=1)
        else:  # [1, 1, T, width]
            update = jax.lax.dynamic_slice_in_dim(new, i, 1, axis=0)[None]
        update = jnp.where(row < batch, update, jax.lax.dynamic_slice(buf, start, update.shape))
        return jax.lax.dynamic_update_slice(buf, update, start)

    return jax.lax.fori_loop(0, n, one, buf)


def _write_pool(buf, layer, new, offsets, rows, pages):
    layers, num_pages, page, *tail = buf.shape
    n, t = new.shape[-len(tail) - 2], new.shape[-len(tail) - 1]
    batch, per_row = pages.shape
    rows = jnp.arange(n, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    pos = offsets.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [n, T]
    logical = pos // page
    table = jnp.take(pages, rows, axis=0, mode="clip")  # [n, per_row]
    phys = jnp.take_along_axis(table, jnp.clip(logical, 0, per_row - 1), axis=1)
    ok = (rows < batch)[:, None] & (logical < per_row) & (phys >= 0) & (phys < num_pages)
    flat = (jnp.where(ok, phys, num_pages) * page + pos % page).reshape(-1)  # no page: past the pool, dropped
    pool = buf.reshape(layers, num_pages * page, *tail)
    new = new.astype(buf.dtype)
    if layer is None:  # [layers, n, T, width]: a scatter per layer (one over the layer axis too had a TPU
        # keep the drafter's whole context pool layers-minor and copy it around every call)
        new = new.reshape(layers, n * t, *tail)
        for i in range(layers):
            pool = pool.at[i, flat].set(new[i], mode="drop")
    else:
        pool = pool.at[layer, flat].set(new.reshape(n * t, *tail), mode="drop")
    return pool.reshape(buf.shape)


def _write_ring(buf, layer, new, offsets, rows):
    lead = 1 if layer is None else 0  # new: [(layers,) n, T, width]
    n, t = new.shape[lead], new.shape[lead + 1]
    rows = jnp.arange(n, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    pos = (offsets.astype(jnp.int32)[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]) % buf.shape[2]
    where = jnp.broadcast_to(rows[:, None], pos.shape)  # rows out of range (padding): dropped
    new = new.astype(buf.dtype)
    if layer is None:  # a scatter per layer, as into a pool
        for i in range(buf.shape[0]):
            buf = buf.at[i, where, pos].set(new[i], mode="drop")
        return buf
    return buf.at[layer, where, pos].set(new, mode="drop")


def read_kv(buf, layer: int | None, positions, rows=None, pages=None, ring: bool = False,
            heads: int | None = None):
    """The keys or values at positions [n, T] of batch rows rows[i] (default row i) from layer
    `layer` of buf (layer None: every layer, [layers, n, T, ...]), through each row's page table
    (`pages`) or a ring's modulo, as `write_kv` wrote them: [n, T, width] as stored, or with
    `heads`, [n, T, heads, width / heads] (a latent buffer: heads=1). Positions past a row's pages
    read page 0 (the caller never uses them)."""
    n = positions.shape[0]
    rows = jnp.arange(n, dtype=jnp.int32) if rows is None else rows.astype(jnp.int32)
    positions = positions.astype(jnp.int32)
    view = buf if layer is None else buf[layer][None]
    layers, _, length, *tail = view.shape
    if pages is not None:
        num_pages, page = view.shape[1], length
        table = jnp.take(pages, rows, axis=0, mode="clip")
        phys = jnp.take_along_axis(table, jnp.clip(positions // page, 0, table.shape[1] - 1), axis=1)
        flat = jnp.clip(phys, 0, num_pages - 1) * page + positions % page
        out = view.reshape(layers, num_pages * page, *tail)[:, flat]
    else:
        where = positions % length if ring else jnp.clip(positions, 0, length - 1)
        out = view[:, jnp.clip(rows, 0, view.shape[1] - 1)[:, None], where]
    if heads is not None:
        out = split_heads(out, heads)
    return out if layer is None else out[0]
