"""Constraints on the device: each row's token-level automaton (a regex's, a JSON schema's; compiled
on the host by `dflash_jax.constrain`) masks the target's logits at every position it samples from,
and its state advances with each committed token, with no host round trip per cycle.

The pool (`ConstraintPool`, part of `DecodeState`) holds one region per batch slot, each of
`EngineSpec.constraint_states` states and `constraint_edges` exception edges. A state is one row of
a bitmask over the vocabulary (the tokens it allows: 4 bytes per 32 tokens in whole groups of 4,096
tokens, `mask_words`: 19,456 bytes a state at a 151,936-token vocabulary) plus its transitions in a compact form: a default next state (the one
most of its tokens go to: a JSON string's content state goes back to itself) and the tokens that go
elsewhere (sorted, found by binary search). State ids are global: region r's states are
r * constraint_states + local id, so a row's state is one int32 (`DecodeState.fsm`; `NONE` for a
row without a constraint, `DEAD` for a path that left its automaton, which only a rejected draft's
can: every token is allowed there and nothing from it is ever committed).

The host side (`ConstraintRegions`) puts a row's automaton into a region at admission (one
compiled call, `load_region`; a region whose automaton is already there is shared, and kept,
idle, for the next row that asks for it) and never per cycle. A slot's row holds its region until
the slot's next row is admitted; with one region per slot, a row always finds one.

A row cannot end before its automaton reaches a final state: the end-of-sequence tokens are
allowed only in final states (`dflash_jax.constrain`), and a final state with nothing else allowed
leaves the row only its end.
"""

from __future__ import annotations

import collections

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from dflash_jax.errors import InputError

# Automaton states a constraint may have where nothing says (the server's --constraint-states, rows of
# `python -m infer` that ask for one): a typical JSON schema needs a few hundred
# (docs/structured-output.md); a region of 512 is 10.0 MB of masks at a 151,936-token vocabulary.
DEFAULT_STATES = 512
# Transition exceptions a region holds per state where nothing says (`--constraint-edges`): 8 bytes each,
# so 1024 cost 8 KiB a state beside its 19,456-byte mask at a 152k vocabulary. A string of bounded length
# needs many (each position's tokens reach as many next positions as token lengths): 672 a state for a
# 20-character string on the demo vocabulary.
EDGES_PER_STATE = 1024
NONE = -1  # a row without a constraint: every token allowed
DEAD = -2  # a path that left its automaton (a rejected draft's): every token allowed, never committed


# The device's bit order: the vocabulary in groups of GROUP = 32 x 128 tokens, each group 128 words,
# token g * GROUP + k * 128 + j at bit k of word g * 128 + j. Unpacking a state's mask is then 32
# shifts of whole 128-lane rows, which the TPU does in place; unpacking the host's order (token v at
# bit v % 32 of word v // 32) moved every bit across lanes, and cost the verify's masks about 1 GB a
# cycle at batch 8 and a 152k vocabulary by the TPU compiler's estimate (grouped: 0.4 GB).
LANES = 128
GROUP = 32 * LANES


def mask_words(vocab_size: int) -> int:
    """uint32 words of one state's bitmask on the device (whole groups of GROUP tokens)."""
    return -(-vocab_size // GROUP) * LANES


def device_masks(masks: np.ndarray, vocab_size: int) -> np.ndarray:
    """Host-order bitmasks [n, ceil(V / 32)] (`dflash_jax.constrain.Automaton.masks`: token v at bit
    v % 32 of word v // 32) in the device's grouped order [n, mask_words(V)]."""
    n = masks.shape[0]
    bits = np.unpackbits(np.ascontiguousarray(masks, "<u4").view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    groups = mask_words(vocab_size) // LANES
    bits = np.pad(bits, ((0, 0), (0, groups * GROUP - vocab_size))).reshape(n, groups, 32, LANES)
    # each lane's 32 bits (k) packed into its word: a transpose then packbits (13x a shift-and-sum here,
    # 0.14 s for 400 states of a 152k vocabulary, run at a region's load on the engine's thread)
    packed = np.packbits(bits.transpose(0, 1, 3, 2), axis=-1, bitorder="little")  # [n, groups, LANES, 4] bytes
    return np.ascontiguousarray(packed).view("<u4").reshape(n, groups * LANES).astype(np.uint32)


@flax.struct.dataclass
class ConstraintPool:
    """The automata of the rows' constraints on the device: `regions` regions of `states` states
    and `edges` exception edges. masks [R*S, W] uint32; default [R*S] int32 (global ids); starts,
    counts [R*S] int32 (a state's exceptions: edges starts .. starts + counts - 1, global edge
    positions); tokens, targets [R*E] int32 (sorted by token within a state; targets global)."""

    masks: jax.Array
    default: jax.Array
    starts: jax.Array
    counts: jax.Array
    tokens: jax.Array
    targets: jax.Array

    @classmethod
    def empty(cls, regions: int, states: int, edges: int, vocab_size: int) -> "ConstraintPool":
        n, e = regions * states, regions * edges
        zeros = lambda *shape, dtype=jnp.int32: jnp.zeros(shape, dtype)
        return cls(masks=zeros(n, mask_words(vocab_size), dtype=jnp.uint32), default=jnp.full((n,), DEAD, jnp.int32),
                   starts=zeros(n), counts=zeros(n), tokens=zeros(e), targets=zeros(e))


def allowed(pool: ConstraintPool | None, states, vocab_size: int):
    """[..., vocab_size] bool: the tokens each of states [...] allows (every token for NONE and
    DEAD); None without a pool (nothing constrained)."""
    if pool is None:
        return None
    words = pool.masks[jnp.clip(states, 0, pool.masks.shape[0] - 1)]  # [..., W]
    groups = words.shape[-1] // LANES
    words = words.reshape(*states.shape, groups, 1, LANES)
    bits = (words >> jnp.arange(32, dtype=jnp.uint32)[:, None]) & 1  # [..., groups, 32, LANES]: the grouped order
    bits = bits.reshape(*states.shape, groups * GROUP)[..., :vocab_size].astype(bool)
    return jnp.where((states >= 0)[..., None], bits, True)


def _bit(pool: ConstraintPool, states, tokens):
    word = pool.masks[jnp.clip(states, 0, pool.masks.shape[0] - 1), tokens // GROUP * LANES + tokens % LANES]
    return ((word >> (tokens % GROUP // LANES).astype(jnp.uint32)) & 1).astype(bool)


def permits(pool: ConstraintPool | None, states, tokens):
    """[...] bool: whether each of states [...] allows its token of tokens [...] (every token for
    NONE and DEAD, and without a pool): `allowed` at single tokens, without the whole mask."""
    if pool is None:
        return jnp.ones(jnp.shape(tokens), bool)
    return jnp.where(states >= 0, _bit(pool, states, tokens), True)


def advance(pool: ConstraintPool | None, states, tokens):
    """The states [...] reach after tokens [...]: NONE stays NONE; a token a state does not allow,
    or a DEAD state, gives DEAD. A binary search over the state's exception edges, else its default."""
    if pool is None:
        return states
    s = jnp.clip(states, 0, pool.default.shape[0] - 1)
    lo, count = pool.starts[s], pool.counts[s]
    end = lo + count
    hi = end
    for _ in range(max(1, int(pool.tokens.shape[0]).bit_length())):
        mid = (lo + hi) // 2
        right = pool.tokens[jnp.clip(mid, 0, pool.tokens.shape[0] - 1)] < tokens
        open_ = lo < hi
        lo, hi = jnp.where(open_ & right, mid + 1, lo), jnp.where(open_ & ~right, mid, hi)
    at = jnp.clip(lo, 0, pool.tokens.shape[0] - 1)
    found = (lo < end) & (pool.tokens[at] == tokens)
    nxt = jnp.where(found, pool.targets[at], pool.default[s])
    nxt = jnp.where(_bit(pool, states, tokens), nxt, DEAD)
    return jnp.where(states >= 0, nxt, jnp.where(states == NONE, NONE, DEAD))


def walk(pool: ConstraintPool | None, states, tokens):
    """states [batch] walked along tokens [batch, T]: [batch, T + 1], the state before each token
    and after the last."""
    if pool is None:
        return jnp.repeat(states[:, None], tokens.shape[1] + 1, axis=1)

    def step(s, t):
        n = advance(pool, s, t)
        return n, n

    _, after = jax.lax.scan(step, states, tokens.T)
    return jnp.concatenate([states[:, None], after.T], axis=1)


def _load(pool: ConstraintPool, region, masks, default, starts, counts, tokens, targets) -> ConstraintPool:
    s, e = masks.shape[0], tokens.shape[0]
    put = lambda buf, new, size: jax.lax.dynamic_update_slice_in_dim(buf, new, region * size, axis=0)
    return pool.replace(masks=put(pool.masks, masks, s), default=put(pool.default, default, s),
                        starts=put(pool.starts, starts, s), counts=put(pool.counts, counts, s),
                        tokens=put(pool.tokens, tokens, e), targets=put(pool.targets, targets, e))


load_region = jax.jit(_load, donate_argnums=(0,))


# --------------------------------------------------------------------------- the host side


def region_arrays(automaton, region: int, states: int, edges: int, vocab_size: int) -> dict[str, np.ndarray]:
    """An automaton (`dflash_jax.constrain.Automaton`) as region `region`'s arrays (global ids),
    padded to the region's states and edges; an InputError naming its size where it does not fit."""
    n = automaton.num_states
    if n > states:
        raise InputError(f"the constraint needs {n} automaton states; this engine holds at most {states} per "
                         f"constraint (--constraint-states)")
    if automaton.masks.shape[1] != -(-vocab_size // 32):
        raise InputError(f"the constraint was compiled for a vocabulary of {automaton.vocab_size} tokens, "
                         f"this target's is {vocab_size}")
    base, ebase = region * states, region * edges
    default = np.full((states,), DEAD, np.int32)
    starts, counts = np.zeros((states,), np.int32), np.zeros((states,), np.int32)
    tokens, targets = [], []
    for s in range(n):
        lo, c = int(automaton.starts[s]), int(automaton.counts[s])
        tok, tgt = automaton.tokens[lo:lo + c], automaton.targets[lo:lo + c]
        if c == 0:
            continue
        common = int(np.bincount(tgt).argmax())  # the next state most of its tokens reach
        default[s] = base + common
        other = tgt != common
        starts[s], counts[s] = ebase + sum(len(t) for t in tokens), int(other.sum())
        tokens.append(tok[other].astype(np.int32))
        targets.append((tgt[other] + base).astype(np.int32))
    used = sum(len(t) for t in tokens)
    if used > edges:
        raise InputError(f"the constraint needs {used} transition exceptions; this engine holds at most {edges} "
                         f"per constraint (--constraint-edges)")
    pad = lambda parts: np.concatenate(parts + [np.zeros((edges - used,), np.int32)])
    masks = np.zeros((states, mask_words(vocab_size)), np.uint32)
    masks[:n] = device_masks(automaton.masks, vocab_size)
    return dict(masks=masks, default=default, starts=starts, counts=counts, tokens=pad(tokens), targets=pad(targets))


class ConstraintRegions:
    """Which automaton each region of the pool holds, which slot's row uses which region, and the
    loads admissions need (host bookkeeping; the engine's thread only). Regions hold automata by
    identity (a `ConstraintCache` gives one object per constraint), shared by rows that ask for
    the same one, kept idle after their rows end, and reused least recently used first."""

    def __init__(self, regions: int, states: int, edges: int, vocab_size: int):
        self.states, self.edges, self.vocab_size = states, edges, vocab_size
        self.held: list = [None] * regions  # the automaton in each region (None: empty)
        self.users = [0] * regions  # rows using each region
        self.slot_region: dict[int, int] = {}
        self.idle: collections.OrderedDict[int, None] = collections.OrderedDict((r, None) for r in range(regions))
        self.loads = 0  # regions loaded so far (a figure for tests and metrics)

    def check(self, automaton) -> None:
        """An InputError where this automaton could never fit a region."""
        region_arrays(automaton, 0, self.states, self.edges, self.vocab_size)

    def admit(self, pool: ConstraintPool, slot: int, automaton) -> tuple[ConstraintPool, int]:
        """Slot `slot`'s new row: the slot's last row gives its region back, the row gets one holding
        `automaton` (loaded here if no region holds it). Returns (pool, the row's initial global
        state); automaton None: (pool, NONE)."""
        self.release(slot)
        if automaton is None:
            return pool, NONE
        region = next((r for r, a in enumerate(self.held) if a is automaton), None)
        if region is None:
            region = next(iter(self.idle))  # least recently used; one is always idle (a region per slot)
            arrays = region_arrays(automaton, region, self.states, self.edges, self.vocab_size)
            pool = load_region(pool, np.int32(region), **arrays)
            self.held[region] = automaton
            self.loads += 1
        self.idle.pop(region, None)
        self.users[region] += 1
        self.slot_region[slot] = region
        return pool, region * self.states + int(automaton.initial)

    def release(self, slot: int) -> None:
        region = self.slot_region.pop(slot, None)
        if region is None:
            return
        self.users[region] -= 1
        if self.users[region] == 0:
            self.idle[region] = None
            self.idle.move_to_end(region)
