"""A constraint compiled once on the host: a token-level DFA over the target's vocabulary as compact
numpy arrays (`Automaton`), the form the engine loads into its device pool.

`compile_constraint(constraint, vocab)`: the constraint's regex -> outlines-core's `Index` (a byte
DFA walked over every token's bytes) -> states renumbered densely from 0 (the initial state first,
then breadth-first in token order), with the states from which no final state is reachable pruned
(with their edges: outlines-core keeps every state a token reaches that can go on a byte further,
which a vocabulary may not be able to finish), and the eos ids added: each allowed exactly in final
states, leading back to the same state.

Size. A state costs `4 * ceil(vocab_size / 32)` bytes of mask (18,992 at a 151,936-token vocabulary;
512 at the demo's 4,096), 8 bytes of state tables (starts, counts) and 1 of `final`, and each edge
8 bytes (token, target). Edges dominate where a state allows most of the vocabulary: inside a JSON
string almost every token is allowed, about 1.2 MB of edges per such state at 152k tokens. Compiling
costs a pass over the vocabulary per state (outlines-core, in Rust) plus the arrays' assembly here;
docs/structured-output.md has measured figures (`python -m dflash_jax.constrain` prints them).
A constraint over `max_states` states is refused with its count.
"""

from __future__ import annotations

import dataclasses
from collections import deque

import numpy as np

from dflash_jax.constrain.constraint import Constraint
from dflash_jax.constrain.vocabulary import TokenVocabulary
from dflash_jax.errors import InputError

# The default bound on a constraint's states (after pruning): 78 MB of masks at a 152k vocabulary.
MAX_STATES = 4096


def mask_words(vocab_size: int) -> int:
    return -(-vocab_size // 32)


@dataclasses.dataclass(frozen=True, eq=False)
class Automaton:
    """A token-level DFA over `vocab_size` ids. State s allows exactly the tokens of its edges
    `tokens[starts[s] : starts[s] + counts[s]]` (ascending; `targets` the next states), which its
    mask row spells as bits (bit t % 32 of word t // 32); `final[s]`: the text so far is a complete
    match (and the eos ids are among its edges, leading back to s)."""
    vocab_size: int
    initial: int
    masks: np.ndarray    # [S, ceil(vocab_size / 32)] uint32
    starts: np.ndarray   # [S] int32
    counts: np.ndarray   # [S] int32
    tokens: np.ndarray   # [E] int32
    targets: np.ndarray  # [E] int32
    final: np.ndarray    # [S] bool

    @property
    def num_states(self) -> int:
        return int(self.final.shape[0])

    @property
    def num_edges(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.masks, self.starts, self.counts, self.tokens, self.targets, self.final))

    def allowed(self, state: int) -> np.ndarray:
        """The token ids allowed in `state`, ascending."""
        s = int(self.starts[state])
        return self.tokens[s:s + int(self.counts[state])]

    def next(self, state: int, token: int) -> int:
        """The state after `token`, or -1 where `token` is not allowed."""
        s, n = int(self.starts[state]), int(self.counts[state])
        row = self.tokens[s:s + n]
        i = int(np.searchsorted(row, token))
        return int(self.targets[s + i]) if i < n and row[i] == token else -1

    def accepts(self, ids) -> bool:
        """Whether walking `ids` from the initial state stays allowed and ends in a final state."""
        state = self.initial
        for t in ids:
            state = self.next(state, int(t))
            if state < 0:
                return False
        return bool(self.final[state])


def build_index(constraint: Constraint, vocab: TokenVocabulary):
    """outlines-core's `Index` for the constraint's regex over `vocab` (InputError where it cannot)."""
    from outlines_core import Index

    regex = constraint.to_regex()
    try:
        return Index(regex, vocab.outlines)
    except (ValueError, TypeError, RuntimeError) as e:
        message = " ".join(str(e).split())
        if len(message) > 300:
            message = message[:300] + "..."
        raise InputError(f"{constraint.kind}: cannot compile: {message}") from None


def _useful(transitions: dict, finals: set, eos: int) -> set:
    """The states from which a final state is reachable over non-eos tokens."""
    back: dict[int, set] = {}
    for s, row in transitions.items():
        for t, d in row.items():
            if t != eos:
                back.setdefault(d, set()).add(s)
    seen, todo = set(finals), list(finals)
    while todo:
        for s in back.get(todo.pop(), ()):
            if s not in seen:
                seen.add(s)
                todo.append(s)
    return seen


def compile_constraint(constraint: Constraint, vocab: TokenVocabulary, max_states: int = MAX_STATES) -> Automaton:
    """The constraint's token-level automaton over `vocab` (see the module docstring); InputError where
    outlines-core cannot express it, no output can satisfy it, or it has over `max_states` states."""
    index = build_index(constraint, vocab)
    eos = vocab.eos_ids[0]
    transitions = index.get_transitions()
    finals = set(index.get_final_states())
    initial = index.get_initial_state()
    useful = _useful(transitions, finals, eos)
    if initial not in useful:
        raise InputError(f"{constraint.kind}: no output over this vocabulary can satisfy the constraint")
    # Dense ids: breadth-first from the initial state, each state's edges in token order.
    ids, order, rows = {initial: 0}, deque([initial]), []
    while order:
        s = order.popleft()
        row = sorted((t, d) for t, d in transitions.get(s, {}).items() if t != eos and d in useful)
        for _t, d in row:
            if d not in ids:
                ids[d] = len(ids)
                order.append(d)
        rows.append((s, row))
    n = len(ids)
    if n > max_states:
        raise InputError(f"{constraint.kind}: the automaton has {n} states, over the limit of {max_states}")
    return _assemble(vocab, rows, ids, finals)


def _assemble(vocab: TokenVocabulary, rows: list, ids: dict, finals: set) -> Automaton:
    """The arrays from the dense states' rows ([(outlines state, [(token, outlines target)])])."""
    n, eos_ids = len(ids), sorted(vocab.eos_ids)
    final = np.array([s in finals for s, _ in rows], dtype=bool)
    counts = np.array([len(row) + (len(eos_ids) if s in finals else 0) for s, row in rows], dtype=np.int32)
    starts = np.zeros(n, dtype=np.int32)
    np.cumsum(counts[:-1], out=starts[1:])
    tokens = np.empty(int(counts.sum()), dtype=np.int32)
    targets = np.empty_like(tokens)
    for k, (s, row) in enumerate(rows):
        toks = [t for t, _ in row]
        dests = [ids[d] for _, d in row]
        if s in finals:  # eos: allowed exactly here, back to the same state; merged in token order
            toks, dests = toks + eos_ids, dests + [k] * len(eos_ids)
            perm = np.argsort(toks, kind="stable")
            toks, dests = np.asarray(toks)[perm], np.asarray(dests)[perm]
        a = int(starts[k])
        tokens[a:a + len(toks)] = toks
        targets[a:a + len(toks)] = dests
    masks = np.zeros((n, mask_words(vocab.vocab_size)), dtype=np.uint32)
    state_of_edge = np.repeat(np.arange(n), counts)
    np.bitwise_or.at(masks, (state_of_edge, tokens // 32), np.left_shift(np.uint32(1), (tokens % 32).astype(np.uint32)))
    for a in (masks, starts, counts, tokens, targets, final):
        a.flags.writeable = False
    return Automaton(vocab_size=vocab.vocab_size, initial=0, masks=masks, starts=starts, counts=counts,
                     tokens=tokens, targets=targets, final=final)
