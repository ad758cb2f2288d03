"""Loading straight onto a mesh: no device ever holds more than its own shard of the model plus
one tensor, and `python -m infer` / `python -m train` load that way.

The checks run in one subprocess on 8 CPU devices (the device count must be fixed before jax is
imported); run as a script, this file is that subprocess. Peak bytes per device are measured from
`jax.live_arrays()` (the CPU client has no `memory_stats`): after every placement the loader makes
(`jax.device_put`, `jax.make_array_from_callback`, `jax.make_array_from_single_device_arrays`), after
every cast of a jax array and before every tensor it reads, each live buffer is counted once on the
device that holds it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MESHES = ("data=2,model=4", "model=8")
OLD_WAY_MESH = MESHES[0]  # where the old way (load onto one device, then shard) is measured too
DEVICES = 8


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """Tiny random HF targets (a dense Qwen3 in float32, a Qwen3-MoE of 8 experts in bfloat16,
    one HF tensor per expert), built offline, and the worker's figures on both meshes."""
    import torch

    from fixtures import tiny
    from tiny import make_model, save_model

    work = tmp_path_factory.mktemp("mesh_loading")
    save_model(make_model("qwen3"), work / "qwen3")
    save_model(make_model("qwen3_moe", num_experts=8), work / "qwen3_moe", dtype=torch.bfloat16)
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}"}
    proc = subprocess.run([sys.executable, __file__, str(work), str(tiny())], capture_output=True, text=True,
                          env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["devices"] == DEVICES
    return out


CASES = ("qwen3 hf", "qwen3_moe hf", "qwen3 converted->bfloat16")


@pytest.mark.parametrize("case", CASES)
def test_each_device_holds_at_most_its_shard_plus_one_tensor(measured, case):
    """While loading with a mesh, no device ever holds more than its final shard plus the largest
    parameter; the old way (load onto one device, then shard) puts the whole model on device 0,
    and the same bound catches it."""
    for mesh in MESHES:
        m = measured["load"][f"{case} {mesh}"]
        bound = [f + m["largest"] for f in m["final"]]
        assert all(p <= b for p, b in zip(m["peak"], bound)), (mesh, m)
        # What each device ends with is its share of the model: less than the whole on every device.
        assert max(m["final"]) < m["model"], (mesh, m)
        if mesh == OLD_WAY_MESH:
            # The bound can fail: loading onto one device and then sharding breaks it on device 0
            # (which held the whole model), with the same shards in the end.
            assert m["old_final"] == m["final"], m
            assert m["old_peak"][0] > bound[0] and m["old_peak"][0] >= m["model"], m


@pytest.mark.parametrize("case", CASES)
def test_mesh_loading_gives_the_one_device_values_in_their_shardings(measured, case):
    for mesh in MESHES:
        m = measured["load"][f"{case} {mesh}"]
        assert m["equal"] and m["shardings"] == "param_shardings", (mesh, m)
        assert m["split"] > 0, (mesh, m)  # some parameters really are split over `model`


def test_infer_loads_the_pair_onto_the_mesh(measured):
    """`python -m infer --mesh data=2,model=4` on 8 devices calls the loaders with the mesh, never
    holds more than each device's shard plus a tensor, hands the loaded arrays to the engine as
    they are (its own shard_params re-puts nothing), and decodes the reference's tokens (which a
    one-device run reproduces: test_infer_cli)."""
    m = measured["infer"]
    assert m["code"] == 0
    bound = [f + m["largest"] for f in m["final"]]
    assert all(p <= b for p, b in zip(m["peak"], bound)), {k: m[k] for k in ("peak", "final", "largest", "calls")}
    assert max(m["final"]) < m["model"], m
    assert [c["kind"] for c in m["calls"]] == ["target", "drafter"]
    assert all(c["mesh"] == {"data": 2, "model": 4} and c["sharded"] for c in m["calls"]), m["calls"]
    assert m["engine_got_the_loaded_arrays"] is True
    cases = m["expected"]
    for r in m["records"]:
        i = int(r["id"].split("-")[1])
        assert cases["prompts"][i] + r["output_ids"] == cases["outputs"][i], r["id"]
        assert r["acceptance_lengths"] == cases["acceptance_lengths"][i], r["id"]
    assert len(m["records"]) == 1


def test_train_regenerates_then_loads_target_and_drafter_onto_the_mesh(measured):
    """`python -m train` with train.mesh=data=2,model=4: data regeneration gets the run's mesh and
    runs before the target is loaded (the target is never held twice); target and drafter load
    with the mesh, in their shardings."""
    m = measured["train"]
    assert m["generate_mesh"] == "data=2,model=4"
    assert [c["kind"] for c in m["calls"]] == ["generate", "target", "drafter"]
    assert all(c["mesh"] == {"data": 2, "model": 4} and c["sharded"] for c in m["calls"][1:]), m["calls"]


# ----------------------------------------------------------------------------- the worker


class Probe:
    """Peak bytes per device of live jax arrays while `on`, above what was live when it started."""

    def __init__(self):
        import jax

        self.jax, self.on, self.base, self.peak = jax, False, {}, {}

    def now(self) -> dict[int, int]:
        seen, per_device = set(), {d.id: 0 for d in self.jax.devices()}
        for a in self.jax.live_arrays():
            if a.is_deleted():
                continue
            for shard in a.addressable_shards:
                data = shard.data
                key = (shard.device.id, data.unsafe_buffer_pointer())  # aliases (orbax's pieces) count once
                if key not in seen:
                    seen.add(key)
                    per_device[shard.device.id] += data.nbytes
        return per_device

    def __call__(self):
        if self.on:
            for d, n in self.now().items():
                self.peak[d] = max(self.peak[d], n - self.base[d])

    def start(self):
        import gc

        gc.collect()
        self.base = self.now()
        self.peak = {d: 0 for d in self.base}
        self.on = True

    def stop(self) -> tuple[list[int], list[int]]:
        """(peak, now) per device, above the start."""
        self()
        self.on = False
        now = self.now()
        return [self.peak[d] for d in sorted(now)], [now[d] - self.base[d] for d in sorted(now)]

    def install(self):
        """Probe after every placement, every cast of a jax array and before every tensor the HF
        loader reads."""
        from dflash_jax import checkpoint

        jax = self.jax
        for name in ("device_put", "make_array_from_callback", "make_array_from_single_device_arrays"):
            original = getattr(jax, name)

            def placed(*a, _original=original, _name=name, **kw):
                out = _original(*a, **kw)
                # Not after orbax's puts of single shards, hundreds of them: after it assembles each array.
                to = getattr(a[1] if len(a) > 1 else kw.get("device"), "sharding", None) if _name == "device_put" else None
                if not (isinstance(to, jax.sharding.Sharding) and len(to.device_set) == 1):
                    self()
                return out

            setattr(jax, name, placed)
        array_type = type(jax.numpy.zeros(()))
        astype = array_type.astype

        def cast(*a, **kw):  # a cast after placing makes a second copy of what it casts
            out = astype(*a, **kw)
            self()
            return out

        array_type.astype = cast
        tensors = checkpoint.iter_hf_tensors

        def iter_hf_tensors(*a, **kw):
            for item in tensors(*a, **kw):
                self()
                yield item
            self()

        checkpoint.iter_hf_tensors = iter_hf_tensors


def _nbytes(tree) -> tuple[int, int]:
    """(whole model, largest parameter) in bytes."""
    import jax

    sizes = [x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)]
    return sum(sizes), max(sizes)


def _in_param_shardings(params, mesh) -> bool:
    import jax

    from dflash_jax.sharding import param_shardings

    want = param_shardings(jax.eval_shape(lambda: params), mesh)
    return all(x.sharding == s for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(want)))


def worker_load(probe, work: Path) -> dict:
    import jax
    import numpy as np

    from dflash_jax.checkpoint import convert, load_target
    from dflash_jax.sharding import make_mesh, shard_params

    convert(work / "qwen3", work / "qwen3-converted")  # float32, restored as bfloat16 below
    cases = {"qwen3 hf": (work / "qwen3", None), "qwen3_moe hf": (work / "qwen3_moe", None),
             "qwen3 converted->bfloat16": (work / "qwen3-converted", "bfloat16")}
    out = {}
    for case, (path, dtype) in cases.items():
        reference = jax.tree.map(np.asarray, load_target(path, dtype=dtype)[1])  # one device, then host
        model, largest = _nbytes(reference)
        for spec in MESHES:
            mesh = make_mesh(spec)
            probe.start()
            params = load_target(path, dtype=dtype, mesh=mesh)[1]
            peak, final = probe.stop()
            equal = all(x.dtype == y.dtype and np.array_equal(np.asarray(x), y)
                        for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(reference)))
            sharded = _in_param_shardings(params, mesh)
            split = sum("model" in str(x.sharding.spec) for x in jax.tree.leaves(params))
            del params
            out[f"{case} {spec}"] = dict(peak=peak, final=final, largest=largest, model=model, equal=equal,
                                         split=split, shardings="param_shardings" if sharded else "other")
            if spec == OLD_WAY_MESH:  # the old way: everything onto one device, then shard it
                probe.start()
                params = shard_params(load_target(path, dtype=dtype)[1], mesh)
                out[f"{case} {spec}"]["old_peak"], out[f"{case} {spec}"]["old_final"] = probe.stop()
                del params
    return out


def worker_infer(probe, work: Path, fixture: Path) -> dict:
    import jax

    from dflash_jax import checkpoint
    from dflash_jax.engine import BatchEngine
    from infer.cli import main

    calls, sizes, seen = [], [], {}
    load_model = checkpoint.load_model

    def recording_load_model(path, kind, **kw):
        config, params = load_model(path, kind, **kw)
        mesh = kw.get("mesh")
        calls.append({"kind": kind, "mesh": dict(mesh.shape) if mesh is not None else None,
                      "sharded": mesh is not None and _in_param_shardings(params, mesh)})
        sizes.append(_nbytes(params))  # sizes only: a reference would keep the arrays alive
        return config, params

    init = BatchEngine.__init__

    def recording_init(self, target_config, target_params, drafter_config=None, drafter_params=None, *args, **kw):
        init(self, target_config, target_params, drafter_config, drafter_params, *args, **kw)
        if probe.on:  # the first engine: loading is over
            seen["peak"], seen["final"] = probe.stop()
        pairs = list(zip(jax.tree.leaves(self.tparams), jax.tree.leaves(target_params)))
        if self.dparams is not None:
            pairs += list(zip(jax.tree.leaves(self.dparams), jax.tree.leaves(drafter_params)))
        seen["same"] = seen.get("same", True) and all(a is b for a, b in pairs)

    checkpoint.load_model = recording_load_model
    BatchEngine.__init__ = recording_init
    # One of the reference's prompts in a batch of two (one row per `data` index): compiling the engine
    # for the mesh is most of this test's time, and one prompt needs the fewest programs.
    prompts, out = work / "prompts.jsonl", work / "infer.jsonl"
    prompts.write_text((fixture / "prompts.jsonl").read_text().splitlines(True)[0])
    probe.start()
    try:
        code = main(["--target", str(fixture / "target"), "--drafter", str(fixture / "drafter"),
                     "--input", str(prompts), "--max-new-tokens", "40", "--speculation", "fixed",  # the reference's
                     "--mesh", "data=2,model=4", "--batch-size", "2", "--output", str(out), "--quiet"])
    finally:
        checkpoint.load_model, BatchEngine.__init__ = load_model, init
    records = [json.loads(line) for line in out.read_text().splitlines()] if out.is_file() else []
    return dict(code=code, calls=calls, engine_got_the_loaded_arrays=seen.get("same"), peak=seen.get("peak"),
                final=seen.get("final"), model=sum(s[0] for s in sizes), largest=max(s[1] for s in sizes),
                records=records, expected=json.loads((fixture / "greedy_cases.json").read_text()))


class _Stop(Exception):
    pass


def worker_train(work: Path, fixture: Path) -> dict:
    """train() as far as the drafter's loading: the data regeneration recorded, not run."""
    from dflash_jax import checkpoint, generation
    from train.config import load_config
    from train.trainer import train

    conversations = work / "conversations.jsonl"
    conversations.write_text("".join(json.dumps({"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6]}) + "\n"
                                     for _ in range(8)))
    calls, got = [], {}
    load_model, run_job = checkpoint.load_model, generation.run_job

    def recording_load_model(path, kind, **kw):
        config, params = load_model(path, kind, **kw)
        mesh = kw.get("mesh")
        calls.append({"kind": kind, "mesh": dict(mesh.shape) if mesh is not None else None,
                      "sharded": mesh is not None and _in_param_shardings(params, mesh)})
        if kind == "drafter":
            raise _Stop
        return config, params

    def recording_job(job, make_record=None, **kw):
        calls.append({"kind": "generate"})
        got["generate_mesh"] = job.options.mesh
        return generation.GenerationResult(None)

    checkpoint.load_model, generation.run_job = recording_load_model, recording_job
    cfg = load_config(REPO / "configs/train/tiny.yaml", [
        f"target={fixture / 'target'}", f"drafter.init={fixture / 'drafter'}", f"train.output_dir={work / 'run'}",
        f"data.conversations={conversations}", f"data.generate_from={work / 'generate_from.jsonl'}",
        "data.eval_holdout=0", "train.mesh=data=2,model=4"])
    try:
        train(cfg, progress=False)
    except _Stop:
        pass
    finally:
        checkpoint.load_model, generation.run_job = load_model, run_job
    return {"calls": calls, **got}


def worker(work: Path, fixture: Path) -> dict:
    import jax

    sys.path.insert(0, str(REPO))
    probe = Probe()
    probe.install()
    return {"devices": jax.device_count(), "load": worker_load(probe, work),
            "infer": worker_infer(probe, work, fixture), "train": worker_train(work, fixture)}


if __name__ == "__main__":
    print(json.dumps(worker(Path(sys.argv[1]), Path(sys.argv[2]))))
