"""Speculative decoding with a DFlash drafter: prefill, then cycles of
draft -> verify -> accept -> commit (SPEC section 1), for a whole batch at once.

Device side (pure, jit-compiled over static shapes):
  `prefill`     prompts [batch, bucket] -> DecodeState (first token sampled, caches filled)
  `run_cycles`  a `lax.while_loop` of up to n cycles, until every row is done
Every row accepts its own number of tokens per cycle: the target cache rolls back by
setting each row's length, the drafter's context cache grows by each row's accepted
positions. Finished rows ride along as no-ops. `block_size == 1` is plain autoregressive
decoding of the target through the same code (the baseline).

Host side (`Generator`): batches and buckets prompts, syncs once per `sync_every` cycles
(to stream finished rows and drive a progress bar, never per token), and cuts outputs at
the first stop token and at `max_new_tokens`.

Sampling is lossless: drafts are the drafter's argmax (a one-hot proposal), the target
samples y_i at every block position, and a draft is accepted while it equals the target's
sample. The sample for sequence position t always uses the key fold_in(row_key, t), so a
row's output does not depend on the batch it ran in, nor on the block size.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh

from dflash_jax.config import ModelConfig
from dflash_jax.drafter import DrafterConfig, check_pair, draft_hidden, extend_context, init_context_cache
from dflash_jax.errors import DFlashError
from dflash_jax.model import CausalLM, KVCache, forward, init_cache
from dflash_jax.sharding import CACHE_AXES, constrain, put_batch, shard_params, to_host

# --------------------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the target picks tokens. temperature 0 is greedy. Hashable: a static jit arg."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off

    def __post_init__(self):
        if self.temperature < 0:
            raise DFlashError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise DFlashError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise DFlashError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def processed_logits(logits, sampling: Sampling):
    """Temperature, top-k and top-p applied; removed tokens get -inf. [..., vocab] float32."""
    logits = logits.astype(jnp.float32) / sampling.temperature
    neg = jnp.finfo(jnp.float32).min
    if 0 < sampling.top_k < logits.shape[-1]:  # k >= vocab keeps everything, as in HF
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, neg, logits)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        keep_sorted = before < sampling.top_p  # the smallest prefix reaching top_p
        keep = _unsort(keep_sorted, order)
        logits = jnp.where(keep, logits, neg)
    return logits


def _unsort(values, order):
    """Scatter values given in `order` back to vocabulary order (last axis)."""
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(values, inverse, axis=-1)


def greedy_pick(logits):
    """argmax over the last axis (the first index of the maximum, as jnp.argmax and
    torch.argmax), as int32. Written as a max, then a min over the indices that reach it:
    two plain reductions that XLA vectorises, where the index-carrying reduction of
    jnp.argmax ran about 5x slower on CPU (136 us against 28 us for [16, 4096] logits).
    NaN logits pick the last index rather than the first NaN."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    index = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    vocab = logits.shape[-1]
    return jnp.minimum(jnp.min(jnp.where(logits == top, index, vocab), axis=-1), vocab - 1)


def target_distribution(logits, sampling: Sampling):
    """The exact distribution the target samples from, [..., vocab] float32."""
    if sampling.greedy:
        return jax.nn.one_hot(greedy_pick(logits), logits.shape[-1], dtype=jnp.float32)
    return jax.nn.softmax(processed_logits(logits, sampling), axis=-1)


def sample(logits, keys, sampling: Sampling):
    """Tokens [...] from logits [..., vocab] with one key [..., 2] per token."""
    if sampling.greedy:
        return greedy_pick(logits)
    flat_logits = processed_logits(logits.reshape(-1, logits.shape[-1]), sampling)
    flat_keys = keys.reshape(-1, keys.shape[-1])
    tokens = jax.vmap(jax.random.categorical)(flat_keys, flat_logits)
    return tokens.reshape(logits.shape[:-1]).astype(jnp.int32)


def position_keys(row_keys, positions):
    """row_keys [batch, 2] uint32, positions [batch, T] -> keys [batch, T, 2]."""
    return jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.fold_in(k, p))(ps))(row_keys, positions)


# --------------------------------------------------------------------------- state


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything static about a compiled engine."""

    target: ModelConfig
    drafter: DrafterConfig | None
    block_size: int
    sampling: Sampling
    max_new_tokens: int
    cache_len: int  # target and context caches: prompt bucket cap + max_new + 2 * block
    mesh: Mesh | None = None  # batch over `data`, heads/MLP/vocab over `model` (dflash_jax.sharding)
    draft_tokens: int | None = None  # drafts sent to the verify per cycle, K <= B - 1 (None: B - 1)

    def __post_init__(self):
        k, b = self.draft_tokens, self.block_size
        if k is None:
            return
        if b == 1:
            raise DFlashError("draft tokens need a drafter (block size 1 is plain decoding)")
        if not 1 <= k <= b - 1:
            raise DFlashError(f"draft tokens must be in 1..{b - 1} for block size {b}, got {k}")

    @property
    def num_drafts(self) -> int:
        """K: the drafter denoises a whole block of B, the target verifies [anchor, d_1..d_K]."""
        if self.block_size == 1:
            return 0
        return self.block_size - 1 if self.draft_tokens is None else self.draft_tokens

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


@struct.dataclass
class DecodeState:
    """Per-row decoding state; every array has the batch as its first axis.

    anchor:        [batch] the next token: known, committed, not yet run by the target.
    output:        [batch, max_new + block] generated tokens (anchors included).
    num_generated: [batch] valid entries of `output`.
    acceptance:    [batch, max_new + 1] acceptance length (a + 1) of each cycle.
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
    row_keys: jax.Array


TRACE_COUNTS: dict[str, int] = {"prefill": 0, "run_cycles": 0}


def _constrain_cache(cache: KVCache | None, mesh) -> KVCache | None:
    if cache is None or mesh is None:
        return cache
    return KVCache(k=constrain(cache.k, mesh, CACHE_AXES), v=constrain(cache.v, mesh, CACHE_AXES),
                   lengths=constrain(cache.lengths, mesh, ("batch",)))


def constrain_state(state: "DecodeState", mesh) -> "DecodeState":
    """Pin the layout of the loop state: rows over `data`, cache heads over `model`."""
    if mesh is None:
        return state
    rows = lambda x: constrain(x, mesh, ("batch",) + (None,) * (x.ndim - 1))
    return state.replace(
        target_cache=_constrain_cache(state.target_cache, mesh),
        context_cache=_constrain_cache(state.context_cache, mesh),
        anchor=rows(state.anchor), output=rows(state.output), num_generated=rows(state.num_generated),
        acceptance=rows(state.acceptance), num_cycles=rows(state.num_cycles), done=rows(state.done),
        stopped=rows(state.stopped), row_keys=rows(state.row_keys),
    )


def _hits_stop(tokens, stop_ids):
    """tokens [batch, T], stop_ids [K] (-1 padded) -> [batch, T] bool."""
    return (tokens[..., None] == stop_ids[None, None, :]).any(-1) & (stop_ids >= 0).any()


@functools.partial(jax.jit, static_argnames=("spec",))
def prefill(tparams, dparams, spec: EngineSpec, tokens, prompt_lens, active, row_keys, stop_ids) -> DecodeState:
    """Run the prompts [batch, bucket] (right-padded; prompt_lens real tokens) through the
    target, sample the first token, fill the drafter's context with the prompt's taps."""
    TRACE_COUNTS["prefill"] += 1
    batch = tokens.shape[0]
    out = forward(tparams, spec.target, tokens, init_cache(spec.target, batch, spec.cache_len),
                  num_tokens=prompt_lens, taps=spec.taps, logits_indices=(prompt_lens - 1)[:, None])
    first = sample(out.logits[:, 0], position_keys(row_keys, prompt_lens[:, None])[:, 0], spec.sampling)
    context_cache = None
    if spec.uses_drafter:
        context_cache = extend_context(dparams, spec.drafter, out.tap_features,
                                       init_context_cache(spec.drafter, batch, spec.cache_len), prompt_lens)
    stopped = _hits_stop(first[:, None], stop_ids)[:, 0]
    return constrain_state(DecodeState(
        target_cache=out.cache,
        context_cache=context_cache,
        anchor=first,
        output=jnp.zeros((batch, spec.out_len), jnp.int32).at[:, 0].set(first),
        num_generated=jnp.ones((batch,), jnp.int32),
        acceptance=jnp.zeros((batch, spec.max_new_tokens + 1), jnp.int32),
        num_cycles=jnp.zeros((batch,), jnp.int32),
        done=~active | stopped,
        stopped=stopped & active,
        row_keys=row_keys,
    ), spec.mesh)


def draft_block(tparams, dparams, spec: EngineSpec, anchor, context_cache):
    """Drafts d_1..d_K [batch, K]: argmax of the target head over the drafter's output for
    the block [anchor, MASK x (B-1)] placed at each row's context length. The drafter always
    denoises the whole block it was trained on; only the K slots that will be verified go
    through the LM head."""
    model = CausalLM(spec.target)
    batch, b = anchor.shape[0], spec.block_size
    block = jnp.concatenate([anchor[:, None], jnp.full((batch, b - 1), spec.drafter.mask_token_id, jnp.int32)], 1)
    embeds = model.apply({"params": tparams}, block, method=CausalLM.embed)
    hidden = draft_hidden(dparams, spec.drafter, embeds, context_cache)
    logits = model.apply({"params": tparams}, hidden[:, 1:1 + spec.num_drafts], method=CausalLM.logits)
    return greedy_pick(logits)


def cycle(tparams, dparams, spec: EngineSpec, state: DecodeState, stop_ids) -> DecodeState:
    """One draft -> verify -> accept -> commit cycle for every row (no-op for done rows)."""
    b = spec.verify_len
    active = ~state.done
    start = state.target_cache.lengths  # P: the anchor's position
    if spec.uses_drafter:
        drafts = draft_block(tparams, dparams, spec, state.anchor, state.context_cache)
        block = jnp.concatenate([state.anchor[:, None], drafts], axis=1)
    else:
        block = state.anchor[:, None]

    # Verify: y_i is the target's token for position P + i + 1, given the block up to i.
    out = forward(tparams, spec.target, block, state.target_cache, taps=spec.taps)
    keys = position_keys(state.row_keys, start[:, None] + 1 + jnp.arange(b)[None, :])
    y = sample(out.logits, keys, spec.sampling)

    # Accept: the longest prefix of drafts equal to the target's own tokens.
    if spec.uses_drafter:
        a = jnp.cumprod(drafts == y[:, :-1], axis=1).sum(axis=1).astype(jnp.int32)
    else:
        a = jnp.zeros_like(start)
    n_new = jnp.where(active, a + 1, 0)

    # Commit: the accepted drafts equal y_0..y_{a-1}, and y_a is the new anchor, so the
    # generated tokens grow by y_0..y_a.
    write = jax.vmap(lambda row, new, off: jax.lax.dynamic_update_slice_in_dim(row, new, off, axis=0))
    output = jnp.where(active[:, None], write(state.output, y, state.num_generated), state.output)
    new_mask = jnp.arange(b)[None, :] <= a[:, None]
    stopped = active & (_hits_stop(y, stop_ids) & new_mask).any(axis=1)
    slot = jnp.arange(state.acceptance.shape[1])[None, :] == state.num_cycles[:, None]
    acceptance = jnp.where(slot & active[:, None], (a + 1)[:, None], state.acceptance)
    num_generated = state.num_generated + n_new
    target_cache = out.cache.replace(lengths=start + n_new)  # rollback is a length update
    context_cache = state.context_cache
    if spec.uses_drafter:
        # The verify pass produced the taps of positions P..P+a: they join the context.
        context_cache = extend_context(dparams, spec.drafter, out.tap_features, context_cache, n_new)
    # The reference keeps cycling while generated <= max_new (its `start < max_length`).
    done = state.done | stopped | (num_generated > spec.max_new_tokens)
    return constrain_state(state.replace(
        target_cache=target_cache, context_cache=context_cache,
        anchor=jnp.where(active, jnp.take_along_axis(y, a[:, None], axis=1)[:, 0], state.anchor),
        output=output, num_generated=num_generated, acceptance=acceptance,
        num_cycles=state.num_cycles + active.astype(jnp.int32),
        done=done, stopped=state.stopped | stopped,
    ), spec.mesh)


@functools.partial(jax.jit, static_argnames=("spec",), donate_argnames=("state",))
def run_cycles(tparams, dparams, spec: EngineSpec, state: DecodeState, stop_ids, max_cycles):
    """Up to max_cycles cycles, on device, stopping early once every row is done.

    Returns (state, progress): progress [2, batch] int32 is (done, num_generated), a fresh
    array apart from the state, so the host can read it while the next call, which takes
    the state donated, already runs."""
    TRACE_COUNTS["run_cycles"] += 1

    def cond(carry):
        i, s = carry
        return (i < max_cycles) & ~s.done.all()

    def body(carry):
        i, s = carry
        return i + 1, cycle(tparams, dparams, spec, s, stop_ids)

    state = jax.lax.while_loop(cond, body, (jnp.int32(0), state))[1]
    return state, jnp.stack([state.done.astype(jnp.int32), state.num_generated])


# --------------------------------------------------------------------------- host side


@dataclasses.dataclass
class Result:
    index: int  # position in the prompts given to `generate`
    output_ids: list[int]
    acceptance_lengths: list[int]
    finish_reason: str  # "stop" | "length"


def bucket(n: int, minimum: int = 16) -> int:
    """Next power of two >= n (and >= minimum): prompt lengths compile to a few shapes."""
    return max(minimum, 1 << max(0, n - 1).bit_length())


class Generator:
    """Batch generation with a target and (optionally) a DFlash drafter.

    block_size 1 (or no drafter) is plain autoregressive decoding of the target. Shapes
    are fixed at construction (batch_size, max_new_tokens, max_prompt_len), so after one
    compilation per prompt bucket nothing recompiles. draft_tokens K (default B - 1) sends
    only the first K drafts of each block to the verify: the drafter still denoises the
    whole block, the target runs K + 1 tokens. Worth it where a verify token costs compute
    (CPUs, large batches); on a memory-bound accelerator the full block is nearly free.
    """

    def __init__(self, target_config: ModelConfig, target_params, drafter_config: DrafterConfig | None = None,
                 drafter_params=None, *, block_size: int | None = None, batch_size: int = 1,
                 max_new_tokens: int = 256, max_prompt_len: int = 512, sampling: Sampling = Sampling(),
                 stop_token_ids: Sequence[int] = (), sync_every: int = 8, mesh: Mesh | None = None,
                 draft_tokens: int | None = None):
        if drafter_config is not None:
            check_pair(target_config, drafter_config)
        if block_size is None:
            block_size = drafter_config.block_size if drafter_config is not None else 1
        if block_size < 1:
            raise DFlashError(f"block size must be >= 1, got {block_size}")
        if block_size > 1 and drafter_config is None:
            raise DFlashError(f"block size {block_size} needs a drafter (block size 1 is plain decoding)")
        if max_new_tokens < 1:
            raise DFlashError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.max_prompt_len = bucket(max_prompt_len)
        self.spec = EngineSpec(
            target=target_config, drafter=drafter_config if block_size > 1 else None, block_size=block_size,
            sampling=sampling, max_new_tokens=max_new_tokens,
            cache_len=self.max_prompt_len + max_new_tokens + 2 * block_size, mesh=mesh,
            draft_tokens=draft_tokens,
        )
        if mesh is not None and batch_size % mesh.shape["data"]:
            raise DFlashError(f"batch size {batch_size} is not divisible by the mesh's data axis ({mesh.shape['data']})")
        self.mesh = mesh
        self.tparams = shard_params(target_params, mesh)
        self.dparams = shard_params(drafter_params, mesh) if block_size > 1 else None
        self.batch_size, self.sync_every = batch_size, sync_every
        stop = list(dict.fromkeys(int(t) for t in stop_token_ids)) or [-1]
        self.stop_ids = jnp.asarray(stop + [-1] * (-len(stop) % 8), jnp.int32)
        self.stop_set = frozenset(stop) - {-1}

    def check_prompt(self, prompt: Sequence[int]) -> str | None:
        """Why this prompt cannot run, or None."""
        n, limit = len(prompt), min(self.max_prompt_len, self.spec.target.max_position_embeddings)
        if n == 0:
            return "empty prompt"
        if n > limit:
            return f"prompt of {n} tokens is longer than the context ({limit} tokens)"
        bad = [t for t in prompt if not 0 <= t < self.spec.target.vocab_size]
        if bad:
            return f"token id {bad[0]} outside the vocabulary (size {self.spec.target.vocab_size})"
        return None

    def prefill(self, prompts: Sequence[Sequence[int]], indices: Sequence[int], seed: int = 0) -> DecodeState:
        """The DecodeState after prefill of up to batch_size prompts (for benchmarks and tools)."""
        return self._prefill(prompts, indices, seed)

    def _prefill(self, prompts, indices, seed):
        n = len(prompts)
        bucket_len = min(bucket(max(len(p) for p in prompts)), self.max_prompt_len)
        tokens = np.zeros((self.batch_size, bucket_len), np.int32)
        lens = np.ones((self.batch_size,), np.int32)
        for i, p in enumerate(prompts):
            tokens[i, :len(p)], lens[i] = p, len(p)
        active = np.arange(self.batch_size) < n
        ids = np.zeros((self.batch_size,), np.uint32)
        ids[:n] = indices
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(jax.random.PRNGKey(seed), jnp.asarray(ids))
        put = lambda x: put_batch(x, self.mesh)
        return prefill(self.tparams, self.dparams, self.spec, put(tokens), put(lens), put(active),
                       put(np.asarray(row_keys)), self.stop_ids)

    def warmup(self, prompt_lengths: Sequence[int] = (1,)):
        """Compile prefill for the buckets of these lengths and the cycle loop."""
        for n in sorted({min(bucket(n), self.max_prompt_len) for n in prompt_lengths}):
            state = self._prefill([[0] * n], [0], 0)
            jax.block_until_ready(self._run(state, 1))

    def _run(self, state, cycles=None):
        return run_cycles(self.tparams, self.dparams, self.spec, state, self.stop_ids,
                          self.sync_every if cycles is None else cycles)

    def _finish(self, index, output, num_generated, acceptance, num_cycles) -> Result:
        tokens = output[:num_generated].tolist()
        reason = "length"
        for j, t in enumerate(tokens):
            if t in self.stop_set:
                tokens, reason = tokens[:j + 1], "stop"
                break
        if len(tokens) > self.spec.max_new_tokens:
            tokens, reason = tokens[:self.spec.max_new_tokens], "length"
        elif reason != "stop":
            reason = "length"
        return Result(index, tokens, acceptance[:num_cycles].tolist(), reason)

    def generate(self, prompts: Sequence[Sequence[int]], *, seed: int = 0, indices: Sequence[int] | None = None,
                 progress=None) -> Iterator[Result]:
        """Yield a Result per prompt as rows finish. `indices` (default 0..n-1) name the rows
        and key their random streams. `progress(n_tokens)` is called after each sync."""
        indices = list(range(len(prompts))) if indices is None else [int(i) for i in indices]
        if len(indices) != len(prompts):
            raise DFlashError(f"{len(indices)} indices for {len(prompts)} prompts")
        bad = [i for i in indices if not 0 <= i < 2**32]
        if bad:
            raise DFlashError(f"row index {bad[0]} outside 0..2**32-1 (indices key the random streams)")
        for p in prompts:
            why = self.check_prompt(p)
            if why:
                raise DFlashError(why)
        for start in range(0, len(prompts), self.batch_size):
            chunk = prompts[start:start + self.batch_size]
            state = self._prefill(chunk, indices[start:start + len(chunk)], seed)
            reported = np.zeros(self.batch_size, bool)
            reported[len(chunk):] = True
            last_counts = np.ones(self.batch_size, np.int64)
            state, info = self._run(state)
            while True:
                # The next cycles are queued before this sync's figures are read, so the device
                # never waits on the host. Finished rows are frozen (later cycles skip them), so
                # their tokens are read from the newer state; once all are done the queued call
                # runs no cycle.
                state, next_info = self._run(state)
                info = to_host(info)
                done, num_generated = info[0].astype(bool), info[1]
                info = next_info
                if progress is not None:
                    counts = np.minimum(num_generated, self.spec.max_new_tokens)
                    progress(int((counts - np.minimum(last_counts, self.spec.max_new_tokens))[:len(chunk)].sum()))
                    last_counts = num_generated.copy()
                newly = done & ~reported
                if newly.any():
                    output, acceptance, num_cycles = (to_host(state.output), to_host(state.acceptance),
                                                      to_host(state.num_cycles))
                    for i in np.flatnonzero(newly):
                        yield self._finish(indices[start + i], output[i], num_generated[i], acceptance[i], num_cycles[i])
                    reported |= newly
                if reported.all():
                    break


@dataclasses.dataclass
class GenerationStats:
    """Aggregates over Results: tau, acceptance histogram, tokens/s."""

    block_size: int
    tokens: int = 0
    cycles: int = 0
    seconds: float = 0.0
    histogram: dict[int, int] = dataclasses.field(default_factory=dict)

    def add(self, result: Result):
        self.tokens += len(result.output_ids)
        self.cycles += len(result.acceptance_lengths)
        for a in result.acceptance_lengths:
            self.histogram[a] = self.histogram.get(a, 0) + 1

    @property
    def tau(self) -> float:
        return sum(k * v for k, v in self.histogram.items()) / max(1, self.cycles)

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict:
        return dict(block_size=self.block_size, tau=round(self.tau, 4), cycles=self.cycles,
                    output_tokens=self.tokens, seconds=round(self.seconds, 3),
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
