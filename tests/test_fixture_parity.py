"""Against outputs of the reference PyTorch implementation (z-lab dflash/model.py)."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import forward, init_cache, load_drafter, load_target
from dflash_jax.drafter import draft_hidden, extend_context
from dflash_jax.kv import init_context_cache
from dflash_jax.model import CausalLM
from dflash_jax.engine import BatchEngine
from fixtures import tiny

TOL = dict(atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def pair():
    root = tiny()
    tc, tp = load_target(root / "target")
    dc, dp = load_drafter(root / "drafter")
    return tc, tp, dc, dp


@pytest.fixture(scope="module")
def expected():
    return np.load(tiny() / "expected.npz")


@pytest.fixture(scope="module")
def cases(expected):
    c = json.loads((tiny() / "greedy_cases.json").read_text())
    prompts = [expected["prompt"][0].tolist()] + c["prompts"]
    outputs = [expected["greedy_output"][0].tolist()] + c["outputs"]
    acceptance = [expected["acceptance_lengths"].tolist()] + c["acceptance_lengths"]
    assert c["max_new_tokens"] == 40 and c["block_size"] == 8
    return prompts, outputs, acceptance


def test_drafter_config_read_from_z_lab_format(pair):
    _, _, dc, _ = pair
    assert (dc.block_size, dc.mask_token_id, dc.target_layer_ids) == (8, 511, (1, 3))
    assert dc.model.num_hidden_layers == 2 and dc.model.qk_norm


def test_context_features_drafter_hidden_and_draft_logits(pair, expected):
    tc, tp, dc, dp = pair
    prompt = jnp.asarray(expected["prompt"], jnp.int32)
    out = forward(tp, tc, prompt, init_cache(tc, 1, 32), taps=dc.target_layer_ids)
    np.testing.assert_allclose(np.asarray(out.logits), expected["target_logits"], **TOL)
    np.testing.assert_allclose(np.asarray(out.tap_features), expected["context_feature"], **TOL)

    n = prompt.shape[1]
    ctx = extend_context(dp, dc, out.tap_features, init_context_cache(dc, 1, 32), jnp.array([n]))
    block = jnp.asarray(expected["block_ids"], jnp.int32)
    assert int(block[0, 0]) == int(np.argmax(expected["target_logits"][0, -1]))
    model = CausalLM(tc)
    embeds = model.apply({"params": tp}, block, method=CausalLM.embed)
    hidden = draft_hidden(dp, dc, embeds, ctx)
    np.testing.assert_allclose(np.asarray(hidden), expected["draft_hidden"], **TOL)
    logits = model.apply({"params": tp}, hidden[:, 1:], method=CausalLM.logits)
    np.testing.assert_allclose(np.asarray(logits), expected["draft_logits"], **TOL)


def test_context_cache_built_in_pieces_equals_one_pass(pair, expected):
    """The engine grows the context a few positions per cycle; that must equal one pass."""
    tc, tp, dc, dp = pair
    prompt = jnp.asarray(expected["prompt"], jnp.int32)
    feats = forward(tp, tc, prompt, init_cache(tc, 1, 32), taps=dc.target_layer_ids).tap_features
    whole = extend_context(dp, dc, feats, init_context_cache(dc, 1, 32), jnp.array([11]))
    pieces = init_context_cache(dc, 1, 32)
    for lo, hi in ((0, 4), (4, 5), (5, 11)):
        chunk = jnp.zeros((1, 8, feats.shape[-1])).at[:, :hi - lo].set(feats[:, lo:hi])
        pieces = extend_context(dp, dc, chunk, pieces, jnp.array([hi - lo]))
    assert int(pieces.lengths[0]) == 11
    np.testing.assert_allclose(np.asarray(pieces.k[:, :, :11]), np.asarray(whole.k[:, :, :11]), atol=1e-5)
    np.testing.assert_allclose(np.asarray(pieces.v[:, :, :11]), np.asarray(whole.v[:, :, :11]), atol=1e-5)


# everyday batched (each of its rows the reference's); one by one and more slots than prompts under -m heavy
@pytest.mark.parametrize("batch_size", [pytest.param(1, marks=pytest.mark.heavy), pytest.param(9, marks=pytest.mark.heavy), 4])
def test_greedy_tokens_and_acceptance_lengths_match_reference(pair, cases, batch_size):
    tc, tp, dc, dp = pair
    prompts, outputs, acceptance = cases
    gen = BatchEngine(tc, tp, dc, dp, batch_size=batch_size, max_new_tokens=40, max_prompt_len=32, speculation="fixed")
    results = sorted(gen.generate(prompts), key=lambda r: r.index)
    assert [r.index for r in results] == list(range(len(prompts)))
    for r, prompt, want, acc in zip(results, prompts, outputs, acceptance):
        assert prompt + r.output_ids == want, f"case {r.index}"
        assert r.acceptance_lengths == acc, f"case {r.index}"
        assert r.finish_reason == "length"
    # The fixture exercises multi-token acceptance, including whole blocks.
    assert max(max(a) for a in acceptance) == 8
