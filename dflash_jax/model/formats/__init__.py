"""The quantized weight formats, one module each, and how a checkpoint's `quantization_config` picks them.

Each module registers its `WeightFormat` (`dflash_jax.model.weights.register`) and, for the
checkpoints that ship in it, a rule maker under their `quant_method` in `METHODS`:
`METHODS[quant_method](cfg, config) -> FormatRules`, from the config.json dict `cfg` and the dense
`ModelConfig` the family parsed, a format per weight path (`dflash_jax.model.weights.FormatRules`):
the quantized modules in the checkpoint's format, the ones it keeps unquantized (its ignore list)
dense. Importing this package registers them all.
"""

from __future__ import annotations

from typing import Callable

METHODS: dict[str, Callable] = {}

from dflash_jax.model.formats import mxfp4  # noqa: E402,F401
