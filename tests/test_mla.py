"""Multi-head latent attention and DeepSeek-MoE targets (DeepSeek-V3 / Kimi-K2: `deepseek_v3`),
against transformers, on tiny random checkpoints.

- Six configs (`CASES`: q through a latent or one projection, interleaved or half-split RoPE, YaRN
  with its softmax mscale, one group or several, first dense layers, biases, tied embeddings,
  one shared expert or two): logits equal transformers', whole and in right-padded prefill
  pieces; plain greedy decoding equals transformers' `generate`; DFlash with a random drafter
  equals plain decoding, greedy and seeded sampled, on per-row caches and on a page pool (decoding: the
  configs in `DECODED`). (Everyday: the first config; the others `-m heavy`.)
- The cache holds one latent per position and layer (kv_lora_rank + qk_rope_head_dim values in two
  parts, no head axis), and the decode step's HLO holds no per-head key or value of a cached position: it
  attends over the latent (a positive control shows the check sees the expanded form).
- `python -m infer`: plain greedy equals transformers' `generate`; the pair on a 2-device mesh (query
  heads split over `model`, the latent whole on each device) with a page pool decodes the same tokens,
  greedy, and sampled as plain sampling on one device (`-m heavy`: subprocesses).
- Bad configs are one-line errors; the MTP layer of a real checkpoint is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax import forward, init_cache, load_drafter, load_target
from dflash_jax.engine import BatchEngine, Sampling
from dflash_jax.errors import ConfigError
from dflash_jax.families import model_config
from tiny import (FAMILIES, make_model, prefill_in_pieces, save_model,
                  write_random_drafter)

HERE = Path(__file__).resolve().parent
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0)
# name: (family, overrides of tests/tiny.py's config)
CASES = {
    "deepseek_v3": ("deepseek_v3", {}),
    "deepseek_v3-q-proj-half-split": ("deepseek_v3", dict(q_lora_rank=None, rope_interleave=False)),
    "deepseek_v3-yarn": ("deepseek_v3", dict(rope_parameters=YARN, max_position_embeddings=256)),
    "deepseek_v3-one-group": ("deepseek_v3", dict(n_group=1, topk_group=1, norm_topk_prob=False,
                                                  routed_scaling_factor=1.0, n_shared_experts=2)),
    "deepseek_v3-all-sparse-biased": ("deepseek_v3", dict(first_k_dense_replace=0, attention_bias=True,
                                                          num_experts_per_tok=3)),
    "deepseek_v3-8-heads-tied": ("deepseek_v3", dict(num_attention_heads=8, num_key_value_heads=8, v_head_dim=8,
                                                     qk_nope_head_dim=8, kv_lora_rank=16, tie_word_embeddings=True,
                                                     first_k_dense_replace=2)),
}
EVERYDAY = ("deepseek_v3",)
VOCAB = 24  # small, so a random drafter's guesses are accepted often enough to matter


def case_params(cases: dict = CASES, everyday: tuple = EVERYDAY):
    return [name if name in everyday else pytest.param(name, marks=pytest.mark.heavy) for name in cases]


def build(name: str, root: Path, cases: dict = CASES):
    """(torch model, HF directory, drafter directory) of a case."""
    family, overrides = cases[name]
    model = make_model(family, seed=len(name), **{"vocab_size": VOCAB, **overrides})
    path = save_model(model, root / "target")
    layers = model.config.num_hidden_layers
    drafter = write_random_drafter(path, root / "drafter", block_size=4, taps=(0, layers - 1), layers=1)
    return model, path, drafter


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def prompts(config, seed=3, lengths=(3, 15, 11, 7)):  # one prefill bucket (16): fewer programs to compile
    rs = np.random.RandomState(seed)
    return [rs.randint(0, config.vocab_size, n).tolist() for n in lengths]


ROWS = [Sampling(), Sampling(0.9, top_p=0.95)]  # each prompt greedy, then sampled
MAX_NEW = 24  # per row: enough cycles that a random drafter's guesses are accepted somewhere


def decoded(config, params, drafter=None, dparams=None, *, kv_pages=None):
    """(outputs, acceptance lengths) of the case's prompts decoded greedy and sampled (seed 7) in one
    per-row engine: 2 slots, 16-position pages (a pool of kv_pages)."""
    gen = BatchEngine(config, params, drafter, dparams, batch_size=2, max_new_tokens=MAX_NEW, max_prompt_len=16,
                      page_size=16, kv_pages=kv_pages, sampling=Sampling(per_row=True), speculation="fixed")
    rows = prompts(config)
    results = sorted(gen.generate(rows * 2, seed=7, sampling=[s for s in ROWS for _ in rows]), key=lambda r: r.index)
    return [r.output_ids for r in results], [a for r in results for a in r.acceptance_lengths]


def check_against_transformers(model, config, params, name):
    ids = np.random.RandomState(2).randint(0, VOCAB, (2, 40))
    out = forward(params, config, jnp.asarray(ids, jnp.int32), init_cache(config, 2, 48, page_size=16))
    np.testing.assert_allclose(np.asarray(out.logits), torch_logits(model, ids), atol=1e-4, rtol=0, err_msg=name)
    pieces = prefill_in_pieces(params, config, ids, [[13, 16], [16, 9]], width=16, cache_len=48)
    for r, got in enumerate(pieces):
        np.testing.assert_allclose(got, torch_logits(model, ids[r:r + 1, :len(got)])[0], atol=1e-4, rtol=0,
                                   err_msg=f"{name} row {r}")


@pytest.mark.parametrize("name", case_params())
def test_logits_equal_transformers_whole_and_in_padded_pieces(name, tmp_path):
    model, path, _ = build(name, tmp_path)
    config, params = load_target(path)
    assert config.mla is not None and config.moe.router == "sigmoid_grouped"
    check_against_transformers(model, config, params, name)


# Decoding (plain as transformers' `generate`, DFlash as plain) runs on the configs that change what a
# decode step reads or caches; the configs that change only RoPE, routing, biases or ties are checked
# against transformers by their logits, whole and in padded pieces (the cached path), and their decoding
# went for .ci/run's 50 minutes (2026-12-08).
DECODED = ("deepseek_v3", "deepseek_v3-8-heads-tied")  # the latent's width and heads change with the second


@pytest.mark.heavy  # engines compile for a minute per case
@pytest.mark.parametrize("name", DECODED)
def test_plain_decoding_equals_transformers_and_dflash_equals_plain(name, tmp_path):
    check_decoding(*build(name, tmp_path))


def check_decoding(model, path, drafter_dir):
    """Plain greedy decoding equals transformers' `generate`; DFlash with a random drafter on a page
    pool equals plain decoding, greedy and sampled at the same seed."""
    config, params = load_target(path)
    plain, _ = decoded(config, params)
    n = len(prompts(config))
    for prompt, got in zip(prompts(config), plain[:n]):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert got == ref[0, len(prompt):].tolist(), f"prompt of {len(prompt)} tokens"
    assert plain[n:] != plain[:n]  # the sampled rows sampled
    spec, accepted = decoded(config, params, *load_drafter(drafter_dir), kv_pages=6)
    assert spec == plain
    assert max(accepted) > 1  # drafts were accepted: the verify pass's rollback was exercised


# --------------------------------------------------------------------------- the latent cache


def tiny_config(**overrides):
    cfg = json.loads(json.dumps({**FAMILIES["deepseek_v3"][2], "model_type": "deepseek_v3", "vocab_size": VOCAB,
                                 "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3,
                                 "num_attention_heads": 4, "max_position_embeddings": 256}))
    return {**cfg, **overrides}


def shapes_in(hlo: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"[a-z]+[0-9]*\[([0-9,]*)\]", hlo)]


def per_head_cached(hlo: str, config, positions: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Arrays over cached positions (a dimension in `positions`: a page, the cache) that hold per-head
    keys or values (heads x qk_nope_head_dim or heads x v_head_dim, split or flattened)."""
    m, heads = config.mla, config.num_attention_heads
    per_head = {m.qk_nope_head_dim, m.v_head_dim, m.qk_nope_head_dim + m.v_head_dim}
    out = []
    for shape in shapes_in(hlo):
        flat = {heads * d for d in per_head}
        pairs = any(a == heads and b in per_head for a, b in zip(shape, shape[1:]))
        if set(positions) & set(shape) and (pairs or flat & set(shape)):
            out.append(shape)
    return out


def test_the_cache_holds_the_latent_and_decode_attends_over_it():
    # Distinct sizes, so a shape names what it holds: 6 heads, nope 12, v 20, latent 28 + 10, pages of
    # 16, a cache of 80 (no weight has a dimension of 16 or 80).
    config = model_config(tiny_config(num_attention_heads=6, num_key_value_heads=6, qk_nope_head_dim=12,
                                      v_head_dim=20, kv_lora_rank=28, qk_rope_head_dim=10, q_lora_rank=None))
    from dflash_jax.model import init_params

    params = init_params(config)
    cache = init_cache(config, 2, 80, page_size=16)
    assert cache.k.shape == (3, 2, 80, 28) and cache.v.shape == (3, 2, 80, 10)  # kv_lora_rank + rope a position
    step = jax.jit(lambda p, t, c: forward(p, config, t, c).logits)
    hlo = step.lower(params, jnp.zeros((2, 1), jnp.int32), cache).compile().as_text()
    assert not per_head_cached(hlo, config, (16, 80)), per_head_cached(hlo, config, (16, 80))[:5]

    # The positive control: the expanded form (kv_b_proj over the cached latent, as transformers
    # attends) is what the check finds.
    kv_b = params["model"]["layers_0"]["self_attn"]["kv_b_proj"]["kernel"]
    expanded = jax.jit(lambda c, w: jnp.einsum("bsl,xl->bsx", c[0, :, :, :28], w))
    assert per_head_cached(expanded.lower(cache.k, kv_b).compile().as_text(), config, (16, 80))


@pytest.mark.parametrize("change,message", [
    (dict(kv_lora_rank=0), "'kv_lora_rank' must be a positive integer"),
    (dict(qk_rope_head_dim=7), "qk_rope_head_dim 7 must be even"),
    (dict(n_group=3), "8 experts do not split into n_group 3"),
    (dict(topk_group=5), "topk_group 5 > n_group 4"),
    (dict(num_experts_per_tok=6, topk_group=2), "topk_group 2 groups hold fewer experts than num_experts_per_tok 6"),
    (dict(first_k_dense_replace=9), "first_k_dense_replace must be in 0..3"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
])
def test_bad_deepseek_config_is_a_one_line_error(change, message):
    with pytest.raises(ConfigError, match=re.escape(message)) as err:
        model_config(tiny_config(**change))
    assert "\n" not in str(err.value)


def test_the_multi_token_prediction_layer_is_skipped(tmp_path):
    """DeepSeek-V3 checkpoints carry their MTP layer as `model.layers.{num_hidden_layers}.*`: loading
    skips it, and the model is the one without it."""
    from safetensors.numpy import load_file, save_file

    model = make_model("deepseek_v3", seed=1, vocab_size=VOCAB, num_hidden_layers=2)
    path = save_model(model, tmp_path / "t")
    tensors = load_file(path / "model.safetensors")
    tensors.update({k.replace("layers.1.", "layers.2."): v for k, v in tensors.items() if "layers.1." in k})
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config, params = load_target(path)
    assert config.num_hidden_layers == 2 and "layers_2" not in params["model"]


# --------------------------------------------------------------------------- python -m infer, 2 devices


def infer_cli(target: Path, out: Path, rows: Path, *extra, devices: int = 1) -> list[list[int]]:
    """`python -m infer` on `devices` CPU devices: each row's output ids, in input order."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"}
    cmd = [sys.executable, "-m", "infer", "--target", str(target), "--input", str(rows), "--output", str(out),
           "--max-new-tokens", "12", "--max-prompt-len", "16", "--batch-size", "2", "--ignore-eos", "--quiet",
           "--speculation", "fixed", *extra]  # one cycle program: what these tests check is the family
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = {r["id"]: r["output_ids"] for r in map(json.loads, out.read_text().splitlines())}
    return [got[str(i)] for i in range(len(got))]


def check_cli_on_two_devices(model, target: Path, drafter: Path, tmp_path: Path):
    """`python -m infer`: plain greedy decoding equals transformers' `generate`; with the drafter on a
    2-device mesh (query heads and experts split over `model`, the latent whole on each) and a page
    pool, greedy equals it too, and sampled equals plain sampling on one device at the same seed."""
    config, _ = load_target(target)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": str(i), "input_ids": p}) + "\n" for i, p in enumerate(prompts(config))))
    want = []
    for prompt in prompts(config):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        want.append(ref[0, len(prompt):].tolist())
    assert infer_cli(target, tmp_path / "plain.jsonl", rows) == want
    mesh = ("--drafter", str(drafter), "--mesh", "model=2", "--kv-pages", "12")
    assert infer_cli(target, tmp_path / "mesh.jsonl", rows, *mesh, devices=2) == want
    sampled = ("--temperature", "0.9", "--top-p", "0.95", "--seed", "5")
    plain = infer_cli(target, tmp_path / "plain-sampled.jsonl", rows, *sampled)
    assert plain != want  # it sampled
    assert infer_cli(target, tmp_path / "mesh-sampled.jsonl", rows, *mesh, *sampled, devices=2) == plain


@pytest.mark.heavy  # four `python -m infer` runs
def test_infer_cli_equals_transformers_and_on_two_devices_equals_one(tmp_path):
    check_cli_on_two_devices(*build("deepseek_v3", tmp_path), tmp_path)
