"""The chain (DFlash): the drafter denoises a block [anchor, MASK x (B-1)] in one pass, the target
head's argmax at its first K positions are the drafts, the target verifies [anchor, d_1..d_K] in
one pass and each row keeps the longest prefix of drafts equal to its own tokens (sample-and-match:
greedy and seeded sampled output equal plain decoding's)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.engine.cycles.base import CycleKind, Settings, accept, caught_up, denoise, verify
from dflash_jax.engine.constraints import allowed, advance
from dflash_jax.engine.sampling import greedy_pick
from dflash_jax.model import CausalLM


@dataclasses.dataclass(frozen=True)
class Chain(CycleKind):
    """K drafts verified, 1 <= K <= B - 1."""

    k: int

    @classmethod
    def of(cls, settings: Settings) -> "Chain | None":
        return cls(settings.drafts)

    @property
    def num_drafts(self) -> int:
        return self.k

    def drafts(self, tparams, dparams, spec, anchor, context_cache, fsm=None, pool=None):
        """d_1..d_K [batch, K] for the block [anchor, MASK x (B-1)] placed at each row's context
        length. The drafter always denoises the whole block it was trained on; only the K slots
        that will be verified go through the LM head. With the rows' constraints (their automata's
        states fsm [batch] in pool), each draft is the argmax among the tokens the state its
        predecessors reach allows (`masked_argmax`)."""
        hidden = denoise(tparams, dparams, spec, anchor, context_cache)[:, 1:1 + self.k]
        logits = CausalLM(spec.target).apply({"params": tparams}, hidden, method=CausalLM.logits)
        if pool is None:
            return greedy_pick(logits)
        return masked_argmax(pool, fsm, logits, spec.target.vocab_size)

    def draft_verify(self, tparams, dparams, spec, state):
        state = caught_up(dparams, spec, state)
        drafts = self.drafts(tparams, dparams, spec, state.anchor, state.context_cache, state.fsm, state.constraints)
        target_tokens, verified = verify(tparams, spec, state, jnp.concatenate([state.anchor[:, None], drafts], axis=1))
        return state, target_tokens, accept(drafts, target_tokens), verified


def masked_argmax(pool, fsm, logits, vocab_size):
    """Drafts [batch, K] from logits [batch, K, vocab] along each row's automaton: d_i is the argmax
    among the tokens the state after d_1..d_{i-1} (from fsm [batch]) allows; a row without a
    constraint takes the plain argmax."""
    return _masked_chain(pool, fsm, logits, vocab_size)[0]


def _masked_chain(pool, fsm, logits, vocab_size):
    """(d [batch, K], states [batch, K]): the masked argmax chain, states[:, i] the one d_i is drawn
    under. Only tokens and states ride the scan (a scan carrying the masked logits copied them
    whole, by the TPU compiler's estimate)."""
    def step(state, x):
        d = greedy_pick(jnp.where(allowed(pool, state, vocab_size), x, -jnp.inf))
        return advance(pool, state, d), (d, state)

    drafts, states = jax.lax.scan(step, fsm, jnp.swapaxes(logits, 0, 1))[1]
    return drafts.T, states.T


def masked_logits(pool, fsm, logits, vocab_size):
    """logits [batch, K, vocab] with position i's outside what the state after d_1..d_{i-1} allows
    at -inf, d_j the masked argmax chain's (from fsm [batch]; `masked_argmax`): where a draft tree
    takes each depth's candidates from."""
    states = _masked_chain(pool, fsm, logits, vocab_size)[1]
    return jnp.where(allowed(pool, states, vocab_size), logits, -jnp.inf)
