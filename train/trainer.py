"""The training loop, top to bottom: load the frozen target, (re)generate data, build the
drafter, then steps with logging, evaluation by real speculative decoding, and atomic
orbax checkpoints that resume bit-identically."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from dflash_jax.checkpoint import load_drafter
from dflash_jax.errors import CheckpointError
from dflash_jax.data import conversation_tokens, make_dataset, read_jsonl
from dflash_jax.drafter import (DrafterConfig, check_pair, retap,
                                init_drafter_params)
from dflash_jax.pair import engine_mesh, open_pair
from dflash_jax.sharding import global_batch, shard_params
from dflash_jax.engine import GenerationStats, BatchEngine
from dflash_jax.training import (LossSpec, TrainState, default_gamma, init_train_state, make_optimizer,
                                 state_shardings, train_step, upgrade_to_dflash2)
from train.config import TrainConfigError, new_drafter_config, with_dflash2
from train.verdict import verdict

CHECKPOINTS = "checkpoints"
DRAFTER_CONFIG = "drafter_config.json"  # z-lab config of the drafter being trained
METRICS = "metrics.jsonl"
# Testing hook: kill this process (SIGKILL, no cleanup) right after that step, once the
# checkpoint writes already begun have finished.
FAIL_AT_STEP = int(os.environ.get("DFLASH_TRAIN_KILL_AT_STEP", "0") or 0)


# --------------------------------------------------------------------------- setup


def log(*a):
    if jax.process_index() == 0:
        print(*a, file=sys.stderr, flush=True)


def ensure_data(cfg: dict, tokenizer_dir: Path):
    """Regenerate responses with the target when `data.generate_from` is set (resumable)."""
    d = cfg["data"]
    if not d["generate_from"]:
        return
    from dflash_jax.generation import GenerationJob, run_job
    from train.generate_data import conversation_record

    job = GenerationJob.of(target=cfg["target"], input=d["generate_from"], output=d["conversations"],
                        max_new_tokens=d["generate_max_new_tokens"], batch_size=d["generate_batch_size"],
                        dtype=cfg["target_dtype"] or None, quiet=True,
                        # the run's mesh, so the target loads split as it will train
                        mesh=str(cfg["train"]["mesh"]) if cfg["train"]["mesh"] else None)
    log(f"regenerating responses with the target: {d['generate_from']} -> {d['conversations']}")
    run_job(job, make_record=conversation_record)


def eval_prompts(records, tokenizer, thinking: bool) -> list[list[int]]:
    prompts = []
    for r in records:
        if "prompt_ids" in r:
            prompts.append(list(r["prompt_ids"]))
        else:
            ids, mask = conversation_tokens(r, tokenizer, thinking=thinking)
            first = mask.index(1) if 1 in mask else len(ids)
            prompts.append(ids[:first])
    return [p for p in prompts if p]


@contextlib.contextmanager
def quiet_orbax():
    """Orbax's log lines off (absl's logger): what it cannot read of a damaged checkpoint, it logs
    as it lists the steps, then raises when one is restored; `resume` says it once, in one line."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        absl.setLevel(level)


def checkpoint_manager(out: Path, cfg: dict):
    import orbax.checkpoint as ocp

    t = cfg["train"]
    options = ocp.CheckpointManagerOptions(max_to_keep=t["keep"], create=True)
    with quiet_orbax():
        return ocp.CheckpointManager((out / CHECKPOINTS).absolute(), options=options,
                                     item_names=("state", "data"))


def save(mngr, step: int, state: TrainState, data_state: dict):
    import orbax.checkpoint as ocp

    mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                            data=ocp.args.JsonSave(data_state)), force=True)


def restore(mngr, step: int, abstract_state):
    import orbax.checkpoint as ocp

    got = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state),
                                                     data=ocp.args.JsonRestore()))
    return got["state"], got["data"]


def trim_metrics(path: Path, upto_step: int):
    """After a resume, drop metric lines of steps that will run again."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= upto_step:
                keep.append(line)
        except json.JSONDecodeError:
            pass
    path.write_text("".join(l + "\n" for l in keep))


def restore_failure(e: Exception) -> str:
    """What went wrong restoring a checkpoint, in one short line (orbax and TensorStore raise
    many kinds, some with pages of detail)."""
    text = (str(e).strip().splitlines() or [""])[0].split(" See full TensorStore details")[0]
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def set_aside(ckpt_dir: Path, step: int) -> Path:
    """Move a damaged checkpoint out of the manager's directory (so the step can be saved again),
    into CHECKPOINTS-damaged/ beside it: kept for a look, never restored. Its new path."""
    damaged = ckpt_dir.with_name(ckpt_dir.name + "-damaged")
    damaged.mkdir(exist_ok=True)
    dest, n = damaged / str(step), 1
    while dest.exists():
        dest, n = damaged / f"{step}.{n}", n + 1
    os.rename(ckpt_dir / str(step), dest)
    return dest


def resume(mngr, state: TrainState, data_iter, out: Path) -> tuple[int, TrainState]:
    """(step, state) to start from: the latest checkpoint's, its data position restored into
    data_iter (and metric lines of later steps dropped), else (0, state).

    A checkpoint that cannot be restored (damaged: files truncated or garbled) is moved to
    CHECKPOINTS-damaged/ with a one-line warning naming it and the step resumed from instead, the
    latest one that restores; when none does, a one-line CheckpointError naming the latest."""
    steps = sorted(mngr.all_steps(), reverse=True)
    if not steps:
        return 0, state
    # Restored straight into the layout (and onto the devices) each array will live on.
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state)
    ckpt_dir = out / CHECKPOINTS
    damaged = []
    with quiet_orbax():
        for step in steps:
            try:
                restored, data_state = restore(mngr, step, abstract)
                data_iter.set_state(data_state)
            except Exception as e:  # noqa: BLE001 (whatever a damaged checkpoint raises: try the one before)
                damaged.append((step, restore_failure(e)))
                continue
            state, start = restored, step
            break
    if len(damaged) == len(steps):
        step, why = damaged[0]
        earlier = f", nor can the {len(steps) - 1} before it" if len(steps) > 1 else ", and there is no earlier one"
        raise CheckpointError(f"cannot resume: checkpoint {ckpt_dir / str(step)} cannot be restored ({why}){earlier}; "
                              f"move {ckpt_dir} away to train from the start")
    if damaged:
        if jax.process_index() == 0:
            for step, why in damaged:
                moved = set_aside(ckpt_dir, step)
                log(f"warning: checkpoint step {step} cannot be restored ({why}): resuming from step {start} "
                    f"instead; the damaged one is moved to {moved}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("damaged checkpoints set aside")
        mngr.reload()
    if jax.process_index() == 0:
        trim_metrics(out / METRICS, start)
    log(f"resumed from step {start} ({out / CHECKPOINTS})")
    return start, state


# --------------------------------------------------------------------------- evaluation


class TauEvaluator:
    """Real speculative decoding on held-out prompts with the current drafter weights."""

    def __init__(self, tcfg, tparams, dcfg: DrafterConfig, prompts, max_new: int, batch: int, mesh=None):
        self.dcfg = dcfg.with_dtype(tcfg.dtype)
        self.prompts = prompts
        self.tcfg, self.tparams = tcfg, tparams
        self.max_new, self.batch, self.mesh = max_new, batch, mesh
        self.gen = None

    def __call__(self, params) -> dict:
        cast = jax.tree.map(lambda p: p.astype(jnp.dtype(self.tcfg.dtype)), params)
        if self.gen is None:  # one BatchEngine: later evaluations reuse its compilation
            self.gen = BatchEngine(self.tcfg, self.tparams, self.dcfg, cast, batch_size=self.batch,
                                 max_new_tokens=self.max_new, max_prompt_len=max(len(p) for p in self.prompts),
                                 mesh=self.mesh, speculation="fixed")
        self.gen.dparams = shard_params(cast, self.mesh)
        stats = GenerationStats(self.dcfg.block_size)
        for r in self.gen.generate(self.prompts):
            stats.add(r)
        return {"eval_tau": round(stats.tau, 4), "eval_histogram": stats.summary()["acceptance_histogram"]}


# --------------------------------------------------------------------------- main loop


def initial_drafter(cfg: dict, tcfg, tokenizer, mesh):
    """The drafter training starts from: drafter.init's checkpoint (retapped where the config
    names other taps; a plain DFlash one upgraded to DFlash2 where drafter.dflash2 is set), else a
    new one of the config's shape. (DrafterConfig, float32 params)."""
    t = cfg["train"]
    if cfg["drafter"]["init"]:
        dcfg, init_params = load_drafter(cfg["drafter"]["init"], dtype="float32", mesh=mesh)
        if cfg["drafter"]["target_layer_ids"]:  # fine-tune it on other taps
            before = dcfg.target_layer_ids
            dcfg, init_params = retap(dcfg, init_params, cfg["drafter"]["target_layer_ids"])
            if dcfg.target_layer_ids != before:
                log(f"taps {list(before)} -> {list(dcfg.target_layer_ids)}: kept taps keep their fc weights, new ones start at zero")
        wanted = with_dflash2(cfg, dcfg)  # refuses a DFlash2 init's conflicting drafter.dflash2
        if wanted.dflash2 is not None and dcfg.dflash2 is None:
            dcfg, init_params = upgrade_to_dflash2(dcfg, init_params, wanted.dflash2, jax.random.PRNGKey(t["seed"]))
            log("DFlash drafter -> DFlash2: its weights kept, the convolutions start as the identity, the selector "
                "at its init")
        return dcfg.with_dtype(t["compute_dtype"]), init_params
    dcfg = new_drafter_config(cfg, tcfg, tokenizer, t["compute_dtype"])
    return dcfg, init_drafter_params(dcfg.with_dtype("float32"), jax.random.PRNGKey(t["seed"]))


def train(cfg: dict, *, progress: bool = True) -> dict:
    from tqdm import tqdm

    t, d = cfg["train"], cfg["data"]
    out = Path(t["output_dir"])
    out.mkdir(parents=True, exist_ok=True)
    mesh = engine_mesh(t["mesh"])
    pair = open_pair(cfg["target"], dtype=cfg["target_dtype"]).open_tokenizer()
    tokenizer = pair.tokenizer
    # Regenerated first: generation loads the target itself, so it is never held twice.
    ensure_data(cfg, pair.target_dir)
    if jax.process_count() > 1:  # process 0 wrote the data; everyone reads it after this
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("data ready")
    # Every tensor read straight into its shard on the mesh: no device holds the whole target.
    # train.fsdp: split over `data` as well, each device keeping a share of its model shard.
    pair.load_weights(mesh, over_data=t["fsdp"])
    tcfg, tparams = pair.target, pair.tparams

    records = read_jsonl(d["conversations"])
    holdout = min(d["eval_holdout"], len(records) - 1)
    train_records, held = (records[:-holdout], records[-holdout:]) if holdout > 0 else (records, [])
    if len(train_records) < t["global_batch"]:
        raise TrainConfigError(f"{len(train_records)} training conversations < global batch {t['global_batch']}")

    dcfg, init_params = initial_drafter(cfg, tcfg, tokenizer, mesh)
    for warning in check_pair(tcfg, dcfg):
        log(f"warning: {warning}")
    gamma = t["gamma"] or default_gamma(dcfg.block_size)
    spec = LossSpec(target=tcfg, drafter=dcfg, num_anchors=t["num_anchors"], gamma=float(gamma),
                    ce_chunk=t["ce_chunk"], anchor_hardness=float(t["anchor_hardness"]),
                    anchor_miss=float(t["anchor_miss"]), mesh=mesh, remat=t["remat"],
                    fsdp=bool(mesh is not None and t["fsdp"]), ce_weight=float(t["ce_loss_weight"]),
                    selector_weight=float(t["selector_loss_weight"]))
    if mesh is not None and t["global_batch"] % mesh.shape["data"]:
        raise TrainConfigError(f"train.global_batch {t['global_batch']} is not divisible by the data axis "
                               f"({mesh.shape['data']})")
    steps_per_epoch = len(train_records) // t["global_batch"]
    total = t["steps"] or t["epochs"] * steps_per_epoch
    epochs_needed = -(-total // steps_per_epoch)
    tx, schedule = make_optimizer(t["lr"], total, t["warmup_ratio"], t["clip"], t["weight_decay"])

    dataset = make_dataset(train_records, tokenizer, seq_len=d["seq_len"], global_batch=t["global_batch"],
                           seed=t["seed"], epochs=epochs_needed, process_index=jax.process_index(),
                           process_count=jax.process_count(), thinking=d["enable_thinking"],
                           pad_id=0)
    data_iter = iter(dataset.to_iter_dataset())

    state = init_train_state(init_params, tx)
    if mesh is not None:
        state = jax.device_put(state, state_shardings(state, mesh, fsdp=spec.fsdp))
    mngr = checkpoint_manager(out, cfg)
    start, state = resume(mngr, state, data_iter, out)
    if jax.process_index() == 0:
        (out / DRAFTER_CONFIG).write_text(json.dumps(
            {**dcfg.to_hf_dict(), "dtype": "float32"}, indent=2) + "\n")
        (out / "train_config.json").write_text(json.dumps(cfg, indent=2, default=str) + "\n")

    evaluator = TauEvaluator(tcfg, tparams, dcfg, eval_prompts(held, tokenizer, d["enable_thinking"]),
                             t["eval_max_new_tokens"], t["eval_batch_size"], mesh) if held else None
    seed_key = jax.random.PRNGKey(t["seed"])
    metrics_file = open(out / METRICS, "a") if jax.process_index() == 0 else None

    def record(entry: dict):
        if metrics_file is not None:
            metrics_file.write(json.dumps(entry) + "\n")
            metrics_file.flush()

    history = []
    if evaluator is not None and start == 0:
        entry = {"step": 0, **evaluator(state.params)}
        record(entry)
        history.append(entry)
        log(f"step 0: eval tau {entry['eval_tau']:.3f} (the initial drafter)")

    bar = tqdm(total=total, initial=start, desc="train", unit="step",
               disable=not progress or jax.process_index() != 0, file=sys.stderr)
    if not bar.disable:
        # Teacher-forced: every block sees the true context, so it reads well above the tau of
        # real decoding (the eval's); named so nobody mistakes one for the other.
        bar.write("progress: loss, and tau_tf = tau estimated teacher-forced (each block sees the true "
                  "context; reads above real decoding, which the eval lines measure)", file=sys.stderr)
    window_t, window_tokens = time.perf_counter(), 0
    try:
        for step in range(start, total):
            batch = next(data_iter)
            state, metrics = train_step(state, tparams, global_batch(batch["tokens"], mesh),
                                        global_batch(batch["loss_mask"], mesh), seed_key, spec=spec, tx=tx)
            window_tokens += int(batch["tokens"].size) * jax.process_count()
            done = step + 1
            entry = None
            if done % t["log_every"] == 0 or done == total:
                m = jax.device_get(metrics)
                now = time.perf_counter()
                entry = {"step": done, "loss": round(float(m["loss"]), 5), "tau_estimate": round(float(m["tau_estimate"]), 4),
                         "slot_accuracy": [round(float(a), 4) for a in m["slot_accuracy"]],
                         "grad_norm": round(float(m["grad_norm"]), 4), "lr": float(schedule(step)),
                         "tokens_per_second": round(window_tokens / (now - window_t), 1)}
                if "selector_loss" in m:  # a DFlash2 drafter's: its two losses and its selector's figures
                    entry.update({k: round(float(m[k]), 5) for k in ("ce_loss", "selector_loss", "selector_accuracy",
                                                                      "gold_in_top_k")})
                window_t, window_tokens = now, 0
                bar.set_postfix(loss=f"{entry['loss']:.3f}", tau_tf=f"{entry['tau_estimate']:.2f}")
            if evaluator is not None and (done % t["eval_every"] == 0 or done == total):
                entry = {**(entry or {"step": done}), **evaluator(state.params)}
            if entry is not None:
                record(entry)
                history.append(entry)
                if "eval_tau" in entry and jax.process_index() == 0:  # above the bar, never over it
                    bar.write(f"step {done}: eval tau {entry['eval_tau']:.3f} (decoding held-out prompts)",
                              file=sys.stderr)
            if done % t["save_every"] == 0 or done == total:
                save(mngr, done, state, data_iter.get_state())
            if done == FAIL_AT_STEP:  # fault injection for the resume tests: a real SIGKILL,
                mngr.wait_until_finished()  # once the checkpoints begun so far are on disk
                os.kill(os.getpid(), signal.SIGKILL)
            bar.update(1)
    finally:
        bar.close()
        mngr.wait_until_finished()
        mngr.close()
        if metrics_file is not None:
            metrics_file.close()
    return {"steps": total, "output_dir": str(out), "history": history}


def run_evals(out: Path, history: list[dict]) -> list[dict]:
    """The run's eval entries in step order: from its metrics.jsonl, which a resumed run continues
    (so the step-0 eval of the first attempt counts), else from this process's history."""
    entries = []
    path = out / METRICS
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError:
                pass
    evals = [e for e in entries if "eval_tau" in e] or [h for h in history if "eval_tau" in h]
    return sorted(evals, key=lambda e: e["step"])


def done_message(summary: dict, cfg: dict) -> str:
    """The end of a run, for people: where it is, the last figures, what to run next."""
    out, history = summary["output_dir"], summary["history"]
    lines = [f"done: {summary['steps']} steps; checkpoints and metrics.jsonl in {out}"]
    last_train = next((h for h in reversed(history) if "loss" in h), None)
    if last_train:
        lines.append(f"  step {last_train['step']}: loss {last_train['loss']:.3f}, teacher-forced tau "
                     f"{last_train['tau_estimate']:.2f}")
    evals = run_evals(Path(out), history)
    first, last = (evals[0], evals[-1]) if evals else (None, None)
    lines += verdict(first["eval_tau"] if first and first is not last else None,
                     last["eval_tau"] if last else None, summary["steps"], cfg,
                     start_step=first["step"] if first else 0)
    lines.append(f"next: python -m train.export --run {out} --out DRAFTER_DIR")
    lines.append(f"      python -m infer --target {cfg['target']} --drafter DRAFTER_DIR --input PROMPTS.jsonl")
    return "\n".join(lines)
