"""Constraints on the device (`dflash_jax.engine.constraints`): a row's automaton masks the target's
logits at prefill and at every verified position, its drafts are masked along the chain, its
state advances with each committed token, and the output is constrained plain decoding's, token
for token, greedy and seeded, with several rows of different constraints (and none) in one batch.

The automata here are written by hand (a small DFA over the tiny models' vocabularies), so these
tests need no tokenizer; `tests/test_constrain.py` checks the automata compiled from regexes and
schemas."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.engine import BatchEngine, Sampling
from dflash_jax.engine import constraints as cons
from dflash_jax.errors import InputError
from fixtures import by_index, sampling_setup, setup

EOS = 11


@dataclasses.dataclass(frozen=True, eq=False)
class Dfa:
    """An automaton in `dflash_jax.constrain.Automaton`'s array form, from {state: {token: next}}."""

    vocab_size: int
    initial: int
    masks: np.ndarray
    starts: np.ndarray
    counts: np.ndarray
    tokens: np.ndarray
    targets: np.ndarray
    final: np.ndarray

    @property
    def num_states(self):
        return len(self.final)

    @classmethod
    def of(cls, edges: dict[int, dict[int, int]], finals, vocab_size, eos=(EOS,)):
        n = len(edges)
        masks = np.zeros((n, -(-vocab_size // 32)), np.uint32)
        starts, counts, tokens, targets = np.zeros(n, np.int32), np.zeros(n, np.int32), [], []
        for s in range(n):
            row = dict(edges[s])
            if s in finals:
                row.update({e: s for e in eos})
            starts[s], counts[s] = len(tokens), len(row)
            for t in sorted(row):
                tokens.append(t)
                targets.append(row[t])
                masks[s, t // 32] |= np.uint32(1 << (t % 32))
        final = np.array([s in finals for s in range(n)])
        return cls(vocab_size, 0, masks, starts, counts, np.array(tokens, np.int32), np.array(targets, np.int32), final)

    def next(self, state, token):
        lo, c = self.starts[state], self.counts[state]
        hit = np.flatnonzero(self.tokens[lo:lo + c] == token)
        return int(self.targets[lo + hit[0]]) if len(hit) else -1

    def walk(self, ids):
        """The states along ids from the initial one (-1 once a token is not allowed)."""
        state, out = self.initial, []
        for t in ids:
            state = self.next(state, t) if state >= 0 else -1
            out.append(state)
        return out


def pairs_dfa(vocab_size):
    """(A B)+ then EOS: A in {2, 3}, B in {4, 5, 6}; final after each B."""
    return Dfa.of({0: {2: 1, 3: 1}, 1: {4: 2, 5: 2, 6: 2}, 2: {2: 1, 3: 1}}, {2}, vocab_size)


def counting_dfa(vocab_size, n=5):
    """Exactly n tokens from {7, 8, 9, 10}, then EOS: a row must end at the automaton's end."""
    return Dfa.of({s: {t: s + 1 for t in (7, 8, 9, 10)} if s < n else {} for s in range(n + 1)}, {n}, vocab_size)


def test_the_device_bit_order_holds_the_host_masks():
    """The pool keeps masks in the device's grouped bit order (`constraints.device_masks`); `allowed`
    and `permits` read back the host's masks exactly at a vocabulary of several groups and a ragged
    end, NONE and DEAD allowing every token."""
    vocab = 2 * cons.GROUP + 1234
    rng = np.random.RandomState(1)
    host = rng.randint(0, 2**32, (5, -(-vocab // 32)), dtype=np.uint64).astype(np.uint32)
    want = np.unpackbits(host.view(np.uint8), axis=1, bitorder="little")[:, :vocab].astype(bool)
    pool = cons.ConstraintPool.empty(1, 5, 4, vocab)
    assert pool.masks.shape == (5, 3 * cons.LANES)
    pool = pool.replace(masks=jnp.asarray(cons.device_masks(host, vocab)))
    states = jnp.array([0, 1, 2, 3, 4, cons.NONE, cons.DEAD], jnp.int32)
    got = np.asarray(cons.allowed(pool, states, vocab))
    np.testing.assert_array_equal(got[:5], want)
    assert got[5:].all()
    tokens = jnp.asarray(rng.randint(0, vocab, (7, 64)), jnp.int32)
    np.testing.assert_array_equal(np.asarray(cons.permits(pool, jnp.repeat(states[:, None], 64, 1), tokens)),
                                  np.take_along_axis(got, np.asarray(tokens), axis=1))


def test_the_device_automaton_agrees_with_the_host_arrays():
    """`advance` and `allowed` on a pool region equal the automaton's own transitions and masks at every
    (state, token), for a DFA whose transitions go several ways (exceptions and a default)."""
    vocab = 70
    rng = np.random.RandomState(0)
    edges = {s: {int(t): int(rng.randint(0, 6)) for t in rng.choice(vocab - 1, 20, replace=False)} for s in range(6)}
    dfa = Dfa.of(edges, {3, 5}, vocab, eos=(vocab - 1,))
    regions = cons.ConstraintRegions(2, 8, 128, vocab)
    pool = cons.ConstraintPool.empty(2, 8, 128, vocab)
    pool, _ = regions.admit(pool, 0, counting_dfa(vocab))
    pool, initial = regions.admit(pool, 1, dfa)
    base = initial - dfa.initial
    states = jnp.repeat(jnp.arange(6, dtype=jnp.int32) + base, vocab)
    tokens = jnp.tile(jnp.arange(vocab, dtype=jnp.int32), 6)
    got = np.asarray(cons.advance(pool, states, tokens)).reshape(6, vocab)
    want = np.array([[dfa.next(s, t) for t in range(vocab)] for s in range(6)])
    np.testing.assert_array_equal(np.where(want >= 0, got - base, -1), want)
    assert (got[want < 0] == cons.DEAD).all()
    mask = np.asarray(cons.allowed(pool, jnp.arange(6, dtype=jnp.int32) + base, vocab))
    np.testing.assert_array_equal(mask, want >= 0)
    # no constraint: every token, and it stays none; a dead path stays dead
    assert np.asarray(cons.allowed(pool, jnp.array([cons.NONE, cons.DEAD]), vocab)).all()
    np.testing.assert_array_equal(np.asarray(cons.advance(pool, jnp.array([cons.NONE, cons.DEAD]), jnp.array([3, 3]))),
                                  [cons.NONE, cons.DEAD])


def _engine(pair, block_size, sampling=Sampling(), batch_size=4, **kw):
    target, tparams, drafter, dparams = pair
    return BatchEngine(target, tparams, drafter if block_size > 1 else None, dparams if block_size > 1 else None,
                       block_size=block_size, batch_size=batch_size, max_new_tokens=16, max_prompt_len=16,
                       sampling=dataclasses.replace(sampling, per_row=True), stop_token_ids=(EOS,),
                       speculation="fixed", **{"constraint_states": 8, **kw})


def _rows(pair, block_size, rows, prompts, seed=0, **kw):
    gen = _engine(pair, block_size, **kw)
    return by_index(gen.generate(prompts, seed=seed, sampling=rows)), gen


# greedy: heavy here, everyday on the demo pair (tests/test_structured.py); sampled everyday with a tree
# (the chain sampled under a constraint everyday: tests/test_dflash2.py's sample-and-match)
@pytest.mark.parametrize("temperature,tree", [pytest.param(0.0, 0, marks=pytest.mark.heavy),
                                              pytest.param(1.0, 0, marks=pytest.mark.heavy),
                                              pytest.param(0.0, 6, marks=pytest.mark.heavy), (1.0, 6)])
def test_constrained_rows_decode_as_constrained_plain_decoding(temperature, tree):
    """Rows with two constraints and none, in one batch: every constrained output walks its automaton
    to a final state and ends there (or stops at its limit inside it); the chain's and a draft tree's
    tokens equal plain decoding's under the same constraints, greedy and seeded."""
    pair = sampling_setup()
    vocab = pair[0].vocab_size
    a, b = pairs_dfa(vocab), counting_dfa(vocab)
    s = lambda c: Sampling(temperature, constraint=c, per_row=True)
    rows = [s(a), s(b), s(None), s(a), s(b), s(a)]
    prompts = [[3, 1, 4], [1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7], [2], [9, 3, 2, 3]]
    plain, _ = _rows(pair, 1, rows, prompts, seed=3)
    spec, gen = _rows(pair, 4, rows, prompts, seed=3, tree_budget=tree)
    for r, p, row in zip(spec, plain, rows):
        assert r.output_ids == p.output_ids
        if row.constraint is None:
            continue
        walked = row.constraint.walk(r.output_ids)
        assert all(st >= 0 for st in walked), (r.output_ids, walked)
        if r.finish_reason == "stop":  # it ended on EOS, which only a final state allows
            assert r.output_ids[-1] == EOS and row.constraint.final[walked[-1]]
    counted = [r for r, row in zip(spec, rows) if row.constraint is b]
    assert all(r.output_ids[:5] and len(r.output_ids) == 6 and r.output_ids[-1] == EOS for r in counted)
    assert gen.regions.loads == 2  # one region per automaton, shared by its rows


@pytest.mark.heavy  # three engines each; bench/constrained.py prints the same comparison on the demo pair
@pytest.mark.parametrize("tree", [0, 6])
def test_drafts_follow_the_constraint(monkeypatch, tree):
    """Masked drafts: each chain draft is the drafter's argmax among the tokens its predecessors'
    state allows; a tree node's children are the candidates its state allows. Output is plain
    decoding's either way; masked drafts are accepted more often than unmasked ones (which this
    random drafter mostly spends outside the constraint)."""
    from dflash_jax.engine.cycles import chain

    pair = setup("qwen3-v128")
    vocab = pair[0].vocab_size
    a = counting_dfa(vocab, 14)
    rows = [Sampling(constraint=a, per_row=True)] * 4
    prompts = [[3, 1, 4], [1, 5, 9, 2], [6, 5], [3, 5, 8, 9, 7]]
    plain, _ = _rows(pair, 1, rows, prompts, constraint_states=16)
    spec, _ = _rows(pair, 4, rows, prompts, constraint_states=16, tree_budget=tree)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    for r in spec:
        assert all(st >= 0 for st in a.walk(r.output_ids))
    tau = lambda results: np.mean([x for r in results for x in r.acceptance_lengths])
    if tree:  # the drafter's own top candidates, each a child whatever its parent's state
        from dflash_jax.engine.cycles import tree as tree_kind

        monkeypatch.setattr(tree_kind, "masked_logits", lambda pool, fsm, logits, vocab: logits)
        monkeypatch.setattr(cons, "permits", lambda pool, states, tokens: jnp.ones(tokens.shape, bool))
    else:
        monkeypatch.setattr(chain, "masked_argmax", lambda pool, fsm, logits, vocab: chain.greedy_pick(logits))
    jax.clear_caches()  # the cycle loop traced again, with unmasked drafts
    unmasked, _ = _rows(pair, 4, rows, prompts, constraint_states=16, tree_budget=tree)
    assert [r.output_ids for r in unmasked] == [r.output_ids for r in plain]
    jax.clear_caches()
    assert tau(spec) > tau(unmasked), (tau(spec), tau(unmasked))


def test_constraints_are_refused_where_they_cannot_go():
    from dflash_jax.dflash2 import DFlash2Config
    from dflash_jax.engine.cycles import cycle_kind

    pair = sampling_setup()
    vocab = pair[0].vocab_size
    # every kind takes constraints now: the chain, the tree, a DFlash2 drafter's selector
    dflash2 = dataclasses.replace(pair[2], dflash2=DFlash2Config())
    assert cycle_kind(pair[0], dflash2, 4, constrained=True).num_drafts == 3
    assert cycle_kind(pair[0], pair[2], 4, tree_budget=6, constrained=True).num_drafts == 6
    gen = _engine(pair, 4)
    too_big = counting_dfa(vocab, n=12)  # 13 states, a region holds 8
    with pytest.raises(InputError, match="needs 13 automaton states; this engine holds at most 8"):
        gen.regions.check(too_big)
    plain = BatchEngine(*pair, block_size=4, batch_size=2, max_new_tokens=8, max_prompt_len=16,
                        sampling=Sampling(per_row=True), speculation="fixed")
    with pytest.raises(Exception, match="holds no constraints"):
        list(plain.generate([[1, 2]], sampling=[Sampling(constraint=pairs_dfa(vocab), per_row=True)]))


def test_regions_are_shared_kept_idle_and_reused():
    vocab = 12
    regions = cons.ConstraintRegions(2, 8, 64, vocab)
    pool = cons.ConstraintPool.empty(2, 8, 64, vocab)
    a, b, c = pairs_dfa(vocab), counting_dfa(vocab), counting_dfa(vocab, 3)
    pool, first = regions.admit(pool, 0, a)
    pool, again = regions.admit(pool, 1, a)  # shared
    assert first == again and regions.loads == 1
    pool, _ = regions.admit(pool, 1, b)  # slot 1's row ends, b takes the other region
    assert regions.loads == 2 and regions.users == [1, 1]
    pool, _ = regions.admit(pool, 0, None)  # a idle, kept
    pool, _ = regions.admit(pool, 0, a)
    assert regions.loads == 2
    pool, _ = regions.admit(pool, 0, c)  # a's region is the idle one: c overwrites it
    assert regions.loads == 3 and regions.held.count(a) == 0
