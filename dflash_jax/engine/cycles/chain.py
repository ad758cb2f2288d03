"""The chain (DFlash): the drafter denoises a block [anchor, MASK x (B-1)] in one pass, the target
head's argmax at its first K positions are the drafts, the target verifies [anchor, d_1..d_K] in
one pass and each row keeps the longest prefix of drafts equal to its own tokens (sample-and-match:
greedy and seeded sampled output equal plain decoding's)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dflash_jax.engine.cycles.base import CycleKind, Settings, accept, caught_up, denoise, verify
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

    def drafts(self, tparams, dparams, spec, anchor, context_cache):
        """d_1..d_K [batch, K] for the block [anchor, MASK x (B-1)] placed at each row's context
        length. The drafter always denoises the whole block it was trained on; only the K slots
        that will be verified go through the LM head."""
        hidden = denoise(tparams, dparams, spec, anchor, context_cache)[:, 1:1 + self.k]
        return greedy_pick(CausalLM(spec.target).apply({"params": tparams}, hidden, method=CausalLM.logits))

    def draft_verify(self, tparams, dparams, spec, state):
        state = caught_up(dparams, spec, state)
        drafts = self.drafts(tparams, dparams, spec, state.anchor, state.context_cache)
        target_tokens, verified = verify(tparams, spec, state, jnp.concatenate([state.anchor[:, None], drafts], axis=1))
        return state, target_tokens, accept(drafts, target_tokens), verified
