"""Engine options: how a `BatchEngine` runs (batch, block, draft length, tree, speculation, cache
and page sizes, syncs, mesh, dtype, watchdog), one frozen type checked once and declared only
here: `GenerationJob` holds one (`python -m infer`), `BatchEngine` takes one (its default: these
defaults, every command's), and the flags of `python -m infer`, `python -m infer.serve` and the
bench are made from its fields (`infer.flags.add_engine_flags`, one flag per field, these
defaults; a command whose default differs says so in one `overrides` entry).

    options = EngineOptions(batch_size=16, sync_every=SERVER_SYNC_EVERY)
    gen = BatchEngine.of(pair, options, max_new_tokens=256, max_prompt_len=2048)

A field out of range is an `InputError` naming it by its flag (`--batch-size must be >= 1`).
What depends on the pair is settled once, by `resolve(pair, options)`, before a weight is read:
the block size (the drafter's, or 1), and the cycle this pair can run with these settings
(`dflash_jax.engine.cycles.cycle_kind`, the one home of their rules: --draft-tokens within the
block, a tree the pair can verify, the settings that need a drafter); every command and
`BatchEngine` settle their options there. Limits each command resolves its own way (max_new_tokens: 256, 128
for the demo pair; max_prompt_len: the input's longest prompt for a batch job, the target's
context for the server) are passed to the engine (`BatchEngine.of`), not kept here.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, fields, replace
from typing import NamedTuple

from dflash_jax.config import DTYPES
from dflash_jax.engine.sampling import ACCEPTANCE_RULES
from dflash_jax.engine.speculation import SPECULATION_MODES
from dflash_jax.errors import InputError, flag
from dflash_jax.kv.layout import PAGE_SIZE

# Decoding cycles per host sync. A batch run (`python -m infer`, the bench) syncs every 8 cycles:
# fewer syncs cost the host less, which is throughput. The server syncs every 2: tokens reach
# its clients at each sync, so the inter-token latency stays near a cycle. Each command's flag
# default is one of these (`infer.flags.add_engine_flags(parser, overrides=...)`).
SYNC_EVERY = 8
SERVER_SYNC_EVERY = 2

# Fields that must be integers >= 0.
_NON_NEGATIVE = ("tree_budget", "constraint_states", "constraint_edges", "max_logprobs")
# Fields that must be integers >= 1 when set.
_POSITIVE = ("max_new_tokens", "batch_size", "sync_every", "block_size", "draft_tokens", "max_prompt_len",
             "kv_pages", "page_size", "prefill_chunk", "draft_window")


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs, checked when made (an InputError names the flag). None: the default
    the engine or the command works out (the drafter's block, B-1 drafts, per-row caches, the
    checkpoint's dtype, every device on `data`)."""

    batch_size: int = 8  # rows decoded together (slots)
    block_size: int | None = None  # None: the drafter's; 1 = plain autoregressive decoding
    draft_tokens: int | None = None  # drafts verified per cycle, 1..B-1 (None: B-1)
    tree_budget: int = 0  # draft-tree nodes verified per cycle (0: the chain of draft_tokens)
    acceptance: str = ACCEPTANCE_RULES[0]  # how a DFlash2 drafter's sampled rows accept drafts
    speculation: str | None = SPECULATION_MODES[0]  # "auto": each sync's draft length picked by cost; "fixed"
    # (None: the command's: auto, but fixed for `python -m infer`'s demo on its own prompts)
    draft_window: int | None = None  # the drafter sees each row's last N committed positions (None: all)
    max_new_tokens: int | None = None  # the most a row generates, which sizes the cache (None: the command's)
    max_prompt_len: int | None = None  # longest prompt, which sizes the cache (None: the command's)
    kv_pages: int | None = None  # a shared pool of this many K/V pages (None: per-row caches)
    prefix_cache: str | None = None  # "on" | "off": prompts' cached pages shared (None: on where it works)
    page_size: int = PAGE_SIZE  # K/V positions per page
    sync_every: int = SYNC_EVERY  # decoding cycles per host sync
    narrow_tail: bool = False  # run the batch's tail on narrower loops
    prefill_chunk: int = 512  # longer prompts are prefilled this many tokens at a time (the server)
    mesh: str | None = None  # "data=D,model=M" (None: every device on `data`; one device: no mesh)
    dtype: str | None = None  # "bfloat16" | "float32" (None: the checkpoint's)
    stall_timeout: float = 10.0  # minutes without device progress before a stall error; 0 = never
    constraint_states: int = 0  # automaton states a row's constraint may have (0: no constraints; `engine.constraints`)
    constraint_edges: int = 0  # its transition exceptions (0: `constraints.EDGES_PER_STATE` per state)
    # The most top alternatives a row's logprobs may ask for (`Sampling.logprobs`; 0: no logprobs, nothing
    # computed or stored). No flag: the server sets it (MAX_LOGPROBS), a library caller may.
    max_logprobs: int = 0

    def __post_init__(self):
        for name in _POSITIVE:
            value = getattr(self, name)
            if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
                raise InputError(f"{flag(name)} must be an integer, got {value!r}")
            if value is not None and value < 1:
                raise InputError(f"{flag(name)} must be >= 1, got {value}")
        for name in _NON_NEGATIVE:
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
                raise InputError(f"{flag(name)} must be an integer >= 0, got {value!r}")
        from dflash_jax.engine.cycles import check_settings  # the rules of draft length, tree and acceptance

        check_settings(self.block_size, self.draft_tokens, self.tree_budget, self.acceptance,
                       drafting=False if self.block_size == 1 else None, names=flag)
        if not self.stall_timeout >= 0:
            raise InputError(f"--stall-timeout must be >= 0 minutes, got {self.stall_timeout}")
        if self.speculation is not None and self.speculation not in SPECULATION_MODES:
            raise InputError(f"--speculation must be one of {', '.join(SPECULATION_MODES)}, got {self.speculation!r}")
        if self.prefix_cache not in (None, "on", "off"):
            raise InputError(f"--prefix-cache must be on or off, got {self.prefix_cache!r}")
        if self.prefix_cache == "on" and self.kv_pages is None:
            raise InputError("--prefix-cache on needs a page pool (--kv-pages): it shares the pool's pages")
        if self.prefix_cache == "on" and getattr(self, "draft_window", None):
            raise InputError("--prefix-cache on cannot share the drafter's context as a ring (--draft-window)")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"--dtype must be one of {', '.join(sorted(DTYPES))}, got {self.dtype!r}")

    @classmethod
    def of(cls, source) -> EngineOptions:
        """The options among an object's attributes (parsed flags): each field it has, the default
        for the others."""
        return cls(**{f.name: getattr(source, f.name) for f in fields(cls) if hasattr(source, f.name)})

    def watchdog(self):
        """The stall watchdog of --stall-timeout (None: 0, wait forever)."""
        from dflash_jax.engine.watchdog import Watchdog

        return Watchdog(self.stall_timeout * 60) if self.stall_timeout > 0 else None

    def plain(self) -> EngineOptions:
        """These options for plain decoding (block size 1): the drafter's settings dropped (the
        baseline `python -m infer --compare-baseline` times)."""
        return replace(self, block_size=1, draft_tokens=None, tree_budget=0, draft_window=None)


class PairConfigs(NamedTuple):
    """A pair's configs, what `resolve` reads of a pair (a `ModelPair` has them too)."""

    target: object  # ModelConfig
    drafter: object | None  # DrafterConfig; None: plain decoding


def resolve(pair, options: EngineOptions) -> EngineOptions:
    """The options settled for a pair (anything with `target` and `drafter` configs: a `ModelPair`,
    `PairConfigs`; drafter None: no drafter) and checked against it, before a weight is read:
    the block size the drafter's (or 1 without one, or as given), --draft-tokens within the block,
    a tree one the target and drafter can verify (`cycle_kind`), speculation's default (auto).
    Plain decoding (block size 1, or no drafter) drops the drafter's settings
    (draft_tokens, tree_budget, draft_window); asking for them without a drafter is an InputError.
    Every command (`python -m infer`, the server, the bench) and `BatchEngine` settle options here."""
    from dflash_jax.engine.cycles import check_settings, cycle_kind

    speculation = options.speculation or SPECULATION_MODES[0]
    drafter = pair.drafter if options.block_size != 1 else None
    if drafter is None:
        check_settings(options.block_size, options.draft_tokens, options.tree_budget, options.acceptance,
                       drafting=False, names=flag)
        return replace(options.plain(), speculation=speculation)
    block = options.block_size or drafter.block_size
    cycle_kind(pair.target, drafter, block, options.draft_tokens, options.tree_budget, options.acceptance,
               constrained=options.constraint_states > 0, names=flag)
    return replace(options, block_size=block, speculation=speculation)
