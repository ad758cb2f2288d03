"""The gated delta rule of Qwen3.5's linear-attention layers, against transformers' reference,
and its rollback: a verify pass's state kept after the accepted prefix equals the state of a
run over that prefix alone."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from dflash_jax.model import delta_rule

B, KH, VH, DK, DV = 2, 2, 4, 8, 6  # two value heads per q/k head


def inputs(t, seed):
    rs = np.random.RandomState(seed)
    q, k = rs.randn(B, t, KH, DK).astype(np.float32), rs.randn(B, t, KH, DK).astype(np.float32)
    v = rs.randn(B, t, VH, DV).astype(np.float32)
    g = -np.abs(rs.randn(B, t, VH)).astype(np.float32) * 0.3  # log decay <= 0
    beta = (1 / (1 + np.exp(-rs.randn(B, t, VH)))).astype(np.float32)
    state = rs.randn(B, VH, DK, DV).astype(np.float32) * 0.5
    return q, k, v, g, beta, state


def torch_reference(fn, q, k, v, g, beta, state, **kw):
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    out, final = getattr(m, fn)(*(torch.from_numpy(x) for x in (q, k, v, g, beta)), initial_state=torch.from_numpy(state),
                                output_final_state=True, use_qk_l2norm_in_kernel=True, **kw)
    return out.numpy(), final.numpy()


@pytest.mark.parametrize("t", [1, 5, 16])
def test_recurrent_equals_transformers(t):
    x = inputs(t, t)
    out, final = delta_rule.recurrent(*map(jnp.asarray, x))
    ref_out, ref_final = torch_reference("torch_recurrent_gated_delta_rule", *x)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(final), ref_final, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("t,chunk", [(40, 16), (16, 16), (7, 16), (150, 64)])  # chunks with a ragged end; one; less
def test_chunked_equals_transformers_and_the_recurrent_form(t, chunk):
    x = inputs(t, 100 + t)
    out, final = delta_rule.chunked(*map(jnp.asarray, x), chunk=chunk)
    ref_out, ref_final = torch_reference("torch_chunk_gated_delta_rule", *x, chunk_size=chunk)
    np.testing.assert_allclose(np.asarray(out), ref_out, atol=5e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(final), ref_final, atol=5e-5, rtol=1e-4)
    rec_out, rec_final = delta_rule.recurrent(*map(jnp.asarray, x))
    np.testing.assert_allclose(np.asarray(out), np.asarray(rec_out), atol=5e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(final), np.asarray(rec_final), atol=5e-5, rtol=1e-4)


@pytest.mark.parametrize("n", [1, 2, 5, 16, 17, 64])
def test_unit_lower_inverse_equals_numpy(n):
    """(I + L)^-1 by matmuls (doubling within 16-blocks, halving above) equals LAPACK's
    inverse, for the chunk systems the rule builds: L = strictly-lower(beta k k^T * decay)."""
    rs = np.random.RandomState(n)
    k = rs.randn(3, n, 8)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    beta = 1 / (1 + np.exp(-rs.randn(3, n, 1)))
    cum = np.cumsum(-np.abs(rs.randn(3, n)) * 0.1, axis=-1)
    lower = np.tril((beta * k) @ k.swapaxes(-1, -2) * np.exp(cum[:, :, None] - cum[:, None, :]), -1)
    got = np.asarray(delta_rule.unit_lower_inverse(jnp.asarray(lower, jnp.float32)))
    np.testing.assert_allclose(got, np.linalg.inv(np.eye(n) + lower), atol=1e-5, rtol=0)
    assert n < 3 or np.abs(np.tril(got, -2)).max() > 1e-3  # the system's inverse is not just I - L


def test_rollback_keeps_the_state_after_the_accepted_prefix():
    """A verify pass over 8 tokens with rows accepting 3 and 0 (and all 8 in a second call):
    the kept state is the state after the accepted tokens alone, and the outputs are the
    full pass's."""
    q, k, v, g, beta, state = inputs(8, 7)
    x = tuple(map(jnp.asarray, (q, k, v, g, beta)))
    out, kept = delta_rule.recurrent(*x, jnp.asarray(state), keep=jnp.array([3, 0]))
    for row, accepted in ((0, 3), (1, 0)):
        prefix = tuple(a[row:row + 1, :accepted] for a in x)
        if accepted:
            _, alone = delta_rule.recurrent(*prefix, jnp.asarray(state[row:row + 1]))
        else:
            alone = jnp.asarray(state[row:row + 1])
        np.testing.assert_allclose(np.asarray(kept[row]), np.asarray(alone[0]), atol=1e-6, rtol=1e-6)
    full_out, final = delta_rule.recurrent(*x, jnp.asarray(state))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(full_out))
    _, all_kept = delta_rule.recurrent(*x, jnp.asarray(state), keep=jnp.array([8, 8]))
    np.testing.assert_array_equal(np.asarray(all_kept), np.asarray(final))
    # The rejected suffix did change the state: keeping it would be wrong.
    assert np.abs(np.asarray(final[0]) - np.asarray(kept[0])).max() > 1e-2


def test_settle_advances_state_and_tail_by_each_rows_accepted_prefix_alone():
    """A deferred block settled at keep = (3, 0): each row's state and tail equal those of a
    run over its accepted tokens alone (the state by the recurrent form, to 1e-5)."""
    q, k, v, g, beta, state = inputs(8, 11)
    conv_in = np.random.RandomState(3).randn(B, 8, 5).astype(np.float32)
    tail = np.random.RandomState(4).randn(B, 3, 5).astype(np.float32)
    pending = delta_rule.Pending(*map(jnp.asarray, (conv_in, k, v, g, beta)))
    new_tail, settled = delta_rule.settle_state(jnp.asarray(tail), jnp.asarray(state), pending, jnp.array([3, 0]))
    _, alone = delta_rule.recurrent(*(jnp.asarray(a[:1, :3]) for a in (q, k, v, g, beta)), jnp.asarray(state[:1]))
    np.testing.assert_allclose(np.asarray(settled[0]), np.asarray(alone[0]), atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(settled[1]), state[1], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(new_tail[0]), np.concatenate([tail[0], conv_in[0]])[3:6])
    np.testing.assert_array_equal(np.asarray(new_tail[1]), tail[1])


# --------------------------------------------------------------------------- the short convolution

C, K = 10, 4


def conv_inputs(t, seed):
    rs = np.random.RandomState(seed)
    return (rs.randn(B, t, C).astype(np.float32), rs.randn(C, K).astype(np.float32),
            rs.randn(C).astype(np.float32), rs.randn(B, K - 1, C).astype(np.float32))


def test_causal_conv_equals_transformers_prefill_and_update():
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    x, w, bias, tail = conv_inputs(9, 0)
    y, new_tail = delta_rule.causal_conv(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), jnp.zeros((B, K - 1, C)))
    ref = m.causal_conv1d_fn(torch.from_numpy(x).transpose(1, 2), torch.from_numpy(w), torch.from_numpy(bias),
                             activation="silu").transpose(1, 2).numpy()
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_tail), x[:, -(K - 1):])
    # Decoding from a state: transformers' update keeps the state in [b, C, len] order.
    state = torch.from_numpy(tail).transpose(1, 2).contiguous()
    ref = m.causal_conv1d_update(torch.from_numpy(x[:, :3]).transpose(1, 2), state, torch.from_numpy(w),
                                 torch.from_numpy(bias), activation="silu").transpose(1, 2).numpy()
    y, new_tail = delta_rule.causal_conv(jnp.asarray(x[:, :3]), jnp.asarray(w), jnp.asarray(bias), jnp.asarray(tail))
    np.testing.assert_allclose(np.asarray(y), ref, atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(new_tail), state.transpose(1, 2).numpy())


def test_causal_conv_rollback_keeps_the_tail_after_the_accepted_prefix():
    x, w, bias, tail = conv_inputs(6, 1)
    args = (jnp.asarray(w), jnp.asarray(bias))
    _, kept = delta_rule.causal_conv(jnp.asarray(x), *args, jnp.asarray(tail), keep=jnp.array([4, 1]))
    for row, accepted in ((0, 4), (1, 1)):
        _, alone = delta_rule.causal_conv(jnp.asarray(x[row:row + 1, :accepted]), *args, jnp.asarray(tail[row:row + 1]))
        np.testing.assert_array_equal(np.asarray(kept[row]), np.asarray(alone[0]))
    _, none_kept = delta_rule.causal_conv(jnp.asarray(x), *args, jnp.asarray(tail), keep=jnp.array([0, 0]))
    np.testing.assert_array_equal(np.asarray(none_kept), tail)


# --------------------------------------------------------------------------- the layer


def test_gated_delta_net_layer_equals_transformers_and_decodes_in_pieces():
    """Our layer with transformers' weights equals `Qwen3_5GatedDeltaNet` on a prompt (its
    chunked path, from an empty state); running the same tokens as a prefill of 7, a verify of
    5 rolled back to 2 and the rest token by token gives the same outputs and final state."""
    import transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from dflash_jax.model.delta_rule import GatedDeltaNet

    cfg = transformers.Qwen3_5TextConfig(hidden_size=24, linear_num_value_heads=4, linear_num_key_heads=2,
                                         linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
                                         num_hidden_layers=1, layer_types=["linear_attention"], rms_norm_eps=1e-6)
    torch.manual_seed(0)
    ref = m.Qwen3_5GatedDeltaNet(cfg, 0).eval()
    with torch.no_grad():
        ref.dt_bias.add_(0.3 * torch.randn_like(ref.dt_bias))
        ref.norm.weight.add_(0.2 * torch.randn_like(ref.norm.weight))
    sd = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    params = {name: {"kernel": sd[f"{name}.weight"].T} for name in ("in_proj_qkv", "in_proj_z", "in_proj_b",
                                                                      "in_proj_a", "out_proj")}
    params.update(conv1d=sd["conv1d.weight"], dt_bias=sd["dt_bias"], A_log=sd["A_log"], norm={"weight": sd["norm.weight"]})
    layer = GatedDeltaNet(hidden_size=24, k_heads=2, v_heads=4, k_dim=8, v_dim=6, conv_kernel=4)
    apply = lambda x, tail, state, **kw: layer.apply({"params": params}, x, tail, state, **kw)

    x = np.random.RandomState(0).randn(2, 20, 24).astype(np.float32)
    with torch.no_grad():
        want = ref(torch.from_numpy(x)).numpy()
    tail0, state0 = jnp.zeros((2, 3, layer.conv_dim)), jnp.zeros((2, 4, 8, 6))
    full, _, final, _ = apply(jnp.asarray(x), tail0, state0, chunk=8)
    np.testing.assert_allclose(np.asarray(full), want, atol=1e-5, rtol=1e-4)

    # Prefill 7 (chunked) of rows right-padded to 9; a deferred verify of 5 settled at 2 (the
    # other 3 are redone); then one at a time.
    padded = np.concatenate([x[:, :7], np.random.RandomState(1).randn(2, 2, 24).astype(np.float32)], 1)
    out, tail, state, _ = apply(jnp.asarray(padded), tail0, state0, valid=jnp.array([7, 7]), chunk=4)
    pieces = [out[:, :7]]
    verify, same_tail, same_state, pending = apply(jnp.asarray(x[:, 7:12]), tail, state, defer=True)
    assert same_tail is tail and same_state is state
    tail, state = delta_rule.settle_state(tail, state, pending, jnp.array([2, 2]))
    pieces.append(verify[:, :2])
    for i in range(9, 20):
        out, tail, state, _ = apply(jnp.asarray(x[:, i:i + 1]), tail, state)
        pieces.append(out)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(pieces, 1)), want, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(np.asarray(state), np.asarray(final), atol=1e-5, rtol=1e-4)
