"""DFlash2 drafters (z-lab / Inco AI; `DFlash2DraftModel`, served by vLLM's `qwen3_dflash2`): what
they add to a DFlash drafter.

- **Dynamic grouped convolutions** around both sublayers of every layer (`DynamicConv`). From the
  sublayer's normed input h, `kernel_projection` gives per-position kernel offsets delta
  [T, 2, K, G] (G = hidden / conv_group_size channel groups); side 0 convolves h before the
  sublayer, side 1 its output after it:

      conv(y)[t, c] = sum_{tau < K} (base_kernel[side, tau, c] + delta[t, side, tau, c // group]) * y[t - tau, c]

  causal over the block, each block on its own: a tap reaching before its block's first position
  reads zero (a position's place in its block is its index mod the block size). No state carries
  from one cycle to the next. With base_kernel[:, 0] = 1, the other taps 0 and a zero projection
  it is the identity (how training starts).
- **The candidate selector** (`CandidateSelector`, `candidates`, `walk`): at each drafted slot the
  top-K tokens of the target head's raw logits, times `output_multiplier`, then soft-capped
  (`final_logit_softcapping`), are the unary scores U; an edge from candidate i of the slot before
  (the anchor, at the first slot) to candidate j scores

      S[p, i, j] = U[p, j] + <A[pred_i] * (W_h h_p), B[cand_j]>

  (A, B the predecessor and successor codebooks [vocab, rank], W_h the hidden projection). The
  drafts are a walk left to right from the anchor: the argmax at each slot (lowest index on ties),
  or, drawing, the Gumbel-max of S / T, whose realised proposal q = softmax(S / T) over the K
  candidates is what rejection sampling divides by.
- Block tokens are embedded with the target's embedding times `input_embedding_scale`.

DFlash2 is DFlash plus these: with identity convolutions and zero codebooks the walk is the argmax
of the head, and the drafter is a DFlash drafter (a test holds them to it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from dflash_jax.errors import ConfigError
from dflash_jax.model.layers import unfused
from dflash_jax.model.weights import Projection

ARCHITECTURE = "DFlash2DraftModel"
REQUIRED_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


@dataclasses.dataclass(frozen=True)
class DFlash2Config:
    """The `dflash_config` keys a DFlash2 drafter adds (hashable: part of a jit static arg)."""

    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None: no soft cap
    input_embedding_scale: float = 1.0

    @classmethod
    def from_dflash_config(cls, dflash: dict[str, Any], hidden_size: int, vocab_size: int) -> "DFlash2Config":
        missing = [k for k in REQUIRED_KEYS if dflash.get(k) is None]
        if missing:
            raise ConfigError(f"{ARCHITECTURE} config has no dflash_config.{missing[0]}")
        ints = {k: dflash[k] for k in REQUIRED_KEYS}
        for key, value in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"dflash_config.{key} must be a positive integer, got {value!r}")
        if hidden_size % ints["conv_group_size"]:
            raise ConfigError(f"dflash_config.conv_group_size {ints['conv_group_size']} does not divide "
                              f"hidden_size {hidden_size}")
        if ints["selector_top_k"] > vocab_size:
            raise ConfigError(f"dflash_config.selector_top_k {ints['selector_top_k']} exceeds the vocabulary "
                              f"({vocab_size})")
        cap = float(dflash.get("final_logit_softcapping") or 0.0)
        return cls(**ints, output_multiplier=float(dflash.get("output_multiplier", 1.0)),
                   final_logit_softcapping=cap if cap > 0 else None,
                   input_embedding_scale=float(dflash.get("input_embedding_scale", 1.0)))

    def to_dict(self) -> dict[str, Any]:
        """The keys as `dflash_config` holds them."""
        return {**{k: getattr(self, k) for k in REQUIRED_KEYS}, "output_multiplier": self.output_multiplier,
                "final_logit_softcapping": self.final_logit_softcapping,
                "input_embedding_scale": self.input_embedding_scale}


# --------------------------------------------------------------------------- convolutions


def _identity_kernel(key, shape, dtype):
    """base_kernel [2, K, hidden] of the identity convolution: tap 0 is 1, the others 0."""
    return jnp.zeros(shape, dtype).at[:, 0].set(1)


class DynamicConv(nn.Module):
    """A layer's `attention_conv` or `mlp_conv`: `prepare` (the side-0 convolution of the sublayer's
    input, and the side-1 offsets) and `finish` (the side-1 convolution of its output)."""

    hidden: int
    taps: int
    group_size: int
    dtype: Any = jnp.float32

    def setup(self):
        self.groups = self.hidden // self.group_size
        self.base_kernel = self.param("base_kernel", _identity_kernel, (2, self.taps, self.hidden), self.dtype)
        self.kernel_projection = Projection(2 * self.taps * self.groups, False, self.dtype, self.dtype,
                                            kernel_init=nn.initializers.zeros)

    def _convolve(self, y, delta, side: int, block_size: int):
        """y [b, T, hidden], delta [b, T, K, G] -> [b, T, hidden]: blocks are the runs of block_size rows.

        Channel-wide: each group's offset is repeated over its channels, y keeps its [b, T, hidden]
        shape (the same sums, in the same order, as with y split into [G, group_size]). Compiled
        for a TPU, that split re-laid out the sublayer's output, and the compiler matched it by
        copying the drafter's o_proj and down_proj kernels into a transposed layout on every call."""
        t = y.shape[1]
        coeff = self.base_kernel[side].astype(y.dtype) + jnp.repeat(delta.astype(y.dtype), self.group_size, axis=-1)
        place = jnp.arange(t) % block_size
        out = coeff[:, :, 0] * y
        for tap in range(1, self.taps):
            shifted = jnp.pad(y[:, :-tap], ((0, 0), (tap, 0), (0, 0)))
            out = out + coeff[:, :, tap] * jnp.where((place >= tap)[None, :, None], shifted, 0)
        return out

    def prepare(self, h, block_size: int):
        """h [b, T, hidden] (T a whole number of blocks) -> (h convolved, the side-1 offsets)."""
        b, t, _ = h.shape
        # the projection's output as stored (`unfused`): the [2, K, G] split fused into the dot made
        # the TPU compiler copy kernel_projection's kernel into a transposed layout at batch 1
        delta = unfused(self.kernel_projection(h)).reshape(b, t, 2, self.taps, self.groups)
        return self._convolve(h, delta[:, :, 0], 0, block_size), delta[:, :, 1]

    def finish(self, y, delta, block_size: int):
        return self._convolve(y, delta, 1, block_size)


# --------------------------------------------------------------------------- the selector


class CandidateSelector(nn.Module):
    """`candidate_selector`: the hidden projection [hidden -> rank] and the two codebooks [vocab, rank]."""

    vocab_size: int
    rank: int
    dtype: Any = jnp.float32

    def setup(self):
        init = nn.initializers.normal(0.02)  # not zero: the bilinear term's gradients vanish at zero
        self.hidden_projection = Projection(self.rank, False, self.dtype, self.dtype)
        self.predecessor_codebook = self.param("predecessor_codebook", init, (self.vocab_size, self.rank), self.dtype)
        self.successor_codebook = self.param("successor_codebook", init, (self.vocab_size, self.rank), self.dtype)

    def __call__(self, hidden, candidates, unary, predecessors):
        """Edge scores S [b, D, Kc, Kc] (float32): hidden [b, D, hidden] at D drafted slots, their
        candidates and unary scores [b, D, Kc], predecessors [b, D, Kc] (slot d's candidate i
        follows predecessors[:, d, i])."""
        w = self.hidden_projection(hidden).astype(jnp.float32)
        pred = self.predecessor_codebook[predecessors].astype(jnp.float32)
        succ = self.successor_codebook[candidates].astype(jnp.float32)
        return unary[:, :, None, :] + jnp.einsum("bdpr,bdcr->bdpc", pred * w[:, :, None, :], succ)


def predecessors(anchor, candidates):
    """[b, D, Kc]: the anchor [b] before every candidate of the first slot, slot d-1's candidate i
    before slot d's row i."""
    first = jnp.broadcast_to(anchor[:, None, None], (candidates.shape[0], 1, candidates.shape[2]))
    return jnp.concatenate([first.astype(candidates.dtype), candidates[:, :-1]], axis=1)


def unary_scores(values, config: DFlash2Config):
    """The candidates' raw head logits -> U: times output_multiplier, then the tanh soft cap."""
    u = values.astype(jnp.float32) * config.output_multiplier
    cap = config.final_logit_softcapping
    return u if cap is None else jnp.tanh(u / cap) * cap


def walk(scores, candidates, temperature=None, keys=None, gate=None):
    """The selector's path, left to right from the anchor. scores [b, D, Kc, Kc], candidates
    [b, D, Kc]; temperature [b] and keys [b, D, 2] (None: the argmax walk). A row with
    temperature 0 takes the argmax (lowest index on ties); others the Gumbel-max of S / T.
    gate: the rows' constraints, (state [b], allows(state, tokens [b, Kc]) -> bool [b, Kc],
    advance(state, token [b]) -> state): each slot's candidates its predecessors' state does not
    allow score -inf (so the proposal is renormalised over the allowed ones); a slot with none
    allowed keeps its scores (its draft is one the verify then never accepts).

    Returns (drafts [b, D] int32, rows [b, D, Kc]: each slot's realised score row S[p, prev, :],
    picked [b, D]: the index of each draft among its slot's candidates). An unrolled scan: D small
    steps with static shapes, fused, with no loop left in the program."""
    b, d, k = candidates.shape
    hot = None if temperature is None else temperature > 0

    def step(carry, xs):
        prev, state = carry
        s, key, cands = xs  # s [b, Kc, Kc], cands [b, Kc]
        row = jnp.take_along_axis(s, prev[:, None, None], axis=1)[:, 0]
        if gate is not None:
            ok = gate[1](state, cands)
            row = jnp.where(ok.any(-1, keepdims=True), jnp.where(ok, row, -jnp.inf), row)
        choose = row
        if hot is not None:
            gumbel = jax.vmap(lambda kk: jax.random.gumbel(kk, (k,), jnp.float32))(key)
            drawn = row / jnp.where(hot, temperature, 1.0)[:, None] + gumbel
            choose = jnp.where(hot[:, None], drawn, row)
        idx = jnp.argmax(choose, axis=-1).astype(jnp.int32)
        if gate is not None:
            state = gate[2](state, jnp.take_along_axis(cands, idx[:, None], axis=-1)[:, 0])
        return (idx, state), (idx, row)

    key_steps = jnp.zeros((d, b, 2), jnp.uint32) if keys is None else jnp.swapaxes(keys, 0, 1)
    state0 = jnp.zeros((b,), jnp.int32) if gate is None else gate[0]
    _, (picked, rows) = jax.lax.scan(step, (jnp.zeros((b,), jnp.int32), state0),
                                     (jnp.swapaxes(scores, 0, 1), key_steps, jnp.swapaxes(candidates, 0, 1)),
                                     unroll=True)
    picked, rows = jnp.swapaxes(picked, 0, 1), jnp.swapaxes(rows, 0, 1)
    return jnp.take_along_axis(candidates, picked[..., None], axis=-1)[..., 0].astype(jnp.int32), rows, picked
