"""The target decoder: one Flax Linen implementation for every family in `dflash_jax.families`.

Parameter paths mirror the Hugging Face names (`model/layers_3/self_attn/q_proj/kernel`
for `model.layers.3.self_attn.q_proj.weight`), so conversion is a table.

The KV cache (`dflash_jax.kv.KVCache`) is preallocated with a length per row, in one of three
layouts: per-row slots (`[layers, batch, max_len, kv_heads * head_dim]` for keys and for values),
a page pool shared by every row (`[layers, pages, page_size, ...]` and a page table per row), or,
where every layer of a group slides, a ring of the last positions per row. `forward` writes a
chunk of T tokens per row at that row's own offset (`cache.lengths`) straight into the cache (in
place under jit, `dflash_jax.kv.write_kv`), then attends over the positions the rows have used
(`dflash_jax.attention`), so one entry point serves batched prefill (prompts right-padded to a bucket; pass
`num_tokens`), single-token decode (T=1) and the block verify pass of speculative decoding
(T=K+1). Rollback is a length update: entries at or past a row's length are stale, and the
causal limit (key position <= query position, with every position below the query written
in this or an earlier call) guarantees they are never read.

Hybrid decoders (Qwen3.5) mix in gated delta-net linear-attention layers, which keep a
recurrent state and a convolution tail per row instead of KV entries; the cache holds those
too (`KVCache.state`, `.tail`: one array per linear layer, since each step rewrites a whole
state, where the KV buffers stack the attention layers, whose steps write a few positions). A recurrent state cannot be rolled back by a length, so a verify pass runs
with `defer_recurrent`: it reads the states but leaves them, returns what the block would
write (`ForwardOutput.pending`), and `settle` advances each row by its accepted prefix.
"""

from __future__ import annotations

import functools
from typing import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import struct

from dflash_jax.errors import ConfigError
from dflash_jax.kv import KVCache, init_cache, row_lengths
from dflash_jax.config import ModelConfig, jnp_dtype
from dflash_jax.model.layers import ACTIVATIONS, MLP, Attention, norm, rope_angles
from dflash_jax.model.delta_rule import GatedDeltaNet, Pending
from dflash_jax.model.delta_rule import settle_state
from dflash_jax.model.mla import LatentAttention
from dflash_jax.model.moe import MoE
from dflash_jax.model.weights import Projection, Transposed, as_weight, project


# --------------------------------------------------------------------------- layers


def _linear_layer(c: ModelConfig, name: str) -> GatedDeltaNet:
    lin = c.linear_attention
    return GatedDeltaNet(c.hidden_size, lin.k_heads, lin.v_heads, lin.k_dim, lin.v_dim, lin.conv_kernel,
                         eps=c.rms_norm_eps, dtype=jnp_dtype(c.dtype), weight_format=c.weight_format, name=name)


class DecoderLayer(nn.Module):
    """One layer: token mixing (attention, or a gated delta-net), then the MLP (dense, sparse,
    or for Gemma 4 both side by side), with the config's block norms."""

    config: ModelConfig
    layer: int

    @nn.compact
    def __call__(self, x, cos, sin, cache: KVCache, query_pos, rows, valid=None, defer=False, per_layer_input=None,
                 tree_mask=None, selected=None):
        """Returns (x, cache, pending, selected): pending is the linear layer's deferred `Pending`
        (defer), else None; selected the positions sparse attention saw (`mla.LatentAttention`: the
        next shared layer's), else None. tree_mask: a draft tree's ancestor mask (`forward`'s `tree`)."""
        c = self.config
        slot = c.cache_slot(self.layer)
        pending = None
        h = norm(c, "input_layernorm")(x)
        if c.is_linear(self.layer):
            take = (lambda a: a[slot]) if rows is None else (lambda a: jnp.take(a[slot], rows, axis=0, mode="clip"))
            h, tail, state, pending = _linear_layer(c, "linear_attn")(h, take(cache.tail), take(cache.state),
                                                                     valid=valid, defer=defer)
            if not defer:
                put = ((lambda a, new: a[:slot] + (new,) + a[slot + 1:]) if rows is None
                       else (lambda a, new: a[:slot] + (a[slot].at[rows].set(new, mode="drop"),) + a[slot + 1:]))
                cache = cache.replace(tail=put(cache.tail, tail), state=put(cache.state, state))
        elif c.mla is not None:
            h, cache, selected = LatentAttention(c, self.layer, name="self_attn")(h, cos, sin, cache, query_pos, rows,
                                                                                 tree_mask, selected)
        else:
            h, cache = Attention(c, self.layer, name="self_attn")(h, cos, sin, cache, query_pos, rows, tree_mask)
        if c.block_norms == "sandwich":
            x = x + norm(c, "post_attention_layernorm")(h)
            h = MLP(c, name="mlp")(norm(c, "pre_feedforward_layernorm")(x))
            if c.is_sparse(self.layer):  # Gemma 4: experts beside the MLP, routed on the block's input
                experts = MoE(c, name="moe")(norm(c, "pre_feedforward_layernorm_2")(x), router_x=x)
                h = norm(c, "post_feedforward_layernorm_1")(h) + norm(c, "post_feedforward_layernorm_2")(experts)
            x = x + norm(c, "post_feedforward_layernorm")(h)
        else:
            x = x + h
            mlp = MoE(c, name="mlp") if c.is_sparse(self.layer) else MLP(c, name="mlp")
            x = x + mlp(norm(c, "post_attention_layernorm")(x))
        if c.per_layer_input_size:
            dtype = jnp_dtype(c.dtype)
            dense = lambda n, name: Projection(n, False, dtype, dtype, format=c.weight_format, name=name)
            gate = ACTIVATIONS[c.mlp_activation](dense(c.per_layer_input_size, "per_layer_input_gate")(x))
            h = dense(c.hidden_size, "per_layer_projection")(gate * per_layer_input)
            x = x + norm(c, "post_per_layer_input_norm")(h)
        if c.layer_scalar:
            x = x * self.param("layer_scalar", nn.initializers.ones, (1,), jnp_dtype(c.dtype))
        return x, cache, pending, selected


class Decoder(nn.Module):
    """HF `model.*`: embeddings, decoder layers, final norm."""

    config: ModelConfig

    def setup(self):
        c = self.config
        dtype = jnp_dtype(c.dtype)
        self.embed_tokens = nn.Embed(c.vocab_size, c.hidden_size, dtype=dtype, param_dtype=dtype)
        self.layers = [DecoderLayer(c, i, name=f"layers_{i}") for i in range(c.num_hidden_layers)]
        self.norm = norm(c)
        if c.per_layer_input_size:
            width = c.num_hidden_layers * c.per_layer_input_size
            self.embed_tokens_per_layer = nn.Embed(c.per_layer_vocab_size, width, dtype=dtype, param_dtype=dtype)
            self.per_layer_model_projection = Projection(width, False, dtype, dtype, format=c.weight_format)
            self.per_layer_projection_norm = norm(c)

    def __call__(self, tokens, cache: KVCache, taps: Sequence[int], rows=None, valid=None, defer=False, tree=None):
        c = self.config
        offsets = cache.lengths if rows is None else row_lengths(cache, rows)
        steps = jnp.arange(tokens.shape[1])[None, :] if tree is None else tree[0]
        query_pos = offsets[:, None] + steps
        # One RoPE table per kind of layer (Gemma 4's global layers have their own).
        angles = {kind: rope_angles(c, query_pos, next(i for i in range(c.num_hidden_layers) if c.is_global(i) == kind))
                  for kind in {c.is_global(i) for i in range(c.num_hidden_layers)}}
        x = self.embed(tokens)
        per_layer = self.per_layer_inputs(tokens, x) if c.per_layer_input_size else None
        tapped, pending, selected = {}, [], None
        for i, layer in enumerate(self.layers):
            cos, sin = angles[c.is_global(i)]
            x, cache, p, selected = layer(x, cos, sin, cache, query_pos, rows, valid, defer,
                                          None if per_layer is None else per_layer[:, :, i],
                                          None if tree is None else tree[1], selected)
            if p is not None:
                pending.append(p)
            if i in taps:
                tapped[i] = x
        x = self.norm(x)
        last = self.config.num_hidden_layers - 1
        if last in taps:
            # HF's hidden_states[L] is taken after the final norm; DFlash drafters were
            # trained on exactly hidden_states[l + 1], so the last tap follows HF.
            tapped[last] = x
        pending = tuple(pending) or None
        return x, cache, tapped, pending

    def embed(self, tokens):
        """Token embeddings; with `embed_scale` times sqrt(hidden) rounded to the dtype, as
        transformers' scaled embedding (the drafter borrows exactly these)."""
        x = self.embed_tokens(tokens)
        if self.config.embed_scale:
            x = x * jnp.asarray(self.config.hidden_size ** 0.5, x.dtype)
        return x

    def per_layer_inputs(self, tokens, x):
        """[n, T, layers, per_layer_input_size]: each layer's slice of the per-layer embedding
        (times sqrt of its width) and of the normed projection of the embeddings, summed and
        times 2 ** -0.5 (Gemma 4's per-layer inputs)."""
        c = self.config
        shape = (*tokens.shape, c.num_hidden_layers, c.per_layer_input_size)
        table = self.embed_tokens_per_layer(tokens)
        identity = (table * jnp.asarray(c.per_layer_input_size ** 0.5, table.dtype)).reshape(shape)
        context = self.per_layer_model_projection(x) * jnp.asarray(c.hidden_size ** -0.5, x.dtype)
        context = self.per_layer_projection_norm(context.reshape(shape))
        return (context + identity) * jnp.asarray(2 ** -0.5, x.dtype)

    def tied_logits(self, h):
        """h @ the embedding table^T: the LM head of a model with tied embeddings (as `nn.Embed.attend`)."""
        return project(h, as_weight(self.embed_tokens.embedding), Transposed(self.embed_tokens.dtype))


class CausalLM(nn.Module):
    """HF `*ForCausalLM`. Returns (hidden after final norm, cache with the chunk written, {tap: hidden})."""

    config: ModelConfig

    def setup(self):
        c = self.config
        self.model = Decoder(c)
        if not c.tie_word_embeddings:
            dtype = jnp_dtype(c.dtype)
            self.lm_head = Projection(c.vocab_size, False, dtype, dtype)  # the head stays dense, as quantized checkpoints keep it

    def __call__(self, tokens, cache: KVCache, taps: Sequence[int] = (), rows=None, valid=None, defer=False,
                 tree=None):
        return self.model(tokens, cache, taps, rows, valid, defer, tree)

    def head_logits(self, h):
        """h [..., hidden] -> the head's raw float32 logits [..., vocab] (no soft cap)."""
        out = self.model.tied_logits(h) if self.config.tie_word_embeddings else self.lm_head(h)
        return out.astype(jnp.float32)

    def logits(self, h):
        """h [..., hidden] -> float32 logits [..., vocab] (soft-capped: cap * tanh(logits / cap),
        with `final_logit_softcap`)."""
        out = self.head_logits(h)
        cap = self.config.final_logit_softcap
        return out if cap is None else cap * jnp.tanh(out / cap)

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
    pending: with defer_recurrent, the linear-attention layers' deferred writes (a `Pending`
        per linear layer) for `settle`; else None.
    """

    logits: jax.Array | None
    tap_features: jax.Array | None
    cache: KVCache
    pending: tuple[Pending, ...] | None = None


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
    defer_recurrent: bool = False,
    tree=None,
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
    defer_recurrent: linear-attention layers (hybrid decoders) read their states but leave
        them as they were, and the output's `pending` says what the chunk would write;
        `settle` then commits each row's accepted prefix (the verify pass of speculative
        decoding). Otherwise their states advance by num_tokens per row.
    tree: (depth [n, T], mask [n, T, T]) for a draft tree's verify (`dflash_jax.engine.tree`):
        token i is a tree node at position cache.lengths + depth[:, i] (node 0, the root, at
        depth 0), seeing the cache and the nodes mask[:, i] marks (its ancestors and itself);
        its K/V are written at cache.lengths + i. Attention layers only (no recurrent layers).
    The caller guarantees cache.lengths + T <= cache.max_len (and, with a ring, T at most the
    chunk it was sized for).
    Jit-compiled (config, taps, return_logits and defer_recurrent are static); callable inside other jits.
    """
    taps = tuple(int(l) for l in taps)
    bad = [l for l in taps if not 0 <= l < config.num_hidden_layers]
    if bad:
        raise ConfigError(f"tap layer(s) {bad} outside the target's {config.num_hidden_layers} layers")
    if tree is not None and config.num_linear_layers:
        raise ConfigError("a tree verify needs attention layers only: recurrent layers cannot run several branches")
    if tree is not None and config.mla is not None and config.mla.indexer is not None:
        raise ConfigError("a tree verify cannot run sparse attention: its indexer picks positions by query position")
    return _forward(params, config, tokens, cache, num_tokens, taps, logits_indices, return_logits, rows,
                    defer_recurrent, tree)


@functools.partial(jax.jit, static_argnames=("config", "taps", "return_logits", "defer_recurrent"))
def _forward(params, config, tokens, cache, num_tokens, taps, logits_indices, return_logits, rows, defer_recurrent,
             tree=None):
    model = CausalLM(config)
    valid = None if num_tokens is None or not config.num_linear_layers else num_tokens.astype(jnp.int32)
    h, new_cache, tapped, pending = model.apply({"params": params}, tokens, cache, taps, rows, valid, defer_recurrent,
                                                tree)
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
    return ForwardOutput(logits=logits, tap_features=features, cache=new_cache, pending=pending)


def settle(cache: KVCache, pending: tuple[Pending, ...] | None, keep) -> KVCache:
    """Commit the first keep[b] (0..T) positions of a deferred chunk (`forward(...,
    defer_recurrent=True)`) into each row's linear-attention states and convolution tails:
    afterwards they are what a run over those positions alone would have left. Lengths are
    the caller's (attention layers roll back by length). A no-op without linear layers."""
    if pending is None:
        return cache
    tail, state = zip(*_settle_layers(cache.tail, cache.state, pending, keep))
    return cache.replace(tail=tuple(tail), state=tuple(state))


@jax.jit
def _settle_layers(tails, states, pending, keep):
    return [settle_state(t, s, p, keep) for t, s, p in zip(tails, states, pending)]
