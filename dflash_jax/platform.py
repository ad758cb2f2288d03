"""The platform a program is traced for: the default backend, or the target of an ahead-of-time
compile (`python -m infer.bench --aot` compiles for a TPU on a CPU machine). Code that takes a
different path per platform (the attention implementation, `layers.unfused`) asks here, so an
ahead-of-time compile traces what the chip itself would run."""

from __future__ import annotations

import contextlib

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
