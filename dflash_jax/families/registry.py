"""The registry of model families: a `Family` per Hugging Face `model_type`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from dflash_jax.errors import ConfigError
from dflash_jax.families.table import Row


@dataclasses.dataclass(frozen=True)
class Family:
    """One `model_type`.

    switches: fields of `ModelConfig` the family fixes. A bool, or the name of a config.json
        field that holds the bool (e.g. `attention_bias`). Besides ModelConfig fields,
        `all_sliding` says a non-null `sliding_window` applies to every layer (Mistral).
    parse: (config.json dict, number of layers) -> further ModelConfig fields (MoE), or ones
        that replace the generic parse's (Gemma 4's RoPE per layer type).
    table: the HF <-> Flax name table of the family's `*ForCausalLM`.
    combine: (parameter path, {part: tensor}, dtype) -> the parameter, for rows with a `part`
        (a parameter stored as several tensors, e.g. MXFP4 blocks and scales), or None
        while parts are still missing.
    split: (ModelConfig, HF tensor name, the tensor in Flax layout) -> {piece: parameter}, for
        rows with a `piece` (one tensor several parameters are cut from along their last axis, e.g.
        Qwen3-Next's fused `in_proj_qkvz`).
    quantizations: the `quantization_config.quant_method`s whose tensors it can read besides
        `fp8` (block-scaled float8 Linear weights, `dflash_jax.fp8`), which every family reads.
    ignore: regexes of checkpoint tensors that are not the text decoder's (a vision tower,
        a multi-token-prediction head); they are skipped.
    text_config: the decoder's config is config.json's `text_config` (a multimodal checkpoint).
    extra_layers: tensors of layers past `num_hidden_layers` (DeepSeek-V3's multi-token-prediction
        layer, `model.layers.61.*`) are not the decoder's; they are skipped.
    """

    model_type: str
    switches: Mapping[str, Any]
    table: tuple[Row, ...]
    parse: Callable[[dict, int], dict] | None = None
    combine: Callable[[tuple[str, ...], dict, Any], Any] | None = None
    split: Callable[[Any, str, Any], dict] | None = None
    quantizations: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    text_config: bool = False
    extra_layers: bool = False


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]
