"""The cycle kind: what one decoding cycle drafts, verifies and commits, as a type.

    Plain()             no drafts: plain decoding (block size 1), or auto speculation's plain cycle (`plain.py`)
    Chain(k)            the drafter's argmax at the block's first k positions, matched (`chain.py`)
    Selector(k, rule)   a DFlash2 drafter's selector walk, matched or rejection-sampled (`selector.py`)
    Tree(budget)        a draft tree of `budget` nodes (`tree.py`)

`cycle_kind` is the one place the settings' compatibility rules live (those that need no model in
`check_settings`, which the command line runs before anything loads: a tree needs a drafter; draft
tokens 1..B-1; a tree and draft tokens exclude each other; a tree's limits for this target and
drafter, in `cycle_kind` itself; the acceptance rules); `EngineSpec` carries its answer as `spec.kind`, and `step.cycle` is
`spec.kind.draft_verify` then `commit`. Its errors name the settings (`tree_budget needs a drafter`);
`check_tree` gives the same rules as the command line spells them (`--tree-budget`).

`base.py` holds `CycleKind` and the pieces the kinds share (`denoise`, `verify`, `accept`, `pick`).
A new kind: a module with a `CycleKind` subclass (its `of`, `num_drafts`, `draft_verify`; its
commit specifics, `acceptance_length` and `keep_taps`, if any) and its line in `KINDS`.
"""

from __future__ import annotations

from typing import Callable

from dflash_jax.engine.cycles.base import CycleKind, Settings
from dflash_jax.engine.cycles.chain import Chain
from dflash_jax.engine.cycles.plain import Plain
from dflash_jax.engine.cycles.selector import Selector
from dflash_jax.engine.cycles.tree import Tree
from dflash_jax.engine.sampling import ACCEPTANCE_RULES
from dflash_jax.engine.tree import max_tree_budget
from dflash_jax.errors import InputError, flag

# The registry: the first kind whose `of` takes an engine's checked settings is its kind.
KINDS: tuple[type[CycleKind], ...] = (
    Tree,
    Plain,
    Selector,
    Chain,
)


def check_settings(block_size: int | None, draft_tokens: int | None = None, tree_budget: int = 0,
                   acceptance: str = ACCEPTANCE_RULES[0], *, drafting: bool | None = None,
                   names: Callable[[str], str] = str) -> None:
    """The rules of these settings that need no model, or an InputError naming the setting (as `names`
    spells it): what the command line checks before anything loads, and `cycle_kind` with the rest.
    block_size None: the drafter's, not known yet; drafting: whether a drafter drafts (None: not
    known yet; block size 1 is plain decoding)."""
    if acceptance not in ACCEPTANCE_RULES:
        raise InputError(f"{names('acceptance')} must be one of {', '.join(ACCEPTANCE_RULES)}, got {acceptance!r}")
    plain = block_size == 1 or drafting is False
    why = "block size 1 is plain decoding" if block_size == 1 else "there is none: plain decoding"
    if drafting is False and block_size not in (None, 1):
        raise InputError(f"{names('block_size')} {block_size} needs a drafter ({why})")
    if tree_budget < 0:
        raise InputError(f"{names('tree_budget')} must be >= 0, got {tree_budget}")
    if tree_budget and plain:
        raise InputError(f"{names('tree_budget')} needs a drafter ({why})")
    if draft_tokens is not None and plain:
        raise InputError(f"{names('draft_tokens')} needs a drafter ({why})")
    if tree_budget and draft_tokens is not None:
        raise InputError(f"{names('tree_budget')} and {names('draft_tokens')} exclude each other: a tree's depth "
                         f"is the block's")
    if draft_tokens is not None and draft_tokens < 0:
        raise InputError(f"{names('draft_tokens')} must be >= 0, got {draft_tokens}")
    if draft_tokens is not None and block_size is not None and draft_tokens > block_size - 1:
        raise InputError(f"{names('draft_tokens')} {draft_tokens} is more than a block of {block_size} holds "
                         f"(1..{block_size - 1})")


def cycle_kind(target, drafter, block_size: int, draft_tokens: int | None = None, tree_budget: int = 0,
               acceptance: str = ACCEPTANCE_RULES[0], greedy: bool = True, constrained: bool = False,
               names: Callable[[str], str] = str) -> CycleKind:
    """The kind of cycle an engine of this target (a `ModelConfig`), drafter (a `DrafterConfig`, or
    None) and block runs, or an InputError naming the setting (as `names` spells it: the setting
    itself, or its flag) that cannot go with the others, before anything compiles: `check_settings`'
    rules, then a tree's for this target and drafter.

    draft_tokens: drafts verified per cycle, 1..B-1 (None: B-1; 0: auto speculation's plain
    cycle); tree_budget: draft-tree nodes per cycle (0: the chain); acceptance: how a DFlash2
    drafter's sampled rows accept drafts (`ACCEPTANCE_RULES`); greedy: the engine samples
    nothing (its DFlash2 rows then match whatever the rule); constrained: rows may carry a
    constraint (`dflash_jax.engine.constraints`), which every kind masks (the plain cycle, the
    chain, the tree, a DFlash2 drafter's selector): the argument is the cycle's compatibility
    seam, and no kind refuses it today."""
    check_settings(block_size, draft_tokens, tree_budget, acceptance, names=names)
    if tree_budget:
        _check_tree(target, drafter, block_size, tree_budget, names)
    dflash2 = drafter is not None and drafter.dflash2 is not None
    settings = Settings(block_size=block_size, drafts=block_size - 1 if draft_tokens is None else draft_tokens,
                        tree_budget=tree_budget, dflash2=dflash2,
                        rule="rejection" if acceptance == "rejection" and not greedy else "match")
    return next(kind for kind in (k.of(settings) for k in KINDS) if kind is not None)


def _check_tree(target, drafter, block_size: int, budget: int, names):
    """A tree's rules for this target and drafter: its limits (`max_tree_budget`), a target and
    drafter whose verify and drafts a tree can branch."""
    tree = names("tree_budget")
    limit = max_tree_budget(target, block_size)
    if budget > limit:
        why = (f"a tree and its root are verified as one block within the target's context of "
               f"{target.max_position_embeddings} positions" if limit == target.max_position_embeddings - 1 else
               f"a block of {block_size} over a vocabulary of {target.vocab_size} has only {limit} token paths")
        raise InputError(f"{tree} {budget} is more than a draft tree can hold here: at most {limit} ({why})")
    if target.num_linear_layers:
        raise InputError(f"{tree}: the target's {target.num_linear_layers} recurrent (delta-net) layers "
                         f"cannot verify several branches from one state; use the chain ({tree} 0)")
    if target.mla is not None and target.mla.indexer is not None:
        raise InputError(f"{tree}: the target's sparse attention picks each query's positions by its own "
                         f"position, which a tree's branches share; use the chain ({tree} 0)")
    if drafter is not None and drafter.dflash2 is not None:  # never drop the selector silently
        raise InputError(f"{tree}: a DFlash2 drafter drafts by its candidate selector's walk, one path, which "
                         f"a tree would bypass; use the chain ({tree} 0)")


def check_tree(target, block_size: int, budget: int, draft_tokens: int | None = None, drafter=None) -> None:
    """`cycle_kind`'s rules for a tree of `budget` nodes, its errors naming the flags (`--tree-budget`):
    the command line's check once the configs are read, before a weight is."""
    cycle_kind(target, drafter, block_size, draft_tokens=draft_tokens, tree_budget=budget, names=flag)


__all__ = ["CycleKind", "Chain", "KINDS", "Plain", "Selector", "Settings", "Tree", "check_settings", "check_tree", "cycle_kind"]
