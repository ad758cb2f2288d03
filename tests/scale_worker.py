"""Run in a subprocess with XLA_FLAGS=--xla_force_host_platform_device_count=N (the
device count must be fixed before jax is imported). Prints one JSON object."""

import json
import sys
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))  # the repository: the benchmarks (bench/) are not installed


def record_widths(gen) -> list[int]:
    """The slots of each run_cycles call the generator makes from now on."""
    widths, run = [], gen.run_cycles

    def recording(state, *args, **kwargs):
        widths.append(int(state.done.shape[0]))
        return run(state, *args, **kwargs)

    gen.run_cycles = recording
    return widths


def inference(meshes):
    from dflash_jax import load_drafter, load_target
    from dflash_jax.sharding import make_mesh
    from dflash_jax.engine import BatchEngine
    from fixtures import tiny

    case = json.loads((tiny() / "greedy_cases.json").read_text())
    prompts = case["prompts"]
    out = {}
    for spec in [None] + meshes:
        mesh = make_mesh(spec) if spec else None
        tc, tp = load_target(tiny() / "target", mesh=mesh)  # sharded loading straight onto the mesh
        dc, dp = load_drafter(tiny() / "drafter", mesh=mesh)
        gen = BatchEngine(tc, tp, dc, dp, batch_size=8, max_new_tokens=40, max_prompt_len=32, mesh=mesh, speculation="fixed")
        res = sorted(gen.generate(prompts), key=lambda r: r.index)
        kernel = gen.tparams["model"]["layers_0"]["mlp"]["up_proj"]["kernel"]
        out[spec or "single"] = {
            "outputs": [p + r.output_ids for p, r in zip(prompts, res)],
            "acceptance": [r.acceptance_lengths for r in res],
            "up_proj_spec": str(kernel.sharding.spec) if mesh else None,
            "devices": len(kernel.sharding.device_set),
        }
        if spec == "data=2,model=4":  # the tail narrowed: 8 slots, then 6, 4, 2 (rows split over data=2)
            gen = BatchEngine(tc, tp, dc, dp, batch_size=8, max_new_tokens=40, max_prompt_len=32, mesh=mesh,
                            narrow_tail=True, sync_every=2, speculation="fixed")
            widths = record_widths(gen)
            res = sorted(gen.generate(prompts), key=lambda r: r.index)
            out["data=2,model=4 narrowed"] = {"outputs": [p + r.output_ids for p, r in zip(prompts, res)],
                                              "acceptance": [r.acceptance_lengths for r in res],
                                              "tail_widths": gen.tail_widths, "widths_run": sorted(set(widths))}
        if spec == "model=8":  # a page pool, on a mesh that splits the model (a pool needs data=1)
            gen = BatchEngine(tc, tp, dc, dp, batch_size=8, max_new_tokens=40, max_prompt_len=32, mesh=mesh,
                            kv_pages=30, page_size=16, speculation="fixed")
            res = sorted(gen.generate(prompts), key=lambda r: r.index)
            out["model=8 pool"] = {"outputs": [p + r.output_ids for p, r in zip(prompts, res)],
                                   "acceptance": [r.acceptance_lengths for r in res],
                                   "pool_spec": str(gen.new_state().target_cache.k.sharding.spec)}
    out["expected"] = {"outputs": case["outputs"], "acceptance": case["acceptance_lengths"]}
    return out


def training(meshes):

    from dflash_jax.config import ModelConfig
    from dflash_jax.drafter import DrafterConfig, init_drafter_params
    from dflash_jax.model import init_params
    from dflash_jax.sharding import global_batch, make_mesh, param_shardings
    from dflash_jax.training import LossSpec, init_train_state, make_optimizer, state_shardings, train_step

    # A step whose Adam moments are split over `data` (each updated parameter all-gathered), loaded
    # from jax's persistent compilation cache (the tests keep one), deadlocks the CPU backend's
    # collectives: devices wait at different all-gathers. Compiled afresh it runs, every time.
    jax.config.update("jax_enable_compilation_cache", False)
    target = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                         num_attention_heads=8, num_key_value_heads=4, head_dim=8, qk_norm=True)
    drafter = DrafterConfig(model=target.replace(num_hidden_layers=2, sliding_windows=(None, None)), block_size=4,
                            mask_token_id=63, target_layer_ids=(0, 2), num_target_layers=3)
    tparams = init_params(target, jax.random.PRNGKey(0))
    dparams = init_drafter_params(drafter, jax.random.PRNGKey(1))
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 63, (8, 32)).astype(np.int32)
    mask = (np.arange(32)[None] >= 8).astype(np.int32).repeat(8, 0)
    out = {}
    for spec_text in [None] + meshes + ["data=2,model=4 fsdp"]:
        fsdp = bool(spec_text) and spec_text.endswith(" fsdp")
        mesh = make_mesh(spec_text.split()[0]) if spec_text else None
        spec = LossSpec(target=target, drafter=drafter, num_anchors=6, gamma=4.0, ce_chunk=32, mesh=mesh, fsdp=fsdp)
        tx, _ = make_optimizer(1e-3, 10)
        state = init_train_state(dparams, tx)
        if mesh is not None:
            state = jax.device_put(state, state_shardings(state, mesh, fsdp=fsdp))
        # from the host, as load_target places them (a device-to-device reshard of many arrays can
        # deadlock the CPU backend's collectives on 8 devices over 2 cores)
        tp = tparams if mesh is None else jax.device_put(
            jax.device_get(tparams), param_shardings(jax.eval_shape(lambda: tparams), mesh, over_data=fsdp))
        losses = []
        for _ in range(3):
            state, m = train_step(state, tp, global_batch(tokens, mesh), global_batch(mask, mesh),
                                  jax.random.PRNGKey(0), spec=spec, tx=tx)
            losses.append(float(m["loss"]))
        flat = [np.asarray(x).ravel().tolist() for x in jax.tree.leaves(state.params)]
        kernel = state.params["layers_0"]["mlp"]["up_proj"]["kernel"]
        moment = state.opt_state[1][0].mu["layers_0"]["mlp"]["up_proj"]["kernel"]  # (clip, (adam, ...))
        out[spec_text or "single"] = {"losses": losses, "params": flat,
                                      "up_proj_spec": str(kernel.sharding.spec) if mesh else None,
                                      "up_proj_moment_spec": str(moment.sharding.spec) if mesh else None}
    return out


def moe(meshes):
    """Qwen3-MoE and gpt-oss pairs (8 experts) decode the same on every mesh: experts split
    over `model`, rows over `data`."""
    import dataclasses

    from dflash_jax.engine import BatchEngine
    from dflash_jax.sharding import make_mesh, shard_params
    from fixtures import SETUPS, prompts, setup

    meshes = [m for m in meshes if "model" in m]  # rows alone (data=8) are the fixture pair's test
    out = {}
    for name in ("qwen3_moe-v8", "gpt_oss-v8"):
        target, tparams, drafter, dparams = setup(name)
        target = target.replace(moe=dataclasses.replace(target.moe, num_experts=8))
        from dflash_jax.model import init_params
        from fixtures import perturbed

        tparams = perturbed(init_params(target, jax.random.PRNGKey(SETUPS[name][5])))
        for spec in [None] + meshes:
            mesh = make_mesh(spec) if spec else None
            gen = BatchEngine(target, shard_params(tparams, mesh), drafter, shard_params(dparams, mesh), block_size=4,
                            batch_size=8, max_new_tokens=16, max_prompt_len=40, mesh=mesh, speculation="fixed")
            res = sorted(gen.generate(list(prompts(name))), key=lambda r: r.index)
            experts = gen.tparams["model"]["layers_0"]["mlp"]["experts"]
            weight = experts.get("gate_proj", experts.get("gate_up_proj"))
            out[f"{name} {spec or 'single'}"] = {
                "outputs": [r.output_ids for r in res], "acceptance": [r.acceptance_lengths for r in res],
                "experts_spec": str(weight.sharding.spec) if mesh else None,
            }
    return out


def heterogeneous(meshes):
    """A Qwen3.5 pair (8 attention and 8 value heads; the gated delta-net projections and
    recurrent states split over `model` by head) and a Gemma 4 pair (sliding and global layers
    in two K/V groups, shared K/V, experts split over `model`) decode the same on every mesh."""
    import dataclasses

    from dflash_jax.engine import BatchEngine
    from dflash_jax.model import init_params
    from dflash_jax.sharding import make_mesh, shard_params
    from fixtures import perturbed, prompts, setup

    meshes = [m for m in meshes if "model" in m]
    out = {}
    for name in ("qwen3_5-v8", "gemma4-v8"):
        target, tparams, drafter, dparams = setup(name)
        if name.startswith("qwen3_5"):
            target = target.replace(num_attention_heads=8, num_key_value_heads=4, linear_attention=dataclasses.replace(
                target.linear_attention, k_heads=4, v_heads=8))
            tparams = perturbed(init_params(target, jax.random.PRNGKey(13)))
        for spec in [None] + meshes:
            mesh = make_mesh(spec) if spec else None
            gen = BatchEngine(target, shard_params(tparams, mesh), drafter, shard_params(dparams, mesh), block_size=4,
                            batch_size=8, max_new_tokens=16, max_prompt_len=40, mesh=mesh, speculation="fixed")
            res = sorted(gen.generate(list(prompts(name))), key=lambda r: r.index)
            layer = gen.tparams["model"]["layers_0"]
            kernel = (layer["linear_attn"]["in_proj_z"] if "linear_attn" in layer else layer["mlp"]["up_proj"])["kernel"]
            out[f"{name} {spec or 'single'}"] = {
                "outputs": [r.output_ids for r in res], "acceptance": [r.acceptance_lengths for r in res],
                "kernel_spec": str(kernel.sharding.spec) if mesh else None,
            }
    return out


if __name__ == "__main__":
    what, meshes = sys.argv[1], sys.argv[2:]
    print(json.dumps({"devices": jax.device_count(), **{"inference": inference, "training": training, "moe": moe, "heterogeneous": heterogeneous}[what](meshes)}))
