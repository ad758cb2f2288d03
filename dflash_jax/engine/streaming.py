"""Serving: the scheduler's admission fed by a queue, and every row's tokens streamed at each sync.

`StreamingEngine.of(pair, options, ...)` (or `StreamingEngine(generator)`, a BatchEngine built with
`Sampling(per_row=True)`) runs on a thread of its own. `submit(request)` queues a `StreamRequest` (a bounded queue: `QueueFull` when it is full);
the engine admits requests into free slots as they come (in arrival order, each with its own
max_new_tokens, sampling and random stream), runs `sync_every` cycles per call and, while the
device runs the next call, hands each request the tokens it gained in the last one through
`request.emit(tokens, result)`: result is None until the request finishes (a request that asked for
logprobs gets them too, `emit(tokens, None, logprobs)`). A request that is
cancelled (a client gone, a stop string found) ends at the next sync and its slot takes the next
request. `close()` stops new requests, lets the running and queued ones finish (or cancels them)
and ends the thread.

With prefix caching (`BatchEngine.prefix_cache`) a request whose prompt starts with pages cached by
an earlier one holds them and prefills only the rest (its pieces start after them); the metrics
count the prompt tokens so served (`EngineMetrics.prefix_hit_rate`).

Tokens are those `BatchEngine.generate` would give the same prompt: a row's tokens depend only on
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

from dflash_jax.engine.options import EngineOptions
from dflash_jax.engine.sampling import Sampling, check_sampling
from dflash_jax.engine.scheduler import BatchEngine, run_steps
from dflash_jax.engine.slots import Result, SlotLedger, token_logprobs
from dflash_jax.engine.step import cancel, prefill_part
from dflash_jax.kv import PrefixPool, page_table
from dflash_jax.sharding import put_batch
from dflash_jax.errors import DFlashError, InputError


class QueueFull(DFlashError):
    """The engine's queue holds as many requests as it may: try again later."""


class Closed(DFlashError):
    """The engine takes no more requests (it is shutting down)."""


@dataclasses.dataclass(eq=False)
class StreamRequest:
    """One prompt to generate from. emit(tokens, result) is called from the engine's thread with
    the tokens the row gained since the last call (stop tokens included, cut at the first), and
    with its Result once it ends (finish_reason "stop", "length" or "cancelled"); it must not
    block. row_id keys the row's random stream: the same prompt, sampling and row_id give the
    same tokens whatever else runs. A request whose sampling asks for logprobs (`Sampling.logprobs`)
    has its tokens emitted as emit(tokens, None, (logprobs, top_logprobs)), those tokens' own
    logprobs and top alternatives as `Result` holds them, and the whole lists in its Result."""

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


def _integer(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _cancel_reason(req: StreamRequest) -> str:
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
    cached_prompt_tokens: int = 0  # of them, served from the prefix cache (not prefilled)
    kv_pages: dict = dataclasses.field(default_factory=dict)  # a page pool's pages: total, free, cached (idle), held
    generation_tokens: int = 0
    cycles: int = 0  # decoding cycles of finished rows that drafted (tau's denominator; auto's plain ones apart)
    accepted: int = 0  # their tokens (tau's numerator)
    slot_syncs: int = 0  # slots x syncs, and how many of them held a running row: occupancy
    busy_slot_syncs: int = 0
    busy_seconds: float = 0.0  # wall time with rows running: tokens/s
    speculation: dict = dataclasses.field(default_factory=dict)  # share of cycles per draft length
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
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache, of all prompt tokens admitted."""
        return self.cached_prompt_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def occupancy(self) -> float:
        return self.busy_slot_syncs / self.slot_syncs if self.slot_syncs else 0.0


def pool_pages(pool) -> dict:
    """A page pool's pages (None: no pool): total, free, cached (a prefix cache's, held by no row) and held."""
    if pool is None:
        return {}
    cached = len(getattr(pool, "idle", ()))
    total = pool.num_pages
    return dict(total=total, free=len(pool.free), cached=cached, held=total - len(pool.free) - cached)


class StreamingEngine:
    """A BatchEngine serving a queue of Requests on a thread of its own (see the module's doc).

    max_waiting bounds the requests queued for a slot. The BatchEngine must be built with
    Sampling(per_row=True) and without narrow_tail (a server's batch has no tail). on_error(e)
    runs on the engine's thread if it fails, after every open request has ended with "error"."""

    def __init__(self, gen: BatchEngine, *, max_waiting: int = 256,
                 on_error: Callable[[BaseException], None] | None = None):
        if not gen.spec.sampling.per_row:
            raise DFlashError("a streaming engine needs a BatchEngine built with Sampling(per_row=True)")
        if gen.tail_widths:
            raise DFlashError("a streaming engine keeps its batch whole: build the BatchEngine without narrow_tail")
        self.gen, self.max_waiting, self.on_error = gen, max_waiting, on_error
        self.metrics = EngineMetrics(gen.batch_size, gen.spec.block_size)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._queued = 0  # submitted and not yet admitted (guarded by _lock)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._cancel_all = False
        self._thread: threading.Thread | None = None
        self._open: set[StreamRequest] = set()  # submitted and not yet ended (guarded by _lock)
        self._last_read = 0.0  # when the engine's thread last read a call's figures
        self.error: BaseException | None = None  # what ended the engine's thread, if anything did

    @classmethod
    def of(cls, pair, options: EngineOptions, *, max_new_tokens: int, max_prompt_len: int, max_waiting: int = 256,
           on_error: Callable[[BaseException], None] | None = None, admission_widths=None) -> "StreamingEngine":
        """A streaming engine for a loaded pair (`dflash_jax.pair.ModelPair`) run with these options
        (the server's), as `BatchEngine.of` builds a batch engine: each row with its own sampling
        (`Sampling(per_row=True)`), its batch whole (no narrow tail). admission_widths: as
        `BatchEngine`'s."""
        gen = BatchEngine.of(pair, dataclasses.replace(options, narrow_tail=False), max_new_tokens=max_new_tokens,
                             max_prompt_len=max_prompt_len, sampling=Sampling(per_row=True),
                             admission_widths=admission_widths)
        return cls(gen, max_waiting=max_waiting, on_error=on_error)

    # ------------------------------------------------------------------ the callers' side

    def warmup(self, progress: Callable[[int, int, str], None] | None = None) -> list[int]:
        """Compile all that serving runs, so nothing compiles while it serves: prefill for every
        prompt bucket (16 up to the BatchEngine's max_prompt_len, or up to its prefill_chunk where
        longer prompts go piece by piece) at every admission width, the streaming loop, `cancel`,
        and the pieces of a long prompt. progress(done, total, label) as `BatchEngine.warmup`'s.
        Returns the buckets."""
        gen = self.gen
        top = gen.spec.prefill_chunk if self.interleaves else gen.max_prompt_len
        buckets = [b for b in (16 << i for i in range(32)) if b < top] + [top]
        steps = gen.warmup_steps(buckets, stream=True)
        if self.interleaves:
            def pieces():
                piece = gen.spec.prefill_chunk
                # A first, a middle (where prompts can have one) and a last piece.
                req = StreamRequest([0] * min(gen.max_prompt_len, 2 * piece + 1), 1, lambda *a: None, gen.spec.sampling)
                state = gen.new_state()
                for offset in range(0, len(req.prompt), piece):
                    state = self._piece(state, 0, req, offset, [])
                state, figures = gen.run_cycles(state, 1, stream=True)
                state = cancel(gen.spec, state, np.ones((gen.batch_size,), bool))
                gen.read((figures, state.done), "running the warm-up's pieces of a long prompt")

            steps.append((f"a long prompt in pieces of {gen.spec.prefill_chunk}", pieces))
        run_steps(steps, progress)
        return buckets

    def check_constraint(self, automaton) -> None:
        """An InputError where a row could not hold this automaton (`dflash_jax.constrain.Automaton`):
        an engine with no constraint pool, or one too large for its regions."""
        if self.gen.regions is None:
            raise InputError("this engine holds no constraints (constraint_states 0)")
        self.gen.regions.check(automaton)

    def check(self, prompt, max_new_tokens: int) -> str | None:
        """Why this request cannot run, or None."""
        top = self.gen.spec.max_new_tokens
        if not (_integer(max_new_tokens) and 1 <= max_new_tokens <= top):
            return f"max_tokens must be in 1..{top} (the server's --max-new-tokens), got {max_new_tokens!r}"
        if not (np.issubdtype(prompt.dtype, np.integer) if isinstance(prompt, np.ndarray)
                else isinstance(prompt, (list, tuple)) and all(_integer(t) for t in prompt)):
            return "a prompt must be a list of integer token ids"
        return self.gen.check_prompt(prompt, max_new_tokens)

    def submit(self, request: StreamRequest):
        """Queue a request (from any thread). Raises DFlashError for a request that cannot run,
        QueueFull when max_waiting requests wait, Closed once the engine is closing.

        Everything admission casts to a device array is checked here (the prompt's ids, max_new_tokens,
        the row id, the sampling settings): a value out of range fails this request, never the
        engine's thread (which would end every request and the server)."""
        why = self.check(request.prompt, request.max_new_tokens)
        if why:
            raise DFlashError(why)
        if not (_integer(request.row_id) and 0 <= request.row_id < 2**32):
            raise DFlashError(f"row id {request.row_id!r} outside 0..2**32-1")
        s = request.sampling
        if not isinstance(s, Sampling):
            raise DFlashError(f"a request's sampling must be a Sampling, got {type(s).__name__}")
        check_sampling(s.temperature, s.top_k, s.top_p, s.logprobs)  # a Sampling checks itself; it may have been altered
        why = None if s.logprobs is None else self.gen.check_logprobs(s.logprobs)
        if why:
            raise InputError(why)
        if s.constraint is not None:
            self.check_constraint(s.constraint)  # an InputError (a DFlashError): never the engine thread's
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

    def _ended(self, req: StreamRequest, result: Result):
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
        state = gen.new_state()
        # The ledger's rows are the Requests.
        ledger = SlotLedger(gen.batch_size, spec.kv_pages, gen.stop_set,
                            lambda req: gen.pages_needed(len(req.prompt), req.max_new_tokens), lambda req: req.prompt,
                            PrefixPool(spec.kv_pages, spec.page_size) if gen.prefix_cache else None)
        last_emit = np.zeros(gen.batch_size)  # when each slot's row last emitted tokens
        to_end = np.zeros(gen.batch_size, bool)  # slots whose rows the host ended: the device ends them next
        pending = None  # (figures of the call in flight, the occupants it ran with, when it was issued)

        def end(s: int, result: Result):
            req = ledger.finish(s)
            to_end[s] = True
            with m.lock:  # before the request hears; its pages with it (a scrape that sees the row gone
                m.running = ledger.busy  # sees its pages back, not the figures of the loop's last turn)
                m.kv_pages = pool_pages(ledger.pool)
                m.cycles += len(result.acceptance_lengths)
                m.accepted += sum(result.acceptance_lengths)
                for a in result.acceptance_lengths:
                    m.acceptance.observe(a)
            self._ended(req, result)

        while True:
            idle = not ledger.busy and pending is None and not ledger.waiting
            if idle and self._closing.is_set() and self._inbox.empty():
                return
            self._take(ledger.waiting, block=idle)
            self._cancel_rows(ledger, end)
            if to_end.any():
                # A copy: jax may read a host array after the call returns (on a CPU it can use the
                # array's own memory, read when the call runs behind the one in flight), so clearing
                # to_end at once lost cancels: the rows ran on, writing pages handed to new rows.
                state = cancel(spec, state, to_end.copy())
                to_end[:] = False
            state, admitted = self._admit(state, ledger)
            issued = None
            if ledger.running:
                state, call = gen.launch(state, ledger.width, until_free=bool(ledger.waiting), stream=True,
                                         timed=not admitted)
                issued = (call, list(ledger.occupant))
            if pending is not None:
                self._deliver(pending, ledger, last_emit, end)
            pending = issued
            with m.lock:
                m.running, m.waiting = ledger.busy, self._queued_now()
                m.kv_pages = pool_pages(ledger.pool)

    def _cancel_rows(self, ledger: SlotLedger, end):
        """Requests cancelled while they waited end here; those decoding or being filled end as a
        running row does (`end`: slot, pages and, at the device, the row)."""
        cancel_all = self._cancel_all
        for req in [r for r in ledger.waiting if r.cancelled or cancel_all]:
            ledger.waiting.remove(req)
            self._admitted(1)
            self._ended(req, Result(req.row_id, [], [], _cancel_reason(req)))
        for s, req in enumerate(ledger.occupant):
            if req is not None and (req.cancelled or cancel_all):
                end(s, Result(req.row_id, [], [], _cancel_reason(req)))
        for s, (req, _) in list(ledger.filling.items()):
            if req.cancelled or cancel_all:
                end(s, Result(req.row_id, [], [], _cancel_reason(req)))

    def _admit(self, state, ledger: SlotLedger):
        """Admission: the free slots take the first requests, in arrival order (one that waits
        for pages is not overtaken); a long prompt goes in piece by piece, one piece of each per
        round of cycles (the running rows wait for a piece, not for a whole prompt), and its last
        piece makes it a running row. Returns (state, whether any prefill was queued)."""
        gen = self.gen
        piece = gen.spec.prefill_chunk if self.interleaves else None
        queued = len(ledger.waiting)
        slots, new = ledger.admit_waiting(lambda req, start: piece is not None and len(req.prompt) - start > piece)
        self._admitted(queued - len(ledger.waiting))
        admitted = bool(new or ledger.filling)
        for s, entry in list(ledger.filling.items()):
            req, done_tokens = entry
            state = self._piece(state, s, req, done_tokens, ledger.pages[s], ledger.start[s])
            entry[1] += piece
            if entry[1] >= len(req.prompt):
                ledger.filled(s)
                ledger.register([s])
                self._count_prompts([req], [ledger.start[s]])
        if new:
            state = gen.admit(state, slots, [r.prompt for r in new], [r.row_id for r in new],
                              [r.max_new_tokens for r in new], 0, ledger.tables(slots), [r.sampling for r in new],
                              ledger.starts(slots))
            ledger.register(slots)
            self._count_prompts(new, ledger.starts(slots))
        return state, admitted

    def _count_prompts(self, reqs, starts):
        """Prompts now in: their tokens, and those of them the prefix cache served."""
        with self.metrics.lock:
            self.metrics.prompt_tokens += sum(len(r.prompt) for r in reqs)
            self.metrics.cached_prompt_tokens += sum(starts)

    @property
    def interleaves(self) -> bool:
        """Whether prompts longer than the BatchEngine's prefill_chunk go in piece by piece between
        cycles. Not for a hybrid target decoded plainly: its recurrent layers advance every row a
        cycle passes over, and the state of a row being filled must wait for its next piece."""
        spec = self.gen.spec
        return self.gen.max_prompt_len > spec.prefill_chunk and not (spec.target.num_linear_layers
                                                                      and not spec.uses_drafter)

    def _piece(self, state, slot: int, req: StreamRequest, offset: int, pages, start: int = 0):
        """The piece of req's prompt from offset into slot: `prefill_part`, or for the last piece
        `prefill(resume=True)`, which samples the row's first token and starts it. start: the
        prompt positions its cached pages hold (prefix caching), where its first piece begins."""
        gen, spec = self.gen, self.gen.spec
        piece = spec.prefill_chunk
        part = req.prompt[offset:offset + piece]
        if offset + piece >= len(req.prompt):  # the last piece: the prefill call `admit` makes, resumed
            return gen.prefill_rows(state, 1, piece, [(part, slot, req.row_id, req.max_new_tokens, req.sampling, 0)],
                                    resume=True)
        put = lambda x: put_batch(np.asarray(x), gen.mesh)
        tokens = np.zeros((1, piece), np.int32)
        tokens[0, :len(part)] = part
        table = put(page_table([pages], 1, state.target_cache.pages.shape[1])) if spec.kv_pages else None
        return prefill_part(gen.tparams, gen.dparams, spec, state, put(tokens), put(np.int32([len(part)])),
                            put(np.int32([slot])), table, begin=offset == start,
                            starts=put(np.int32([start])) if gen.prefix_cache and offset == start else None)

    def _queued_now(self) -> int:
        with self._lock:
            return self._queued

    def _admitted(self, n: int):
        with self._lock:
            self._queued -= n

    def _deliver(self, pending, ledger: SlotLedger, last_emit, end):
        """Read a call's figures (waiting for it) and hand each row still served by the request
        it ran for its new tokens; rows that ended end their requests."""
        gen, m, sent = self.gen, self.metrics, ledger.counted
        call, owners = pending
        progress, _, (output, acceptance, num_cycles) = gen.land(call)
        now = time.perf_counter()
        done, num_generated = progress[0].astype(bool), progress[1]
        logprobs = None  # the rows' logprob arrays, read only where a row asked for them
        if any(req is not None and req.sampling.logprobs is not None for req in owners):
            logprobs = gen.read(call.figures[3], "reading the rows' logprobs")
        busy = 0
        for s, req in enumerate(owners):
            if req is None or req.finished or ledger.occupant[s] is not req:
                continue
            busy += 1
            upto = int(min(num_generated[s], req.max_new_tokens))
            tokens, stopped = ledger.cut(output[s, sent[s]:upto].tolist())
            asked = None if req.sampling.logprobs is None else (req.sampling.logprobs, *(a[s] for a in logprobs))
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
                if asked is None:
                    req.emit(tokens, None)
                else:
                    req.emit(tokens, None, token_logprobs(*asked, sent[s] - len(tokens), sent[s]))
            if stopped or done[s] or sent[s] >= req.max_new_tokens:
                end(s, ledger.result(req.row_id, output[s], sent[s], acceptance[s], num_cycles[s], asked))
        with m.lock:
            m.slot_syncs += len(owners)
            m.busy_slot_syncs += busy
            if busy:
                m.busy_seconds += now - max(call.issued, self._last_read)
            m.speculation = gen.policy.share()
        self._last_read = now
