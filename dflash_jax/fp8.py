"""FP8 checkpoints (transformers' `quant_method: "fp8"`, block-scaled float8_e4m3fn): their config, and
dequantizing at load (`load_target(..., dequantize=True)`, and any FP8 tensor the model does not
keep in FP8 on the device: `dflash_jax.model.formats.fp8` keeps them by default).

DeepSeek-V3, Kimi-K2, GLM-*-FP8, Qwen3-*-FP8 and MiniMax-M2 ship their Linear weights this way:
config.json's `quantization_config` is `{"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [128, 128]}`, and each quantized Linear stores `X.weight` as float8
[..., out, in] beside `X.weight_scale_inv` [..., ceil(out / 128), ceil(in / 128)] (float32, or
power-of-two `float8_e8m0fnu` with `scale_fmt: "ue8m0"`); a tensor not named `.weight` pairs with
`X_scale_inv`. The real weight is `float32(fp8) * scale_inv` of its block (edge blocks partial),
rounded once to the model's dtype. Embeddings, norms, routers and the head stay unquantized; so do
the modules of `modules_to_not_convert` (they simply have no scale).

The loader pairs each float8 tensor with its scale before the family's table is consulted
(`pair_scales`), so a family needs no rows for scales: any family whose weights are plain
Linear layers reads FP8 checkpoints. The pair is an `Fp8Tensor`, read like any lazy tensor (whole
or a range of rows, for a device's shard), dequantized a few million values at a time: beside
the result the host holds one chunk in float32.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterator

import ml_dtypes
import numpy as np

from dflash_jax.errors import CheckpointError, ConfigError

FORMATS = {"e4m3": ml_dtypes.float8_e4m3fn, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
           "e5m2": ml_dtypes.float8_e5m2, "float8_e5m2": ml_dtypes.float8_e5m2}
FLOAT8 = (np.dtype(ml_dtypes.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2))
SCALE_DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16),
                np.dtype(ml_dtypes.float8_e8m0fnu))
CHUNK = 1 << 22  # values dequantized at a time


@dataclasses.dataclass(frozen=True)
class Fp8Format:
    """What an FP8 checkpoint's config says about its tensors."""

    dtype: np.dtype  # the float8 type of its weights
    block: tuple[int, int] | None  # (rows, columns) a scale covers; None: one scale per matrix


def fp8_format(cfg: dict) -> Fp8Format | None:
    """The FP8 format of a config.json dict, None if it is not an `fp8` checkpoint. Bad or
    unsupported settings raise a one-line ConfigError."""
    q = cfg.get("quantization_config") or {}
    if q.get("quant_method") != "fp8":
        return None
    fmt = q.get("fmt", "e4m3")
    if fmt not in FORMATS:
        raise ConfigError(f"quantization_config fmt {fmt!r} is not supported (e4m3 or e5m2)")
    scheme = str(q.get("activation_scheme", "dynamic")).lower()
    if scheme != "dynamic":
        raise ConfigError(f"quantization_config activation_scheme {scheme!r} is not supported (dynamic only)")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise ConfigError(f"quantization_config expert_dtype {q['expert_dtype']!r} is not supported (fp8 only)")
    if q.get("scale_fmt", "float") not in ("float", "ue8m0"):
        raise ConfigError(f"quantization_config scale_fmt {q['scale_fmt']!r} is not supported (float or ue8m0)")
    block = q.get("weight_block_size", [128, 128])
    if block is not None:
        if (not isinstance(block, (list, tuple)) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ConfigError(f"quantization_config weight_block_size {block!r} is not two positive integers")
        block = (int(block[0]), int(block[1]))
    return Fp8Format(np.dtype(FORMATS[fmt]), block)


def scale_name(weight: str) -> str:
    """The name of the scale that belongs to a quantized tensor (transformers' convention)."""
    return f"{weight}_scale_inv"


def weight_of_scale(name: str) -> str | None:
    """The quantized tensor a scale belongs to, or None if `name` is not a scale."""
    return name[: -len("_scale_inv")] if name.endswith("_scale_inv") else None


def dequantize(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int], dtype, first_row: int = 0) -> np.ndarray:
    """weight [..., rows, cols] (float8) times its block's scale, in `dtype`: float32 products
    rounded once, as transformers dequantizes. scale [..., ceil(R / block rows), ceil(cols /
    block cols)], R the matrix's full height: `weight` may be the rows from `first_row` on of one
    matrix (2-D only). Chunk by chunk, so beside the result only a chunk is held in float32; float8
    to float32 through a 256-entry table (ml_dtypes' own conversion of every code)."""
    out = np.empty(weight.shape, dtype)
    rows, cols = weight.shape[-2:]
    w, s, o = (a.reshape((-1,) + a.shape[-2:]) for a in (weight, scale, out))
    table = np.arange(256, dtype=np.uint8).view(weight.dtype).astype(np.float32)
    step = max(1, CHUNK // max(cols, 1))
    for m in range(w.shape[0]):
        col_scales = np.repeat(s[m].astype(np.float32), block[1], axis=-1)[:, :cols]  # [row blocks, cols]
        for r in range(0, rows, step):
            stop = min(r + step, rows)
            values = table[w[m, r:stop].view(np.uint8)]
            a = r
            while a < stop:  # each run of rows in one row block: times that block's scales
                b = min(stop, (a + first_row) // block[0] * block[0] + block[0] - first_row)
                values[a - r:b - r] *= col_scales[(a + first_row) // block[0]]
                a = b
            o[m, r:stop] = values
    return out


class Fp8Tensor:
    """A float8 tensor and its scale, read as the dequantized tensor: whole or a range of rows
    (axis 0), with LazyTensor's interface. `dtype`: the model's, what it is dequantized into."""

    def __init__(self, name: str, weight, scale, fmt: Fp8Format, dtype):
        self.name, self.weight, self.scale = name, weight, scale
        self.shape, self.dtype = tuple(weight.shape), np.dtype(dtype)
        if len(self.shape) < 2:
            raise CheckpointError(f"tensor {name!r} is float8 but not a matrix (shape {self.shape})")
        if np.dtype(weight.dtype) != fmt.dtype:
            raise CheckpointError(f"tensor {name!r} is {np.dtype(weight.dtype).name}, but quantization_config "
                                  f"fmt says {fmt.dtype.name}")
        if np.dtype(scale.dtype) not in SCALE_DTYPES:
            raise CheckpointError(f"scale {scale_name(name)!r} has dtype {np.dtype(scale.dtype).name}, not a float")
        rows, cols = self.shape[-2:]
        self.block = fmt.block or (rows, cols)
        self.scale_shape = self.shape[:-2] + (-(-rows // self.block[0]), -(-cols // self.block[1]))
        # one scale a matrix may also be stored as a scalar ([] or [1]; [experts] for a stack)
        per_matrix = fmt.block is None and (len(self.shape) == 2 or tuple(scale.shape[:1]) == self.shape[:1]) and int(
            np.prod(scale.shape, dtype=np.int64)) == int(np.prod(self.scale_shape, dtype=np.int64))
        if tuple(scale.shape) != self.scale_shape and not per_matrix:
            raise CheckpointError(
                f"scale {scale_name(name)!r} has shape {tuple(scale.shape)}, expected {self.scale_shape} for a "
                f"{self.shape} weight in {list(self.block)} blocks")

    def read_rows(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        stop = self.shape[0] if stop is None else stop
        weight = self.weight.read_rows(start, stop)
        if len(self.shape) == 2:  # rows of one matrix: its whole (small) scale grid
            scale, first_row = self.scale.read().reshape(self.scale_shape), start
        else:  # matrices start..stop of a stack
            scale, first_row = self.scale.read_rows(start, stop).reshape((stop - start,) + self.scale_shape[1:]), 0
        return dequantize(weight, scale, self.block, self.dtype, first_row)

    def read(self) -> np.ndarray:
        return self.read_rows()


def pair_scales(tensors: Iterator, fmt: Fp8Format, dtype, keep: Callable[[str], bool] | None = None) -> Iterator:
    """(name, tensor) of a checkpoint with each float8 tensor and its scale joined into one
    `Fp8Tensor` under the tensor's name (in whichever order, in whichever shard they come);
    other tensors pass through, and so do the float8 tensors `keep(name)` says are kept in FP8 on
    the device (`dflash_jax.model.formats.fp8`) and their scales. Nothing is read here: an unpaired
    one waits as a handle. A float8 tensor without a scale, or a scale without its tensor, is a
    CheckpointError."""
    weights, scales = {}, {}
    for name, tensor in tensors:
        base = weight_of_scale(name)
        if keep is not None and keep(name if base is None else base):
            yield name, tensor
        elif base is not None:
            if base in weights:
                yield base, Fp8Tensor(base, weights.pop(base), tensor, fmt, dtype)
            else:
                scales[base] = tensor
        elif np.dtype(tensor.dtype) in FLOAT8:
            if name in scales:
                yield name, Fp8Tensor(name, tensor, scales.pop(name), fmt, dtype)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    if weights:
        name = next(iter(weights))
        more = f" (and {len(weights) - 1} more)" if len(weights) > 1 else ""
        raise CheckpointError(f"float8 tensor {name!r} has no scale {scale_name(name)!r} in the checkpoint{more}")
    if scales:
        name = next(iter(scales))
        raise CheckpointError(f"scale {scale_name(name)!r} has no float8 tensor {name!r} in the checkpoint")
