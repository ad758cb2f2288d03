"""MXFP4 (gpt-oss's experts), kept on the device: FP4 (E2M1) values two a byte, an E8M0 scale per 32.

A weight of logical shape [..., in, out] stores
  `_blocks` [..., in, out'] float4_e2m1fn: the FP4 values, in the weight's own layout (the device
            packs them two a byte: a TPU holds a [128, 2880, 5760] stack in 1.06 GB), out' = out
            rounded up to a multiple of `LANES` (128), the columns past out zero;
  `_scales` [..., in / 32, out'] uint8: the E8M0 scale of each group of 32 consecutive inputs,
            2^(s - 127), as the checkpoint stores it, its columns padded as the blocks' (127: 1.0);
4.25 bits a weight (and the padding's 4.25 bits a value: 2.2% of gpt-oss's [2880, 2880]
down_proj). Its value is `_blocks[..., :out]` x 2^(`_scales` - 127), the scale broadcast over its
group: exactly gpt-oss's dequantization (`dflash_jax.families.gpt_oss.dequantize_mxfp4`).

Why the padding: a TPU's default layout for an array whose last dim is not a multiple of 128 puts
another axis minor (gpt-oss's down_proj [128, 2880, 2880]: the expert axis), and the dots need
[in, out] minor, so the compiler copied the whole stack into that layout at every call (0.49 GiB a
layer of temporaries, 18 GiB over gpt-oss-120b's 36 layers; docs/benchmarks.md, "MXFP4 experts").
The scales likewise: unpadded, [128, 90, 2880] was kept expert-minor and every call copied the
whole stack's scales out of that layout before picking an expert's (one gpt-oss-120b MoE layer at 8
tokens: 1.104 ms unpadded, 0.524 ms padded). Padded, each stack's default layout is the one its
products read.

So the stored arrays no longer say the weight's out: a format is one out width,
`mxfp4_format(out)`, registered as "mxfp4" for a width of whole lanes (nothing padded: gpt-oss's
gate_up_proj, 5760) and "mxfp4_out<out>" otherwise (its down_proj, "mxfp4_out2880"), as fp8's
formats are one block shape; `rules` gives each projection its own.

The checkpoint's `*_blocks` [experts, out, in / 32, 16] uint8 (two codes a byte, the even input in
the low nibble) and `*_scales` [experts, out, in / 32] are rearranged into these arrays as they load
(`to_stored`, from the family's `combine`): the FP4 codes transposed to [experts, in, out'], the
scales to [experts, in / 32, out'].

Products (`product`):
- `Batched` (the touched experts at decode: `project(x, stack.take(ids), Batched(dtype))`) and `Dot`:
  one partial dot per chunk of 64 inputs (32 where `in` is not a multiple of 64) with the FP4 ->
  compute-dtype convert inside the dot's operand, each group's partial scaled after the dot and the
  partials summed. A chunk of 64 is a whole tile of the TPU's FP4 layout (64 rows): the rows of the
  chunk's two groups are contracted against two copies of x, each zero outside its own group, so
  the kernel is read in place (no relayout) and each group's partial gets its own scale. The
  compiler fuses the convert, the scale and the sum into the dot (docs/benchmarks.md, MXFP4).
- `Grouped` (prefill's `ragged_dot`), `Transposed`, `Einsum`: the weight materialized in the model's
  dtype, then the contraction (`ragged_dot` takes no FP4 operand).
Each cuts its result to the format's out.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import ConfigError
from dflash_jax.model import weights as w

GROUP = 32  # inputs per E8M0 scale
FP4 = jnp.float4_e2m1fn
LANES = 128  # `_blocks`' last axis is padded to a multiple of this (the module's docstring)


def padded(n_out: int) -> int:
    return -(-n_out // LANES) * LANES


def format_name(n_out: int) -> str:
    """The format of an MXFP4 weight with `n_out` outputs (the module's docstring)."""
    return "mxfp4" if n_out % LANES == 0 else f"mxfp4_out{n_out}"


def stored(shape, dtype, init):
    *lead, n_in, out = shape  # n_in a multiple of GROUP in any MXFP4 checkpoint (a group's blocks are whole)

    def padded_init(key, shape, dtype):  # the weight's own columns as init gives them, the padding zero
        values = init(key, (*shape[:-1], out), jnp.float32)
        return jnp.pad(values, [(0, 0)] * (len(shape) - 1) + [(0, shape[-1] - out)]).astype(dtype)

    return {"_blocks": ((*lead, n_in, padded(out)), FP4, padded_init),
            "_scales": ((*lead, -(-n_in // GROUP), padded(out)), jnp.uint8,
                        lambda key, shape, dtype: jnp.full(shape, 127, dtype))}


def scale_values(scales, dtype):
    """uint8 E8M0 -> 2^(s - 127) in dtype (exact: a power of two)."""
    return jax.lax.bitcast_convert_type(scales, jnp.float8_e8m0fnu).astype(dtype)


def _width(blocks, n_out: int | None) -> int:
    """The weight's out: n_out (its format's), which the stored columns must be padded from."""
    width = blocks.shape[-1]
    if n_out is None:
        if width % LANES:
            raise ConfigError(f"an MXFP4 weight stored {width} columns wide takes the format {format_name(width)!r}")
        return width
    if width != padded(n_out):
        raise ConfigError(f"an MXFP4 weight stored {width} columns wide is not one of {n_out} outputs "
                          f"(format {format_name(n_out)!r})")
    return n_out


def materialize(arrays, dtype, n_out: int | None = None):
    """The dense weight [..., in, out] in dtype (out: n_out, or the stored width)."""
    blocks, scales = arrays["_blocks"], arrays["_scales"]
    *lead, n_in, _ = blocks.shape
    n_out = _width(blocks, n_out)
    values = blocks[..., :n_out].astype(jnp.float32).reshape(*lead, n_in // GROUP, GROUP, n_out)
    return (values * scale_values(scales[..., :n_out], jnp.float32)[..., None, :]).reshape(*lead, n_in, n_out).astype(dtype)


def batched(x, blocks, scales, compute, n_out: int | None = None):
    """x [K, M, in] . W [K, in, out] -> [K, M, out] float32, W = blocks x scales, by partial dots
    per chunk of whole groups with the convert inside the dot (the module's docstring); out: n_out,
    or the stored width."""
    k, m, n_in = x.shape
    n_out = _width(blocks, n_out)
    chunk = 2 * GROUP if n_in % (2 * GROUP) == 0 else GROUP
    halves, chunks = chunk // GROUP, n_in // chunk
    # x2[k, m, j, c, i]: x's inputs of chunk c where i falls in group j of the chunk, zero elsewhere
    own = jnp.eye(halves, dtype=compute)[:, None, :, None]  # [j, 1, j', 1]
    x2 = (x.astype(compute).reshape(k, m, 1, chunks, halves, GROUP) * own).reshape(k, m, halves, chunks, chunk)
    part = jnp.einsum("kmjci,kcio->kmjco", x2, blocks.astype(compute).reshape(k, chunks, chunk, -1),
                      preferred_element_type=jnp.float32)
    s = scale_values(scales, jnp.float32).reshape(k, chunks, halves, -1)  # group g = c * halves + j
    return (part * jnp.swapaxes(s, 1, 2)[:, None]).sum((2, 3))[..., :n_out]


def _product(n_out: int | None):
    def product(spec, x, arrays, dtype):
        blocks, scales = arrays["_blocks"], arrays["_scales"]
        if isinstance(spec, w.Batched):
            return batched(x, blocks, scales, spec.dtype, n_out).astype(spec.dtype)
        if isinstance(spec, w.Dot) and blocks.ndim == 2:
            compute = spec.dtype or jnp.result_type(x.dtype, dtype)
            lead = x.shape[:-1]
            y = batched(x.reshape(1, -1, x.shape[-1]), blocks[None], scales[None], compute, n_out)
            return y.reshape(*lead, -1).astype(compute)
        return spec(x, materialize(arrays, dtype, n_out))
    return product


def take(arrays, index):
    """Experts picked from a stack (`Weight.take`) out of the blocks' chunked view [E, chunks, chunk,
    out], the layout `batched` contracts: a pick of the plain stack reshaped after it is written out
    by the TPU compiler before the dot; picked from the view, the pick rides in the dot's operand."""
    blocks, scales = arrays["_blocks"], arrays["_scales"]
    pick = lambda a: jnp.take(a, index, axis=0, mode="clip")  # noqa: E731
    e, n_in, n_out = blocks.shape
    chunk = 2 * GROUP if n_in % (2 * GROUP) == 0 else GROUP
    view = blocks.reshape(e, n_in // chunk, chunk, n_out)
    return {"_blocks": pick(view).reshape(*index.shape, n_in, n_out), "_scales": pick(scales)}


def mxfp4_format(n_out: int) -> w.WeightFormat:
    """The format of MXFP4 weights with `n_out` outputs (`format_name`), registered on first use."""
    name = format_name(n_out)
    if name in w.FORMATS:
        return w.FORMATS[name]
    out = None if name == "mxfp4" else int(n_out)  # "mxfp4": any width of whole lanes, nothing cut
    return w.register(w.WeightFormat(name, stored=stored,
                                     materialize=lambda arrays, dtype: materialize(arrays, dtype, out),
                                     product=_product(out), take=take, row_cost=2))


MXFP4 = mxfp4_format(LANES)  # "mxfp4"


# --------------------------------------------------------------------------- the checkpoint's layout


def to_stored(blocks: np.ndarray, scales: np.ndarray) -> dict[str, np.ndarray]:
    """The checkpoint's MXFP4 (blocks [..., out, in / 32, 16] uint8, two FP4 codes a byte, the even
    input in the low nibble; scales [..., out, in / 32] uint8) -> the stored arrays
    {"_blocks": [..., in, out'] float4_e2m1fn (out' = `padded(out)`, the padding zero), "_scales":
    [..., in / 32, out'] uint8 (the padding 127)}, the arrays of `mxfp4_format(out)`. On the host the
    FP4 array takes a byte a value; one expert at a time beside the result."""
    import ml_dtypes

    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.ndim < 3 or blocks.shape[-1] != GROUP // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    *lead, n_out, groups, width = blocks.shape
    flat = blocks.reshape(-1, n_out, groups, width)
    out = np.zeros((flat.shape[0], groups * GROUP, padded(n_out)), ml_dtypes.float4_e2m1fn)
    codes = out.view(np.uint8)  # ml_dtypes keeps an FP4 value's code in the low nibble of its byte
    for e in range(flat.shape[0]):
        pair = np.empty((n_out, groups, width, 2), np.uint8)
        pair[..., 0], pair[..., 1] = flat[e] & 0x0F, flat[e] >> 4
        codes[e, :, :n_out] = pair.reshape(n_out, groups * GROUP).T
    return {"_blocks": out.reshape(*lead, groups * GROUP, padded(n_out)),
            "_scales": np.pad(np.swapaxes(scales, -1, -2), [(0, 0)] * (scales.ndim - 1) + [(0, padded(n_out) - n_out)],
                              constant_values=127)}


# --------------------------------------------------------------------------- gpt-oss's checkpoints


def rules(cfg: dict, config) -> w.FormatRules:
    """gpt-oss: every layer's expert projections are MXFP4; attention, router, embeddings and head
    stay in the model's dtype (its `modules_to_not_convert`)."""
    return (("*/mlp/experts/gate_up_proj", mxfp4_format(2 * config.moe.intermediate_size).name),
            ("*/mlp/experts/down_proj", mxfp4_format(config.hidden_size).name))

