"""The cycle kind as a type (`dflash_jax.engine.cycles`): which kind an engine's settings make, the
rules of those settings in one constructor (`cycle_kind`, its errors naming the settings; `check_tree`,
the command line's, naming the flags), and `EngineSpec` carrying the kind. No compilation: milliseconds."""

from __future__ import annotations

import dataclasses

import pytest

from dflash_jax.dflash2 import DFlash2Config
from dflash_jax.engine import EngineSpec, Sampling
from dflash_jax.engine.cycles import KINDS, Chain, Plain, Selector, Tree, check_tree, cycle_kind
from dflash_jax.errors import InputError
from fixtures import drafter_config, model_config

TARGET = model_config("qwen3", 128, 3)
DRAFTER = drafter_config(TARGET, 1, (0, 2))  # block 8
DFLASH2 = dataclasses.replace(DRAFTER, dflash2=DFlash2Config(selector_top_k=4))


def test_settings_make_their_kind():
    assert cycle_kind(TARGET, None, 1) == Plain()
    assert cycle_kind(TARGET, DRAFTER, 8) == Chain(7)
    assert cycle_kind(TARGET, DRAFTER, 8, draft_tokens=3) == Chain(3)
    assert cycle_kind(TARGET, DRAFTER, 8, draft_tokens=0) == Plain()  # auto speculation's plain cycle
    assert cycle_kind(TARGET, DRAFTER, 8, tree_budget=12) == Tree(12)
    # a DFlash2 drafter's selector: its rule is rejection only where rows sample
    assert cycle_kind(TARGET, DFLASH2, 8) == Selector(7, "match")
    assert cycle_kind(TARGET, DFLASH2, 8, draft_tokens=5, greedy=False) == Selector(5, "rejection")
    assert cycle_kind(TARGET, DFLASH2, 8, acceptance="match", greedy=False) == Selector(7, "match")
    assert cycle_kind(TARGET, DFLASH2, 8, draft_tokens=0, greedy=False) == Plain()
    kinds = [Plain(), Chain(3), Tree(4), Selector(2, "rejection")]
    assert len(set(kinds)) == 4 and all(dataclasses.is_dataclass(k) for k in KINDS)  # hashable: static jit args


@pytest.mark.parametrize("args,kw,message", [
    ((None, 1), dict(tree_budget=4), "tree_budget needs a drafter (block size 1 is plain decoding)"),
    ((DRAFTER, 8), dict(tree_budget=-1), "tree_budget must be >= 0, got -1"),
    ((DRAFTER, 8), dict(tree_budget=4, draft_tokens=3), "tree_budget and draft_tokens exclude each other"),
    ((DFLASH2, 8), dict(tree_budget=4), "tree_budget: a DFlash2 drafter drafts by its candidate selector"),
    ((None, 1), dict(draft_tokens=2), "draft_tokens needs a drafter (block size 1 is plain decoding)"),
    ((DRAFTER, 8), dict(draft_tokens=8), "draft_tokens 8 is more than a block of 8 holds (1..7)"),
    ((DRAFTER, 8), dict(acceptance="greedy"), "acceptance must be one of rejection, match, got 'greedy'"),
])
def test_each_rule_is_the_constructors_naming_the_setting(args, kw, message):
    with pytest.raises(InputError) as err:
        cycle_kind(TARGET, *args, **kw)
    assert str(err.value).startswith(message), str(err.value)


def test_the_command_lines_check_names_the_flags():
    with pytest.raises(InputError, match=r"^--tree-budget and --draft-tokens exclude each other"):
        check_tree(TARGET, 8, 4, draft_tokens=3, drafter=DRAFTER)
    with pytest.raises(InputError, match=r"^--tree-budget 100000 is more than a draft tree can hold"):
        check_tree(TARGET, 8, 100000, drafter=DRAFTER)


def test_the_spec_carries_its_kind_and_switches_it_with_the_draft_length():
    common = dict(target=TARGET, max_new_tokens=8, cache_len=64)
    spec = EngineSpec(drafter=DFLASH2, block_size=8, sampling=Sampling(0.7), **common)
    assert spec.kind == Selector(7, "rejection") and spec.rejection and spec.num_drafts == 7
    assert spec.with_drafts(3).kind == Selector(3, "rejection") and spec.with_drafts(0).kind == Plain()
    assert not spec.with_drafts(0).rejection and spec.with_drafts(0).selector  # the drafter is still DFlash2's
    tree = EngineSpec(drafter=DRAFTER, block_size=8, sampling=Sampling(), tree_budget=6, **common)
    assert tree.kind == Tree(6) and tree.verify_len == 7 and tree.kind.reach(tree) == 7
    assert tree.with_drafts(0).kind == Plain()
    # the kind is derived: equal settings are equal specs, one compiled program
    assert hash(tree) == hash(dataclasses.replace(tree)) and tree == dataclasses.replace(tree)
    with pytest.raises(InputError, match="^tree_budget needs a drafter"):
        EngineSpec(drafter=None, block_size=1, sampling=Sampling(), tree_budget=6, **common)
