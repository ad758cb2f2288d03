"""The platform a program is traced for: the default backend, or the target of an ahead-of-time
compile (`python -m bench --aot` compiles for a TPU on a CPU machine). Code that takes a
different path per platform (the attention implementation, `layers.unfused`) asks here, so an
ahead-of-time compile traces what the chip itself would run."""

from __future__ import annotations

import contextlib
import functools
import os

import jax

_compiling_for: list[str] = []


@contextlib.contextmanager
def compiling_for(platform: str):
    """Trace for `platform` rather than the default backend."""
    _compiling_for.append(platform)
    try:
        yield
    finally:
        _compiling_for.pop()


def target_platform() -> str:
    return _compiling_for[-1] if _compiling_for else jax.default_backend()


# Compiler options for the decoding loop, by platform. On a TPU, memory-space assignment otherwise
# prefetches weights that a step reads once (each layer's o_proj and k_proj) into on-chip memory,
# which buys no bandwidth (the weight crosses HBM once either way) and which the compiler's own cost
# model charges five times: compiled for a v5p, Qwen3-8B's AR step is estimated at 9.65 ms with the
# prefetches and 7.08 ms (1.02x its ideal) without. A copy is made only where a buffer is used a
# thousand times its bytes. DFLASH_TPU_PREFETCH_WEIGHTS=1 (set before importing) keeps the default.
DECODE_COMPILER_OPTIONS: dict[str, dict] = (
    {} if os.environ.get("DFLASH_TPU_PREFETCH_WEIGHTS") == "1"
    else {"tpu": {"xla_tpu_msa_inefficient_use_to_copy_ratio": 1000.0}})


class PlatformJit:
    """`jax.jit(fn, **jit_kwargs)`, compiled with `options[platform]` when traced for that platform
    (`target_platform`: a chip of it, or an ahead-of-time compile for it). Calls, `trace` and `lower`
    go to the jit of the platform traced for; `_cache_size` (what `compiling.compiles` reads) counts
    the programs of them all."""

    def __init__(self, fn, options: dict[str, dict], **jit_kwargs):
        self._default, self._options = jax.jit(fn, **jit_kwargs), dict(options)
        self._by_platform = {p: jax.jit(fn, compiler_options=o, **jit_kwargs) for p, o in options.items()}
        functools.update_wrapper(self, fn)

    def _pick(self):
        return self._by_platform.get(target_platform(), self._default)

    def compiler_options(self) -> dict:
        """The compiler options a call traced now compiles with: those of the platform traced for,
        or none (jax's defaults)."""
        return self._options.get(target_platform(), {})

    def __call__(self, *args, **kwargs):
        return self._pick()(*args, **kwargs)

    def trace(self, *args, **kwargs):
        return self._pick().trace(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self._pick().lower(*args, **kwargs)

    def _cache_size(self) -> int:
        return self._default._cache_size() + sum(j._cache_size() for j in self._by_platform.values())


def decode_jit(**jit_kwargs):
    """Decorator: `PlatformJit` with `DECODE_COMPILER_OPTIONS`."""
    return lambda fn: PlatformJit(fn, DECODE_COMPILER_OPTIONS, **jit_kwargs)
