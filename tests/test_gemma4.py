"""Gemma 4 targets against transformers, beyond the logits and taps of test_model_parity
(whose tiny gemma4 checkpoint uses every switch: two head shapes, k = v, shared K/V, per-layer
inputs, experts beside the MLP, soft-capping).

- The cache: global layers keep their own K/V group; layers sharing K/V have no slot.
- A prompt prefilled in right-padded pieces equals one pass; plain greedy decoding equals
  transformers' `generate` (prompts longer than the 8-token window).
- The multimodal `gemma4` checkpoint's text model loads and equals it; the 31B shape parses.
- Bad configs are one-line errors; a drafter for a Gemma 4 target borrows its scaled
  embedding, and `python -m train` trains one (`-m heavy`).
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from dflash_jax import forward, init_cache, load_target
from dflash_jax.config import ModelConfig
from dflash_jax.errors import ConfigError
from dflash_jax.families import model_config
from tiny import (BASE, FAMILIES, assert_plain_greedy_equals_generate, make_model, prefill_in_pieces, save_model,
                  train_cli_on_regenerated)


@pytest.fixture(scope="module")
def hf_gemma(tmp_path_factory):
    model = make_model("gemma4", seed=3)
    return model, save_model(model, tmp_path_factory.mktemp("gemma4") / "model")


def torch_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def test_config_and_cache_layout(hf_gemma):
    """Layers: sliding, sliding, global, twice; layer 4 reads layer 3's K/V and layer 5 layer
    2's, as transformers' kv_sharing_modes say; only K/V-owning layers have slots."""
    config, _ = load_target(hf_gemma[1])
    model = hf_gemma[0]
    modes = model.config.kv_sharing_modes
    assert config.kv_shared_from == (None, None, None, None, 3, 2)
    for i in range(6):
        shared = config.kv_shared_from[i]
        assert (shared is not None) == (modes[i] == "reuse"), i
        if shared is not None:
            assert modes[shared] == "store" and model.config.layer_types[shared] == model.config.layer_types[i]
    assert [config.is_global(i) for i in range(6)] == [t == "full_attention" for t in model.config.layer_types]
    assert config.attention_shape(2) == (32, 1) and config.attention_shape(0) == (16, 2)
    cache = init_cache(config, 2, 40)
    assert cache.k.shape == (3, 2, 40, 2 * 16)  # sliding layers 0, 1, 3 (4 shares 3); 2 heads of 16 a row
    assert cache.k_global.shape == (1, 2, 40, 1 * 32) and cache.global_heads == 1  # global layer 2 (5 shares it)
    assert config.global_rope.type == "proportional" and config.rope.type == "default"
    assert config.final_logit_softcap == 30.0 and config.per_layer_input_size == 8


def test_prefill_in_right_padded_pieces_equals_one_pass(hf_gemma):
    model, path = hf_gemma
    config, params = load_target(path)
    ids = np.random.RandomState(2).randint(0, 160, (2, 30))
    ref = torch_logits(model, ids)
    for r, got in enumerate(prefill_in_pieces(params, config, ids, [[13, 17], [20, 10]], width=20, cache_len=48)):
        np.testing.assert_allclose(got, ref[r], atol=1e-4, rtol=0, err_msg=f"row {r}")


def test_plain_greedy_decoding_equals_transformers_generate(hf_gemma):
    assert_plain_greedy_equals_generate(*hf_gemma, lengths=(3, 19, 11))  # 19 > the window of 8


def test_multimodal_checkpoint_loads_its_text_model(tmp_path):
    text = {**BASE, **FAMILIES["gemma4"][2]}
    cfg = transformers.Gemma4Config(text_config=text, vision_config=None, audio_config=None)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    model.save_pretrained(tmp_path)
    config, params = load_target(tmp_path)
    assert config.model_type == "gemma4" and config.num_kv_slots(True) == 1
    ids = np.random.RandomState(4).randint(0, 160, (1, 20))
    out = forward(params, config, jnp.asarray(ids, jnp.int32), init_cache(config, 1, 32))
    np.testing.assert_allclose(np.asarray(out.logits), torch_logits(model, ids), atol=1e-4, rtol=0)


def test_published_31b_config_parses():
    """Gemma 4 31B's text config: 60 layers, every sixth global (512 x 4 KV heads, k = v,
    proportional RoPE on a quarter), sliding window 1024, no shared K/V or per-layer inputs."""
    from dflash_jax.shapes import PUBLISHED_TARGETS

    config = model_config(PUBLISHED_TARGETS["gemma4-31b"])
    assert config.num_hidden_layers == 60 and config.num_kv_slots(True) == 10 and config.num_kv_slots(False) == 50
    assert config.attention_shape(5) == (512, 4) and config.attention_shape(0) == (256, 16)
    assert config.attention_k_eq_v and config.kv_shared_from == () and config.per_layer_input_size == 0
    assert config.sliding_windows[:6] == (1024,) * 5 + (None,) and config.moe is None
    assert config.global_rope.partial_rotary_factor == 0.25 and config.global_rope.theta == 1e6


GOOD = {**BASE, "model_type": "gemma4_text", "num_hidden_layers": 2, "head_dim": 16,
        "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 8}


@pytest.mark.parametrize("change,message", [
    (dict(layer_types=["sliding_attention", "chunked_attention"]), "unsupported kind(s) ['chunked_attention']"),
    (dict(use_double_wide_mlp=True), "double-wide MLPs are not supported"),
    (dict(num_kv_shared_layers=2), "num_kv_shared_layers must be in 0..1, got 2"),
    (dict(layer_types=["full_attention", "sliding_attention"], num_kv_shared_layers=1),
     "no earlier layer of type 'sliding_attention' to share K/V from"),
    (dict(enable_moe_block=True, num_experts=4, top_k_experts=6, moe_intermediate_size=8), "top_k_experts 6 > num_experts 4"),
    (dict(hidden_activation="relu"), "hidden_activation 'relu' is not supported"),
    (dict(per_layer_config={"0": {"head_dim": 32}}), "per_layer_config must give every full_attention layer"),
])
def test_bad_gemma4_config_is_a_one_line_error(change, message):
    with pytest.raises(ConfigError) as e:
        model_config({**GOOD, **change})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_drafter_borrows_the_scaled_embedding(hf_gemma):
    """The drafter's block embeddings are the target's scaled ones (x sqrt(hidden)), as the
    reference drafter gets them from the target's embedding module."""
    from dflash_jax.model import CausalLM

    model, path = hf_gemma
    config, params = load_target(path)
    ids = jnp.asarray([[1, 7, 42]], jnp.int32)
    ours = CausalLM(config).apply({"params": params}, ids, method=CausalLM.embed)
    with torch.no_grad():
        ref = model.model.embed_tokens(torch.tensor(np.asarray(ids))).numpy()
    np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)
    assert np.abs(ref).max() > 2 * np.abs(params["model"]["embed_tokens"]["embedding"]).max()  # really scaled


@pytest.mark.heavy
def test_train_cli_trains_a_drafter_for_a_gemma4_target(hf_gemma, tmp_path):
    losses = train_cli_on_regenerated(hf_gemma[1], tmp_path, steps=4, save_every=2)
    assert len(losses) == 4 and all(np.isfinite(losses))


def test_a_new_drafter_for_gemma4_is_plain_qwen3():
    """`dense_drafter_model` of a Gemma 4 target keeps its widths, sliding head shape and RoPE,
    and none of its extras (GELU, sandwich norms, scaled embeddings, shared K/V...), so the
    exported z-lab config reads back as the same drafter."""
    from dflash_jax.drafter import DrafterConfig, dense_drafter_model
    from dflash_jax.shapes import PUBLISHED_TARGETS

    target = model_config(PUBLISHED_TARGETS["gemma4-31b"])
    model = dense_drafter_model(target, 5)
    plain = ModelConfig(model_type="qwen3", vocab_size=262144, hidden_size=5376, intermediate_size=21504,
                        num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=16, head_dim=256,
                        rope=target.rope, max_position_embeddings=262144, qk_norm=True, sliding_windows=(None,) * 5)
    assert model == plain
    config = DrafterConfig(model=model, block_size=16, mask_token_id=0, target_layer_ids=(1, 15, 29, 43, 57),
                           num_target_layers=60)
    assert DrafterConfig.from_hf_dict(config.to_hf_dict()) == config
