"""Hugging Face `config.json` -> ModelConfig: the fields every family shares, RoPE in both
config styles (transformers 4's `rope_theta` + `rope_scaling`, 5's `rope_parameters`), sliding
windows, dtype, and the sparse MoE block's fields; then the family's own switches and parser."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dflash_jax.config import DTYPES, ModelConfig, MoeConfig, RopeConfig
from dflash_jax.errors import ConfigError
from dflash_jax.families.registry import family as find_family
from dflash_jax.fp8 import fp8_format

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def model_config(cfg: dict[str, Any], *, dtype: str | None = None, dequantize: bool = False) -> ModelConfig:
    """The ModelConfig of an HF config.json dict: the generic fields, the switches its family
    fixes and the fields its family's parser reads. dtype overrides the checkpoint's (it sets the
    activations, and the weights a checkpoint keeps unquantized). A quantized checkpoint's weights
    stay in its format on the device (`weight_format`: the rules its `quant_method` gives,
    `dflash_jax.model.formats.METHODS`); with `dequantize`, or for a method without rules, they
    are dequantized into `dtype` as they load."""
    model_type = cfg.get("model_type")
    family = find_family(model_type)
    if family.text_config:  # a multimodal checkpoint: the decoder is its text model
        text = cfg.get("text_config")
        if not isinstance(text, dict):
            raise ConfigError(f"config.json ({model_type}) is missing required field 'text_config'")
        top = {k: cfg[k] for k in ("tie_word_embeddings", "dtype", "torch_dtype", "quantization_config") if k in cfg}
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

    dtype = dtype or dtype_of(cfg)
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")

    quant = (cfg.get("quantization_config") or {}).get("quant_method")
    if quant == "fp8":  # block-scaled float8 Linear weights: any family, dequantized at load
        fp8_format(cfg)
    elif quant is not None and quant not in family.quantizations:
        raise ConfigError(f"quantization {quant!r} is not supported for {model_type}"
                          + f" (only {', '.join(('fp8',) + family.quantizations)})")
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
        rope=rope_config(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 32768)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=switch("qk_norm"),
        qk_norm_whole=switch("qk_norm_whole"),
        qkv_bias=switch("qkv_bias"),
        o_bias=switch("o_bias"),
        mlp_bias=switch("mlp_bias"),
        attention_sinks=switch("attention_sinks"),
        norm_weight_in_float32=switch("norm_weight_in_float32"),
        attention_output_gate=switch("attention_output_gate"),
        norm_zero_centered=switch("norm_zero_centered"),
        sliding_windows=sliding_windows(cfg, layers, switch("all_sliding")),
        dtype=dtype,
    )
    config = ModelConfig(**{**fields, **extra})  # a family's parse may override a generic field (Gemma 4: rope)
    if quant is not None and not dequantize:
        from dflash_jax.model.formats import METHODS

        if quant in METHODS:
            config = config.replace(weight_format=METHODS[quant](cfg, config))
    return config


def model_config_from_json(path: str | Path, *, dtype: str | None = None, dequantize: bool = False) -> ModelConfig:
    return model_config(read_config_json(path), dtype=dtype, dequantize=dequantize)


def read_config_json(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"no config.json at {path}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None


def dtype_of(cfg: dict[str, Any]) -> str:
    d = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    return "bfloat16" if d in ("bfloat16", "float16") else "float32"


def rope_config(cfg: dict[str, Any]) -> RopeConfig:
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
                attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
            else:
                attention_factor = yarn_mscale(factor)
        kw.update(factor=float(factor), original_max_position_embeddings=original,
                  beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow") or 1),
                  truncate=bool(params.get("truncate", True)), attention_factor=float(attention_factor))
    return RopeConfig(**kw)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def sliding_windows(cfg: dict[str, Any], layers: int, all_sliding: bool) -> tuple[int | None, ...]:
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


def moe_config(cfg: dict[str, Any], model_type: str, *, experts: tuple[str, ...], **kw) -> MoeConfig:
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
    return MoeConfig(num_experts=num_experts, top_k=top_k, intermediate_size=width, **kw)
