"""How the target picks tokens: greedy or sampled (temperature, top-k, top-p), with one
random key per row and sequence position.

Sampling is lossless under speculative decoding: drafts are the drafter's argmax (a one-hot
proposal), the target samples y_i at every verified position, and a draft is accepted while it
equals the target's sample ("match"). The sample for sequence position t always uses the key
fold_in(row_key, t), so a row's output depends neither on the batch or slot it ran in, nor on
the block size.

A DFlash2 drafter draws its drafts from a proposal q it can name (its selector's walk), so its
sampled rows can instead accept by speculative rejection sampling ("rejection",
`rejection_accept`): draft d is kept with probability min(1, p(d) / q(d)), the first one rejected
is replaced by a draw from norm(max(0, p - q)). The output then has the target's distribution, not
plain decoding's seeded tokens. The walk's, the acceptance's and the replacement's draws use keys
of their own, `draw_keys(row_keys, positions, use)`.

Each row's sampling lives on the device as a `RowSampling` (temperature, top-k, top-p, its key,
plus the slots structured output and logprobs fill: a logit bias, a constraint, a logprobs
count), part of the decoding state, built on the host by one helper (`rows_of`) and read by one
logits processor (`pick`; `target_probs` for rejection sampling) at every position the target
samples from: prefill, the chain's, the tree's and DFlash2's verify. A BatchEngine's `Sampling`
(a compile-time setting) is its rows' default; with `Sampling(per_row=True)` (the server) each
row brings its own, and greedy and sampled rows share one batch and one compiled program. A
greedy engine compiles the argmax alone (`pick(sampled=False)`).

Every setting is bounded where it is made (`check_sampling`, which `Sampling` runs): the engine
casts temperature and top_p to float32 and top_k to int32 at admission, so an out-of-range value
would otherwise fail there, on the engine's thread. The server and the batch CLI check their
inputs with the same function (`sampling_problem` names the field and says why).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import DFlashError, InputError

# --------------------------------------------------------------------------- bounds of what the engine casts

# The device holds top_k, row limits, lengths and token ids as int32, and temperature and top_p
# as float32: a setting past these would overflow where the engine casts it (after the models
# load, or on a server's engine thread), so every edge (`GenerationJob`, `read_rows`, the server's
# requests, `StreamingEngine.submit`) refuses it first, with the bounds below: one home for them.
INT32_MAX = 2**31 - 1
# The smallest temperature that is not greedy: logits divided by a smaller one leave float32's
# range (or the temperature itself rounds to 0 in float32). vLLM counts below 1e-5 as greedy.
MIN_TEMPERATURE = 1e-5
_FLOAT32_MAX = 3.4028234663852886e38
_FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal number: a smaller top_p rounds to 0


class SamplingError(DFlashError):
    """A sampling setting out of its bounds; `field` names it ("temperature", "top_k", "top_p")."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def _got(x) -> str:
    """A value quoted in an error, as JSON where it is JSON, cut short (a request's integer may
    have thousands of digits)."""
    try:
        text = json.dumps(x)
    except (TypeError, ValueError):
        text = repr(x)
    return text if len(text) <= 40 else text[:40] + "..."


def _integer(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def temperature_problem(x) -> str | None:
    """Why a temperature is out of bounds (None: it fits): 0 (greedy) or MIN_TEMPERATURE..float32's largest."""
    if _real(x) and (x == 0 or MIN_TEMPERATURE <= x <= _FLOAT32_MAX):
        return None
    return f"must be 0 (greedy) or a number from {MIN_TEMPERATURE:g} up, got {_got(x)}"


def top_k_problem(x) -> str | None:
    """top_k: an integer in 0..INT32_MAX (0: off; a k at or above the vocabulary keeps every token, so it is off too)."""
    return None if _integer(x) and 0 <= x <= INT32_MAX else f"must be an integer in 0..{INT32_MAX} (0: off), got {_got(x)}"


def top_p_problem(x) -> str | None:
    """top_p: a number in (0, 1] (1: off), not so small that float32 rounds it to 0."""
    if _real(x) and _FLOAT32_TINY <= x <= 1:
        return None
    return f"must be a number in (0, 1] (from {_FLOAT32_TINY:.2g} up), got {_got(x)}"


def max_new_tokens_problem(x) -> str | None:
    """max_new_tokens: an integer in 1..INT32_MAX."""
    return None if _integer(x) and 1 <= x <= INT32_MAX else f"must be an integer in 1..{INT32_MAX}, got {_got(x)}"


# The most top alternatives a row's logprobs may ask for per token (OpenAI's and vLLM's default limit).
MAX_LOGPROBS = 20


def logprobs_problem(x) -> str | None:
    """logprobs: None (none) or an integer in 0..MAX_LOGPROBS (the token's own logprob and that many
    top alternatives)."""
    if x is None or _integer(x) and 0 <= x <= MAX_LOGPROBS:
        return None
    return f"must be an integer in 0..{MAX_LOGPROBS}, got {_got(x)}"


def sampling_problem(temperature, top_k, top_p, logprobs=None) -> tuple[str, str] | None:
    """The first sampling setting out of its bounds as (field, why), why reading after the
    field's name ("must be ..., got X"); None when all fit."""
    for name, why in (("temperature", temperature_problem(temperature)), ("top_k", top_k_problem(top_k)),
                      ("top_p", top_p_problem(top_p)), ("logprobs", logprobs_problem(logprobs))):
        if why is not None:
            return name, why
    return None


def check_sampling(temperature, top_k, top_p, logprobs=None) -> None:
    """Raise SamplingError ("top_k must be ...") for the first setting out of its bounds (`sampling_problem`)."""
    problem = sampling_problem(temperature, top_k, top_p, logprobs)
    if problem is not None:
        raise SamplingError(problem[0], f"{problem[0]} {problem[1]}")


def _check(problem, value, where: str):
    why = problem(value)
    if why is not None:
        raise InputError(f"{where} {why}")


def check_top_k(value, where: str):
    """An InputError naming `where` (the flag or the row: `--top-k`, `in.jsonl line 3: top_k`) past top_k's bounds."""
    _check(top_k_problem, value, where)


def check_temperature(value, where: str):
    _check(temperature_problem, value, where)


def check_top_p(value, where: str):
    _check(top_p_problem, value, where)


def check_max_new_tokens(value, where: str):
    _check(max_new_tokens_problem, value, where)


def check_seed(value, where: str):
    """A seed: any integer (the engine takes it modulo 2**32, `seed_int32`)."""
    if not _integer(value):
        raise InputError(f"{where} must be an integer, got {_got(value)}")


def seed_int32(seed: int) -> int:
    """The int32 the engine keys a run's random streams with (`jax.random.PRNGKey`): the seed
    modulo 2**32, as a signed 32-bit integer. Seeds in -2**31..2**31-1 are themselves; s and
    s + 2**32 give the same streams (as the server's request seeds, also taken modulo 2**32)."""
    return (int(seed) + 2**31) % 2**32 - 2**31


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the target picks tokens. temperature 0 is greedy. Hashable: a static jit arg.

    per_row: the engine takes each row's settings at admission instead (a Sampling per row,
    `BatchEngine.generate(sampling=...)`); this one's values are then the rows' default."""

    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    per_row: bool = False
    # The row's constraint: a `dflash_jax.constrain.Automaton` (hashed by identity: a cache gives one
    # object per constraint), which the engine's constraint pool holds while the row runs (None: none).
    constraint: object = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in -100..100), at most LOGIT_BIAS_SLOTS
    # The row's logprobs (`token_logprobs`): None, none; 0..MAX_LOGPROBS, each token's own logprob under
    # the target's raw distribution and that many top alternatives (the engine's max_logprobs bounds it).
    logprobs: int | None = None

    def __post_init__(self):
        check_sampling(self.temperature, self.top_k, self.top_p, self.logprobs)  # SamplingError
        if len(self.logit_bias) > LOGIT_BIAS_SLOTS or not all(
                _integer(t) and t >= 0 and _real(b) and -100 <= b <= 100 for t, b in self.logit_bias):
            raise SamplingError("logit_bias", f"logit_bias must map at most {LOGIT_BIAS_SLOTS} token ids to "
                                              f"numbers in -100..100, got {_got(list(self.logit_bias))}")

    @property
    def greedy(self) -> bool:
        """Every row picks the argmax (never true of a per-row engine)."""
        return self.temperature == 0 and not self.per_row


# --------------------------------------------------------------------------- each row's sampling on the device

# The most logit-bias entries a row holds (OpenAI's limit on a request's `logit_bias`); every row
# has this many slots, unused ones -1, so admissions of any bias share one compiled program.
LOGIT_BIAS_SLOTS = 300
_NEG = float(jnp.finfo(jnp.float32).min)


@flax.struct.dataclass
class RowSampling:
    """How each row of a decoding state picks its tokens: a pytree of [batch, ...] arrays, part of
    `DecodeState` (its `sampling`), set at admission and read by the one logits processor
    (`pick`, `target_probs`) at every position the target samples from: prefill's first token,
    the chain's, the tree's and DFlash2's verify.

    temperature [batch] float32 (0: greedy), top_k [batch] int32 (0: off), top_p [batch] float32
    (1: off); key [batch, 2] uint32, the row's random stream (fold_in(PRNGKey(seed), row id),
    drawn at admission: None in what `rows_of` builds); bias_ids, bias [batch, LOGIT_BIAS_SLOTS]
    the logit bias added to the row's logits before anything else (id -1: an unused slot);
    constraint [batch] int32, the initial state of the row's automaton in the engine's constraint
    pool (-1: none; `dflash_jax.engine.constraints`: the state its committed tokens reached is
    `DecodeState.fsm`, whose mask reaches `pick` as `allowed`); logprobs [batch] int32, how many
    top log-probabilities the row returns per token (-1: none)."""

    temperature: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    key: jax.Array | None
    bias_ids: jax.Array
    bias: jax.Array
    constraint: jax.Array
    logprobs: jax.Array

    @classmethod
    def idle(cls, batch: int) -> "RowSampling":
        """`batch` greedy rows with nothing set (a free slot's), on the device."""
        zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
        return cls(temperature=zeros(batch, dtype=jnp.float32), top_k=zeros(batch),
                   top_p=jnp.ones((batch,), jnp.float32), key=zeros(batch, 2, dtype=jnp.uint32),
                   bias_ids=jnp.full((batch, LOGIT_BIAS_SLOTS), -1, jnp.int32),
                   bias=zeros(batch, LOGIT_BIAS_SLOTS, dtype=jnp.float32),
                   constraint=jnp.full((batch,), -1, jnp.int32), logprobs=jnp.full((batch,), -1, jnp.int32))


def rows_of(samplings, width: int | None = None, constraints=None) -> RowSampling:
    """The one host helper: the RowSampling (numpy arrays, key None: drawn at admission) of rows
    with these `Sampling`s, padded to `width` rows (padding: greedy, nothing set). constraints:
    each row's initial automaton state in the engine's pool (`ConstraintRegions.admit`; -1: none)."""
    samplings = list(samplings)
    width = len(samplings) if width is None else width
    constraint = np.full((width,), -1, np.int32)
    constraint[:len(samplings)] = -1 if constraints is None else constraints
    temperature, top_p = np.zeros((width,), np.float32), np.ones((width,), np.float32)
    top_k, logprobs = np.zeros((width,), np.int32), np.full((width,), -1, np.int32)
    for j, s in enumerate(samplings):
        temperature[j], top_k[j], top_p[j] = s.temperature, s.top_k, s.top_p
        logprobs[j] = -1 if s.logprobs is None else s.logprobs
    bias_ids, bias = np.full((width, LOGIT_BIAS_SLOTS), -1, np.int32), np.zeros((width, LOGIT_BIAS_SLOTS), np.float32)
    for j, s in enumerate(samplings):
        for i, (token, value) in enumerate(s.logit_bias):
            bias_ids[j, i], bias[j, i] = token, value
    return RowSampling(temperature=temperature, top_k=top_k, top_p=top_p, key=None, bias_ids=bias_ids, bias=bias,
                       constraint=constraint, logprobs=logprobs)


def _cut(logits, temperature, top_k, top_p):
    """Temperature, top-k and top-p applied to logits [n, vocab] float32 with each row's own
    settings [n] (temperature > 0; top_k 0 and top_p 1: off); removed tokens get float32's lowest.
    The one implementation: one descending sort of the row gives both cut-offs as values, the
    k-th largest logit and the smallest logit of the shortest prefix (of the top-k survivors)
    whose probability reaches top_p; a token below either is removed, one equal to the cut-off
    kept (so tied tokens share a fate). The sort runs only when some row asks for it."""
    vocab = logits.shape[-1]
    logits = logits / temperature[:, None]

    def cut(logits):
        ordered = -jnp.sort(-logits, axis=-1)
        at = lambda i: jnp.take_along_axis(ordered, jnp.clip(i, 0, vocab - 1)[:, None], axis=-1)[:, 0]
        kth = jnp.where((top_k > 0) & (top_k < vocab), at(top_k - 1), _NEG)  # k >= vocab keeps all, as in HF
        ordered = jnp.where(ordered < kth[:, None], _NEG, ordered)
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each token
        count = (before < top_p[:, None]).sum(-1)  # the smallest prefix reaching top_p
        pth = jnp.where(top_p < 1.0, at(count - 1), _NEG)
        return jnp.where(logits < jnp.maximum(kth, pth)[:, None], _NEG, logits)

    needed = ((top_k > 0) & (top_k < vocab)) | (top_p < 1.0)
    return jax.lax.cond(needed.any(), cut, lambda x: x, logits)


def _per_position(x, positions: int):
    """A row's [batch, ...] setting repeated for each of its positions: [batch * positions, ...]."""
    return jnp.repeat(x, positions, axis=0)


def _bias_rows(rows: RowSampling, vocab: int):
    """Each row's logit bias as a dense [batch, vocab] float32 (zeros where it has none). The scatter
    runs under a lax.cond only when some row has a bias, and its operands and result are the small,
    replicated per-row arrays, never the sharded logits: a scatter into the logits themselves left
    the TPU compiler without a time estimate for the whole step, and the logits' collectives inside
    a branch timed out in a rendezvous on a 4-device CPU mesh. Adding the dense rows to the logits is
    elementwise, so it partitions over the vocabulary without a collective."""
    b = rows.bias_ids.shape[0]
    used = rows.bias_ids >= 0

    def build(_):
        return jnp.zeros((b, vocab), jnp.float32).at[jnp.arange(b)[:, None], jnp.where(used, rows.bias_ids, vocab)].add(
            rows.bias, mode="drop")

    return jax.lax.cond(used.any(), build, lambda _: jnp.zeros((b, vocab), jnp.float32), None)


def _adjusted(logits, rows: RowSampling, allowed=None):
    """Logits [n, vocab] float32 of n = batch x T positions with each row's bias added and, where
    `allowed` [n, vocab] (bool) is given, the tokens outside it removed: what greedy and sampled
    rows both pick from."""
    n, vocab = logits.shape
    b = rows.temperature.shape[0]
    logits = (logits.astype(jnp.float32).reshape(b, n // b, vocab) + _bias_rows(rows, vocab)[:, None]).reshape(n, vocab)
    return logits if allowed is None else jnp.where(allowed, logits, _NEG)


def processed_rows(logits, rows: RowSampling, allowed=None):
    """The logits each position samples from, [batch, T, vocab] float32 from logits [batch, T,
    vocab]: the row's bias and constraint, then its temperature, top-k and top-p (`_cut`). A
    greedy row's are only biased and constrained (its pick is their argmax)."""
    b, t, vocab = logits.shape
    flat = _adjusted(logits.reshape(-1, vocab), rows, None if allowed is None else allowed.reshape(-1, vocab))
    temperature = _per_position(rows.temperature, t)
    flat = _cut(flat, jnp.where(temperature > 0, temperature, 1.0), _per_position(rows.top_k, t),
                _per_position(rows.top_p, t))
    return flat.reshape(b, t, vocab)


def pick(logits, rows: RowSampling, positions, *, sampled: bool = True, allowed=None):
    """The one logits processor's tokens: logits [batch, T, vocab] -> [batch, T] int32, each row
    with its own settings (`RowSampling`), the sample at sequence position positions [batch, T]
    drawn with the key fold_in(row key, position). A greedy row (temperature 0) takes the argmax of
    its biased, constrained logits. sampled False: the engine never samples (a static promise:
    only the argmax is compiled); else the sampled branch runs only when some row samples."""
    b, t, vocab = logits.shape
    flat = _adjusted(logits.reshape(-1, vocab), rows, None if allowed is None else allowed.reshape(-1, vocab))
    greedy = greedy_pick(flat).reshape(b, t)
    if not sampled:
        return greedy
    temperature = _per_position(rows.temperature, t)

    def draw(_):
        cut = _cut(flat, jnp.where(temperature > 0, temperature, 1.0), _per_position(rows.top_k, t),
                   _per_position(rows.top_p, t))
        keys = position_keys(rows.key, positions).reshape(-1, 2)
        tokens = jax.vmap(jax.random.categorical)(keys, cut).astype(jnp.int32).reshape(b, t)
        return jnp.where((rows.temperature > 0)[:, None], tokens, greedy)

    return jax.lax.cond((rows.temperature > 0).any(), draw, lambda _: greedy, None)


def token_logprobs(logits, tokens, rows: RowSampling, width: int, active=None):
    """The logprobs of tokens [batch, T] under logits [batch, T, vocab]: the target's raw distribution
    (log-softmax of its logits, before bias, constraint, temperature, top-k and top-p, as vLLM's
    default), with no other pass. Returns (own [batch, T] float32, top_ids [batch, T, width] int32,
    top [batch, T, width] float32), the width most likely tokens by `jax.lax.top_k`. Computed only
    when some row (of active [batch], default all) asked (`RowSampling.logprobs` >= 0); else zeros."""
    b, t, _ = logits.shape
    asked = rows.logprobs >= 0
    asked = asked if active is None else asked & active

    def compute(_):
        lp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        own = jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]
        top, ids = jax.lax.top_k(lp, width)
        return own, ids.astype(jnp.int32), top

    def none(_):
        return (jnp.zeros((b, t), jnp.float32), jnp.zeros((b, t, width), jnp.int32),
                jnp.zeros((b, t, width), jnp.float32))

    return jax.lax.cond(asked.any(), compute, none, None)


def processed_logits(logits, sampling: Sampling):
    """Temperature, top-k and top-p of one `Sampling` (temperature > 0) applied to logits [...,
    vocab]; removed tokens get float32's lowest. [..., vocab] float32 (the rows' `_cut`)."""
    flat = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
    full = lambda x, dtype: jnp.full((flat.shape[0],), x, dtype)
    out = _cut(flat, full(sampling.temperature, jnp.float32), full(sampling.top_k, jnp.int32),
               full(sampling.top_p, jnp.float32))
    return out.reshape(logits.shape)


def greedy_pick(logits):
    """argmax over the last axis (the first index of the maximum, as torch.argmax), as int32.
    One reduction that reads the logits once: [128, 38016] float32 logits cost XLA 19 MB of
    traffic, where a max followed by a min over the indices reaching it cost 118 MB (and ran
    5x slower on CPU with jax 0.10)."""
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def position_keys(row_keys, positions):
    """row_keys [batch, 2] uint32, positions [batch, T] -> keys [batch, T, 2]."""
    return jax.vmap(lambda k, ps: jax.vmap(lambda p: jax.random.fold_in(k, p))(ps))(row_keys, positions)


# --------------------------------------------------------------------------- rejection sampling

# How a DFlash2 drafter's sampled rows accept drafts (`EngineSpec.acceptance`, `--acceptance`): the
# first is the default.
ACCEPTANCE_RULES = ("rejection", "match")
_DRAWS = {"walk": 1, "accept": 2, "residual": 3}  # the uses of draw_keys


def draw_keys(row_keys, positions, use: str):
    """Keys [batch, T, 2] of a draw speculative decoding makes at positions [batch, T] besides the
    target's own sample there (`position_keys`): `use` one of "walk" (the selector's Gumbel walk),
    "accept" (the acceptance test), "residual" (the replacement of a rejected draft)."""
    keys = position_keys(row_keys, positions)
    flat = jax.vmap(lambda k: jax.random.fold_in(k, _DRAWS[use]))(keys.reshape(-1, keys.shape[-1]))
    return flat.reshape(keys.shape)


def target_probs(logits, rows: RowSampling, allowed=None):
    """p [batch, T, vocab] float32: the distribution each row's target samples each position from
    (its bias and constraint, `allowed` [batch, T, vocab], then temperature, top-k and top-p:
    `processed_rows`). A greedy row's p is unused (any)."""
    return jax.nn.softmax(processed_rows(logits, rows, allowed), axis=-1)


def rejection_accept(probs, drafts, candidates, rows, picked, temperature, row_keys, positions):
    """Speculative rejection sampling of drafts drawn from a proposal over candidates.

    probs [batch, K+1, vocab]: the target's p at the verified positions (`target_probs`); drafts
    [batch, K]; candidates, rows [batch, K, Kc]: each slot's candidates and the score row its draw
    read, so the proposal is q = softmax(rows / temperature) over the candidates (0 elsewhere);
    picked [batch, K]: each draft's index among its candidates; temperature [batch] (> 0 where it
    matters); positions [batch, K+1]: the sequence positions the verify pass predicts.

    Draft i is kept with probability min(1, p_i(d_i) / q_i(d_i)), while all before it were; at the
    first rejection (slot a) the token is drawn from norm(max(0, p_a - q_a)); with none rejected, the
    bonus token from p_K. Returns (target_tokens [batch, K+1], num_accepted [batch]) as the
    chain's verify and accept do: target_tokens[:, :a] are the kept drafts, target_tokens[:, a] the
    drawn token."""
    b, k = drafts.shape
    q = jax.nn.softmax(rows / jnp.where(temperature > 0, temperature, 1.0)[:, None, None], axis=-1)
    q_draft = jnp.take_along_axis(q, picked[..., None], axis=-1)[..., 0]
    p_draft = jnp.take_along_axis(probs[:, :k], drafts[..., None], axis=-1)[..., 0]
    u = jax.vmap(jax.vmap(lambda key: jax.random.uniform(key)))(draw_keys(row_keys, positions[:, :k], "accept"))
    kept = u * q_draft < p_draft
    num_accepted = jnp.cumprod(kept, axis=1).sum(axis=1).astype(jnp.int32)
    p_at = jnp.take_along_axis(probs, num_accepted[:, None, None], axis=1)[:, 0]
    slot = jnp.minimum(num_accepted, k - 1)[:, None, None]
    q_at = jnp.where((num_accepted < k)[:, None], jnp.take_along_axis(q, slot, axis=1)[:, 0], 0.0)
    rows_idx = jnp.arange(b)[:, None]
    q_full = jnp.zeros_like(p_at).at[rows_idx, jnp.take_along_axis(candidates, slot, axis=1)[:, 0]].add(q_at)
    residual = jnp.maximum(p_at - q_full, 0.0)
    residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_at)
    key = jnp.take_along_axis(draw_keys(row_keys, positions, "residual"), num_accepted[:, None, None], axis=1)[:, 0]
    token = jax.vmap(jax.random.categorical)(key, jnp.log(residual)).astype(jnp.int32)
    tokens = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    return tokens.at[jnp.arange(b), num_accepted].set(token), num_accepted
