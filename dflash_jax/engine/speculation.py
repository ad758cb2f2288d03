"""Auto speculation: which draft length K the next decoding cycles run, chosen at each host sync.

Whether speculation pays depends on the batch and the hardware: at a small batch on an
accelerator a cycle that verifies K + 1 tokens costs about one plain step (reading the weights),
so the longest block wins; as the batch grows the step turns compute-bound, each verified token
costs compute, and the best K shrinks, down to plain decoding (K = 0). The engine compiles a few
draft lengths (`candidates`) with static shapes, and `Speculation` picks one at each sync from two
measurements:

- the cost of a cycle of each K at the batch's width (seconds per cycle: timed when the engine
  calibrates after warm-up, then kept current online from each call's wall time),
- the acceptance: per draft position i, the share of rows that reached draft i and accepted it
  (`AcceptanceCounts`). A cycle that verifies K drafts accepts a prefix of them, so
  E[tokens per row per cycle | K] = 1 + sum_{i<=K} prod_{j<=i} rate_j (`expected_tokens`): a run at
  a shorter K still measures the positions it reaches.

`choose(costs, rates)` is the policy itself: the K of the most expected tokens per second (rows
cancel: every row of a cycle runs the same K). Switching K never changes tokens: a row's token at
each position is the target's, sampled with that position's key, whichever K verified it (a K = 0
cycle still extends the drafter's context, so a later cycle drafts from all of it). The one
exception is a DFlash2 drafter's rejection acceptance, where sampled tokens keep the target's
distribution but depend on the drafts.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Callable, Mapping, Sequence

import numpy as np

SPECULATION_MODES = ("auto", "fixed")

# A rate estimate starts from this many pseudo-observations of PRIOR_RATE (before any cycle has
# run at a position), so a first choice drafts, and one cycle's rows do not swing it.
PRIOR_RATE, PRIOR_WEIGHT = 0.7, 8.0
# The counts keep about this many row-cycles: older ones fade, so the rates follow the rows now running.
MEMORY = 512.0


def default_candidates(block_size: int, tree_budget: int = 0) -> tuple[int, ...]:
    """The draft lengths `--speculation auto` compiles: plain decoding (0), 3 and 7 (where the
    block holds them) and the whole block, B - 1; with a draft tree, 0 and the tree's node count."""
    if block_size <= 1:
        return (0,)
    if tree_budget:
        return (0, tree_budget)
    return tuple(sorted({0, *(k for k in (3, 7) if k < block_size - 1), block_size - 1}))


def expected_tokens(rates: Sequence[float], k: int) -> float:
    """Tokens a row gains in a cycle of k drafts when draft i is accepted with probability
    rates[i-1] given that drafts 1..i-1 were: 1 (the target's own token) + the accepted prefix."""
    total, reach = 1.0, 1.0
    for rate in rates[:k]:
        reach *= rate
        total += reach
    return total


def rates_for_tau(tau: float, k: int) -> list[float]:
    """One acceptance rate for every position such that a cycle of k drafts gains tau tokens on
    average (a geometric fit of a measured tau at one K; tau in [1, k + 1])."""
    if not 1.0 <= tau <= k + 1:
        raise ValueError(f"tau must be in 1..{k + 1} for {k} drafts, got {tau}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if expected_tokens([mid] * k, k) < tau else (lo, mid)
    return [(lo + hi) / 2] * k


def choose(costs: Mapping[int, float], rates: Sequence[float]) -> int:
    """The draft length of the most expected tokens per second: argmax over K of
    expected_tokens(rates, K) / costs[K] (costs: seconds per cycle, K = 0 plain decoding). A tie
    goes to the shorter K."""
    if not costs:
        raise ValueError("no draft length to choose from")
    return max(sorted(costs), key=lambda k: (expected_tokens(rates, k) / costs[k], -k))


@dataclasses.dataclass
class AcceptanceCounts:
    """Per draft position i (1..depth): rows that reached draft i in a cycle (tried) and rows that
    accepted it (accepted), faded to about MEMORY row-cycles."""

    depth: int
    tried: np.ndarray = None
    accepted: np.ndarray = None

    def __post_init__(self):
        self.tried = np.zeros(self.depth) if self.tried is None else self.tried
        self.accepted = np.zeros(self.depth) if self.accepted is None else self.accepted

    def add(self, tried: np.ndarray, accepted: np.ndarray):
        self.tried = self.tried + tried[:self.depth]
        self.accepted = self.accepted + accepted[:self.depth]
        if self.tried[0] > MEMORY:
            scale = MEMORY / self.tried[0]
            self.tried, self.accepted = self.tried * scale, self.accepted * scale

    def rates(self) -> list[float]:
        return ((self.accepted + PRIOR_RATE * PRIOR_WEIGHT) / (self.tried + PRIOR_WEIGHT)).tolist()


class Speculation:
    """The host's auto-speculation policy over compiled draft lengths `candidates` (0 = plain).

    `pick(width)` gives the K the next call runs; `observe(k, width, cycles, seconds, tried,
    accepted)` records a call's figures (its wall seconds None when they are not its own: a
    prefill ran before it in the same wait). A cost is kept per (width, K): the least seconds per
    cycle of its last `window` timed calls. A call's wall time is its cycles' plus whatever else
    held the host or the device (a burst of admissions, a server's HTTP work, another process),
    which only adds: a median of such times stuck high keeps a K from being chosen long after the
    burst, the least does not. Until a K is timed at a width it is tried first.
    So that no cost (nor, while plain decoding wins, the drafts' acceptance) goes stale while
    another K runs, a K other than the best is run again once the time since it last ran is its
    last timed call's time / `probe_share` (each K then takes about that share of the time: 1%).
    `clock` gives seconds (tests pass their own). `share()` is the share of cycles each K ran."""

    def __init__(self, candidates: Sequence[int], depth: int, *, tree: bool = False, probe_share: float = 0.01,
                 window: int = 9, clock: Callable[[], float] = time.monotonic):
        self.candidates = tuple(sorted(set(candidates)))
        self.tree = tree  # the one drafting candidate is a tree: its rates are per depth, all its own
        self.counts = AcceptanceCounts(depth)
        self.samples: dict[tuple[int, int], collections.deque] = {}
        self.timed: dict[tuple[int, int], float] = {}  # the seconds of each one's last timed call
        self.ran: dict[tuple[int, int], float] = {}  # when each last ran (timed or not)
        self.cycles: dict[int, int] = {k: 0 for k in self.candidates}
        self.probe_share, self.window, self.clock = probe_share, window, clock

    @property
    def costs(self) -> dict[tuple[int, int], float]:
        """Seconds per cycle of each (width, K) timed: the least of its recent calls."""
        return {key: float(min(v)) for key, v in self.samples.items()}

    def rates(self) -> list[float]:
        return self.counts.rates()

    def _tokens(self, k: int) -> float:
        if self.tree and k:  # a tree's depth is the block's, whatever its node count
            return expected_tokens(self.rates(), self.counts.depth)
        return expected_tokens(self.rates(), k)

    def pick(self, width: int) -> int:
        untimed = [k for k in self.candidates if (width, k) not in self.samples]
        if untimed:
            return untimed[0]
        costs = self.costs
        best = max(self.candidates, key=lambda k: (self._tokens(k) / costs[(width, k)], -k))
        now = self.clock()
        overdue = {k: (now - self.ran[(width, k)]) * self.probe_share / self.timed[(width, k)]
                   for k in self.candidates if k != best}
        due = [k for k, late in overdue.items() if late >= 1]
        return max(due, key=lambda k: (overdue[k], -k)) if due else best

    def observe(self, k: int, width: int, cycles: int, seconds: float | None, tried=None, accepted=None):
        """A call of `cycles` cycles of k drafts on `width` slots: its wall seconds (None: not its own)
        and, per draft position, the rows that reached it (tried) and accepted it."""
        if cycles <= 0:
            return
        self.cycles[k] = self.cycles.get(k, 0) + int(cycles)
        self.ran[(width, k)] = self.clock()
        if tried is not None and k:
            self.counts.add(np.asarray(tried, float), np.asarray(accepted, float))
        if seconds is not None:
            self.time(k, width, cycles, seconds)

    def time(self, k: int, width: int, cycles: int, seconds: float):
        """`cycles` cycles of k drafts on `width` slots took `seconds`: a sample of the cost."""
        if cycles <= 0 or seconds <= 0:
            return
        key = (width, k)
        self.samples.setdefault(key, collections.deque(maxlen=self.window)).append(seconds / cycles)
        self.timed[key] = seconds
        self.ran[key] = self.clock()

    def share(self) -> dict[int, float]:
        total = sum(self.cycles.values())
        return {k: (n / total if total else 0.0) for k, n in sorted(self.cycles.items())}

    def reading(self, width: int | None = None) -> dict | None:
        """What the choice at `width` (default: the widest timed) rests on now, for a person: the
        K `pick` would run there (no probe: `best`) and, per K timed there, its ms per cycle and
        the tokens per cycle the measured rates give it (`expected_tokens`); None before any cost
        is timed."""
        widths = sorted({w for w, _ in self.samples})
        if not widths:
            return None
        width = width if width in widths else widths[-1]
        costs = {k: c for (w, k), c in self.costs.items() if w == width}
        best = max(sorted(costs), key=lambda k: (self._tokens(k) / costs[k], -k))
        return dict(width=width, best=best, cycle_ms={str(k): round(1e3 * c, 3) for k, c in sorted(costs.items())},
                    expected_tokens={str(k): round(self._tokens(k), 3) for k in sorted(costs)})

    def summary(self) -> dict:
        """For the run's summary: the candidates, the share of cycles each ran (`cycles`: how many),
        the rates measured, the costs (ms per cycle) at each width and the `reading` of the widest."""
        return dict(candidates=list(self.candidates), share={str(k): round(v, 4) for k, v in self.share().items()},
                    cycles={str(k): n for k, n in sorted(self.cycles.items())},
                    acceptance_rates=[round(r, 4) for r in self.rates()],
                    cycle_ms={f"{w}x{k}": round(1e3 * c, 3) for (w, k), c in sorted(self.costs.items())},
                    reading=self.reading())

