"""The DFlash drafter (arXiv 2602.06036): Qwen3-style layers with target features injected
into the keys and values of every layer, non-causal attention over one block.

The drafter has no embedding or LM head of its own; it borrows the target's. Its only
state across decoding cycles is a context K/V cache per layer (`KVCache`, with a length
per row): context K/V depend only on the tap features of committed positions, so they are
computed once, when those positions are committed (`extend_context`), and every later
draft reads them (under a draft window, `--draft-window N`, only the last N before the block's
anchor, kept in a ring: `KVCache.window`). Block K/V are never kept.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.config import ModelConfig, RopeConfig
from dflash_jax.dflash2 import ARCHITECTURE as DFLASH2, REQUIRED_KEYS as DFLASH2_KEYS, CandidateSelector, DFlash2Config, \
    DynamicConv
from dflash_jax.families import model_config, read_config_json
from dflash_jax.errors import ConfigError
from dflash_jax.attention import AttentionMetadata, LayerKV, attend, block_attention
from dflash_jax.config import jnp_dtype
from dflash_jax.kv import KVCache, merge_heads, row_lengths, write_kv
from dflash_jax.model import MLP, RMSNorm, apply_rope, rope_angles, unfused
from dflash_jax.model.weights import Projection


@dataclasses.dataclass(frozen=True)
class DrafterConfig:
    """A drafter's decoder shape (`model`) plus the DFlash fields."""

    model: ModelConfig
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int
    dflash2: DFlash2Config | None = None  # a DFlash2 drafter's convolutions and candidate selector

    @property
    def num_taps(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, dtype: str | None = None) -> "DrafterConfig":
        dflash = cfg.get("dflash_config") or {}
        architectures = cfg.get("architectures") or []
        if not {"DFlashDraftModel", DFLASH2} & set(architectures) and not dflash:
            raise ConfigError("not a DFlash drafter config (no DFlashDraftModel architecture, no dflash_config)")
        is_dflash2 = DFLASH2 in architectures
        extra = [k for k in DFLASH2_KEYS if k in dflash]
        if extra and not is_dflash2:  # never read a DFlash2 drafter as a plain one (no convs, no selector)
            raise ConfigError(f"drafter config has DFlash2's dflash_config.{extra[0]} but its architectures "
                              f"{architectures} do not name {DFLASH2}")
        if is_dflash2 and dtype == "float16":
            raise ConfigError("a DFlash2 drafter loses its acceptance in float16 (its selector's scores overflow "
                              "and it accepts nothing); run it in bfloat16 or float32")
        # Drafter layers are always Qwen3-style (q/k norm), whatever model_type says.
        model = model_config({**cfg, "model_type": "qwen3"}, dtype=dtype).replace(qk_norm=True)
        block_size = dflash.get("block_size", cfg.get("block_size"))
        if block_size is None:
            raise ConfigError("drafter config has no block_size (top level or in dflash_config)")
        mask = dflash.get("mask_token_id", cfg.get("mask_token_id"))
        if mask is None:
            raise ConfigError("drafter config has no dflash_config.mask_token_id")
        n_target = cfg.get("num_target_layers")
        taps = dflash.get("target_layer_ids", cfg.get("target_layer_ids"))
        if taps is None:
            if n_target is None:
                raise ConfigError("drafter config has neither target_layer_ids nor num_target_layers")
            taps = default_target_layer_ids(int(n_target), model.num_hidden_layers)
        dflash2 = (DFlash2Config.from_dflash_config(dflash, model.hidden_size, model.vocab_size)
                   if is_dflash2 else None)
        return cls(model=model, block_size=int(block_size), mask_token_id=int(mask),
                   target_layer_ids=tuple(int(t) for t in taps),
                   num_target_layers=int(n_target) if n_target is not None else -1, dflash2=dflash2)

    def with_dtype(self, dtype: str) -> "DrafterConfig":
        return dataclasses.replace(self, model=self.model.replace(dtype=dtype))

    def to_hf_dict(self) -> dict[str, Any]:
        """The z-lab config.json of this drafter (the format of the published z-lab/*-DFlash* checkpoints)."""
        m = self.model
        layer_types = ["sliding_attention" if w else "full_attention" for w in (m.sliding_windows or (None,) * m.num_hidden_layers)]
        windows = [w for w in m.sliding_windows if w]
        rope = {"rope_type": m.rope.type, "factor": m.rope.factor, "low_freq_factor": m.rope.low_freq_factor,
                "high_freq_factor": m.rope.high_freq_factor,
                "original_max_position_embeddings": m.rope.original_max_position_embeddings}
        if m.rope.type == "yarn":  # a drafter trained for a gpt-oss target keeps its YaRN
            rope.update(beta_fast=m.rope.beta_fast, beta_slow=m.rope.beta_slow, truncate=m.rope.truncate,
                        attention_factor=m.rope.attention_factor)
        if m.rope.partial_rotary_factor != 1.0:
            rope["partial_rotary_factor"] = m.rope.partial_rotary_factor
        dflash = {"mask_token_id": self.mask_token_id, "target_layer_ids": list(self.target_layer_ids)}
        dflash2 = {} if self.dflash2 is None else {"architectures": [DFLASH2], "is_causal": False}
        return {
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "hidden_size": m.hidden_size, "intermediate_size": m.intermediate_size,
            "num_hidden_layers": m.num_hidden_layers, "num_attention_heads": m.num_attention_heads,
            "num_key_value_heads": m.num_key_value_heads, "head_dim": m.head_dim,
            "rms_norm_eps": m.rms_norm_eps, "rope_theta": m.rope.theta,
            "rope_scaling": None if m.rope == RopeConfig(theta=m.rope.theta) else rope,
            "max_position_embeddings": m.max_position_embeddings, "vocab_size": m.vocab_size,
            "attention_bias": m.qkv_bias, "tie_word_embeddings": False, "hidden_act": "silu",
            "num_target_layers": self.num_target_layers, "block_size": self.block_size,
            "dflash_config": dflash if self.dflash2 is None else {**dflash, **self.dflash2.to_dict()},
            "layer_types": layer_types, "sliding_window": windows[0] if windows else None,
            "use_sliding_window": bool(windows), "dtype": m.dtype, **dflash2,
        }

    @classmethod
    def from_json(cls, path, *, dtype: str | None = None) -> "DrafterConfig":
        return cls.from_hf_dict(read_config_json(path), dtype=dtype)


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """The reference rule: one tap in the middle, or n taps spread over layers 1..L-3; never the
    last layer (last_layer_tap_warning), even for a target too shallow for the rule."""
    top = max(num_target_layers - 2, 0)
    if num_draft_layers == 1:
        return (min(num_target_layers // 2, top),)
    span = num_target_layers - 4
    taps = (int(round(1 + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers))
    return tuple(min(max(t, 0), top) for t in taps)


def last_layer_tap_warning(num_target_layers: int, target_layer_ids) -> str | None:
    """Why a drafter that taps the target's last layer is trouble, or None when it does not.

    This engine and the reference read that tap after the target's final norm (hidden_states[L]
    in transformers); vLLM hands the drafter the layer's residual stream before it, so vLLM (and
    SGLang, which reads it the same way) serve such a drafter below its strength: on the bundled
    demo pair, whose stage-7 drafter tapped the last of 6 layers, vLLM's mean acceptance was 2.77
    against this engine's 3.50 (3.46 with that one tap normalised). z-lab's drafters never tap it."""
    last = num_target_layers - 1
    if last not in tuple(target_layer_ids):
        return None
    return (f"the drafter taps the target's last layer ({last}): this engine reads that tap after the target's "
            "final norm, vLLM and SGLang before it, so they serve this drafter below its strength; train with "
            f"target_layer_ids below {last} for a drafter every engine reads alike")


def retap(config: DrafterConfig, params, target_layer_ids) -> tuple[DrafterConfig, dict]:
    """The drafter pointed at other target layers, to fine-tune it there (`drafter.target_layer_ids`
    beside `drafter.init` in training). `fc` reads the taps' hidden states concatenated in
    `target_layer_ids` order, one [hidden] block of its input rows per tap: a tap it keeps keeps its
    block, a new tap's block starts at zero, so the drafter starts as it was, less what it read
    from the taps it drops."""
    taps = tuple(int(t) for t in target_layer_ids)
    if len(set(taps)) != len(taps):
        raise ConfigError(f"target_layer_ids {list(taps)} names a layer twice")
    if taps == config.target_layer_ids:
        return config, params
    kernel = params["fc"]["kernel"]
    hidden = kernel.shape[0] // config.num_taps
    old = {t: i for i, t in enumerate(config.target_layer_ids)}
    blocks = [kernel[old[t] * hidden:(old[t] + 1) * hidden] if t in old else jnp.zeros((hidden,) + kernel.shape[1:], kernel.dtype)
              for t in taps]
    params = {**params, "fc": {**params["fc"], "kernel": jnp.concatenate(blocks, axis=0)}}
    return dataclasses.replace(config, target_layer_ids=taps), params


def dense_drafter_model(target: ModelConfig, num_layers: int, intermediate_size: int | None = None,
                        dtype: str | None = None) -> ModelConfig:
    """The layers of a new drafter for `target`: dense Qwen3-style whatever the target (no
    experts, sinks, biases, linear attention, gates or Gemma's extras: built from the target's
    widths, not copied from its config), with the target's sliding-layer head shape and RoPE
    (positions are the target's) rotating whole heads: a Qwen3 layer, as vLLM and SGLang serve
    it, has no partial rotary (Gemma's proportional type is a frequency table any RoPE layer
    reads, so it stays). For an MLA target (DeepSeek-V3, GLM-5): its query heads of its RoPE width
    (qk_rope_head_dim), and at most 8 K/V heads."""
    rope = target.rope if target.rope.type == "proportional" else dataclasses.replace(target.rope,
                                                                                     partial_rotary_factor=1.0)
    kv_heads = target.num_key_value_heads
    if target.mla is not None:  # an MLA target's "K/V heads" are its query heads: grouped-query instead
        kv_heads = max(k for k in range(1, min(8, target.num_attention_heads) + 1) if target.num_attention_heads % k == 0)
    return ModelConfig(
        model_type="qwen3", vocab_size=target.vocab_size, hidden_size=target.hidden_size,
        intermediate_size=intermediate_size or target.intermediate_size, num_hidden_layers=num_layers,
        num_attention_heads=target.num_attention_heads, num_key_value_heads=kv_heads,
        head_dim=target.head_dim, rms_norm_eps=target.rms_norm_eps, rope=rope,
        max_position_embeddings=target.max_position_embeddings, qk_norm=True, sliding_windows=(None,) * num_layers,
        dtype=dtype or target.dtype)


def check_pair(target: ModelConfig, drafter: DrafterConfig) -> list[str]:
    """Refuse a target/drafter pair that cannot work together, naming the mismatch. Returns the
    warnings about a pair that works here but not everywhere (last_layer_tap_warning)."""
    d = drafter.model
    if d.hidden_size != target.hidden_size:
        raise ConfigError(f"drafter hidden_size {d.hidden_size} != target hidden_size {target.hidden_size}")
    if d.vocab_size != target.vocab_size:
        raise ConfigError(f"drafter vocab_size {d.vocab_size} != target vocab_size {target.vocab_size}")
    bad = [l for l in drafter.target_layer_ids if not 0 <= l < target.num_hidden_layers]
    if bad:
        raise ConfigError(f"drafter taps target layers {bad}, but the target has {target.num_hidden_layers} layers")
    if not 0 <= drafter.mask_token_id < target.vocab_size:
        raise ConfigError(f"drafter mask_token_id {drafter.mask_token_id} is outside the target vocab ({target.vocab_size})")
    warning = last_layer_tap_warning(target.num_hidden_layers, drafter.target_layer_ids)
    return [warning] if warning else []


# --------------------------------------------------------------------------- module


class DraftAttention(nn.Module):
    """KV injection: block queries attend to [context ; block] keys, non-causally."""

    config: ModelConfig
    window: int | None = None

    def setup(self):
        c = self.config
        dtype = jnp_dtype(c.dtype)
        dense = lambda n, bias: Projection(n, bias, dtype, dtype, format=c.weight_format)
        self.q_proj = dense(c.num_attention_heads * c.head_dim, c.qkv_bias)
        self.k_proj = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias)
        self.v_proj = dense(c.num_key_value_heads * c.head_dim, c.qkv_bias)
        self.o_proj = dense(c.hidden_size, c.o_bias)
        self.q_norm = RMSNorm(c.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(c.rms_norm_eps, dtype)

    def kv(self, x, cos, sin):
        """Keys (normed, rotated) and values of x [batch, T, hidden] -> [batch, T, kv_heads, head_dim]."""
        c = self.config
        b, t, _ = x.shape
        k = self.k_norm(unfused(self.k_proj(x)).reshape(b, t, c.num_key_value_heads, c.head_dim))
        v = unfused(self.v_proj(x)).reshape(b, t, c.num_key_value_heads, c.head_dim)
        return apply_rope(k, cos, sin), v

    def queries(self, x, cos, sin):
        c = self.config
        b, t, _ = x.shape
        q = apply_rope(self.q_norm(unfused(self.q_proj(x)).reshape(b, t, c.num_attention_heads, c.head_dim)), cos, sin)
        return q.reshape(b, t, c.num_key_value_heads, c.num_groups, c.head_dim)

    def __call__(self, x, cos, sin, positions, context: KVCache, layer: int):
        """Decoding: x [batch, block, hidden] at positions [batch, block]; the context K/V are
        layer `layer` of the drafter's context cache, read over the pages the rows have used."""
        k, v = self.kv(x, cos, sin)
        # the block is non-causal and never cached
        q_pos, window = context_window(positions, self.window, context.window)
        meta = AttentionMetadata.block(q_pos, context.lengths, window=window, page_size=context.page_size,
                                       pages=context.pages, ring=context.ring)
        out, _ = attend(self.queries(x, cos, sin), k, v, LayerKV(context.k, context.v, layer), meta)
        return self.o_proj(out.astype(x.dtype))

    def train_pass(self, x, cos, sin, ctx_k, ctx_v, ctx_mask, block_size: int):
        """Training, every block of a sequence at once: x [batch, N*B, hidden] (B = block_size);
        ctx_k/v [batch, S, kv_heads, head_dim]; ctx_mask [batch, N*B, S]. Each block sees the
        context its mask allows and itself, never another block."""
        k, v = self.kv(x, cos, sin)
        out = block_attention(self.queries(x, cos, sin), ctx_k.astype(k.dtype), ctx_v.astype(v.dtype), ctx_mask, k, v,
                              block_size)
        return self.o_proj(out.astype(x.dtype))


def context_window(positions, layer_window: int | None, draft_window: int | None):
    """(the positions the attention's window counts from, the window) of a block at positions
    [n, T] (the anchor first) in a layer with its own sliding window (None: none) under a draft
    window (`KVCache.window`, None: none). A layer's window counts from each query: keys >
    position - window. A draft window N counts from the anchor: context positions anchor - N ..
    anchor - 1, for every query of the block. Both: each query sees what both allow (the smaller
    rules), one window from shifted positions: keys > max(position - w, anchor - N - 1)."""
    if draft_window is None:
        return positions, layer_window
    anchor = positions[:, :1]
    if layer_window is None:
        return jnp.broadcast_to(anchor, positions.shape), draft_window + 1
    return jnp.maximum(positions, anchor + layer_window - draft_window - 1), layer_window


# Rematerialisation in training (`DFlashDrafter.remat`): what a layer's forward keeps for its backward.
# "attention": the projections' and MLP's outputs (dots against weights); the attention scores,
# the largest tensors of the step, are recomputed. "layer": only the layer's inputs.
REMAT_POLICIES = {"attention": jax.checkpoint_policies.dots_with_no_batch_dims_saveable, "layer": None}


class DraftLayer(nn.Module):
    """Attention then MLP, each pre-normed with a residual; a DFlash2 drafter's layer wraps each
    sublayer in its dynamic convolution (`dflash_jax.dflash2.DynamicConv`)."""

    config: ModelConfig
    window: int | None = None
    dflash2: DFlash2Config | None = None

    def setup(self):
        c = self.config
        dtype = jnp_dtype(c.dtype)
        self.self_attn = DraftAttention(c, self.window)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(c.rms_norm_eps, dtype)
        if self.dflash2 is not None:
            conv = lambda: DynamicConv(c.hidden_size, self.dflash2.conv_kernel_size, self.dflash2.conv_group_size, dtype)
            self.attention_conv, self.mlp_conv = conv(), conv()

    def context_kv(self, ctx, cos, sin):
        return self.self_attn.kv(ctx, cos, sin)

    def _sublayer(self, x, norm, conv_name: str, sublayer, block_size: int):
        """x + sublayer(norm(x)), or with the DFlash2 convolution around the sublayer."""
        h = norm(x)
        if self.dflash2 is None:
            return x + sublayer(h)
        conv = getattr(self, conv_name)
        h, delta = conv.prepare(h, block_size)
        return x + conv.finish(sublayer(h), delta, block_size)

    def __call__(self, x, cos, sin, positions, context: KVCache, layer: int):
        attend = lambda h: self.self_attn(h, cos, sin, positions, context, layer)  # noqa: E731
        x = self._sublayer(x, self.input_layernorm, "attention_conv", attend, x.shape[1])
        return self._sublayer(x, self.post_attention_layernorm, "mlp_conv", self.mlp, x.shape[1])

    def train_pass(self, x, cos, sin, ctx_k, ctx_v, ctx_mask, block_size: int):
        attend = lambda h: self.self_attn.train_pass(h, cos, sin, ctx_k, ctx_v, ctx_mask, block_size)  # noqa: E731
        x = self._sublayer(x, self.input_layernorm, "attention_conv", attend, block_size)
        return self._sublayer(x, self.post_attention_layernorm, "mlp_conv", self.mlp, block_size)


class DFlashDrafter(nn.Module):
    """Parameter paths mirror the z-lab names: `fc`, `hidden_norm`, `layers_{i}/...`, `norm` (a DFlash2
    drafter's: `layers_{i}/attention_conv`, `layers_{i}/mlp_conv`, `candidate_selector`)."""

    config: DrafterConfig
    remat: str = "none"  # training's rematerialisation of each layer: a key of REMAT_POLICIES

    def setup(self):
        c = self.config.model
        dtype = jnp_dtype(c.dtype)
        self.fc = Projection(c.hidden_size, False, dtype, dtype, format=c.weight_format)
        self.hidden_norm = RMSNorm(c.rms_norm_eps, dtype)
        windows = c.sliding_windows or (None,) * c.num_hidden_layers
        layer = DraftLayer
        if self.remat != "none":  # the same parameters; train_pass's backward recomputes what the policy drops
            layer = nn.remat(DraftLayer, policy=REMAT_POLICIES[self.remat], methods=["train_pass"],
                             static_argnums=(7,))
        self.layers = [layer(c, windows[i], self.config.dflash2) for i in range(c.num_hidden_layers)]  # layers_{i}
        self.norm = RMSNorm(c.rms_norm_eps, dtype)
        if self.config.dflash2 is not None:
            self.candidate_selector = CandidateSelector(c.vocab_size, self.config.dflash2.selector_rank, dtype)

    def _block_input(self, block_embeds):
        """The target's embeddings of the block tokens, in the compute dtype (a DFlash2 drafter's
        times its input_embedding_scale)."""
        x = block_embeds.astype(jnp_dtype(self.config.model.dtype))
        d2 = self.config.dflash2
        return x if d2 is None or d2.input_embedding_scale == 1.0 else x * jnp.asarray(d2.input_embedding_scale, x.dtype)

    def edge_scores(self, hidden, candidates, unary, predecessors):
        """A DFlash2 drafter's selector: edge scores [b, D, Kc, Kc] (`dflash_jax.dflash2.CandidateSelector`)."""
        return self.candidate_selector(hidden, candidates, unary, predecessors)

    def context(self, features):
        """Context feature: hidden_norm(fc(concat of taps)). [batch, T, n*hidden] -> [batch, T, hidden]."""
        return self.hidden_norm(self.fc(features.astype(jnp_dtype(self.config.model.dtype))))

    def context_kv(self, features, positions):
        """Per-layer context K/V of tap features at positions [batch, T] -> k, v [layers, batch, T, kv, hd]."""
        ctx = self.context(features)
        cos, sin = rope_angles(self.config.model, positions)
        kvs = [layer.context_kv(ctx, cos, sin) for layer in self.layers]
        return jnp.stack([k for k, _ in kvs]), jnp.stack([v for _, v in kvs])

    def __call__(self, block_embeds, positions, context: KVCache):
        """Drafter output after its final norm, [batch, block, hidden].

        block_embeds [batch, block, hidden] (target embeddings of [anchor, MASK...]) at
        positions [batch, block]; context: the context cache (k/v [layers, batch, S, kv, hd],
        context.lengths[b] valid entries, entry j holding position j, or a ring of the last ones).
        """
        c = self.config.model
        cos, sin = rope_angles(c, positions)
        x = self._block_input(block_embeds)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, positions, context, i)
        return self.norm(x)

    def train_hidden(self, block_embeds, block_positions, features, ctx_mask):
        """All blocks of a sequence in one pass (training).

        block_embeds [batch, N*B, hidden] at block_positions [batch, N*B], B = the block size;
        features [batch, S, n*hidden] of positions 0..S-1; ctx_mask [batch, N*B, S] (a block sees
        context strictly before its anchor). A block also sees itself, and no other block.
        """
        c = self.config.model
        s = features.shape[1]
        ctx_pos = jnp.broadcast_to(jnp.arange(s), features.shape[:2])
        ctx_k, ctx_v = self.context_kv(features, ctx_pos)
        cos, sin = rope_angles(c, block_positions)
        x = self._block_input(block_embeds)
        for i, layer in enumerate(self.layers):
            mask = ctx_mask
            if layer.window is not None:
                mask &= jnp.arange(s)[None, None, :] > block_positions[:, :, None] - layer.window
            x = layer.train_pass(x, cos, sin, ctx_k[i], ctx_v[i], mask, self.config.block_size)
        return self.norm(x)

    def _init_all(self, features, block_embeds):
        b, t = features.shape[:2]
        pos = jnp.broadcast_to(jnp.arange(t), (b, t))
        k, v = self.context_kv(features, pos)
        hidden = self(block_embeds, pos, KVCache(k=merge_heads(k), v=merge_heads(v), lengths=jnp.full((b,), t, jnp.int32),
                                                 heads=k.shape[-2]))
        if self.config.dflash2 is not None:
            ids = jnp.zeros(hidden.shape[:2] + (self.config.dflash2.selector_top_k,), jnp.int32)
            self.edge_scores(hidden, ids, ids.astype(jnp.float32), ids)
        return hidden


# --------------------------------------------------------------------------- functions


@functools.partial(jax.jit, static_argnums=0)
def init_drafter_params(config: DrafterConfig, rng=None):
    rng = jax.random.PRNGKey(0) if rng is None else rng
    d = config.model.hidden_size
    return DFlashDrafter(config).init(
        rng, jnp.zeros((1, 2, config.num_taps * d)), jnp.zeros((1, 2, d)), method=DFlashDrafter._init_all
    )["params"]


def abstract_drafter_params(config: DrafterConfig):
    return jax.eval_shape(lambda: init_drafter_params(config))


@functools.partial(jax.jit, static_argnames=("config",))
def extend_context(params, config: DrafterConfig, features, cache: KVCache, num_tokens, rows=None) -> KVCache:
    """Commit tap features [n, T, n_taps*hidden] of positions lengths..lengths+T-1: their
    K/V go into the context cache (in place under jit); each row's length advances by
    num_tokens [n]. rows [n]: the cache rows the features belong to (default 0..n-1; rows
    out of range are padding and write nothing)."""
    t = features.shape[1]
    lengths = cache.lengths if rows is None else row_lengths(cache, rows)
    positions = lengths[:, None] + jnp.arange(t)[None, :]
    k, v = DFlashDrafter(config).apply({"params": params}, features, positions, method=DFlashDrafter.context_kv)
    num_tokens = num_tokens.astype(jnp.int32)
    new_lengths = cache.lengths + num_tokens if rows is None else cache.lengths.at[rows].add(num_tokens, mode="drop")
    return cache.replace(k=write_kv(cache.k, None, k, lengths, rows, **cache.kv_args("k")),
                         v=write_kv(cache.v, None, v, lengths, rows, **cache.kv_args("v")),
                         lengths=new_lengths)


@functools.partial(jax.jit, static_argnames=("config",))
def draft_hidden(params, config: DrafterConfig, block_embeds, cache: KVCache):
    """Drafter hidden states [batch, block, hidden] (after its final norm) for a block that
    starts at each row's context length (the anchor's position)."""
    t = block_embeds.shape[1]
    positions = cache.lengths[:, None] + jnp.arange(t)[None, :]
    return DFlashDrafter(config).apply({"params": params}, block_embeds, positions, cache)
