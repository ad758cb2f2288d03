"""Layers shared by every family: RMSNorm, RoPE, attention over the paged cache, dense MLP.

Each layer is configured by `ModelConfig` switches (q/k norm, biases, sliding window,
attention sinks); the families (`dflash_jax.families`) say which switches a checkpoint uses.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.attention import attend, write_kv
from dflash_jax.config import ModelConfig, rope_inv_freq


def jnp_dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


class RMSNorm(nn.Module):
    """RMSNorm computed in float32. The weight multiplies in the input dtype (as HF's Llama
    and Qwen3), or with `weight_in_float32` before the cast back (as gpt-oss). With
    `zero_centered` the stored weight is an offset from 1, applied in float32 (Qwen3.5)."""

    eps: float
    dtype: jnp.dtype = jnp.float32
    weight_in_float32: bool = False
    zero_centered: bool = False

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.zeros if self.zero_centered else nn.initializers.ones
        weight = self.param("weight", init, (x.shape[-1],), self.dtype)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        if self.zero_centered:
            return (x32 * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
        if self.weight_in_float32:
            return (weight.astype(jnp.float32) * x32).astype(x.dtype)
        return weight * x32.astype(x.dtype)


def rope_angles(config: ModelConfig, positions):
    """cos, sin of shape [*positions.shape, rotary_dim // 2]: one angle per rotated pair (YaRN
    scales both by its attention factor, as transformers does)."""
    inv_freq = jnp.asarray(rope_inv_freq(config.rope, config.head_dim))
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    cos, sin = jnp.cos(freqs), jnp.sin(freqs)
    if config.rope.attention_factor != 1.0:
        cos, sin = cos * config.rope.attention_factor, sin * config.rope.attention_factor
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
    pairs = x.reshape(*x.shape[:-1], 2, half)
    x1, x2 = pairs[..., 0, :], pairs[..., 1, :]
    return jnp.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-2).reshape(x.shape)


def norm(config: ModelConfig, name: str | None = None) -> RMSNorm:
    return RMSNorm(config.rms_norm_eps, jnp_dtype(config.dtype), config.norm_weight_in_float32,
                   config.norm_zero_centered, name=name)


class Attention(nn.Module):
    """Grouped-query attention over the paged cache. With `attention_output_gate` (Qwen3.5)
    q_proj gives each head a query and a gate of head_dim each, and the attention output is
    multiplied by sigmoid(gate) before o_proj."""

    config: ModelConfig
    layer: int  # this layer's index into the cache buffers (its slot among the attention layers)
    window: int | None = None

    @nn.compact
    def __call__(self, x, cos, sin, cache, query_pos, rows):
        """x [n, T, hidden] at query_pos [n, T] of cache rows `rows` (None: rows 0..n-1).
        Writes this chunk's K/V into the cache, then attends causally over it."""
        c = self.config
        dtype = jnp_dtype(c.dtype)
        dense = lambda n, name, bias: nn.Dense(n, use_bias=bias, dtype=dtype, param_dtype=dtype, name=name)
        b, t, _ = x.shape
        gated = 2 if c.attention_output_gate else 1
        q = dense(c.num_attention_heads * c.head_dim * gated, "q_proj", c.qkv_bias)(x)
        k = dense(c.num_key_value_heads * c.head_dim, "k_proj", c.qkv_bias)(x)
        v = dense(c.num_key_value_heads * c.head_dim, "v_proj", c.qkv_bias)(x)
        q = q.reshape(b, t, c.num_attention_heads, c.head_dim * gated)
        if gated == 2:
            q, gate = q[..., :c.head_dim], q[..., c.head_dim:].reshape(b, t, -1)
        k = k.reshape(b, t, c.num_key_value_heads, c.head_dim)
        v = v.reshape(b, t, c.num_key_value_heads, c.head_dim)
        if c.qk_norm:
            q = norm(c, "q_norm")(q)
            k = norm(c, "k_norm")(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        sinks = None
        if c.attention_sinks:
            sinks = self.param("sinks", nn.initializers.zeros, (c.num_attention_heads,), dtype)
            sinks = sinks.astype(jnp.float32).reshape(c.num_key_value_heads, c.num_groups)

        offsets = query_pos[:, 0]
        cache = cache.replace(k=write_kv(cache.k, self.layer, k, offsets, rows),
                              v=write_kv(cache.v, self.layer, v, offsets, rows))
        q = q.reshape(b, t, c.num_key_value_heads, c.num_groups, c.head_dim)
        out = attend(q, query_pos, cache.k, cache.v, self.layer, query_pos + 1, window=self.window, rows=rows,
                     page_size=cache.page_size, sinks=sinks)
        out = out.astype(dtype)
        if gated == 2:
            out = out * jax.nn.sigmoid(gate.astype(jnp.float32)).astype(dtype)
        return dense(c.hidden_size, "o_proj", c.o_bias)(out), cache


class MLP(nn.Module):
    """The dense gated MLP: down(silu(gate(x)) * up(x)), `width` wide (default the config's
    intermediate_size)."""

    config: ModelConfig
    width: int | None = None

    @nn.compact
    def __call__(self, x):
        c = self.config
        dtype = jnp_dtype(c.dtype)
        width = self.width or c.intermediate_size
        dense = lambda n, name: nn.Dense(n, use_bias=c.mlp_bias, dtype=dtype, param_dtype=dtype, name=name)
        h = jax.nn.silu(dense(width, "gate_proj")(x)) * dense(width, "up_proj")(x)
        return dense(c.hidden_size, "down_proj")(h)
