"""The host's ledger of a batch's slots, shared by `BatchEngine.generate` and `StreamingEngine`.

`SlotLedger` keeps which row occupies each slot, the slots whose prompts are being filled in
piece by piece, the pool pages each slot holds (`dflash_jax.kv.pool`), the rows waiting for a
slot, and how many tokens of each row were already reported. It admits waiting rows in order (one
that waits for pages is not overtaken), finishes rows (freeing their slots and pages), and cuts a
row's tokens at its first stop token into a `Result`. With prefix caching (`prompt_of`), its pool is
a `PrefixPool`: a waiting row's cached prompt pages are found at admission, held, and the row's
prefill starts after them (`start`); `register` caches a row's prompt pages once its prompt is in. `GenerationStats` aggregates Results (tau,
acceptance histogram, tokens/s); the server's live figures are `streaming.EngineMetrics`.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Hashable, Iterator, Sequence

import numpy as np

from dflash_jax.errors import DFlashError
from dflash_jax.kv.pool import PagePool
from dflash_jax.kv.prefix import PrefixPool


@dataclasses.dataclass
class Result:
    index: int  # position in the prompts given to `generate` (a request's row_id when streaming)
    output_ids: list[int]
    acceptance_lengths: list[int]  # of each cycle that drafted (plain decoding's: 1 per step)
    finish_reason: str  # "stop" | "length" (streaming: also "cancelled", "error")
    plain_cycles: int = 0  # auto speculation's plain cycles (no draft verified, one token each)
    # A row that asked for logprobs (`Sampling.logprobs`): each output token's logprob under the target's raw
    # distribution and its top alternatives as (token id, logprob), most likely first; aligned with output_ids.
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None

    @property
    def cycles(self) -> int:
        """Every decoding cycle the row ran, drafting or plain."""
        return len(self.acceptance_lengths) + self.plain_cycles


class SlotLedger:
    """Host bookkeeping of `width` slots. A row is anything the caller names its rows by (a
    prompt's index, a StreamRequest); `pages_of(row)` is the pool pages it needs (only asked with a
    pool of kv_pages pages). stop_set: the stop tokens.

    occupant[s]: the row decoding in slot s, None: none. filling[s]: [row, prompt tokens in] of a
    slot whose prompt goes in piece by piece (not yet decoding). pages[s]: the pool pages slot s
    holds. waiting: rows waiting for a slot, in admission order. counted[s]: tokens of slot s's
    row already reported. start[s]: the prompt positions of slot s's row found in the prefix cache
    (0 without). pool: the page pool (default: a new PagePool of kv_pages); a `PrefixPool` (which
    the caller may keep across ledgers) with prompt_of(row), a row's prompt tokens: prefix caching.
    cached_tokens, prompt_tokens: the admitted rows' prompt tokens found in the cache, and all."""

    def __init__(self, width: int, kv_pages: int | None, stop_set: frozenset[int],
                 pages_of: Callable[[Hashable], int], prompt_of: Callable[[Hashable], list[int]] | None = None,
                 pool: PagePool | None = None):
        self.pool = pool if pool is not None else (PagePool(kv_pages) if kv_pages else None)
        self.prompt_of = prompt_of if isinstance(self.pool, PrefixPool) else None
        self.stop_set, self.pages_of = stop_set, pages_of
        self.occupant: list = [None] * width
        self.filling: dict[int, list] = {}
        self.pages: list[list[int]] = [[] for _ in range(width)]
        self.start = [0] * width
        self.waiting: collections.deque = collections.deque()
        self.counted = np.zeros(width, np.int64)
        self.cached_tokens = self.prompt_tokens = 0

    # ------------------------------------------------------------------ who is where

    @property
    def width(self) -> int:
        return len(self.occupant)

    @property
    def running(self) -> int:
        """Rows decoding."""
        return sum(o is not None for o in self.occupant)

    @property
    def busy(self) -> int:
        """Rows decoding or being filled."""
        return self.running + len(self.filling)

    def occupied(self) -> np.ndarray:
        """[width] bool: the slots with a row decoding."""
        return np.asarray([o is not None for o in self.occupant], bool)

    # ------------------------------------------------------------------ admission and finish

    def admit_waiting(self, fills: Callable[[Hashable, int], bool] | None = None) -> tuple[list[int], list]:
        """The free slots take the first waiting rows, in order, each with the pool pages it
        needs (a row that waits for pages is not overtaken), its cached prompt pages first (held,
        not counted twice). A row for which fills(row, start) is true starts filling (`filling`,
        from start); the others decode at once. Returns (slots, rows) of those."""
        slots, rows = [], []
        for s in range(self.width):
            if self.occupant[s] is not None or s in self.filling:
                continue
            if not self.waiting:
                break
            row = self.waiting[0]
            hits = self.pool.lookup(self.prompt_of(row)) if self.prompt_of else []
            if self.pool and self._cost(row, hits) > self.pool.available:
                break
            if self.pool:
                new = self.pages_of(row) - len(hits)
                self.pages[s] = self.pool.take(new, hits) if hits else self.pool.take(new)
            self.start[s] = len(hits) * self.pool.page_size if hits else 0
            if self.prompt_of:
                self.cached_tokens += self.start[s]
                self.prompt_tokens += len(self.prompt_of(row))
            self.waiting.popleft()
            if fills is not None and fills(row, self.start[s]):
                self.filling[s] = [row, self.start[s]]
                continue
            self.occupant[s], self.counted[s] = row, 0
            slots.append(s)
            rows.append(row)
        if not slots and self.waiting and not self.busy:  # cannot happen: every row fits the empty pool
            raise DFlashError("no row is running and the next prompt does not fit the page pool")
        return slots, rows

    def _cost(self, row, hits: list[int]) -> int:
        """Of the pool's available pages, what admitting row uses up (its hits held, not taken)."""
        new = self.pages_of(row) - len(hits)
        return self.pool.cost(new, hits) if hits else new

    def starts(self, slots: Sequence[int]) -> list[int]:
        """The prompt positions of these slots' rows found in the prefix cache (their prefill's start)."""
        return [self.start[s] for s in slots]

    def register(self, slots: Sequence[int]):
        """These slots' rows have their whole prompts in: their full prompt pages are cached (with
        prefix caching; else nothing)."""
        if self.prompt_of:
            for s in slots:
                self.pool.register(self.prompt_of(self.occupant[s]), self.pages[s])

    def tables(self, slots: Sequence[int]) -> list[list[int]] | None:
        """The pool pages of these slots (for their page tables), None without a pool."""
        return [self.pages[s] for s in slots] if self.pool else None

    def filled(self, slot: int):
        """The filling row of slot has its whole prompt in: it decodes from now on."""
        row, _ = self.filling.pop(slot)
        self.occupant[slot], self.counted[slot] = row, 0

    def finish(self, slot: int):
        """End the row of slot (decoding or filling): the slot is free and its pages back in the
        pool. Returns the row."""
        row = self.filling.pop(slot)[0] if slot in self.filling else self.occupant[slot]
        self.occupant[slot] = None
        if self.pool:
            self.pool.give(self.pages[slot])
        self.pages[slot], self.start[slot] = [], 0
        return row

    def narrow(self, keep: np.ndarray):
        """Keep only slots `keep`, in that order (the state narrowed to them)."""
        self.occupant = [self.occupant[k] for k in keep]
        self.counted = self.counted[keep]
        self.pages = [self.pages[k] for k in keep]
        self.start = [self.start[k] for k in keep]

    # ------------------------------------------------------------------ tokens

    def report(self, num_generated: np.ndarray, limit_of: Callable[[Hashable], int]) -> int:
        """The tokens the decoding rows gained since the last report (each counted up to its
        limit, limit_of(row)), now counted."""
        busy = self.occupied()
        top = np.asarray([limit_of(o) if o is not None else 0 for o in self.occupant])
        counts = np.where(busy, np.minimum(num_generated, top), self.counted)
        gained = int((counts - self.counted)[busy].sum())
        self.counted[:] = counts
        return gained

    def cut(self, tokens: list[int]) -> tuple[list[int], bool]:
        """tokens up to and including the first stop token, and whether there was one."""
        stop = next((j for j, t in enumerate(tokens) if t in self.stop_set), None)
        return (tokens, False) if stop is None else (tokens[:stop + 1], True)

    def result(self, index: int, output: np.ndarray, upto: int, acceptance: np.ndarray, num_cycles: int,
               logprobs=None) -> Result:
        """The Result of a row from its output tokens (the first `upto` of them, cut at the first
        stop token) and its acceptance lengths (the first num_cycles; a 0 is auto speculation's
        plain cycle, counted apart: `Result.plain_cycles`). logprobs: (k, the row's token_logprobs,
        top_ids, top_logprobs), for a row that asked for k top alternatives (None: none)."""
        tokens, stopped = self.cut(output[:upto].tolist())
        lengths = acceptance[:num_cycles].tolist()
        drafted = [a for a in lengths if a > 0]
        result = Result(index, tokens, drafted, "stop" if stopped else "length", len(lengths) - len(drafted))
        if logprobs is not None:
            result.logprobs, result.top_logprobs = token_logprobs(*logprobs, 0, len(tokens))
        return result


def token_logprobs(k: int, own: np.ndarray, ids: np.ndarray, top: np.ndarray, start: int,
                   stop: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """A row's logprobs of output positions start..stop from its `DecodeState` arrays (own [out_len],
    ids and top [out_len, max_logprobs]), k top alternatives each: (logprobs, top_logprobs), as
    `Result` holds them."""
    own = own[start:stop].tolist()
    ids, top = ids[start:stop, :k].tolist(), top[start:stop, :k].tolist()
    return own, [list(zip(i, t)) for i, t in zip(ids, top)]


@dataclasses.dataclass
class GenerationStats:
    """Aggregates over Results: tau and the acceptance histogram over the cycles that drafted
    (`cycles`; plain decoding's steps, block size 1), auto speculation's plain cycles apart
    (`plain_cycles`), tokens/s."""

    block_size: int
    tokens: int = 0
    cycles: int = 0
    plain_cycles: int = 0
    seconds: float = 0.0
    histogram: dict[int, int] = dataclasses.field(default_factory=dict)

    def add(self, result: Result):
        self.tokens += len(result.output_ids)
        self.cycles += len(result.acceptance_lengths)
        self.plain_cycles += result.plain_cycles
        for a in result.acceptance_lengths:
            self.histogram[a] = self.histogram.get(a, 0) + 1

    @property
    def tau(self) -> float | None:
        """Mean tokens per cycle that drafted; None when none did (auto ran plain decoding only)."""
        if not self.cycles:
            return None if self.plain_cycles else 0.0
        return sum(k * v for k, v in self.histogram.items()) / self.cycles

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        tau = self.tau
        return dict(block_size=self.block_size, tau=None if tau is None else round(tau, 4), cycles=self.cycles,
                    plain_cycles=self.plain_cycles, output_tokens=self.tokens, seconds=round(self.seconds, 3),
                    tokens_per_second=round(self.tokens_per_second, 2),
                    acceptance_histogram={str(k): self.histogram[k] for k in sorted(self.histogram)})


def timed(results: Iterator[Result], stats: GenerationStats) -> Iterator[Result]:
    """Pass results through, adding them and the wall time spent producing them to stats."""
    t = time.perf_counter()
    for r in results:
        stats.seconds += time.perf_counter() - t
        stats.add(r)
        yield r
        t = time.perf_counter()
    stats.seconds += time.perf_counter() - t
