"""Drafter training: anchors, the attention layout, loss weights, end to end, resume, export."""

import dataclasses
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import load_drafter, load_target
from dflash_jax.config import ModelConfig
from dflash_jax.attention import dense_attention
from dflash_jax.drafter import DFlashDrafter, DraftAttention, DrafterConfig, draft_hidden, extend_context, \
    init_drafter_params
from dflash_jax.model import init_params
from dflash_jax.engine import BatchEngine
from dflash_jax.kv import init_cache, init_context_cache
from dflash_jax.model import CausalLM, forward
from dflash_jax.training import block_layout, default_gamma, drafter_loss, drafter_miss, LossSpec, \
    miss_tilted_anchors, position_difficulty, sample_anchors, target_features
from train.config import TrainConfigError, load_config
from train.export import export, restore_params
from fixtures import TINY

REPO = Path(__file__).resolve().parents[1]
TINY_TARGET = TINY / "target"

TARGET = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True)
DRAFTER = DrafterConfig(model=TARGET.replace(num_hidden_layers=2, sliding_windows=(None, None)), block_size=4,
                        mask_token_id=63, target_layer_ids=(0, 2), num_target_layers=3)


# ----------------------------------------------------------------------------- anchors, layout, weights


def test_anchors_are_eligible_distinct_sorted_and_redrawn():
    mask = np.zeros((3, 40), np.int32)
    mask[0, 10:30] = 1  # eligible 10..28 (19 positions)
    mask[1, [5, 6, 20, 30, 31, 32]] = 1  # eligible 5, 30, 31
    mask[2, 39] = 1  # the last position has no successor: nothing eligible
    anchors, valid = map(np.asarray, sample_anchors(jax.random.PRNGKey(0), jnp.asarray(mask), 8))
    assert valid.sum(1).tolist() == [8, 3, 0]
    for row in range(3):
        a = anchors[row][valid[row]]
        assert (mask[row, a] == 1).all() and (mask[row, a + 1] == 1).all()
        assert len(set(a.tolist())) == len(a) and (np.diff(a) > 0).all()
    assert sorted(anchors[1][valid[1]].tolist()) == [5, 30, 31]
    other, _ = sample_anchors(jax.random.PRNGKey(1), jnp.asarray(mask), 8)
    assert np.asarray(other)[0].tolist() != anchors[0].tolist()
    # Uniform: over many draws every eligible position is picked about equally often.
    counts = np.zeros(40)
    for k in range(200):
        a, v = sample_anchors(jax.random.PRNGKey(k), jnp.asarray(mask[:1]), 4)
        counts[np.asarray(a)[0][np.asarray(v)[0]]] += 1
    picked = counts[10:29]
    assert counts.sum() == 800 and picked.min() > 20 and picked.max() < 70  # expected 42 each


def test_weighted_anchors_favour_heavy_positions_and_stay_eligible():
    mask = np.zeros((2, 40), np.int32)
    mask[0, :] = 1  # eligible 0..38
    mask[1, [5, 6, 30, 31]] = 1  # eligible 5 and 30 only
    weights = np.ones((2, 40), np.float32)
    weights[0, 10:15] = 20.0
    heavy = 0
    for k in range(100):
        a, v = map(np.asarray, sample_anchors(jax.random.PRNGKey(k), jnp.asarray(mask), 4, jnp.asarray(weights)))
        assert v.sum(1).tolist() == [4, 2] and sorted(a[1][v[1]].tolist()) == [5, 30]
        assert len(set(a[0].tolist())) == 4 and (np.diff(a[0]) > 0).all() and a[0].max() <= 38
        heavy += int(((a[0] >= 10) & (a[0] < 15)).sum())
    # Uniform draws would put 5/39 of the 400 anchors (about 51) on positions 10..14.
    assert heavy > 200


def test_miss_tilted_anchors_favour_drafter_misses_and_stay_eligible():
    mask = np.zeros((2, 40), np.int32)
    mask[0, :] = 1  # eligible 0..38
    mask[1, [5, 6, 30, 31]] = 1  # eligible 5 and 30 only
    seen = []

    def miss_fn(cand):  # the drafter "misses" only at positions 20..24
        seen.append(cand)
        return ((cand >= 20) & (cand < 25)).astype(jnp.float32)

    missed = 0
    for k in range(100):
        a, v = map(np.asarray, miss_tilted_anchors(jax.random.PRNGKey(k), jnp.asarray(mask), 4, None, miss_fn, 20.0))
        assert seen[-1].shape == (2, 16)  # 4N candidates go through the drafter
        assert v.sum(1).tolist() == [4, 2] and sorted(a[1][v[1]].tolist()) == [5, 30]
        assert len(set(a[0].tolist())) == 4 and (np.diff(a[0]) > 0).all() and a[0].max() <= 38
        missed += int(((a[0] >= 20) & (a[0] < 25)).sum())
    # Uniform draws would put 5/39 of the 400 anchors (about 51) on positions 20..24.
    assert missed > 150


def test_position_difficulty_is_one_minus_the_target_probability(models):
    tparams, _ = models
    tokens = jnp.asarray(np.random.RandomState(2).randint(0, 64, (2, 10)), jnp.int32)
    final = target_features(tparams, TARGET, tokens, (TARGET.num_hidden_layers - 1,))
    head = lambda h: CausalLM(TARGET).apply({"params": tparams}, h, method=CausalLM.logits)
    got = np.asarray(position_difficulty(final, head, tokens, chunk=4))
    logits = forward(tparams, TARGET, tokens, init_cache(TARGET, 2, 10)).logits
    p = np.asarray(jax.nn.softmax(logits[:, :-1], -1))
    want = 1 - np.take_along_axis(p, np.asarray(tokens)[:, 1:, None], -1)[..., 0]
    assert (got[:, 0] == 0).all()
    np.testing.assert_allclose(got[:, 1:], want, atol=1e-5)


def test_loss_weights_decay_and_vanish_where_there_is_no_loss():
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    s, b = 12, 4
    tokens = jnp.arange(s)[None] + 100
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1]])
    anchors, valid = jnp.asarray([[2, 5, 9, 0]]), jnp.asarray([[True, True, True, False]])
    lay = block_layout(tokens, mask, anchors, valid, block_size=b, mask_token_id=7, gamma=2.0)
    w = np.asarray(lay.weights[0])
    decay = [0, 1, np.exp(-0.5), np.exp(-1.0)]
    np.testing.assert_allclose(w[0], decay, rtol=1e-6)  # positions 3, 4, 5 all in the mask
    np.testing.assert_allclose(w[1], [0, 1, 0, np.exp(-1.0)], rtol=1e-6)  # position 7 is outside the mask
    np.testing.assert_allclose(w[2], [0, 1, np.exp(-0.5), 0], rtol=1e-6)  # 12 is past the end
    np.testing.assert_array_equal(w[3], 0)  # an invalid anchor carries no loss
    assert np.asarray(lay.tokens[0]).reshape(4, b)[:, 0].tolist() == [102, 105, 109, 100]
    assert (np.asarray(lay.tokens[0]).reshape(4, b)[:, 1:] == 7).all()
    assert np.asarray(lay.targets[0, 0]).tolist() == [102, 103, 104, 105]
    assert np.asarray(lay.positions[0]).reshape(4, b)[1].tolist() == [5, 6, 7, 8]


@pytest.fixture(scope="module")
def models():
    tparams = init_params(TARGET, jax.random.PRNGKey(0))
    dparams = init_drafter_params(DRAFTER, jax.random.PRNGKey(1))
    return tparams, dparams


def block_hiddens(dparams, features, embeds, anchors, s):
    """Drafter hidden states of all blocks through the training path, [N, B, D]."""
    n, b = len(anchors), DRAFTER.block_size
    a = jnp.asarray([anchors])
    lay = block_layout(jnp.zeros((1, s), jnp.int32), jnp.ones((1, s)), a, jnp.ones_like(a, bool),
                       block_size=b, mask_token_id=DRAFTER.mask_token_id, gamma=4.0)
    h = DFlashDrafter(DRAFTER).apply({"params": dparams}, embeds, lay.positions, features, lay.ctx_mask,
                                     method=DFlashDrafter.train_hidden)
    return h.reshape(n, b, -1)


def test_a_block_sees_only_context_before_its_anchor_and_itself(models):
    tparams, dparams = models
    s, anchors, b = 24, [3, 9, 15], DRAFTER.block_size
    rng = np.random.RandomState(0)
    features = jnp.asarray(rng.randn(1, s, 2 * 32), jnp.float32)
    embeds = jnp.asarray(rng.randn(1, len(anchors) * b, 32), jnp.float32)
    ref = block_hiddens(dparams, features, embeds, anchors, s)
    for j, a in enumerate(anchors):
        # Context at or after the anchor: invisible to block j.
        late = features.at[:, a:].add(5.0)
        np.testing.assert_allclose(block_hiddens(dparams, late, embeds, anchors, s)[j], ref[j], atol=1e-6)
        # Other blocks' inputs: invisible.
        others = embeds.reshape(len(anchors), b, 32).at[jnp.arange(len(anchors)) != j].add(5.0).reshape(1, -1, 32)
        np.testing.assert_allclose(block_hiddens(dparams, features, others, anchors, s)[j], ref[j], atol=1e-6)
        # The test has power: the position just before the anchor is seen.
        early = features.at[:, a - 1].add(5.0)
        assert np.abs(np.asarray(block_hiddens(dparams, early, embeds, anchors, s)[j] - ref[j])).max() > 1e-3
        # And training computes what decoding computes for a block at that anchor.
        ctx = extend_context(dparams, DRAFTER, features[:, :a], init_context_cache(DRAFTER, 1, 32), jnp.array([a]))
        decode = draft_hidden(dparams, DRAFTER, embeds[:, j * b:(j + 1) * b], ctx)
        np.testing.assert_allclose(np.asarray(decode[0]), np.asarray(ref[j]), atol=1e-5)


def dense_train_pass(self, x, cos, sin, ctx_k, ctx_v, ctx_mask, block_size):
    """The drafter's training attention as first written: one dense softmax over [context ; every
    block's keys] with a same-block mask (every block scored against every other, then masked)."""
    k, v = self.kv(x, cos, sin)
    t = x.shape[1]
    same = jnp.arange(t)[:, None] // block_size == jnp.arange(t)[None, :] // block_size
    mask = jnp.concatenate([ctx_mask, jnp.broadcast_to(same, (x.shape[0], t, t))], axis=-1)
    out = dense_attention(self.queries(x, cos, sin), jnp.concatenate([ctx_k, k], 1), jnp.concatenate([ctx_v, v], 1),
                          mask)
    return self.o_proj(out.astype(x.dtype))


@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.heavy), "attention",
                                   pytest.param("layer", marks=pytest.mark.heavy)])
def test_block_attention_loss_and_gradients_equal_the_dense_path(models, monkeypatch, remat):
    """Context-before-anchor plus in-block attention, merged by log-sum-exp and rematerialised by
    each policy, gives the loss and gradients of dense attention over every block (float32)."""
    tparams, dparams = models
    drafter = dataclasses.replace(DRAFTER, model=DRAFTER.model.replace(sliding_windows=(None, 6)))
    dparams = jax.tree.map(lambda p: p * 3.0, dparams)  # sharper attention than the init's
    rng = np.random.RandomState(3)
    tokens = jnp.asarray(rng.randint(0, 60, (2, 20)), jnp.int32)
    mask = jnp.ones((2, 20), jnp.int32).at[1, :4].set(0)
    spec = LossSpec(target=TARGET, drafter=drafter, num_anchors=4, gamma=4.0, remat=remat)
    run = lambda: jax.jit(jax.value_and_grad(drafter_loss, has_aux=True), static_argnums=2)  # noqa: E731 (a new cache)
    (loss, metrics), grads = run()(dparams, tparams, spec, tokens, mask, jax.random.PRNGKey(5))
    monkeypatch.setattr(DraftAttention, "train_pass", dense_train_pass)
    (ref_loss, ref_metrics), ref_grads = run()(dparams, tparams, dataclasses.replace(spec, remat="none"), tokens, mask,
                                             jax.random.PRNGKey(5))
    assert float(metrics["anchors"]) == 8 and float(ref_loss) > 0.1
    np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    flat, ref_flat = jax.tree.leaves(grads), jax.tree.leaves(ref_grads)
    assert max(float(jnp.abs(g).max()) for g in ref_flat) > 1e-3
    for g, r in zip(flat, ref_flat):
        np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-5)


def test_drafter_miss_is_the_decoding_first_slot_miss(models):
    """drafter_miss at anchor a equals 1 - p(x_{a+1}) from the decoding path's draft of the
    block [x_a, MASK] after context 0..a-1: S blocks at once, none seeing another."""
    tparams, dparams = models
    s = 12
    tokens = jnp.asarray(np.random.RandomState(3).randint(0, 63, (2, s)), jnp.int32)
    features = target_features(tparams, TARGET, tokens, DRAFTER.target_layer_ids)
    lm = CausalLM(TARGET)
    head = lambda h: lm.apply({"params": tparams}, h, method=CausalLM.logits)
    embed = lambda ids: lm.apply({"params": tparams}, ids, method=CausalLM.embed)
    every = jnp.broadcast_to(jnp.arange(s), (2, s))
    got = np.asarray(drafter_miss(dparams, DRAFTER, embed, head, features, tokens, every, chunk=5))
    assert (got[:, -1] == 0).all() and got[:, :-1].std() > 1e-3
    for row in range(2):
        for a in (1, 4, 10):
            ctx = extend_context(dparams, DRAFTER, features[row:row + 1, :a], init_context_cache(DRAFTER, 1, 16),
                                 jnp.array([a]))
            block = jnp.asarray([[int(tokens[row, a]), DRAFTER.mask_token_id]])
            p = jax.nn.softmax(head(draft_hidden(dparams, DRAFTER, embed(block), ctx))[0, 1])
            assert got[row, a] == pytest.approx(1 - float(p[int(tokens[row, a + 1])]), abs=1e-5)


def test_block_loss_ignores_tokens_it_must_not_see(models):
    """End to end through the loss: with one anchor, changing tokens after the block's last
    slot leaves the loss unchanged; changing a token before the anchor changes it."""
    tparams, dparams = models
    s = 20
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, 60, (1, s)), jnp.int32)
    mask = jnp.zeros((1, s), jnp.int32).at[:, 8:10].set(1)  # one eligible anchor: 8
    spec = LossSpec(target=TARGET, drafter=DRAFTER, num_anchors=1, gamma=4.0, ce_chunk=8)
    loss = lambda t: float(drafter_loss(dparams, tparams, spec, t, mask, jax.random.PRNGKey(0))[0])
    ref = loss(tokens)
    assert loss(tokens.at[:, 12:].set(1)) == pytest.approx(ref, abs=1e-6)
    assert abs(loss(tokens.at[:, 5].set((tokens[0, 5] + 1) % 60)) - ref) > 1e-4
    # Hard-anchor sampling changes which anchors are drawn, never what a block sees: with one
    # eligible anchor the loss is the same (the difficulty tap is split off the drafter's features).
    # (Both tilts at once: each is a program of its own to compile.)
    tilted = dataclasses.replace(spec, anchor_hardness=1.0, anchor_miss=2.0)
    assert float(drafter_loss(dparams, tparams, tilted, tokens, mask, jax.random.PRNGKey(0))[0]) == \
        pytest.approx(ref, abs=1e-6)


# ----------------------------------------------------------------------------- config


def test_config_overrides_and_unknown_keys(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("target: t\ndata: {conversations: c.jsonl}\ntrain: {output_dir: o}\n")
    cfg = load_config(path, ["train.steps=7", "drafter.block_size=8", "train.lr=1e-3"])
    assert cfg["train"]["steps"] == 7 and cfg["drafter"]["block_size"] == 8 and cfg["train"]["lr"] == 1e-3
    with pytest.raises(TrainConfigError, match="unknown config key 'train.stepz'"):
        load_config(path, ["train.stepz=7"])
    with pytest.raises(TrainConfigError, match="config needs target"):
        load_config(None, ["data.conversations=x", "train.output_dir=o"])
    with pytest.raises(TrainConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(TrainConfigError, match="anchor_hardness must be a number >= 0"):
        load_config(path, ["train.anchor_hardness=-1"])
    with pytest.raises(TrainConfigError, match="anchor_miss must be a number >= 0"):
        load_config(path, ["train.anchor_miss=-0.5"])
    with pytest.raises(TrainConfigError, match="train.remat must be none, attention or layer, got 'full'"):
        load_config(path, ["train.remat=full"])
    with pytest.raises(TrainConfigError, match="train.fsdp must be true or false, got 'yes please'"):
        load_config(path, ["train.fsdp=yes please"])
    assert load_config(path, ["train.fsdp=true"])["train"]["fsdp"] is True
    shipped = sorted((REPO / "configs" / "train").glob("*.yaml"))
    assert {"tiny", "qwen3-8b", "demo", "demo-stage6", "demo-stage7"} <= {p.stem for p in shipped}
    for config in shipped:  # every shipped config loads
        load_config(config)
    paper = load_config(REPO / "configs" / "train" / "qwen3-8b.yaml")
    assert paper["drafter"]["num_hidden_layers"] == 5 and paper["drafter"]["block_size"] == 16
    assert paper["drafter"]["target_layer_ids"] == [1, 9, 17, 25, 33] and paper["data"]["seq_len"] == 3072
    assert paper["train"]["num_anchors"] == 512 and paper["train"]["lr"] == 6e-4 and paper["train"]["epochs"] == 6


# ----------------------------------------------------------------------------- end to end


def write_prompts(path, n, seed):
    rng = np.random.RandomState(seed)
    path.write_text("".join(json.dumps({"id": i, "input_ids": rng.randint(3, 500, int(rng.randint(4, 24))).tolist()})
                            + "\n" for i in range(n)))
    return path


def train_cli(tmp_path, name, *overrides, env=None):
    cmd = [sys.executable, "-m", "train", "--config", str(REPO / "configs" / "train" / "tiny.yaml"), "--quiet",
           f"target={TINY_TARGET}", f"train.output_dir={tmp_path / name}", *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env={**os.environ, **(env or {})})


def write_conversations(path, n, seed):
    """Token-id conversations (no regeneration): enough for runs that test mechanics."""
    rng = np.random.RandomState(seed)
    path.write_text("".join(json.dumps({"prompt_ids": rng.randint(3, 500, int(rng.randint(4, 16))).tolist(),
                                        "response_ids": rng.randint(3, 500, int(rng.randint(24, 64))).tolist()})
                            + "\n" for _ in range(n)))
    return path


RESUME_RUN = ["data.generate_from=null", "data.eval_holdout=0", "train.steps=16", "train.save_every=4",
              "train.log_every=2"]


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """16 steps of the tiny config on written conversations, checkpointed every 4: what the
    resume and export tests need (the regenerate-train-evaluate run is `-m heavy`)."""
    tmp = tmp_path_factory.mktemp("short")
    conv = write_conversations(tmp / "conv.jsonl", 64, 5)
    proc = train_cli(tmp, "straight", f"data.conversations={conv}", *RESUME_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The run ends by saying where it is, its last figures and what to run next (not a JSON dict).
    done = proc.stderr[proc.stderr.index("done: 16 steps"):]
    assert f"in {tmp / 'straight'}" in done and "teacher-forced tau" in done and "{" not in done
    assert f"python -m train.export --run {tmp / 'straight'}" in done and f"--target {TINY_TARGET}" in done
    return tmp, conv


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny config end to end: regenerate data with the demo target, train, evaluate."""
    tmp = tmp_path_factory.mktemp("tiny")
    prompts = write_prompts(tmp / "prompts.jsonl", 240, 3)
    proc = train_cli(tmp, "run", f"data.generate_from={prompts}", f"data.conversations={tmp / 'conv.jsonl'}",
                     "train.epochs=8", "train.eval_every=1000", "train.log_every=10")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = [json.loads(l) for l in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    return tmp, metrics


@pytest.mark.heavy
def test_regenerated_data_is_the_targets_own_output(trained):
    tmp, _ = trained
    convs = [json.loads(l) for l in (tmp / "conv.jsonl").read_text().splitlines()]
    assert len(convs) == 240 and all(c["response_ids"] and c["prompt_ids"] for c in convs)
    tc, tp = load_target(TINY_TARGET)
    plain = BatchEngine(tc, tp, max_new_tokens=64, max_prompt_len=32, stop_token_ids=[2], batch_size=4)
    for c, r in zip(convs[:4], plain.generate([c["prompt_ids"] for c in convs[:4]])):
        assert r.output_ids == c["response_ids"]


@pytest.mark.heavy
def test_training_lowers_loss_and_raises_real_tau(trained):
    _, metrics = trained
    losses = [m["loss"] for m in metrics if "loss" in m]
    evals = [m["eval_tau"] for m in metrics if "eval_tau" in m]
    assert metrics[0]["step"] == 0 and len(evals) == 2  # untrained, then final
    assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:2]), losses
    assert evals[0] < 1.02 and evals[-1] > evals[0] + 0.05, evals
    assert all(len(m["slot_accuracy"]) == 7 for m in metrics if "loss" in m)
    assert all(m["tokens_per_second"] > 0 and 1.0 <= m["tau_estimate"] <= 8.0 for m in metrics if "loss" in m)


def test_export_round_trip_gives_identical_drafts(short_run, tmp_path, capsys):
    tmp, _ = short_run
    run = tmp / "straight"
    out = export(run, tmp_path / "hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 8
    assert set(cfg["dflash_config"]) == {"mask_token_id", "target_layer_ids"}
    dcfg, dparams = load_drafter(out)
    params, step = restore_params(run)
    jax.tree.map(np.testing.assert_array_equal, dparams, jax.tree.map(np.asarray, params))
    tc, tp = load_target(TINY_TARGET)
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    via_export = [r.acceptance_lengths for r in BatchEngine(tc, tp, dcfg, dparams, batch_size=2, max_new_tokens=24,
                                                          max_prompt_len=16, speculation="fixed").generate(prompts)]
    direct = [r.acceptance_lengths for r in BatchEngine(tc, tp, dcfg, jax.tree.map(jnp.asarray, params), batch_size=2,
                                                      max_new_tokens=24, max_prompt_len=16, speculation="fixed").generate(prompts)]
    assert via_export == direct
    with pytest.raises(Exception, match="already exists"):
        export(run, out)
    # bfloat16 export (the published format) loads too.
    bf = export(run, tmp_path / "bf16")
    assert load_drafter(bf)[0].model.dtype == "bfloat16"
    # Given without its target, the exported drafter's error names the target it was trained against.
    from infer.cli import main as infer_main

    assert infer_main(["--drafter", str(out)]) == 2
    assert f"--drafter needs --target, the model it drafts for (this one was trained against {TINY_TARGET}" \
        in capsys.readouterr().err


def test_export_refuses_a_last_layer_tap_unless_allowed(short_run, tmp_path, capsys):
    """vLLM and SGLang read a last-layer tap before the final norm: export stops such a drafter
    (before reading a weight) unless told to, and then warns."""
    import shutil

    from train.export import main as export_main

    tmp, _ = short_run
    run = tmp_path / "run"
    shutil.copytree(tmp / "straight", run)
    config = json.loads((run / "drafter_config.json").read_text())
    last = config["num_target_layers"] - 1
    config["dflash_config"]["target_layer_ids"] = [1, last]
    (run / "drafter_config.json").write_text(json.dumps(config))
    assert export_main(["--run", str(run), "--out", str(tmp_path / "refused")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"taps the target's last layer ({last})" in err[0]
    assert "--allow-last-layer-tap" in err[0] and not (tmp_path / "refused").exists()
    assert export_main(["--run", str(run), "--out", str(tmp_path / "allowed"), "--allow-last-layer-tap"]) == 0
    assert "warning: the drafter taps the target's last layer" in capsys.readouterr().err
    assert json.loads((tmp_path / "allowed" / "config.json").read_text())["dflash_config"]["target_layer_ids"] == \
        [1, last]


def test_resume_after_kill_is_bit_identical(short_run, tmp_path):
    tmp, conv = short_run
    common = [f"data.conversations={conv}", *RESUME_RUN]
    killed = train_cli(tmp_path, "resumed", *common, env={"DFLASH_TRAIN_KILL_AT_STEP": "10"})
    assert killed.returncode == -9  # SIGKILL: no cleanup ran
    assert max(restore_params(tmp_path / "resumed")[1] for _ in [0]) == 8
    resumed = train_cli(tmp_path, "resumed", *common)
    assert resumed.returncode == 0 and "resumed from step 8" in resumed.stderr, resumed.stderr[-2000:]
    a, step_a = restore_params(tmp / "straight")
    b, step_b = restore_params(tmp_path / "resumed")
    assert step_a == step_b == 16
    jax.tree.map(np.testing.assert_array_equal, a, b)
    m_a = (tmp / "straight" / "metrics.jsonl").read_text().splitlines()
    m_b = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    strip = lambda lines: [{k: v for k, v in json.loads(l).items() if k != "tokens_per_second"} for l in lines]
    assert strip(m_a) == strip(m_b)  # same losses at every logged step, none duplicated


def damage(step_dir, how):
    """Every file of a checkpoint's state cut to half ("truncate"), or every file of the checkpoint
    overwritten with random bytes ("garble")."""
    for f in (p for p in (step_dir / "state" if how == "truncate" else step_dir).rglob("*") if p.is_file()):
        data = f.read_bytes()
        f.write_bytes(data[:len(data) // 2] if how == "truncate" else os.urandom(len(data)))


class DataPosition:
    """What resume() restores a data position into."""

    state = None

    def set_state(self, state):
        self.state = state


@pytest.mark.parametrize("how", ["truncate", "garble"])
def test_a_damaged_latest_checkpoint_falls_back_to_the_one_before(tmp_path, capsys, caplog, how):
    """Checkpoints at steps 4 and 8, step 8's files damaged: resume restores step 4 (its state and
    data position), warns in one line naming both steps, and moves step 8 aside, so that the run
    saves step 8 again. With only a damaged checkpoint: a one-line error naming it."""
    from dflash_jax.errors import CheckpointError
    from train.trainer import checkpoint_manager, resume, save

    cfg = {"train": {"keep": 3}}
    state = {"w": jnp.arange(8.0), "step": jnp.int32(0)}
    mngr = checkpoint_manager(tmp_path, cfg)
    for step in (4, 8):
        save(mngr, step, {"w": state["w"] * step, "step": jnp.int32(step)}, {"position": step})
    mngr.close()
    damage(tmp_path / "checkpoints" / "8", how)

    mngr, data = checkpoint_manager(tmp_path, cfg), DataPosition()
    start, got = resume(mngr, state, data, tmp_path)
    assert start == 4 and int(got["step"]) == 4 and data.state == {"position": 4}
    np.testing.assert_array_equal(np.asarray(got["w"]), 4 * np.arange(8.0))
    err = capsys.readouterr().err.splitlines()
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: checkpoint step 8 cannot be restored (")
    assert err == [warnings[0], f"resumed from step 4 ({tmp_path / 'checkpoints'})"], err
    assert not [r for r in caplog.records if r.name == "absl" and r.levelno >= logging.WARNING]  # nothing of orbax's
    assert "resuming from step 4 instead" in warnings[0], warnings
    assert (tmp_path / "checkpoints-damaged" / "8").is_dir() and mngr.all_steps() == [4]
    save(mngr, 8, {"w": state["w"] * 8, "step": jnp.int32(8)}, {"position": 8})  # the step saves again
    mngr.close()

    only = tmp_path / "only"
    mngr = checkpoint_manager(only, cfg)
    save(mngr, 4, state, {"position": 4})
    mngr.close()
    damage(only / "checkpoints" / "4", how)
    with pytest.raises(CheckpointError) as info:
        resume(checkpoint_manager(only, cfg), state, DataPosition(), only)
    message = str(info.value)
    assert message.startswith(f"cannot resume: checkpoint {only / 'checkpoints' / '4'} cannot be restored (")
    assert "there is no earlier one" in message and "\n" not in message


@pytest.mark.heavy  # a 4-step resumed run on top of the short run's
def test_a_run_resumes_past_a_damaged_checkpoint_bit_identically(short_run, tmp_path):
    """The short run's last checkpoint (step 16) damaged: `python -m train` warns, resumes from step
    12 and ends with the very parameters of the undamaged run."""
    import shutil

    tmp, conv = short_run
    shutil.copytree(tmp / "straight", tmp_path / "run")
    damage(tmp_path / "run" / "checkpoints" / "16", "truncate")
    proc = train_cli(tmp_path, "run", f"data.conversations={conv}", *RESUME_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "warning: checkpoint step 16 cannot be restored (" in proc.stderr and "resuming from step 12" in proc.stderr
    a, step_a = restore_params(tmp / "straight")
    b, step_b = restore_params(tmp_path / "run")
    assert step_a == step_b == 16
    jax.tree.map(np.testing.assert_array_equal, a, b)


@pytest.mark.heavy
def test_input_benchmark_checks_the_hosts_shards(tmp_path):
    """bench/train_input.py at a small size: its figures, and the hosts' shards found disjoint
    and complete (it exits 1 otherwise)."""
    aot = tmp_path / "aot.json"
    aot.write_text(json.dumps({"step": {"seconds": 0.5}, "batch": 1, "chip": "v5p"}))
    out = tmp_path / "input.json"
    p = subprocess.run([sys.executable, str(REPO / "bench" / "train_input.py"), "--seq-len", "256",
                        "--global-batch", "8", "--hosts", "4", "--batches", "2", "--aot-json", str(aot),
                        "--json", str(out)], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = json.loads(out.read_text())
    assert r["shards_disjoint_and_complete"] is True and r["sequences_per_second_per_host"] > 0
    assert r["needed_sequences_per_second_per_host"] == pytest.approx(1 / 0.5 * 4)
    assert r["headroom"] == pytest.approx(r["sequences_per_second_per_host"] / 8)


# ----------------------------------------------------------------------------- judging a run


def tiny_config(*overrides):
    return load_config(REPO / "configs" / "train" / "tiny.yaml", list(overrides))


def test_verdict_calls_the_tiny_runs_figure_the_expected_smoke_test_result():
    from train.verdict import verdict

    cfg = tiny_config()
    assert cfg["train"]["expect_tau"] == 1.12 and "smoke test" in cfg["train"]["expect_note"]
    text = "\n".join(verdict(1.007, 1.117, 456, cfg))  # what configs/train/tiny.yaml measured
    assert text.startswith("verdict: eval tau 1.007 (step 0) -> 1.117 after 456 steps of 8 x 96 tokens")
    assert "1.0 = no draft token ever accepted" in text
    assert "as expected: this config as written reaches about 1.12 (train.expect_tau)" in text
    assert "smoke test" in text and "NOT IMPROVED" not in text and "BELOW" not in text
    # The reference figures, with where they come from.
    assert "3.27 on its held-out eval, 3.67 on unseen numpy" in text and "12,750 steps" in text and "docs/demo.md" in text
    assert "Qwen3-8B drafter: 6.49" in text and "docs/benchmarks.md" in text
    assert len(text.splitlines()) <= 8 and "{" not in text


def test_verdict_flags_a_run_that_did_not_improve_or_fell_short():
    from train.verdict import verdict

    flat = "\n".join(verdict(1.007, 1.010, 456, tiny_config()))
    assert "NOT IMPROVED (+0.003)" in flat and "BELOW EXPECTATION: this config as written reaches about 1.12" in flat
    fell = "\n".join(verdict(3.16, 3.02, 450, tiny_config("train.expect_tau=null", "train.expect_note=null")))
    assert "NOT IMPROVED (-0.140)" in fell and "train.expect_tau" not in fell
    short = "\n".join(verdict(1.007, 1.06, 100, tiny_config()))  # improved, but short of the config's figure
    assert "NOT IMPROVED" not in short and "BELOW EXPECTATION" in short
    assert "above expectation" in "\n".join(verdict(1.007, 1.30, 456, tiny_config()))
    plain = "\n".join(verdict(1.0, 2.0, 1000, tiny_config("train.expect_tau=null")))
    assert "names no expected tau (train.expect_tau)" in plain and "6.49" in plain
    none = "\n".join(verdict(None, None, 16, tiny_config("data.eval_holdout=0")))
    assert none.startswith("verdict: no eval tau measured") and "python -m infer" in none


def test_expect_tau_is_checked_and_each_demo_stage_expects_its_logged_tau():
    with pytest.raises(TrainConfigError, match="train.expect_tau must be a number >= 1"):
        tiny_config("train.expect_tau=0.5")
    with pytest.raises(TrainConfigError, match="train.expect_note must be text"):
        tiny_config("train.expect_note=3")
    from bench.published import PAPER_TAU
    from train import verdict

    assert verdict.PAPER_TAU == PAPER_TAU
    logs = REPO / "dflash_jax" / "demo" / "drafter"
    stages = {"demo": "train_log_stage1.jsonl", **{f"demo-stage{i}": f"train_log_stage{i}.jsonl" for i in range(2, 8)},
              "demo-stage8": "train_log.jsonl"}
    steps = 0
    for name, log_name in stages.items():
        cfg = load_config(REPO / "configs" / "train" / f"{name}.yaml")
        evals = [json.loads(l) for l in (logs / log_name).read_text().splitlines() if "eval_tau" in l]
        steps += max(json.loads(l)["step"] for l in (logs / log_name).read_text().splitlines())
        assert cfg["train"]["expect_tau"] == pytest.approx(evals[-1]["eval_tau"], abs=0.005), name
        assert log_name in cfg["train"]["expect_note"]
    assert steps == verdict.DEMO_STEPS and cfg["train"]["expect_tau"] == verdict.DEMO_EVAL_TAU


def test_done_message_ends_with_the_verdict_counting_the_step0_eval_of_a_resumed_run(tmp_path):
    from train.trainer import done_message

    rows = [{"step": 0, "eval_tau": 1.0066}, {"step": 440, "loss": 3.6, "tau_estimate": 1.6},
            {"step": 456, "loss": 3.511, "tau_estimate": 1.61, "eval_tau": 1.1172}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # Resumed after step 400: this process's history has no step-0 eval, the metrics file has.
    msg = done_message({"steps": 456, "output_dir": str(tmp_path), "history": rows[1:]}, tiny_config())
    assert "verdict: eval tau 1.007 (step 0) -> 1.117 after 456 steps" in msg and "as expected" in msg
    assert msg.splitlines()[-2].startswith("next: python -m train.export")
