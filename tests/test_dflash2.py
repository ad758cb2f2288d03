"""DFlash2 drafters (`dflash_jax.dflash2`): their format, and decoding with them against a PyTorch
reference written from vLLM's semantics (`tests/dflash2_reference.py`).

1. the config and checkpoint: what is read, what is refused, one line each
2. parity: drafter output, candidates, edge scores and walk; tokens and per-cycle acceptance
   lengths of whole runs (batch 1 and 8, per-row caches and the page pool)
3. identity convolutions and zero codebooks are DFlash exactly
4. sampling: rejection sampling against the selector's realised proposal keeps the target's
   distribution (chi-square), sample-and-match keeps plain decoding's seeded tokens
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from scipy import stats

from dflash2_reference import DFlash2Reference, write_dflash2_drafter
from dflash_jax import load_drafter, load_target
from dflash_jax.dflash2 import DFlash2Config
from dflash_jax.drafter import DrafterConfig, draft_hidden, extend_context, init_drafter_params
from dflash_jax.engine import BatchEngine, EngineSpec, Sampling
from dflash_jax.engine.sampling import rejection_accept
from dflash_jax.engine.step import _selector_scores, draft
from dflash_jax.errors import CheckpointError, ConfigError, DFlashError
from dflash_jax.kv import init_context_cache
from dflash_jax import forward, init_cache
from dflash_jax.model import CausalLM
from fixtures import tiny

MAX_NEW = 24


def by_index(results):
    return sorted(results, key=lambda r: r.index)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    """The tiny reference target, a DFlash2 drafter built on its trained DFlash drafter (random
    convolutions and selector on top, so some cycles still accept several drafts), and the same
    drafter with identity convolutions and zero codebooks."""
    root = tmp_path_factory.mktemp("dflash2")
    target, base = tiny() / "target", tiny() / "drafter"
    write_dflash2_drafter(target, root / "d2", base_dir=base, seed=3)
    write_dflash2_drafter(target, root / "identity", base_dir=base, identity=True)
    return target, root / "d2", root / "identity"


@pytest.fixture(scope="module")
def loaded(pair_dirs):
    target, d2, _ = pair_dirs
    return (*load_target(target), *load_drafter(d2))


@pytest.fixture(scope="module")
def reference(pair_dirs):
    target, d2, _ = pair_dirs
    return DFlash2Reference(target, d2)


@functools.cache
def prompts():
    rs = np.random.RandomState(7)
    return [rs.randint(0, 500, int(n)).tolist() for n in rs.randint(4, 16, 8)]


# --------------------------------------------------------------------------- 1. format


def config_dict(**dflash):
    return {"architectures": ["DFlash2DraftModel"], "model_type": "qwen3", "is_causal": False,
            "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "block_size": 8, "num_target_layers": 6,
            "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 3], "conv_kernel_size": 2,
                              "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4, **dflash}}


def test_config_read_and_written_in_the_published_format():
    config = DrafterConfig.from_hf_dict(config_dict(output_multiplier=0.5, final_logit_softcapping=20.0,
                                                    input_embedding_scale=2.0))
    assert config.dflash2 == DFlash2Config(2, 16, 8, 4, 0.5, 20.0, 2.0)
    out = config.to_hf_dict()
    assert out["architectures"] == ["DFlash2DraftModel"] and out["is_causal"] is False
    assert DrafterConfig.from_hf_dict(out) == config
    plain = DrafterConfig.from_hf_dict({**config_dict(), "architectures": ["DFlashDraftModel"],
                                        "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 3]}})
    assert plain.dflash2 is None and plain.to_hf_dict()["architectures"] == ["DFlashDraftModel"]


@pytest.mark.parametrize("change,message", [
    (lambda c: c["dflash_config"].pop("selector_rank"), "no dflash_config.selector_rank"),
    (lambda c: c["dflash_config"].update(conv_group_size=24), "conv_group_size 24 does not divide hidden_size 64"),
    (lambda c: c["dflash_config"].update(selector_top_k=600), "selector_top_k 600 exceeds the vocabulary"),
    (lambda c: c["dflash_config"].update(conv_kernel_size=0), "conv_kernel_size must be a positive integer"),
    (lambda c: c.update(architectures=["DFlashDraftModel"]), "do not name DFlash2DraftModel"),
])
def test_config_errors_name_the_problem(change, message):
    cfg = config_dict()
    change(cfg)
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_hf_dict(cfg)


def test_float16_is_refused_for_a_dflash2_drafter():
    with pytest.raises(ConfigError, match="float16.*bfloat16 or float32"):
        DrafterConfig.from_hf_dict(config_dict(), dtype="float16")


def test_checkpoint_loads_and_missing_or_stray_tensors_are_named(pair_dirs, tmp_path):
    from safetensors.numpy import load_file, save_file

    _, d2, _ = pair_dirs
    config, params = load_drafter(d2)
    assert config.dflash2 is not None and config.block_size == 8
    assert params["layers_1"]["mlp_conv"]["base_kernel"].shape == (2, 2, 64)
    assert params["candidate_selector"]["successor_codebook"].shape == (512, 8)
    tensors = load_file(d2 / "model.safetensors")

    missing = tmp_path / "missing"
    missing.mkdir()
    (missing / "config.json").write_text((d2 / "config.json").read_text())
    save_file({k: v for k, v in tensors.items() if k != "candidate_selector.successor_codebook"},
              missing / "model.safetensors")
    with pytest.raises(CheckpointError, match="missing tensor 'candidate_selector.successor_codebook'"):
        load_drafter(missing)

    # A DFlash2 checkpoint whose config says plain DFlash: refused, never read without its selector.
    stray = tmp_path / "stray"
    stray.mkdir()
    cfg = json.loads((d2 / "config.json").read_text())
    for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        cfg["dflash_config"].pop(key)
    (stray / "config.json").write_text(json.dumps({**cfg, "architectures": ["DFlashDraftModel"]}))
    save_file(tensors, stray / "model.safetensors")
    with pytest.raises(CheckpointError, match="unexpected tensor .*a DFlash2 drafter's tensor"):
        load_drafter(stray)


def test_convert_keeps_a_dflash2_drafter(pair_dirs, loaded, tmp_path):
    _, d2, _ = pair_dirs
    out = tmp_path / "converted"
    proc = subprocess.run([sys.executable, "-m", "dflash_jax.convert", "--hf", str(d2), "--out", str(out), "--quiet"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    config, params = load_drafter(out)
    assert config == loaded[2]
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded[3])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tree_verification_refuses_a_dflash2_drafter(loaded):
    tc, tp, dc, dp = loaded
    with pytest.raises(DFlashError, match="DFlash2 drafter drafts by its candidate selector"):
        BatchEngine(tc, tp, dc, dp, tree_budget=8, max_new_tokens=8, max_prompt_len=16, batch_size=1, speculation="fixed")
    with pytest.raises(DFlashError, match="--acceptance must be one of"):
        BatchEngine(tc, tp, dc, dp, acceptance="greedy", max_new_tokens=8, max_prompt_len=16, batch_size=1, speculation="fixed")


# --------------------------------------------------------------------------- 2. parity


def test_drafter_candidates_scores_and_walk_match_the_reference(loaded, reference):
    tc, tp, dc, dp = loaded
    seq = prompts()[0] + reference.plain_greedy(prompts()[0], 3)[-3:]
    n = len(seq) - 1
    out = forward(tp, tc, jnp.asarray([seq[:-1]], jnp.int32), init_cache(tc, 1, 64), taps=dc.target_layer_ids)
    features = reference.context_features(seq[:-1])
    np.testing.assert_allclose(np.asarray(out.tap_features[0]), features.numpy(), atol=1e-4)
    context = extend_context(dp, dc, out.tap_features, init_context_cache(dc, 1, 64), jnp.array([n]))
    block = jnp.asarray([[seq[-1]] + [dc.mask_token_id] * 7], jnp.int32)
    embeds = CausalLM(tc).apply({"params": tp}, block, method=CausalLM.embed)
    hidden = draft_hidden(dp, dc, embeds, context)
    ref_hidden = reference.drafter_hidden(block[0].tolist(), torch.arange(n, n + 8), features)
    np.testing.assert_allclose(np.asarray(hidden[0]), ref_hidden.numpy(), atol=1e-4)

    spec = EngineSpec(target=tc, drafter=dc, block_size=8, sampling=Sampling(), max_new_tokens=8, cache_len=64)
    scores, candidates = _selector_scores(tp, dp, spec, block[:, 0], hidden[:, 1:])
    ref_c, ref_u = reference.candidates(ref_hidden[1:])
    ref_s = reference.edge_scores(ref_hidden[1:], ref_c, ref_u, seq[-1])
    np.testing.assert_array_equal(np.asarray(candidates[0]), ref_c.numpy())
    np.testing.assert_allclose(np.asarray(scores[0]), ref_s.numpy(), atol=1e-4)
    drafts = np.asarray(draft(tp, dp, spec, block[:, 0], context)[0])
    ref_drafts, argmax = reference.draft(seq)
    np.testing.assert_array_equal(drafts, ref_drafts.numpy())
    assert (ref_drafts != argmax).any(), "the selector must change some drafts here, or the walk is untested"


@functools.lru_cache(maxsize=None)
def reference_run(reference, prompt: tuple) -> dict:
    run = reference.generate(list(prompt), MAX_NEW)
    assert run["output_ids"] == reference.plain_greedy(list(prompt), MAX_NEW)
    return run


@pytest.mark.parametrize("batch,kv_pages", [
    pytest.param(8, None, id="batch8"),
    pytest.param(1, None, id="batch1", marks=pytest.mark.heavy),
    pytest.param(8, 24, id="batch8-page-pool", marks=pytest.mark.heavy),
    pytest.param(1, 8, id="batch1-page-pool", marks=pytest.mark.heavy),
])
def test_tokens_and_acceptance_lengths_match_the_reference(loaded, reference, batch, kv_pages):
    tc, tp, dc, dp = loaded
    gen = BatchEngine(tc, tp, dc, dp, batch_size=batch, max_new_tokens=MAX_NEW, max_prompt_len=16,
                      kv_pages=kv_pages, page_size=16, speculation="fixed")
    results = by_index(gen.generate(prompts()))
    accepted = []
    for prompt, result in zip(prompts(), results):
        ref = reference_run(reference, tuple(prompt))
        assert prompt + result.output_ids == ref["output_ids"]
        assert result.acceptance_lengths == ref["acceptance_lengths"]
        accepted += result.acceptance_lengths
    assert max(accepted) >= 3, "no cycle accepted several drafts: the comparison would be weak"


# --------------------------------------------------------------------------- 3. DFlash is DFlash2's special case


def test_identity_convolutions_and_zero_codebooks_reproduce_dflash(pair_dirs):
    target, _, identity = pair_dirs
    tc, tp = load_target(target)
    dc2, dp2 = load_drafter(identity)
    dc, dp = load_drafter(tiny() / "drafter")
    cases = json.loads((tiny() / "greedy_cases.json").read_text())
    runs = []
    for drafter, params in ((dc, dp), (dc2, dp2)):
        gen = BatchEngine(tc, tp, drafter, params, batch_size=4, max_new_tokens=40, max_prompt_len=32, speculation="fixed")
        runs.append(by_index(gen.generate(cases["prompts"])))
    for prompt, output, acceptance, plain, d2 in zip(cases["prompts"], cases["outputs"], cases["acceptance_lengths"],
                                                      *runs):
        assert prompt + d2.output_ids == output == prompt + plain.output_ids
        assert d2.acceptance_lengths == acceptance == plain.acceptance_lengths


# --------------------------------------------------------------------------- 4. sampling


def chi_square_p(counts, expected_probs, min_expected: float = 5.0) -> float:
    """The chi-square test's p-value of counts against probabilities, cells expected below
    min_expected pooled into one."""
    counts, expected = np.ravel(counts), np.ravel(expected_probs) * np.sum(counts)
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    keep = exp > 0
    assert obs[~keep].sum() == 0, "a sample of probability zero"
    return stats.chisquare(obs[keep], exp[keep]).pvalue


def test_rejection_accept_draws_from_p_whatever_the_proposal():
    """One draft drawn from a proposal q over 4 candidates: the kept-or-replaced token is
    distributed as the target's p (chi-square), and q itself is far from p (the test's power)."""
    n, vocab = 20000, 6
    p = np.array([0.05, 0.3, 0.1, 0.25, 0.2, 0.1])
    candidates = np.array([1, 3, 5, 0])
    rows = np.log(np.array([0.5, 0.1, 0.3, 0.1]))  # q: the proposal over the candidates
    rs = np.random.RandomState(0)
    picked = rs.choice(4, size=n, p=np.exp(rows))
    tokens, accepted = rejection_accept(
        jnp.broadcast_to(jnp.asarray(p, jnp.float32), (n, 2, vocab)), jnp.asarray(candidates[picked][:, None]),
        jnp.broadcast_to(jnp.asarray(candidates), (n, 1, 4)), jnp.broadcast_to(jnp.asarray(rows, jnp.float32), (n, 1, 4)),
        jnp.asarray(picked[:, None], jnp.int32), jnp.ones((n,)), jax.random.split(jax.random.PRNGKey(1), n),
        jnp.broadcast_to(jnp.arange(2), (n, 2)))
    first = np.bincount(np.asarray(tokens[:, 0]), minlength=vocab)
    assert chi_square_p(first, p) > 1e-3
    q_full = np.zeros(vocab)
    q_full[candidates] = np.exp(rows)
    assert chi_square_p(np.bincount(candidates[picked], minlength=vocab), p) < 1e-6
    expected_rate = np.minimum(p, q_full).sum()  # P(accept) = sum min(p, q)
    assert abs(np.mean(np.asarray(accepted)) - expected_rate) < 0.02


@functools.cache
def dflash2_sampling_setup():
    """The sampling suite's target (12 tokens, peaked) with a DFlash2 drafter of 4 candidates whose
    convolutions and selector are random enough to matter."""
    from fixtures import sampling_setup

    target, tparams, drafter, dparams = sampling_setup("qwen3")
    config = dataclasses.replace(drafter, dflash2=DFlash2Config(conv_group_size=8, selector_rank=8, selector_top_k=4))
    params = init_drafter_params(config, jax.random.PRNGKey(52))
    keys = iter(jax.random.split(jax.random.PRNGKey(3), 64))
    params = jax.tree_util.tree_map_with_path(
        lambda path, x: x + (0.1 if "codebook" in str(path) or "base_kernel" in str(path) else 0.05)
        * jax.random.normal(next(keys), x.shape, x.dtype) if ("conv" in str(path) or "candidate" in str(path)) else x,
        params)
    # the plain drafter's weights (whose first draft the target often samples) under the new parts
    params = {**params, **{k: v for k, v in dparams.items() if not k.startswith("layers")}}
    for i in range(drafter.model.num_hidden_layers):
        params[f"layers_{i}"] = {**params[f"layers_{i}"], **dparams[f"layers_{i}"]}
    return target, tparams, config, params


@pytest.mark.parametrize("temperature", [1.0, pytest.param(0.7, marks=pytest.mark.heavy)])
def test_rejection_sampling_keeps_the_target_distribution(temperature):
    from fixtures import N_SAMPLES, SAMPLE_PROMPT, exact_joint

    target, tparams, drafter, dparams = dflash2_sampling_setup()
    sampling = Sampling(temperature=temperature)
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=512, max_new_tokens=3,
                      max_prompt_len=16, sampling=sampling, speculation="fixed")
    assert gen.spec.rejection
    results = by_index(gen.generate([list(SAMPLE_PROMPT)] * N_SAMPLES, seed=99, indices=range(N_SAMPLES)))
    tokens = np.array([r.output_ids for r in results])
    assert np.mean([r.acceptance_lengths[0] >= 2 for r in results]) > 0.2, "drafts rarely accepted: a weak test"
    exact = exact_joint(sampling)
    v = exact.shape[0]
    counts = np.zeros((v, v, v))
    np.add.at(counts, tuple(tokens.T), 1)
    assert chi_square_p(counts.sum(0), exact.sum(0)) > 1e-3  # (t2, t3): t3 is the first the rule decides
    assert chi_square_p(counts.sum(2), exact.sum(2)) > 1e-3


def alternating_dfa(vocab, banned=((0, 3, 5), (1, 2, 4))):
    """Two states, alternating, each banning a few tokens (and the last, the fixtures' eos): each
    position's mask depends on the tokens before it."""
    from test_constrained import Dfa

    keep = [[t for t in range(vocab - 1) if t not in b] for b in banned]
    return Dfa.of({0: {t: 1 for t in keep[0]}, 1: {t: 0 for t in keep[1]}}, set(), vocab, eos=())


def masked_joint(sampling, dfa):
    """p(t1, t2, t3) of plain sampling under the automaton: each step's softmax(logits / T) over the
    tokens its state allows, renormalised (numpy, from the target's exact logits)."""
    from fixtures import SAMPLE_PROMPT, exact_logits

    logits = exact_logits().astype(np.float64) / sampling.temperature
    p = len(SAMPLE_PROMPT)
    v = logits.shape[-1]
    joint = np.zeros((v, v, v))
    for t1 in range(v):
        for t2 in range(v):
            for t3 in range(v):
                prob, state = 1.0, dfa.initial
                for t, row in ((t1, logits[0, 0, p - 1]), (t2, logits[t1, 0, p]), (t3, logits[t1, t2, p + 1])):
                    ok = np.array([dfa.next(state, x) >= 0 for x in range(v)])
                    if not ok[t]:
                        prob = 0.0
                        break
                    w = np.where(ok, np.exp(row - row.max()), 0.0)
                    prob *= w[t] / w.sum()
                    state = dfa.next(state, t)
                joint[t1, t2, t3] = prob
    return joint


@pytest.mark.heavy  # 4096 rows of the DFlash2 engine with constraints
def test_constrained_rejection_sampling_keeps_the_masked_target_distribution():
    """A DFlash2 drafter's selector masked by each row's automaton, its proposal renormalised over the
    allowed candidates, and rejection sampling against the masked target: the output is distributed as
    plain sampling under the constraint (chi-square), every row walks its automaton, drafts accepted."""
    from fixtures import N_SAMPLES, SAMPLE_PROMPT

    target, tparams, drafter, dparams = dflash2_sampling_setup()
    dfa = alternating_dfa(target.vocab_size)
    sampling = Sampling(temperature=1.0, per_row=True)
    gen = BatchEngine(target, tparams, drafter, dparams, block_size=4, batch_size=512, max_new_tokens=3,
                      max_prompt_len=16, sampling=sampling, speculation="fixed", constraint_states=4)
    assert gen.spec.rejection
    rows = [dataclasses.replace(sampling, constraint=dfa)] * N_SAMPLES
    results = by_index(gen.generate([list(SAMPLE_PROMPT)] * N_SAMPLES, seed=99, indices=range(N_SAMPLES),
                                    sampling=rows))
    tokens = np.array([r.output_ids for r in results])
    assert all(s >= 0 for t in tokens for s in dfa.walk(t)), "a token outside the constraint"
    assert np.mean([r.acceptance_lengths[0] >= 2 for r in results]) > 0.2, "drafts rarely accepted: a weak test"
    exact = masked_joint(sampling, dfa)
    v = exact.shape[0]
    counts = np.zeros((v, v, v))
    np.add.at(counts, tuple(tokens.T), 1)
    assert chi_square_p(counts.sum(0), exact.sum(0)) > 1e-3  # (t2, t3): t3 is the first the rule decides
    assert chi_square_p(counts.sum(2), exact.sum(2)) > 1e-3


# greedy under -m heavy: a greedy DFlash2 run is the reference's (test_tokens_and_acceptance_lengths_...)
@pytest.mark.parametrize("temperature", [pytest.param(0.0, marks=pytest.mark.heavy), 1.0])
def test_constrained_match_keeps_constrained_plain_decodings_seeded_tokens(temperature):
    """Sample-and-match with the selector's walk masked: plain decoding's tokens under the constraint,
    greedy and seeded, with unconstrained rows beside the constrained ones (which keep theirs)."""
    target, tparams, drafter, dparams = dflash2_sampling_setup()
    dfa = alternating_dfa(target.vocab_size)
    rs = np.random.RandomState(4)
    batch = [rs.randint(0, 11, int(n)).tolist() for n in rs.randint(3, 9, 6)]
    sampling = Sampling(temperature=temperature, per_row=True)
    rows = [dataclasses.replace(sampling, constraint=dfa if i % 2 == 0 else None) for i in range(len(batch))]
    runs = []
    for block in (1, 4):
        gen = BatchEngine(target, tparams, drafter if block > 1 else None, dparams if block > 1 else None,
                          block_size=block, batch_size=3, max_new_tokens=12, max_prompt_len=16, sampling=sampling,
                          acceptance="match", speculation="fixed", constraint_states=4)
        runs.append([r.output_ids for r in by_index(gen.generate(batch, seed=5, sampling=rows))])
    assert runs[0] == runs[1]
    assert all(s >= 0 for ids in runs[0][::2] for s in dfa.walk(ids))
    assert any(s < 0 for ids in runs[0][1::2] for s in dfa.walk(ids))  # the free rows leave it


@pytest.mark.heavy  # the constrained test above runs unconstrained rows beside its constrained ones
def test_match_keeps_plain_decodings_seeded_tokens():
    target, tparams, drafter, dparams = dflash2_sampling_setup()
    sampling = Sampling(temperature=1.0)
    rs = np.random.RandomState(4)
    batch = [rs.randint(0, 11, int(n)).tolist() for n in rs.randint(3, 9, 6)]
    runs = []
    for block, acceptance in ((1, "match"), (4, "match")):
        gen = BatchEngine(target, tparams, drafter if block > 1 else None, dparams if block > 1 else None,
                          block_size=block, batch_size=3, max_new_tokens=12, max_prompt_len=16, sampling=sampling,
                          acceptance=acceptance, speculation="fixed")
        runs.append([r.output_ids for r in by_index(gen.generate(batch, seed=5))])
    assert runs[0] == runs[1]
