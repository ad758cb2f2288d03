"""The GPU implementation: one fused attention (cuDNN flash attention through
`jax.nn.dot_product_attention`) of the queries over the layer's whole cache, with the walk's mask
(keys < kv_limit, inside the window) as a boolean mask: no score matrix in memory, no per-page
loop. It reads the allocated cache, not only the pages in use, so it suits caches sized near the
contexts served. A draft tree's verify (the "tree" kind) reads its nodes from the cache too, where
they were written, with the ancestor mask placed over their positions. What it cannot take (sinks,
the drafter's uncached block keys, chosen rows, a pool, a ring, float32 on cuDNN) `dflash_jax.attention.select` sends to the walk before it is called."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.attention.metadata import AttentionMetadata, LayerKV
from dflash_jax.kv import split_heads


def attend(q, cache: LayerKV, meta: AttentionMetadata, implementation: str = "cudnn"):
    """q [n, T, kv_heads, groups, head_dim] over one layer of per-row caches -> [n, T, kv_heads *
    groups * head_dim] float32. `implementation="xla"` runs the same call through jax's reference
    implementation (the CPU tests)."""
    n, t, kv_heads, groups, d = q.shape
    k, v = (split_heads(buf[cache.layer], kv_heads) for buf in (cache.k, cache.v))  # [batch, max_len, kv_heads, head_dim]
    key_pos = jnp.arange(k.shape[1])
    mask = key_pos[None, None, :] < meta.kv_limit[:, :, None]
    if meta.mask == "tree":  # the nodes are in the cache from the root's position: their keys by the tree's mask
        node = key_pos[None, None, :] - meta.kv_limit[:, :, None]  # [n, T, S]: the key's node, where it is one
        in_tree = (node >= 0) & (node < meta.block_mask.shape[2])
        mask |= in_tree & jnp.take_along_axis(meta.block_mask, jnp.clip(node, 0, meta.block_mask.shape[2] - 1), axis=2)
    if meta.window is not None:
        mask &= key_pos[None, None, :] > meta.q_pos[:, :, None] - meta.window
    out = jax.nn.dot_product_attention(q.reshape(n, t, kv_heads * groups, d).astype(k.dtype), k, v,
                                       mask=mask[:, None], scale=d ** -0.5 if meta.scale is None else meta.scale,
                                       implementation=implementation)
    return out.reshape(n, t, kv_heads * groups * d).astype(jnp.float32)
