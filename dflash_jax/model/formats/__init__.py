"""The quantized weight formats, one module each, and how a checkpoint's `quantization_config` picks them.

Each module registers its `WeightFormat` (`dflash_jax.model.weights.register`) and has, for the
checkpoints that ship in it, a rule maker, entered here under their `quant_method` in `METHODS`
(here, not by the module: a module importing this package would make an import circle):
`METHODS[quant_method](cfg, config) -> FormatRules`, from the config.json dict `cfg` and the dense
`ModelConfig` the family parsed, a format per weight path (`dflash_jax.model.weights.FormatRules`):
the quantized modules in the checkpoint's format, the ones it keeps unquantized (its ignore list)
dense. `DEQUANTIZE[quant_method](tensors, cfg, dtype)` joins a checkpoint's stored tensors of each
quantized weight into one tensor read dequantized (`load_target(dequantize=True)`; FP8 has its own
pairing, `dflash_jax.fp8`). Importing this package registers them all (`dflash_jax.model` does).

- `fp8`: float8 (e4m3, e5m2) values with a float32 scale per block (transformers' `fp8`:
  DeepSeek-V3, GLM-5, MiniMax-M2, Qwen3-FP8), multiplied block by block.
- `int4`: compressed-tensors `pack-quantized` INT4 with a scale per group (Kimi-K2.5's experts), kept
  packed; `quant_method: compressed-tensors`.
- `mxfp4`: MXFP4, gpt-oss's experts (`quant_method` "mxfp4"): FP4 values two a byte, an E8M0 scale
  per 32 inputs, 4.25 bits a weight.
"""

from __future__ import annotations

from typing import Callable

METHODS: dict[str, Callable] = {}
DEQUANTIZE: dict[str, Callable] = {}

from dflash_jax.model.formats import fp8, int4, mxfp4  # noqa: E402  (registers)

METHODS["fp8"] = fp8.rules
METHODS[int4.METHOD] = int4.rules
DEQUANTIZE[int4.METHOD] = int4.join
METHODS["mxfp4"] = mxfp4.rules
