"""Serving: the scheduler's admission fed by a queue, and every row's tokens streamed at each sync.

`StreamingEngine(generator)` runs a Generator built with `Sampling(per_row=True)` on a thread of
its own. `submit(request)` queues a `Request` (a bounded queue: `QueueFull` when it is full);
the engine admits requests into free slots as they come (in arrival order, each with its own
max_new_tokens, sampling and random stream), runs `sync_every` cycles per call and, while the
device runs the next call, hands each request the tokens it gained in the last one through
`request.emit(tokens, result)`: result is None until the request finishes. A request that is
cancelled (a client gone, a stop string found) ends at the next sync and its slot takes the next
request. `close()` stops new requests, lets the running and queued ones finish (or cancels them)
and ends the thread.

Tokens are those `Generator.generate` would give the same prompt: a row's tokens depend only on
its prompt, its sampling and its random stream (`row_id`), never on the rows beside it.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import queue
import threading
import time
import traceback
from typing import Callable

import numpy as np

from dflash_jax.engine.sampling import Sampling
from dflash_jax.engine.scheduler import Generator, PagePool, Result, run_steps
from dflash_jax.kv import NO_PAGE
from dflash_jax.engine.step import cancel, prefill, prefill_part
from dflash_jax.sharding import put_batch
from dflash_jax.errors import DFlashError


class QueueFull(DFlashError):
    """The engine's queue holds as many requests as it may: try again later."""


class Closed(DFlashError):
    """The engine takes no more requests (it is shutting down)."""


@dataclasses.dataclass(eq=False)
class Request:
    """One prompt to generate from. emit(tokens, result) is called from the engine's thread with
    the tokens the row gained since the last call (stop tokens included, cut at the first), and
    with its Result once it ends (finish_reason "stop", "length" or "cancelled"); it must not
    block. row_id keys the row's random stream: the same prompt, sampling and row_id give the
    same tokens whatever else runs."""

    prompt: list[int]
    max_new_tokens: int
    emit: Callable[[list[int], Result | None], None]
    sampling: Sampling = Sampling()
    row_id: int = 0
    cancelled: bool = False  # set by anyone: the engine ends the row at its next sync
    stopped: bool = False  # with cancelled: the caller found the row's end (a stop string), so it ends as "stop"
    arrived: float = dataclasses.field(default_factory=time.perf_counter)
    first_token: float | None = None  # when the engine emitted its first token
    finished: bool = False


def _cancel_reason(req: Request) -> str:
    """The finish reason of a cancelled request: "stop" where its caller found its end."""
    return "stop" if req.stopped else "cancelled"


# Prometheus histogram buckets, in seconds.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """A Prometheus histogram: counts per upper bound, the sum and the count."""

    def __init__(self, bounds):
        self.bounds, self.counts, self.sum, self.count = tuple(bounds), [0] * len(bounds), 0.0, 0

    def observe(self, value: float):
        i = bisect.bisect_left(self.bounds, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.sum += value
        self.count += 1


@dataclasses.dataclass
class EngineMetrics:
    """What the engine has done, for /metrics. Updated by the engine's thread under `lock`."""

    batch_size: int
    block_size: int
    running: int = 0
    waiting: int = 0
    requests: dict = dataclasses.field(default_factory=collections.Counter)  # by finish_reason
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cycles: int = 0  # decoding cycles of finished rows (tau's denominator)
    accepted: int = 0  # their tokens (tau's numerator)
    slot_syncs: int = 0  # slots x syncs, and how many of them held a running row: occupancy
    busy_slot_syncs: int = 0
    busy_seconds: float = 0.0  # wall time with rows running: tokens/s
    started: float = dataclasses.field(default_factory=time.perf_counter)
    lock: threading.Lock = dataclasses.field(default_factory=threading.Lock)

    def __post_init__(self):
        self.acceptance = Histogram(range(1, self.block_size + 1))
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.itl = Histogram(LATENCY_BUCKETS)

    @property
    def tau(self) -> float:
        return self.accepted / self.cycles if self.cycles else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.generation_tokens / self.busy_seconds if self.busy_seconds else 0.0

    @property
    def occupancy(self) -> float:
        return self.busy_slot_syncs / self.slot_syncs if self.slot_syncs else 0.0


class StreamingEngine:
    """A Generator serving a queue of Requests on a thread of its own (see the module's doc).

    max_waiting bounds the requests queued for a slot. The Generator must be built with
    Sampling(per_row=True) and without narrow_tail (a server's batch has no tail). on_error(e)
    runs on the engine's thread if it fails, after every open request has ended with "error"."""

    def __init__(self, gen: Generator, *, max_waiting: int = 256,
                 on_error: Callable[[BaseException], None] | None = None):
        if not gen.spec.sampling.per_row:
            raise DFlashError("a streaming engine needs a Generator built with Sampling(per_row=True)")
        if gen.tail_widths:
            raise DFlashError("a streaming engine keeps its batch whole: build the Generator without narrow_tail")
        self.gen, self.max_waiting, self.on_error = gen, max_waiting, on_error
        self.metrics = EngineMetrics(gen.batch_size, gen.spec.block_size)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # submitted and not yet admitted (guarded by _lock)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._cancel_all = False
        self._thread: threading.Thread | None = None
        self._open: set[Request] = set()  # submitted and not yet ended (guarded by _lock)
        self._last_read = 0.0  # when the engine's thread last read a call's figures
        self.error: BaseException | None = None  # what ended the engine's thread, if anything did

    # ------------------------------------------------------------------ the callers' side

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> list[int]:
        """Compile all that serving runs, so nothing compiles while it serves: prefill for every
        prompt bucket (16 up to the Generator's max_prompt_len, or up to its prefill_chunk where
        longer prompts go piece by piece) at every admission width, the streaming loop, `cancel`,
        and the pieces of a long prompt. progress(done, total, label) as `Generator.warmup`'s.
        Returns the buckets."""
        gen = self.gen
        top = gen.spec.prefill_chunk if self.interleaves else gen.max_prompt_len
        buckets = [b for b in (16 << i for i in range(32)) if b < top] + [top]
        steps = gen.warmup_steps(buckets, stream=True)
        if self.interleaves:
            def pieces():
                piece = gen.spec.prefill_chunk
                # A first, a middle (where prompts can have one) and a last piece.
                req = Request([0] * min(gen.max_prompt_len, 2 * piece + 1), 1, lambda *a: None, gen.spec.sampling)
                state = gen.new_state()
                for offset in range(0, len(req.prompt), piece):
                    state = self._piece(state, 0, req, offset, [])
                state, figures = gen._run(state, 1, stream=True)
                state = cancel(gen.spec, state, np.ones((gen.batch_size,), bool))
                gen._wait((figures, state.done), "running the warm-up's pieces of a long prompt")

            steps.append((f"a long prompt in pieces of {gen.spec.prefill_chunk}", pieces))
        run_steps(steps, progress)
        return buckets

    def check(self, prompt, max_new_tokens: int) -> str | None:
        """Why this request cannot run, or None."""
        top = self.gen.spec.max_new_tokens
        if not 1 <= max_new_tokens <= top:
            return f"max_tokens must be in 1..{top} (the server's --max-new-tokens), got {max_new_tokens}"
        return self.gen.check_prompt(prompt, max_new_tokens)

    def submit(self, request: Request):
        """Queue a request (from any thread). Raises DFlashError for a request that cannot run,
        QueueFull when max_waiting requests wait, Closed once the engine is closing."""
        why = self.check(request.prompt, request.max_new_tokens)
        if why:
            raise DFlashError(why)
        if not 0 <= request.row_id < 2**32:
            raise DFlashError(f"row id {request.row_id} outside 0..2**32-1")
        with self._lock:
            if self._closing.is_set() or self.error is not None:
                raise Closed("the server is shutting down" if self.error is None else f"the engine failed: {self.error}")
            if self._queued >= self.max_waiting:
                raise QueueFull(f"{self._queued} requests are waiting, the most this server queues")
            self._queued += 1
            self._open.add(request)
            with self.metrics.lock:
                self.metrics.waiting = self._queued
        self._inbox.put(request)

    def start(self) -> "StreamingEngine":
        self._thread = threading.Thread(target=self._serve, name="dflash-engine", daemon=True)
        self._thread.start()
        return self

    def close(self, *, cancel_running: bool = False, timeout: float | None = None) -> bool:
        """Take no more requests; finish those queued and running (or cancel them), then end the
        thread. Returns whether it ended within timeout."""
        with self._lock:
            self._closing.set()
            self._cancel_all = cancel_running
        self._inbox.put(None)  # wakes an idle engine
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ------------------------------------------------------------------ the engine's thread

    def _serve(self):
        try:
            self._loop()
        except BaseException as e:  # the engine is gone: every request still open ends with it
            traceback.print_exc()
            with self._lock:
                self.error, failed = e, list(self._open)
                self._open.clear()
            for req in failed:
                req.finished = True
                req.emit([], Result(req.row_id, [], [], "error"))
            if self.on_error is not None:
                self.on_error(e)

    def _ended(self, req: Request, result: Result):
        req.finished = True
        with self._lock:
            self._open.discard(req)
        with self.metrics.lock:
            self.metrics.requests[result.finish_reason] += 1
        req.emit([], result)

    def _take(self, waiting: collections.deque, block: bool):
        """Move submitted requests to `waiting` (waiting for one when block)."""
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            if item is not None:
                waiting.append(item)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _loop(self):
        gen, spec, m = self.gen, self.gen.spec, self.metrics
        batch = gen.batch_size
        pool = PagePool(spec.kv_pages) if spec.kv_pages else None
        held: list[list[int]] = [[] for _ in range(batch)]
        occupant: list[Request | None] = [None] * batch
        sent = np.zeros(batch, np.int64)  # tokens of each slot's row already emitted
        last_emit = np.zeros(batch)  # when each slot's row last emitted tokens
        waiting: collections.deque[Request] = collections.deque()
        to_end = np.zeros(batch, bool)  # slots whose rows the host ended: the device ends them next
        # Slots whose long prompts go in piece by piece between cycles: slot -> [request, tokens in].
        filling: dict[int, list] = {}
        piece = spec.prefill_chunk if self.interleaves else None
        state = gen.new_state()
        pending = None  # (figures of the call in flight, the occupants it ran with, when it was issued)

        def end(s: int, result: Result):
            req = occupant[s]
            occupant[s], to_end[s] = None, True
            if pool:
                pool.give(held[s])
                held[s] = []
            with m.lock:
                m.running = sum(o is not None for o in occupant) + len(filling)  # before the request hears
                m.cycles += len(result.acceptance_lengths)
                m.accepted += sum(result.acceptance_lengths)
                for a in result.acceptance_lengths:
                    m.acceptance.observe(a)
            self._ended(req, result)

        while True:
            running = sum(o is not None for o in occupant)
            idle = not running and pending is None and not waiting and not filling
            if idle and self._closing.is_set() and self._inbox.empty():
                return
            self._take(waiting, block=idle)
            cancel_all = self._cancel_all
            # Requests cancelled while they waited end here; running ones at the device below.
            for req in [r for r in waiting if r.cancelled or cancel_all]:
                waiting.remove(req)
                self._admitted(1)
                self._ended(req, Result(req.row_id, [], [], _cancel_reason(req)))
            for s, req in enumerate(occupant):
                if req is not None and (req.cancelled or cancel_all):
                    end(s, Result(req.row_id, [], [], _cancel_reason(req)))
            for s, (req, _) in list(filling.items()):
                if req.cancelled or cancel_all:
                    del filling[s]
                    occupant[s] = req  # ended as a running row is: slot, pages and device row
                    end(s, Result(req.row_id, [], [], _cancel_reason(req)))
            if to_end.any():
                state = cancel(spec, state, to_end)
                to_end[:] = False
            # Admission: the free slots take the first requests, in arrival order (one that
            # waits for pages is not overtaken).
            new, slots, tables = [], [], []
            for s in range(batch):
                if occupant[s] is None and s not in filling and waiting:
                    req = waiting[0]
                    if pool:
                        need = gen.pages_needed(len(req.prompt), req.max_new_tokens)
                        if need > pool.available:
                            break
                        held[s] = pool.take(need)
                    waiting.popleft()
                    if piece and len(req.prompt) > piece:  # a long prompt: piece by piece, below
                        filling[s] = [req, 0]
                        self._admitted(1)
                        continue
                    tables.append(held[s])
                    new.append(req)
                    slots.append(s)
            # One piece of each long prompt per round of cycles: the running rows wait for a
            # piece, not for a whole prompt. Its last piece makes it a running row.
            for s, entry in list(filling.items()):
                req, done_tokens = entry
                state = self._piece(state, s, req, done_tokens, held[s] if pool else None)
                entry[1] += piece
                if entry[1] >= len(req.prompt):
                    del filling[s]
                    occupant[s], sent[s] = req, 0
                    with m.lock:
                        m.prompt_tokens += len(req.prompt)
            if new:
                for s, req in zip(slots, new):
                    occupant[s], sent[s] = req, 0
                self._admitted(len(new))
                state = gen.admit(state, slots, [r.prompt for r in new], [r.row_id for r in new],
                                  [r.max_new_tokens for r in new], 0, tables if pool else None,
                                  [r.sampling for r in new])
                with m.lock:
                    m.prompt_tokens += sum(len(r.prompt) for r in new)
            issued = None
            if any(o is not None for o in occupant):
                state, figures = gen._run(state, until_free=bool(waiting), stream=True)
                issued = (figures, list(occupant), time.perf_counter())
            if pending is not None:
                self._deliver(pending, occupant, sent, last_emit, end)
            pending = issued
            with m.lock:
                m.running, m.waiting = sum(o is not None for o in occupant) + len(filling), self._queued_now()

    @property
    def interleaves(self) -> bool:
        """Whether prompts longer than the Generator's prefill_chunk go in piece by piece between
        cycles. Not for a hybrid target decoded plainly: its recurrent layers advance every row a
        cycle passes over, and a held row's state must wait for its next piece."""
        spec = self.gen.spec
        return self.gen.max_prompt_len > spec.prefill_chunk and not (spec.target.num_linear_layers
                                                                      and not spec.uses_drafter)

    def _piece(self, state, slot: int, req: Request, offset: int, pages):
        """The piece of req's prompt from offset into slot: `prefill_part`, or for the last piece
        `prefill(resume=True)`, which samples the row's first token and starts it."""
        gen, spec = self.gen, self.gen.spec
        piece = spec.prefill_chunk
        put = lambda x: put_batch(np.asarray(x), gen.mesh)
        tokens = np.zeros((1, piece), np.int32)
        part = req.prompt[offset:offset + piece]
        tokens[0, :len(part)] = part
        where = put(np.int32([slot]))
        if offset + piece < len(req.prompt):
            table = None
            if spec.kv_pages:
                table = np.full((1, state.target_cache.pages.shape[1]), NO_PAGE, np.int32)
                table[0, :len(pages)] = pages
                table = put(table)
            return prefill_part(gen.tparams, gen.dparams, spec, state, put(tokens), put(np.int32([len(part)])), where,
                                table, begin=offset == 0)
        s = req.sampling
        rows = (put(np.float32([s.temperature])), put(np.int32([s.top_k])), put(np.float32([s.top_p])))
        return prefill(gen.tparams, gen.dparams, spec, state, put(tokens), put(np.int32([len(part)])), where,
                       put(np.uint32([req.row_id])), np.int32(0), put(np.int32([req.max_new_tokens])), gen.stop_ids,
                       None, rows, resume=True)

    def _queued_now(self) -> int:
        with self._lock:
            return self._queued

    def _admitted(self, n: int):
        with self._lock:
            self._queued -= n

    def _deliver(self, pending, occupant, sent, last_emit, end):
        """Read a call's figures (waiting for it) and hand each row still served by the request
        it ran for its new tokens; rows that ended end their requests."""
        gen, m = self.gen, self.metrics
        figures, owners, issued = pending
        (progress, (output, acceptance, num_cycles)) = gen._wait(figures, "running decoding cycles")
        now = time.perf_counter()
        done, num_generated = progress[0].astype(bool), progress[1]
        busy = 0
        for s, req in enumerate(owners):
            if req is None or req.finished or occupant[s] is not req:
                continue
            busy += 1
            upto = int(min(num_generated[s], req.max_new_tokens))
            tokens = output[s, sent[s]:upto].tolist()
            stop = next((j for j, t in enumerate(tokens) if t in gen.stop_set), None)
            if stop is not None:
                tokens = tokens[:stop + 1]
            if tokens:
                if req.first_token is None:
                    req.first_token = now
                    with m.lock:
                        m.ttft.observe(now - req.arrived)
                else:
                    with m.lock:
                        m.itl.observe(now - last_emit[s])
                last_emit[s] = now
                sent[s] += len(tokens)
                with m.lock:
                    m.generation_tokens += len(tokens)
                req.emit(tokens, None)
            if stop is not None or done[s] or sent[s] >= req.max_new_tokens:
                ids = output[s, :sent[s]].tolist()
                reason = "stop" if ids and ids[-1] in gen.stop_set else "length"
                end(s, Result(req.row_id, ids, acceptance[s, :num_cycles[s]].tolist(), reason))
        with m.lock:
            m.slot_syncs += len(owners)
            m.busy_slot_syncs += busy
            if busy:
                m.busy_seconds += now - max(issued, self._last_read)
        self._last_read = now
