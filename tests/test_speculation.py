"""Auto speculation (`dflash_jax.engine.speculation`): the policy that picks each sync's draft length,
and the engine switching between its compiled draft lengths.

- The policy is a pure function: given costs and acceptance it picks the K of the most expected
  tokens per second (hand-computed cases, ties, a geometric fit of tau), and the host's state
  around it tries an untimed K first, probes while plain decoding wins, fades old acceptance.
- Switching K never changes tokens: an engine whose calls rotate through every draft length gives
  plain decoding's greedy and seeded sampled tokens, compiles nothing after warm-up, and its tally
  counts every cycle and accepted draft.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from bench.timing import compile_counts
from dflash_jax import DFlashError
from dflash_jax.engine import BatchEngine, Sampling
from dflash_jax.engine.speculation import (AcceptanceCounts, Speculation, choose, default_candidates,
                                           expected_tokens, rates_for_tau)
from fixtures import prompts, sampling_setup, setup

# --------------------------------------------------------------------------- the policy


def test_expected_tokens_is_one_plus_the_accepted_prefix():
    assert expected_tokens([0.5, 0.5, 0.5], 0) == 1.0
    assert expected_tokens([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert expected_tokens([1.0, 0.0, 1.0], 3) == 2.0  # a prefix: nothing past the first rejected position
    rates = rates_for_tau(6.49, 15)
    assert expected_tokens(rates, 15) == pytest.approx(6.49, abs=1e-9)
    assert len(set(rates)) == 1 and 0 < rates[0] < 1
    with pytest.raises(ValueError):
        rates_for_tau(17.0, 15)


def test_choose_maximises_expected_tokens_per_second():
    rates = rates_for_tau(6.49, 15)
    tokens = {k: expected_tokens(rates, k) for k in (0, 3, 7, 15)}
    # Memory-bound: a cycle costs about a step whatever K: the whole block.
    assert choose({0: 1.0, 3: 1.05, 7: 1.1, 15: 1.2}, rates) == 15
    # Compute-bound: each verified token costs as much as a step: plain decoding.
    assert choose({k: 1.0 + k for k in (0, 3, 7, 15)}, rates) == 0
    # In between, the argmax by hand.
    costs = {0: 1.0, 3: 1.6, 7: 2.9, 15: 6.0}
    best = max(costs, key=lambda k: tokens[k] / costs[k])
    assert choose(costs, rates) == best == 3
    # A tie goes to the shorter draft length; a drafter that never hits makes drafting lose.
    assert choose({0: 1.0, 3: tokens[3]}, rates) == 0
    assert choose({0: 1.0, 15: 1.01}, [0.0] * 15) == 0
    with pytest.raises(ValueError):
        choose({}, rates)


def test_default_candidates():
    assert default_candidates(16) == (0, 3, 7, 15)
    assert default_candidates(8) == (0, 3, 7)
    assert default_candidates(4) == (0, 3)
    assert default_candidates(2) == (0, 1)
    assert default_candidates(1) == (0,)
    assert default_candidates(16, tree_budget=24) == (0, 24)


def test_the_policy_times_every_candidate_first_reprobes_by_time_and_fades_old_counts():
    now = [0.0]
    policy = Speculation((0, 3, 7), depth=7, probe_share=0.01, clock=lambda: now[0])
    seen = []
    for _ in range(3):  # each untimed draft length once, plain decoding first
        k = policy.pick(8)
        seen.append(k)
        policy.observe(k, 8, 2, {0: 0.01, 3: 0.05, 7: 0.09}[k] * 2, np.zeros(7), np.zeros(7))
    assert seen == [0, 3, 7]
    assert policy.pick(4) == 0  # another width is timed on its own
    # Drafts never accepted: plain decoding wins. A draft length is run again once the time since it
    # was timed is 100x its last call's (1% of the time each): 3's call took 0.1 s, 7's 0.18 s.
    policy.observe(3, 8, 10, None, np.r_[np.full(1, 80), np.zeros(6)], np.zeros(7))
    picks = []
    for t in (5.0, 9.9, 10.1, 10.2, 18.1):
        now[0] = t
        k = policy.pick(8)
        picks.append(k)
        if k:
            policy.observe(k, 8, 2, {3: 0.1, 7: 0.18}[k])
    assert picks == [0, 0, 3, 0, 7]
    assert policy.share() == {0: 2 / 20, 3: 14 / 20, 7: 4 / 20}  # cycles observed, by draft length
    # A cost is the least of its recent calls: calls the host slowed do not move it; the oldest leave.
    for seconds in (0.03, 0.5, 0.5):
        policy.observe(0, 8, 2, seconds)
    assert policy.costs[(8, 0)] == pytest.approx(0.01)
    for _ in range(9):
        policy.observe(0, 8, 2, 0.04)
    assert policy.costs[(8, 0)] == pytest.approx(0.02)
    # Counts fade to about 512 row-cycles: the rates follow the rows now running.
    counts = AcceptanceCounts(2)
    counts.add(np.array([10000.0, 0]), np.array([0.0, 0]))
    counts.add(np.array([512.0, 512]), np.array([512.0, 512]))
    assert counts.tried[0] <= 512.0 + 1e-9 and counts.rates()[0] > 0.45


def test_the_reading_gives_the_figures_the_choice_rests_on():
    policy = Speculation((0, 3, 15), depth=15, clock=lambda: 0.0)
    assert policy.reading() is None  # nothing timed yet
    for k, ms in ((0, 4.0), (3, 8.0), (15, 28.0)):
        policy.time(k, 8, 2, 2 * ms / 1e3)
    policy.time(0, 4, 2, 0.004)  # a narrower width: the widest is read by default
    # Every row-cycle at K=3 accepted 2 of its drafts: rates 1, 1, 0 at positions 1..3, the prior elsewhere.
    tried, accepted = np.zeros(15), np.zeros(15)
    tried[:3], accepted[:2] = 1e4, 1e4
    policy.observe(3, 8, 1000, None, tried, accepted)
    r = policy.reading()
    assert r["width"] == 8 and r["cycle_ms"] == {"0": 4.0, "3": 8.0, "15": 28.0}
    tokens = {k: expected_tokens(policy.rates(), k) for k in (0, 3, 15)}
    assert r["expected_tokens"] == {str(k): round(v, 3) for k, v in tokens.items()}
    assert r["expected_tokens"]["3"] == pytest.approx(3.0, abs=0.01)  # 1 + the two always accepted
    # The K pick would run: the most tokens per ms (3: 3 tokens for 2 plain steps).
    assert r["best"] == max((0, 3, 15), key=lambda k: tokens[k] / {0: 4.0, 3: 8.0, 15: 28.0}[k]) == 3
    assert policy.reading(4) == dict(width=4, best=0, cycle_ms={"0": 2.0}, expected_tokens={"0": 1.0})
    s = policy.summary()
    assert s["reading"] == r and s["cycles"] == {"0": 0, "3": 1000, "15": 0} and s["share"]["3"] == 1.0


def test_a_plain_cycle_has_no_acceptance_length_and_no_tau():
    """The engine records auto's plain cycle as 0 (`step.commit`): a row's Result keeps the acceptance
    lengths of the cycles that drafted and counts the plain ones apart, and tau is theirs alone."""
    from dflash_jax.engine.slots import GenerationStats, SlotLedger

    ledger = SlotLedger(2, None, frozenset(), lambda row: 0)
    output = np.arange(20)
    mixed = ledger.result(0, output, 9, np.array([0, 0, 5, 0, 1, 0, 0, 0]), 6)
    assert mixed.acceptance_lengths == [5, 1] and mixed.plain_cycles == 4 and mixed.cycles == 6
    plain = ledger.result(1, output, 3, np.array([0, 0, 0, 0]), 3)
    assert plain.acceptance_lengths == [] and plain.plain_cycles == 3
    stats = GenerationStats(16)
    stats.add(plain)
    assert stats.tau is None and stats.summary()["tau"] is None  # nothing drafted: no tau at all
    stats.add(mixed)
    assert stats.tau == 3.0 and stats.cycles == 2 and stats.plain_cycles == 7
    assert stats.summary()["acceptance_histogram"] == {"1": 1, "5": 1}
    fixed = ledger.result(0, output, 9, np.array([5, 4, 0]), 2)  # past num_cycles: not a cycle
    assert fixed.acceptance_lengths == [5, 4] and fixed.plain_cycles == 0
    assert GenerationStats(1).tau == 0.0  # nothing ran


# --------------------------------------------------------------------------- the engine


class Rotating(Speculation):
    """Each call the next draft length in turn: every switch between them is exercised."""

    def __init__(self, candidates, depth, **kw):
        super().__init__(candidates, depth, **kw)
        self._turn = itertools.cycle(self.candidates)

    def pick(self, width):
        return next(self._turn)


def rotating(gen: BatchEngine) -> BatchEngine:
    gen.policy = Rotating(gen.candidates, gen.policy.counts.depth)
    return gen


@pytest.mark.heavy  # everyday, `python -m infer`'s demo (tests/test_demo.py) runs auto speculation
def test_switching_draft_lengths_keeps_plain_decodings_tokens_and_compiles_nothing_after_warmup():
    target, tparams, drafter, dparams = setup("qwen3-v8")
    kw = dict(batch_size=3, max_new_tokens=24, max_prompt_len=32, page_size=16, prefill_chunk=16, sync_every=2)
    plain = BatchEngine(target, tparams, None, None, block_size=1, **kw)
    auto = rotating(BatchEngine(target, tparams, drafter, dparams, block_size=8, speculation="auto", **kw))
    assert auto.candidates == (0, 3, 7)
    ps = list(prompts("qwen3-v8"))
    auto.warmup([len(p) for p in ps])
    assert set(auto.policy.costs) == {(3, k) for k in (0, 3, 7)}  # every draft length timed at warm-up
    before = compile_counts()
    results = sorted(auto.generate(ps), key=lambda r: r.index)
    assert compile_counts() == before
    expected = sorted(plain.generate(ps), key=lambda r: r.index)
    assert [r.output_ids for r in results] == [r.output_ids for r in expected]
    share = auto.policy.share()
    assert all(share[k] > 0 for k in (0, 3, 7))  # every draft length ran
    assert all(r.plain_cycles > 0 for r in results)  # each row ran plain cycles too, counted apart
    # The policy counts loop cycles (every row of a cycle runs its K): between the longest row's
    # cycles and all rows' together.
    row_cycles = [r.cycles for r in results]  # drafting and plain
    assert max(row_cycles) <= sum(auto.policy.cycles.values()) <= sum(row_cycles)
    # The tally counts every accepted draft (a plain cycle accepts none), at its position.
    accepted = sum(a - 1 for r in results for a in r.acceptance_lengths)
    assert accepted > 0 and auto.policy.counts.accepted.sum() == accepted
    assert all(auto.policy.counts.accepted <= auto.policy.counts.tried)


@pytest.mark.heavy
def test_switching_draft_lengths_keeps_seeded_samples():
    target, tparams, drafter, dparams = sampling_setup()
    kw = dict(batch_size=4, max_new_tokens=16, max_prompt_len=16, sampling=Sampling(temperature=1.0))
    rs = np.random.RandomState(11)
    ps = [rs.randint(0, target.vocab_size, n).tolist() for n in (4, 9, 1, 16, 7, 12)]
    plain = BatchEngine(target, tparams, None, None, block_size=1, **kw)
    auto = rotating(BatchEngine(target, tparams, drafter, dparams, block_size=4, speculation="auto", **kw))
    out = lambda gen: {r.index: r.output_ids for r in gen.generate(ps, seed=7)}
    assert out(auto) == out(plain)


def test_bad_speculation_settings_are_refused():
    target, tparams, drafter, dparams = setup("qwen3-v8")
    make = lambda **kw: BatchEngine(target, tparams, drafter, dparams, block_size=8, max_new_tokens=4,
                                    max_prompt_len=16, batch_size=1, **kw)
    with pytest.raises(DFlashError, match="--speculation must be one of auto, fixed"):
        make(speculation="sometimes")
    with pytest.raises(DFlashError, match=r"draft lengths must be in 0\.\.7"):
        make(speculation="auto", candidates=(0, 9))
    assert make(speculation="auto", draft_tokens=5).candidates == (0, 5)
    assert make(speculation="fixed").candidates == (7,)


class Scripted(Speculation):
    """The draft lengths of a script, in turn: runs of plain cycles long enough to fill the taps kept."""

    def __init__(self, candidates, depth, script, **kw):
        super().__init__(candidates, depth, **kw)
        self._turn = itertools.cycle(script)

    def pick(self, width):
        return next(self._turn)


@pytest.mark.heavy
def test_plain_cycles_taps_reach_the_drafters_context_as_if_extended_every_cycle():
    """Plain cycles keep their taps and the context takes them a block at a time (when a row's block is
    full, or before a drafting cycle): the drafts, hence the acceptance lengths, are those of an engine
    that extends the context at every plain cycle, and the tokens plain decoding's."""
    import dataclasses

    target, tparams, drafter, dparams = setup("qwen3-v8")
    kw = dict(batch_size=3, max_new_tokens=24, max_prompt_len=32, page_size=16, prefill_chunk=16, sync_every=2)
    script = [0] * 5 + [3, 7, 0, 0, 3]  # 10 plain cycles in a row: more than a block (8) of taps kept

    def scripted(lazy: bool) -> BatchEngine:
        gen = BatchEngine(target, tparams, drafter, dparams, block_size=8, speculation="auto", **kw)
        assert gen.spec.lazy_context
        if not lazy:
            gen.spec = dataclasses.replace(gen.spec, lazy_context=False)
            gen.specs = {k: gen.spec.with_drafts(k) for k in gen.candidates}
        gen.policy = Scripted(gen.candidates, gen.policy.counts.depth, script)
        return gen

    ps = list(prompts("qwen3-v8"))
    lazy, eager = (sorted(scripted(x).generate(ps), key=lambda r: r.index) for x in (True, False))
    plain = sorted(BatchEngine(target, tparams, None, None, block_size=1, **kw).generate(ps), key=lambda r: r.index)
    assert [r.output_ids for r in lazy] == [r.output_ids for r in eager] == [r.output_ids for r in plain]
    assert [r.acceptance_lengths for r in lazy] == [r.acceptance_lengths for r in eager]
    assert max(a for r in lazy for a in r.acceptance_lengths) > 1
