"""MXFP4 kept on the device (`dflash_jax.model.formats.mxfp4`): the stored arrays equal gpt-oss's
dequantization, every product equals materialize-then-contract, and a tiny gpt-oss checkpoint in
MXFP4 loads kept and decodes as its dequantized self."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from dflash_jax import forward, init_cache, load_target
from dflash_jax.errors import CheckpointError
from dflash_jax.families.gpt_oss import dequantize_mxfp4
from dflash_jax.model.formats import mxfp4
from dflash_jax.model.weights import Batched, Dot, Grouped, Weight, project
from test_moe import IDS, mxfp4_checkpoint
from tiny import make_model


def random_mxfp4(experts, n_out, n_in, seed=0):
    rs = np.random.RandomState(seed)
    blocks = rs.randint(0, 256, (experts, n_out, n_in // 32, 16)).astype(np.uint8)
    scales = rs.randint(118, 136, (experts, n_out, n_in // 32)).astype(np.uint8)
    return blocks, scales


def kept(blocks, scales, dtype=jnp.float32) -> Weight:
    fmt = mxfp4.mxfp4_format(scales.shape[-2])  # "mxfp4_out<out>": the stored arrays are padded past out
    return Weight({k: jnp.asarray(v) for k, v in mxfp4.to_stored(blocks, scales).items()}, fmt, dtype)


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_stored_arrays_materialize_to_gpt_oss_dequantization(dtype):
    blocks, scales = random_mxfp4(3, 24, 96)
    stored = mxfp4.to_stored(blocks, scales)
    # the FP4 columns padded to a whole 128 (zero), so a TPU's default layout is the one the dots read
    assert stored["_blocks"].dtype == ml_dtypes.float4_e2m1fn and stored["_blocks"].shape == (3, 96, 128)
    assert not np.asarray(stored["_blocks"][..., 24:], np.float32).any()
    # the scales' columns padded as the blocks' (127: a scale of 1), so their layout is whole lanes too
    assert stored["_scales"].dtype == np.uint8 and stored["_scales"].shape == (3, 3, 128)
    assert (stored["_scales"][..., 24:] == 127).all()
    fmt = mxfp4.mxfp4_format(24)
    assert fmt.name == "mxfp4_out24" and mxfp4.mxfp4_format(256).name == "mxfp4"
    dense = np.asarray(fmt.materialize({k: jnp.asarray(v) for k, v in stored.items()}, jnp.dtype(dtype)))
    np.testing.assert_array_equal(dense.astype(np.float32), dequantize_mxfp4(blocks, scales, dtype).astype(np.float32))
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.to_stored(blocks, scales[..., :1])


@pytest.mark.parametrize("n_in", [128, 96])  # chunks of 64 inputs (two groups), and of 32
def test_products_equal_materialize_then_contract(n_in):
    blocks, scales = random_mxfp4(4, 40, n_in, seed=n_in)
    weight = kept(blocks, scales)
    dense = jnp.asarray(dequantize_mxfp4(blocks, scales))  # [4, in, 40]
    x = jnp.asarray(np.random.RandomState(1).standard_normal((4, 5, n_in)), jnp.float32)
    with jax.default_matmul_precision("highest"):
        ref = jnp.einsum("kmi,kio->kmo", x, dense)
        got = project(x, weight, Batched(jnp.float32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))
        one = Weight({k: v[2] for k, v in weight.arrays.items()}, weight.format, jnp.float32)
        got = project(x[0], one, Dot(jnp.float32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(x[0] @ dense[2]), rtol=1e-5,
                                   atol=1e-5 * float(jnp.abs(ref).max()))
        sizes = jnp.array([2, 0, 3, 0], jnp.int32)
        got = project(x[0], weight, Grouped(sizes, jnp.float32))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(Grouped(sizes, jnp.float32)(x[0], dense)))
        # the experts a step touches, taken from the stack in their stored format
        ids = jnp.array([3, 1], jnp.int32)
        got = project(x[:2], weight.take(ids), Batched(jnp.float32))
        np.testing.assert_allclose(np.asarray(got), np.asarray(jnp.einsum("kmi,kio->kmo", x[:2], dense[ids])),
                                   rtol=1e-5, atol=1e-5 * float(jnp.abs(ref).max()))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = make_model("gpt_oss", seed=3)
    return model, mxfp4_checkpoint(model, tmp_path_factory.mktemp("mxfp4"))


def test_checkpoint_loads_kept_in_mxfp4_and_decodes_as_dequantized(checkpoint, monkeypatch):
    from dflash_jax.engine import BatchEngine
    from dflash_jax.model import moe as moe_module

    tiled = []  # MXFP4 stacks' products cost two dots a row: a step running every expert takes the tiled path
    real = moe_module.tiled_mlp
    monkeypatch.setattr(moe_module, "tiled_mlp", lambda *a, **k: tiled.append(1) or real(*a, **k))
    from dflash_jax.model.weights import format_for, weight_format

    model, path = checkpoint
    config, params = load_target(path, dtype="float32")
    dconfig, dparams = load_target(path, dtype="float32", dequantize=True)
    assert config.weight_format != "dense" and dconfig.weight_format == "dense"
    for i in range(config.num_hidden_layers):
        experts = params["model"][f"layers_{i}"]["mlp"]["experts"]
        assert set(experts) == {"gate_up_proj_blocks", "gate_up_proj_scales", "gate_up_proj_bias",
                                "down_proj_blocks", "down_proj_scales", "down_proj_bias"}
        for name in ("gate_up_proj", "down_proj"):
            assert experts[f"{name}_blocks"].dtype == jnp.float4_e2m1fn
            assert experts[f"{name}_scales"].dtype == jnp.uint8
            dense = dparams["model"][f"layers_{i}"]["mlp"]["experts"][name]
            fmt = weight_format(format_for(config.weight_format, f"model/layers_{i}/mlp/experts/{name}"))
            assert fmt.name == mxfp4.format_name(dense.shape[-1])  # its out width's format ("mxfp4_out<out>")
            np.testing.assert_array_equal(
                np.asarray(fmt.materialize({s: experts[name + s] for s in ("_blocks", "_scales")}, jnp.float32)),
                np.asarray(dense))
        # attention and the router stay dense, in the model's dtype
        assert params["model"][f"layers_{i}"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.float32
        assert params["model"][f"layers_{i}"]["mlp"]["router"]["kernel"].dtype == jnp.float32
    ids = jnp.asarray(IDS, jnp.int32)
    ours = forward(params, config, ids, init_cache(config, 2, 32)).logits
    ref = forward(dparams, dconfig, ids, init_cache(dconfig, 2, 32)).logits
    np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), atol=1e-5, rtol=0)

    prompts = [IDS[0, :n].tolist() for n in (3, 19, 11)]
    outs = []
    for cfg, p in ((config, params), (dconfig, dparams)):
        tiled.clear()
        gen = BatchEngine(cfg, p, batch_size=2, max_new_tokens=10, max_prompt_len=24, page_size=16)
        outs.append([r.output_ids for r in sorted(gen.generate(prompts), key=lambda r: r.index)])
        assert bool(tiled) == (cfg.weight_format != "dense")  # 2 rows x top 2 run all 4 experts: tiled in MXFP4
    assert outs[0] == outs[1]


def test_a_missing_scale_is_named_when_kept(checkpoint, tmp_path):
    import shutil

    from safetensors.numpy import load_file, save_file

    _, src = checkpoint
    path = tmp_path / "q"
    shutil.copytree(src, path)
    tensors = {k: np.array(v) for k, v in load_file(path / "model.safetensors").items()}
    del tensors["model.layers.2.mlp.experts.down_proj_scales"]
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model.layers.2.mlp.experts.down_proj.*blocks read"):
        load_target(path)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed")
def test_a_tpu_holds_gpt_oss_120b_experts_at_the_checkpoints_bytes():
    """Compiled for one v5p chip, a program taking one gpt-oss-120b layer's experts in MXFP4 holds
    them at 4.25 bits a weight (the checkpoint's blocks and scales; down_proj's FP4 columns and
    scales padded from 2880 to 2944), the biases in bfloat16, and its default layouts are the ones
    the products read: no stack, of values or of scales, is copied into another layout."""
    from dflash_jax import aot
    from dflash_jax.families import model_config
    from dflash_jax.model import abstract_params
    from dflash_jax.shapes import PUBLISHED_MOE

    hf = dict(PUBLISHED_MOE["gpt-oss-120b"], num_hidden_layers=1, layer_types=["full_attention"],
              quantization_config={"quant_method": "mxfp4"})
    config = model_config(hf)
    experts = abstract_params(config)["model"]["layers_0"]["mlp"]["experts"]
    mesh = aot.mesh_for(aot.topology("v5p:1x1x1"), "data=1,model=1")
    args = {k: aot.abstract_replicated(mesh, v.shape, v.dtype) for k, v in experts.items()}
    r = aot.compile_for_tpu(jax.jit(lambda a: sum(v.reshape(-1)[0].astype(jnp.float32) for v in a.values())),
                            (args,), None, "experts")
    e, h, i = 128, 2880, 2880
    blocks, scales = e * (h * 2 * i + i * 2944) / 2, e * (h * 2 * i + i * 2944) / 32
    assert r["memory"]["arguments"] == blocks + scales + e * (2 * i + h) * 2
    layouts = jax.jit(lambda a: a).trace(args).lower().compile().input_formats[0][0]
    for name in ("gate_up_proj_blocks", "down_proj_blocks"):
        assert layouts[name].layout.major_to_minor == (0, 1, 2), (name, layouts[name].layout)
    for name in ("gate_up_proj_scales", "down_proj_scales"):  # the columns minor, not the experts (unpadded,
        # down_proj's were expert-minor, and every call copied the stack's scales before picking an expert's)
        assert layouts[name].layout.major_to_minor[-1] == 2, (name, layouts[name].layout)


def test_conversion_keeps_the_experts_in_mxfp4_and_reloads_as_the_hf_checkpoint(checkpoint, tmp_path):
    """`python -m dflash_jax.convert` of an MXFP4 checkpoint writes the FP4 values and E8M0 scales as
    they are, and the converted directory loads as the HF one (kept) and as its dequantized self."""
    from dflash_jax.convert import main

    _, path = checkpoint
    out = tmp_path / "converted"
    assert main(["--hf", str(path), "--out", str(out), "--quiet"]) == 0
    (config, params), (hf_config, hf_params) = load_target(out), load_target(path)
    assert config == hf_config and config.weight_format != "dense"

    def same(a, b):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a.astype(jnp.float32)), np.asarray(b.astype(jnp.float32)))

    jax.tree.map(same, params, hf_params)
    (config, params), (hf_config, hf_params) = load_target(out, dequantize=True), load_target(path, dequantize=True)
    assert config.weight_format == "dense"
    jax.tree.map(same, params, hf_params)
