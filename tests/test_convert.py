"""Checkpoint formats: converted == HF, sharded and .bin inputs, atomic CLI, bad input."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax import CheckpointError, ConfigError, forward, init_cache, load_target
from dflash_jax import checkpoint, safetensors_io
from dflash_jax.convert import main as convert_main
from tiny import make_model, save_model

IDS = jnp.asarray(np.random.RandomState(0).randint(0, 160, (2, 12)), jnp.int32)


def logits_of(path, **kw):
    config, params = load_target(path, **kw)
    return np.asarray(forward(params, config, IDS, init_cache(config, 2, 16)).logits), config, params


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        family: save_model(make_model(family), root / family)
        for family in ("qwen3", "llama3", "qwen3_tied")
    }


@pytest.mark.parametrize("family", ["qwen3", "llama3", "qwen3_tied"])
def test_converted_checkpoint_gives_identical_logits(family, hf_dirs, tmp_path, capsys):
    out = tmp_path / "converted"
    assert convert_main(["--hf", str(hf_dirs[family]), "--out", str(out), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (out / "config.json").is_file() and (out / "params").is_dir()
    meta = json.loads((out / "dflash_jax.json").read_text())
    assert meta["kind"] == "target" and meta["dtype"] == "float32"
    ref, config_hf, params_hf = logits_of(hf_dirs[family])
    got, config_cv, params_cv = logits_of(out)
    assert config_cv == config_hf
    np.testing.assert_array_equal(got, ref)
    jax.tree.map(np.testing.assert_array_equal, params_cv, params_hf)


def test_convert_to_bfloat16_and_side_files(hf_dirs, tmp_path):
    src = tmp_path / "src"
    save_model(make_model("qwen3"), src)
    (src / "tokenizer_config.json").write_text("{}")
    out = tmp_path / "bf16"
    assert convert_main(["--hf", str(src), "--out", str(out), "--dtype", "bfloat16", "--quiet"]) == 0
    assert (out / "tokenizer_config.json").is_file() and (out / "generation_config.json").is_file()
    config, params = load_target(out)
    assert config.dtype == "bfloat16"
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    config32, params32 = load_target(out, dtype="float32")
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params32))


def test_refuses_to_overwrite_without_force(hf_dirs, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert_main(["--hf", str(hf_dirs["qwen3"]), "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    assert convert_main(["--hf", str(hf_dirs["llama3"]), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and err.count("\n") == 1
    assert load_target(out)[0].model_type == "qwen3"
    assert convert_main(["--hf", str(hf_dirs["llama3"]), "--out", str(out), "--quiet", "--force"]) == 0
    assert load_target(out)[0].model_type == "llama"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]  # no temporary left behind


def test_interrupted_conversion_leaves_nothing_complete(hf_dirs, tmp_path, monkeypatch):
    def boom(out, *a, **kw):
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint, "save_converted", boom)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.convert(hf_dirs["qwen3"], tmp_path / "out")
    assert list(tmp_path.iterdir()) == []


def test_sharded_safetensors_and_pytorch_bin(tmp_path):
    model = make_model("qwen3", seed=4)
    sharded = save_model(model, tmp_path / "sharded", max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 2
    ref, *_ = logits_of(sharded)
    with torch.no_grad():
        want = model(torch.tensor(np.asarray(IDS))).logits.numpy()
    np.testing.assert_allclose(ref, want, atol=1e-4, rtol=0)

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "config.json").write_text((sharded / "config.json").read_text())
    torch.save(model.to(torch.bfloat16).state_dict(), bin_dir / "pytorch_model.bin")
    got, config, params = logits_of(bin_dir, dtype="float32")
    np.testing.assert_allclose(got, ref, atol=0.1)  # bfloat16 weights, float32 compute
    emb = model.model.embed_tokens.weight.detach().float().numpy()
    np.testing.assert_array_equal(np.asarray(params["model"]["embed_tokens"]["embedding"]), emb)


def test_pytorch_bin_that_would_run_code_is_refused(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "config.json").write_text(json.dumps({**json.loads(
        (save_model(make_model("qwen3"), tmp_path / "src") / "config.json").read_text())}))
    torch.save({"x": Evil()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="cannot load .*pytorch_model.bin safely"):
        load_target(tmp_path)


# ----------------------------------------------------------------------------- bad input


def rewrite_tensors(path, edit):
    tensors = dict(safetensors_io.iter_tensors(path / "model.safetensors"))
    edit(tensors)
    safetensors_io.save_file(tensors, path / "model.safetensors")


def edit_header(path, edit):
    """Rewrite a safetensors file's JSON header through edit(header), its data unchanged."""
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + raw[8 + n:])


def shift(header, name, by):
    header[name]["data_offsets"] = [o + by for o in header[name]["data_offsets"]]


def bad_dirs(root, good):
    import shutil

    def copy(name):
        shutil.copytree(good, root / name)
        return root / name

    cases = {}
    cases["missing dir"] = (root / "nope", CheckpointError, "does not exist")
    (root / "empty").mkdir()
    cases["not a model dir"] = (root / "empty", CheckpointError, "not a model directory")
    d = copy("gpt2")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    cases["unsupported model_type"] = (d, ConfigError, "unsupported model_type 'gpt2'")
    d = copy("noweights")
    (d / "model.safetensors").unlink()
    cases["no weights"] = (d, CheckpointError, "no weights in")
    d = copy("missing")
    rewrite_tensors(d, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    cases["missing tensor"] = (d, CheckpointError, "missing tensor 'model.layers.1.mlp.up_proj.weight'")
    d = copy("extra")
    rewrite_tensors(d, lambda t: t.update({"model.extra_thing.weight": np.zeros(3, np.float32)}))
    cases["extra tensor"] = (d, CheckpointError, "unexpected tensor 'model.extra_thing.weight'")
    d = copy("extra_layer")
    rewrite_tensors(d, lambda t: t.update({"model.layers.9.input_layernorm.weight": np.zeros(64, np.float32)}))
    cases["tensor beyond the config's layers"] = (d, CheckpointError, "model.layers.9.input_layernorm.weight")
    d = copy("shape")
    rewrite_tensors(d, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((64, 63), np.float32)}))
    cases["wrong shape"] = (d, CheckpointError, r"q_proj.weight' has shape \(64, 63\), expected \(64, 64\)")
    d = copy("header_dtype")  # float32 data said to be bfloat16: half the bytes it spans
    edit_header(d / "model.safetensors", lambda h: h["model.norm.weight"].update(dtype="BF16"))
    cases["wrong dtype in the header"] = (d, CheckpointError, r"model.safetensors: tensor model.norm.weight: its "
                                          r"data_offsets \[\d+, \d+\] hold 256 bytes, but BF16 \[64\] is 128 bytes")
    d = copy("header_offsets")  # a tensor's offsets moved 4 bytes on: it overlaps the next one
    edit_header(d / "model.safetensors", lambda h: shift(h, "model.norm.weight", 4))
    cases["shifted data_offsets"] = (d, CheckpointError, "model.safetensors: tensor .* starts at data byte .*: it "
                                     "(overlaps the tensor before it|leaves a gap of 4 bytes)")
    d = copy("cut")  # the file cut short
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-4])
    cases["truncated file"] = (d, CheckpointError, "but the file holds .* bytes of data .*cut short")
    d = copy("badjson")
    (d / "config.json").write_text("{not json")
    cases["bad config json"] = (d, ConfigError, "not valid JSON")
    return cases


@pytest.fixture(scope="module")
def bad_cases(tmp_path_factory, hf_dirs):
    return bad_dirs(tmp_path_factory.mktemp("bad"), hf_dirs["qwen3"])


CASES = ["missing dir", "not a model dir", "unsupported model_type", "no weights", "missing tensor",
         "extra tensor", "tensor beyond the config's layers", "wrong shape", "bad config json",
         "wrong dtype in the header", "shifted data_offsets", "truncated file"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_raises_one_line_error(case, bad_cases):
    path, exc, pattern = bad_cases[case]
    with pytest.raises(exc, match=pattern) as info:
        load_target(path)
    assert "\n" not in str(info.value)


def test_a_header_that_does_not_tile_its_data_is_refused_naming_the_tensor(tmp_path):
    """A file written by the safetensors package, its header then edited: a dtype of another
    width, offsets shifted (one tensor, or all), a gap: each a one-line error naming the file and
    the tensor, before any tensor is read; the unedited file reads."""
    from safetensors.numpy import save_file

    path = tmp_path / "t.safetensors"
    arrays = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.arange(4, dtype=np.int64),
              "c": np.ones((3,), np.float16)}
    save_file(arrays, str(path))
    good = path.read_bytes()
    got = dict(safetensors_io.iter_tensors(path))
    assert all(np.array_equal(got[k], v) for k, v in arrays.items())
    cases = [
        (lambda h: h["a"].update(dtype="F16"), r"tensor a: its data_offsets \[\d+, \d+\] hold 24 bytes, but F16 "
                                               r"\[2, 3\] is 12 bytes"),
        (lambda h: h["b"].update(dtype="I32"), "tensor b: .* hold 32 bytes, but I32 \\[4\\] is 16 bytes"),
        (lambda h: h["c"].update(shape=[2]), "tensor c: .* hold 6 bytes, but F16 \\[2\\] is 4 bytes"),
        (lambda h: [shift(h, k, 8) for k in "abc"], "tensor .* starts at data byte 8, where the tensor before it ends "
                                                   "at 0: it leaves a gap of 8 bytes"),
        (lambda h: shift(h, "c", -2), "tensor c starts at data byte .*: it overlaps the tensor before it"),
        (lambda h: h["a"].update(data_offsets=[0, -24]), "tensor a has bad data_offsets"),
        (lambda h: h["b"].update(dtype="Q4"), "tensor b has unsupported dtype Q4"),
    ]
    for edit, message in cases:
        path.write_bytes(good)
        edit_header(path, edit)
        with pytest.raises(CheckpointError, match=message) as err:
            list(safetensors_io.iter_lazy_tensors(path))
        assert str(err.value).startswith(f"{path}: tensor ") and "\n" not in str(err.value)
    path.write_bytes(good + b"\0" * 8)  # bytes past the last tensor
    with pytest.raises(CheckpointError, match="the tensors end at data byte 62 .*, but the file holds 70 bytes"):
        safetensors_io.read_header(path)


@pytest.mark.parametrize("case", ["missing dir", "unsupported model_type", "wrong shape"])
def test_cli_bad_input_exits_nonzero_with_one_line(case, bad_cases, tmp_path):
    path, _, _ = bad_cases[case]
    proc = subprocess.run(
        [sys.executable, "-m", "dflash_jax.convert", "--hf", str(path), "--out", str(tmp_path / "o"), "--quiet"],
        capture_output=True, text=True,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "o").exists()
