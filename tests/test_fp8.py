"""FP8 checkpoints (block-scaled float8_e4m3fn, transformers' `quant_method: "fp8"`), dequantized at load
(`dequantize=True`; kept in FP8 on the device, the default: tests/test_quantized_fp8.py).

Each checkpoint here is quantized in the test from a tiny random model's weights: per block, the
scale is the block's largest magnitude / 448 and the values are cast to float8_e4m3fn. The
reference is computed here too (the float8 values times their block's scale, with the scales
repeated over the blocks, not the library's index arithmetic) and written as a plain checkpoint.
Blocks of [48, 40] divide none of the tiny models' 32-, 64- and 96-wide matrices: every matrix has
partial edge blocks (and a k_proj of 32 rows is one partial block high).
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch

from dflash_jax import load_target
from dflash_jax.errors import CheckpointError, ConfigError
from dflash_jax.families import model_config
from dflash_jax.fp8 import Fp8Format, Fp8Tensor
from dflash_jax.safetensors_io import ArrayTensor
from tiny import FAMILIES, assert_plain_greedy_equals_generate, make_model, save_model

BLOCK = (48, 40)
E4M3 = ml_dtypes.float8_e4m3fn
NOT_CONVERTED = "model.layers.0.self_attn.o_proj"  # left unquantized, as `modules_to_not_convert` does


def quantize(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """[..., R, C] float32 -> (float8_e4m3fn values, float32 scales [..., ceil(R/bm), ceil(C/bn)])."""
    (bm, bn), (rows, cols) = block, w.shape[-2:]
    nr, nc = -(-rows // bm), -(-cols // bn)
    padded = np.zeros(w.shape[:-2] + (nr * bm, nc * bn), np.float32)
    padded[..., :rows, :cols] = w
    amax = np.abs(padded.reshape(w.shape[:-2] + (nr, bm, nc, bn))).max(axis=(-3, -1))
    scale = np.where(amax > 0, amax / 448.0, 1.0).astype(np.float32)
    values = np.clip(w / expand(scale, block, w.shape), -448, 448).astype(E4M3)
    return values, scale


def expand(scale: np.ndarray, block, shape) -> np.ndarray:
    """Each block's scale repeated over its block, cut to the matrix's shape."""
    return np.repeat(np.repeat(scale, block[0], -2), block[1], -1)[..., :shape[-2], :shape[-1]]


def write(tensors: dict, path: Path):
    """numpy arrays (float8, bfloat16 included) to a safetensors file, through torch's writer."""
    from safetensors.torch import save_file

    views = {np.dtype(E4M3): (np.uint8, torch.float8_e4m3fn), np.dtype(ml_dtypes.float8_e5m2): (np.uint8, torch.float8_e5m2),
             np.dtype(ml_dtypes.float8_e8m0fnu): (np.uint8, torch.float8_e8m0fnu),
             np.dtype(ml_dtypes.bfloat16): (np.int16, torch.bfloat16)}
    save_file({k: torch.from_numpy(np.ascontiguousarray(v).view(views[v.dtype][0])).view(views[v.dtype][1])
               if v.dtype in views else torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
              path, metadata={"format": "pt"})


def fp8_checkpoint(model, path: Path, block, dtype: str = "float32") -> tuple[Path, Path]:
    """The model's Linear weights (q/k/v/o and the MLPs' and experts' projections; not the
    embedding, norms, router or head, nor NOT_CONVERTED) quantized in `block`s: (the FP8
    checkpoint, the plain checkpoint of its dequantized weights), both in `dtype`."""
    from safetensors.numpy import load_file

    src = save_model(model, path / "src")
    fp8, plain = {}, {}
    cast = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    for name, t in load_file(src / "model.safetensors").items():
        if name.endswith(("_proj.weight", "_proj_with_mqa.weight")) and not name.startswith(NOT_CONVERTED):
            values, scale = quantize(t, block)
            fp8[name], fp8[f"{name}_scale_inv"] = values, scale
            plain[name] = (values.astype(np.float32) * expand(scale, block, t.shape)).astype(cast)
        else:
            fp8[name] = plain[name] = t.astype(cast)
    config = json.loads((src / "config.json").read_text()) | {"dtype": dtype}
    out = []
    for name, tensors, quant in (("fp8", fp8, dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic",
                                                   weight_block_size=list(block),
                                                   modules_to_not_convert=[NOT_CONVERTED])),
                                 ("plain", plain, None)):
        (path / name).mkdir()
        write(tensors, path / name / "model.safetensors")
        (path / name / "config.json").write_text(json.dumps(config | ({"quantization_config": quant} if quant else {})))
        out.append(path / name)
    return out[0], out[1]


def assert_same_params(a, b):
    leaves_a, leaves_b = jax.tree_util.tree_leaves_with_path(a), jax.tree_util.tree_leaves_with_path(b)
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        assert x.dtype == y.dtype, path
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=jax.tree_util.keystr(path))


def check_fp8_family(family: str, block, tmp_path: Path, dtypes=("float32",)):
    """An FP8 checkpoint of the family loads to exactly its dequantized weights (in each dtype),
    and our plain greedy decoding of it equals transformers' `generate` of the dequantized model."""
    model = make_model(family, seed=4)
    fp8, plain = fp8_checkpoint(model, tmp_path, block)
    for dtype in dtypes:
        (_, ours), (_, want) = load_target(fp8, dtype=dtype, dequantize=True), load_target(plain, dtype=dtype)
        assert_same_params(ours, want)
    reference = FAMILIES[family][1].from_pretrained(plain, dtype=torch.float32).eval()
    assert_plain_greedy_equals_generate(reference, fp8)


def test_fp8_moe_checkpoint_loads_its_dequantized_weights_and_decodes_as_transformers(tmp_path):
    """Qwen3-MoE (per-expert FP8 weights, a dense layer, attention), edge blocks everywhere. The
    reference is transformers' reading too: its own dequantization (`_dequantize_fp8_weight`, what
    its FP8 layers' backward uses) of each pair in the file gives the weights written beside it."""
    from safetensors.torch import load_file
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    check_fp8_family("qwen3_moe", BLOCK, tmp_path)
    fp8, plain = load_file(tmp_path / "fp8" / "model.safetensors"), load_file(tmp_path / "plain" / "model.safetensors")
    pairs = [name for name in fp8 if f"{name}_scale_inv" in fp8]
    assert len(pairs) == 4 * 4 - 1 + 3 * 6 * 3 + 3  # attention (one not converted), 3 sparse layers' experts, 1 MLP
    for name in pairs:
        theirs = _dequantize_fp8_weight(fp8[name], fp8[f"{name}_scale_inv"], list(BLOCK), torch.float32)
        torch.testing.assert_close(theirs, plain[name], rtol=0, atol=0, msg=name)


@pytest.mark.heavy
@pytest.mark.parametrize("family,block", [  # each family and each block once (all nine went for .ci/run's 50 minutes)
    ("qwen3", BLOCK), ("qwen3_moe", (128, 128)), ("qwen3_5_moe", (16, 16))])
def test_fp8_checkpoints_of_each_family_and_block(family, block, tmp_path):
    check_fp8_family(family, block, tmp_path, dtypes=("float32", "bfloat16"))


@pytest.mark.heavy
def test_fp8_checkpoint_converts_to_its_dequantized_weights(tmp_path):
    from dflash_jax.convert import main

    fp8, plain = fp8_checkpoint(make_model("qwen3", seed=2), tmp_path, BLOCK, dtype="bfloat16")
    assert main(["--hf", str(fp8), "--out", str(tmp_path / "converted"), "--dequantize"]) == 0
    assert "quantization_config" not in json.loads((tmp_path / "converted" / "config.json").read_text())
    config, params = load_target(tmp_path / "converted")
    assert config.dtype == "bfloat16"
    assert_same_params(params, load_target(plain)[1])


def test_fp8_tensor_reads_any_rows_of_a_matrix_or_a_stack():
    """A device's shard reads rows start..stop: those rows, with the scales of their blocks
    (a range that starts and ends inside blocks), of one matrix or a stack of experts; one
    scale a matrix (`weight_block_size: null`) too."""
    rs = np.random.RandomState(0)
    for shape, block in (((100, 70), (48, 40)), ((3, 50, 33), (16, 16)), ((3, 50, 33), None)):
        values, scale = quantize(rs.randn(*shape).astype(np.float32), block or shape[-2:])
        if block is None:
            scale = scale.reshape(shape[0])
        whole = values.astype(np.float32) * (scale[:, None, None] if block is None else expand(scale, block, shape))
        tensor = Fp8Tensor("w", ArrayTensor(values), ArrayTensor(scale), Fp8Format(np.dtype(E4M3), block), np.float32)
        np.testing.assert_array_equal(tensor.read(), whole)
        for start, stop in ((0, 1), (1, 2), (2, 3)) if len(shape) == 3 else ((0, 100), (5, 47), (47, 49), (95, 100)):
            np.testing.assert_array_equal(tensor.read_rows(start, stop), whole[start:stop])


# --------------------------------------------------------------------------- bad input

CONFIG = dict(model_type="qwen3", vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1, head_dim=4)


@pytest.mark.parametrize("quant,message", [
    (dict(fmt="e2m1"), "fmt 'e2m1' is not supported"),
    (dict(weight_block_size=[128]), r"weight_block_size \[128\] is not two positive integers"),
    (dict(weight_block_size=[0, 128]), "is not two positive integers"),
    (dict(activation_scheme="static"), "activation_scheme 'static' is not supported"),
    (dict(expert_dtype="fp4"), "expert_dtype 'fp4' is not supported"),
])
def test_bad_fp8_config_is_a_one_line_error(quant, message):
    model_config({**CONFIG, "quantization_config": {"quant_method": "fp8"}})  # the defaults: e4m3, [128, 128]
    with pytest.raises(ConfigError, match=message) as err:
        model_config({**CONFIG, "quantization_config": {"quant_method": "fp8", **quant}})
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,message", [
    ("no scale", r"float8 tensor 'model.layers.0.self_attn.q_proj.weight' has no scale "
                 r"'model.layers.0.self_attn.q_proj.weight_scale_inv'"),
    ("no weight", r"scale 'model.layers.0.self_attn.q_proj.weight_scale_inv' has no float8 tensor"),
    ("scale shape", r"scale 'model.layers.0.self_attn.q_proj.weight_scale_inv' has shape \(1, 1\), "
                    r"expected \(2, 1\) for a \(8, 8\) weight in \[4, 8\] blocks"),
    ("e5m2", r"'model.layers.0.self_attn.q_proj.weight' is float8_e5m2, but quantization_config fmt says "
             r"float8_e4m3fn"),
])
def test_bad_fp8_checkpoint_is_a_one_line_error(change, message, tmp_path):
    name = "model.layers.0.self_attn.q_proj.weight"
    tensors = {name: np.ones((8, 8), E4M3), f"{name}_scale_inv": np.ones((2, 1), np.float32)}
    if change == "no scale":
        del tensors[f"{name}_scale_inv"]
    elif change == "no weight":
        del tensors[name]
    elif change == "scale shape":
        tensors[f"{name}_scale_inv"] = np.ones((1, 1), np.float32)
    else:
        tensors[name] = np.ones((8, 8), ml_dtypes.float8_e5m2)
    write(tensors, tmp_path / "model.safetensors")
    quant = dict(quant_method="fp8", fmt="e4m3", weight_block_size=[4, 8])
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "quantization_config": quant}))
    with pytest.raises(CheckpointError, match=message) as err:
        load_target(tmp_path, dequantize=True)  # kept in FP8: tests/test_quantized_fp8.py
    assert "\n" not in str(err.value)
