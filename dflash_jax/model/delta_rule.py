"""The gated delta rule (Qwen3.5 / Qwen3-Next linear-attention layers), with the state
rollback speculative decoding needs.

A gated delta-net layer keeps, per row and value head, a state S [k_dim, v_dim] instead of a
KV cache. Each token t decays it and writes a correction:

    S <- exp(g_t) S
    S <- S + k_t (beta_t (v_t - k_t^T S))^T        (the delta rule: write what S mispredicts)
    o_t = S^T q_t / sqrt(k_dim)

`recurrent` runs that token by token (decoding, and the verify pass of a block). It can also
return the state as it was after any position of the chunk, `keep[b]` tokens in, which is
the rollback: a verify pass over a drafted block leaves each row's state after its last
*accepted* token, exactly the state a run over the accepted tokens alone would leave.

`chunked` computes the same in chunks (prefill): within a chunk the T sequential updates
collapse into a few matmuls with the inverse of a unit lower-triangular matrix (the UT
transform of DeltaNet; `unit_lower_inverse`, matmuls only, no LAPACK call), and only the
chunk boundaries are sequential. Both work in float32, as transformers' reference
and the FLA kernels do.

`causal_conv` is the short depthwise convolution in front of the layer, whose state (the
last K - 1 inputs) rolls back the same way. `GatedDeltaNet` is the whole layer
(projections, convolution, the rule, the gated RMSNorm), equal to transformers'
`Qwen3_5GatedDeltaNet`.

In the decoder a verify pass cannot know how much of its block will be accepted, so the
layer can `defer` its state: it computes the block's outputs from the state it was given,
leaves the state and tail as they were, and returns what the block would write (`Pending`:
its convolution inputs, keys, values, decays and write strengths). `settle_state` then advances
state and tail by each row's accepted prefix alone: the chunked rule with the rejected
suffix's decay and write strength zeroed (a masked position neither decays nor writes), and
the tail sliced at the prefix's end. No per-position copy of the state is ever kept.

Shapes: q, k [b, T, k_heads, k_dim]; v [b, T, v_heads, v_dim] (v_heads a multiple of
k_heads: each q/k head serves v_heads / k_heads consecutive value heads); g, beta
[b, T, v_heads]; state [b, v_heads, k_dim, v_dim].
"""

from __future__ import annotations

from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.model.layers import RMSNorm
from dflash_jax.model.weights import Projection


def l2norm(x, eps: float = 1e-6):
    return x * jax.lax.rsqrt((x * x).sum(-1, keepdims=True) + eps)


def _prepare(q, k, v, g, beta, l2norm_qk: bool):
    """float32, q/k repeated onto the value heads, normalised and q scaled; heads first:
    [b, heads, T, ...]. q may be None (only the state is wanted)."""
    if q is None:
        q = k
    groups = v.shape[2] // k.shape[2]
    if groups > 1:
        q, k = jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)
    q, k, v, g, beta = (x.astype(jnp.float32).swapaxes(1, 2) for x in (q, k, v, g, beta))
    if l2norm_qk:
        q, k = l2norm(q), l2norm(k)
    return q * q.shape[-1] ** -0.5, k, v, g, beta


def recurrent(q, k, v, g, beta, state, *, keep=None, l2norm_qk: bool = True):
    """Token by token. Returns (out [b, T, v_heads, v_dim] float32, state): the state after
    all T tokens, or with `keep` [b] int32 (0..T) the state after the first keep[b] tokens of
    each row (keep 0: the state given), for rolling a verify pass back to its accepted
    prefix without running it again."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm_qk)
    t = q.shape[2]
    state = state.astype(jnp.float32)
    kept = state

    def step(carry, xs):
        s, kept = carry
        i, q_t, k_t, v_t, g_t, b_t = xs  # [b, h, d] / [b, h]
        s = s * jnp.exp(g_t)[..., None, None]
        delta = (v_t - jnp.einsum("bhkv,bhk->bhv", s, k_t)) * b_t[..., None]
        s = s + k_t[..., None] * delta[..., None, :]
        out = jnp.einsum("bhkv,bhk->bhv", s, q_t)
        if keep is not None:
            kept = jnp.where((keep == i + 1)[:, None, None, None], s, kept)
        return (s, kept), out

    xs = (jnp.arange(t), *(x.swapaxes(0, 2).swapaxes(1, 2) for x in (q, k, v)),
          *(x.transpose(2, 0, 1) for x in (g, beta)))
    (final, kept), out = jax.lax.scan(step, (state, kept), xs)
    return out.transpose(1, 0, 2, 3), (final if keep is None else kept)


def unit_lower_inverse(lower, *, base: int = 8):
    """(I + L)^-1 for a strictly lower-triangular L [..., n, n], without a triangular solve (on
    the CPU that is a LAPACK custom call, and two of them running at once deadlocked XLA's CPU
    thread pool).

    The batch goes to the last axis, so every product is elementwise over [.., batch] vectors
    that fill an accelerator's lanes (n x n matmuls of a chunk's small systems would be padded
    to its tiles: 8x the work at n = 16 on a TPU). Halved recursively,
    [[I + L11, 0], [L21, I + L22]]^-1 = [[A, 0], [-D L21 A, D]] with A = (I + L11)^-1 and
    D = (I + L22)^-1 (block forward substitution), down to blocks of at most `base`, inverted
    by forward substitution: row i = e_i - sum_{j<i} L_ij row_j."""
    shape, n = lower.shape, lower.shape[-1]
    inverse = _lanes_inverse(jnp.moveaxis(lower.reshape(-1, n, n), 0, -1), base)
    return jnp.moveaxis(inverse, -1, 0).reshape(shape)


def _lanes_inverse(lower, base: int):
    """unit_lower_inverse of L [n, n, batch]."""
    n = lower.shape[0]
    if n <= base:
        eye = jnp.broadcast_to(jnp.eye(n, dtype=lower.dtype)[..., None], lower.shape)
        rows = eye[:1]  # [i, n, batch]: the inverse's rows so far
        for i in range(1, n):
            row = eye[i] - (lower[i, :i, None, :] * rows).sum(0)
            rows = jnp.concatenate([rows, row[None]], axis=0)
        return rows
    product = lambda x, y: (x[:, :, None, :] * y[None, :, :, :]).sum(1)  # x @ y per batch entry
    h = n // 2
    a, d = _lanes_inverse(lower[:h, :h], base), _lanes_inverse(lower[h:, h:], base)
    top = jnp.concatenate([a, jnp.zeros((h, n - h) + a.shape[2:], a.dtype)], axis=1)
    bottom = jnp.concatenate([-product(product(d, lower[h:, :h]), a), d], axis=1)
    return jnp.concatenate([top, bottom], axis=0)


def chunked(q, k, v, g, beta, state, *, chunk: int = 64, l2norm_qk: bool = True):
    """The same as `recurrent` (its final state), in chunks of `chunk` positions: within a
    chunk by the inverse of a unit lower-triangular system and matmuls, across chunks by a scan. The
    sequence is padded to whole chunks with g = 0, beta = 0 (no decay, no write). With q
    None only the final state is computed (out is None)."""
    want_out = q is not None
    q, k, v, g, beta = _prepare(q, k, v, g, beta, l2norm_qk)
    b, h, t, dk = k.shape
    dv = v.shape[-1]
    pad = (-t) % chunk
    if pad:
        q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
        g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
    n = (t + pad) // chunk
    split = lambda x: x.reshape(b, h, n, chunk, *x.shape[3:])
    q, k, v, g, beta = map(split, (q, k, v, g, beta))
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]

    cum = jnp.cumsum(g, axis=-1)  # log of the decay from the chunk's start through each position
    causal = jnp.tril(jnp.ones((chunk, chunk), bool))
    pair = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))  # decay j -> i, i >= j
    strictly = jnp.tril(jnp.ones((chunk, chunk), bool), -1)
    inverse = unit_lower_inverse(jnp.where(strictly, (k_beta @ k.swapaxes(-1, -2)) * pair, 0.0))
    intra = jnp.where(causal, (q @ k.swapaxes(-1, -2)) * pair, 0.0)
    new_values = inverse @ v_beta  # what each position writes, given the chunk's earlier writes
    k_cumdecay = inverse @ (k_beta * jnp.exp(cum)[..., None])  # how each position reads the state at the chunk start

    q_decayed = q * jnp.exp(cum)[..., None]
    k_to_end = k * jnp.exp(cum[..., -1:] - cum)[..., None]
    chunk_decay = jnp.exp(cum[..., -1])[..., None, None]

    def step(s, xs):
        nv, kc, qd, ke, intra_i, decay_i = xs
        v_new = nv - kc @ s
        out = qd @ s + intra_i @ v_new if want_out else None
        return s * decay_i + ke.swapaxes(-1, -2) @ v_new, out

    move = lambda x: jnp.moveaxis(x, 2, 0)
    final, out = jax.lax.scan(step, state.astype(jnp.float32),
                              tuple(map(move, (new_values, k_cumdecay, q_decayed, k_to_end, intra, chunk_decay))))
    if not want_out:
        return None, final
    out = jnp.moveaxis(out, 0, 2).reshape(b, h, n * chunk, dv)[:, :, :t]
    return out.swapaxes(1, 2), final


def causal_conv(x, weight, bias, tail, *, keep=None, activation: str | None = "silu"):
    """The short depthwise causal convolution in front of a gated delta-net layer, with its
    own rollback.

    x [b, T, C]; weight [C, K]; bias [C] or None; tail [b, K - 1, C]: the layer's last K - 1
    inputs (zeros before the first token). Output t sees inputs t - K + 1 .. t. Returns
    (y [b, T, C] in x's dtype, new tail): the last K - 1 inputs of [tail ; x], or with `keep`
    [b] (0..T) those ending at each row's keep[b]-th token, the tail after the accepted prefix.
    """
    k = weight.shape[-1]
    t = x.shape[1]
    full = jnp.concatenate([tail.astype(x.dtype), x], axis=1)  # [b, K - 1 + T, C]
    w = weight.astype(jnp.float32)
    y = sum(full[:, j:j + t].astype(jnp.float32) * w[:, j] for j in range(k))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    if activation == "silu":
        y = jax.nn.silu(y)
    elif activation is not None:
        raise ValueError(f"unknown activation {activation!r}")
    if keep is None:
        new_tail = full[:, t:]
    else:
        new_tail = jax.vmap(lambda f, s: jax.lax.dynamic_slice_in_dim(f, s, k - 1, axis=0))(full, keep)
    return y.astype(x.dtype), new_tail


class Pending(NamedTuple):
    """What a deferred block of T positions would write into a gated delta-net layer's state:
    conv_in [b, T, C] (the convolution's inputs), k [b, T, k_heads, k_dim] and v [b, T,
    v_heads, v_dim] (after the convolution), g and beta [b, T, v_heads]."""

    conv_in: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array


def settle_state(tail, state, pending: Pending, keep):
    """The tail and state after the first keep[b] (0..T) positions of a deferred block: the
    chunked rule over the block with the later positions masked out (g = 0: no decay,
    beta = 0: no write), and the convolution tail ending at the keep[b]-th input."""
    t = pending.k.shape[1]
    mask = (jnp.arange(t)[None, :] < keep[:, None])[..., None]
    _, state = chunked(None, pending.k, pending.v, jnp.where(mask, pending.g, 0.0), jnp.where(mask, pending.beta, 0.0),
                       state, chunk=t)
    kernel = tail.shape[1] + 1
    full = jnp.concatenate([tail, pending.conv_in.astype(tail.dtype)], axis=1)
    tail = jax.vmap(lambda f, s: jax.lax.dynamic_slice_in_dim(f, s, kernel - 1, axis=0))(full, keep)
    return tail, state


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer (`Qwen3_5GatedDeltaNet`), parameters named as its HF
    tensors: in_proj_qkv, in_proj_z, in_proj_b, in_proj_a (Dense), conv1d [C, 1, K] (as HF's
    depthwise `conv1d.weight`), dt_bias and A_log [v_heads], norm/weight [v_dim], out_proj.

    x [b, T, hidden] with the layer's state (tail [b, K - 1, C], state [b, v_heads, k_dim,
    v_dim]) -> (out [b, T, hidden], tail, state, pending). One token runs the recurrent form
    (as transformers decodes), more the chunked one (chunks of `chunk`). valid [b]: only the
    first valid[b] positions are real (a right-padded prefill): the state and tail stop
    there. defer: leave tail and state as given and return the block's `Pending` for
    `settle_state` (a verify pass); otherwise pending is None."""

    hidden_size: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    conv_kernel: int
    eps: float = 1e-6
    dtype: jnp.dtype = jnp.float32
    weight_format: str | tuple = "dense"  # the projections' (`dflash_jax.model.weights`: a name or FormatRules)

    @property
    def conv_dim(self) -> int:
        return 2 * self.k_heads * self.k_dim + self.v_heads * self.v_dim

    @nn.compact
    def __call__(self, x, tail, state, *, valid=None, defer: bool = False, chunk: int = 64):
        b, t, _ = x.shape
        dense = lambda n, name: Projection(n, False, self.dtype, self.dtype, format=self.weight_format, name=name)
        kd, vd = self.k_heads * self.k_dim, self.v_heads * self.v_dim
        conv_w = self.param("conv1d", nn.initializers.normal(0.5), (self.conv_dim, 1, self.conv_kernel), self.dtype)
        dt_bias = self.param("dt_bias", nn.initializers.ones, (self.v_heads,), self.dtype)
        a_log = self.param("A_log", nn.initializers.zeros, (self.v_heads,), self.dtype)

        conv_in = dense(self.conv_dim, "in_proj_qkv")(x)
        mixed, new_tail = causal_conv(conv_in, conv_w[:, 0], None, tail, keep=valid)
        q = mixed[..., :kd].reshape(b, t, self.k_heads, self.k_dim)
        k = mixed[..., kd:2 * kd].reshape(b, t, self.k_heads, self.k_dim)
        v = mixed[..., 2 * kd:].reshape(b, t, self.v_heads, self.v_dim)
        z = dense(vd, "in_proj_z")(x).reshape(b, t, self.v_heads, self.v_dim)
        beta = jax.nn.sigmoid(dense(self.v_heads, "in_proj_b")(x).astype(jnp.float32))
        a = dense(self.v_heads, "in_proj_a")(x).astype(jnp.float32)
        g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a + dt_bias.astype(jnp.float32))
        if valid is not None:  # padding positions neither decay nor write the state
            real = (jnp.arange(t)[None, :] < valid[:, None])[..., None]
            g, beta = jnp.where(real, g, 0.0), jnp.where(real, beta, 0.0)
        if t == 1:
            out, new_state = recurrent(q, k, v, g, beta, state)
        else:
            out, new_state = chunked(q, k, v, g, beta, state, chunk=min(chunk, t))
        pending = None
        if defer:
            pending, new_tail, new_state = Pending(conv_in, k, v, g, beta), tail, state
        # Gated RMSNorm over each head's values: the shared RMSNorm, then times silu(z) in float32.
        normed = RMSNorm(self.eps, self.dtype, name="norm")(out.astype(x.dtype))
        gated = normed.astype(jnp.float32) * jax.nn.silu(z.astype(jnp.float32))
        out = gated.astype(x.dtype).reshape(b, t, vd)
        return dense(self.hidden_size, "out_proj")(out), new_tail, new_state.astype(state.dtype), pending
