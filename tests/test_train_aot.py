"""The training step compiled for TPUs on this CPU (`python -m train --aot`): a tiny run's step
compiles for one v5e chip, fits, and reports its estimate, its useful flops and MFU, and the
projected training time; bad input is a one-line error. `useful_flops` is held to a count by hand.

The compiles need libtpu (`pip install -e '.[tpu]'`; .ci/run installs it): without it they are
skipped, with that reason. The error checks and the four-chip compiles are `-m heavy`."""

import importlib.util
import json
import subprocess
import sys

import pytest

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed: pip install -e '.[tpu]' to compile for TPUs")


def train_aot(tmp_path, *flags):
    out = tmp_path / "train-aot.json"
    p = subprocess.run([sys.executable, "-m", "train", "--config", "configs/train/tiny.yaml", *flags,
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    return p, (json.loads(out.read_text()) if out.exists() else None)


@needs_libtpu
def test_tiny_training_step_compiles_for_one_v5e_chip(tmp_path):
    p, r = train_aot(tmp_path, "--aot", "v5e:1x1", "--batch", "2", "--conversations", "1000", "--chips", "4",
                     "train.remat=layer")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    f = r["step"]
    assert f["compiled"] and f["fits"], f
    assert r["mesh"] == {"data": 1, "model": 1} and r["batch"] == 2 and r["remat"] == "layer"
    assert 0 < f["memory"]["arguments"] <= f["memory"]["total"] < r["chip_spec"]["hbm"]
    assert f["seconds"] > 0 and f["flops"] > 0 and f["bytes"] > 0
    u = r["useful_flops"]
    assert u["total"] == pytest.approx(u["target"] + u["drafter"] + u["lm_head"])
    assert r["mfu_useful"] == pytest.approx(u["total"] / (f["seconds"] * r["chip_spec"]["flops"]))
    assert 0 < r["mfu_useful"] < 1
    assert r["target_tokens_per_second_per_chip"] == pytest.approx(2 * 96 / f["seconds"])
    # 1000 conversations x 12 epochs on 4 chips, 2 sequences per step per chip
    assert r["projection"]["hours"] == pytest.approx(1000 * 12 / (2 / f["seconds"] * 4) / 3600)
    assert "MFU over useful flops" in p.stdout and "projected" in p.stdout


@needs_libtpu
@pytest.mark.heavy  # a TPU compile (12 s); the everyday suite compiles DFlash's step
def test_dflash2_recipe_compiles_for_one_v5e_chip(tmp_path):
    """--dflash2: the tiny target's drafter as DFlash2 (DFlash2Config's defaults: convolutions of 2
    taps over groups of 16, a rank-256 selector over the top 16) at block 8, its selector's loss in
    the step (one layer, a short sequence: the compile is the test's time)."""
    p, r = train_aot(tmp_path, "--aot", "v5e:1x1", "--batch", "1", "--dflash2", "train.remat=layer",
                     "drafter.num_hidden_layers=1", "data.seq_len=64", "train.num_anchors=8")
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    f = r["step"]
    assert f["compiled"] and f["fits"] and f["seconds"] > 0 and f["flops"] > 0, f
    assert r["block_size"] == 8 and r["dflash2"] == {
        "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 256, "selector_top_k": 16,
        "output_multiplier": 1.0, "final_logit_softcapping": None, "input_embedding_scale": 1.0}
    assert "DFlash2 drafter 1 layers, block 8" in p.stdout and "MFU over useful flops" in p.stdout


@needs_libtpu
@pytest.mark.heavy
def test_bad_topology_mesh_and_batch_are_one_line_errors(tmp_path):
    p, _ = train_aot(tmp_path, "--aot", "v9:1x1")
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].startswith("error: unknown TPU topology 'v9:1x1'")
    p, _ = train_aot(tmp_path, "--aot", "v5e:2x2", "train.mesh=data=3")
    assert p.returncode != 0 and p.stderr.strip().splitlines()[-1].startswith("error:")
    p, _ = train_aot(tmp_path, "--aot", "v5e:2x2", "--batch", "3")
    assert p.returncode != 0 and "not divisible by the mesh's data axis (4)" in p.stderr.strip().splitlines()[-1]


def test_a_target_without_config_needs_a_shape(tmp_path):
    from dflash_jax.aot import AotError
    from train.aot import target_config

    with pytest.raises(AotError, match="has no config.json here; give --shape"):
        target_config({"target_dtype": None, "target": str(tmp_path)}, None)


def test_useful_flops_match_a_count_by_hand():
    """One-layer target (tap 0) and one-layer drafter, no GQA, block 4: every term by hand."""
    import dataclasses

    import jax

    from dflash_jax.dflash2 import DFlash2Config
    from dflash_jax.drafter import DrafterConfig, init_drafter_params
    from dflash_jax.config import ModelConfig
    from dflash_jax.model import abstract_params
    from train.aot import useful_flops

    h, i, v, heads, hd = 32, 64, 100, 4, 8
    tcfg = ModelConfig(model_type="qwen3", vocab_size=v, hidden_size=h, intermediate_size=i, num_hidden_layers=1,
                       num_attention_heads=heads, num_key_value_heads=heads, head_dim=hd, dtype="float32")
    dcfg = DrafterConfig(model=tcfg.replace(qk_norm=True), block_size=4, mask_token_id=0, target_layer_ids=(0,),
                         num_target_layers=1)
    tparams = abstract_params(tcfg)
    dparams = jax.eval_shape(lambda: init_drafter_params(dcfg))
    s, n, b = 64, 8, 4
    t = n * b
    layer = 4 * h * h + 3 * h * i  # q, k, v, o (no GQA: all h x h) and the MLP's gate, up, down
    target = 2 * s * layer + 4 * (s * s / 2) * heads * hd
    drafter = (4 * s * h * h  # fc: one tap of width h -> h
               + 6 * s * 2 * h * h  # context K and V over the sequence
               + 6 * t * layer  # the layer's weights over the block tokens
               + 12 * t * (s / 2 + b) * heads * hd)  # attention: context before the anchor + its block
    head = 4 * n * (b - 1) * v * h
    u = useful_flops(tcfg, dcfg, tparams, dparams, batch=3, seq_len=s, num_anchors=n)
    assert u["target"] == pytest.approx(3 * target)
    assert u["drafter"] == pytest.approx(3 * drafter)
    assert u["lm_head"] == pytest.approx(3 * head)
    assert u["total"] == pytest.approx(3 * (target + drafter + head))

    # DFlash2: each layer's two convolutions' kernel projections (hidden -> 2 sides x 2 taps x 4
    # groups of 8) join its weights (their base kernels are no matrix); the selector's projection to
    # rank 16 and the gold row's bilinear term over 5 candidates at every slot with a loss.
    d2 = dataclasses.replace(dcfg, dflash2=DFlash2Config(conv_kernel_size=2, conv_group_size=8, selector_rank=16,
                                                         selector_top_k=5))
    d2params = jax.eval_shape(lambda: init_drafter_params(d2))
    convs = 2 * h * (2 * 2 * (h // 8))
    selector = 6 * n * (b - 1) * 16 * (h + 5)
    u2 = useful_flops(tcfg, d2, tparams, d2params, batch=3, seq_len=s, num_anchors=n)
    assert u2["drafter"] == pytest.approx(3 * (drafter + 6 * t * convs + selector))
    assert u2["target"] == u["target"] and u2["lm_head"] == u["lm_head"]


@needs_libtpu
@pytest.mark.heavy
def test_data_by_model_mesh_with_fsdp_holds_less_per_chip(tmp_path):
    """v5e:2x2 as data=2 x model=2: with train.fsdp the target's weights and the drafter's
    parameters are split over `data` too, so each chip holds less (the Adam moments always are)."""
    figures = {}
    for fsdp in ("false", "true"):
        p, r = train_aot(tmp_path, "--aot", "v5e:2x2", "train.mesh=data=2,model=2", f"train.fsdp={fsdp}")
        assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
        assert r["step"]["compiled"] and r["step"]["fits"] and r["mesh"] == {"data": 2, "model": 2}
        assert r["fsdp"] is (fsdp == "true") and "mfu_useful" not in r  # several chips: no per-chip time
        figures[fsdp] = r["step"]["memory"]["arguments"]
    assert figures["true"] < 0.9 * figures["false"], figures
