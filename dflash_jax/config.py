"""Model configuration parsed from a Hugging Face `config.json`.

One decoder implementation serves every family; a family (`dflash_jax.families`) says
which switches its checkpoints use and parses the fields only it has (experts, router).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dflash_jax.errors import ConfigError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # YaRN (gpt-oss): the ramp between interpolated and extrapolated frequencies, and the
    # factor cos and sin are multiplied by.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0
    # Proportional (Gemma 4's full layers): only the first partial_rotary_factor of the pairs
    # rotate, at frequencies set by the whole head_dim; the rest have frequency 0 (identity).
    # Any other type (Qwen3.5): only the first partial_rotary_factor * head_dim dimensions
    # rotate, as a head of that size would; the rest pass through.
    partial_rotary_factor: float = 1.0

    def rotary_dim(self, head_dim: int) -> int:
        """How many leading dimensions of a head the rotation covers (its half-split is
        inside them)."""
        if self.type == "proportional" or self.partial_rotary_factor == 1.0:
            return head_dim
        return int(head_dim * self.partial_rotary_factor)


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """A sparse mixture-of-experts MLP block.

    router: "softmax_topk" (softmax over all experts, then the top k; Qwen3-MoE, which
        renormalises the k weights when `norm_topk_prob`) or "topk_softmax" (top k logits,
        then a softmax over those k; gpt-oss).
    activation: "silu" (silu(gate) * up), "gelu_tanh" (Gemma 4) or "clamped_swiglu" (gpt-oss:
        gate clamped above and up on both sides at `swiglu_limit`, (up + 1) * gate * sigmoid(alpha * gate)).
    fused_gate_up: gate and up live in one `gate_up_proj` [experts, hidden, 2 * inter],
        interleaved (gate = [..., 0::2], up = [..., 1::2]) as gpt-oss stores them.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    router: str = "softmax_topk"
    norm_topk_prob: bool = False
    router_bias: bool = False
    expert_bias: bool = False
    fused_gate_up: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # A dense "shared expert" MLP of this width every token goes through, scaled by
    # sigmoid(shared_expert_gate(x)) (Qwen3.5-MoE); 0: none.
    shared_expert_size: int = 0
    # Gemma 4: gate and up are the two halves of `gate_up_proj` (not interleaved); the router's
    # input is RMS-normed without weight, times a learned scale and hidden ** -0.5; each
    # expert's routing weight is times a learned per-expert scale.
    gate_up_halves: bool = False
    router_input_norm: bool = False
    per_expert_scale: bool = False

    @classmethod
    def parse(cls, cfg: dict[str, Any], model_type: str, *, experts: tuple[str, ...], **kw) -> "MoeConfig":
        """Read and check the expert count (the first of the fields `experts` present),
        `num_experts_per_tok` and the expert width (`moe_intermediate_size`, else
        `intermediate_size`)."""
        def positive(key):
            value = cfg.get(key)
            if value is None:
                raise ConfigError(f"config.json ({model_type}) is missing required field {key!r}")
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config.json ({model_type}) field {key!r} must be a positive integer, got {value!r}")
            return value

        experts_field = next((key for key in experts if key in cfg), experts[0])
        num_experts, top_k = positive(experts_field), positive("num_experts_per_tok")
        if top_k > num_experts:
            raise ConfigError(f"config.json ({model_type}): num_experts_per_tok {top_k} > {experts_field} {num_experts}")
        width = positive("moe_intermediate_size" if "moe_intermediate_size" in cfg else "intermediate_size")
        return cls(num_experts=num_experts, top_k=top_k, intermediate_size=width, **kw)


@dataclasses.dataclass(frozen=True)
class LinearAttentionConfig:
    """The gated delta-net layers of a hybrid decoder (Qwen3.5): q/k heads and their size,
    value heads (a multiple of the q/k heads) and their size, the causal convolution's width."""

    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int = 4

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Static description of a decoder. Frozen and hashable: usable as a jit static arg."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = RopeConfig()
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Per layer: None (full attention) or the sliding window length.
    sliding_windows: tuple[int | None, ...] = ()
    # A learned per-head logit joins each softmax's denominator (gpt-oss).
    attention_sinks: bool = False
    # RMSNorm multiplies its weight in float32 before casting back (gpt-oss), not after.
    norm_weight_in_float32: bool = False
    # The sparse MLP block, and per layer whether it has one (else the dense MLP).
    moe: MoeConfig | None = None
    sparse_layers: tuple[bool, ...] = ()
    # Hybrid decoders (Qwen3.5): per layer whether it is a gated delta-net linear-attention
    # layer (a recurrent state, no KV cache) rather than attention.
    linear_attention: LinearAttentionConfig | None = None
    linear_layers: tuple[bool, ...] = ()
    # Attention output times sigmoid(gate), the gate a second half of each q_proj head (Qwen3.5).
    attention_output_gate: bool = False
    # RMSNorm weights are offsets from 1: x * (1 + w) (Qwen3.5).
    norm_zero_centered: bool = False
    # Gemma 4. Full-attention ("global") layers with their own head_dim, KV heads and RoPE
    # (None: the config's); their values may be their keys (attention_k_eq_v: the key
    # projection before k_norm, then the value norm).
    global_head_dim: int | None = None
    global_kv_heads: int | None = None
    global_rope: RopeConfig | None = None
    attention_k_eq_v: bool = False
    # Per layer: the earlier layer whose K/V it reads instead of its own (KV sharing), or None.
    kv_shared_from: tuple[int | None, ...] = ()
    value_norm: bool = False  # an RMSNorm without weight on the values
    attention_scale: float | None = None  # the softmax's scale (None: head_dim ** -0.5)
    # "pre": input_layernorm before attention, post_attention_layernorm before the MLP (Llama);
    # "sandwich": each block's input and output normed (Gemma: post_attention_layernorm on the
    # attention output, pre_/post_feedforward_layernorm around the MLP).
    block_norms: str = "pre"
    embed_scale: bool = False  # embeddings times sqrt(hidden) (rounded to the dtype, as HF)
    final_logit_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    mlp_activation: str = "silu"  # "silu" or "gelu_tanh" (the gated MLP's and the experts')
    layer_scalar: bool = False  # a learned scalar multiplies each layer's output
    # Per-layer inputs (Gemma 4 E2B/E4B): a per_layer_input_size slice of a second embedding
    # (and of a projection of the first) feeds each layer through a small gated projection.
    per_layer_input_size: int = 0
    per_layer_vocab_size: int = 0
    dtype: str = "float32"

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def is_sparse(self, layer: int) -> bool:
        return bool(self.sparse_layers) and self.sparse_layers[layer]

    def is_linear(self, layer: int) -> bool:
        return bool(self.linear_layers) and self.linear_layers[layer]

    @property
    def num_attention_layers(self) -> int:
        """Attention layers (every layer but the linear-attention ones)."""
        return self.num_hidden_layers - sum(self.linear_layers)

    @property
    def num_linear_layers(self) -> int:
        return sum(self.linear_layers)

    def is_global(self, layer: int) -> bool:
        """A full-attention layer with its own head shape (Gemma 4's global layers)."""
        return (self.global_head_dim is not None or self.global_kv_heads is not None) and not (
            self.sliding_windows and self.sliding_windows[layer]) and not self.is_linear(layer)

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(head_dim, KV heads) of an attention layer."""
        if self.is_global(layer):
            return self.global_head_dim or self.head_dim, self.global_kv_heads or self.num_key_value_heads
        return self.head_dim, self.num_key_value_heads

    def layer_rope(self, layer: int) -> RopeConfig:
        return self.global_rope if self.is_global(layer) and self.global_rope is not None else self.rope

    def kv_producer(self, layer: int) -> int:
        """The layer whose K/V this layer attends over: itself, or the one it shares."""
        shared = self.kv_shared_from[layer] if self.kv_shared_from else None
        return layer if shared is None else shared

    def cache_slot(self, layer: int) -> int:
        """The layer's index into its cache: into the KV buffers of its group (`is_global`) for
        an attention layer (a layer sharing K/V: its producer's), into the recurrent states
        for a linear one."""
        if self.is_linear(layer):
            return sum(self.is_linear(i) for i in range(layer))
        layer = self.kv_producer(layer)
        return sum(self.kv_producer(i) == i and not self.is_linear(i) and self.is_global(i) == self.is_global(layer)
                   for i in range(layer))

    def num_kv_slots(self, global_group: bool) -> int:
        """KV buffer slots of a group: its attention layers that keep their own K/V."""
        return sum(self.kv_producer(i) == i and not self.is_linear(i) and self.is_global(i) == global_group
                   for i in range(self.num_hidden_layers))

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, dtype: str | None = None) -> "ModelConfig":
        from dflash_jax.families import family as find_family

        model_type = cfg.get("model_type")
        family = find_family(model_type)
        if family.text_config:  # a multimodal checkpoint: the decoder is its text model
            text = cfg.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError(f"config.json ({model_type}) is missing required field 'text_config'")
            top = {k: cfg[k] for k in ("tie_word_embeddings", "dtype", "torch_dtype") if k in cfg}
            cfg = {**text, **top, "model_type": model_type}

        def need(key):
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"config.json ({model_type}) is missing required field {key!r}")
            return cfg[key]

        def switch(name):
            value = family.switches.get(name, False)
            return bool(cfg.get(value, False)) if isinstance(value, str) else bool(value)

        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ConfigError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
        head_dim = cfg.get("head_dim") or hidden // heads
        layers = int(need("num_hidden_layers"))

        dtype = dtype or _dtype_from_config(cfg)
        if dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")

        quant = (cfg.get("quantization_config") or {}).get("quant_method")
        if quant is not None and quant not in family.quantizations:
            raise ConfigError(f"quantization {quant!r} is not supported for {model_type}"
                              + (f" (only {', '.join(family.quantizations)})" if family.quantizations else ""))
        extra = family.parse(cfg, layers) if family.parse else {}
        fields = dict(
            model_type=model_type,
            vocab_size=int(need("vocab_size")),
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope=_rope_from_config(cfg),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qk_norm=switch("qk_norm"),
            qkv_bias=switch("qkv_bias"),
            o_bias=switch("o_bias"),
            mlp_bias=switch("mlp_bias"),
            attention_sinks=switch("attention_sinks"),
            norm_weight_in_float32=switch("norm_weight_in_float32"),
            attention_output_gate=switch("attention_output_gate"),
            norm_zero_centered=switch("norm_zero_centered"),
            sliding_windows=_sliding_windows(cfg, layers, switch("all_sliding")),
            dtype=dtype,
        )
        return cls(**{**fields, **extra})  # a family's parse may override a generic field (Gemma 4: rope)

    @classmethod
    def from_json(cls, path: str | Path, *, dtype: str | None = None) -> "ModelConfig":
        return cls.from_hf_dict(read_config_json(path), dtype=dtype)


def read_config_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def _dtype_from_config(cfg: dict[str, Any]) -> str:
    d = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return "bfloat16" if d in ("bfloat16", "float16") else "float32"


def _rope_from_config(cfg: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters` (theta inside); older writes
    # `rope_theta` + `rope_scaling`. Read both.
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ConfigError(
            f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    kw = dict(theta=float(theta), type=rope_type)
    if rope_type in ("linear", "llama3"):
        if "factor" not in params:
            raise ConfigError(f"rope type {rope_type!r} needs a 'factor'")
        kw["factor"] = float(params["factor"])
    if rope_type == "llama3":
        for key in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if key not in params:
                raise ConfigError(f"rope type 'llama3' needs {key!r}")
        kw["low_freq_factor"] = float(params["low_freq_factor"])
        kw["high_freq_factor"] = float(params["high_freq_factor"])
        kw["original_max_position_embeddings"] = int(params["original_max_position_embeddings"])
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    if not 0 < partial <= 1:
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {partial}")
    kw["partial_rotary_factor"] = partial
    if rope_type == "proportional":
        kw["factor"] = float(params.get("factor", 1.0))
    if rope_type == "yarn":
        if "original_max_position_embeddings" not in params:
            raise ConfigError("rope type 'yarn' needs 'original_max_position_embeddings'")
        original = int(params["original_max_position_embeddings"])
        factor = params.get("factor") or int(cfg.get("max_position_embeddings", original)) / original
        attention_factor = params.get("attention_factor")
        if attention_factor is None:
            mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
            if mscale and mscale_all_dim:
                attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = _yarn_mscale(factor)
        kw.update(factor=float(factor), original_max_position_embeddings=original,
                  beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                  truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))
    return RopeConfig(**kw)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _sliding_windows(cfg: dict[str, Any], layers: int, all_sliding: bool) -> tuple[int | None, ...]:
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries for {layers} layers")
        if "sliding_attention" in layer_types and not window:
            raise ConfigError("layer_types asks for sliding_attention but sliding_window is not set")
        return tuple(int(window) if t == "sliding_attention" else None for t in layer_types)
    if window and (all_sliding or cfg.get("use_sliding_window")):
        first = int(cfg.get("max_window_layers", 0)) if not all_sliding else 0
        return tuple(int(window) if i >= first else None for i in range(layers))
    return (None,) * layers


def rope_inv_freq(rope: RopeConfig, head_dim: int):
    """Inverse frequencies [rotary_dim // 2], float32, with HF's scaling rules."""
    import numpy as np

    if rope.type != "proportional":
        head_dim = rope.rotary_dim(head_dim)

    # float32 like transformers, so positions far out agree to the last bit we can.
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(rope.theta) ** exponent)).astype(np.float64)
    if rope.type == "linear":
        inv = inv / rope.factor
    elif rope.type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        inv = np.where(medium, smoothed, scaled)
    elif rope.type == "yarn":
        return _yarn_inv_freq(rope, head_dim)
    elif rope.type == "proportional":
        rotated = int(rope.partial_rotary_factor * head_dim // 2)
        exponent = np.arange(0, 2 * rotated, 2, dtype=np.float32) / np.float32(head_dim)
        inv = np.float32(1.0) / (np.float32(rope.theta) ** exponent)
        inv = np.concatenate([inv, np.zeros(head_dim // 2 - rotated, np.float32)]) / np.float32(rope.factor)
    return inv.astype(np.float32)


def _yarn_inv_freq(rope: RopeConfig, dim: int):
    """YaRN (arXiv 2309.00071) as transformers computes it, in float32: interpolated
    frequencies (divided by `factor`) for the long wavelengths, the original ones for the
    short, and a linear ramp between the dimensions `beta_fast` and `beta_slow` rotations
    mark over the original context."""
    import numpy as np

    def correction_dim(rotations):
        return dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = np.float32(rope.theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation_weight = np.float32(1) - ramp.astype(np.float32)
    inv = interpolation * (1 - extrapolation_weight) + extrapolation * extrapolation_weight
    return inv.astype(np.float32)
