"""`ConstraintCache`: compiled automata kept by constraint, least recently used first out, bounded by
count and bytes; thread-safe (the server compiles on its request threads). Two requests for the same
constraint at once compile it once: the second waits for the first's result (or its error). Errors
are not kept: a constraint refused is compiled (and refused) again when asked again."""

from __future__ import annotations

import threading
from collections import OrderedDict
from concurrent.futures import Future

from dflash_jax.constrain.automaton import MAX_STATES, Automaton, compile_constraint
from dflash_jax.constrain.constraint import Constraint
from dflash_jax.constrain.vocabulary import TokenVocabulary


class ConstraintCache:
    """Automata for one vocabulary, at most `max_entries` of them and `max_bytes` in all (an automaton
    larger than `max_bytes` alone is returned but not kept)."""

    def __init__(self, vocab: TokenVocabulary, max_entries: int = 64, max_bytes: int = 1 << 30,
                 max_states: int = MAX_STATES):
        self.vocab = vocab
        self.max_entries, self.max_bytes, self.max_states = max_entries, max_bytes, max_states
        self._entries: OrderedDict[Constraint, Automaton] = OrderedDict()
        self._pending: dict[Constraint, Future] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __contains__(self, constraint: Constraint) -> bool:
        with self._lock:
            return constraint in self._entries

    def get(self, constraint: Constraint) -> Automaton:
        """The constraint's automaton: kept, or compiled now (InputError where it cannot be)."""
        with self._lock:
            found = self._entries.get(constraint)
            if found is not None:
                self._entries.move_to_end(constraint)
                self.hits += 1
                return found
            pending = self._pending.get(constraint)
            if pending is None:
                self.misses += 1
                owner, pending = True, Future()
                self._pending[constraint] = pending
            else:
                owner = False
        if not owner:
            return pending.result()
        try:
            automaton = compile_constraint(constraint, self.vocab, self.max_states)
        except BaseException as e:
            with self._lock:
                del self._pending[constraint]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._pending[constraint]
            self._entries[constraint] = automaton
            self._bytes += automaton.nbytes
            while self._entries and (len(self._entries) > self.max_entries or self._bytes > self.max_bytes):
                _, old = self._entries.popitem(last=False)
                self._bytes -= old.nbytes
        pending.set_result(automaton)
        return automaton
