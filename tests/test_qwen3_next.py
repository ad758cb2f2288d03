"""Qwen3-Next (`qwen3_next`) targets: Qwen3.5-MoE's layers read from Qwen3-Next's checkpoint layout
(fused `in_proj_qkvz` / `in_proj_ba` cut at load; MoE on the layers Qwen3-MoE's rule picks).

- Six tiny random configs (dense and sparse layers mixed, the published config.json's style with
  `full_attention_interval` and top-level RoPE fields, partial RoPE 0.5 and tied embeddings,
  no experts at all, one q/k head for four value heads, biases and whole-head RoPE): logits equal
  transformers' for a prompt longer than one delta-rule chunk, prefilled whole and in right-padded
  pieces; plain greedy decoding equals transformers' `generate`, and DFlash with a random
  drafter equals plain greedy decoding (`-m heavy`; everyday: the first config's logits).
- DFlash sampled (seeded) on a page pool equals plain sampling (two configs, `-m heavy`).
- `python -m infer` with a random drafter on a 2-device mesh (model=2) and the page pool, greedy
  and sampled, equals plain decoding on one device (`-m heavy`).
- A bad config is a one-line error.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax import forward, init_cache, load_drafter, load_target
from dflash_jax.engine import BatchEngine, Sampling
from dflash_jax.errors import ConfigError
from dflash_jax.families import model_config
from tiny import (BASE, FAMILIES, assert_plain_greedy_equals_generate, make_model, prefill_in_pieces, save_model,
                  write_random_drafter)

REPO = Path(__file__).resolve().parent.parent
ROPE = lambda partial: dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=partial)

# name: (overrides of tiny.py's qwen3_next, drafter taps, config.json style). Vocabulary 8: a
# random drafter's drafts are then accepted often enough that rollbacks keep a prefix.
CONFIGS = {
    # 3 linear : 1 attention (layer_types), layer 1 dense among sparse ones; no partial_rotary_factor
    # in config.json (transformers' default 0.25 applies).
    "mixed": (dict(), (0, 2), "no_partial"),
    # The published config.json: full_attention_interval (linear, full, linear, full), rope_theta and
    # partial_rotary_factor at the top, no layer_types; sparse every 2nd layer, weights not renormalised.
    "published": (dict(layer_types=None, full_attention_interval=2, decoder_sparse_step=2, norm_topk_prob=False,
                       rope_parameters=ROPE(0.25)), (1, 3), "published"),
    "tied_half_rope": (dict(tie_word_embeddings=True, rope_parameters=ROPE(0.5), num_experts=4, num_experts_per_tok=3,
                            shared_expert_intermediate_size=16), (0, 3), None),
    "no_experts": (dict(num_experts=0), (1, 2), None),  # every layer's MLP dense
    "one_kq_head": (dict(num_hidden_layers=6, layer_types=["linear_attention"] * 2 + ["full_attention"]
                         + ["linear_attention"] * 2 + ["full_attention"], linear_num_key_heads=1,
                         linear_num_value_heads=4, linear_key_head_dim=16, linear_conv_kernel_dim=3,
                         num_key_value_heads=1, head_dim=32), (1, 4), None),
    "biases": (dict(attention_bias=True, mlp_only_layers=[0, 2], num_experts_per_tok=1, rope_parameters=ROPE(1.0),
                    rms_norm_eps=1e-5, shared_expert_intermediate_size=96), (0, 3), None),
}
VOCAB = 8
# configs that change what the model computes but not the engine's programs' structure (the config
# file's style; top-1 routing and biases): their logits and plain greedy decoding are checked, DFlash
# against plain decoding on the other four
MODEL_ONLY = ("published", "biases")
PROMPT_LENGTHS = (3, 13, 11, 6, 16)
SAMPLED = Sampling(temperature=1.0)


def restyle(path: Path, style: str | None) -> None:
    """Rewrite a saved config.json: drop partial_rotary_factor ("no_partial"), or write it as the
    published Qwen3-Next checkpoints do ("published")."""
    cfg = json.loads((path / "config.json").read_text())
    rope = cfg["rope_parameters"]
    if style == "no_partial":
        rope.pop("partial_rotary_factor")
    elif style == "published":
        interval = cfg["layer_types"].index("full_attention") + 1
        cfg.pop("layer_types"), cfg.pop("rope_parameters")
        cfg.update(full_attention_interval=interval, rope_theta=rope["rope_theta"], rope_scaling=None,
                   partial_rotary_factor=rope["partial_rotary_factor"])
    (path / "config.json").write_text(json.dumps(cfg))


_PAIRS: dict = {}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """pair(name) -> (torch model, target directory, drafter directory), built once."""
    root = tmp_path_factory.mktemp("qwen3_next")

    def get(name):
        if name not in _PAIRS:
            overrides, taps, style = CONFIGS[name]
            model = make_model("qwen3_next", seed=list(CONFIGS).index(name) + 3, vocab_size=VOCAB, **overrides)
            target = save_model(model, root / name)
            restyle(target, style)
            _PAIRS[name] = (model, target, write_random_drafter(target, root / f"{name}-drafter", block_size=4,
                                                                taps=taps))
        return _PAIRS[name]

    yield get
    _PAIRS.clear()


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def prompts(vocab: int, seed: int = 3):
    rs = np.random.RandomState(seed)
    return [rs.randint(0, vocab, n).tolist() for n in PROMPT_LENGTHS]


def decode(target, drafter=None, sampling=Sampling(), **kw):
    """{index: (output ids, acceptance lengths)} of the prompts, 2 slots, pages of 16: plain decoding
    compiles the programs `assert_plain_greedy_equals_generate` compiled (jax's cache has them)."""
    config, params = target
    dcfg, dparams = drafter or (None, None)
    gen = BatchEngine(config, params, dcfg, dparams, batch_size=2, max_new_tokens=12, max_prompt_len=24,
                      page_size=16, sampling=sampling, speculation="fixed", **kw)
    return {r.index: (r.output_ids, r.acceptance_lengths) for r in gen.generate(prompts(config.vocab_size), seed=5)}


def outputs(results):
    return {i: out for i, (out, _) in results.items()}


# --------------------------------------------------------------------------- the model


def test_the_first_config_equals_transformers_logits(pair):
    """The everyday sibling of the next test: its logits checks, on the first config."""
    name = next(iter(CONFIGS))
    model, target_dir, _ = pair(name)
    check_logits(model, load_target(target_dir))


@pytest.mark.heavy  # the engines compile for most of a minute per config
@pytest.mark.parametrize("name", list(CONFIGS))
def test_config_decodes_as_transformers_and_dflash_greedy_as_plain_decoding(name, pair):
    """Logits equal transformers' for 150 tokens (three delta-rule chunks of 64, a ragged end),
    prefilled whole and as two right-padded pieces per row (rows of different lengths, whose padding
    must not touch the states); plain greedy decoding equals `generate`; DFlash (block 4, a random
    drafter) on per-slot caches equals plain greedy decoding, and some of its cycles kept drafts (a
    verify's rollback kept a prefix), but for MODEL_ONLY."""
    model, target_dir, drafter_dir = pair(name)
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    check_logits(model, target)
    assert_plain_greedy_equals_generate(model, target_dir)
    if name in MODEL_ONLY:
        return
    spec = decode(target, drafter)
    assert outputs(spec) == outputs(decode(target))
    assert max(a for _, acc in spec.values() for a in acc) > 1


def check_logits(model, target):
    config, params = target
    assert config.model_type == "qwen3_next"
    ids = np.random.RandomState(2).randint(0, VOCAB, (2, 150))
    ref = torch_logits(model, ids)
    out = forward(params, config, jnp.asarray(ids, jnp.int32), init_cache(config, 2, 160))
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=0)
    pieces = prefill_in_pieces(params, config, ids, [[70, 80], [60, 80]], width=80, cache_len=192)
    for r, got in enumerate(pieces):  # causal: a prefix's logits are the whole prompt's first ones
        np.testing.assert_allclose(got, ref[r, :len(got)], atol=1e-4, rtol=0, err_msg=f"row {r}")


@pytest.mark.heavy
@pytest.mark.parametrize("name", ["mixed"])  # one_kq_head's greedy decoding is the test above's (.ci/run's 50 minutes)
def test_dflash_sampled_on_a_page_pool_equals_plain_sampling(name, pair):
    """Seeded sampling (temperature 1): DFlash on a pool of 8 pages for 2 slots gives plain
    decoding's tokens (each position's key is the row's and the position's, whatever was drafted)."""
    target, drafter = load_target(pair(name)[1]), load_drafter(pair(name)[2])
    sampled = decode(target, drafter, SAMPLED, kv_pages=8)
    assert outputs(sampled) == outputs(decode(target, sampling=SAMPLED))
    assert outputs(sampled) != outputs(decode(target))  # really sampled


def test_bad_qwen3_next_config_is_a_one_line_error():
    good = {**BASE, **FAMILIES["qwen3_next"][2], "model_type": "qwen3_next"}
    assert model_config(good).rope.partial_rotary_factor == 0.25
    for change, message in (
            (dict(shared_expert_intermediate_size=0), "field 'shared_expert_intermediate_size' must be a positive"),
            (dict(mlp_only_layers=[4]), r"mlp_only_layers \[4\] are not layers of a 4-layer model"),
            (dict(decoder_sparse_step=0), "field 'decoder_sparse_step' must be a positive integer, got 0"),
            (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
            (dict(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
            (dict(num_experts_per_tok=7), "num_experts_per_tok 7 > num_experts 6")):
        with pytest.raises(ConfigError, match=message) as e:
            model_config({**good, **change})
        assert "\n" not in str(e.value) and "qwen3_next" in str(e.value)


# --------------------------------------------------------------------------- python -m infer


@pytest.mark.heavy
def test_infer_cli_on_a_two_device_mesh_with_a_page_pool_equals_plain_decoding(pair, tmp_path):
    """`python -m infer --mesh model=2 --kv-pages 8` (2 CPU devices: the delta-net's heads, the
    attention heads and the experts split in two), greedy and sampled, gives the tokens of plain
    decoding on one device."""
    _, target_dir, drafter_dir = pair("mixed")
    target = load_target(target_dir)
    rows = tmp_path / "prompts.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "input_ids": p}) + "\n"
                            for i, p in enumerate(prompts(VOCAB))))
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"}
    for sampling, flags in ((Sampling(), []), (SAMPLED, ["--temperature", "1.0", "--seed", "5"])):
        out = tmp_path / f"out-{sampling.temperature}.jsonl"
        cmd = [sys.executable, "-m", "infer", "--target", str(target_dir), "--drafter", str(drafter_dir),
               "--input", str(rows), "--output", str(out), "--max-new-tokens", "12", "--max-prompt-len", "24",
               "--batch-size", "2", "--mesh", "model=2", "--kv-pages", "8", "--page-size", "16", "--ignore-eos",
               "--quiet", "--speculation", "fixed", *flags]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = {int(r["id"]): r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
        assert got == outputs(decode(target, sampling=sampling)), sampling


def test_published_qwen3_coder_next_shape():
    """`--shape qwen3-coder-next` (bench --aot / --cost): 48 layers, 36 gated delta-net (16 q/k heads,
    32 value heads, x 128) and 12 gated attention (16 heads, 2 KV heads, x 256, a quarter rotating), every
    layer 512 experts top-10 of width 512 plus a shared expert of 512; scaled, the pattern stays whole."""
    from dflash_jax.shapes import published_configs

    target, drafter = published_configs(1.0, shape="qwen3-coder-next")
    assert (target.model_type, target.hidden_size, target.num_hidden_layers, target.num_attention_heads,
            target.num_key_value_heads, target.head_dim, target.vocab_size) == ("qwen3_next", 2048, 48, 16, 2, 256,
                                                                                151936)
    assert target.num_linear_layers == 36 and target.linear_layers[:4] == (True, True, True, False)
    lin, moe = target.linear_attention, target.moe
    assert (lin.k_heads, lin.v_heads, lin.k_dim, lin.v_dim) == (16, 32, 128, 128)
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.shared_expert_size) == (512, 10, 512, 512)
    assert all(target.sparse_layers) and target.rope.rotary_dim(256) == 64
    assert drafter.model.num_hidden_layers == 5 and drafter.model.hidden_size == 2048
    small, _ = published_configs(0.25, shape="qwen3-coder-next")
    assert small.num_hidden_layers == 12 and small.linear_layers == (True, True, True, False) * 3
