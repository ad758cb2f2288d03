"""`attend`, the one entry the target and the drafter attend through: the call's new keys/values
written into the cache (the target) or attended as the block's uncached keys (the drafter), then
the implementation `selection.select` picks for the platform traced for."""

from __future__ import annotations

import jax.numpy as jnp

from dflash_jax.attention.metadata import AttentionMetadata, LayerKV
from dflash_jax.attention.selection import run
from dflash_jax.kv import read_kv, write_kv
from dflash_jax.platform import target_platform


def attend(q, k_new, v_new, cache: LayerKV, meta: AttentionMetadata) -> tuple:
    """Grouped-query attention of queries over one layer of a cache -> (out, cache).

    q: [n, T, kv_heads, groups, head_dim] (rotated); k_new, v_new: [n, T, kv_heads, head_dim] or
    None (a layer sharing another's K/V). "causal" metadata writes them into `cache` at the
    queries' positions (rows `meta.rows`, through the page table or the ring) before attending;
    "block" metadata attends them as the block's keys through `meta.block_mask`, uncached; "tree"
    metadata writes them from the root's position and attends them as the block's keys (a layer
    sharing another's K/V reads the block back from the cache).
    With a latent cache (`meta.latent`) k_new and v_new are a latent's two parts: the keys are
    [k_new ; v_new], the values k_new, and the output has k_new's width per head.
    out: [n, T, kv_heads * groups * head_dim] float32; cache: with the new K/V written.
    """
    if meta.mask in ("causal", "tree"):
        if k_new is not None:
            offsets = meta.q_pos[:, 0] if meta.mask == "causal" else meta.block_start

            def write(buf, new):
                return write_kv(buf, cache.layer, new, offsets, meta.rows, meta.pages, meta.ring)

            cache = cache.replace(k=write(cache.k, k_new), v=write(cache.v, v_new))
        if meta.mask == "tree":
            if k_new is None:
                positions = meta.block_start[:, None] + jnp.arange(q.shape[1])[None, :]
                k_new, v_new = (read_kv(buf, cache.layer, positions, meta.rows, meta.pages, meta.ring, heads=q.shape[2])
                                for buf in (cache.k, cache.v))
            meta = meta.replace(block_k=k_new, block_v=v_new)
    else:
        meta = meta.replace(block_k=k_new, block_v=v_new)
    if meta.latent and meta.block_k is not None:
        meta = meta.replace(block_k=jnp.concatenate([meta.block_k, meta.block_v], axis=-1), block_v=meta.block_k)
    return run(q, cache, meta, target_platform()), cache
