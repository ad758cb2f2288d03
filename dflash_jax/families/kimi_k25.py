"""Kimi-K2.5 / K2.6 (`KimiK25ForConditionalGeneration`, `model_type: kimi_k25`), and Kimi-K2's own
`model_type: kimi_k2`: DeepSeek-V3's decoder (`dflash_jax.families.deepseek_v3`: MLA, 384 routed
experts top-8 with sigmoid grouped routing, a shared expert, the first layer dense).

Kimi-K2.5 is multimodal: config.json keeps the decoder's config in `text_config` (with the
`quantization_config`), the decoder's tensors under `language_model.` (`language_model.model.*`,
`language_model.lm_head.weight`), and a vision tower and projector (`vision_tower.*`,
`mm_projector.*`) that are not read. It ships compressed-tensors INT4 (`pack-quantized`, symmetric,
group 32) for the routed experts, the rest (attention, shared experts, the dense layer's MLP, the
head) in bfloat16: `dflash_jax.model.formats.int4` keeps the experts packed on the device.
Kimi-K2-Thinking (`kimi_k2`) ships the same format with DeepSeek-V3's own tensor names.
"""

from __future__ import annotations

import dataclasses

from dflash_jax.families.deepseek_v3 import SWITCHES, mla_rows, moe_rows, parse
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import decoder_rows

PREFIX = "language_model."
TABLE = tuple(dataclasses.replace(row, hf=PREFIX + row.hf) for row in decoder_rows(mla_rows, moe_rows))
IGNORE = (r"(vision_tower|mm_projector)\..*",)
QUANTIZATIONS = ("compressed-tensors",)

register(Family("kimi_k25", SWITCHES, TABLE, parse=parse, quantizations=QUANTIZATIONS, ignore=IGNORE,
                text_config=True, extra_layers=True))
register(Family("kimi_k2", SWITCHES, decoder_rows(mla_rows, moe_rows), parse=parse, quantizations=QUANTIZATIONS,
                extra_layers=True))
