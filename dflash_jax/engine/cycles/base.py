"""What every cycle kind is built from: `CycleKind` (the hooks `step.cycle` and `step.commit` call)
and the pieces kinds share: the drafter's pass over a block (`denoise`), the target's verify
(`verify`), sample-and-match acceptance of a chain (`accept`), the target's picks (`pick`), and
the catch-up of an engine whose plain cycles keep their taps (`caught_up`, `flush_taps`).

A kind's module holds its own draft, verify and acceptance (`CycleKind.draft_verify`) and what
its commit does apart (`acceptance_length`, `keep_taps`); `dflash_jax.engine.cycles` picks a
kind for an engine's settings (`cycle_kind`, the one home of their compatibility rules).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from dflash_jax.drafter import draft_hidden, extend_context
from dflash_jax.engine import constraints, sampling
from dflash_jax.errors import DFlashError
from dflash_jax.model import CausalLM, ForwardOutput, forward


@dataclasses.dataclass(frozen=True)
class Settings:
    """An engine's settings as the kinds' `of` reads them, checked (`cycle_kind`): drafts is the
    chain's K (B - 1 unless draft_tokens says; 0 with no drafter); rule the acceptance a
    DFlash2 drafter's rows use ("match" for a greedy engine, whatever was asked)."""

    block_size: int
    drafts: int
    tree_budget: int
    dflash2: bool
    rule: str


class CycleKind:
    """One kind of decoding cycle: a frozen, hashable dataclass (part of `EngineSpec`, a static
    jit argument). A kind is registered in `dflash_jax.engine.cycles.KINDS`; `of` says which
    settings make it (None: not these), `draft_verify` is its cycle up to commit."""

    @classmethod
    def of(cls, settings: Settings) -> "CycleKind | None":
        raise NotImplementedError

    @property
    def num_drafts(self) -> int:
        """K: the tokens verified after the anchor (a tree's: its nodes below the root)."""
        raise NotImplementedError

    def reach(self, spec) -> int:
        """Draft positions a cycle can accept (`step._tally`)."""
        return self.num_drafts

    def drafts(self, tparams, dparams, spec, anchor, context_cache):
        """The chain of drafts [batch, K] this kind verifies (`step.draft`)."""
        raise DFlashError(f"a {type(self).__name__} cycle verifies no chain of drafts")

    def draft_verify(self, tparams, dparams, spec, state):
        """Draft, verify, accept for every row: (state, target_tokens [batch, T], num_accepted
        [batch], the verify's ForwardOutput), as `step.commit` takes them; state is the cycle's
        own (an engine's kept taps taken in first, `caught_up`)."""
        raise NotImplementedError

    def acceptance_length(self, spec, num_accepted):
        """What `DecodeState.acceptance` records for a cycle: num_accepted + 1."""
        return num_accepted + 1

    def keep_taps(self, dparams, spec, state, verified: ForwardOutput, n_new, active):
        """The drafter's context after a cycle committed n_new [batch] positions: (context_cache,
        taps, num_taps). A drafting cycle's context takes the verify's taps at once."""
        return (extend_context(dparams, spec.drafter, verified.tap_features, state.context_cache, n_new),
                state.taps, state.num_taps)


# --------------------------------------------------------------------------- shared pieces


def pick(spec, logits, rows, positions, allowed=None):
    """The target's tokens [batch, T] from logits [batch, T, vocab] at sequence positions [batch, T],
    each row by its own `RowSampling` (the one logits processor, `sampling.pick`), within allowed
    [batch, T, vocab] (the rows' constraints; None: every token); a greedy engine compiles the
    argmax alone."""
    return sampling.pick(logits, rows, positions, sampled=not spec.sampling.greedy, allowed=allowed)


def denoise(tparams, dparams, spec, anchor, context_cache):
    """The drafter's one pass over the block [anchor, MASK x (B-1)] placed at each row's context
    length: its hidden states [batch, B, hidden] (after its final norm)."""
    model = CausalLM(spec.target)
    batch, b = anchor.shape[0], spec.block_size
    block = jnp.concatenate([anchor[:, None], jnp.full((batch, b - 1), spec.drafter.mask_token_id, jnp.int32)], 1)
    embeds = model.apply({"params": tparams}, block, method=CausalLM.embed)
    return draft_hidden(dparams, spec.drafter, embeds, context_cache)


def verify_pass(tparams, spec, state, block) -> ForwardOutput:
    """The target's pass over block [batch, K+1] = [anchor, d_1..d_K] at each row's length."""
    # A hybrid target's linear layers defer their states to commit (settled at the accepted
    # prefix); plain decoding (one token, always kept while the row runs) lets them advance.
    return forward(tparams, spec.target, block, state.target_cache, taps=spec.taps,
                   defer_recurrent=bool(spec.target.num_linear_layers) and spec.uses_drafter)


def verify(tparams, spec, state, block) -> tuple[jax.Array, ForwardOutput]:
    """The target runs block [batch, K+1] = [anchor, d_1..d_K] at each row's length.
    Returns target_tokens [batch, K+1] (target_tokens[:, i] is the target's token for position
    P + i + 1 given the block up to i) and the forward output (cache written, taps). A row's
    constraint masks position i by the state its automaton reaches over d_1..d_i."""
    out = verify_pass(tparams, spec, state, block)
    start = state.target_cache.lengths
    states = constraints.walk(state.constraints, state.fsm, block[:, 1:])
    allowed = constraints.allowed(state.constraints, states, spec.target.vocab_size)
    positions = start[:, None] + 1 + jnp.arange(block.shape[1])[None, :]
    return pick(spec, out.logits, state.sampling, positions, allowed), out


def accept(drafts, target_tokens):
    """num_accepted [batch]: the longest prefix of drafts [batch, K] equal to the target's own
    tokens target_tokens[:, :K]."""
    return jnp.cumprod(drafts == target_tokens[:, :-1], axis=1).sum(axis=1).astype(jnp.int32)


def flush_taps(dparams, spec, context_cache, taps, num_taps):
    """The taps plain cycles kept (`DecodeState.taps`) into the drafter's context, in one pass over the
    block of them; returns (context_cache, taps, num_taps) with none kept."""
    context_cache = extend_context(dparams, spec.drafter, taps, context_cache, num_taps)
    return context_cache, taps, jnp.zeros_like(num_taps)


def caught_up(dparams, spec, state):
    """Before a drafting cycle of an engine whose plain cycles keep their taps: the context takes them."""
    if not (spec.lazy_context and spec.uses_drafter):
        return state
    context_cache, taps, num_taps = jax.lax.cond((state.num_taps > 0).any(), functools.partial(flush_taps, dparams, spec),
                                                 lambda *a: a, state.context_cache, state.taps, state.num_taps)
    return state.replace(context_cache=context_cache, taps=taps, num_taps=num_taps)
