"""INT4 weights kept packed (compressed-tensors `pack-quantized`, `dflash_jax.model.formats.int4`) and
Kimi-K2.5 (`kimi_k25`), on checkpoints written with compressed-tensors' own packing.

- The unpack and the numpy dequantization equal the library's `unpack_from_int32` / decompress on
  random data (float32 and bfloat16 scales, stacks); the products through the seam (`Dot`,
  `Batched`, `Grouped`) equal the same products with the dequantized weight.
- A tiny `kimi_k25` checkpoint (DeepSeek-V3's layers in `text_config`, tensors under
  `language_model.`, a vision tower to skip, the routed experts quantized by the library, group
  32, the rest dense as Kimi's ignore list keeps it) loads with its experts packed (0.5 bytes a
  weight plus a scale per 32) and gives the logits of its dequantized self (`dequantize=True`,
  whose experts equal the library's decompression bit for bit) to 1e-5 in float32; greedy
  decoding equals its dequantized self's and DFlash equals plain decoding, greedy and seeded
  (`-m heavy`: engines).
- A `weight_shape` that disagrees, unsupported compressed-tensors settings, and Kimi's tokenizer
  (custom code) are one-line errors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

from dflash_jax import forward, init_cache, load_target, safetensors_io
from dflash_jax.errors import CheckpointError, ConfigError, InputError
from dflash_jax.families import model_config
from dflash_jax.model.formats import int4
from dflash_jax.model.weights import Batched, Dot, Grouped, Weight, project
from tiny import make_model, save_model, write_random_drafter

GROUP = 32
VOCAB = 24
ARGS = dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=GROUP)
IGNORE = ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
          "re:.*vision_tower.*", "re:.*mm_projector.*"]
EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.\d+\.(gate|up|down)_proj\.weight")


def quantization_config(**weights):
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                          "weights": {**ARGS, "scale_dtype": "torch.bfloat16", **weights}}},
            "ignore": IGNORE, "kv_cache_scheme": None}


def compress(w: torch.Tensor, scale_dtype=torch.bfloat16) -> dict:
    """The library's compressed state of one [out, in] weight: symmetric INT4, a scale per 32."""
    groups = w.float().reshape(w.shape[0], -1, GROUP)
    scale = (groups.abs().amax(-1) / 7.5).clamp(min=1e-6).to(scale_dtype)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**ARGS))
    return PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale}, scheme)


def decompress(state: dict) -> torch.Tensor:
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**ARGS))
    return PackedQuantizationCompressor.decompress(state, scheme)["weight"]


def to_numpy(t: torch.Tensor) -> np.ndarray:
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def flax_arrays(state: dict) -> dict:
    """A compressed [out, in] weight as the format keeps it: [in / 8, out] words, [in / 32, out] scales."""
    return {"_packed": jnp.asarray(to_numpy(state["weight_packed"]).T),
            "_scale": jnp.asarray(to_numpy(state["weight_scale"]).T)}


# --------------------------------------------------------------------------- the format


def test_the_unpack_is_the_librarys_and_so_is_the_dequantized_weight():
    rs = np.random.RandomState(0)
    q = torch.from_numpy(rs.randint(-8, 8, (3, 40, 64)).astype(np.int8))  # a stack of 3 [out, in]
    packed = pack_to_int32(q, 4)
    assert tuple(packed.shape) == (3, 40, 8) and packed.dtype == torch.int32
    ours = np.asarray(int4.unpack(jnp.asarray(np.swapaxes(packed.numpy(), -1, -2))))
    np.testing.assert_array_equal(np.swapaxes(ours, -1, -2), q.numpy())
    np.testing.assert_array_equal(unpack_from_int32(packed, 4, q.shape).numpy(), q.numpy())
    for scale_dtype, dtype in ((torch.bfloat16, jnp.bfloat16), (torch.bfloat16, jnp.float32),
                               (torch.float32, jnp.float32)):
        state = compress(torch.from_numpy(rs.randn(48, 96).astype(np.float32)).to(scale_dtype), scale_dtype)
        theirs = to_numpy(decompress(state)).astype(np.float32)  # dequantized in the scale's dtype
        arrays = flax_arrays(state)
        dense = np.asarray(int4.materialize(arrays, dtype).astype(jnp.float32)).T
        host = int4.dequantize(to_numpy(state["weight_packed"]), to_numpy(state["weight_scale"]), 96,
                               np.dtype(dtype)).astype(np.float32)
        np.testing.assert_array_equal(host, dense)
        if jnp.dtype(dtype) == jnp.dtype(jnp.float32) and scale_dtype == torch.bfloat16:
            theirs = to_numpy(decompress({**state, "weight_scale": state["weight_scale"].float()}))
        np.testing.assert_array_equal(dense, theirs)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_products_equal_those_with_the_dequantized_weight(dtype):
    rs = np.random.RandomState(1)
    stack = [compress(torch.from_numpy(rs.randn(16, 64).astype(np.float32))) for _ in range(3)]
    arrays = {k: jnp.stack([flax_arrays(s)[k] for s in stack]) for k in ("_packed", "_scale")}
    stacked = Weight(arrays, int4.int4_format(GROUP, "bfloat16"), dtype)
    one = Weight(flax_arrays(stack[0]), stacked.format, dtype)
    dense = stacked.dense
    assert dense.shape == (3, 64, 16) and dense.dtype == dtype
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=2e-2, rtol=2e-2)
    x = jnp.asarray(rs.randn(2, 5, 64), dtype)
    got, want = project(x, one, Dot(dtype)), jnp.dot(x, dense[0])
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
    xs = jnp.asarray(rs.randn(2, 4, 64), dtype)  # two touched experts (2 and 0), 4 rows each
    picked = stacked.take(jnp.asarray([2, 0]))
    got = project(xs, picked, Batched(dtype))
    want = jnp.einsum("kmi,kio->kmo", xs, dense[jnp.asarray([2, 0])], preferred_element_type=jnp.float32)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want.astype(dtype), np.float32), **tol)
    rows, sizes = jnp.asarray(rs.randn(7, 64), dtype), jnp.asarray([3, 0, 4], jnp.int32)
    np.testing.assert_array_equal(np.asarray(project(rows, stacked, Grouped(sizes, dtype)), np.float32), np.asarray(
        jax.lax.ragged_dot(rows, dense, sizes, preferred_element_type=jnp.float32).astype(dtype), np.float32))


# --------------------------------------------------------------------------- a tiny Kimi-K2.5


def write_kimi(root: Path, seed: int = 0) -> Path:
    """A tiny `kimi_k25` directory: transformers' DeepSeek-V3 weights under `language_model.`, the
    routed experts compressed by the library, a vision tower and projector beside them."""
    model = make_model("deepseek_v3", seed=seed, vocab_size=VOCAB)  # hidden 64, expert width 32
    hf = save_model(model, root / "dense")
    text = json.loads((hf / "config.json").read_text())
    tensors = {}
    for name, t in safetensors_io.iter_lazy_tensors(hf / "model.safetensors"):
        array = t.read()
        if EXPERT.fullmatch(name):
            state = compress(torch.from_numpy(np.array(array, np.float32)))
            for key in ("weight_packed", "weight_scale", "weight_shape"):
                tensors[f"language_model.{name[:-len('weight')]}{key}"] = to_numpy(state[key])
        else:
            tensors[f"language_model.{name}"] = array
    tensors["vision_tower.patch_embed.proj.weight"] = np.ones((8, 3, 2, 2), np.float32)
    tensors["mm_projector.proj.0.weight"] = np.ones((64, 8), np.float32)
    path = root / "kimi"
    path.mkdir()
    safetensors_io.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = {"model_type": "kimi_k25", "architectures": ["KimiK25ForConditionalGeneration"],
              "tie_word_embeddings": False, "torch_dtype": "float32", "vision_config": {"hidden_size": 8},
              "text_config": {**text, "model_type": "kimi_k2", "quantization_config": quantization_config()}}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return write_kimi(tmp_path_factory.mktemp("kimi"))


def test_a_kimi_checkpoint_keeps_its_experts_packed_and_equals_its_dequantized_self(kimi):
    config, params = load_target(kimi)
    dconfig, dparams = load_target(kimi, dequantize=True)
    assert config.model_type == "kimi_k25" and config.mla is not None and dconfig.weight_format == "dense"
    fmt = int4.format_name(GROUP, "bfloat16")
    assert dict(config.weight_format) == {f"model/layers_{i}/mlp/experts/{p}": fmt
                                          for i in (1, 2, 3) for p in ("gate_proj", "up_proj", "down_proj")}
    experts = params["model"]["layers_1"]["mlp"]["experts"]
    assert set(experts) == {f"{p}{s}" for p in ("gate_proj", "up_proj", "down_proj") for s in ("_packed", "_scale")}
    assert experts["gate_proj_packed"].shape == (8, 64 // 8, 32) and experts["gate_proj_packed"].dtype == jnp.int32
    assert experts["down_proj_scale"].shape == (8, 32 // GROUP, 64) and experts["down_proj_scale"].dtype == jnp.bfloat16
    dense_bytes = sum(a.size * 4 for a in jax.tree.leaves(dparams["model"]["layers_1"]["mlp"]["experts"]))
    kept_bytes = sum(a.nbytes for a in jax.tree.leaves(experts))
    assert kept_bytes * 4 == dense_bytes * (0.5 + 2 / GROUP)  # 0.5 bytes a weight + a bfloat16 scale per 32
    shared = params["model"]["layers_1"]["mlp"]["shared_expert"]["gate_proj"]
    assert set(shared) == {"kernel"} and shared["kernel"].dtype == jnp.float32  # the ignore list's: dense

    # the dequantized experts are the library's decompression (in float32, the model's dtype), bit for bit
    lazy = dict(safetensors_io.iter_lazy_tensors(kimi / "model.safetensors"))
    stem = "language_model.model.layers.2.mlp.experts.5.up_proj."
    theirs = decompress({k: torch.from_numpy(np.array(lazy[stem + k].read(), np.float32 if k == "weight_scale" else None))
                         for k in ("weight_packed", "weight_scale", "weight_shape")})
    np.testing.assert_array_equal(np.asarray(dparams["model"]["layers_2"]["mlp"]["experts"]["up_proj"][5]).T,
                                  to_numpy(theirs).astype(np.float32))

    ids = jnp.asarray(np.random.RandomState(2).randint(0, VOCAB, (2, 24)), jnp.int32)
    kept = forward(params, config, ids, init_cache(config, 2, 32, page_size=16)).logits
    dense = forward(dparams, dconfig, ids, init_cache(dconfig, 2, 32, page_size=16)).logits
    np.testing.assert_allclose(np.asarray(kept), np.asarray(dense), atol=1e-5, rtol=0)
    np.testing.assert_array_equal(np.asarray(kept).argmax(-1), np.asarray(dense).argmax(-1))


def test_a_weight_shape_that_disagrees_is_a_one_line_error(kimi, tmp_path):
    path = tmp_path / "bad"
    path.mkdir()
    (path / "config.json").write_text((kimi / "config.json").read_text())
    tensors = {n: t.read() for n, t in safetensors_io.iter_lazy_tensors(kimi / "model.safetensors")}
    name = "language_model.model.layers.1.mlp.experts.3.down_proj.weight_shape"
    tensors[name] = np.asarray([64, 40], tensors[name].dtype)
    safetensors_io.save_file(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"^tensor '.*experts\.3\.down_proj\.weight_shape' says the dense weight "
                       r"is \[64, 40\], its packed values hold \[64, 32\]$"):
        load_target(path)
    with pytest.raises(CheckpointError, match=r"weight_shape says \[64, 40\], its packed values hold \[64, 32\]$"):
        load_target(path, dequantize=True)


@pytest.mark.heavy  # engines compile for a minute each
def test_kimi_decodes_as_its_dequantized_self_and_dflash_equals_plain(kimi, tmp_path):
    from dflash_jax import load_drafter
    from test_mla import decoded, prompts

    drafter = write_random_drafter(kimi, tmp_path / "drafter", block_size=4, taps=(0, 3), layers=1)
    config, params = load_target(kimi)
    plain, _ = decoded(config, params)
    dense, _ = decoded(*load_target(kimi, dequantize=True))
    n = len(prompts(config))
    assert plain[:n] == dense[:n]  # greedy: the packed experts decode as the dequantized ones
    assert plain[n:] != plain[:n]  # the sampled rows sampled
    spec, accepted = decoded(config, params, *load_drafter(drafter), kv_pages=6)
    assert spec == plain
    assert max(accepted) > 1


# --------------------------------------------------------------------------- errors


def kimi_config(**weights) -> dict:
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                kv_lora_rank=32, q_lora_rank=24, qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16,
                n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1,
                torch_dtype="bfloat16", quantization_config=quantization_config(**weights))
    return {"model_type": "kimi_k25", "text_config": text}


@pytest.mark.parametrize("change, message", [
    (dict(symmetric=False), "weights symmetric False"),
    (dict(num_bits=8), "weights num_bits 8"),
    (dict(type="float"), "weights type 'float'"),
    (dict(strategy="channel"), "weights strategy 'channel'"),
    (dict(group_size=20), "weights group_size 20"),
    (dict(actorder="group"), "weights actorder 'group'"),
    ("activations", "input_activations"),
    ("format", "format 'float-quantized'"),
])
def test_unsupported_compressed_tensors_settings_are_one_line_errors(change, message):
    cfg = kimi_config(**(change if isinstance(change, dict) else {}))
    q = cfg["text_config"]["quantization_config"]
    if change == "activations":
        q["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    elif change == "format":
        q["format"] = "float-quantized"
    with pytest.raises(ConfigError) as e:
        model_config(cfg)
    assert str(e.value).startswith(f"quantization_config (compressed-tensors): {message}")
    assert "\n" not in str(e.value) and str(e.value).endswith("activations unquantized)")


def test_a_kimi_config_reads_and_its_scale_dtype_follows_the_checkpoint():
    config = model_config(kimi_config(scale_dtype=None))
    assert config.model_type == "kimi_k25" and config.moe.num_experts == 8 and config.sparse_layers == (False, True)
    assert set(dict(config.weight_format).values()) == {"int4-g32-bfloat16"}
    assert model_config(kimi_config(), dequantize=True).weight_format == "dense"


def test_kimis_tokenizer_is_custom_code_and_the_error_says_what_to_do(tmp_path, monkeypatch):
    from dflash_jax.pair import TRUST_REMOTE_CODE, load_tokenizer

    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer",
                                                                                None]}}))
    (tmp_path / "tokenization_kimi.py").write_text("import tiktoken\n")
    (tmp_path / "config.json").write_text("{}")
    monkeypatch.delenv(TRUST_REMOTE_CODE, raising=False)
    with pytest.raises(InputError) as e:
        load_tokenizer(tmp_path)
    assert str(e.value) == (f"the tokenizer in {tmp_path} is the checkpoint's own code (tokenization_kimi."
                            "TikTokenTokenizer, transformers' trust_remote_code); to run it set "
                            "DFLASH_TRUST_REMOTE_CODE=1 (Kimi's also needs: pip install tiktoken), or give rows as "
                            "input_ids from a directory without tokenizer files")
    try:
        import tiktoken  # noqa: F401
    except ImportError:  # opted in, without tiktoken: says to install it
        monkeypatch.setenv(TRUST_REMOTE_CODE, "1")
        with pytest.raises(InputError) as e:
            load_tokenizer(tmp_path)
        assert str(e.value) == f"the tokenizer in {tmp_path} (tokenization_kimi.TikTokenTokenizer) needs tiktoken: " \
                               "pip install tiktoken"


def test_conversion_keeps_the_experts_packed_and_reloads_as_the_hf_checkpoint(kimi, tmp_path):
    """`python -m dflash_jax.convert` of an INT4 checkpoint writes the packed words and scales as they
    are, and the converted directory loads as the HF one (kept) and as its dequantized self."""
    from dflash_jax.convert import main

    out = tmp_path / "converted"
    assert main(["--hf", str(kimi), "--out", str(out), "--quiet"]) == 0
    (config, params), (hf_config, hf_params) = load_target(out), load_target(kimi)
    assert config == hf_config and config.weight_format != "dense"
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)) or
                 (a.dtype == b.dtype) or pytest.fail(f"{a.dtype} != {b.dtype}"), params, hf_params)
    (config, params), (hf_config, hf_params) = load_target(out, dequantize=True), load_target(kimi, dequantize=True)
    assert config.weight_format == "dense"
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, hf_params)


def test_packed_experts_and_their_scales_lie_out_on_a_mesh_as_the_experts_do(kimi):
    """Each stored array of a kept weight takes its weight's axes (`sharding.param_axes`): a routed
    expert's packed words and scales on the expert's device, not copied to every chip."""
    from dflash_jax.model import abstract_params
    from dflash_jax.sharding import param_axes

    config = model_config(json.loads((kimi / "config.json").read_text()))
    flat = jax.tree_util.tree_flatten_with_path(abstract_params(config))[0]
    stored = {tuple(k.key for k in path): leaf for path, leaf in flat if path[-1].key.endswith(("_packed", "_scale"))}
    assert stored and all(p[-2] == "experts" for p in stored)
    for path, leaf in stored.items():
        weight = path[:-1] + (path[-1].rsplit("_", 1)[0],)
        assert param_axes(path, leaf.ndim) == param_axes(weight, leaf.ndim) and param_axes(path, leaf.ndim)[0] == "expert"
