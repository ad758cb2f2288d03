"""Training DFlash2 drafters: `drafter.dflash2` in the config, the upgrade of a DFlash drafter (the
new parts at the identity / their init), the selector's loss (candidates with the gold token
injected, teacher-forced edge scores, its gradients), and a run that trains, exports, loads back
and resumes after a kill like a DFlash one."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import load_drafter, load_target
from dflash_jax.checkpoint import DRAFTER_TABLE, save_hf_params
from dflash_jax.config import ModelConfig
from dflash_jax.dflash2 import DFlash2Config
from dflash_jax.drafter import DFlashDrafter, DrafterConfig, draft_hidden, extend_context, init_drafter_params
from dflash_jax.engine import BatchEngine
from dflash_jax.kv import init_context_cache
from dflash_jax.model import init_params
from dflash_jax.training import (LossSpec, block_layout, chunked_cross_entropy, chunked_cross_entropy_top_k,
                                 drafter_loss, init_train_state, inject_gold, make_optimizer,
                                 selector_cross_entropy, train_step, upgrade_to_dflash2)
from train.config import TrainConfigError, load_config, new_drafter_config, with_dflash2
from train.export import export, restore_params
from test_training import REPO, RESUME_RUN, TINY_TARGET, train_cli, write_conversations

TARGET = ModelConfig(model_type="qwen3", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True)
PLAIN = DrafterConfig(model=TARGET.replace(num_hidden_layers=2, sliding_windows=(None, None)), block_size=4,
                      mask_token_id=63, target_layer_ids=(0, 2), num_target_layers=3)
D2 = DFlash2Config(conv_kernel_size=2, conv_group_size=8, selector_rank=8, selector_top_k=4)
# The run's drafter: small enough for the tiny target (hidden 64, vocab 512).
RUN_DFLASH2 = "drafter.dflash2={conv_group_size: 16, selector_rank: 16, selector_top_k: 8}"
loss_fn = jax.jit(drafter_loss, static_argnums=2)
# One spec and batch for the tests' losses (each spec is a compile): loss = 2 x CE + 0.5 x the selector's.
SPEC = LossSpec(target=TARGET, drafter=PLAIN, num_anchors=4, gamma=4.0, ce_chunk=8, ce_weight=2.0, selector_weight=0.5)
TOKENS = jnp.asarray(np.random.RandomState(4).randint(0, 60, (2, 24)), jnp.int32)
MASK = jnp.ones((2, 24), jnp.int32).at[0, :5].set(0)


def tiny_yaml(*overrides):
    return load_config(REPO / "configs" / "train" / "tiny.yaml", list(overrides))


# ----------------------------------------------------------------------------- config


def test_dflash2_config_keys_defaults_and_one_line_errors(tmp_path):
    assert tiny_yaml()["drafter"]["dflash2"] is None  # absent: a plain DFlash drafter
    tcfg = TARGET.replace(hidden_size=64, vocab_size=512)
    assert new_drafter_config(tiny_yaml(), tcfg, None, "float32").dflash2 is None
    assert new_drafter_config(tiny_yaml("drafter.dflash2={}"), tcfg, None, "float32").dflash2 == DFlash2Config()
    # A file's mapping, one key overridden on the command line: the file's other keys stay.
    path = tmp_path / "c.yaml"
    path.write_text("target: t\ndata: {conversations: c.jsonl}\ntrain: {output_dir: o}\n"
                    "drafter: {dflash2: {selector_rank: 32, final_logit_softcapping: 30}}\n")
    cfg = load_config(path, ["drafter.dflash2.selector_top_k=8", "train.selector_loss_weight=0.5"])
    assert cfg["drafter"]["dflash2"] == {"selector_rank": 32, "final_logit_softcapping": 30, "selector_top_k": 8}
    assert cfg["train"]["selector_loss_weight"] == 0.5 and cfg["train"]["ce_loss_weight"] == 1.0
    got = new_drafter_config(cfg, tcfg, None, "float32").dflash2
    assert got == DFlash2Config(selector_rank=32, selector_top_k=8, final_logit_softcapping=30.0)
    assert load_config(path, ["drafter.dflash2=null"])["drafter"]["dflash2"] is None
    bad = {
        "drafter.dflash2.selector_rnk=8": "unknown config key 'drafter.dflash2.selector_rnk'",
        "drafter.dflash2.selector_rank=0": "drafter.dflash2.selector_rank must be a positive integer, got 0",
        "drafter.dflash2.conv_kernel_size=1.5": "drafter.dflash2.conv_kernel_size must be a positive integer",
        "drafter.dflash2.selector_top_k=true": "drafter.dflash2.selector_top_k must be a positive integer",
        "drafter.dflash2.output_multiplier=-1": "drafter.dflash2.output_multiplier must be a number > 0, got -1",
        "drafter.dflash2.input_embedding_scale=x": "drafter.dflash2.input_embedding_scale must be a number > 0",
        "drafter.dflash2.final_logit_softcapping=0": "drafter.dflash2.final_logit_softcapping must be a number > 0, "
                                                     "or null",
        "drafter.dflash2=3": "drafter.dflash2 must be a mapping of conv_kernel_size",
        "train.selector_loss_weight=-1": "train.selector_loss_weight must be a number >= 0, got -1",
        "train.ce_loss_weight=no": "train.ce_loss_weight must be a number >= 0",
    }
    for override, message in bad.items():
        with pytest.raises(TrainConfigError, match="^" + message.replace("(", r"\(")) as e:
            tiny_yaml(override)
        assert "\n" not in str(e.value)
    # Values that depend on the target: named by their key against the drafter's shape.
    with pytest.raises(TrainConfigError, match=r"^drafter.dflash2.conv_group_size 24 does not divide the hidden size 64"):
        new_drafter_config(tiny_yaml("drafter.dflash2={conv_group_size: 24}"), tcfg, None, "float32")
    with pytest.raises(TrainConfigError, match=r"^drafter.dflash2.selector_top_k 600 exceeds the vocabulary \(512\)"):
        new_drafter_config(tiny_yaml("drafter.dflash2={selector_top_k: 600}"), tcfg, None, "float32")


def test_an_init_is_upgraded_or_keeps_its_own_dflash2_config():
    plain, d2 = PLAIN, dataclasses.replace(PLAIN, dflash2=D2)
    assert with_dflash2(tiny_yaml(), plain) is plain and with_dflash2(tiny_yaml(), d2) is d2
    assert with_dflash2(tiny_yaml("drafter.dflash2={conv_group_size: 8}"), plain).dflash2 == \
        DFlash2Config(conv_group_size=8)
    # A DFlash2 init keeps its config: the same values are fine, another is refused in one line.
    assert with_dflash2(tiny_yaml("drafter.dflash2={selector_rank: 8, selector_top_k: 4}"), d2) is d2
    with pytest.raises(TrainConfigError, match=r"^drafter.dflash2.selector_rank 16 conflicts with drafter.init's "
                                               r"DFlash2 drafter \(selector_rank 8\)") as e:
        with_dflash2(tiny_yaml("drafter.dflash2={selector_rank: 16}"), d2)
    assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- init


@pytest.fixture(scope="module")
def models():
    tparams = init_params(TARGET, jax.random.PRNGKey(0))
    # Weights of a trained size, so every part of the drafter matters.
    plain = jax.tree.map(lambda p: p * 3.0, init_drafter_params(PLAIN, jax.random.PRNGKey(1)))
    return tparams, plain


def test_upgrade_starts_dflash2_as_its_dflash_drafter(models):
    """Upgraded: the DFlash weights kept, convolutions the identity, the selector small random.
    With its codebooks zeroed, the DFlash2 drafter's loss CE is the DFlash drafter's loss."""
    tparams, plain = models
    dcfg, params = upgrade_to_dflash2(PLAIN, plain, D2, jax.random.PRNGKey(7))
    assert dcfg.dflash2 == D2 and dcfg.block_size == PLAIN.block_size
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            c = params[f"layers_{i}"][conv]
            base = np.asarray(c["base_kernel"])
            assert base.shape == (2, 2, 32) and (base[:, 0] == 1).all() and (base[:, 1:] == 0).all()
            assert (np.asarray(c["kernel_projection"]["kernel"]) == 0).all()
        for k, v in plain[f"layers_{i}"].items():
            jax.tree.map(np.testing.assert_array_equal, params[f"layers_{i}"][k], v)
    sel = params["candidate_selector"]
    for book in ("predecessor_codebook", "successor_codebook"):
        std = float(np.asarray(sel[book]).std())
        assert sel[book].shape == (64, 8) and 0.01 < std < 0.04  # normal(0.02): small, never zero
    jax.tree.map(np.testing.assert_array_equal, params["fc"], plain["fc"])

    zeroed = {**params, "candidate_selector": {**sel, **{b: jnp.zeros_like(sel[b]) for b in
                                                          ("predecessor_codebook", "successor_codebook")}}}
    key = jax.random.PRNGKey(3)
    _, m = loss_fn(plain, tparams, SPEC, TOKENS, MASK, key)
    _, m2 = loss_fn(zeroed, tparams, dataclasses.replace(SPEC, drafter=dcfg), TOKENS, MASK, key)
    assert float(m2["ce_loss"]) == pytest.approx(float(m["ce_loss"]), rel=1e-6) and float(m["ce_loss"]) > 1
    np.testing.assert_allclose(np.asarray(m2["slot_accuracy"]), np.asarray(m["slot_accuracy"]))
    # The test has power: a convolution away from the identity changes the CE.
    moved = jax.tree.map(lambda x: x, zeroed)
    moved["layers_0"]["mlp_conv"]["base_kernel"] = moved["layers_0"]["mlp_conv"]["base_kernel"].at[:, 1].set(0.5)
    _, m3 = loss_fn(moved, tparams, dataclasses.replace(SPEC, drafter=dcfg), TOKENS, MASK, key)
    assert abs(float(m3["ce_loss"]) - float(m["ce_loss"])) > 1e-3
    with pytest.raises(ValueError, match="DFlash2 drafter already"):
        upgrade_to_dflash2(dcfg, params, D2)


def test_training_pass_is_the_decoding_pass_for_dflash2(models):
    """train_hidden of all blocks at once (each block's convolutions on its own) equals the
    decoding path's draft of each block, with convolutions away from the identity."""
    _, plain = models
    dcfg, params = upgrade_to_dflash2(PLAIN, plain, D2, jax.random.PRNGKey(7))
    key = iter(jax.random.split(jax.random.PRNGKey(2), 8))
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            c = params[f"layers_{i}"][conv]
            c["base_kernel"] = c["base_kernel"] + 0.3 * jax.random.normal(next(key), c["base_kernel"].shape)
            k = c["kernel_projection"]["kernel"]
            c["kernel_projection"]["kernel"] = 0.2 * jax.random.normal(next(key), k.shape)
    s, anchors, b = 20, [3, 8, 13], dcfg.block_size
    rng = np.random.RandomState(0)
    features = jnp.asarray(rng.randn(1, s, 2 * 32), jnp.float32)
    embeds = jnp.asarray(rng.randn(1, len(anchors) * b, 32), jnp.float32)
    a = jnp.asarray([anchors])
    lay = block_layout(jnp.zeros((1, s), jnp.int32), jnp.ones((1, s)), a, jnp.ones_like(a, bool), block_size=b,
                       mask_token_id=63, gamma=4.0)
    hidden = DFlashDrafter(dcfg).apply({"params": params}, embeds, lay.positions, features, lay.ctx_mask,
                                       method=DFlashDrafter.train_hidden).reshape(len(anchors), b, -1)
    for j, anchor in enumerate(anchors):
        ctx = extend_context(params, dcfg, features[:, :anchor], init_context_cache(dcfg, 1, 32), jnp.array([anchor]))
        decode = draft_hidden(params, dcfg, embeds[:, j * b:(j + 1) * b], ctx)
        # float32 through two orders of the same sums (all blocks at once, one block on its cache): jax 0.10's
        # CPU kernels differ by up to 4e-5 on values of order 1; one context position short differs by 4.7
        np.testing.assert_allclose(np.asarray(decode[0]), np.asarray(hidden[j]), rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- the selector's loss


def test_gold_is_injected_in_place_of_the_lowest_candidate():
    cand = jnp.asarray([[7, 3, 9, 1], [7, 3, 9, 1], [5, 6, 2, 8]])
    vals = jnp.asarray([[4.0, 3.0, 2.0, 1.0], [4.0, 3.0, 2.0, 1.0], [2.0, 0.5, 3.0, 1.0]])
    gold = jnp.asarray([9, 4, 11])
    gold_value = jnp.asarray([2.0, -1.5, 0.25])
    c, v, idx, hit = map(np.asarray, inject_gold(cand, vals, gold, gold_value))
    assert hit.tolist() == [True, False, False]
    assert idx.tolist() == [2, 3, 1]  # found at 2; else the lowest: the last of a sorted row, 0.5 in the third
    assert c.tolist() == [[7, 3, 9, 1], [7, 3, 9, 4], [5, 11, 2, 8]]
    np.testing.assert_array_equal(v, [[4, 3, 2, 1], [4, 3, 2, -1.5], [2, 0.25, 3, 1]])
    assert (c[np.arange(3), idx] == np.asarray(gold)).all()


def test_chunked_top_k_is_the_full_logits_top_k_and_ce():
    rng = np.random.RandomState(0)
    hidden = jnp.asarray(rng.randn(13, 8), jnp.float32)
    w = jnp.asarray(rng.randn(8, 40) * 2, jnp.float32)
    targets = jnp.asarray(rng.randint(0, 40, 13), jnp.int32)
    raw = np.asarray(hidden @ w)
    for cap in (None, 3.0):
        ce, correct, values, cand, gold = map(np.asarray, chunked_cross_entropy_top_k(hidden, lambda h: h @ w, targets,
                                                                                      5, 6, cap))
        head = (lambda h: h @ w) if cap is None else (lambda h, cap=cap: cap * jnp.tanh((h @ w) / cap))
        ref_ce, ref_correct = chunked_cross_entropy(hidden, head, targets, 5)
        np.testing.assert_allclose(ce, np.asarray(ref_ce), rtol=1e-5)
        np.testing.assert_array_equal(correct, np.asarray(ref_correct))
        np.testing.assert_array_equal(cand, np.argsort(-raw, 1)[:, :6])  # of the raw logits, soft cap or not
        np.testing.assert_allclose(values, -np.sort(-raw, 1)[:, :6], rtol=1e-6)
        np.testing.assert_allclose(gold, raw[np.arange(13), np.asarray(targets)], rtol=1e-6)


def test_selector_loss_is_the_gold_predecessors_row_cross_entropy(models):
    """By hand: slot 1's row is from the anchor, slot d's from the gold token of slot d-1;
    S[j] = U[j] + <A[pred] * (W h), B[cand_j]>, the loss -log softmax(S)[gold]."""
    _, plain = models
    d2 = dataclasses.replace(D2, output_multiplier=2.0, final_logit_softcapping=5.0)
    dcfg, params = upgrade_to_dflash2(PLAIN, plain, d2, jax.random.PRNGKey(7))
    sel = params["candidate_selector"] = jax.tree.map(lambda p: p * 20.0, params["candidate_selector"])
    rng = np.random.RandomState(1)
    r, d, k = 2, 3, 4
    hidden = jnp.asarray(rng.randn(r, d, 32), jnp.float32)
    anchors = jnp.asarray([10, 20])
    gold = jnp.asarray([[1, 2, 3], [4, 5, 6]])
    cand = jnp.asarray(rng.permutation(np.arange(7, 64))[:r * d * k].reshape(r, d, k))
    cand = cand.at[0, 1, 2].set(2)  # slot 2 of row 0 has its gold token among its candidates
    values = jnp.asarray(-np.sort(-rng.randn(r, d, k) * 3, -1), jnp.float32)
    gold_value = jnp.asarray(rng.randn(r, d), jnp.float32)
    ce, correct, hit = map(np.asarray, selector_cross_entropy(DFlashDrafter(dcfg), params, hidden, anchors, gold, cand,
                                                              values, gold_value, d2))
    A, B = np.asarray(sel["predecessor_codebook"]), np.asarray(sel["successor_codebook"])
    W = np.asarray(sel["hidden_projection"]["kernel"])
    for i in range(r):
        for s in range(d):
            c, v = np.asarray(cand[i, s]).copy(), np.asarray(values[i, s]).copy()
            g = int(gold[i, s])
            if g not in c:
                c[-1], v[-1] = g, float(gold_value[i, s])
            u = np.tanh(v * 2.0 / 5.0) * 5.0
            pred = int(anchors[i]) if s == 0 else int(gold[i, s - 1])
            row = u + (A[pred] * (np.asarray(hidden[i, s]) @ W)) @ B[c].T
            at = list(c).index(g)
            want = np.log(np.exp(row - row.max()).sum()) + row.max() - row[at]
            assert ce[i, s] == pytest.approx(want, rel=1e-4)
            assert correct[i, s] == (np.argmax(row) == at)
            assert hit[i, s] == (i == 0 and s == 1)
    assert ce.std() > 0.1


def test_gradients_reach_the_drafter_through_the_unary_scores_and_the_selector(models):
    tparams, plain = models
    dcfg, params = upgrade_to_dflash2(PLAIN, plain, D2, jax.random.PRNGKey(7))
    spec, key = dataclasses.replace(SPEC, drafter=dcfg), jax.random.PRNGKey(3)
    # d(ce_loss), d(selector_loss) in one program: the two rows of the Jacobian of both.
    parts = jax.jit(jax.jacrev(lambda p: (lambda m: jnp.stack([m["ce_loss"], m["selector_loss"]]))(
        drafter_loss(p, tparams, spec, TOKENS, MASK, key)[1])))(params)
    only_ce, only_selector = [jax.tree.map(lambda x, i=i: float(jnp.abs(x[i]).max()), parts) for i in range(2)]
    for name in ("predecessor_codebook", "successor_codebook"):
        assert only_selector["candidate_selector"][name] > 1e-6
    assert only_selector["candidate_selector"]["hidden_projection"]["kernel"] > 1e-6
    # Through U (the head's top-K logits of the drafter's hidden state) into the layers.
    assert only_selector["layers_0"]["mlp"]["down_proj"]["kernel"] > 1e-6 and only_selector["fc"]["kernel"] > 1e-6
    assert all(v == 0 for v in jax.tree.leaves(only_ce["candidate_selector"]))
    assert only_ce["layers_0"]["mlp"]["down_proj"]["kernel"] > 1e-6
    # The weights: loss = ce_weight x CE + selector_weight x the selector's CE; a plain DFlash
    # drafter's loss has no selector, so its weight changes nothing.
    loss, m = loss_fn(params, tparams, spec, TOKENS, MASK, key)
    assert float(loss) == pytest.approx(2 * float(m["ce_loss"]) + 0.5 * float(m["selector_loss"]), rel=1e-6)
    loss, m = loss_fn(plain, tparams, SPEC, TOKENS, MASK, key)
    assert float(loss) == pytest.approx(2 * float(m["ce_loss"]), rel=1e-6) and "selector_loss" not in m


@pytest.mark.heavy  # twelve steps (10 s); the loss is checked by hand everyday
def test_selector_loss_falls_over_a_few_steps_of_the_tiny_config():
    """The tiny config's DFlash2 drafter against the tiny target, 12 steps on one batch (the same
    32 of its 39 eligible anchors drawn each step): the selector's loss falls and its accuracy rises."""
    cfg = tiny_yaml(RUN_DFLASH2, "train.compute_dtype=float32")
    tcfg, tparams = load_target(TINY_TARGET)
    dcfg = new_drafter_config(cfg, tcfg, None, "float32")
    assert dcfg.dflash2 == DFlash2Config(conv_group_size=16, selector_rank=16, selector_top_k=8) and dcfg.block_size == 8
    tokens = jnp.asarray(np.random.RandomState(0).randint(3, 500, (4, 48)), jnp.int32)
    mask = jnp.ones(tokens.shape, jnp.int32).at[:, :8].set(0)
    spec = LossSpec(target=tcfg, drafter=dcfg, num_anchors=32, gamma=4.0, ce_chunk=256)
    tx, _ = make_optimizer(3e-3, 12, warmup_ratio=0.0)
    state = init_train_state(init_drafter_params(dcfg, jax.random.PRNGKey(0)), tx)
    seen = []
    for _ in range(12):
        state, m = train_step(state, tparams, tokens, mask, jax.random.PRNGKey(0), spec=spec, tx=tx)
        seen.append({k: float(m[k]) for k in ("selector_loss", "selector_accuracy", "gold_in_top_k", "ce_loss")})
    first, last = np.mean([s["selector_loss"] for s in seen[:2]]), np.mean([s["selector_loss"] for s in seen[-2:]])
    assert last < 0.8 * first, [s["selector_loss"] for s in seen]
    assert all(0 <= s["selector_accuracy"] <= 1 and 0 <= s["gold_in_top_k"] <= 1 for s in seen)
    assert seen[-1]["selector_accuracy"] > seen[0]["selector_accuracy"]


# ----------------------------------------------------------------------------- a run: export, resume


@pytest.fixture(scope="module")
def dflash2_run(tmp_path_factory):
    """16 steps of the tiny config with a DFlash2 drafter, checkpointed every 4."""
    tmp = tmp_path_factory.mktemp("d2")
    conv = write_conversations(tmp / "conv.jsonl", 64, 5)
    proc = train_cli(tmp, "straight", f"data.conversations={conv}", RUN_DFLASH2, *RESUME_RUN)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp, conv


@pytest.mark.heavy  # a training run and its export (23 s); the everyday suite trains DFlash2 through the loss tests
def test_dflash2_run_logs_its_selector_and_exports_the_dflash2_format(dflash2_run, tmp_path):
    tmp, _ = dflash2_run
    run = tmp / "straight"
    lines = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(lines) == 8 and all({"ce_loss", "selector_loss", "selector_accuracy", "gold_in_top_k"} <= set(m)
                                   for m in lines)
    assert all(m["loss"] == pytest.approx(m["ce_loss"] + m["selector_loss"], abs=2e-5) for m in lines)
    out = export(run, tmp_path / "hf", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False and cfg["block_size"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": cfg["dflash_config"]["mask_token_id"],
                                    "target_layer_ids": cfg["dflash_config"]["target_layer_ids"],
                                    "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 16,
                                    "selector_top_k": 8, "output_multiplier": 1.0, "final_logit_softcapping": None,
                                    "input_embedding_scale": 1.0}
    from dflash_jax.safetensors_io import read_header

    names = set(read_header(out / "model.safetensors")[0]) - {"__metadata__"}
    assert {"layers.0.attention_conv.base_kernel", "layers.1.mlp_conv.kernel_projection.weight",
            "candidate_selector.hidden_projection.weight", "candidate_selector.predecessor_codebook",
            "candidate_selector.successor_codebook"} <= names
    dcfg, dparams = load_drafter(out)
    params, step = restore_params(run)
    assert step == 16 and dcfg.dflash2 == DFlash2Config(conv_group_size=16, selector_rank=16, selector_top_k=8)
    jax.tree.map(np.testing.assert_array_equal, dparams, jax.tree.map(np.asarray, params))
    # Trained: the convolutions and the selector moved from their init.
    assert np.abs(np.asarray(params["layers_0"]["attention_conv"]["kernel_projection"]["kernel"])).max() > 1e-4
    tc, tp = load_target(TINY_TARGET)
    prompts = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45]]
    run_engine = lambda p: [r.acceptance_lengths for r in BatchEngine(  # noqa: E731
        tc, tp, dcfg, p, batch_size=2, max_new_tokens=24, max_prompt_len=16, speculation="fixed").generate(prompts)]
    assert run_engine(dparams) == run_engine(jax.tree.map(jnp.asarray, params))
    assert load_drafter(export(run, tmp_path / "bf16"))[0].dflash2 == dcfg.dflash2


@pytest.mark.heavy  # a killed run and its resume (21 s); the everyday suite resumes DFlash's (test_training.py)
def test_dflash2_resume_after_kill_is_bit_identical(dflash2_run, tmp_path):
    tmp, conv = dflash2_run
    common = [f"data.conversations={conv}", RUN_DFLASH2, *RESUME_RUN]
    killed = train_cli(tmp_path, "resumed", *common, env={"DFLASH_TRAIN_KILL_AT_STEP": "10"})
    assert killed.returncode == -9
    assert restore_params(tmp_path / "resumed")[1] == 8
    resumed = train_cli(tmp_path, "resumed", *common)
    assert resumed.returncode == 0 and "resumed from step 8" in resumed.stderr, resumed.stderr[-2000:]
    a, step_a = restore_params(tmp / "straight")
    b, step_b = restore_params(tmp_path / "resumed")
    assert step_a == step_b == 16 and "candidate_selector" in b
    jax.tree.map(np.testing.assert_array_equal, a, b)
    strip = lambda p: [{k: v for k, v in json.loads(l).items() if k != "tokens_per_second"}  # noqa: E731
                       for l in (p / "metrics.jsonl").read_text().splitlines()]
    assert strip(tmp / "straight") == strip(tmp_path / "resumed")


def test_drafter_init_upgrades_a_dflash_drafter_and_refuses_a_conflicting_one(tmp_path):
    """drafter.init a plain DFlash drafter + drafter.dflash2: trained as DFlash2 from its weights; a
    DFlash2 init with another drafter.dflash2: a one-line error before training."""
    from train.trainer import initial_drafter

    tcfg, _ = load_target(TINY_TARGET)
    plain_cfg = new_drafter_config(tiny_yaml(), tcfg, None, "float32")
    plain = init_drafter_params(plain_cfg, jax.random.PRNGKey(3))
    hf = tmp_path / "plain"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(plain_cfg.to_hf_dict()))
    save_hf_params(plain, hf / "model.safetensors", table=DRAFTER_TABLE)
    cfg = tiny_yaml(f"drafter.init={hf}", RUN_DFLASH2)
    dcfg, params = initial_drafter(cfg, tcfg, None, None)
    assert dcfg.dflash2 == DFlash2Config(conv_group_size=16, selector_rank=16, selector_top_k=8)
    jax.tree.map(np.testing.assert_array_equal, {k: v for k, v in params.items() if k != "candidate_selector"} |
                 {f"layers_{i}": {k: v for k, v in params[f"layers_{i}"].items() if not k.endswith("_conv")}
                  for i in range(2)}, jax.tree.map(np.asarray, plain))
    d2 = tmp_path / "d2"
    d2.mkdir()
    (d2 / "config.json").write_text(json.dumps(dcfg.to_hf_dict()))
    save_hf_params(params, d2 / "model.safetensors", table=DRAFTER_TABLE)
    assert initial_drafter(tiny_yaml(f"drafter.init={d2}"), tcfg, None, None)[0].dflash2 == dcfg.dflash2
    with pytest.raises(TrainConfigError, match=r"^drafter.dflash2.selector_top_k 4 conflicts with drafter.init's "
                                               r"DFlash2 drafter \(selector_top_k 8\)"):
        initial_drafter(tiny_yaml(f"drafter.init={d2}", "drafter.dflash2={selector_top_k: 4}"), tcfg, None, None)
