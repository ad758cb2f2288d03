"""Multi-head latent attention (MLA: DeepSeek-V3, Kimi-K2, GLM-5), over a latent cache.

Each position's keys and values come from one latent: `kv_a_proj_with_mqa` gives kv_lora_rank
values (normed by `kv_a_layernorm`) and qk_rope_head_dim key values that RoPE rotates and every
head shares. transformers expands the latent per head through `kv_b_proj` (each head's
non-rotated key, qk_nope_head_dim, and value, v_head_dim) and attends as multi-head attention.
We attend in the absorbed form instead, on every pass (prefill, decode, verify):

    score_h(i, j) = q_nope_h(i) . W_uk_h c(j) + q_rope_h(i) . k_rope(j)
                  = [W_uk_h^T q_nope_h(i), q_rope_h(i)] . [c(j), k_rope(j)]
    out_h(i)      = sum_j p_h(i, j) W_uv_h c(j) = W_uv_h (sum_j p_h(i, j) c(j))

so attention is multi-query attention with one K/V "head" of kv_lora_rank + qk_rope_head_dim
dimensions (the latent, what the cache holds: 576 values per position and layer for DeepSeek-V3
against 2 x 128 heads x 192 expanded) whose values are its first kv_lora_rank dimensions, and
every query head a group of it. `W_uk` and `W_uv` (the two halves of kv_b_proj) fold into the
queries before and the output after. The softmax scale stays the expanded head's,
(qk_nope_head_dim + qk_rope_head_dim) ** -0.5 (times YaRN's mscale squared: `ModelConfig.attention_scale`).

Parameters (HF names under `self_attn.`): q_proj, or q_a_proj + q_a_layernorm + q_b_proj;
kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj (kept in HF's layout, [heads * (nope + v), kv_lora_rank],
a bare kernel read as two per-head matrices), o_proj.

DeepSeek sparse attention (GLM-5, `MlaConfig.indexer`): an `Indexer` picks, per query, the top-k
cached positions by its own cheap scores; attention then sees only those (`AttentionMetadata.selected`)
within the causal limit. Exact to transformers: when a query sees at most k positions it sees them
all. The indexer's keys live in the cache beside the latent (`KVCache.index_k`), written and rolled
back like it. A "shared" layer reuses the previous indexer layer's selection. Its scores cover the
whole cache per query ([n, T, heads, max_len] float32), the reference form: on a TPU the selection
should move into a kernel.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.attention import AttentionMetadata, LayerKV, attend
from dflash_jax.config import ModelConfig, jnp_dtype
from dflash_jax.kv import read_kv, write_kv
from dflash_jax.model.layers import apply_rope, norm, unfused
from dflash_jax.model.weights import Einsum, Projection, declare, project


class Kernel(nn.Module):
    """A bare `kernel` weight (kv_b_proj's, used as two per-head matrices, not as a Dense)."""

    shape: tuple[int, ...]
    dtype: jnp.dtype
    format: str | tuple = "dense"  # a format's name or `FormatRules`

    @nn.compact
    def __call__(self):
        return declare(self, "kernel", self.shape, self.dtype, nn.initializers.lecun_normal(), self.format)


def deinterleave(x):
    """[..., d] with rotation pairs (0, 1), (2, 3), ... -> the half-split layout (pair i is (i, i +
    d/2)) `apply_rope` rotates. Applied to queries and keys alike, so their dot products are the
    interleaved rotation's."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2).swapaxes(-1, -2).reshape(x.shape)


class Indexer(nn.Module):
    """DeepSeek sparse attention's indexer (HF `self_attn.indexer.*`: wq_b, wk, k_norm (a LayerNorm),
    weights_proj). Writes the chunk's keys into the cache's indexer keys, then returns each query's
    selection [n, T, max_len] bool: the top-k cached positions by sum_h w_h relu(q_h . k) within
    the causal limit."""

    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, q_latent, cos, sin, cache, query_pos, rows):
        c, ix = self.config, self.config.mla.indexer
        dtype = jnp_dtype(c.dtype)
        dense = lambda n, name: Projection(n, False, dtype, dtype, format=c.weight_format, name=name)  # noqa: E731
        b, t, _ = x.shape
        rot = c.mla.qk_rope_head_dim

        def rotate(v):  # interleaved RoPE on the first qk_rope_head_dim dimensions, the rest pass
            return jnp.concatenate([apply_rope(deinterleave(v[..., :rot]), cos, sin), v[..., rot:]], axis=-1)

        q = rotate(dense(ix.heads * ix.head_dim, "wq_b")(q_latent).reshape(b, t, ix.heads, ix.head_dim))
        k = nn.LayerNorm(epsilon=1e-6, dtype=dtype, param_dtype=dtype, name="k_norm")(dense(ix.head_dim, "wk")(x))
        k = rotate(k[:, :, None, :])
        slot = ix.slot(self.layer)
        buf = write_kv(cache.index_k, slot, k, query_pos[:, 0], rows, **cache.kv_args("index_k"))
        cache = cache.replace(index_k=buf)
        positions = jnp.broadcast_to(jnp.arange(cache.max_len)[None, :], (b, cache.max_len))
        keys = read_kv(buf, slot, positions, rows, **cache.kv_args("index_k"))  # [n, S, head_dim]
        scores = jnp.einsum("bthd,bsd->bths", q.astype(jnp.float32), keys.astype(jnp.float32)) * ix.head_dim ** -0.5
        weights = dense(ix.heads, "weights_proj")(x).astype(jnp.float32) * ix.heads ** -0.5
        index = jnp.einsum("bth,bths->bts", weights, jax.nn.relu(scores))
        visible = jnp.arange(cache.max_len)[None, None, :] <= query_pos[:, :, None]
        index = jnp.where(visible, index, -jnp.inf)
        _, top = jax.lax.top_k(index, min(ix.top_k, cache.max_len))
        picked = jnp.zeros(index.shape, bool).at[jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None],
                                                 top].set(True)
        return picked & visible, cache


class LatentAttention(nn.Module):
    """MLA over the latent cache: the call of `layers.Attention` (x [n, T, hidden] at query_pos of
    cache rows `rows`; a draft tree's mask with tree_mask) -> (out [n, T, hidden], cache, selection):
    with sparse attention, the positions each query saw (its indexer's, or for a shared layer the
    `selected` it was given); else None."""

    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, cache, query_pos, rows, tree_mask=None, selected=None):
        c, m = self.config, self.config.mla
        dtype = jnp_dtype(c.dtype)
        dense = lambda n, name, bias=False: Projection(n, bias, dtype, dtype, format=c.weight_format,  # noqa: E731
                                                       name=name)
        b, t, _ = x.shape
        heads = c.num_attention_heads
        if m.q_lora_rank is None:
            q = dense(heads * m.qk_head_dim, "q_proj")(x)
        else:
            q_latent = norm(c, "q_a_layernorm")(dense(m.q_lora_rank, "q_a_proj", c.qkv_bias)(x))
            q = dense(heads * m.qk_head_dim, "q_b_proj")(q_latent)
        q = unfused(q).reshape(b, t, heads, m.qk_head_dim)
        q_nope, q_rope = q[..., :m.qk_nope_head_dim], q[..., m.qk_nope_head_dim:]
        latent = unfused(dense(m.latent_dim, "kv_a_proj_with_mqa", c.qkv_bias)(x))
        c_kv, k_rope = norm(c, "kv_a_layernorm")(latent[..., :m.kv_lora_rank]), latent[..., m.kv_lora_rank:]
        if m.rope_interleave:
            q_rope, k_rope = deinterleave(q_rope), deinterleave(k_rope)
        q_rope = apply_rope(q_rope, cos, sin)
        k_rope = apply_rope(k_rope[:, :, None, :], cos, sin)[:, :, 0]

        kv_b = Kernel((heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank), dtype, c.weight_format,
                      name="kv_b_proj")()
        per_head = lambda w: w.reshape(heads, m.qk_nope_head_dim + m.v_head_dim, m.kv_lora_rank)  # noqa: E731
        w_uk = lambda w: per_head(w)[:, :m.qk_nope_head_dim]  # noqa: E731
        w_uv = lambda w: per_head(w)[:, m.qk_nope_head_dim:]  # noqa: E731
        q_absorbed = project(q_nope, kv_b, Einsum("bthn,hnl->bthl", dtype, w_uk))
        q = jnp.concatenate([q_absorbed, q_rope.astype(dtype)], axis=-1)[:, :, None]  # [n, T, 1, heads, latent]

        if m.indexer is not None and not m.indexer.is_shared(self.layer):
            selected, cache = Indexer(c, self.layer, name="indexer")(x, q_latent, cos, sin, cache, query_pos, rows)
        pages, ring = cache.layout(False)
        layout = dict(rows=rows, pages=pages, ring=ring, page_size=cache.page_size, scale=c.attention_scale,
                      latent=True, selected=selected)
        meta = (AttentionMetadata.causal(query_pos, **layout) if tree_mask is None
                else AttentionMetadata.tree(query_pos, tree_mask, **layout))
        # the latent's two parts: [n, T, 1, kv_lora_rank] (keys and values) and [n, T, 1, rope] (keys)
        out, kv = attend(q, c_kv[:, :, None], k_rope.astype(dtype)[:, :, None],
                         LayerKV(cache.k, cache.v, c.cache_slot(self.layer)), meta)
        cache = cache.replace(k=kv.k, v=kv.v)
        out = out.astype(dtype).reshape(b, t, heads, m.kv_lora_rank)
        out = project(out, kv_b, Einsum("bthl,hvl->bthv", dtype, w_uv))
        return dense(c.hidden_size, "o_proj", c.o_bias)(out.reshape(b, t, heads * m.v_head_dim)), cache, selected
