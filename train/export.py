"""`python -m train.export --run DIR --out DIR`: a trained drafter -> the z-lab HF format.

Writes `config.json` (architectures DFlashDraftModel, block_size, dflash_config with
mask_token_id and target_layer_ids) and `model.safetensors` (names without a `model.`
prefix), the format that `python -m infer --drafter`, vLLM and SGLang load. A DFlash2 run's
drafter (`drafter.dflash2`) is written in the DFlash2 format: architectures DFlash2DraftModel,
is_causal false, dflash_config with the DFlash2Config keys too (conv_kernel_size, conv_group_size,
selector_rank, selector_top_k, output_multiplier, final_logit_softcapping, input_embedding_scale),
and each layer's `attention_conv` / `mlp_conv` and the `candidate_selector` tensors, as vLLM's
`qwen3_dflash2` loads them. Written to a temporary directory and renamed at the end; refuses to
overwrite without --force.

A drafter that taps the target's last layer is refused unless --allow-last-layer-tap: vLLM and
SGLang read that tap before the target's final norm where training read it after, so they would
serve it below its strength without a word (dflash_jax.drafter.last_layer_tap_warning). Exporting
is for those engines, so the silent loss is the one to stop; `python -m infer` reads the run's
drafter either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from dflash_jax.checkpoint import DRAFTER_TABLE, save_hf_params
from dflash_jax.drafter import last_layer_tap_warning
from dflash_jax.errors import CheckpointError, DFlashError


def restore_params(run_dir: Path, step: int | None = None):
    """Drafter parameters (float32) of a training run's checkpoint (latest, or `step`)."""
    import orbax.checkpoint as ocp

    ckpt_dir = (run_dir / "checkpoints").absolute()
    if not ckpt_dir.is_dir():
        raise CheckpointError(f"{run_dir} is not a training run (no checkpoints/)")
    mngr = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(create=False),
                                 item_handlers={"state": ocp.StandardCheckpointHandler(),
                                                "data": ocp.JsonCheckpointHandler()})
    try:
        steps = mngr.all_steps()
        if not steps:
            raise CheckpointError(f"{ckpt_dir} holds no checkpoint")
        step = max(steps) if step is None else step
        if step not in steps:
            raise CheckpointError(f"no checkpoint of step {step} in {ckpt_dir} (have {sorted(steps)})")
        # Onto this process's first device, whatever mesh the run was saved from.
        import jax

        device = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        meta = mngr.item_metadata(step)["state"]
        abstract = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device), meta)
        state = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract)))["state"]
    finally:
        mngr.close()
    return state["params"], step


def export(run_dir: str | Path, out: str | Path, *, step: int | None = None, dtype: str = "bfloat16",
           force: bool = False, allow_last_layer_tap: bool = False, warn=None) -> Path:
    import ml_dtypes
    import numpy as np

    run_dir, out = Path(run_dir), Path(out)
    config_path = run_dir / "drafter_config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{run_dir} is not a training run (no drafter_config.json)")
    if out.exists() and not force:
        raise CheckpointError(f"{out} already exists; pass --force to overwrite it")
    config = json.loads(config_path.read_text())
    taps = (config.get("dflash_config") or {}).get("target_layer_ids") or ()
    tap_warning = last_layer_tap_warning(int(config.get("num_target_layers", -1)), taps)
    if tap_warning and not allow_last_layer_tap:
        raise CheckpointError(f"{tap_warning}; pass --allow-last-layer-tap to export it anyway")
    if tap_warning and warn is not None:
        warn(f"warning: {tap_warning}")
    params, step = restore_params(run_dir, step)
    config["dtype"] = dtype
    config["torch_dtype"] = dtype
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        np_dtype = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        save_hf_params(params, tmp / "model.safetensors", table=DRAFTER_TABLE, dtype=np_dtype)
        (tmp / "dflash_training.json").write_text(json.dumps({"run": str(run_dir), "step": step}) + "\n")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.export", description=(
        __doc__.splitlines()[0] + " (DFlashDraftModel, or DFlash2DraftModel for a run with drafter.dflash2)"))
    p.add_argument("--run", required=True, metavar="DIR", help="training output_dir")
    p.add_argument("--out", required=True, metavar="DIR", help="HF drafter directory to write")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--allow-last-layer-tap", action="store_true",
                   help="export a drafter that taps the target's last layer (vLLM and SGLang serve it below its "
                        "strength: they read that tap before the final norm)")
    args = p.parse_args(argv)
    try:
        out = export(args.run, args.out, step=args.step, dtype=args.dtype, force=args.force,
                     allow_last_layer_tap=args.allow_last_layer_tap, warn=lambda m: print(m, file=sys.stderr))
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
