"""The target decoder: one Flax Linen implementation for every family in `dflash_jax.families`.

Parameter paths mirror the Hugging Face names (`model/layers_3/self_attn/q_proj/kernel`
for `model.layers.3.self_attn.q_proj.weight`), so conversion is a table.

The KV cache is preallocated in pages (`dflash_jax.attention`): one buffer
`[layers, batch, max_len, kv_heads, head_dim]` for keys and one for values, with a length per
row. `forward` writes a chunk of T tokens per row at that row's own offset (`cache.lengths`)
straight into the buffers (in place under jit), then attends over the pages the rows have
used, so one entry point serves batched prefill (prompts right-padded to a bucket; pass
`num_tokens`), single-token decode (T=1) and the block verify pass of speculative decoding
(T=K+1). Rollback is a length update: entries at or past a row's length are stale, and the
causal limit (key position <= query position, with every position below the query written
in this or an earlier call) guarantees they are never read.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.attention import PAGE_SIZE, cache_length
from dflash_jax.config import ModelConfig
from dflash_jax.errors import ConfigError
from dflash_jax.model.layers import MLP, Attention, jnp_dtype, norm, rope_angles
from dflash_jax.model.moe import MoE


# --------------------------------------------------------------------------- cache


@struct.dataclass
class KVCache:
    """Static-shape paged KV cache with a length per row.

    k, v:    [layers, batch, max_len, kv_heads, head_dim], max_len a whole number of pages
    lengths: [batch] int32, number of valid (committed) positions of each row.
    page_size: positions per page (static), the unit attention walks in.
    """

    k: jax.Array
    v: jax.Array
    lengths: jax.Array
    page_size: int = struct.field(pytree_node=False, default=PAGE_SIZE)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def row_lengths(cache: KVCache, rows):
    """lengths of cache rows `rows` [n]; 0 for padding rows (out of range)."""
    return jnp.where(rows < cache.lengths.shape[0], jnp.take(cache.lengths, rows, mode="clip"), 0)


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None, page_size: int = PAGE_SIZE) -> KVCache:
    """An empty cache for at least max_len positions per row (rounded up to whole pages)."""
    dtype = dtype or jnp_dtype(config.dtype)
    shape = (config.num_hidden_layers, batch, cache_length(max_len, page_size), config.num_key_value_heads,
             config.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32),
                   page_size=page_size)


# --------------------------------------------------------------------------- layers


class DecoderLayer(nn.Module):
    config: ModelConfig
    layer: int
    window: int | None = None

    @nn.compact
    def __call__(self, x, cos, sin, cache: KVCache, query_pos, rows):
        c = self.config
        h, cache = Attention(c, self.layer, self.window, name="self_attn")(
            norm(c, "input_layernorm")(x), cos, sin, cache, query_pos, rows
        )
        x = x + h
        mlp = MoE(c, name="mlp") if c.is_sparse(self.layer) else MLP(c, name="mlp")
        x = x + mlp(norm(c, "post_attention_layernorm")(x))
        return x, cache


class Decoder(nn.Module):
    """HF `model.*`: embeddings, decoder layers, final norm."""

    config: ModelConfig

    def setup(self):
        c = self.config
        dtype = jnp_dtype(c.dtype)
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype)
        self.layers = [
            DecoderLayer(c, i, c.sliding_windows[i] if c.sliding_windows else None, name=f"layers_{i}")
            for i in range(c.num_hidden_layers)
        ]
        self.norm = norm(c)

    def __call__(self, tokens, cache: KVCache, taps: Sequence[int], rows=None):
        offsets = cache.lengths if rows is None else row_lengths(cache, rows)
        query_pos = offsets[:, None] + jnp.arange(tokens.shape[1])[None, :]
        cos, sin = rope_angles(self.config, query_pos)
        x = self.embed_tokens(tokens)
        tapped = {}
        for i, layer in enumerate(self.layers):
            x, cache = layer(x, cos, sin, cache, query_pos, rows)
            if i in taps:
                tapped[i] = x
        x = self.norm(x)
        last = self.config.num_hidden_layers - 1
        if last in taps:
            # HF's hidden_states[L] is taken after the final norm; DFlash drafters were
            # trained on exactly hidden_states[l + 1], so the last tap follows HF.
            tapped[last] = x
        return x, cache, tapped

    def embed(self, tokens):
        return self.embed_tokens(tokens)

    def attend(self, h):
        return self.embed_tokens.attend(h)


class CausalLM(nn.Module):
    """HF `*ForCausalLM`. Returns (hidden after final norm, cache with the chunk written, {tap: hidden})."""

    config: ModelConfig

    def setup(self):
        c = self.config
        self.model = Decoder(c)
        if not c.tie_word_embeddings:
            dtype = jnp_dtype(c.dtype)
            self.lm_head = nn.Dense(c.vocab_size, use_bias=False, dtype=dtype, param_dtype=dtype)

    def __call__(self, tokens, cache: KVCache, taps: Sequence[int] = (), rows=None):
        return self.model(tokens, cache, taps, rows)

    def logits(self, h):
        """h [..., hidden] -> float32 logits [..., vocab]."""
        out = self.model.attend(h) if self.config.tie_word_embeddings else self.lm_head(h)
        return out.astype(jnp.float32)

    def embed(self, tokens):
        return self.model.embed(tokens)

    def _init_all(self, tokens, cache):
        h, *_ = self(tokens, cache)
        return self.logits(h)


# --------------------------------------------------------------------------- entry point


@struct.dataclass
class ForwardOutput:
    """logits: [batch, T or K, vocab] float32, or None when not asked for.
    tap_features: [batch, T, len(taps) * hidden], taps concatenated in the order given
        (the DFlash drafter's context input), or None when no taps.
    cache: the cache with the chunk written and lengths advanced by num_tokens.
    """

    logits: jax.Array | None
    tap_features: jax.Array | None
    cache: KVCache


@functools.partial(jax.jit, static_argnums=0)
def init_params(config: ModelConfig, rng=None):
    """Random parameters (for tests and shape discovery)."""
    rng = jax.random.PRNGKey(0) if rng is None else rng
    cache = init_cache(config, 1, 8)
    return CausalLM(config).init(rng, jnp.zeros((1, 1), jnp.int32), cache, method=CausalLM._init_all)["params"]


def abstract_params(config: ModelConfig):
    """ShapeDtypeStruct tree of the parameters, computed without allocating them."""
    return jax.eval_shape(lambda: init_params(config))


def forward(
    params,
    config: ModelConfig,
    tokens,
    cache: KVCache,
    *,
    num_tokens=None,
    taps: Sequence[int] = (),
    logits_indices=None,
    return_logits: bool = True,
    rows=None,
) -> ForwardOutput:
    """Process a chunk of tokens per row at each row's own offset.

    tokens: [n, T] int32, placed at positions cache.lengths[row] + 0..T-1.
    rows: [n] int32, the cache rows the n token rows belong to (default 0..n-1, n = the
        cache's batch). Rows out of range are padding: their writes are dropped.
    num_tokens: [n] int32, how many of the T tokens are real per row (default T);
        the row's length advances by it. Padding past it writes stale entries only.
    taps: target layer ids l whose outputs are returned, equal to HF hidden_states[l + 1]
        (for the last layer that is after the final norm, as in HF).
    logits_indices: [batch, K] int32 chunk indices at which to compute logits (e.g. the
        last real token of each prompt) instead of all T, to save memory at large vocab.
    The caller guarantees cache.lengths + T <= cache.max_len.
    Jit-compiled (config, taps and return_logits are static); callable inside other jits.
    """
    taps = tuple(int(l) for l in taps)
    bad = [l for l in taps if not 0 <= l < config.num_hidden_layers]
    if bad:
        raise ConfigError(f"tap layer(s) {bad} outside the target's {config.num_hidden_layers} layers")
    return _forward(params, config, tokens, cache, num_tokens, taps, logits_indices, return_logits, rows)


@functools.partial(jax.jit, static_argnames=("config", "taps", "return_logits"))
def _forward(params, config, tokens, cache, num_tokens, taps, logits_indices, return_logits, rows):
    model = CausalLM(config)
    h, new_cache, tapped = model.apply({"params": params}, tokens, cache, taps, rows)
    logits = None
    if return_logits:
        if logits_indices is not None:
            h = jnp.take_along_axis(h, logits_indices[..., None], axis=1)
        logits = model.apply({"params": params}, h, method=CausalLM.logits)
    features = jnp.concatenate([tapped[l] for l in taps], axis=-1) if taps else None
    if num_tokens is None:
        num_tokens = jnp.full(tokens.shape[:1], tokens.shape[1], jnp.int32)
    num_tokens = num_tokens.astype(jnp.int32)
    if rows is None:
        lengths = cache.lengths + num_tokens
    else:
        lengths = cache.lengths.at[rows].add(num_tokens, mode="drop")
    new_cache = new_cache.replace(lengths=lengths)
    return ForwardOutput(logits=logits, tap_features=features, cache=new_cache)
