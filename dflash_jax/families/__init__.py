"""Model families: what each Hugging Face `model_type` needs from the one decoder.

The decoder (`dflash_jax.model`) is built from shared layers configured by switches. A family
is a small module here that registers a `Family`: the switches its checkpoints use, a parser
for the config fields only it has (experts, router, activation), and its HF <-> Flax name
table. Adding a family that reuses existing layers is a module here, not a new decoder.

| model_type | module | what differs from a Llama block |
|---|---|---|
| llama, qwen2, qwen3, mistral | `dense` | q/k norm, biases, sliding windows |
| qwen3_moe | `qwen3_moe` | sparse MoE block (softmax then top-k) on some layers |
| gpt_oss | `gpt_oss` | attention sinks, MoE with biases and clamped SwiGLU, MXFP4 experts |
| gemma4_text, gemma4 | `gemma4` | sliding and global layers of two head shapes and RoPEs, k = v, shared K/V, sandwich norms, scaled embeddings, per-layer inputs, MoE beside the MLP, soft-capped logits |
| qwen3_5_text, qwen3_5_moe_text, qwen3_5, qwen3_5_moe | `qwen3_5` | gated delta-net linear-attention layers, gated attention, partial RoPE, (1 + w) norms, MoE with a shared expert |
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

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
    quantizations: the `quantization_config.quant_method`s whose tensors it can read.
    ignore: regexes of checkpoint tensors that are not the text decoder's (a vision tower,
        a multi-token-prediction head); they are skipped.
    text_config: the decoder's config is config.json's `text_config` (a multimodal checkpoint).
    """

    model_type: str
    switches: Mapping[str, Any]
    table: tuple[Row, ...]
    parse: Callable[[dict, int], dict] | None = None
    combine: Callable[[tuple[str, ...], dict, Any], Any] | None = None
    quantizations: tuple[str, ...] = ()
    ignore: tuple[str, ...] = ()
    text_config: bool = False


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    return family


def family(model_type: str) -> Family:
    from dflash_jax.errors import ConfigError

    if model_type not in FAMILIES:
        raise ConfigError(f"unsupported model_type {model_type!r}; supported: {', '.join(sorted(FAMILIES))}")
    return FAMILIES[model_type]


from dflash_jax.families import dense, gemma4, gpt_oss, qwen3_5, qwen3_moe  # noqa: E402,F401  (they register)
