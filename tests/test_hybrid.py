"""Hybrid decoders (Qwen3.5 / Qwen3.6): gated delta-net linear-attention layers among
attention layers, against transformers, and the rollback a verify pass needs.

- Logits equal transformers for a prompt longer than one delta-rule chunk, prefilled whole
  and in right-padded pieces; the multimodal checkpoints' text model loads and equals it.
- Rollback: after a verify pass over a drafted block whose suffix is rejected (rows keeping
  different prefixes), the linear layers' states and convolution tails, the KV entries and
  the next logits equal those of a run over the accepted tokens alone; for sliding-window
  attention layers too.
- Plain greedy decoding equals transformers' `generate`.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dflash_jax import forward, init_cache, load_target
from dflash_jax.config import LinearAttentionConfig, ModelConfig, RopeConfig
from dflash_jax.engine import BatchEngine
from dflash_jax.errors import ConfigError
from dflash_jax.model import init_params, settle
from dflash_jax.families import model_config
from tiny import (BASE, HYBRID_FAMILIES, LINEAR, assert_plain_greedy_equals_generate, make_model, prefill_in_pieces,
                  save_model, train_cli_on_regenerated)


@pytest.fixture(scope="module")
def hf_hybrid(tmp_path_factory):
    """{family: (torch model, HF directory)} of the tiny hybrid checkpoints."""
    root = tmp_path_factory.mktemp("hybrid")
    return {f: (m, save_model(m, root / f)) for f in HYBRID_FAMILIES for m in [make_model(f, seed=5)]}


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("family", [HYBRID_FAMILIES[0]] + [pytest.param(f, marks=pytest.mark.heavy)
                                                         for f in HYBRID_FAMILIES[1:]])  # MoE: the full matrix
def test_a_prompt_longer_than_a_chunk_whole_and_in_padded_pieces_equals_transformers(family, hf_hybrid):
    """150 tokens: three chunks of the delta rule (64) with a ragged end. Then the same prompt
    as two right-padded prefill chunks per row (rows of different lengths), whose padding
    must neither decay nor write the states."""
    model, path = hf_hybrid[family]
    config, params = load_target(path)
    ids = np.random.RandomState(2).randint(0, 160, (2, 150))
    ref = torch_logits(model, ids)
    out = forward(params, config, jnp.asarray(ids, jnp.int32), init_cache(config, 2, 160))
    np.testing.assert_allclose(np.asarray(out.logits), ref, atol=1e-4, rtol=0)

    # rows' real tokens per piece (the pieces are 80 wide); the padding would change a state if written
    pieces = prefill_in_pieces(params, config, ids, [[70, 80], [60, 80]], width=80, cache_len=192)
    for r, got in enumerate(pieces):
        np.testing.assert_allclose(got, torch_logits(model, ids[r:r + 1, :len(got)])[0], atol=1e-4, rtol=0,
                                   err_msg=f"row {r}")


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    """A `qwen3_5` (image-text) checkpoint: the config's text_config and the
    model.language_model.* weights make the decoder; the vision tower is not read."""
    text = dict(BASE, **LINEAR)
    cfg = transformers.Qwen3_5Config(text_config=text, vision_config=dict(
        depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4))
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path)
    config, params = load_target(tmp_path)
    assert config.model_type == "qwen3_5" and config.num_linear_layers == 3 and config.num_attention_layers == 1
    ids = np.random.RandomState(4).randint(0, 160, (1, 20))
    out = forward(params, config, jnp.asarray(ids, jnp.int32), init_cache(config, 1, 32))
    np.testing.assert_allclose(np.asarray(out.logits), torch_logits(model, ids), atol=1e-4, rtol=0)


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["linear_attention", "mamba"]), "layer_types has unsupported kind(s) ['mamba']"),
    (dict(linear_num_value_heads=3), "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2"),
    (dict(linear_conv_kernel_dim=None), "field 'linear_conv_kernel_dim' must be a positive integer, got None"),
    (dict(model_type="qwen3_5", text_config=None), "missing required field 'text_config'"),
])
def test_bad_hybrid_config_is_a_one_line_error(change, message):
    good = {**BASE, **LINEAR, "model_type": "qwen3_5_text", "num_hidden_layers": 2,
            "layer_types": ["linear_attention", "full_attention"]}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("(", r"\(").replace(")", r"\)")):
        model_config({**good, **change})


# --------------------------------------------------------------------------- rollback


def hybrid_config(sliding: bool) -> ModelConfig:
    """linear, attention (sliding window 4 when asked: shorter than the prompts), linear."""
    return ModelConfig(
        model_type="qwen3_5_text", vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, qk_norm=True, attention_output_gate=True,
        norm_zero_centered=True, rope=RopeConfig(partial_rotary_factor=0.5),
        linear_attention=LinearAttentionConfig(k_heads=2, v_heads=4, k_dim=8, v_dim=8),
        linear_layers=(True, False, True), sliding_windows=(None, 4 if sliding else None, None))


# full heavy for the everyday suite's 10 minutes: the sliding case holds the same linear and full layers and one sliding
@pytest.mark.parametrize("sliding", [pytest.param(False, marks=pytest.mark.heavy), True], ids=["full", "sliding"])
def test_a_verify_rolled_back_to_its_accepted_prefix_equals_running_only_those_tokens(sliding):
    """Prefill 11 and 6 tokens; verify a block of 6 per row, keep 3 and 0 of it (settle, and
    lengths cut); then 4 more tokens. Caches and logits equal a run that only ever saw the
    kept tokens. Without the settle (the state after the whole block) they would not."""
    config = hybrid_config(sliding)
    params = init_params(config, jax.random.PRNGKey(3))
    rs = np.random.RandomState(0)
    prompt_lens, keep = np.array([11, 6]), np.array([3, 0])
    prompts = rs.randint(0, 32, (2, 11)).astype(np.int32)
    block, after = rs.randint(0, 32, (2, 6)).astype(np.int32), rs.randint(0, 32, (2, 4)).astype(np.int32)

    cache = forward(params, config, jnp.asarray(prompts), init_cache(config, 2, 32),
                    num_tokens=jnp.asarray(prompt_lens)).cache
    verified = forward(params, config, jnp.asarray(block), cache, defer_recurrent=True)
    assert len(verified.pending) == 2 and verified.pending[0].k.shape[:2] == (2, 6)  # per linear layer: [rows, T]
    np.testing.assert_array_equal(np.asarray(verified.cache.state), np.asarray(cache.state))  # deferred: untouched
    rolled = settle(verified.cache, verified.pending, jnp.asarray(keep)).replace(
        lengths=jnp.asarray(prompt_lens + keep, jnp.int32))
    unsettled = verified.cache.replace(lengths=rolled.lengths)

    # The reference: every row's prompt and kept tokens, one prefill.
    kept = np.zeros((2, 14), np.int32)
    for r in range(2):
        kept[r, :prompt_lens[r] + keep[r]] = np.concatenate([prompts[r, :prompt_lens[r]], block[r, :keep[r]]])
    ref_cache = forward(params, config, jnp.asarray(kept), init_cache(config, 2, 32),
                        num_tokens=jnp.asarray(prompt_lens + keep)).cache

    np.testing.assert_allclose(np.asarray(rolled.state), np.asarray(ref_cache.state), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(rolled.tail), np.asarray(ref_cache.tail), atol=1e-5, rtol=1e-5)
    for r in range(2):
        n = prompt_lens[r] + keep[r]
        np.testing.assert_allclose(np.asarray(rolled.k[:, r, :n]), np.asarray(ref_cache.k[:, r, :n]), atol=1e-5)
    nxt = forward(params, config, jnp.asarray(after), rolled)
    ref = forward(params, config, jnp.asarray(after), ref_cache)
    np.testing.assert_allclose(np.asarray(nxt.logits), np.asarray(ref.logits), atol=1e-4, rtol=0)
    np.testing.assert_allclose(np.asarray(nxt.cache.state), np.asarray(ref.cache.state), atol=1e-5, rtol=1e-5)
    # The test can fail: the state after the whole block gives other logits.
    wrong = forward(params, config, jnp.asarray(after), unsettled)
    assert np.abs(np.asarray(wrong.logits) - np.asarray(ref.logits)).max() > 1e-2


def test_settle_of_a_decoder_without_linear_layers_is_a_no_op():
    config = dataclasses.replace(hybrid_config(False), linear_attention=None, linear_layers=())
    params = init_params(config, jax.random.PRNGKey(0))
    out = forward(params, config, jnp.zeros((1, 3), jnp.int32), init_cache(config, 1, 8), defer_recurrent=True)
    assert out.pending is None and out.cache.state is None
    assert settle(out.cache, out.pending, jnp.array([1])) is out.cache


# --------------------------------------------------------------------------- decoding


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.heavy)])
def test_plain_greedy_decoding_equals_transformers_generate(family, hf_hybrid):
    assert_plain_greedy_equals_generate(*hf_hybrid[family])


# --------------------------------------------------------------------------- training


@pytest.mark.heavy
def test_train_cli_regenerates_with_and_trains_a_drafter_for_a_hybrid_target(hf_hybrid, tmp_path):
    """`python -m train` with a Qwen3.5 target: it regenerates responses with the target (its
    states settle every cycle), trains against its taps, and exports a dense Qwen3 drafter
    (whole-head RoPE, no linear layers or gates) that pairs with the target and decodes it
    losslessly."""
    from dflash_jax import load_drafter
    from dflash_jax.drafter import check_pair
    from train.export import export

    target = hf_hybrid["qwen3_5"][1]
    losses = train_cli_on_regenerated(target, tmp_path, steps=4, save_every=2)
    assert len(losses) == 4 and all(np.isfinite(losses))
    dcfg, dparams = load_drafter(export(tmp_path / "run", tmp_path / "drafter", dtype="float32"))
    tcfg, tparams = load_target(target)
    check_pair(tcfg, dcfg)
    m = dcfg.model
    assert (m.num_linear_layers, m.attention_output_gate, m.norm_zero_centered) == (0, False, False)
    assert m.rope.partial_rotary_factor == 1.0 and m.rope.theta == tcfg.rope.theta
    rs = np.random.RandomState(1)
    prompts = [rs.randint(0, 159, n).tolist() for n in (5, 14)]
    spec = BatchEngine(tcfg, tparams, dcfg, dparams, batch_size=2, max_new_tokens=10, max_prompt_len=16, speculation="fixed")
    plain = BatchEngine(tcfg, tparams, batch_size=2, max_new_tokens=10, max_prompt_len=16)
    assert sorted((r.index, r.output_ids) for r in spec.generate(prompts)) == sorted(
        (r.index, r.output_ids) for r in plain.generate(prompts))
