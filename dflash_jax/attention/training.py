"""Drafter training's attention: every key at once, no cache. `dense_attention` (an arbitrary
mask; the reference) and `block_attention` (every block of a sequence at once, context plus its
own block merged by log-sum-exp, without scoring one block against another)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from dflash_jax.attention.softmax import NEG, scores as _scores

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


