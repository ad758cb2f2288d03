"""The device side of speculative decoding with a DFlash drafter: pure, jit-compiled
functions over a fixed set of batch slots.

  `init_state`  an empty DecodeState of `batch` slots (every slot free, caches allocated once)
  `prefill`     admit prompts into free slots: the target runs them (written straight into
                those slots' cache rows), the first token is sampled, the drafter's context is
                filled with the prompts' taps, and the slot's row state is reset (`insert`)
  `cycle`       draft -> verify -> accept (the spec's cycle kind: `dflash_jax.engine.cycles`) -> commit,
                for every slot at once
  `run_cycles`  a `lax.while_loop` of up to n cycles, until every row is done (or, when the
                host has prompts waiting, until some row finishes and frees its slot)
  `narrow_state` the live rows of a state as a narrower state (the scheduler's batch tail)

Every row accepts its own number of tokens per cycle: the target cache rolls back by setting
each row's length, the drafter's context cache grows by each row's accepted positions. Done
rows and free slots ride along as no-ops. `block_size == 1` is plain autoregressive decoding
of the target through the same code (the baseline). Caches are updated in place: the state
is donated to `prefill` and `run_cycles`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from dflash_jax.kv import PAGE_SIZE
from dflash_jax.config import ModelConfig, jnp_dtype
from dflash_jax.drafter import DrafterConfig, extend_context
from dflash_jax.engine.cycles import CycleKind, Selector, cycle_kind
from dflash_jax.engine.cycles.base import pick
from dflash_jax.engine.cycles.selector import selector_scores as _selector_scores  # noqa: F401 (tests reach it here)
from dflash_jax.engine import constraints
from dflash_jax.engine.constraints import NONE, ConstraintPool
from dflash_jax.engine.sampling import RowSampling, Sampling, token_logprobs
from dflash_jax.errors import DFlashError
from dflash_jax.kv import KVCache, init_cache, init_context_cache
from dflash_jax.model import ForwardOutput, forward, settle
from dflash_jax.platform import decode_jit
from dflash_jax.sharding import constrain, sharding_of, tracing_on

# --------------------------------------------------------------------------- spec and state


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything static about a compiled engine."""

    target: ModelConfig
    drafter: DrafterConfig | None
    block_size: int
    sampling: Sampling
    max_new_tokens: int  # the longest row; sizes `output` and `acceptance` (rows may ask for fewer)
    cache_len: int  # target and context caches: prompt cap + max_new + 2 * block (rounded up to pages)
    mesh: Mesh | None = None  # batch over `data`, heads/MLP/vocab over `model` (dflash_jax.sharding)
    draft_tokens: int | None = None  # drafts sent to the verify per cycle, K <= B - 1 (None: B - 1; 0: none,
    # the target decodes plainly and the drafter's context still grows: auto speculation's plain cycle)
    page_size: int = PAGE_SIZE  # cache positions per page: attention walks the pages rows have used
    prefill_chunk: int = 512  # prompts longer than this prefill in chunks of it, one after another
    kv_pages: int | None = None  # a page pool of this many pages shared by the rows (None: cache_len per slot)
    tree_budget: int = 0  # draft-tree nodes verified per cycle (`dflash_jax.engine.tree`); 0: the chain
    acceptance: str = "rejection"  # how sampled rows of a DFlash2 drafter accept drafts (`ACCEPTANCE_RULES`)
    # Auto speculation's plain cycles (draft_tokens 0) keep the taps of what they commit in
    # `DecodeState.taps` and the drafter's context takes them B at a time (`flush_taps`), not every
    # cycle: a plain cycle then costs what plain decoding costs, near enough.
    lazy_context: bool = False
    draft_window: int | None = None  # a block sees its row's last N committed positions, kept in a ring (None: all)
    # Rows' constraints (`dflash_jax.engine.constraints`): a pool region per slot of this many automaton
    # states and transition exceptions (0: no constraints, nothing compiled for them).
    constraint_states: int = 0
    constraint_edges: int = 0
    # Rows' logprobs (`Sampling.logprobs`): the most top alternatives a row may ask for per token, stored in
    # `DecodeState.token_logprobs`, `top_ids`, `top_logprobs` (0: no logprobs, nothing computed or stored).
    max_logprobs: int = 0

    # The kind of cycle these settings make (`dflash_jax.engine.cycles.cycle_kind`, where every rule
    # of draft_tokens, tree_budget and acceptance lives): derived, so not compared (the settings are).
    kind: CycleKind = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "kind", cycle_kind(
            self.target, self.drafter, self.block_size, draft_tokens=self.draft_tokens, tree_budget=self.tree_budget,
            acceptance=self.acceptance, greedy=self.sampling.greedy, constrained=self.constraint_states > 0))
        if self.draft_window is not None and self.draft_window < 1:
            raise DFlashError(f"--draft-window must be >= 1, got {self.draft_window}")
        if not 0 <= self.max_logprobs <= self.target.vocab_size:
            raise DFlashError(f"max_logprobs must be in 0..{self.target.vocab_size} (the vocabulary), "
                              f"got {self.max_logprobs}")

    @property
    def num_drafts(self) -> int:
        """K: the drafter denoises a whole block of B, the target verifies [anchor, d_1..d_K]
        (a tree: [root, its tree_budget nodes])."""
        return self.kind.num_drafts

    @property
    def verify_len(self) -> int:
        """Tokens of the verify pass, K + 1 (1: plain decoding); the longest acceptance."""
        return self.num_drafts + 1

    @property
    def taps(self) -> tuple[int, ...]:
        return self.drafter.target_layer_ids if self.drafter is not None and self.block_size > 1 else ()

    @property
    def out_len(self) -> int:
        return self.max_new_tokens + self.block_size

    @property
    def uses_drafter(self) -> bool:
        return self.block_size > 1

    @property
    def selector(self) -> bool:
        """A DFlash2 drafter drafts: its candidate selector walks the block (`dflash_jax.dflash2`)."""
        return self.uses_drafter and self.drafter.dflash2 is not None

    @property
    def rejection(self) -> bool:
        """Sampled rows draw their drafts from the selector and accept them by rejection sampling
        against its realised proposal (`rejection_accept`); else every draft is the argmax walk and
        rows accept by sample-and-match."""
        return isinstance(self.kind, Selector) and self.kind.rule == "rejection"

    def with_drafts(self, k: int) -> "EngineSpec":
        """The same engine verifying k drafts a cycle (0: plain decoding, the drafter's context kept), or
        its tree (k == tree_budget): the programs `--speculation auto` switches between, on one state."""
        if k == self.num_drafts:
            return self
        if self.tree_budget and k:
            raise DFlashError(f"a tree engine verifies its tree ({self.tree_budget} nodes) or nothing, not {k} drafts")
        return dataclasses.replace(self, draft_tokens=k, tree_budget=0)


@struct.dataclass
class DecodeState:
    """Per-slot decoding state; every array has the batch (slots) as its first axis.

    anchor:         [batch] the next token: known, committed, not yet run by the target.
    output:         [batch, max_new + block] generated tokens (anchors included).
    num_generated:  [batch] valid entries of `output`.
    acceptance:     [batch, max_new + 1] acceptance length (num_accepted + 1) of each cycle; 0 for a
                    plain cycle of auto speculation (no draft verified: one token).
    done:           [batch] the row needs no more cycles (also true for a free slot).
    max_new_tokens: [batch] this row's own limit (<= the spec's).
    sampling:       each row's `RowSampling` (temperature, top-k, top-p, its random key, logit bias,
                    constraint, logprobs): what the one logits processor (`pick`) reads.
    fsm:            [batch] each row's constraint automaton state after its committed tokens, the
                    anchor included (`constraints.NONE`: no constraint).
    constraints:    the pool of the rows' automata (`ConstraintPool`; None: spec.constraint_states 0):
                    one region per slot, shared by the rows, not split by row.
    taps, num_taps: with spec.lazy_context, [batch, B, n_taps * hidden] the tap features of positions
                    committed by plain cycles and not yet in the drafter's context, and how many
                    ([batch]; the context's length + num_taps is the target's); else [batch, 0, 0].
    filling:        [batch] the slot's prompt is being prefilled piece by piece (`prefill_part`):
                    done (cycles pass over it), but cycles keep its caches and pages.
    token_logprobs: [batch, max_new + block] float32, each output token's logprob under the target's raw
                    distribution (`sampling.token_logprobs`), at `output`'s offsets; written for rows
                    that asked (`RowSampling.logprobs` >= 0). [batch, 0] with spec.max_logprobs 0.
    top_ids, top_logprobs: [batch, max_new + block, spec.max_logprobs] int32 / float32, the most likely
                    tokens at each output position and their logprobs ([batch, 0, 0] with none).
    """

    target_cache: KVCache
    context_cache: KVCache | None
    anchor: jax.Array
    output: jax.Array
    num_generated: jax.Array
    acceptance: jax.Array
    num_cycles: jax.Array
    done: jax.Array
    stopped: jax.Array
    max_new_tokens: jax.Array
    sampling: RowSampling
    fsm: jax.Array
    constraints: ConstraintPool | None
    taps: jax.Array
    num_taps: jax.Array
    filling: jax.Array
    token_logprobs: jax.Array
    top_ids: jax.Array
    top_logprobs: jax.Array


def map_state(state: DecodeState, f) -> DecodeState:
    """f(array, logical axes) over every array of a DecodeState: rows over `batch`, cache
    heads over `kv_heads` (dflash_jax.sharding's rules)."""
    caches = {name: None if cache is None else cache.map_arrays(f)
              for name, cache in (("target_cache", state.target_cache), ("context_cache", state.context_cache))}
    rows = lambda x: f(x, ("batch",) + (None,) * (x.ndim - 1))
    others = {fl.name: jax.tree.map(rows, getattr(state, fl.name))
              for fl in dataclasses.fields(state) if fl.name not in caches and fl.name != "constraints"}
    whole = jax.tree.map(lambda x: f(x, (None,) * x.ndim), state.constraints)  # the rows share it
    return state.replace(**caches, **others, constraints=whole)


def constrain_state(state: DecodeState, mesh) -> DecodeState:
    """Pin the layout of the loop state: rows over `data`, cache heads over `model`."""
    if mesh is None:
        return state
    return map_state(state, lambda x, axes: constrain(x, mesh, axes))


def decode_state_shardings(state: DecodeState, mesh: Mesh) -> DecodeState:
    """The NamedSharding of each array of a (possibly abstract) DecodeState on `mesh`, as
    `constrain_state` lays it out."""
    return map_state(state, lambda x, axes: sharding_of(mesh, axes, x.shape))


def _hits_stop(tokens, stop_ids):
    """tokens [batch, T], stop_ids [K] (-1 padded) -> [batch, T] bool."""
    return (tokens[..., None] == stop_ids[None, None, :]).any(-1) & (stop_ids >= 0).any()


@functools.partial(jax.jit, static_argnames=("spec", "batch"))
def init_state(spec: EngineSpec, batch: int) -> DecodeState:
    """`batch` free slots: every row done, caches empty (allocated once, reused by every row)."""
    zeros = lambda *shape: jnp.zeros(shape, jnp.int32)
    chunk = max(spec.prefill_chunk, spec.verify_len)  # the most positions one call writes
    return constrain_state(DecodeState(
        target_cache=init_cache(spec.target, batch, spec.cache_len, page_size=spec.page_size,
                                num_pages=spec.kv_pages, ring_chunk=chunk),
        context_cache=(init_context_cache(spec.drafter, batch, spec.cache_len, page_size=spec.page_size,
                                          num_pages=spec.kv_pages, window=spec.draft_window, ring_chunk=chunk)
                       if spec.uses_drafter else None),
        anchor=zeros(batch), output=zeros(batch, spec.out_len), num_generated=zeros(batch),
        acceptance=zeros(batch, spec.max_new_tokens + 1), num_cycles=zeros(batch),
        done=jnp.ones((batch,), bool), stopped=jnp.zeros((batch,), bool),
        max_new_tokens=zeros(batch), sampling=RowSampling.idle(batch), fsm=jnp.full((batch,), NONE, jnp.int32),
        constraints=(ConstraintPool.empty(batch, spec.constraint_states, spec.constraint_edges, spec.target.vocab_size)
                     if spec.constraint_states else None),
        taps=jnp.zeros((batch, *_taps_shape(spec)), jnp_dtype(spec.target.dtype)), num_taps=zeros(batch),
        filling=jnp.zeros((batch,), bool), **_logprob_arrays(spec, batch),
    ), spec.mesh)


def _logprob_arrays(spec: EngineSpec, batch: int) -> dict:
    """`DecodeState`'s empty logprob arrays: an output's length of them, none without spec.max_logprobs."""
    n = spec.max_logprobs
    length = spec.out_len if n else 0
    return dict(token_logprobs=jnp.zeros((batch, length), jnp.float32),
                top_ids=jnp.zeros((batch, length, n), jnp.int32),
                top_logprobs=jnp.zeros((batch, length, n), jnp.float32))


def _taps_shape(spec: EngineSpec) -> tuple[int, int]:
    """Positions and width of `DecodeState.taps` (none without spec.lazy_context)."""
    if not (spec.lazy_context and spec.uses_drafter):
        return (0, 0)
    return (spec.block_size, len(spec.taps) * spec.target.hidden_size)


@functools.partial(jax.jit, static_argnames=("spec",))
def narrow_state(spec: EngineSpec, state: DecodeState, keep) -> DecodeState:
    """The rows in slots keep [m] of a state, as a state of m slots (slot i holds row keep[i]):
    every per-row array is gathered, a page pool's pages stay where they are (the rows' page
    tables come along). Decoding goes on from it exactly as it would have in the wide state,
    since rows never read each other; a narrower loop computes fewer rows."""
    def take(x, axes):
        return jnp.take(x, keep, axis=axes.index("batch")) if "batch" in axes else x

    return constrain_state(map_state(state, take), spec.mesh)


# --------------------------------------------------------------------------- admission


def insert(spec: EngineSpec, state: DecodeState, slots, anchor, stopped, max_new_tokens,
           rows: RowSampling, logprobs=None) -> DecodeState:
    """Start new rows in `slots` [n] (out of range: padding, dropped): the first token is the
    anchor, nothing else is generated yet, rows [n] their sampling (keys drawn). logprobs: the
    anchor's (own [n], top ids and logprobs [n, spec.max_logprobs]; `sampling.token_logprobs`),
    None without spec.max_logprobs. Caches are the caller's (prefill writes them)."""
    n = slots.shape[0]
    put = lambda arr, values: arr.at[slots].set(values, mode="drop")
    fsm = constraints.advance(state.constraints, rows.constraint, anchor)  # the anchor was drawn under its mask
    if logprobs is not None:
        own, ids, top = logprobs
        first = lambda arr, x: put(arr, jnp.zeros((n, *arr.shape[1:]), arr.dtype).at[:, 0].set(x))
        state = state.replace(token_logprobs=first(state.token_logprobs, own), top_ids=first(state.top_ids, ids),
                              top_logprobs=first(state.top_logprobs, top))
    return state.replace(sampling=jax.tree.map(put, state.sampling, rows), fsm=put(state.fsm, fsm),
        anchor=put(state.anchor, anchor),
        output=put(state.output, jnp.zeros((n, spec.out_len), jnp.int32).at[:, 0].set(anchor)),
        num_generated=put(state.num_generated, jnp.ones((n,), jnp.int32)),
        acceptance=put(state.acceptance, jnp.zeros((n, spec.max_new_tokens + 1), jnp.int32)),
        num_cycles=put(state.num_cycles, jnp.zeros((n,), jnp.int32)),
        done=put(state.done, stopped), stopped=put(state.stopped, stopped),
        max_new_tokens=put(state.max_new_tokens, max_new_tokens),
        filling=put(state.filling, jnp.zeros((n,), bool)), num_taps=put(state.num_taps, jnp.zeros((n,), jnp.int32)),
    )


def traced_on_mesh(fn):
    """Trace an engine entry point under its spec's mesh (`jax.sharding.use_abstract_mesh`), so
    that layers which split work by hand over the mesh (the MoE block's expert parallelism)
    see it; without a mesh, nothing changes. `spec` is the third argument."""
    @functools.wraps(fn)
    def wrapped(tparams, dparams, spec, *args, **kwargs):
        with tracing_on(spec.mesh):
            return fn(tparams, dparams, spec, *args, **kwargs)

    return wrapped


def _prompt_chunks(tparams, dparams, spec: EngineSpec, target_cache, context_cache, tokens, prompt_lens, slots):
    """Run prompts [n, bucket] (prompt_lens real tokens) into the rows `slots` of the caches, after
    what those rows hold, in chunks of spec.prefill_chunk (a scan), each attending over the pages
    the chunks before it wrote, so no score matrix is wider than a page nor taller than a chunk.
    Returns the caches and the logits [n, vocab] of each prompt's last token."""
    n, bucket_len = tokens.shape
    chunk = min(bucket_len, spec.prefill_chunk)
    last = prompt_lens - 1  # the position whose logits give the first new token

    def run_chunk(carry, c):
        target_cache, context_cache, last_logits = carry
        lo = c * chunk
        num_tokens = jnp.clip(prompt_lens - lo, 0, chunk)
        out = forward(tparams, spec.target, jax.lax.dynamic_slice_in_dim(tokens, lo, chunk, axis=1), target_cache,
                      rows=slots, num_tokens=num_tokens, taps=spec.taps,
                      logits_indices=jnp.clip(last - lo, 0, chunk - 1)[:, None])
        mine = (last >= lo) & (last < lo + chunk)
        last_logits = jnp.where(mine[:, None], out.logits[:, 0], last_logits)
        if spec.uses_drafter:
            context_cache = extend_context(dparams, spec.drafter, out.tap_features, context_cache, num_tokens,
                                           rows=slots)
        return (out.cache, context_cache, last_logits), None

    carry = (target_cache, context_cache, jnp.zeros((n, spec.target.vocab_size), jnp.float32))
    return jax.lax.scan(run_chunk, carry, jnp.arange(bucket_len // chunk))[0]


def _fresh_rows(cache, slots, pages, starts=None):
    """The rows `slots` of a cache emptied for new prompts (and given their page tables); with
    starts [n], a row holds its first starts positions already (its prompt's cached pages, the
    first of its table: prefix caching), so its prompt goes in from there."""
    cache = cache.reset_rows(slots)
    if starts is not None:
        cache = cache.replace(lengths=cache.lengths.at[slots].set(starts, mode="drop"))
    return cache if pages is None or cache.pages is None else cache.assign_pages(slots, pages)  # a ring: no pages


@functools.partial(jax.jit, static_argnames=("spec", "begin"), donate_argnames=("state",))
@traced_on_mesh
def prefill_part(tparams, dparams, spec: EngineSpec, state: DecodeState, tokens, num_tokens, slots, pages=None,
                 begin=False, starts=None) -> DecodeState:
    """One piece of long prompts, so that their prefill interleaves with the other rows' cycles:
    tokens [n, piece] (num_tokens [n] real) run into the rows `slots` [n] after what they hold.
    begin: the prompts' first piece (the rows are emptied and given their page tables, pages; with
    starts, the positions their cached pages hold, from which the piece goes in).
    The rows stay done, so cycles pass over them, and filling, so cycles keep their caches; their
    last piece goes through `prefill(..., resume=True)`, which samples their first token."""
    target_cache, context_cache = state.target_cache, state.context_cache
    if begin:
        target_cache = _fresh_rows(target_cache, slots, pages, starts)
        context_cache = _fresh_rows(context_cache, slots, pages, starts) if spec.uses_drafter else None
    target_cache, context_cache, _ = _prompt_chunks(tparams, dparams, spec, target_cache, context_cache, tokens,
                                                    num_tokens, slots)
    done = state.done.at[slots].set(True, mode="drop")
    filling = state.filling.at[slots].set(True, mode="drop")
    return constrain_state(state.replace(target_cache=target_cache, context_cache=context_cache, done=done,
                                         filling=filling), spec.mesh)


@functools.partial(jax.jit, static_argnames=("spec", "resume"), donate_argnames=("state",))
@traced_on_mesh
def prefill(tparams, dparams, spec: EngineSpec, state: DecodeState, tokens, prompt_lens, slots, row_ids, seed,
            max_new_tokens, stop_ids, rows: RowSampling, pages=None, resume=False, starts=None) -> DecodeState:
    """Admit prompts [n, bucket] (right-padded; prompt_lens real tokens) into `slots` [n] of the
    state (a slot of `batch` or more is padding). The target runs the prompts straight into
    those slots' cache rows, the first token is sampled, the drafter's context gets the prompts'
    taps. row_ids [n] uint32 key each row's random stream (fold_in(PRNGKey(seed), row_id));
    max_new_tokens [n] are the rows' own limits. Prompt buckets longer than spec.prefill_chunk
    run in chunks (a scan), each over the pages the chunks before it wrote, so no score matrix
    is wider than a page nor taller than a chunk. rows: the rows' `RowSampling` [n] (`rows_of`; its
    keys are drawn here). With a page pool, pages [n, pages per row] are the rows' page tables (the
    pages the host gave them; spec.kv_pages: none). resume: the rows hold the first pieces of their prompts (`prefill_part`) and
    these tokens are the rest. starts [n] (prefix caching): each row's first starts positions are
    its cached prompt pages (the first of its page table, both caches), and tokens are the rest of
    its prompt. One compilation per (n, bucket)."""
    rows = rows.replace(key=jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(seed), row_ids))

    target_cache, context_cache = state.target_cache, state.context_cache
    if not resume:
        target_cache = _fresh_rows(target_cache, slots, pages, starts)
        context_cache = _fresh_rows(context_cache, slots, pages, starts) if spec.uses_drafter else None
    before = target_cache.lengths.at[slots].get(mode="fill", fill_value=0)  # prompt tokens already in
    target_cache, context_cache, logits = _prompt_chunks(tparams, dparams, spec, target_cache, context_cache, tokens,
                                                         prompt_lens, slots)
    allowed = constraints.allowed(state.constraints, rows.constraint[:, None], spec.target.vocab_size)
    first = pick(spec, logits[:, None], rows, (before + prompt_lens)[:, None], allowed)[:, 0]
    stopped = _hits_stop(first[:, None], stop_ids)[:, 0]
    logprobs = None
    if spec.max_logprobs:  # the first token's, from prefill's own logits
        own, ids, top = token_logprobs(logits[:, None], first[:, None], rows, spec.max_logprobs)
        logprobs = (own[:, 0], ids[:, 0], top[:, 0])
    state = insert(spec, state.replace(target_cache=target_cache, context_cache=context_cache), slots, first, stopped,
                   max_new_tokens, rows, logprobs)
    # A row whose first token stops it is done before any cycle runs: its pages go back now
    # (a filling row, whose prompt is still going in piece by piece, keeps its own).
    ended = state.done & ~state.filling
    state = state.replace(target_cache=state.target_cache.release_pages(ended),
                          context_cache=(state.context_cache.release_pages(ended)
                                         if spec.uses_drafter else None))
    return constrain_state(state, spec.mesh)


# --------------------------------------------------------------------------- one cycle


def draft(tparams, dparams, spec: EngineSpec, anchor, context_cache):
    """The chain of drafts d_1..d_K [batch, K] the spec's kind verifies for the block [anchor, MASK x
    (B-1)] at each row's context length (`CycleKind.drafts`): a DFlash drafter's, the argmax of the
    target head over the drafter's output; a DFlash2 drafter's, its candidate selector's argmax walk."""
    return spec.kind.drafts(tparams, dparams, spec, anchor, context_cache)


def commit(dparams, spec: EngineSpec, state: DecodeState, target_tokens, num_accepted, verified: ForwardOutput,
           stop_ids) -> DecodeState:
    """Keep the accepted tokens of every active row: the accepted drafts equal
    target_tokens[:, :a] and target_tokens[:, a] is the new anchor, so the output grows by
    target_tokens[:, :a+1]; the target cache keeps positions <= P + a (a length update; the
    linear-attention layers of a hybrid target settle their deferred states at a + 1
    positions), and the taps of those positions, which the verify produced, join the
    drafter's context (as the spec's kind keeps them: `CycleKind.keep_taps`). With
    spec.max_logprobs, the kept tokens' logprobs come from the verify's logits (verified.logits
    [batch, T, vocab], position i giving target_tokens[:, i]; a tree's compacted along its path) and
    are written at the output's offsets."""
    b = target_tokens.shape[1]
    active = ~state.done
    start = state.target_cache.lengths
    n_new = jnp.where(active, num_accepted + 1, 0)
    write = jax.vmap(lambda row, new, off: jax.lax.dynamic_update_slice_in_dim(row, new, off, axis=0))
    output = jnp.where(active[:, None], write(state.output, target_tokens, state.num_generated), state.output)
    logprobs = {}
    if spec.max_logprobs:
        new = token_logprobs(verified.logits, target_tokens, state.sampling, spec.max_logprobs, active)
        for name, values in zip(("token_logprobs", "top_ids", "top_logprobs"), new):
            old = getattr(state, name)
            mask = active.reshape((-1,) + (1,) * (old.ndim - 1))
            logprobs[name] = jnp.where(mask, write(old, values, state.num_generated), old)
    kept = jnp.arange(b)[None, :] <= num_accepted[:, None]
    stopped = active & (_hits_stop(target_tokens, stop_ids) & kept).any(axis=1)
    slot = jnp.arange(state.acceptance.shape[1])[None, :] == state.num_cycles[:, None]
    length = spec.kind.acceptance_length(spec, num_accepted)  # auto's plain cycle: 0 (`Plain`)
    acceptance = jnp.where(slot & active[:, None], length[:, None], state.acceptance)
    num_generated = state.num_generated + n_new
    fsm = state.fsm
    if state.constraints is not None:  # each row's automaton walks its kept tokens, the new anchor last
        walked = constraints.walk(state.constraints, state.fsm, target_tokens)
        fsm = jnp.where(active, jnp.take_along_axis(walked, (num_accepted + 1)[:, None], axis=1)[:, 0], fsm)
    context_cache, taps, num_taps = spec.kind.keep_taps(dparams, spec, state, verified, n_new, active)
    # The reference keeps cycling while generated <= max_new (its `start < max_length`).
    done = state.done | stopped | (num_generated > state.max_new_tokens)
    anchor = jnp.take_along_axis(target_tokens, num_accepted[:, None], axis=1)[:, 0]
    # Rollback is a length update. A finished row's caches are dead (its tokens are in `output`):
    # length 0 keeps it from stretching the other rows' page walks until its slot is refilled.
    # With a page pool a finished row also gives up its page table: the host hands its pages to
    # the next rows, and the row, riding along until then, writes nothing.
    # A filling row (its prompt prefilled piece by piece) keeps its caches: it is done only so that
    # cycles pass over it.
    ended = done & ~state.filling
    num_taps = jnp.where(ended, 0, num_taps)
    lengths = jnp.where(ended, 0, start + n_new)
    if context_cache is not None:
        context_cache = context_cache.replace(lengths=jnp.where(ended, 0, context_cache.lengths))
        context_cache = context_cache.release_pages(ended)
    target_cache = settle(verified.cache, verified.pending, n_new).release_pages(ended)
    return state.replace(
        target_cache=target_cache.replace(lengths=lengths),
        context_cache=context_cache, anchor=jnp.where(active, anchor, state.anchor), output=output,
        num_generated=num_generated, acceptance=acceptance, num_cycles=state.num_cycles + active.astype(jnp.int32),
        done=done, stopped=state.stopped | stopped, taps=taps, num_taps=num_taps, fsm=fsm, **logprobs,
    )


def cycle(tparams, dparams, spec: EngineSpec, state: DecodeState, stop_ids) -> DecodeState:
    """One draft -> verify -> accept -> commit cycle for every row (no-op for done rows), of the
    spec's kind (`dflash_jax.engine.cycles`)."""
    state, target_tokens, num_accepted, verified = spec.kind.draft_verify(tparams, dparams, spec, state)
    return constrain_state(commit(dparams, spec, state, target_tokens, num_accepted, verified, stop_ids), spec.mesh)


def tally_depth(spec: EngineSpec) -> int:
    """Draft positions `run_cycles`' tally counts: the block's, B - 1, whatever K a program verifies (one
    shape for every draft length of an engine; 1 for plain decoding)."""
    return max(1, spec.block_size - 1)


def _tally(spec: EngineSpec, before: DecodeState, after: DecodeState):
    """[2, B-1] int32: per draft position i, the rows of a cycle that reached draft i (verified it, every
    draft before it accepted) and those that accepted it (`dflash_jax.engine.speculation`)."""
    active = ~before.done
    accepted = after.num_generated - before.num_generated - 1  # drafts accepted by each active row
    reach = spec.kind.reach(spec)
    position = jnp.arange(1, tally_depth(spec) + 1)[None, :]
    tried = active[:, None] & (position <= jnp.minimum(accepted + 1, reach)[:, None])
    hit = active[:, None] & (position <= accepted[:, None])
    return jnp.stack([tried.sum(0), hit.sum(0)]).astype(jnp.int32)


@decode_jit(static_argnames=("spec", "stream"), donate_argnames=("state",))
@traced_on_mesh
def run_cycles(tparams, dparams, spec: EngineSpec, state: DecodeState, stop_ids, max_cycles, until_free=False,
               stream=False):
    """Up to max_cycles cycles, on device, stopping early once every row is done, or (until_free,
    when the host has prompts waiting for a slot) once a row that was running finishes.

    Returns (state, (progress, tally)): progress [2, batch] int32 is (done, num_generated), a fresh
    array apart from the state, so the host can read it while the next call, which takes the state
    donated, already runs; tally [3, B-1] int32 is the call's cycles (tally[0, 0]) and, per draft
    position, the rows that reached it and those that accepted it (`_tally`: auto speculation's
    acceptance). stream (static): the figures are (progress, tally, (output, acceptance,
    num_cycles), (token_logprobs, top_ids, top_logprobs)), copies of the rows' tokens so far and
    their logprobs (width 0 without spec.max_logprobs), so that a server streams them at every call
    without waiting on the state."""
    running = ~state.done

    def cond(carry):
        i, s, _ = carry
        freed = (running & s.done).any()
        return (i < max_cycles) & ~s.done.all() & ~(until_free & freed)

    def body(carry):
        i, s, counts = carry
        after = cycle(tparams, dparams, spec, s, stop_ids)
        return i + 1, after, counts + _tally(spec, s, after) if spec.num_drafts else counts  # plain: no drafts

    counts = jnp.zeros((2, tally_depth(spec)), jnp.int32)
    cycles, state, counts = jax.lax.while_loop(cond, body, (jnp.int32(0), state, counts))
    tally = jnp.concatenate([jnp.zeros((1, counts.shape[1]), jnp.int32).at[0, :1].set(cycles), counts])
    progress = jnp.stack([state.done.astype(jnp.int32), state.num_generated])
    if stream:
        logprobs = (state.token_logprobs + 0, state.top_ids + 0, state.top_logprobs + 0)
        return state, (progress, tally, (state.output + 0, state.acceptance + 0, state.num_cycles + 0), logprobs)
    return state, (progress, tally)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def cancel(spec: EngineSpec, state: DecodeState, rows) -> DecodeState:
    """End the rows where rows [batch] is true (a client that went away) as a finished row ends:
    done, caches emptied, a page pool's pages given up (the host hands them on), so their slots
    take new rows. The tokens they made stay in `output`."""
    def end(cache):
        if cache is None:
            return None
        return cache.replace(lengths=jnp.where(rows, 0, cache.lengths)).release_pages(rows)

    return constrain_state(state.replace(target_cache=end(state.target_cache), context_cache=end(state.context_cache),
                                         done=state.done | rows, filling=state.filling & ~rows,
                                         num_taps=jnp.where(rows, 0, state.num_taps)), spec.mesh)
