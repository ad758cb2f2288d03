"""The chain of a DFlash2 drafter: its candidate selector walks the block (`dflash_jax.dflash2`).

rule "match": the drafts are the selector's argmax walk and rows accept them as the chain does
(sample-and-match). rule "rejection" (a sampled engine asked for it, `EngineSpec.acceptance`): a
sampled row's drafts are the Gumbel walk of its selector at the row's temperature and it accepts
each draft d with probability min(1, p(d) / q(d)) against the walk's realised proposal q,
replacing the first it rejects by a draw from norm(max(0, p - q)) (`rejection_accept`); a greedy
row of that engine (temperature 0) takes the argmax walk and matches."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from dflash_jax.dflash2 import predecessors, unary_scores, walk
from dflash_jax.engine import constraints
from dflash_jax.drafter import DFlashDrafter
from dflash_jax.engine.cycles.base import Settings, accept, caught_up, denoise, verify_pass
from dflash_jax.engine.cycles.chain import Chain
from dflash_jax.engine.sampling import draw_keys, pick, rejection_accept, target_probs
from dflash_jax.engine.tree import top_logits
from dflash_jax.model import CausalLM


@dataclasses.dataclass(frozen=True)
class Selector(Chain):
    """K drafts of a DFlash2 drafter's selector, accepted by `rule` ("match" or "rejection")."""

    rule: str = "match"

    @classmethod
    def of(cls, settings: Settings) -> "Selector | None":
        return cls(settings.drafts, settings.rule) if settings.dflash2 else None

    def drafts(self, tparams, dparams, spec, anchor, context_cache, fsm=None, pool=None):
        """The selector's argmax walk d_1..d_K [batch, K] over the block's first K drafted slots
        (with the rows' constraint states fsm [batch] in pool: among the candidates each slot's
        state allows, `gate`)."""
        hidden = denoise(tparams, dparams, spec, anchor, context_cache)[:, 1:1 + self.k]
        return walk(*selector_scores(tparams, dparams, spec, anchor, hidden), gate=gate(fsm, pool))[0]

    def draft_verify(self, tparams, dparams, spec, state):
        if self.rule == "match":
            return super().draft_verify(tparams, dparams, spec, state)
        state = caught_up(dparams, spec, state)
        drafts, proposal = self.drawn(tparams, dparams, spec, state)
        return (state, *verify_rejection(tparams, spec, state, drafts, proposal))

    def drawn(self, tparams, dparams, spec, state):
        """Drafts [batch, K] for rejection sampling: a sampled row's are the Gumbel walk of its selector
        at the row's temperature, keyed by the drafts' positions (a greedy row's, the argmax walk),
        with the proposal they were drawn from: (candidates, the realised score rows, the picked
        indices), each [batch, K, ...]."""
        hidden = denoise(tparams, dparams, spec, state.anchor, state.context_cache)[:, 1:1 + self.k]
        scores, candidates = selector_scores(tparams, dparams, spec, state.anchor, hidden)
        positions = state.target_cache.lengths[:, None] + 1 + jnp.arange(self.k)[None, :]
        drafts, rows, picked = walk(scores, candidates, state.sampling.temperature,
                                    draw_keys(state.sampling.key, positions, "walk"), gate(state.fsm, state.constraints))
        return drafts, (candidates, rows, picked)


def gate(fsm, pool):
    """The rows' constraints as the selector's walk takes them (`dflash2.walk`), or None."""
    if pool is None:
        return None
    return (fsm, lambda s, tokens: constraints.permits(pool, jnp.broadcast_to(s[:, None], tokens.shape), tokens),
            lambda s, token: constraints.advance(pool, s, token))


def selector_scores(tparams, dparams, spec, anchor, hidden):
    """A DFlash2 drafter's edge scores [batch, K, Kc, Kc] and candidates [batch, K, Kc] at the
    drafted slots' hidden states [batch, K, hidden] (`dflash_jax.dflash2`)."""
    d2 = spec.drafter.dflash2
    raw = CausalLM(spec.target).apply({"params": tparams}, hidden, method=CausalLM.head_logits)
    # a value of their own: XLA would otherwise fuse the top-k into the codebook gathers and redo it
    # per gathered row (15x the selector's time on CPU)
    values, candidates = jax.lax.optimization_barrier(top_logits(raw, d2.selector_top_k))
    scores = DFlashDrafter(spec.drafter).apply({"params": dparams}, hidden, candidates, unary_scores(values, d2),
                                               predecessors(anchor, candidates), method=DFlashDrafter.edge_scores)
    return scores, candidates


def verify_rejection(tparams, spec, state, drafts, proposal):
    """Verify drafts drawn from the selector's proposal (the module's rule "rejection"). Returns
    (target_tokens, num_accepted, the forward output), as the chain's verify and accept do."""
    block = jnp.concatenate([state.anchor[:, None], drafts], axis=1)
    out = verify_pass(tparams, spec, state, block)
    temperature = state.sampling.temperature
    positions = state.target_cache.lengths[:, None] + 1 + jnp.arange(block.shape[1])[None, :]
    # p at each position is the masked target's (the state the drafts before it reach), as plain decoding's
    allowed = constraints.allowed(state.constraints, constraints.walk(state.constraints, state.fsm, drafts),
                                  spec.target.vocab_size)
    greedy = pick(out.logits, state.sampling, positions, sampled=False, allowed=allowed)  # a greedy row's: matched
    probs = target_probs(out.logits, state.sampling, allowed)
    tokens, num_accepted = rejection_accept(probs, drafts, *proposal, temperature, state.sampling.key, positions)
    hot = temperature > 0
    tokens = jnp.where(hot[:, None], tokens, greedy)
    num_accepted = jnp.where(hot, num_accepted, accept(drafts, greedy))
    return tokens, num_accepted, out
