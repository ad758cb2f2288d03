"""The host side of the engine: a scheduler that keeps every batch slot busy.

`BatchEngine.generate` streams prompts through `batch_size` slots (continuous batching): rows
run together in `run_cycles`; when rows finish, their results are read and the next waiting
prompts are prefilled straight into the freed slots (several at once when several slots free
up), at fixed shapes: one prefill per (prompt bucket, admission width), one cycle loop, all
compiled by `warmup`. The host syncs once per `sync_every` cycles, or as soon as a row frees a
slot while prompts wait, never per token; once nothing waits, the next cycles are queued
before a sync's figures are read, so the device never waits on the host. With `narrow_tail`,
the rows of the batch's tail move to narrower states as they finish. Outputs are cut at the
first stop token and at each row's own `max_new_tokens`.

With `kv_pages` the caches are one pool of pages shared by the slots (`dflash_jax.kv.pool`):
a row is admitted only when the pool has the pages it can ever need (its prompt, its own
max_new_tokens and a verify block, in whole pages), holds exactly those, and gives them back when
it finishes. So the memory goes to the rows' own lengths, not batch x the longest row, and a
batch of many slots fits where per-slot caches would not; a prompt waits while the pool is
short (never a row stalled mid-way: what a row is given covers its whole life). Layers that all
slide keep only their window, in a ring per row (`KVCache.ring`), instead of pages.

Prefix caching (`prefix_cache`, on by default with a pool where the target allows it): a prompt's
full pages, once it is in, stay in the pool under a hash chain of their tokens, and a later prompt
that starts with the same pages holds them (target and drafter context K/V alike) and prefills
only the rest (`dflash_jax.kv.prefix`). The pool, and what it caches, outlive a `generate` call
(while its state does).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from typing import Callable, Iterator, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from dflash_jax.kv import PAGE_SIZE, PrefixPool, page_table, pages_needed, ring_length
from dflash_jax.config import ModelConfig
from dflash_jax.drafter import DrafterConfig, check_pair
from dflash_jax.engine.constraints import EDGES_PER_STATE, ConstraintRegions
from dflash_jax.engine.options import EngineOptions, PairConfigs, resolve
from dflash_jax.engine.sampling import Sampling, rows_of, seed_int32
from dflash_jax.engine.slots import Result, SlotLedger
from dflash_jax.engine.speculation import Speculation, default_candidates
from dflash_jax.engine.step import (DecodeState, EngineSpec, cancel, init_state, narrow_state, prefill, run_cycles,
                                    tally_depth)
from dflash_jax.engine.watchdog import Watchdog
from dflash_jax.errors import DFlashError
from dflash_jax.sharding import put_batch, shard_params, to_host


def prefix_refusal(spec: EngineSpec) -> str | None:
    """Why prefix caching cannot serve this engine, or None: it shares a pool's pages, so it needs
    one, and every cache the rows write must be paged (no per-row ring or recurrent state)."""
    if not spec.kv_pages:
        return "it needs a page pool (--kv-pages)"
    if spec.target.num_linear_layers:
        return "the target's recurrent (delta-net) layers keep a state per row, which cannot be paged and shared"
    if ring_length(spec.target, spec.cache_len, spec.page_size, max(spec.prefill_chunk, spec.verify_len)):
        return "the target's sliding layers keep a ring per row, whose pages are written over"
    if getattr(spec, "draft_window", None) or getattr(spec.drafter, "draft_window", None):
        return "the drafter's context is a ring per row (--draft-window), whose pages are written over"
    return None


def bucket(n: int, minimum: int = 16) -> int:
    """Next power of two >= n (and >= minimum): prompt lengths compile to a few shapes."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


def row_cache_len(max_prompt_len: int, max_new_tokens: int, block_size: int, tree_budget: int = 0) -> int:
    """Positions each row's cache holds (`EngineSpec.cache_len`): the prompt cap (bucketed), max_new_tokens,
    and what the engine reserves for a cycle's writes past them (two blocks, or a tree's nodes)."""
    return bucket(max_prompt_len) + max_new_tokens + max(2 * block_size, tree_budget + 1)


def per_row_pages(batch_size: int, max_prompt_len: int, max_new_tokens: int, block_size: int, tree_budget: int = 0,
                  page_size: int = PAGE_SIZE) -> int:
    """The pages a page pool needs to hold what per-row caches hold: every slot's whole cache
    (`row_cache_len`, in whole pages), so no row ever waits for pages (the same memory)."""
    return batch_size * -(-row_cache_len(max_prompt_len, max_new_tokens, block_size, tree_budget) // page_size)


@dataclasses.dataclass
class Call:
    """A call of decoding cycles in flight: its figures (on the device until read), the draft length
    and width it ran at, when it was queued, and whether its wall time is its own to time."""

    figures: object
    drafts: int
    width: int
    issued: float
    timed: bool


def admission_parts(widths: Sequence[int], chunk: list[int]) -> list[list[int]]:
    """Prompts admitted together, in prefill calls, given the engine's admission widths: one, padded
    to the next width, unless that would more than double it (widths (1, 8) and 3 prompts), then
    one call each."""
    width = next(w for w in widths if w >= len(chunk))
    return [chunk] if width <= 2 * len(chunk) else [[i] for i in chunk]


class BatchEngine:
    """Batch generation with a target and (optionally) a DFlash drafter.

    block_size 1 (or no drafter) is plain autoregressive decoding of the target. Shapes are
    fixed at construction (batch_size slots, max_new_tokens, max_prompt_len, which size the
    caches), so after warm-up nothing recompiles: prefill compiles once per prompt bucket
    and admission width (powers of two up to batch_size), the cycle loop once. Attention
    reads only the pages rows have used, so a large max_prompt_len costs memory, not time.
    draft_tokens K (default B - 1) sends only the first K drafts of each block to the verify:
    the drafter still denoises the whole block, the target runs K + 1 tokens. Worth it where a
    verify token costs compute (CPUs, large batches); on a memory-bound accelerator the full
    block is nearly free. tree_budget N (default 0, the chain) verifies a draft tree of N nodes
    per cycle instead (`dflash_jax.engine.tree`): more tokens accepted per cycle, the same output.
    draft_window N (default None, all) lets each block see only its row's last N committed
    positions, the drafter's context cache a ring of them: its memory and cost stop growing with
    the context, the output is the same.
    acceptance: how a DFlash2 drafter's sampled rows accept drafts (`ACCEPTANCE_RULES`; rejection
    sampling against its selector's proposal, or sample-and-match of its argmax walk). watchdog:
    every wait on the device runs inside its `waiting`, so a stalled device ends the run with a
    one-line error instead of a hang. prefix_cache: True, False, or None (on where it can work:
    `prefix_refusal`); True where it cannot is a one-line error.

    narrow_tail: once no prompt waits and the rows still running fit fewer slots, they move to
    a narrower state (`narrow_state`; widths 2^k and 3 * 2^k below the batch, each divisible by
    the mesh's data axis: 6, 4, 3, 2, 1 for 8), again as more finish, so the batch's tail runs
    a narrower loop; the host then syncs as rows finish. Rows that finish at different cycles
    (DFlash rows accept different numbers of tokens) otherwise leave the last cycles computing
    mostly finished slots. Worth it where a cycle's cost grows with its rows (CPUs; large
    batches anywhere); on a memory-bound accelerator a narrower loop reads the same weights and
    saves little. Each narrower width compiles the loop once more, in `warmup`.
    """

    def __init__(self, target_config: ModelConfig, target_params, drafter_config: DrafterConfig | None = None,
                 drafter_params=None, options: EngineOptions | None = None, *, max_new_tokens: int = 256,
                 max_prompt_len: int = 512, sampling: Sampling | None = None, stop_token_ids: Sequence[int] = (),
                 mesh: Mesh | None = None, watchdog: Watchdog | None = ...,
                 admission_widths: Sequence[int] | None = None, candidates: Sequence[int] | None = None,
                 **settings):
        """options: how it runs (`EngineOptions`; default the commands' defaults), settled for the
        pair by `resolve`; settings: fields of `EngineOptions` over `options` (`batch_size=2`;
        `prefix_cache` may be True/False). The rest is no option: the limits that size the caches
        (max_new_tokens, max_prompt_len), sampling (default greedy), the stop tokens, the device
        mesh, the watchdog (default `options.watchdog()`), admission widths and auto speculation's
        draft lengths (`candidates`)."""
        if drafter_config is not None:
            check_pair(target_config, drafter_config)
        if isinstance(settings.get("prefix_cache"), bool):
            settings["prefix_cache"] = "on" if settings["prefix_cache"] else "off"
        options = dataclasses.replace(options or EngineOptions(), **settings)
        self.options = options = resolve(PairConfigs(target_config, drafter_config), options)
        sampling = Sampling() if sampling is None else sampling
        watchdog = options.watchdog() if watchdog is ... else watchdog
        block_size, batch_size, kv_pages = options.block_size, options.batch_size, options.kv_pages
        page_size, prefill_chunk, draft_tokens = options.page_size, options.prefill_chunk, options.draft_tokens
        tree_budget, draft_window, speculation = options.tree_budget, options.draft_window, options.speculation
        sync_every, narrow_tail = options.sync_every, options.narrow_tail
        prefix_cache = None if options.prefix_cache is None else options.prefix_cache == "on"
        if max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk < 16 or prefill_chunk & (prefill_chunk - 1):
            raise DFlashError(f"--prefill-chunk must be a power of two >= 16, got {prefill_chunk}")
        if kv_pages is not None and mesh is not None and mesh.shape["data"] > 1:
            raise DFlashError(f"a page pool is shared by every row, so it needs a mesh whose data axis is 1 "
                              f"(got data={mesh.shape['data']}); split the model instead, or drop --kv-pages")
        self.max_prompt_len = bucket(max_prompt_len)
        self.spec = EngineSpec(
            target=target_config, drafter=drafter_config if block_size > 1 else None, block_size=block_size,
            sampling=sampling, max_new_tokens=max_new_tokens,
            cache_len=row_cache_len(self.max_prompt_len, max_new_tokens, block_size, tree_budget), mesh=mesh,
            draft_tokens=draft_tokens, page_size=page_size, prefill_chunk=prefill_chunk, kv_pages=kv_pages,
            tree_budget=tree_budget, acceptance=options.acceptance, draft_window=draft_window,
            constraint_states=options.constraint_states,
            constraint_edges=options.constraint_edges or EDGES_PER_STATE * options.constraint_states,
            max_logprobs=options.max_logprobs,
        )
        # Which automaton each region of the constraint pool holds (`dflash_jax.engine.constraints`).
        self.regions = (ConstraintRegions(batch_size, self.spec.constraint_states, self.spec.constraint_edges,
                                          target_config.vocab_size) if self.spec.constraint_states else None)
        # Auto never changes the output. A DFlash2 drafter's rejection acceptance keeps the target's
        # distribution, but which tokens a seed gives depends on K: so with it auto runs fixed.
        self.auto_refusal = ("a DFlash2 drafter's rejection acceptance draws different tokens at each draft length "
                             "(--acceptance match keeps them)") if speculation == "auto" and self.spec.rejection else None
        self.candidates = self._candidates(speculation, candidates)
        if 0 in self.candidates and self.spec.uses_drafter:  # auto's plain cycles keep their taps for later
            self.spec = dataclasses.replace(self.spec, lazy_context=True)
        # The programs a call can run, by draft length: one (`fixed`), or auto speculation's.
        self.specs = {k: self.spec.with_drafts(k) for k in self.candidates}
        self.policy = Speculation(self.candidates, tally_depth(self.spec), tree=bool(self.spec.tree_budget))
        self._last_read = 0.0  # when the host last read a call's figures (a call's wall time starts no earlier)
        refusal = prefix_refusal(self.spec)
        if prefix_cache and refusal:
            raise DFlashError(f"--prefix-cache on: {refusal}")
        self.prefix_cache = prefix_cache is not False and refusal is None
        if mesh is not None and batch_size % mesh.shape["data"]:
            raise DFlashError(f"batch size {batch_size} is not divisible by the mesh's data axis ({mesh.shape['data']})")
        self.mesh, self.watchdog = mesh, watchdog
        self.tparams = shard_params(target_params, mesh)
        self.dparams = shard_params(drafter_params, mesh) if block_size > 1 else None
        self.batch_size, self.sync_every = batch_size, sync_every
        stop = list(dict.fromkeys(int(t) for t in stop_token_ids)) or [-1]
        self.stop_ids = jax.numpy.asarray(stop + [-1] * (-len(stop) % 8), jax.numpy.int32)
        self.stop_set = frozenset(stop) - {-1}
        # Admission widths: prompts admitted together are padded to the next of these (each one
        # prefill program per prompt bucket). admission_widths narrows the set (it keeps 1 and the
        # batch): a server warms up in half the time with (1, batch), at the price of admitting a
        # few prompts one by one (`admission_parts`).
        self.widths = sorted({min(1 << i, batch_size) for i in range(batch_size.bit_length() + 1)})
        if admission_widths is not None:
            self.widths = sorted({1, batch_size} | {int(w) for w in admission_widths if 1 <= w <= batch_size})
        # The batch's tail: the widths it narrows to, widest first: 2^k and 3 * 2^k below the
        # batch (6, 4, 3, 2, 1 for 8), each a whole number of rows per device of the data axis.
        data = mesh.shape["data"] if mesh is not None else 1
        self.tail_widths = sorted({w for k in range(batch_size.bit_length()) for w in (1 << k, 3 << k)
                                   if w < batch_size and w % data == 0}, reverse=True) if narrow_tail else []

    @classmethod
    def of(cls, pair, options: EngineOptions, *, max_new_tokens: int, max_prompt_len: int, sampling=None,
           stop_token_ids=None, watchdog=..., admission_widths=None) -> BatchEngine:
        """A BatchEngine for a loaded pair (`dflash_jax.pair.ModelPair`: configs, params, mesh, stop
        tokens) run with these options. max_new_tokens, max_prompt_len: the command's resolved
        limits. stop_token_ids: default the pair's. watchdog: default `options.watchdog()`."""
        return cls(pair.target, pair.tparams, pair.drafter, pair.dparams, options, max_new_tokens=max_new_tokens,
                   max_prompt_len=max_prompt_len, sampling=sampling,
                   stop_token_ids=pair.stop_tokens if stop_token_ids is None else stop_token_ids, mesh=pair.mesh,
                   watchdog=watchdog, admission_widths=admission_widths)

    def _candidates(self, speculation: str, candidates) -> tuple[int, ...]:
        """The draft lengths calls may run: the spec's own (fixed, or plain decoding), or auto's
        (`candidates`, default `default_candidates`; with draft_tokens or a tree given: 0 and that); the
        spec's own where auto is refused (`auto_refusal`)."""
        spec = self.spec
        if speculation == "fixed" or not spec.uses_drafter or self.auto_refusal:
            return (spec.num_drafts,)
        if candidates is None:
            explicit = spec.draft_tokens is not None or spec.tree_budget
            candidates = (0, spec.num_drafts) if explicit else default_candidates(spec.block_size)
        top = spec.num_drafts
        bad = [k for k in candidates if not 0 <= k <= top or (spec.tree_budget and k not in (0, top))]
        if bad:
            raise DFlashError(f"auto speculation's draft lengths must be in 0..{top} (a tree: 0 or its {top} "
                              f"nodes), got {bad[0]}")
        return tuple(sorted(set(int(k) for k in candidates) | {top}))

    # ------------------------------------------------------------------ checks

    def check_prompt(self, prompt: Sequence[int], max_new: int | None = None) -> str | None:
        """Why this prompt cannot run (with max_new new tokens, default the engine's), or None."""
        n, limit = len(prompt), min(self.max_prompt_len, self.spec.target.max_position_embeddings)
        if n == 0:
            return "empty prompt"
        if n > limit:
            return f"prompt of {n} tokens is longer than the context ({limit} tokens)"
        bad = [t for t in prompt if not 0 <= t < self.spec.target.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary (size {self.spec.target.vocab_size})"
        pool, max_new = self.spec.kv_pages, max_new or self.spec.max_new_tokens
        if pool and self.pages_needed(n, max_new) > pool:
            return (f"needs {self.pages_needed(n, max_new)} pages of {self.spec.page_size} positions ({n} prompt "
                    f"tokens + {max_new} new + {self.spec.num_drafts} drafts); the pool has {pool}: raise kv_pages")
        return None

    def pages_needed(self, prompt_len: int, max_new: int) -> int:
        """Pages a row of this prompt length and max_new holds in the pool (`kv.pool.pages_needed`)."""
        spec = self.spec
        return pages_needed(prompt_len, max_new, drafts=spec.num_drafts, cache_len=spec.cache_len,
                            page_size=spec.page_size)

    def _limits(self, max_new_tokens, n: int) -> list[int]:
        top = self.spec.max_new_tokens
        if max_new_tokens is None:
            return [top] * n
        limits = [int(max_new_tokens)] * n if np.ndim(max_new_tokens) == 0 else [int(m) for m in max_new_tokens]
        if len(limits) != n:
            raise DFlashError(f"{len(limits)} max_new_tokens for {n} prompts")
        bad = [m for m in limits if not 1 <= m <= top]
        if bad:
            raise DFlashError(f"a row's max_new_tokens must be in 1..{top} (the run's max_new_tokens), got {bad[0]}")
        return limits

    # ------------------------------------------------------------------ device calls

    def read(self, x, what: str):
        """The arrays of x on the host: the host's only waits on the device, each under the
        watchdog (`what` names it in the stall's error)."""
        with self.watchdog.waiting(what) if self.watchdog else contextlib.nullcontext():
            return jax.tree.map(to_host, x)

    def new_state(self) -> DecodeState:
        """batch_size free slots (an empty constraint pool: the regions' bookkeeping starts over)."""
        if self.regions is not None:
            self.regions = ConstraintRegions(self.batch_size, self.spec.constraint_states, self.spec.constraint_edges,
                                             self.spec.target.vocab_size)
        return init_state(self.spec, self.batch_size)

    @property
    def idle_state(self) -> DecodeState | None:
        """The state the last `generate` left, every slot free (the next call starts from it), or None."""
        return getattr(self, "_idle", None)

    @property
    def prefix_pool(self) -> PrefixPool | None:
        """With prefix caching, the host's index of the pages the idle state's caches hold (what the
        calls so far cached), or None."""
        return getattr(self, "_prefix_pool", None)

    def _take_state(self) -> DecodeState:
        """The state the last `generate` left (every slot free again), or a new one: the caches
        are allocated and zeroed once, not per call (a call whose tail narrowed leaves none).
        With prefix caching, `_prefix_pool` is then the pool whose pages that state's caches
        hold (what the last call cached), or a new one."""
        state, self._idle = getattr(self, "_idle", None), None
        pool = getattr(self, "_prefix_pool", None)
        if state is None or pool is None or not pool.whole():
            pool = PrefixPool(self.spec.kv_pages, self.spec.page_size) if self.prefix_cache else None
        self._prefix_pool = pool
        return self.new_state() if state is None else state

    def _width(self, rows: int) -> int:
        """The admission width `rows` prompts admitted together are padded to."""
        return next(w for w in self.widths if w >= rows)

    def _bucket(self, prompt) -> int:
        return min(bucket(len(prompt)), self.max_prompt_len)

    def admit(self, state: DecodeState, slots: Sequence[int], prompts: Sequence[Sequence[int]],
              row_ids: Sequence[int], max_new: Sequence[int], seed: int = 0,
              pages: Sequence[Sequence[int]] | None = None,
              sampling: Sequence[Sampling] | None = None, starts: Sequence[int] | None = None) -> DecodeState:
        """Prefill prompts into the given free slots of a state (grouped by prompt bucket, each
        group padded to an admission width). With a page pool, pages[i] are the pool pages
        prompt i's row holds (None: no pages, every write dropped: the warm-up's compiles).
        sampling[i]: row i's, in a per-row engine (default: the engine's Sampling for every
        row). starts[i] (prefix caching): prompt i's first starts[i] positions are its first
        pages, cached: only the rest is prefilled (its bucket the rest's). The state is donated."""
        pool = self.spec.kv_pages
        pages_per_row = state.target_cache.pages.shape[1] if pool else 0
        starts = list(starts) if starts is not None else [0] * len(prompts)
        prompts = [p[s:] for p, s in zip(prompts, starts)]
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(self._bucket(p), []).append(i)
        rows = list(sampling) if sampling is not None else [self.spec.sampling] * len(prompts)
        for length, members in sorted(groups.items()):
            for chunk in (part for lo in range(0, len(members), self.batch_size)
                          for part in admission_parts(self.widths, members[lo:lo + self.batch_size])):
                width = self._width(len(chunk))
                table = None
                if pool:  # pages None: every entry NO_PAGE
                    table = put_batch(page_table([pages[i] for i in chunk] if pages is not None else [], width,
                                                 pages_per_row), self.mesh)
                state = self.prefill_rows(state, width, length, [
                    (prompts[i], slots[i], row_ids[i], max_new[i], rows[i], starts[i]) for i in chunk], seed, table)
        return state

    def prefill_rows(self, state: DecodeState, width: int, length: int, rows, seed: int = 0, table=None, *,
                     resume: bool = False) -> DecodeState:
        """One `prefill` call: rows, each (tokens, slot, row id, max_new, Sampling, start), padded to
        `width` rows (padding: no slot) of `length` tokens. table: their page table (None: no
        pool). start: the positions before the tokens, cached (prefix caching). resume: the rows'
        last pieces of prompts whose earlier pieces went in by `prefill_part` (`StreamingEngine`).
        The state is donated. `admit` and the streaming engine's pieces both call it."""
        put = lambda x: put_batch(x, self.mesh)
        tokens = np.zeros((width, length), np.int32)
        lens, limits = np.ones((width,), np.int32), np.ones((width,), np.int32)
        where = np.full((width,), self.batch_size, np.int32)  # padding: no slot
        ids, begin = np.zeros((width,), np.uint32), np.zeros((width,), np.int32)
        for j, (part, slot, row_id, max_new, _, start) in enumerate(rows):
            tokens[j, :len(part)], lens[j], begin[j] = part, len(part), start
            where[j], ids[j], limits[j] = slot, row_id, max_new
        initial = None
        if self.regions is not None:  # each row's automaton into the pool (its slot's region)
            pool = state.constraints
            initial = []
            for row in rows:
                pool, first = self.regions.admit(pool, int(row[1]), row[4].constraint)
                initial.append(first)
            state = state.replace(constraints=pool)
        elif any(row[4].constraint is not None for row in rows):
            raise DFlashError("this engine holds no constraints (its constraint_states is 0)")
        sampling = jax.tree.map(put, rows_of([row[4] for row in rows], width, initial))
        # The calls keep their keywords (a keyword given or not is another jit signature).
        extra = {"resume": True} if resume else {"starts": put(begin) if self.prefix_cache else None}
        return prefill(self.tparams, self.dparams, self.spec, state, put(tokens), put(lens), put(where), put(ids),
                       np.int32(seed_int32(seed)), put(limits), self.stop_ids, sampling, table, **extra)

    def warmup(self, prompt_lengths: Sequence[int] = (1,), *, exact: bool = False, stream: bool = False,
               progress: Callable[[int, int, str], None] | None = None):
        """Compile prefill for the buckets of these lengths at every admission width, and the
        cycle loop. exact: the lengths are the very prompts of the next `generate` (one entry
        per prompt), so a bucket with m prompts compiles only the widths up to m's, the most
        it can be admitted at together, and where the slots take every prompt at once only the
        widths of that admission (`_admitted_at_once`). stream: the loop that also returns the
        rows' tokens (`StreamingEngine`), and `cancel`. progress(done, total, label) is called before each
        step and once after the last (`dflash_jax.compiling.CompileProgress.step`)."""
        run_steps(self.warmup_steps(prompt_lengths, exact=exact, stream=stream), progress)

    def warmup_steps(self, prompt_lengths: Sequence[int] = (1,), *, exact: bool = False,
                     stream: bool = False) -> list[tuple[str, Callable[[], None]]]:
        """`warmup`'s steps, (label, run) each, in order."""
        steps = []
        counts = collections.Counter(self._bucket([0] * n) for n in prompt_lengths)
        at_once = exact and self._admitted_at_once(prompt_lengths)
        for length in sorted(counts):
            if at_once:  # the widths the one admission's calls of this bucket use (`admit`)
                widths = sorted({self._width(len(part))
                                 for part in admission_parts(self.widths, list(range(counts[length])))})
            else:
                most = self._width(min(counts[length], self.batch_size))
                widths = [w for w in self.widths if not exact or w <= most]
            for width in widths:
                # The cycle loop is one program whatever was admitted: it runs after the first
                # prefill only (a restart that loads every program from the cache then spends
                # its time on tracing, not on cycles).
                def prefill(length=length, width=width, cycle=not steps and len(self.candidates) == 1):
                    state = self.admit(self.new_state(), range(width), [[0] * length] * width, range(width),
                                       [1] * width)
                    if cycle:
                        self.read(self.run_cycles(state, 1, stream=stream)[1], "running the warm-up's first cycle")
                    else:
                        self.read(state.done, "running the warm-up's prefill")

                steps.append((f"prompts of {length} tokens x {width}", prefill))
        if len(self.candidates) > 1:
            shortest = self._bucket([0] * min(prompt_lengths, default=1))
            steps += [(f"the cycle loop of {k} drafts (compiled, then timed)",
                       functools.partial(self.time_drafts, k, shortest, stream=stream)) for k in self.candidates]
        if stream:
            def cancel_rows():
                state = cancel(self.spec, self.new_state(), np.zeros((self.batch_size,), bool))
                self.read(state.done, "running the warm-up's cancel")

            steps.append(("cancel", cancel_rows))
        if self.tail_widths:
            def narrower_loops():
                state = self.new_state()
                for width in self.tail_widths:
                    state = narrow_state(self.spec, state, np.arange(width, dtype=np.int32))
                    for k in self.candidates:
                        state, info = self.run_cycles(state, 1, drafts=k)
                        self.read(info, "running the warm-up's narrower loops")

            steps.append((f"the tail's loops ({', '.join(map(str, self.tail_widths))} slots)", narrower_loops))
        return steps

    def _admitted_at_once(self, prompt_lengths: Sequence[int]) -> bool:
        """Whether the next `generate` of prompts of these lengths admits them all in its first
        admission: no more than the slots, and the page pool (if any) holds every row at the
        engine's longest max_new_tokens. Then each bucket's rows go in by the calls `admit` makes
        for them together, and an exact warm-up compiles only those widths (the demo: 2 prefill
        programs per engine instead of 7). Cached prefixes could move prompts to shorter buckets:
        not where the prefix pool already holds pages."""
        if len(prompt_lengths) > self.batch_size:
            return False
        if self.idle_state is not None and self.prefix_pool is not None and self.prefix_pool.index:
            return False
        if self.spec.kv_pages:
            need = sum(self.pages_needed(n, self.spec.max_new_tokens) for n in prompt_lengths)
            return need <= self.spec.kv_pages
        return True

    def time_drafts(self, drafts: int, length: int, cycles: int = 4, *, stream: bool = False):
        """Compile the cycle loop of `drafts` drafts and time it on a full batch (every slot a row of a
        `length`-token prompt, admitted one by one: the width-1 prefill of that bucket is compiled;
        stop tokens ignored): the policy's first cost of that draft length at the batch's width.
        Rows that finish early are fewer cycles, not a wrong time (the time is per cycle run)."""
        top, width = self.spec.max_new_tokens, self.batch_size
        no_stop = jax.numpy.full(self.stop_ids.shape, -1, jax.numpy.int32)
        state = self.new_state()
        for n in (1, cycles):  # the first call compiles
            for s in range(width):
                state = self.admit(state, [s], [[0] * length], [s], [top])
            self.read(state.done, "running the warm-up's prefill")
            start = time.perf_counter()
            state, figures = self.run_cycles(state, n, drafts=drafts, stream=stream, stop_ids=no_stop)
            tally = self.read(figures, "timing the warm-up's cycles")[1]
        self.policy.time(drafts, width, int(tally[0, 0]), time.perf_counter() - start)

    def run_cycles(self, state, cycles=None, until_free=False, stream=False, drafts: int | None = None,
                   stop_ids=None):
        """Run `cycles` (default sync_every) decoding cycles of `drafts` drafts (one of `candidates`;
        default the spec's) on the state (donated), or until a row frees its slot with until_free;
        with stream, the figures include the rows' tokens (`step.run_cycles`). Returns (state,
        figures), the figures still on the device."""
        spec = self.specs[self.spec.num_drafts if drafts is None else drafts]
        return run_cycles(self.tparams, self.dparams, spec, state, self.stop_ids if stop_ids is None else stop_ids,
                          np.int32(self.sync_every if cycles is None else cycles), np.bool_(until_free), stream=stream)

    def launch(self, state, width: int, *, until_free=False, stream=False, timed=True) -> tuple[DecodeState, "Call"]:
        """Queue a call of cycles on a state of `width` slots at the draft length the policy picks
        (`Speculation.pick`). timed: the call's wall time is its own (no prefill queued just
        before it). Returns (state, the Call, its figures still on the device)."""
        drafts = self.policy.pick(width)
        state, figures = self.run_cycles(state, until_free=until_free, stream=stream, drafts=drafts)
        return state, Call(figures, drafts, width, time.perf_counter(), timed)

    def land(self, call: "Call"):
        """A call's figures on the host (waiting for it), after the policy has them: its draft
        length's cost (seconds per cycle, when timed) and acceptance. Returns the figures."""
        figures = self.read(call.figures[:3], "running decoding cycles")  # a stream's logprobs: read where asked
        now = time.perf_counter()
        tally = figures[1]
        seconds = now - max(call.issued, self._last_read) if call.timed else None
        self._last_read = now
        self.policy.observe(call.drafts, call.width, int(tally[0, 0]), seconds, tally[1], tally[2])
        return figures

    # ------------------------------------------------------------------ generation

    # ------------------------------------------------------------------ generation

    def _check_rows(self, prompts, indices, max_new_tokens, sampling) -> tuple[list[int], list[int]]:
        """`generate`'s arguments checked: (each row's index, each row's max_new_tokens)."""
        if sampling is not None and not self.spec.sampling.per_row:
            raise DFlashError("sampling per row needs an engine built with Sampling(per_row=True)")
        if sampling is not None and len(sampling) != len(prompts):
            raise DFlashError(f"{len(sampling)} samplings for {len(prompts)} prompts")
        indices = list(range(len(prompts))) if indices is None else [int(i) for i in indices]
        if len(indices) != len(prompts):
            raise DFlashError(f"{len(indices)} indices for {len(prompts)} prompts")
        bad = [i for i in indices if not 0 <= i < 2**32]
        if bad:
            raise DFlashError(f"row index {bad[0]} outside 0..2**32-1 (indices key the random streams)")
        limits = self._limits(max_new_tokens, len(prompts))
        for i, s in zip(indices, sampling or [self.spec.sampling] * len(prompts)):
            why = self.check_logprobs(s.logprobs)
            if why:
                raise DFlashError(f"prompt {i}: {why}")
        for i, p, m in zip(indices, prompts, limits):
            why = self.check_prompt(p, m)
            if why:
                raise DFlashError(f"prompt {i}: {why}")
        return indices, limits

    def check_logprobs(self, logprobs: int | None) -> str | None:
        """Why a row cannot have these logprobs (`Sampling.logprobs`) here, or None: more top alternatives
        than the engine's max_logprobs, or any on an engine without them."""
        top = self.spec.max_logprobs
        if logprobs is None or logprobs <= top and top:
            return None
        if not top:
            return "this engine computes no logprobs (its max_logprobs is 0)"
        return f"logprobs must be at most {top} (the engine's max_logprobs), got {logprobs}"

    def generate(self, prompts: Sequence[Sequence[int]], *, seed: int = 0, indices: Sequence[int] | None = None,
                 max_new_tokens: int | Sequence[int] | None = None, progress=None,
                 sampling: Sequence[Sampling] | None = None) -> Iterator[Result]:
        """Yield a Result per prompt as rows finish. `indices` (default 0..n-1) name the rows
        and key their random streams. `max_new_tokens`: one limit for every row or one per
        row, each at most the engine's (default: the engine's). `progress(n_tokens)` is called
        after each sync with the tokens generated since the last. `sampling`: one per prompt,
        for an engine built with Sampling(per_row=True) (default: its Sampling for every row).
        A row whose Sampling asks for logprobs (an engine with max_logprobs) has them in its Result."""
        indices, limits = self._check_rows(prompts, indices, max_new_tokens, sampling)
        if not prompts:
            return
        # The ledger's rows are the prompts' positions in `prompts`.
        state = self._take_state()
        ledger = SlotLedger(self.batch_size, self.spec.kv_pages, self.stop_set,
                            lambda i: self.pages_needed(len(prompts[i]), limits[i]), lambda i: prompts[i],
                            self._prefix_pool)
        self.ledger = ledger  # the last call's (its cached_tokens / prompt_tokens: the prefix cache's hit rate)
        # Longest first: a long row admitted last would run on alone while the other slots
        # idle; admitting by descending limit (stable: equal limits keep their order) leaves
        # the short rows for the end, where they fill the slots the long ones free.
        ledger.waiting.extend(sorted(range(len(prompts)), key=lambda i: -limits[i]))

        def fill(state):
            """(state, whether prompts were admitted into it)."""
            slots, new = ledger.admit_waiting()
            if not new:
                return state, False
            state = self.admit(state, slots, [prompts[i] for i in new], [indices[i] for i in new],
                               [limits[i] for i in new], seed, ledger.tables(slots),
                               None if sampling is None else [sampling[i] for i in new], ledger.starts(slots))
            ledger.register(slots)
            return state, True

        state, _ = fill(state)
        state, call = self.launch(state, ledger.width, until_free=bool(ledger.waiting), timed=False)
        columns = None  # the slots of a narrowed state in the wider one its pending figures are of
        while True:
            ahead = not ledger.waiting
            if ahead:
                # Nothing to admit: the next cycles are queued before this sync's figures are
                # read. Finished rows are frozen (later cycles skip them), so their tokens are
                # read from the newer state; once all are done the queued call runs no cycle.
                # A tail that narrows syncs as rows finish, so that it narrows without delay.
                state, next_call = self.launch(state, ledger.width, until_free=bool(self.tail_widths))
            info = self.land(call)[0]
            if columns is not None:
                info, columns = info[:, columns], None
            done, num_generated = info[0].astype(bool), info[1]
            if progress is not None:
                progress(ledger.report(num_generated, lambda i: limits[i]))
            yield from self._finish_rows(ledger, state, done, num_generated, indices, limits,
                                         lambda i: (sampling[i] if sampling is not None else self.spec.sampling).logprobs)
            if ahead:
                if not ledger.running:
                    if ledger.width == self.batch_size:
                        self._idle = state  # every slot free: the next call starts from here
                    return
                state, columns = self._narrow_tail(ledger, state, columns)
                call = next_call
                continue
            state, admitted = fill(state)
            state, call = self.launch(state, ledger.width, until_free=bool(ledger.waiting), timed=not admitted)

    def _finish_rows(self, ledger: SlotLedger, state: DecodeState, done, num_generated, indices,
                     limits, logprobs_of) -> Iterator[Result]:
        """The Results of the rows that finished (done), then their slots and pages freed.
        logprobs_of(row): the logprobs it asked for (None: none; read only where some row asked)."""
        finished = np.flatnonzero(done & ledger.occupied())
        if not len(finished):
            return
        output, acceptance, num_cycles = self.read((state.output, state.acceptance, state.num_cycles),
                                                   "reading finished rows")
        asked = [logprobs_of(ledger.occupant[s]) for s in finished]
        arrays = None
        if any(k is not None for k in asked):
            arrays = self.read((state.token_logprobs, state.top_ids, state.top_logprobs), "reading finished rows")
        for s, k in zip(finished, asked):
            i = ledger.occupant[s]
            logprobs = None if k is None else (k, *(a[s] for a in arrays))
            yield ledger.result(indices[i], output[s], min(num_generated[s], limits[i]), acceptance[s], num_cycles[s],
                                logprobs)
        for s in finished:
            ledger.finish(s)

    def _narrow_tail(self, ledger: SlotLedger, state: DecodeState, columns):
        """The tail: while the rows still running fit the next narrower width, move them to a
        state of that many slots (the cycles already queued on this one come along: a row that
        finished in them moves too, and is read from there). The queued cycles' figures are the
        wide state's: `columns` picks the moved slots'. Returns (state, columns)."""
        narrower = [w for w in self.tail_widths if w < ledger.width]
        while narrower and ledger.running <= narrower[0]:
            keep = np.argsort(~ledger.occupied(), kind="stable")[:narrower.pop(0)]  # running slots first
            state = narrow_state(self.spec, state, keep.astype(np.int32))
            columns = keep if columns is None else columns[keep]
            ledger.narrow(keep)
        return state, columns


def run_steps(steps: Sequence[tuple[str, Callable[[], None]]], progress: Callable[[int, int, str], None] | None):
    """Run warm-up steps in order, telling progress(done, total, label) before each and after the last."""
    for i, (label, run) in enumerate(steps):
        if progress is not None:
            progress(i, len(steps), label)
        run()
    if progress is not None:
        progress(len(steps), len(steps), "")

