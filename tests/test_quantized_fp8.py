"""FP8 weights kept on the device (`dflash_jax.model.formats.fp8`): the same model as the checkpoint
dequantized at load.

The checkpoints are tests/test_fp8.py's: a tiny random model's Linear weights quantized in the test
(float8_e4m3fn values, a float32 scale per block), one attention projection left unquantized
(`modules_to_not_convert`). Blocks of [16, 32] over HF's [out, in] divide every kernel's input
width but q_b_proj's (24), so most products run `block_dot` (one partial dot per 32 kernel rows,
scaled after) and some dequantize; [48, 40] divides none: every product dequantizes, and every
matrix has partial edge blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from dflash_jax import forward, init_cache, load_target  # noqa: E402
from dflash_jax.checkpoint import _flatten, dequantized_params  # noqa: E402
from dflash_jax.errors import CheckpointError  # noqa: E402
from dflash_jax.families import model_config  # noqa: E402
from dflash_jax.model.formats.fp8 import SCALE  # noqa: E402
from dflash_jax.model.weights import format_for, weight_format  # noqa: E402
from test_fp8 import NOT_CONVERTED, assert_same_params, fp8_checkpoint, write  # noqa: E402
from tiny import make_model  # noqa: E402

SPLIT = (16, 32)  # HF [out, in] blocks: a kernel [in, out] in [32, 16] blocks, kv_b_proj [out, in] in [16, 32]
EDGES = (48, 40)


def checkpoint(tmp_path: Path, family: str, block, seed: int = 4) -> tuple[Path, Path]:
    return fp8_checkpoint(make_model(family, seed=seed), tmp_path, block)


def load_file(path: Path) -> dict:
    """A safetensors file's tensors as numpy arrays (float8 ones too)."""
    from dflash_jax.safetensors_io import iter_lazy_tensors

    return {name: t.read() for name, t in iter_lazy_tensors(path)}


def weights_of(params, config) -> dict[str, str]:
    """{weight path: its format's name} for every weight of params (a stored array's suffix stripped)."""
    out = {}
    for path in _flatten(params):
        joined = "/".join(path)
        if joined.endswith(SCALE):
            continue
        out[joined] = format_for(config.weight_format, joined)
    return out


# --------------------------------------------------------------------------- rules

DEEPSEEK = dict(model_type="deepseek_v3", vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8,
                v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=8, n_shared_experts=1, moe_intermediate_size=32,
                num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)


def test_the_rules_keep_what_a_transformers_fp8_checkpoint_quantizes_in_its_block_layout():
    """Attention (MLA) projections, MLPs, experts and shared experts in FP8, blocks turned to each
    weight's layout (kernels are HF's transposed, kv_b_proj is not); the router, the head and what
    `modules_to_not_convert` names (exact, a regex, a suffix) dense."""
    quant = dict(quant_method="fp8", fmt="e4m3", weight_block_size=[16, 32],
                 modules_to_not_convert=["model.layers.2.self_attn.o_proj", r"model\.layers\.1\.mlp\.shared_experts\..*",
                                         "lm_head"])
    config = model_config({**DEEPSEEK, "quantization_config": quant})
    want = {
        "model/layers_0/self_attn/q_a_proj/kernel": "fp8_e4m3_32x16",
        "model/layers_1/self_attn/q_b_proj/kernel": "fp8_e4m3_32x16",
        "model/layers_1/self_attn/kv_a_proj_with_mqa/kernel": "fp8_e4m3_32x16",
        "model/layers_1/self_attn/kv_b_proj/kernel": "fp8_e4m3_16x32",
        "model/layers_1/self_attn/o_proj/kernel": "fp8_e4m3_32x16",
        "model/layers_2/self_attn/o_proj/kernel": "dense",
        "model/layers_0/mlp/gate_proj/kernel": "fp8_e4m3_32x16",
        "model/layers_1/mlp/experts/down_proj": "fp8_e4m3_32x16",
        "model/layers_2/mlp/shared_expert/up_proj/kernel": "fp8_e4m3_32x16",
        "model/layers_1/mlp/shared_expert/up_proj/kernel": "dense",
        "model/layers_1/mlp/router/kernel": "dense",
        "model/embed_tokens/embedding": "dense",
        "lm_head/kernel": "dense",
    }
    assert {p: format_for(config.weight_format, p) for p in want} == want
    assert weight_format("fp8_e4m3_16x32").stored((128, 32), jnp.float32, None)[SCALE][0] == (8, 1)
    assert model_config({**DEEPSEEK, "quantization_config": quant}, dequantize=True).weight_format == "dense"
    e5m2 = model_config({**DEEPSEEK, "quantization_config": {**quant, "fmt": "e5m2"}})
    assert format_for(e5m2.weight_format, "model/layers_1/mlp/experts/down_proj") == "fp8_e5m2_32x16"
    assert weight_format("fp8_e5m2_32x16").stored((64, 16), jnp.float32, None)[""][1] == jnp.float8_e5m2
    # one scale a matrix: nothing kept, dequantized at load
    assert model_config({**DEEPSEEK, "quantization_config": {**quant, "weight_block_size": None}}).weight_format == ()


# --------------------------------------------------------------------------- loading


def test_a_kept_model_holds_float8_and_scales_exactly_where_the_rules_say_and_dequantizes_to_the_load_time_weights(
        tmp_path):
    fp8, _ = checkpoint(tmp_path, "qwen3_moe", SPLIT)
    config, params = load_target(fp8)
    dense_config, dense = load_target(fp8, dequantize=True)
    flat = _flatten(params)
    formats = weights_of(params, config)
    assert formats["/".join(("model", "layers_0", "self_attn", "o_proj", "kernel"))] == "dense"  # NOT_CONVERTED
    assert NOT_CONVERTED == "model.layers.0.self_attn.o_proj"
    kept = [p for p, f in formats.items() if f != "dense"]
    assert len(kept) == 4 * 4 - 1 + 3 * 3 + 3  # attention (one not converted), 3 sparse layers' experts, 1 MLP
    for joined, name in formats.items():
        path = tuple(joined.split("/"))
        scale = path[:-1] + (path[-1] + SCALE,)
        if name == "dense":
            assert flat[path].dtype == jnp.float32 and scale not in flat, joined
        else:
            assert flat[path].dtype == jnp.float8_e4m3fn, joined
            assert flat[scale].dtype == jnp.float32, joined
            grid = tuple(-(-n // b) for n, b in zip(flat[path].shape[-2:], (32, 16)))
            assert flat[scale].shape == flat[path].shape[:-2] + grid, joined
    assert set(flat) == {tuple(p.split("/")) for p in formats} | {
        tuple(p.split("/"))[:-1] + (p.split("/")[-1] + SCALE,) for p in kept}
    # the stored arrays are the checkpoint's: materialized, they are the load-time dequantized weights bit for bit
    assert_same_params(dequantized_params(params, config), dense)
    assert config.replace(weight_format="dense") == dense_config


def pow2_checkpoint(tmp_path: Path, fmt: str) -> Path:
    """tests/test_fp8's qwen3 checkpoint with power-of-two scales stored as float8_e8m0fnu
    (`scale_fmt: ue8m0`), or its values as float8_e5m2."""
    fp8, _ = checkpoint(tmp_path, "qwen3", SPLIT)
    tensors = {}
    for name, t in load_file(fp8 / "model.safetensors").items():
        if name.endswith(SCALE) and fmt == "ue8m0":
            t = (2.0 ** np.ceil(np.log2(t))).astype(ml_dtypes.float8_e8m0fnu)
        elif t.dtype == np.dtype(ml_dtypes.float8_e4m3fn) and fmt == "e5m2":
            t = t.astype(np.float32).astype(ml_dtypes.float8_e5m2)
        tensors[name] = t
    out = tmp_path / fmt
    out.mkdir()
    write(tensors, out / "model.safetensors")
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] |= {"scale_fmt": "ue8m0"} if fmt == "ue8m0" else {"fmt": "e5m2"}
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("fmt", ["ue8m0", "e5m2"])
def test_e8m0_scales_and_e5m2_values_are_kept_too(fmt, tmp_path):
    path = pow2_checkpoint(tmp_path, fmt)
    config, params = load_target(path)
    flat = _flatten(params)
    kernel = ("model", "layers_1", "mlp", "down_proj", "kernel")
    assert flat[kernel].dtype == (jnp.float8_e5m2 if fmt == "e5m2" else jnp.float8_e4m3fn)
    assert flat[kernel[:-1] + ("kernel" + SCALE,)].dtype == jnp.float32
    assert_same_params(dequantized_params(params, config), load_target(path, dequantize=True)[1])


def test_a_module_left_unquantized_without_being_named_stays_dense(tmp_path):
    """A checkpoint that leaves a Linear weight unquantized without naming it in modules_to_not_convert
    (as some do: Qwen3.5's small linear-attention projections): the shards' headers say so, the loader
    adds it to the list (the config converted copies keep), and it stays dense, never cast into
    float8; the others stay FP8, and the model is the checkpoint dequantized."""
    from dflash_jax.checkpoint import target_config_dict

    fp8, plain = checkpoint(tmp_path, "qwen3", EDGES)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors = load_file(fp8 / "model.safetensors")
    tensors[name] = load_file(plain / "model.safetensors")[name]
    del tensors[name + SCALE]
    write(tensors, fp8 / "model.safetensors")
    assert target_config_dict(fp8)["quantization_config"]["modules_to_not_convert"][-1] == "model.layers.1.mlp.up_proj"
    config, params = load_target(fp8)
    assert format_for(config.weight_format, "model/layers_1/mlp/up_proj/kernel") == "dense"
    assert format_for(config.weight_format, "model/layers_1/mlp/gate_proj/kernel").startswith("fp8")
    layer = params["model"]["layers_1"]["mlp"]
    assert set(layer["up_proj"]) == {"kernel"} and layer["up_proj"]["kernel"].dtype == jnp.float32
    assert layer["gate_proj"]["kernel"].dtype == jnp.float8_e4m3fn
    assert_same_params(dequantized_params(params, config), load_target(plain)[1])


@pytest.mark.parametrize("change,message", [
    ("no scale", r"is missing tensor 'model.layers.1.mlp.up_proj.weight_scale_inv'"),
    ("scale shape", r"tensor 'model.layers.1.mlp.up_proj.weight_scale_inv' has shape \(1, 1\), expected \(2, 2\)"),
    ("e5m2", r"tensor 'model.layers.1.mlp.up_proj.weight' is float8_e5m2, but the model keeps it in float8_e4m3fn"),
])
def test_a_bad_kept_fp8_tensor_is_a_one_line_error(change, message, tmp_path):
    fp8, _ = checkpoint(tmp_path, "qwen3", EDGES)
    name = "model.layers.1.mlp.up_proj.weight"
    tensors = load_file(fp8 / "model.safetensors")
    if change == "no scale":
        del tensors[name + SCALE]
    elif change == "scale shape":
        tensors[name + SCALE] = np.ones((1, 1), np.float32)
    else:
        tensors[name] = tensors[name].astype(np.float32).astype(ml_dtypes.float8_e5m2)
    write(tensors, fp8 / "model.safetensors")
    with pytest.raises(CheckpointError, match=message) as e:
        load_target(fp8)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------- the same model


def greedy(config, params, prompts, steps: int):
    """Greedy decoding of rows of equal-length prompts with `forward`: (tokens [n, steps], every
    step's logits [n, T or 1, vocab] concatenated)."""
    cache = init_cache(config, prompts.shape[0], prompts.shape[1] + steps + 1)
    out = forward(params, config, jnp.asarray(prompts, jnp.int32), cache)
    logits, tokens = [np.asarray(out.logits)], []
    for _ in range(steps):
        token = jnp.argmax(out.logits[:, -1], axis=-1).astype(jnp.int32)
        tokens.append(np.asarray(token))
        out = forward(params, config, token[:, None], out.cache)
        logits.append(np.asarray(out.logits))
    return np.stack(tokens, 1), np.concatenate(logits, 1)


HEAVY = pytest.mark.heavy  # the everyday suite keeps DeepSeek-V3 (MLA, routed and shared experts, split blocks)


@pytest.mark.parametrize("family,block", [pytest.param("qwen3", SPLIT, marks=HEAVY),
                                          pytest.param("qwen3_moe", SPLIT, marks=HEAVY), ("deepseek_v3", SPLIT),
                                          pytest.param("deepseek_v3", EDGES, marks=HEAVY)])
def test_kept_fp8_gives_the_dequantized_models_greedy_tokens_and_logits(family, block, tmp_path):
    fp8, _ = checkpoint(tmp_path, family, block)
    kept, dense = load_target(fp8), load_target(fp8, dequantize=True)
    assert kept[0].weight_format != "dense" and dense[0].weight_format == "dense"
    prompts = np.random.RandomState(3).randint(0, kept[0].vocab_size, (2, 7))
    (tokens, logits), (want_tokens, want_logits) = greedy(*kept, prompts, 8), greedy(*dense, prompts, 8)
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_allclose(logits, want_logits, rtol=0, atol=1e-5)
    if block == EDGES:  # every product dequantizes first: the load-time weights' products exactly
        np.testing.assert_array_equal(logits, want_logits)


# --------------------------------------------------------------------------- conversion


def test_conversion_keeps_fp8_and_reloads_as_the_hf_checkpoint(tmp_path):
    from dflash_jax.convert import main

    fp8, _ = checkpoint(tmp_path, "qwen3_moe", SPLIT)
    assert main(["--hf", str(fp8), "--out", str(tmp_path / "converted"), "--quiet"]) == 0
    saved = json.loads((tmp_path / "converted" / "config.json").read_text())
    assert saved["quantization_config"] == json.loads((fp8 / "config.json").read_text())["quantization_config"]
    (config, params), (hf_config, hf_params) = load_target(tmp_path / "converted"), load_target(fp8)
    assert config == hf_config
    assert_same_params(params, hf_params)  # float8 values and float32 scales, as the HF checkpoint's
    # dequantized from the converted copy: the HF checkpoint dequantized at load
    (config, params), (hf_config, hf_params) = (load_target(tmp_path / "converted", dequantize=True),
                                                load_target(fp8, dequantize=True))
    assert config == hf_config and config.weight_format == "dense"
    assert_same_params(params, hf_params)


# --------------------------------------------------------------------------- memory at a published shape


@pytest.mark.heavy  # an ahead-of-time compile of DeepSeek-V3's widths (9 s); tests/test_mxfp4.py checks MXFP4's everyday
def test_the_compiled_forward_holds_each_fp8_weight_at_the_checkpoints_bytes():
    """DeepSeek-V3's published dims (hidden 7168, 256 experts of 2048, MLA) cut to 2 layers (one
    dense, one MoE), FP8 in 128 x 128 blocks, compiled ahead of time for the CPU (nothing
    allocated): the program's arguments are the checkpoint's bytes, a byte a float8 value plus 4
    per block scale (the rest bfloat16, as shipped), plus the cache and the tokens; against twice
    the quantized weights' bytes dequantized."""
    import math

    from dflash_jax.model import abstract_params
    from dflash_jax.shapes import PUBLISHED_MLA

    quant = dict(quant_method="fp8", fmt="e4m3", activation_scheme="dynamic", weight_block_size=[128, 128])
    hf = dict(PUBLISHED_MLA["deepseek-v3"], num_hidden_layers=2, first_k_dense_replace=1, quantization_config=quant)
    config, dense_config = model_config(hf, dtype="bfloat16"), model_config(hf, dtype="bfloat16", dequantize=True)
    params = abstract_params(config)
    cache = jax.eval_shape(lambda: init_cache(config, 1, 128))
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    compiled = jax.jit(lambda p, t, c: forward(p, config, t, c).logits).lower(params, tokens, cache).compile()

    def nbytes(tree):
        return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))

    checkpoint_bytes = quantized = 0  # from the dense model's weights: what the HF checkpoint stores for each
    for path, leaf in _flatten(abstract_params(dense_config)).items():
        n = math.prod(leaf.shape)
        if format_for(config.weight_format, "/".join(path)) == "dense":
            checkpoint_bytes += n * jnp.dtype(leaf.dtype).itemsize
        else:
            blocks = math.prod(leaf.shape[:-2]) * math.ceil(leaf.shape[-2] / 128) * math.ceil(leaf.shape[-1] / 128)
            checkpoint_bytes += n + 4 * blocks
            quantized += n
    assert quantized > 0.8 * sum(math.prod(a.shape) for a in jax.tree.leaves(params))  # all but embedding and head
    assert nbytes(params) == checkpoint_bytes
    assert compiled.memory_analysis().argument_size_in_bytes == checkpoint_bytes + nbytes(cache) + nbytes(tokens)
    assert nbytes(abstract_params(dense_config)) - nbytes(params) > 0.95 * quantized  # dequantized: 2 bytes a value


# --------------------------------------------------------------------------- a mesh

MESH = "data=2,model=2"


@pytest.mark.heavy  # a 4-device subprocess, 15 s
def test_a_kept_model_loads_onto_a_mesh_in_its_shardings_hf_or_converted(tmp_path):
    """On 4 CPU devices (a subprocess: the device count is fixed before jax is imported): loading
    straight onto the mesh, from the HF checkpoint and from its converted copy, gives the one-device
    values in `param_shardings`, the experts' scales split over `model` with their experts; the
    forward on the mesh gives the one-device logits."""
    from dflash_jax.convert import main

    fp8, _ = checkpoint(tmp_path, "qwen3_moe", SPLIT)
    assert main(["--hf", str(fp8), "--out", str(tmp_path / "converted"), "--quiet"]) == 0
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"}
    proc = subprocess.run([sys.executable, __file__, str(fp8), str(tmp_path / "converted")], capture_output=True,
                          text=True, env=env, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for source in ("hf", "converted"):
        assert out[source]["equal"] and out[source]["in_param_shardings"], out
        assert out[source]["expert_scale_spec"] == ["model", None, None], out
        assert out[source]["logits_diff"] <= 1e-5, out


def worker(hf: str, converted: str) -> dict:
    from dflash_jax.sharding import make_mesh, param_shardings, tracing_on

    mesh = make_mesh(MESH)
    config, one = load_target(hf)
    prompts = jnp.asarray(np.random.RandomState(3).randint(0, config.vocab_size, (2, 7)), jnp.int32)
    want = np.asarray(forward(one, config, prompts, init_cache(config, 2, 16)).logits)
    out = {}
    for source, path in (("hf", hf), ("converted", converted)):
        config, params = load_target(path, mesh=mesh)
        abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), params)
        flat, ref, shardings = _flatten(params), _flatten(one), _flatten(param_shardings(abstract, mesh))
        with tracing_on(mesh):
            logits = np.asarray(forward(params, config, prompts, init_cache(config, 2, 16)).logits)
        out[source] = dict(
            equal=all(np.array_equal(np.asarray(flat[p]).view(np.uint8), np.asarray(ref[p]).view(np.uint8))
                      if flat[p].dtype.itemsize == 1 else np.array_equal(np.asarray(flat[p]), np.asarray(ref[p]))
                      for p in ref),
            in_param_shardings=all(flat[p].sharding.is_equivalent_to(shardings[p], flat[p].ndim) for p in flat),
            expert_scale_spec=list(flat[("model", "layers_0", "mlp", "experts", "gate_proj" + SCALE)].sharding.spec),
            logits_diff=float(np.abs(logits - want).max()))
    return out


if __name__ == "__main__":
    print(json.dumps(worker(sys.argv[1], sys.argv[2])))


@pytest.mark.parametrize("rows,cols,m", [(256, 256, 2), (256, 256, 12), (200, 192, 2)])
def test_experts_taken_from_a_kept_stack_multiply_as_their_dequantized_selves(rows, cols, m):
    """`Weight.take` through the format's own pick (from the stack's view in row blocks), then the
    touched path's `Batched` product, and a `Dot` on one expert: each equals the product with the
    dequantized weight. Both ways `block_dot` weighs its partials: in one contraction per column
    block (m rows up to `WEIGHED_ROWS`, whole column blocks), and by the scale repeated over its
    columns (more rows; edge blocks of rows and columns)."""
    from dflash_jax.model.formats.fp8 import WEIGHED_ROWS
    from dflash_jax.model.weights import Dot
    from dflash_jax.model.weights import Batched, Weight, project

    fmt = weight_format("fp8_e4m3_128x128")
    rs = np.random.RandomState(0)
    assert (m <= WEIGHED_ROWS) == (m == 2)
    values = jnp.asarray(rs.randn(5, rows, cols).astype(np.float32)).astype(jnp.float8_e4m3fn)
    scale = jnp.asarray(rs.uniform(0.5, 2, (5, -(-rows // 128), -(-cols // 128))).astype(np.float32))
    stack = Weight({"": values, SCALE: scale}, fmt, jnp.float32)
    ids = jnp.asarray([4, 0, 4], jnp.int32)
    picked = stack.take(ids)
    assert picked.arrays[""].shape == (3, rows, cols) and picked.arrays[SCALE].shape == (3, *scale.shape[1:])
    x = jnp.asarray(rs.randn(3, m, rows).astype(np.float32))
    got = project(x, picked, Batched(jnp.float32))
    want = jnp.einsum("kmi,kio->kmo", x, stack.dense[ids], precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
    one = Weight({"": values[1], SCALE: scale[1]}, fmt, jnp.float32)
    got = project(x[1], one, Dot(jnp.float32))
    want = jnp.dot(x[1], stack.dense[1], precision="highest")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * float(jnp.abs(want).max()))
