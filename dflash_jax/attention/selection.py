"""Which implementation serves an attention call, and why: `select` holds every rule in one
list, and `override` is the one documented way to choose another (benchmarks and tests).

Implementations (`IMPLEMENTATIONS`, name -> module with `attend(q, cache, meta, **options)`):
- "walk":   `walk`, the portable page walk: the reference, the CPU path, and every fallback;
- "cudnn":  `cudnn`, one fused cuDNN attention over the layer's cache (a GPU's default);
- "pallas": `pallas_tpu`, the Pallas kernel (a TPU's default; off a TPU, TPU interpret mode).
Only this module knows them all; they do not import each other.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

import jax
import jax.numpy as jnp

from dflash_jax.attention.metadata import AttentionMetadata, LayerKV

IMPLEMENTATIONS = {"walk": "dflash_jax.attention.walk", "cudnn": "dflash_jax.attention.cudnn",
                   "pallas": "dflash_jax.attention.pallas_tpu"}
BY_PLATFORM = {"gpu": "cudnn", "tpu": "pallas"}  # every other platform: the walk

_override: contextvars.ContextVar[tuple[str, dict] | None] = contextvars.ContextVar("attention_override", default=None)


@contextlib.contextmanager
def override(name: str, /, **options):
    """Inside the block, attention calls traced prefer implementation `name` to the platform's, and call it
    with `options` (its keyword arguments) when it serves. The fallback rules still apply: an
    implementation is never given a call it cannot serve. For benchmarks and tests:

        with attention.override("walk"): ...                            # the TPU bench's walk figures
        with attention.override("pallas", expected_live=context): ...   # the kernel's cost estimate
                                                                        # charges `context` positions
        with attention.override("cudnn", implementation="xla"): ...     # the GPU path on a CPU
        with attention.override("pallas", interpret=...): ...           # the kernel in interpret mode

    The choice is made when a call is traced: a jitted function already traced outside the block
    keeps its earlier choice from jax's cache (trace a fresh function, or `jax.clear_caches()`).
    """
    assert name in IMPLEMENTATIONS, name
    token = _override.set((name, options))
    try:
        yield
    finally:
        _override.reset(token)


def _cudnn_rules(meta: AttentionMetadata, q, cache: LayerKV, options: dict) -> list[tuple[bool, str]]:
    return [
        (meta.sinks is not None, "cuDNN has no attention sinks"),
        (meta.latent, "a latent cache: cuDNN takes keys whole from one buffer"),
        (meta.selected is not None, "sparse attention's selected positions: cuDNN has no per-key mask"),
        (meta.mask == "block", "cuDNN cannot add uncached block keys with their own mask"),
        (meta.rows is not None, "prefill into chosen rows: a row gather would copy their caches"),
        (meta.pages is not None, "a page pool: a row's keys are not contiguous"),
        (meta.ring, "a ring: a row's keys are not in position order"),
        (options.get("implementation", "cudnn") == "cudnn" and q.dtype not in (jnp.bfloat16, jnp.float16),
         "cuDNN's fused kernels are bfloat16/float16"),
    ]


def _pallas_rules(meta: AttentionMetadata, q, cache: LayerKV, options: dict) -> list[tuple[bool, str]]:
    sparse = [(meta.selected is not None, "sparse attention's selected positions: the kernel masks by position "
                                          "limits only")]
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty or mesh.size == 1 or "data" not in mesh.axis_names or mesh.shape["data"] == 1:
        return sparse
    n, batch = q.shape[0], cache.k.shape[1]
    split = (n if meta.pages is not None else batch) % mesh.shape["data"] == 0
    return [
        (split and meta.rows is not None, "chosen rows with rows split over `data`: a row's cache may be on "
                                          "another device"),
        (split and meta.pages is not None, "a page pool with rows split over `data`: the pool is not split"),
        (split and n != batch, "queries for fewer rows than the cache, split over `data`"),
    ] + sparse


RULES = {"cudnn": _cudnn_rules, "pallas": _pallas_rules}


def select(meta: AttentionMetadata, q, cache: LayerKV, platform: str) -> tuple[str, str]:
    """(implementation, reason) for a call traced for `platform` (`dflash_jax.platform`): the
    overriding one or the platform's, unless one of its rules sends the call to the walk."""
    current = _override.get()
    if current is not None:
        name, options, why = current[0], current[1], "override"
    else:
        name, options, why = BY_PLATFORM.get(platform, "walk"), {}, f"the {platform} default"
    for applies, reason in RULES.get(name, lambda *_: [])(meta, q, cache, options):
        if applies:
            return "walk", f"{name} cannot serve it: {reason}"
    return name, why


def run(q, cache: LayerKV, meta: AttentionMetadata, platform: str):
    """The selected implementation's output for the call."""
    name, _ = select(meta, q, cache, platform)
    current = _override.get()
    options = current[1] if current is not None and current[0] == name else {}
    return importlib.import_module(IMPLEMENTATIONS[name]).attend(q, cache, meta, **options)
