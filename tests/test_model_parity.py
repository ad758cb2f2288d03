"""Our Flax decoder against transformers PyTorch: logits and every tap, float32."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax import forward, init_cache, load_target
from tiny import FAMILIES, make_model, save_model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_and_taps_match_transformers(family, tmp_path):
    model = make_model(family)
    save_model(model, tmp_path)
    config, params = load_target(tmp_path)
    ids = np.random.RandomState(1).randint(0, config.vocab_size, (2, 40))
    with torch.no_grad():
        ref = model(torch.tensor(ids), output_hidden_states=True)
    taps = tuple(range(config.num_hidden_layers))
    out = forward(params, config, jnp.asarray(ids, jnp.int32), init_cache(config, 2, 64), taps=taps)

    np.testing.assert_allclose(np.asarray(out.logits), ref.logits.numpy(), atol=1e-4, rtol=0)
    d = config.hidden_size
    for j, layer in enumerate(taps):
        np.testing.assert_allclose(
            np.asarray(out.tap_features[..., j * d:(j + 1) * d]),
            ref.hidden_states[layer + 1].numpy(), atol=1e-4, rtol=1e-4, err_msg=f"tap {layer}",
        )


def test_family_switches_parsed(tmp_path):
    checks = {
        "qwen3": dict(qk_norm=True, qkv_bias=False, tie_word_embeddings=False),
        "qwen3_tied": dict(tie_word_embeddings=True),
        "qwen2": dict(qk_norm=False, qkv_bias=True, o_bias=False),
        "mistral": dict(sliding_windows=(6, 6, 6, 6)),
    }
    for family, want in checks.items():
        save_model(make_model(family), tmp_path / family)
        config, _ = load_target(tmp_path / family)
        for key, value in want.items():
            assert getattr(config, key) == value, (family, key)
    save_model(make_model("llama3"), tmp_path / "llama3")
    config, _ = load_target(tmp_path / "llama3")
    assert config.rope.type == "llama3" and config.rope.factor == 8.0
    save_model(make_model("qwen3_prope"), tmp_path / "prope")
    config, _ = load_target(tmp_path / "prope")
    assert config.rope.type == "proportional" and config.rope.partial_rotary_factor == 0.25
    from dflash_jax.model.rope import rope_inv_freq

    inv = rope_inv_freq(config.rope, config.head_dim)  # 2 of 8 pairs rotate, the rest are identity
    assert inv.shape == (8,) and (inv[:2] > 0).all() and (inv[2:] == 0).all()


def test_bfloat16_checkpoint_loads_without_torch_and_tracks_float32(tmp_path):
    model = make_model("qwen3")
    ids = np.random.RandomState(2).randint(0, 160, (1, 24))
    with torch.no_grad():
        ref = model(torch.tensor(ids)).logits.numpy()
    save_model(model, tmp_path, dtype=torch.bfloat16)
    config, params = load_target(tmp_path)
    assert config.dtype == "bfloat16"
    assert params["model"]["layers_0"]["self_attn"]["q_proj"]["kernel"].dtype == jnp.bfloat16
    out = forward(params, config, jnp.asarray(ids, jnp.int32), init_cache(config, 1, 32))
    assert out.logits.dtype == jnp.float32
    err = np.abs(np.asarray(out.logits) - ref).max()
    assert err < 0.05 * np.abs(ref).max(), err
    # Parameters are the checkpoint's bfloat16 values bit for bit (no float32 detour).
    emb = model.model.embed_tokens.weight.detach().to(torch.bfloat16).float().numpy()
    np.testing.assert_array_equal(np.asarray(params["model"]["embed_tokens"]["embedding"], np.float32), emb)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_rope_traced_for_a_tpu_is_the_same_rotation_bit_for_bit(dtype):
    """Traced for a TPU, `apply_rope` rotates whole rows with a lane roll (the halves' 64-wide axis would
    be padded to 128 lanes); it must give the half-split form's values exactly, partial rotary included."""
    import jax

    from dflash_jax.model.layers import apply_rope
    from dflash_jax.platform import compiling_for

    rng = np.random.RandomState(0)
    x = jnp.asarray(rng.randn(2, 5, 3, 128), dtype)
    for pairs in (64, 32):  # full, and partial rotary (Qwen3.5's quarter)
        angles = rng.rand(2, 5, pairs) * 50
        cos, sin = jnp.asarray(np.cos(angles), jnp.float32), jnp.asarray(np.sin(angles), jnp.float32)
        plain = jax.jit(apply_rope)(x, cos, sin)
        with compiling_for("tpu"):  # a function of its own: jit would reuse the trace made for the CPU
            traced = jax.jit(lambda *a: apply_rope(*a)).trace(x, cos, sin)
        assert "concatenate" in str(traced.jaxpr)  # the lane roll, not the half-split form
        rolled = traced.lower(lowering_platforms=("cpu",)).compile()(x, cos, sin)
        np.testing.assert_array_equal(np.asarray(rolled, np.float32), np.asarray(plain, np.float32))
