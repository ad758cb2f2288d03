"""Model configuration parsed from a Hugging Face `config.json`.

One decoder implementation serves every family; a family is a row in `FAMILIES`
that says which switches its checkpoints use. Adding Mistral-like families means
adding a row, not a file.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from dflash_jax.errors import ConfigError

# model_type -> how that family's config fields map onto our switches.
#   qk_norm:   RMSNorm over head_dim on q and k (Qwen3).
#   qkv_bias:  bias on q/k/v projections; True, False, or the name of a config field.
#   o_bias:    bias on o_proj; same conventions.
#   mlp_bias:  bias on gate/up/down; same conventions.
#   all_sliding: a non-null `sliding_window` applies to every layer (Mistral).
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen3": dict(qk_norm=True, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias=False),
    "llama": dict(qk_norm=False, qkv_bias="attention_bias", o_bias="attention_bias", mlp_bias="mlp_bias"),
    "qwen2": dict(qk_norm=False, qkv_bias=True, o_bias=False, mlp_bias=False),
    "mistral": dict(qk_norm=False, qkv_bias=False, o_bias=False, mlp_bias=False, all_sliding=True),
}

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
DTYPES = ("float32", "bfloat16")


@dataclasses.dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


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
    dtype: str = "float32"

    @property
    def num_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], *, dtype: str | None = None) -> "ModelConfig":
        model_type = cfg.get("model_type")
        if model_type not in FAMILIES:
            raise ConfigError(
                f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}"
            )
        family = FAMILIES[model_type]

        def need(key):
            if key not in cfg or cfg[key] is None:
                raise ConfigError(f"config.json ({model_type}) is missing required field {key!r}")
            return cfg[key]

        def switch(value):
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

        return cls(
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
            qk_norm=family["qk_norm"],
            qkv_bias=switch(family["qkv_bias"]),
            o_bias=switch(family["o_bias"]),
            mlp_bias=switch(family["mlp_bias"]),
            sliding_windows=_sliding_windows(cfg, layers, family.get("all_sliding", False)),
            dtype=dtype,
        )

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
    return RopeConfig(**kw)


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
    """Inverse frequencies [head_dim // 2], float32, with HF's scaling rules."""
    import numpy as np

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
    return inv.astype(np.float32)
