"""MiniMax-M2 targets (`minimax_m2`: M2, M2.1, M2.5) against transformers, on tiny random checkpoints.

- Six configs (`CASES`: RoPE on half of each head or all of it, a `partial_rotary_factor` that
  overrides `rotary_dim`, YaRN, 8 query heads on 2 K/V heads and on 1, top-1 to top-3 of 4 to 8
  experts, tied embeddings): logits equal transformers', whole and in right-padded prefill pieces;
  plain greedy decoding equals transformers' `generate`; DFlash with a random drafter equals plain
  decoding, greedy and seeded sampled, on per-row caches and on a page pool (decoding: the configs in
  `DECODED`). (Everyday: the first config's logits; the rest `-m heavy`.) The helpers are `test_mla.py`'s.
- The q/k norms span the whole projection (a per-head norm loads no checkpoint: its weights are
  heads x head_dim), and the checkpoint's `block_sparse_moe` tensors fill the MoE block.
- `python -m infer` equals transformers, and on a 2-device mesh (query heads and experts split over
  `model`: the whole-projection norm sums over both devices' heads) with a page pool equals one
  device, greedy and sampled (`-m heavy`: subprocesses).
- Bad configs are one-line errors; multi-token-prediction layers past the last are skipped; the
  published MiniMax-M2 shape parses.
"""

from __future__ import annotations

import re

import pytest
from safetensors.numpy import load_file, save_file

from dflash_jax import load_target
from dflash_jax.errors import ConfigError
from dflash_jax.families import model_config
from test_mla import (VOCAB, build, case_params, check_against_transformers, check_cli_on_two_devices,
                      check_decoding)
from tiny import FAMILIES, make_model, save_model

YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
            beta_slow=1.0)
# name: (family, overrides of tests/tiny.py's config)
CASES = {
    "minimax_m2": ("minimax_m2", {}),
    "minimax_m2-full-rotary-top3": ("minimax_m2", dict(rotary_dim=16, num_local_experts=8, num_experts_per_tok=3)),
    "minimax_m2-partial-factor-wins": ("minimax_m2", dict(rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25))),
    "minimax_m2-yarn": ("minimax_m2", dict(rope_parameters=YARN, max_position_embeddings=256)),
    "minimax_m2-8-heads-tied": ("minimax_m2", dict(num_attention_heads=8, head_dim=8, rotary_dim=4,
                                                   tie_word_embeddings=True)),
    "minimax_m2-1-kv-head-top1": ("minimax_m2", dict(num_key_value_heads=1, num_local_experts=4,
                                                     num_experts_per_tok=1, num_hidden_layers=3, rms_norm_eps=1e-5)),
}
EVERYDAY = ("minimax_m2",)


@pytest.mark.parametrize("name", case_params(CASES, EVERYDAY))
def test_logits_equal_transformers_whole_and_in_padded_pieces(name, tmp_path):
    model, path, _ = build(name, tmp_path, CASES)
    config, params = load_target(path)
    attn, mlp = params["model"]["layers_0"]["self_attn"], params["model"]["layers_0"]["mlp"]
    assert config.qk_norm_whole and config.moe.router == "sigmoid_grouped" and all(config.sparse_layers)
    assert attn["q_norm"]["weight"].shape == (config.num_attention_heads * config.head_dim,)
    assert mlp["e_score_correction_bias"].dtype.name == "float32"
    check_against_transformers(model, config, params, name)


# Decoding (plain as transformers' `generate`, DFlash as plain) runs on the configs that change what a
# decode step reads or caches (heads, head width, K/V heads); the others change only RoPE or routing and
# are checked against transformers by their logits, whole and in padded pieces (the cached path); their
# decoding went for .ci/run's 50 minutes (2026-12-08).
DECODED = ("minimax_m2", "minimax_m2-8-heads-tied", "minimax_m2-1-kv-head-top1")


@pytest.mark.heavy  # engines compile for a minute per case
@pytest.mark.parametrize("name", DECODED)
def test_plain_decoding_equals_transformers_and_dflash_equals_plain(name, tmp_path):
    check_decoding(*build(name, tmp_path, CASES))


def tiny_config(**overrides):
    return {**FAMILIES["minimax_m2"][2], "model_type": "minimax_m2", "vocab_size": VOCAB, "hidden_size": 64,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            **overrides}


@pytest.mark.parametrize("change,message", [
    (dict(use_qk_norm=False), "use_qk_norm False is not supported"),
    (dict(qk_norm_type="per_head"), "qk_norm_type 'per_head' is not supported (per_layer only)"),
    (dict(scoring_func="softmax"), "scoring_func 'softmax' is not supported (sigmoid only)"),
    (dict(use_routing_bias=False), "use_routing_bias False is not supported"),
    (dict(shared_intermediate_size=64), "shared_intermediate_size 64 is not supported (no shared expert)"),
    (dict(attn_type_list=[1, 0]), "attn_type_list entry 0 is not supported"),
    (dict(rotary_dim=7), "rotary_dim must be an even integer in 2..head_dim 16, got 7"),
    (dict(rotary_dim=32), "rotary_dim must be an even integer in 2..head_dim 16, got 32"),
    (dict(num_experts_per_tok=9), "num_experts_per_tok 9 > num_local_experts 6"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_bad_minimax_config_is_a_one_line_error(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        model_config(tiny_config(**change))
    assert "\n" not in str(err.value)


def test_released_config_fields_and_defaults_parse():
    """The fields of MiniMax-M2's released config.json (rotary_dim, rope_theta at the top level; the
    switches it always sets) parse; without head_dim and rope_theta transformers' defaults apply."""
    released = tiny_config(use_qk_norm=True, qk_norm_type="per_layer", scoring_func="sigmoid", use_routing_bias=True,
                           shared_intermediate_size=0, attn_type_list=[1, 1], use_mtp=True, num_mtp_modules=3,
                           rope_theta=5e6, quantization_config=None)
    config = model_config(released)
    assert config.rope.rotary_dim(config.head_dim) == 8 and config.rope.theta == 5e6 and config.qk_norm_whole
    bare = {k: v for k, v in tiny_config().items() if k not in ("head_dim", "rotary_dim")}
    config = model_config(bare)
    assert config.head_dim == 128 and config.rope.theta == 5e6 and config.rope.rotary_dim(128) == 128


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    model = make_model("minimax_m2", seed=1, vocab_size=VOCAB, num_hidden_layers=2)
    path = save_model(model, tmp_path / "t")
    tensors = load_file(path / "model.safetensors")
    assert any(".block_sparse_moe.experts.0.w1." in k for k in tensors)  # the released checkpoints' names
    tensors.update({k.replace("layers.1.", "layers.2."): v for k, v in tensors.items() if "layers.1." in k})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config, params = load_target(path)
    assert config.num_hidden_layers == 2 and "layers_2" not in params["model"]


def test_published_minimax_m2_shape():
    from dflash_jax.shapes import published_configs

    target, drafter = published_configs(1.0, shape="minimax-m2")
    assert (target.hidden_size, target.num_hidden_layers, target.num_attention_heads, target.num_key_value_heads,
            target.head_dim, target.vocab_size) == (3072, 62, 48, 8, 128, 200064)
    assert target.rope.rotary_dim(128) == 64 and target.rope.theta == 5e6 and target.qk_norm_whole
    assert (target.moe.num_experts, target.moe.top_k, target.moe.intermediate_size) == (256, 8, 1536)
    assert drafter.model.hidden_size == 3072 and not drafter.model.qk_norm_whole


@pytest.mark.heavy  # four `python -m infer` runs
def test_infer_cli_equals_transformers_and_on_two_devices_equals_one(tmp_path):
    """`python -m infer`: plain greedy equals transformers' `generate`; the pair on a 2-device mesh (query
    heads and experts split over `model`: the whole-projection norm sums over both devices' heads) with a
    page pool gives the same tokens, greedy, and sampled as plain sampling on one device."""
    check_cli_on_two_devices(*build("minimax_m2", tmp_path, CASES), tmp_path)
