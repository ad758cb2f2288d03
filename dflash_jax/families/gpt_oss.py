"""gpt-oss (`GptOssForCausalLM`).

Attention: q/k/v/o biases, a learned sink logit per head in every softmax's denominator,
sliding-window (`sliding_window`, 128) and full layers alternating as `layer_types` says, YaRN
RoPE. Every layer's MLP is a MoE block: a router with bias, top-k logits then a softmax over
them; experts with a fused, interleaved gate/up projection and biases, and the clamped
SwiGLU. RMSNorm multiplies its weight in float32.

The official checkpoints store the expert projections in MXFP4 (`*_blocks` + `*_scales`); they stay
MXFP4 on the device (`dflash_jax.model.formats.mxfp4`), or, loaded with `dequantize`,
`dequantize_mxfp4` turns them into the bfloat16 (or float32) parameter, tensor by tensor.
"""

from __future__ import annotations

import numpy as np

from dflash_jax.families.hf import moe_config
from dflash_jax.families.registry import Family, register
from dflash_jax.families.table import Row, decoder_rows

# The 16 values of an FP4 (E2M1) code: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                      np.float32)


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray, dtype=np.float32) -> np.ndarray:
    """MXFP4 -> `dtype`, in the layout gpt-oss computes with.

    blocks [experts, out, groups, 16] uint8: two FP4 codes a byte, the low nibble first, so a
    group of 16 bytes holds 32 consecutive input values. scales [experts, out, groups] uint8:
    the group's power of two, biased by 127. Returns [experts, in = groups * 32, out] (the
    checkpoint's [out, in] transposed, as the bfloat16 gpt-oss weights are stored). Expert by
    expert, so beside the result the host holds one expert's float32 values (gpt-oss-120b: a
    128-expert tensor is 4.2 GB in bfloat16, 8.5 GB in float32).
    """
    blocks, scales = np.asarray(blocks, np.uint8), np.asarray(scales, np.uint8)
    if blocks.ndim != 4 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    experts, rows, groups, width = blocks.shape
    out = np.empty((experts, groups * width * 2, rows), dtype)
    for e in range(experts):
        values = np.empty((rows, groups, width * 2), np.float32)
        values[..., 0::2] = FP4_VALUES[blocks[e] & 0x0F]
        values[..., 1::2] = FP4_VALUES[blocks[e] >> 4]
        values = np.ldexp(values, scales[e].astype(np.int32)[..., None] - 127)
        out[e] = values.reshape(rows, groups * width * 2).T
    return out


def moe_rows(hf_prefix: str, flax_prefix: str) -> list[Row]:
    mlp, flax_mlp = f"{hf_prefix}mlp.", f"{flax_prefix}mlp/"
    rows = [Row(f"{mlp}router.weight", f"{flax_mlp}router/kernel", True),
            Row(f"{mlp}router.bias", f"{flax_mlp}router/bias")]
    for p in ("gate_up_proj", "down_proj"):
        rows += [Row(f"{mlp}experts.{p}", f"{flax_mlp}experts/{p}"),
                 Row(f"{mlp}experts.{p}_bias", f"{flax_mlp}experts/{p}_bias"),
                 Row(f"{mlp}experts.{p}_blocks", f"{flax_mlp}experts/{p}", part="blocks"),
                 Row(f"{mlp}experts.{p}_scales", f"{flax_mlp}experts/{p}", part="scales")]
    return rows


def combine(path: tuple[str, ...], parts: dict, dtype):
    """An expert projection from its MXFP4 parts (`blocks`, `scales`), once both are read: the
    parameter dequantized into `dtype`, or, where the weight is kept in MXFP4 (dtype a dict of the
    stored arrays' suffixes), its stored arrays by suffix (`dflash_jax.model.formats.mxfp4`)."""
    if set(parts) != {"blocks", "scales"}:
        return None
    if isinstance(dtype, dict):
        from dflash_jax.model.formats.mxfp4 import to_stored

        return to_stored(parts["blocks"].read(), parts["scales"].read())
    return dequantize_mxfp4(parts["blocks"].read(), parts["scales"].read(), dtype)


def parse(cfg: dict, layers: int) -> dict:
    moe = moe_config(cfg, "gpt_oss", experts=("num_local_experts",), router="topk_softmax", router_bias=True,
                          expert_bias=True, fused_gate_up=True, activation="clamped_swiglu",
                          swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                          swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))
    return dict(moe=moe, sparse_layers=(True,) * layers)


register(Family("gpt_oss", dict(qkv_bias="attention_bias", o_bias="attention_bias", attention_sinks=True,
                                norm_weight_in_float32=True),
                decoder_rows(moe_rows), parse=parse, combine=combine, quantizations=("mxfp4",)))
