"""Loading z-lab drafters: config variants, conversion, and pairs that must be refused."""

import dataclasses
import json
import shutil

import jax
import numpy as np
import pytest

from dflash_jax import CheckpointError, ConfigError, load_drafter, load_target
from dflash_jax.convert import main as convert_main
from dflash_jax.drafter import DFlashDrafter, DrafterConfig, check_pair, default_target_layer_ids, retap
from dflash_jax.engine import BatchEngine
from fixtures import tiny


def edited_drafter(tmp_path, edit):
    d = tmp_path / "drafter"
    shutil.copytree(tiny() / "drafter", d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_default_target_layer_ids_rule():
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)  # Qwen3-8B
    assert default_target_layer_ids(32, 5) == (1, 8, 15, 22, 29)  # Llama-3.1-8B
    assert default_target_layer_ids(6, 1) == (3,)
    # never the last layer, which vLLM and SGLang read before the final norm (even where the rule,
    # meant for deep targets, would reach it)
    for layers in range(2, 40):
        for n in range(1, 7):
            taps = default_target_layer_ids(layers, n)
            assert len(taps) == n and all(0 <= t < layers - 1 for t in taps), (layers, n, taps)


def test_a_drafter_tapping_the_last_layer_pairs_with_a_warning():
    tc, _ = load_target(tiny() / "target")
    dc, _ = load_drafter(tiny() / "drafter")
    assert check_pair(tc, dataclasses.replace(dc, target_layer_ids=(1, 4))) == []
    (warning,) = check_pair(tc, dataclasses.replace(dc, target_layer_ids=(1, 5)))
    assert "taps the target's last layer (5)" in warning and "vLLM and SGLang" in warning


def test_block_size_in_dflash_config_and_default_taps(tmp_path):
    def edit(cfg):
        cfg["dflash_config"] = {"mask_token_id": 511, "block_size": 4}
        del cfg["block_size"]
    config, _ = load_drafter(edited_drafter(tmp_path, edit))
    assert config.block_size == 4
    assert config.target_layer_ids == default_target_layer_ids(6, 2) == (1, 3)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda c: c.pop("block_size"), "block_size"),
])
def test_drafter_config_missing_fields(tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message):
        load_drafter(edited_drafter(tmp_path, edit))


def test_loading_a_drafter_as_target_and_vice_versa_is_refused():
    with pytest.raises(CheckpointError, match="holds a drafter checkpoint, not a target"):
        load_target(tiny() / "drafter")
    with pytest.raises(CheckpointError, match="holds a target checkpoint, not a drafter"):
        load_drafter(tiny() / "target")


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size=32), "hidden_size 32 != target hidden_size 64"),
    (dict(vocab_size=1000), "vocab_size 1000 != target vocab_size 512"),
    (dict(target_layer_ids=(1, 6)), r"taps target layers \[6\], but the target has 6 layers"),
    (dict(mask_token_id=512), "mask_token_id 512 is outside the target vocab"),
])
def test_incompatible_pairs_are_refused(change, message):
    tc, tp = load_target(tiny() / "target")
    dc, dp = load_drafter(tiny() / "drafter")
    model_change = {k: v for k, v in change.items() if k in ("hidden_size", "vocab_size")}
    dc = DrafterConfig(model=dc.model.replace(**model_change),
                       block_size=dc.block_size,
                       mask_token_id=change.get("mask_token_id", dc.mask_token_id),
                       target_layer_ids=change.get("target_layer_ids", dc.target_layer_ids),
                       num_target_layers=dc.num_target_layers)
    with pytest.raises(ConfigError, match=message):
        check_pair(tc, dc)
    with pytest.raises(ConfigError, match=message):
        BatchEngine(tc, tp, dc, dp, batch_size=1, speculation="fixed")


def test_converted_drafter_drafts_identically(tmp_path):
    out = tmp_path / "drafter-jax"
    assert convert_main(["--hf", str(tiny() / "drafter"), "--out", str(out), "--quiet"]) == 0
    assert json.loads((out / "dflash_jax.json").read_text())["kind"] == "drafter"
    c_hf, p_hf = load_drafter(tiny() / "drafter")
    c_cv, p_cv = load_drafter(out)
    assert c_cv == c_hf
    jax.tree.map(np.testing.assert_array_equal, p_cv, p_hf)
    tc, tp = load_target(tiny() / "target")
    prompts = [[5, 6, 7, 8, 9], [100, 200, 300]]
    run = lambda c, p: [r.output_ids for r in sorted(
        BatchEngine(tc, tp, c, p, batch_size=2, max_new_tokens=12, max_prompt_len=16, speculation="fixed").generate(prompts),
        key=lambda r: r.index)]
    assert run(c_cv, p_cv) == run(c_hf, p_hf)


def test_drafter_config_round_trips_every_rope_type():
    """A drafter keeps its target's RoPE; its exported config.json reads back the same for
    each type (YaRN's ramp and factor, the proportional type's rotated share included)."""
    from dflash_jax.config import ModelConfig, RopeConfig

    ropes = [RopeConfig(theta=1e6), RopeConfig(theta=5e5, type="llama3", factor=8.0, original_max_position_embeddings=8192),
             RopeConfig(theta=1.5e5, type="yarn", factor=32.0, original_max_position_embeddings=4096, truncate=False,
                        attention_factor=1.3465735902799727),
             RopeConfig(theta=1e6, type="proportional", partial_rotary_factor=0.25)]
    for rope in ropes:
        model = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                            qk_norm=True, rope=rope, sliding_windows=(None, None))
        config = DrafterConfig(model=model, block_size=4, mask_token_id=63, target_layer_ids=(0, 2),
                               num_target_layers=3)
        assert DrafterConfig.from_hf_dict(config.to_hf_dict()) == config, rope.type


def test_retap_keeps_the_kept_taps_and_starts_new_ones_at_zero():
    """Re-pointing a drafter for fine-tuning (training's drafter.target_layer_ids beside
    drafter.init): on any input of the new tap, the re-tapped drafter's context feature is the
    old drafter's with the dropped tap's input zeroed."""
    dc, params = load_drafter(tiny() / "drafter", dtype="float32")
    assert dc.target_layer_ids == (1, 3)
    new_cfg, new_params = retap(dc, params, (1, 2))
    assert new_cfg.target_layer_ids == (1, 2) and retap(dc, params, dc.target_layer_ids)[1] is params
    hidden = dc.model.hidden_size
    h1, h2, h3 = np.random.default_rng(0).standard_normal((3, 1, 5, hidden)).astype(np.float32)
    feature = lambda cfg, p, *taps: DFlashDrafter(cfg).apply({"params": p}, np.concatenate(taps, -1),
                                                             method="context")
    np.testing.assert_allclose(feature(new_cfg, new_params, h1, h2), feature(dc, params, h1, 0 * h3),
                               rtol=1e-6, atol=1e-6)
    assert not np.allclose(feature(dc, params, h1, h3), feature(dc, params, h1, 0 * h3))
    with pytest.raises(ConfigError, match="names a layer twice"):
        retap(dc, params, (1, 1))
