"""Meshes on 8 CPU devices, and a 2-process run on localhost, against one device."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from dflash_jax.sharding import MeshError, parse_mesh
from fixtures import TINY
from train.export import restore_params

pytestmark = pytest.mark.heavy  # subprocesses on 8 CPU devices and on 2 processes: minutes each

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MESHES = ["data=8", "data=2,model=4", "model=8"]


def run_worker(what, devices=8):
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run([sys.executable, str(HERE / "scale_worker.py"), what, *MESHES],
                          capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == devices
    return out


def test_parse_mesh():
    assert parse_mesh("data=2,model=4", 8) == {"data": 2, "model": 4}
    assert parse_mesh(None, 8) == {"data": 8, "model": 1}
    assert parse_mesh("model=4", 8) == {"data": 2, "model": 4}
    assert parse_mesh("model=4,data=-1", 8) == {"data": 2, "model": 4}
    for bad, message in (("data=3,model=1", "needs 3 devices, 8 are present"), ("model=3", "do not divide"), ("rows=2", "unknown mesh axis 'rows'"),
                         ("data=x", "not an integer"), ("data", "is not axis=size")):
        with pytest.raises(MeshError, match=message):
            parse_mesh(bad, 8)


def test_sharded_inference_equals_one_device_on_the_fixture_pair():
    out = run_worker("inference")
    single = out["single"]
    assert single["outputs"] == out["expected"]["outputs"]
    assert single["acceptance"] == out["expected"]["acceptance"]
    for mesh in MESHES:
        assert out[mesh]["outputs"] == single["outputs"], mesh
        assert out[mesh]["acceptance"] == single["acceptance"], mesh
    # A page pool on model=8: the same rows, its pages split by K/V head (the tiny pair's 2 KV
    # heads do not divide 8: replicated), not by row.
    assert out["model=8 pool"]["outputs"] == single["outputs"]
    assert out["model=8 pool"]["acceptance"] == single["acceptance"]
    assert out["model=8 pool"]["pool_spec"] == "P()"
    # The batch's tail narrowed on data=2: widths stay divisible by the data axis (8, 6, 4, 2).
    narrowed = out["data=2,model=4 narrowed"]
    assert narrowed["tail_widths"] == [6, 4, 2] and narrowed["widths_run"][-1] == 8
    assert len(narrowed["widths_run"]) > 1 and set(narrowed["widths_run"]) <= {2, 4, 6, 8}
    assert narrowed["outputs"] == single["outputs"] and narrowed["acceptance"] == single["acceptance"]
    # Parameters really are split over the model axis where there is one.
    assert out["model=8"]["up_proj_spec"] == "P(None, 'model')"


def assert_every_mesh_decodes_alike(out, name):
    """The worker's tokens and acceptance lengths for pair `name` on the model-split meshes equal
    one device's, and some cycle accepted more than one token."""
    single = out[f"{name} single"]
    assert max(a for row in single["acceptance"] for a in row) > 1
    for mesh in ("data=2,model=4", "model=8"):
        assert out[f"{name} {mesh}"]["outputs"] == single["outputs"], (name, mesh)
        assert out[f"{name} {mesh}"]["acceptance"] == single["acceptance"], (name, mesh)


def test_sharded_moe_decoding_equals_one_device():
    """Qwen3-MoE and gpt-oss targets with their drafters: the same tokens and acceptance
    lengths on every mesh, with the experts split over the model axis."""
    out = run_worker("moe")
    for name in ("qwen3_moe-v8", "gpt_oss-v8"):
        assert_every_mesh_decodes_alike(out, name)
        assert out[f"{name} model=8"]["experts_spec"] == "P('model', None, None)"
        assert out[f"{name} data=2,model=4"]["experts_spec"] == "P('model', None, None)"


def test_sharded_hybrid_and_gemma4_decoding_equals_one_device():
    """A Qwen3.5 target (linear-attention states settled per row every cycle) and a Gemma 4
    target (two K/V groups, shared K/V), each with its drafter: the same tokens and acceptance
    lengths on every mesh, the delta-net split by head and Gemma's MLP over `model`."""
    out = run_worker("heterogeneous")
    for name in ("qwen3_5-v8", "gemma4-v8"):
        assert_every_mesh_decodes_alike(out, name)
        assert out[f"{name} model=8"]["kernel_spec"] == "P(None, 'model')"


def test_sharded_training_equals_one_device():
    out = run_worker("training")
    single = out["single"]
    for mesh in MESHES + ["data=2,model=4 fsdp"]:
        np.testing.assert_allclose(out[mesh]["losses"], single["losses"], rtol=1e-5, err_msg=mesh)
        for a, b in zip(out[mesh]["params"], single["params"]):
            np.testing.assert_allclose(a, b, atol=1e-6, err_msg=mesh)
    assert out["model=8"]["up_proj_spec"] == "P(None, 'model')"
    # the Adam moments are split over `data` too (ZeRO-1); the parameters are not
    assert out["data=2,model=4"]["up_proj_spec"] == "P(None, 'model')"
    assert out["data=2,model=4"]["up_proj_moment_spec"] == "P('data', 'model')"
    assert out["data=8"]["up_proj_moment_spec"] == "P('data',)"  # (the model axis, of size 1, is dropped)
    # train.fsdp: the parameters too
    assert out["data=2,model=4 fsdp"]["up_proj_spec"] == "P('data', 'model')"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def train_processes(tmp_path, name, n, devices_each, *overrides, kill_at=None):
    base = [sys.executable, "-m", "train", "--config", str(REPO / "configs/train/tiny.yaml"), "--quiet",
            f"target={TINY / 'target'}", f"train.output_dir={tmp_path / name}", *overrides]
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices_each}",
           "JAX_PLATFORMS": "cpu"}
    if kill_at:
        env["DFLASH_TRAIN_KILL_AT_STEP"] = str(kill_at)
    port = free_port()
    procs = [subprocess.Popen(base + ([f"--coordinator=127.0.0.1:{port}", f"--num-processes={n}", f"--process-id={i}"]
                                      if n > 1 else []),
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(n)]
    results = [p.communicate(timeout=600) for p in procs]
    return [p.returncode for p in procs], [r[1] for r in results]


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mh")
    conv = tmp / "conv.jsonl"
    proc = subprocess.run([sys.executable, "-m", "train.generate_data", "--target", str(TINY / "target"),
                           "--input", str(REPO / "configs/train/tiny_prompts.jsonl"), "--output", str(conv),
                           "--max-new-tokens", "32"], capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    n = len((REPO / "configs/train/tiny_prompts.jsonl").read_text().splitlines())
    # Progress reaches logs, redrawn every few seconds rather than once per row.
    assert "rows: 100%" in proc.stderr and f"{n}/{n}" in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.count("rows:") < n // 4, proc.stderr.count("rows:")
    return conv


# Each stage's processes compile afresh (`init_distributed` turns jax's persistent cache off on CPU): with a
# cache warmed by the earlier stages, process 0 loaded programs that process 1 compiled and the resumed run
# aborted on a gloo "collective mismatch" before its own SIGKILL.
def test_two_processes_train_like_one_and_resume(conversations, tmp_path):
    common = [f"data.conversations={conversations}", "data.generate_from=null", "train.steps=6", "train.save_every=3",
              "train.log_every=1", "data.eval_holdout=8", "train.eval_every=1000", "train.eval_batch_size=4"]
    codes, errs = train_processes(tmp_path, "one", 1, 4, *common)
    assert codes == [0], errs[0][-2000:]
    codes, errs = train_processes(tmp_path, "two", 2, 2, *common)
    assert codes == [0, 0], errs[0][-2000:] + errs[1][-2000:]
    one = [json.loads(l) for l in (tmp_path / "one/metrics.jsonl").read_text().splitlines()]
    two = [json.loads(l) for l in (tmp_path / "two/metrics.jsonl").read_text().splitlines()]
    strip = lambda ms: [{k: v for k, v in m.items() if k != "tokens_per_second"} for m in ms]
    losses = lambda ms: [m["loss"] for m in ms if "loss" in m]
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)
    assert [m.get("eval_tau") for m in two] == [m.get("eval_tau") for m in one]  # real decoding on 4 devices of 2 hosts
    a, _ = restore_params(tmp_path / "one")
    b, _ = restore_params(tmp_path / "two")
    jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-6), a, b)

    # Killed (SIGKILL, both processes) after step 4, resumed from the step-3 checkpoint.
    codes, errs = train_processes(tmp_path, "resumed", 2, 2, *common, kill_at=4)
    assert codes == [-9, -9] or -9 in codes, (codes, errs[0][-1500:], errs[1][-1500:])
    codes, errs = train_processes(tmp_path, "resumed", 2, 2, *common)
    assert codes == [0, 0] and "resumed from step 3" in errs[0], errs[0][-2000:]
    c, step = restore_params(tmp_path / "resumed")
    assert step == 6
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), b, c)
    assert strip(two) == strip([json.loads(l) for l in (tmp_path / "resumed/metrics.jsonl").read_text().splitlines()])
