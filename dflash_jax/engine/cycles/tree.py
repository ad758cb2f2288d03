"""The draft tree (DDTree; `dflash_jax.engine.tree` grows and walks it): the drafter's one pass, as
the chain's, turned into a tree of `budget` nodes (each block position's top candidates, expanded
best-first); the target verifies every node in one pass (`forward`'s `tree`), each row's path is
found by sample-and-match (`follow`) and compacted into place, so commit sees it as a chain of
the path's tokens. A path goes at most a block deep. A constrained row's nodes are its
automaton's: each node's children are the candidates its state allows, and the target's token
after each node is picked within that state's mask."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from dflash_jax.engine import constraints
from dflash_jax.engine.cycles.base import CycleKind, Settings, caught_up, denoise, pick
from dflash_jax.engine.cycles.chain import masked_logits
from dflash_jax.engine.tree import Tree as DraftTree
from dflash_jax.engine.tree import build_tree, follow, top_candidates
from dflash_jax.model import CausalLM, forward


@dataclasses.dataclass(frozen=True)
class Tree(CycleKind):
    """A draft tree of `budget` nodes below the root verified per cycle."""

    budget: int

    @classmethod
    def of(cls, settings: Settings) -> "Tree | None":
        return cls(settings.tree_budget) if settings.tree_budget else None

    @property
    def num_drafts(self) -> int:
        return self.budget

    def reach(self, spec) -> int:
        return spec.block_size - 1  # a tree's paths go a block deep

    def draft_verify(self, tparams, dparams, spec, state):
        state = caught_up(dparams, spec, state)
        tree = self.draft_tree(tparams, dparams, spec, state.anchor, state.context_cache, state.fsm, state.constraints)
        return (state, *verify_tree(tparams, spec, state, tree))

    def draft_tree(self, tparams, dparams, spec, anchor, context_cache, fsm=None, pool=None) -> DraftTree:
        """The drafter's one pass turned into a tree of `budget` nodes: each block position's top
        candidates, expanded best-first. With the rows' constraint states fsm [batch] in pool, a
        depth's candidates are the top tokens the masked chain's state there allows (`masked_logits`:
        the tree's best path is the chain's masked drafts), and a node's children only those its
        own state allows (`build_tree`)."""
        hidden = denoise(tparams, dparams, spec, anchor, context_cache)
        logits = CausalLM(spec.target).apply({"params": tparams}, hidden[:, 1:], method=CausalLM.logits)
        if pool is not None:  # each depth's candidates among what the masked chain's state there allows
            logits = masked_logits(pool, fsm, logits, spec.target.vocab_size)
        return build_tree(anchor, *top_candidates(logits, self.budget), self.budget, fsm, pool)


def verify_tree(tparams, spec, state, tree: DraftTree):
    """The target runs the tree's nodes as one block (`forward`'s `tree`), then each row's
    accepted path is found by sample-and-match (`follow`) and compacted: returns the path's
    target tokens [batch, B] (as the chain's verify: target_tokens[:, i] is the token after the
    path's i-th node), num_accepted [batch], and the forward output with the path's K/V moved to
    positions P..P+a and its taps and logits in path order (the logits only where rows' logprobs
    read them, spec.max_logprobs)."""
    out = forward(tparams, spec.target, tree.tokens, state.target_cache, taps=spec.taps,
                  tree=(tree.depth, tree.mask))
    start = state.target_cache.lengths
    # Each node's token after it within what its path's constraint state allows (as plain decoding
    # masks that position), with the same key for every node of one depth: plain decoding's there.
    allowed = None if tree.states is None else constraints.allowed(state.constraints, tree.states,
                                                                   spec.target.vocab_size)
    node_tokens = pick(spec, out.logits, state.sampling, start[:, None] + 1 + tree.depth, allowed)
    path, num_accepted = follow(tree, node_tokens, spec.block_size - 1)
    target_tokens = jnp.take_along_axis(node_tokens, path, axis=1)
    taps = None if out.tap_features is None else jnp.take_along_axis(out.tap_features, path[:, :, None], axis=1)
    logits = jnp.take_along_axis(out.logits, path[:, :, None], axis=1) if spec.max_logprobs else out.logits
    return target_tokens, num_accepted, out.replace(cache=out.cache.compact(start, path), tap_features=taps,
                                                    logits=logits)
