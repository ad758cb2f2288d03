"""The quantized weight formats, one module each, and how a checkpoint's `quantization_config` picks them.

Each module registers its `WeightFormat` (`dflash_jax.model.weights.register`) and, for the
checkpoints that ship in it, a rule maker under their `quant_method` in `METHODS`:
`METHODS[quant_method](cfg, config) -> FormatRules`, from the config.json dict `cfg` and the dense
`ModelConfig` the family parsed, a format per weight path (`dflash_jax.model.weights.FormatRules`):
the quantized modules in the checkpoint's format, the ones it keeps unquantized (its ignore list)
dense. Importing this package registers them all (`dflash_jax.model` imports it).

- `mxfp4`: MXFP4, gpt-oss's experts (`quant_method` "mxfp4"): FP4 values two a byte, an E8M0 scale
  per 32 inputs, 4.25 bits a weight.
"""

from __future__ import annotations

from typing import Callable

METHODS: dict[str, Callable] = {}

from dflash_jax.model.formats import mxfp4  # noqa: E402

# `mxfp4`: MXFP4 (gpt-oss's experts), FP4 values two a byte and an E8M0 scale per 32 inputs.
METHODS["mxfp4"] = mxfp4.rules
