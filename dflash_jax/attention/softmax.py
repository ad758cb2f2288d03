"""The arithmetic every attention implementation shares: grouped-query scores and one step of the
online softmax (float32 statistics), with `NEG`, the finite running maximum the softmax starts from."""

from __future__ import annotations

import jax.numpy as jnp

NEG = float(jnp.finfo(jnp.float32).min)


def scores(q, k, scale=None):
    """q [n, T, kv, groups, d], k [n, S, kv, d] -> [n, kv, groups, T, S] float32, scaled
    (by d ** -0.5 unless given)."""
    s = jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
    return s * (q.shape[-1] ** -0.5 if scale is None else scale)


def online_update(carry, scores, mask, v):
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
