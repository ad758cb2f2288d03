"""python -m train --config CFG --aot TOPOLOGY: the configured training step compiled ahead of time
for a TPU, judged by the TPU compiler itself (no TPU needed: libtpu, `pip install -e '.[tpu]'`).

The step is `training.train_step` as `python -m train` runs it: the frozen target's forward for the
tap features, the drafter's forward and backward over every block, the optimizer. Its inputs are
abstract (nothing is allocated): the target's and drafter's shapes, `batch` sequences of
`data.seq_len` tokens, sharded over the topology's chips by the run's mesh (`train.mesh`; default
every chip on `data`). The target's shape comes from the config's target directory (its
config.json) or from `--shape` (a published shape, as in `python -m bench --aot`). `--dflash2` compiles
the DFlash2 recipe instead (`drafter.dflash2={}`, block 8: the drafter's convolutions and the
selector's loss in the step).

Per step the report gives:
- HBM per chip (arguments + temporaries) against the chip's capacity: fits or not. A step that
  does not fit fails to compile; the report gives the HBM the compiler asked for.
- the compiler's estimate (`optimal_seconds`), target tokens/s per chip, and its flops;
- useful flops: our own count of the work the step cannot avoid (`useful_flops`), and MFU over
  them: useful / (estimate x chips x peak). The compiler's flops include whatever the program
  computes and throws away (masked scores, recomputation), so they are not the measure.
- the projected time to train the recipe: `--conversations` regenerated conversations (one
  sequence each) x `train.epochs`, on `--chips` chips of the same kind, at this step's
  sequences/s per chip (data-parallel scaling taken as linear: the gradient all-reduce is not
  counted).

For a program partitioned over several chips the cost analysis is not a per-chip time (it can
come out negative): time one chip, use several for HBM.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

from dflash_jax.aot import GIB, AotError, abstract_replicated, abstract_sharded, compile_for_tpu, mesh_for, topology

from train.config import new_drafter_config, with_dflash2


def target_config(cfg: dict, shape: str | None):
    """The target's ModelConfig: from `--shape` (a published shape), else the config's target
    directory (config.json). Raises AotError naming what is missing."""
    dtype = cfg["target_dtype"] or "bfloat16"
    if shape:
        from dflash_jax.shapes import published_configs

        return published_configs(1.0, dtype, shape)[0]
    from dflash_jax.families import model_config, read_config_json

    path = Path(cfg["target"]) / "config.json"
    if not path.is_file():
        raise AotError(f"the target {cfg['target']} has no config.json here; give --shape (e.g. qwen3-8b) to "
                       "compile for a published shape")
    return model_config(read_config_json(path), dtype=dtype)


def drafter_config(cfg: dict, tcfg):
    from dflash_jax.drafter import DrafterConfig

    init = cfg["drafter"]["init"]
    compute = cfg["train"]["compute_dtype"]
    if init and (Path(init) / "config.json").is_file():
        return with_dflash2(cfg, DrafterConfig.from_json(Path(init) / "config.json", dtype=compute))
    return new_drafter_config(cfg, tcfg, None, compute)


def _matmul_params(tree, moe) -> float:
    """Weights a token multiplies by in one layer: every matrix, routed experts at top_k / num_experts."""
    import jax

    total = 0.0
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = [getattr(k, "key", "") for k in path]
        if len(leaf.shape) < 2 or "base_kernel" in keys:  # a DFlash2 convolution's taps: no matrix
            continue
        n = float(math.prod(leaf.shape))
        if "experts" in keys and moe is not None:
            n *= moe.top_k / moe.num_experts
        total += n
    return total


def useful_flops(tcfg, dcfg, tparams, dparams, *, batch: int, seq_len: int, num_anchors: int,
                 anchor_hardness: float = 0.0) -> dict:
    """The work a training step cannot avoid, in flops (a multiply-add is 2):

    - target: its forward over the sequence through the last layer tapped (all layers when
      anchor_hardness needs its final hidden state, plus its head), causal attention
      (S^2 / 2 scores per head; a sliding layer S x window);
    - drafter: fc over the sequence's tap features (forward + weight gradient: 4 per weight),
      each layer's context K/V over the sequence and its layer weights over the N x B block
      tokens (forward + both gradients: 6), attention over what each query may see: the context
      before its anchor (S / 2 on average, anchors spread over the sequence) and its own block
      (forward 4 per score and head dim, backward twice that);
    - the head: the N x (B - 1) slots with a loss (forward + input gradient: 4 per weight);
    - a DFlash2 drafter's selector, at those slots: its hidden projection and the bilinear term of
      the gold predecessor's row over K candidates (forward + both gradients: 6 per multiply-add,
      rank x (hidden + K) of them); its convolutions' kernel projections are among each layer's
      weights above. The convolutions themselves, the top-K and the codebook lookups are left out
      with the norms, RoPE, softmax, the optimizer and anchor sampling (small)."""
    s, n, b = seq_len, num_anchors, dcfg.block_size
    t = n * b
    taps = list(dcfg.target_layer_ids)
    last = tcfg.num_hidden_layers - 1 if anchor_hardness > 0 else max(taps)
    model = tparams["model"]
    target = 0.0
    for i in range(last + 1):
        target += 2 * s * _matmul_params(model[f"layers_{i}"], tcfg.moe)
        window = (tcfg.sliding_windows or (None,) * tcfg.num_hidden_layers)[i]
        scores = s * min(window, s) if window else s * s / 2
        target += 4 * scores * tcfg.num_attention_heads * tcfg.head_dim
    head = tcfg.vocab_size * tcfg.hidden_size
    if anchor_hardness > 0:
        target += 2 * s * head
    d = dcfg.model
    drafter = 4 * s * float(math.prod(dparams["fc"]["kernel"].shape))
    for i in range(d.num_hidden_layers):
        layer = dparams[f"layers_{i}"]
        attn = layer["self_attn"]
        kv = float(math.prod(attn["k_proj"]["kernel"].shape) + math.prod(attn["v_proj"]["kernel"].shape))
        drafter += 6 * s * kv + 6 * t * _matmul_params(layer, None)
        drafter += 3 * 4 * t * (s / 2 + b) * d.num_attention_heads * d.head_dim
    lm_head = 4 * n * (b - 1) * head
    d2 = dcfg.dflash2
    if d2 is not None:
        drafter += 6 * n * (b - 1) * d2.selector_rank * (d.hidden_size + d2.selector_top_k)
    per_seq = dict(target=target, drafter=drafter, lm_head=lm_head)
    return {k: v * batch for k, v in per_seq.items()} | {"total": batch * sum(per_seq.values())}


def run_train_aot(cfg: dict, args) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dflash_jax.drafter import check_pair, init_drafter_params
    from dflash_jax.model import abstract_params
    from dflash_jax.sharding import MeshError, param_shardings
    from dflash_jax.training import (LossSpec, default_gamma, init_train_state, make_optimizer, state_shardings,
                                     train_step)

    t, d = cfg["train"], cfg["data"]
    try:
        target = topology(args.aot)
        mesh = mesh_for(target, t["mesh"] or f"data={target.num_chips},model=1")
        tcfg = target_config(cfg, args.shape)
    except (AotError, MeshError) as e:
        raise SystemExit(f"error: {e}") from None
    dcfg = drafter_config(cfg, tcfg)
    check_pair(tcfg, dcfg)
    data = mesh.shape["data"]
    batch = args.batch or data
    if batch % data:
        raise SystemExit(f"error: --batch {batch} is not divisible by the mesh's data axis ({data})")
    seq = d["seq_len"]
    spec = LossSpec(target=tcfg, drafter=dcfg, num_anchors=t["num_anchors"],
                    gamma=float(t["gamma"] or default_gamma(dcfg.block_size)), ce_chunk=t["ce_chunk"],
                    anchor_hardness=float(t["anchor_hardness"]), anchor_miss=float(t["anchor_miss"]), mesh=mesh,
                    remat=t["remat"], fsdp=t["fsdp"], ce_weight=float(t["ce_loss_weight"]),
                    selector_weight=float(t["selector_loss_weight"]))
    tx, _ = make_optimizer(t["lr"], 1000, t["warmup_ratio"], t["clip"], t["weight_decay"])
    chip = target.chip
    print(f"TPU {target.name}: {target.num_chips} {target.chip_name} chip(s), {chip.hbm / GIB:.2f} GiB HBM each; "
          f"mesh {dict(mesh.shape)}; jax {jax.__version__}")
    print(f"target {tcfg.model_type} ({tcfg.num_hidden_layers} layers, hidden {tcfg.hidden_size}, {tcfg.dtype}); "
          f"{'DFlash2 ' if dcfg.dflash2 else ''}drafter {dcfg.model.num_hidden_layers} layers, block {dcfg.block_size}, "
          f"{dcfg.model.dtype} compute; "
          f"batch {batch} x {seq} tokens, {t['num_anchors']} anchors, remat {t['remat']}"
          f"{', fsdp' if t['fsdp'] else ''}", flush=True)

    tparams = abstract_params(tcfg)
    dparams = jax.eval_shape(lambda: init_drafter_params(dcfg.with_dtype("float32")))
    state = jax.eval_shape(lambda: init_train_state(init_drafter_params(dcfg.with_dtype("float32")), tx))
    rows = NamedSharding(mesh, P("data"))
    args_ = (abstract_sharded(state, state_shardings(state, mesh, fsdp=t["fsdp"])),
             abstract_sharded(tparams, param_shardings(tparams, mesh, over_data=t["fsdp"])),
             jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows),
             jax.ShapeDtypeStruct((batch, seq), jnp.int32, sharding=rows), abstract_replicated(mesh, (2,), jnp.uint32))
    fig = compile_for_tpu(train_step, args_, Path(args.hlo) if args.hlo else None, "train_step", spec=spec, tx=tx)
    print(f"  compiled train_step in {fig['compile_seconds']:.0f} s" if fig["compiled"]
          else f"  train_step did not compile: {fig['error'][:200]}", flush=True)
    useful = useful_flops(tcfg, dcfg, tparams, dparams, batch=batch, seq_len=seq, num_anchors=t["num_anchors"],
                          anchor_hardness=float(t["anchor_hardness"]))
    report = dict(topology=target.name, chip=target.chip_name, chips=target.num_chips,
                  chip_spec=dataclasses.asdict(chip), mesh=dict(mesh.shape), shape=args.shape or str(cfg["target"]),
                  batch=batch, seq_len=seq, num_anchors=t["num_anchors"], block_size=dcfg.block_size,
                  dflash2=dataclasses.asdict(dcfg.dflash2) if dcfg.dflash2 else None,
                  remat=t["remat"], fsdp=t["fsdp"], useful_flops=useful, step=fig)
    if fig.get("memory"):
        fig["fits"] = fig["memory"]["total"] <= chip.hbm
    if fig.get("compiled") and fig.get("seconds") and target.num_chips == 1:
        sec = fig["seconds"]
        report["target_tokens_per_second_per_chip"] = batch * seq / sec
        report["mfu_useful"] = useful["total"] / (sec * chip.flops)
        report["mfu_compiler_flops"] = fig["flops"] / (sec * chip.flops)
        seqs = args.conversations * t["epochs"]
        report["projection"] = dict(conversations=args.conversations, epochs=t["epochs"], chips=args.chips,
                                    hours=seqs / (batch / sec * args.chips) / 3600)
    print_train_report(report)
    return report


def print_train_report(r: dict) -> None:
    f = r["step"]
    if not f.get("compiled"):
        print(f"train_step: does not compile on {r['topology']}: {f.get('asked') or f['error'][:300]}")
        return
    m = f["memory"]
    print(f"HBM per chip: {m['arguments'] / GIB:.2f} GiB arguments + {m['temporaries'] / GIB:.2f} GiB temporaries "
          f"= {m['total'] / GIB:.2f} of {r['chip_spec']['hbm'] / GIB:.2f} GiB ({'fits' if f['fits'] else 'DOES NOT FIT'})")
    if "mfu_useful" not in r:
        print("(several chips: the compiler's estimate is not a per-chip time; compile one chip for speed)")
        return
    u = r["useful_flops"]
    print(f"compiler's estimate: {f['seconds'] * 1e3:.1f} ms per step; {r['target_tokens_per_second_per_chip']:,.0f} "
          f"target tokens/s per chip; {f['bytes'] / 1e9:.1f} GB accessed")
    print(f"flops: compiler {f['flops'] / 1e12:.1f} TFLOP; useful {u['total'] / 1e12:.1f} TFLOP (target "
          f"{u['target'] / 1e12:.1f}, drafter {u['drafter'] / 1e12:.1f}, head {u['lm_head'] / 1e12:.1f})")
    print(f"MFU over useful flops: {r['mfu_useful']:.2f} (over the compiler's flops: {r['mfu_compiler_flops']:.2f})")
    p = r["projection"]
    print(f"projected: {p['conversations']:,} conversations x {p['epochs']} epochs on {p['chips']} {r['chip']} chips: "
          f"{p['hours']:.1f} h")
