"""FP8 weights kept on the device: float8 values with a float32 scale per block, dequantized inside the matmul.

A weight of logical shape [..., R, C] (a kernel [in, out], an expert stack [experts, in, out], or
MLA's kv_b_proj [out, in] as its checkpoint lays it) stores

  `X`            float8 (e4m3fn or e5m2) [..., R, C], the checkpoint's values in the weight's layout
  `X_scale_inv`  float32 [..., ceil(R / br), ceil(C / bc)], one scale per [br, bc] block (edge blocks partial)

its value being float32(X) * the scale of its block, rounded once to the model's dtype, as the
checkpoint's `weight_scale_inv` says and as `dflash_jax.fp8` dequantizes at load. A format is one
block shape over the weight's layout, registered as `fp8_<e4m3|e5m2>_<br>x<bc>` (`fp8_format`,
created when a checkpoint's rules first name it; e4m3 and e5m2 at 128 x 128 at import). The
checkpoint's `weight_block_size` [bo, bi] is over HF's [out, in]: a kernel stored transposed
([in, out]) takes blocks [bi, bo], a weight stored as HF lays it (kv_b_proj) [bo, bi].

Products (`dflash_jax.model.weights.project`):
- `Dot` and `Batched` (the touched experts): `block_dot`, one partial dot per br rows of the weight
  (x viewed [..., R / br, br], the weight [R / br, br, C], the float8 -> dtype convert inside the
  dot's operand), each partial times its blocks' scales after the dot, then summed: the form the
  TPU compiler fuses (docs/benchmarks.md, "FP8 experts on a TPU"; a scale multiplied into the
  weight is not fused: it writes a scaled copy out). When br does not divide R (tiny test models),
  the dense weight is materialized and contracted instead.
- `Grouped` (prefill's `ragged_dot`), `Transposed`, `Einsum` (MLA's folds): the spec on the
  materialized weight. For `Grouped` that writes a dequantized copy of the whole expert stack each
  call (the TPU compiler fuses nothing into `ragged_dot`'s kernel): correct, and a prefill-time
  cost; decode and verify take the touched experts (`Batched`).

Bytes on the device: 1 per value plus 4 per block (4 / 16384 a value at 128 x 128).
`rules` (`METHODS["fp8"]`: transformers' `quant_method: "fp8"`) are: every Linear weight a
transformers FP8 checkpoint quantizes (attention and MLA projections, MLPs, experts, shared
experts, the gated delta-net's projections) in its checkpoint's format; embeddings, norms,
routers, the shared-expert gate, the sparse-attention indexer's `weights_proj`, the head and the
modules of `modules_to_not_convert` dense. A checkpoint with one scale per matrix
(`weight_block_size: null`) gets no rules: it is dequantized at load.
"""

from __future__ import annotations

import math
import re

import jax.numpy as jnp
import numpy as np

from dflash_jax.model.weights import FORMATS, Batched, Dot, WeightFormat, register

WEIGHED_ROWS = 8  # rows of a product up to which `block_dot` weighs its partials in one contraction (a sublane tile)
SCALE = "_scale_inv"  # the stored suffix: `X.weight_scale_inv` beside `X.weight`, `kernel_scale_inv` beside `kernel`
FLOAT8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}


def format_name(fp8: str, block: tuple[int, int]) -> str:
    return f"fp8_{fp8}_{block[0]}x{block[1]}"


def _expand(scale, block, shape):
    """Each block's scale repeated over its block, cut to the weight's [..., R, C]."""
    return jnp.repeat(jnp.repeat(scale, block[0], axis=-2), block[1], axis=-1)[..., :shape[-2], :shape[-1]]


def materialize(arrays: dict, dtype, block: tuple[int, int]):
    """The dense weight in dtype: float32(value) times its block's scale, rounded once."""
    w, scale = arrays[""], arrays[SCALE]
    return (w.astype(jnp.float32) * _expand(scale.astype(jnp.float32), block, w.shape)).astype(dtype)


def block_dot(x, w, scale, block: tuple[int, int], dtype, batched: bool = False):
    """x [..., R] . dequantized w [R, C] -> [..., C] in dtype (batched: x [K, M, R], w [K, R, C],
    scale [K, ...]: one product per leading index), as one partial dot per br rows of w, the convert
    to dtype inside the dot's operand, accumulated in float32. The partials [..., R / br, C] are
    weighed by their blocks' scales and summed over the row blocks in one contraction per column
    block (`...jcp,jc->...cp`) while a product has at most `WEIGHED_ROWS` rows: the TPU compiler then
    fuses it into the dot, where a scale repeated over its block's columns first (`jnp.repeat`) is
    written out for every weight (DeepSeek-V3's MoE layer at 8 tokens: 1.494 against 1.344 ms).
    With more rows the contraction is not fused and its partials are written out (the layer at 16
    tokens 7.57 ms, MiniMax-M2's at 128 14.6 against 2.65), so those take the repeated scale, as do
    columns that do not fill their last block (tiny test models). docs/benchmarks.md, "Touched experts"."""
    br, bc = block
    rows, cols = w.shape[-2:]
    xb = x.astype(dtype).reshape(*x.shape[:-1], rows // br, br)
    wb = w.astype(dtype).reshape(*w.shape[:-2], rows // br, br, cols)
    scale = scale.astype(jnp.float32)  # [(K,) R / br, C / bc]
    if batched:
        partial = jnp.einsum("kmjb,kjbo->kmjo", xb, wb, preferred_element_type=jnp.float32)
    else:
        partial = jnp.einsum("...jb,jbo->...jo", xb, wb, preferred_element_type=jnp.float32)
    rows_per_product = x.shape[-2] if batched else math.prod(x.shape[:-1])
    if cols % bc == 0 and rows_per_product <= WEIGHED_ROWS:
        blocks = partial.reshape(*partial.shape[:-1], cols // bc, bc)
        weigh = "kmjcp,kjc->kmcp" if batched else "...jcp,jc->...cp"
        return jnp.einsum(weigh, blocks, scale).reshape(*partial.shape[:-2], cols).astype(dtype)
    s = jnp.repeat(scale, bc, axis=-1)[..., :cols]
    return (partial * (s[:, None] if batched else s)).sum(-2).astype(dtype)


def _product(block):
    def product(spec, x, arrays, dtype):
        w = arrays[""]
        if isinstance(spec, (Dot, Batched)) and w.shape[-2] % block[0] == 0:
            if isinstance(spec, Dot):
                compute = spec.dtype if spec.dtype is not None else jnp.result_type(x.dtype, dtype)
                return block_dot(x, w, arrays[SCALE], block, compute)
            return block_dot(x, w, arrays[SCALE], block, spec.dtype, batched=True)
        return spec(x, materialize(arrays, dtype, block))
    return product


def _take(block):
    def take(arrays, index):
        """Experts of a stack, picked from its view in row blocks ([E, R / br, br, C]): a pick of the
        plain [E, R, C] stack reshaped into blocks after it is written out in bfloat16 by the TPU
        compiler before `block_dot` (docs/benchmarks.md, "FP8 experts on a TPU"); picked from the
        view, the pick and the convert fuse into the dot."""
        w, scale = arrays[""], arrays[SCALE]
        rows, cols = w.shape[-2:]
        pick = lambda a: jnp.take(a, index, axis=0, mode="clip")  # noqa: E731
        if rows % block[0]:
            return {"": pick(w), SCALE: pick(scale)}
        view = w.reshape(w.shape[0], rows // block[0], block[0], cols)
        return {"": pick(view).reshape(*index.shape, rows, cols), SCALE: pick(scale)}
    return take


def fp8_format(fp8: str, block: tuple[int, int]) -> WeightFormat:
    """The format of `fp8` ("e4m3" | "e5m2") values in [br, bc] blocks over the weight's layout,
    registered on first use."""
    name = format_name(fp8, block)
    if name in FORMATS:
        return FORMATS[name]
    block = (int(block[0]), int(block[1]))
    dtype = FLOAT8[fp8]

    def stored(shape, _dtype, init):
        *lead, rows, cols = shape
        grid = (*lead, -(-rows // block[0]), -(-cols // block[1]))
        return {"": (tuple(shape), dtype, lambda key, s, d: init(key, s, jnp.float32).astype(d)),
                SCALE: (grid, jnp.float32, lambda key, s, d: jnp.ones(s, d))}

    return register(WeightFormat(name, stored=stored,
                                 materialize=lambda arrays, dt: materialize(arrays, dt, block),
                                 product=_product(block), take=_take(block)))


for _fp8 in FLOAT8:
    fp8_format(_fp8, (128, 128))


# --------------------------------------------------------------------------- rules

# Linear weights transformers' FP8 checkpoints leave unquantized (custom modules, or kept in
# high precision): by the last module of their parameter path.
DENSE_MODULES = ("router", "shared_expert_gate", "weights_proj")


def skipped(module: str, patterns) -> bool:
    """Whether transformers leaves the HF module `module` unquantized by `modules_to_not_convert`
    (`should_convert_module`): a pattern matching from the start up to a module boundary, as a
    regex, or a suffix of the name."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    for key in patterns or ():
        try:
            hit = re.match(rf"(?:{key}){boundary}", module)
        except re.error:
            hit = re.match(rf"(?:{re.escape(key)}){boundary}", module)
        if hit or module.endswith(key):
            return True
    return False


def linear_rows(table):
    """The rows of a family's table that are Linear weights (kernels, expert stacks): (row, its
    parameter path's pattern, whether it is transposed from HF's layout)."""
    for row in table:
        if row.part is not None or row.piece is not None:
            continue  # read in parts or cut from a fused tensor: dequantized at load
        leaf = row.flax.rsplit("/", 1)
        kernel = row.flax.endswith("/kernel") and row.hf.endswith(".weight")
        experts = "/experts/" in row.flax and not row.flax.endswith("_bias")
        if not (kernel or experts) or row.flax == "lm_head/kernel":
            continue
        if (leaf[0].rsplit("/", 1)[-1] if kernel else leaf[-1]) in DENSE_MODULES:
            continue
        yield row


def rules(cfg: dict, config):
    """`quant_method: "fp8"`: a format per weight path (`dflash_jax.model.weights.FormatRules`)."""
    from dflash_jax.families.registry import family  # (its families registered: the caller is their config parser)
    from dflash_jax.fp8 import fp8_format as checkpoint_format

    fmt = checkpoint_format(cfg)
    if fmt.block is None:
        return ()  # one scale per matrix: dequantized at load
    fp8 = {np.dtype(jnp.float8_e4m3fn): "e4m3", np.dtype(jnp.float8_e5m2): "e5m2"}[np.dtype(fmt.dtype)]
    bo, bi = fmt.block
    skip = (cfg.get("quantization_config") or {}).get("modules_to_not_convert") or ()
    dense, kept = [], []
    for row in linear_rows(family(config.model_type).table):
        name = fp8_format(fp8, (bi, bo) if row.transpose else (bo, bi)).name
        module = row.hf.removesuffix(".weight")
        if "{i}" not in row.flax:
            (dense if skipped(module.format(e=0), skip) else kept).append(
                (row.flax, "dense" if skipped(module.format(e=0), skip) else name))
            continue
        for i in range(config.num_hidden_layers):
            if skipped(module.format(i=i, e=0), skip):
                dense.append((row.flax.format(i=i), "dense"))
        kept.append((row.flax.replace("{i}", "[0-9]*"), name))
    return tuple(dense) + tuple(kept)



def unquantized_modules(cfg: dict, config, dtypes: dict[str, str]) -> list[str]:
    """The HF modules the rules (`rules`) would keep in FP8 whose checkpoint tensor is not float8
    (`dtypes`: tensor name -> safetensors dtype, from the headers), which a checkpoint's
    `modules_to_not_convert` did not name: the loader adds them to it, so such weights stay dense
    (a stack of experts by its expert 0)."""
    from dflash_jax.families.registry import family

    skip = (cfg.get("quantization_config") or {}).get("modules_to_not_convert") or ()
    out = []
    for row in linear_rows(family(config.model_type).table):
        layers = range(config.num_hidden_layers) if "{i}" in row.hf else (None,)
        for i in layers:
            module = row.hf.removesuffix(".weight").format(**({} if i is None else {"i": i}), e=0)
            kind = dtypes.get(module + ".weight")
            if kind is not None and not kind.startswith("F8_") and not skipped(module, skip):
                out.append(module)
    return out
