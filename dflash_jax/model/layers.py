"""Layers shared by every family: RMSNorm, RoPE, attention over the paged cache, dense MLP.

Each layer is configured by `ModelConfig` switches (q/k norm, biases, sliding window,
attention sinks); the families (`dflash_jax.families`) say which switches a checkpoint uses.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.attention import AttentionMetadata, LayerKV, attend
from dflash_jax.config import ModelConfig, jnp_dtype
from dflash_jax.model.rope import rope_inv_freq
from dflash_jax.model.weights import Projection
from dflash_jax.platform import target_platform


_UNFUSED_PLATFORMS = {"tpu"}
_ROLLED_ROPE_PLATFORMS = {"tpu"}  # `apply_rope` as a lane roll of whole rows


def unfused(x):
    """A projection's output as a value of its own, on a TPU. There, a norm or RoPE that the
    compiler fuses into a q/k/v projection's dot makes it re-lay out the whole kernel (a
    transposed copy of every q, k and v weight before the decoding loop, a quarter of a
    Qwen3-8B step's time by its own estimate); with the output materialised (a few KB while
    decoding) the dot streams the weight as stored. Elsewhere it is the identity: on XLA's CPU
    runtime, sharded training programs with these barriers, loaded from the persistent
    compilation cache, deadlocked in their collectives."""
    return jax.lax.optimization_barrier(x) if target_platform() in _UNFUSED_PLATFORMS else x


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. The weight multiplies in the input dtype (as HF's Llama
    and Qwen3), or with `weight_in_float32` before the cast back (as gpt-oss). With
    `zero_centered` the stored weight is an offset from 1, applied in float32 (Qwen3.5)."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    weight_in_float32: bool = False
    zero_centered: bool = False
    with_weight: bool = True  # False: no weight at all (Gemma 4's value norm)

    @nn.compact
    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        scale = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if x.dtype != jnp.float32:  # the same values: on a TPU (`unfused`) converted again for the scaling,
            # else the compiler keeps x's float32 copy for both uses, written and read back (16 MB a
            # Qwen3-8B layer's norms at the verify's 128 rows)
            x32 = unfused(x).astype(jnp.float32)
        x32 = x32 * scale
        if not self.with_weight:
            return x32.astype(x.dtype)
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        if self.zero_centered:
            return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        if self.weight_in_float32:
            return (weight.astype(jnp.float32) * x32).astype(x.dtype)
        return weight * x32.astype(x.dtype)


def rope_angles(config: ModelConfig, positions, layer: int | None = None):
    """cos, sin of shape [*positions.shape, rotary_dim // 2]: one angle per rotated pair (YaRN
    scales both by its attention factor, as transformers does). With `layer`, that layer's
    RoPE and head_dim (Gemma 4's global layers have their own)."""
    rope = config.rope if layer is None else config.layer_rope(layer)
    head_dim = config.head_dim if layer is None else config.attention_shape(layer)[0]
    inv_freq = jnp.asarray(rope_inv_freq(rope, head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if rope.attention_factor != 1.0:
        cos, sin = cos * rope.attention_factor, sin * rope.attention_factor
    return cos, sin


def apply_rope(x, cos, sin):
    """x [batch, T, heads, head_dim]; cos/sin [batch, T, head_dim // 2]. The half-split layout
    of HF (dimension i pairs with i + head_dim / 2), written as one elementwise expression over
    the two halves, which XLA fuses with its producer (a concatenate of a negated half, as
    `rotate_half` does, is a separate pass over q and k on XLA's CPU backend). When cos/sin
    cover fewer pairs than head_dim // 2 (partial rotary, Qwen3.5), the rotation acts on the
    first 2 * cos.shape[-1] dimensions, half-split inside them, and the rest pass through."""
    rotated = 2 * cos.shape[-1]
    if rotated < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotated], cos, sin), x[..., rotated:]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    if target_platform() in _ROLLED_ROPE_PLATFORMS:
        # the same products, bit for bit, over whole head_dim-wide rows: x1 * cos + x2 * (-sin) and
        # x2 * cos + x1 * sin. A TPU pads the halves' 64-wide minor axis to its 128 lanes (two
        # passes over twice the bytes): the verify's 16 rows a slot read 15 MB more per layer.
        cos2, sin2 = jnp.concatenate([cos, cos], axis=-1), jnp.concatenate([-sin, sin], axis=-1)
        return x * cos2 + jnp.roll(x, half, axis=-1) * sin2
    pairs = x.reshape(*x.shape[:-1], 2, half)
    x1, x2 = pairs[..., 0, :], pairs[..., 1, :]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-2).reshape(x.shape)


def norm(config: ModelConfig, name: str | None = None) -> RMSNorm:
    return RMSNorm(config.rms_norm_eps, jnp_dtype(config.dtype), config.norm_weight_in_float32,
                   config.norm_zero_centered, name=name)


class Attention(nn.Module):
    """Grouped-query attention over the paged cache, configured per layer by the config: its
    head shape, window and RoPE, and its cache slot (`ModelConfig.cache_slot`).

    With `attention_output_gate` (Qwen3.5) q_proj gives each head a query and a gate of
    head_dim each, and the output is multiplied by sigmoid(gate) before o_proj. A layer that
    shares an earlier layer's K/V (Gemma 4) has no k/v projections: it writes nothing and
    attends over its producer's slot. Gemma 4's global layers keep their K/V in the cache's
    second group (`k_global`, `v_global`); with `attention_k_eq_v` their values are the key
    projection (normed by the weightless value norm, not rotated). With `qk_norm_whole`
    (MiniMax-M2) q_norm and k_norm each norm the whole projection before it splits into heads."""

    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, cache, query_pos, rows, tree_mask=None):
        """x [n, T, hidden] at query_pos [n, T] of cache rows `rows` (None: rows 0..n-1).
        Writes this chunk's K/V into the cache, then attends causally over it; with tree_mask
        [n, T, T] (a draft tree's verify) the chunk's tokens are tree nodes, written from the
        root's position and seeing their ancestors (`AttentionMetadata.tree`)."""
        c, i = self.config, self.layer
        dtype = jnp_dtype(c.dtype)
        dense = lambda n, name, bias: Projection(n, bias, dtype, dtype, format=c.weight_format, name=name)
        b, t, _ = x.shape
        head_dim, kv_heads = c.attention_shape(i)
        heads, window = c.num_attention_heads, c.sliding_windows[i] if c.sliding_windows else None
        gated = 2 if c.attention_output_gate else 1
        whole = c.qk_norm and c.qk_norm_whole  # one norm over every head (MiniMax-M2), before the split
        q = unfused(dense(heads * head_dim * gated, "q_proj", c.qkv_bias)(x))
        if whole:
            q = norm(c, "q_norm")(q)
        q = q.reshape(b, t, heads, head_dim * gated)
        if gated == 2:
            q, gate = q[..., :head_dim], q[..., head_dim:].reshape(b, t, -1)
        if c.qk_norm and not whole:
            q = norm(c, "q_norm")(q)
        q = apply_rope(q, cos, sin)
        sinks = None
        if c.attention_sinks:
            sinks = self.param("sinks", nn.initializers.zeros, (heads,), dtype)
            sinks = sinks.astype(jnp.float32).reshape(kv_heads, heads // kv_heads)

        keys, values = ("k_global", "v_global") if c.is_global(i) else ("k", "v")
        pages, ring = cache.layout(c.is_global(i))
        k = v = None
        if c.kv_producer(i) == i:
            projected = unfused(dense(kv_heads * head_dim, "k_proj", c.qkv_bias)(x))
            k = (norm(c, "k_norm")(projected) if whole else projected).reshape(b, t, kv_heads, head_dim)
            if c.attention_k_eq_v and window is None:
                v = projected.reshape(b, t, kv_heads, head_dim)
            else:
                v = unfused(dense(kv_heads * head_dim, "v_proj", c.qkv_bias)(x)).reshape(b, t, kv_heads, head_dim)
            if c.qk_norm and not whole:
                k = norm(c, "k_norm")(k)
            if c.value_norm:
                v = RMSNorm(c.rms_norm_eps, dtype, with_weight=False, name="v_norm")(v)
            k = apply_rope(k, cos, sin)
        q = q.reshape(b, t, kv_heads, heads // kv_heads, head_dim)
        layout = dict(rows=rows, pages=pages, sinks=sinks, window=window, ring=ring, page_size=cache.page_size,
                      scale=c.attention_scale)
        meta = (AttentionMetadata.causal(query_pos, **layout) if tree_mask is None
                else AttentionMetadata.tree(query_pos, tree_mask, **layout))
        out, kv = attend(q, k, v, LayerKV(getattr(cache, keys), getattr(cache, values), c.cache_slot(i)), meta)
        cache = cache.replace(**{keys: kv.k, values: kv.v})
        out = out.astype(dtype)
        if gated == 2:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype)
        return dense(c.hidden_size, "o_proj", c.o_bias)(out), cache


ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nn.Module):
    """The dense gated MLP: down(act(gate(x)) * up(x)), act the config's `mlp_activation`
    (silu; Gemma: tanh-approximated GELU), `width` wide (default the config's intermediate_size)."""

    config: ModelConfig
    width: int | None = None

    @nn.compact
    def __call__(self, x):
        c = self.config
        dtype = jnp_dtype(c.dtype)
        width = self.width or c.intermediate_size
        dense = lambda n, name: Projection(n, c.mlp_bias, dtype, dtype, format=c.weight_format, name=name)
        h = ACTIVATIONS[c.mlp_activation](dense(width, "gate_proj")(x)) * dense(width, "up_proj")(x)
        return dense(c.hidden_size, "down_proj")(h)
