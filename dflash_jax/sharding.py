"""Device meshes and the one table that says how every array is laid out on them.

Axes: `data` (batch rows: data parallelism) and `model` (attention heads, MLP width,
vocabulary and experts: tensor and expert parallelism). Every parameter, cache and activation names its
dimensions with *logical* axes (`batch`, `heads`, `kv_heads`, `mlp`, `vocab`, `embed`, ...);
`LOGICAL_RULES` maps those onto mesh axes. Without a mesh everything here is a no-op, so
the same code runs on one CPU and on a pod slice through jit + NamedSharding.
"""

from __future__ import annotations

import contextlib
import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from dflash_jax.errors import DFlashError

AXES = ("data", "model")

# logical axis -> mesh axis (None: replicated)
LOGICAL_RULES: dict[str, str | None] = {
    "batch": "data",
    "heads": "model",
    "kv_heads": "model",
    "mlp": "model",
    "vocab": "model",
    "expert": "model",  # MoE: each device holds whole experts (its width is not split)
    "expert_mlp": None,
    "embed": None,
    "taps_embed": None,
    "layers": None,
    "length": None,
    "head_dim": None,
}

# Parameter name (last two path entries, regex) -> logical axes of its dimensions.
PARAM_AXES: tuple[tuple[str, tuple[str | None, ...]], ...] = (
    (r"embed_tokens/embedding", ("vocab", "embed")),
    (r"lm_head/kernel", ("embed", "vocab")),
    (r"q_proj/kernel", ("embed", "heads")),
    (r"[kv]_proj/kernel", ("embed", "kv_heads")),
    (r"o_proj/kernel", ("heads", "embed")),
    (r"q_proj/bias", ("heads",)),
    (r"[kv]_proj/bias", ("kv_heads",)),
    (r"o_proj/bias", ("embed",)),
    (r"experts/(gate|up|gate_up)_proj", ("expert", "embed", "expert_mlp")),
    (r"experts/down_proj", ("expert", "expert_mlp", "embed")),
    (r"experts/\w+_bias", ("expert", None)),
    (r"experts/\w+_proj_(blocks|scales)", ("expert", None, None)),  # MXFP4 kept: split by expert as the kernel
    (r"router/kernel", ("embed", None)),
    (r"router/bias", (None,)),
    (r"self_attn/sinks", ("heads",)),
    # Multi-head latent attention: the down projections and the latent are whole on every device;
    # the up projections (and kv_b_proj, each head's key and value halves) split by head.
    (r"(q_a_proj|kv_a_proj_with_mqa)/kernel", ("embed", None)),
    (r"(q_b_proj|kv_b_proj)/kernel", (None, "heads")),
    (r"mlp/e_score_correction_bias", (None,)),
    (r"(wq_b|weights_proj)/kernel", (None, None)),  # the sparse-attention indexer: small, whole everywhere
    # Gated delta-net layers: projections split by head like attention's (in_proj_qkv's
    # [q | k | v] output is split as one axis; XLA regroups it after the convolution).
    (r"in_proj_(qkv|z)/kernel", ("embed", "heads")),
    (r"out_proj/kernel", ("heads", "embed")),
    (r"(gate|up)_proj/kernel", ("embed", "mlp")),
    (r"(gate|up)_proj/bias", ("mlp",)),
    (r"down_proj/kernel", ("mlp", "embed")),
    (r"down_proj/bias", ("embed",)),
    (r"fc/kernel", ("taps_embed", "embed")),
    (r"\w+/weight", (None,)),  # norms
)

# The KV cache's arrays name their logical axes themselves: `KVCache.logical_axes`.


class MeshError(DFlashError):
    pass


def parse_mesh(text: str | None, num_devices: int | None = None) -> dict[str, int]:
    """"data=2,model=4" -> {"data": 2, "model": 4}. An axis not named is 1, except `data`,
    which takes the devices left over (as does an axis given as -1)."""
    n = num_devices or jax.device_count()
    sizes = {}
    for part in filter(None, (text or "").split(",")):
        if "=" not in part:
            raise MeshError(f"mesh entry {part!r} is not axis=size (axes: {', '.join(AXES)})")
        name, value = part.split("=", 1)
        if name.strip() not in AXES:
            raise MeshError(f"unknown mesh axis {name.strip()!r}; axes: {', '.join(AXES)}")
        try:
            sizes[name.strip()] = int(value)
        except ValueError:
            raise MeshError(f"mesh axis {name.strip()} has size {value!r}, not an integer") from None
    sizes.setdefault("data", -1)
    sizes.setdefault("model", 1)
    free = [a for a, s in sizes.items() if s == -1]
    if len(free) > 1:
        raise MeshError("at most one mesh axis may be -1")
    fixed = math.prod(s for s in sizes.values() if s != -1)
    if free:
        if n % fixed:
            raise MeshError(f"{n} devices do not divide into a mesh of {sizes}")
        sizes[free[0]] = n // fixed
    if math.prod(sizes.values()) != n:
        raise MeshError(f"mesh {sizes} needs {math.prod(sizes.values())} devices, {n} are present")
    return sizes


def tracing_on(mesh: Mesh | None):
    """Context for tracing under `mesh` (`jax.sharding.use_abstract_mesh`), so that layers which
    split work by hand over it (shard_maps: the TPU attention kernel, the MoE experts) see it;
    without a mesh, a context that changes nothing."""
    return contextlib.nullcontext() if mesh is None else jax.sharding.use_abstract_mesh(mesh.abstract_mesh)


def make_mesh(text: str | None = None) -> Mesh:
    sizes = parse_mesh(text)
    # Auto axes: jit + NamedSharding propagate layouts (GSPMD); we annotate, XLA partitions.
    return jax.make_mesh(tuple(sizes[a] for a in AXES), AXES, axis_types=(AxisType.Auto,) * len(AXES))


def logical_spec(axes: Sequence[str | tuple[str, int] | None], shape: Sequence[int] | None = None,
                 mesh: Mesh | None = None) -> P:
    """PartitionSpec of logical axes. A dimension that the mesh axis does not divide is
    replicated (e.g. 2 KV heads on a model axis of 4). An axis given as (name, units) holds that
    many whole units (a cache row's K/V heads, each head_dim wide) and splits only where the mesh
    axis divides the units."""
    out = []
    for i, name in enumerate(axes):
        units = None
        if isinstance(name, tuple):
            name, units = name
        axis = LOGICAL_RULES.get(name) if name else None
        size = units if units is not None else (shape[i] if shape is not None else None)
        if axis is not None and mesh is not None and size is not None and size % mesh.shape[axis]:
            axis = None
        out.append(axis)
    return P(*out)


# A weight format's stored arrays beside (or instead of) the weight (FP8's `kernel_scale_inv`, a scale
# per block; INT4's `_packed` words and `_scale` per group; MXFP4's `_blocks` and `_scales`), each of
# the weight's dimensions (fewer rows), lie out as their weight does: an expert's on the expert's
# device, a dimension the mesh axis does not divide whole (`logical_spec`).
SCALE_SUFFIXES = ("_scale_inv", "_packed", "_scale", "_blocks", "_scales")


def param_axes(path: tuple[str, ...], ndim: int) -> tuple[str | None, ...]:
    key = "/".join(path[-2:])
    for pattern, axes in PARAM_AXES:
        if re.fullmatch(pattern, key) and len(axes) == ndim:
            return axes
    for suffix in SCALE_SUFFIXES:
        if path and path[-1].endswith(suffix):
            return param_axes(path[:-1] + (path[-1].removesuffix(suffix),), ndim)
    return (None,) * ndim


def _path_keys(path) -> tuple[str, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", str(k))) for k in path)


def param_shardings(abstract, mesh: Mesh, *, over_data: bool = False):
    """NamedSharding per parameter of a (ShapeDtypeStruct) tree. over_data: each also split over
    `data` (split_over_data), for training with data parallelism (FSDP)."""
    def one(path, leaf):
        axes = param_axes(_path_keys(path), len(leaf.shape))
        sharding = NamedSharding(mesh, logical_spec(axes, leaf.shape, mesh))
        return split_over_data(sharding, leaf.shape) if over_data else sharding

    return jax.tree_util.tree_map_with_path(one, abstract)


def split_over_data(sharding: NamedSharding, shape: Sequence[int]) -> NamedSharding:
    """The sharding with its largest dimension that no mesh axis splits yet (and `data` divides)
    split over `data` as well: an array that is otherwise replicated over data-parallel replicas,
    held once across them (FSDP / ZeRO style). Unchanged when no dimension qualifies."""
    mesh, n = sharding.mesh, sharding.mesh.shape["data"]
    spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
    free = [i for i, size in enumerate(shape) if spec[i] is None and size % n == 0]
    if n == 1 or not free:
        return sharding
    spec[max(free, key=lambda i: shape[i])] = "data"
    return NamedSharding(mesh, P(*spec))


def shard_params(params, mesh: Mesh | None):
    if mesh is None:
        return params
    return jax.device_put(params, param_shardings(jax.eval_shape(lambda: params), mesh))


def sharding_of(mesh: Mesh, axes: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
    return NamedSharding(mesh, logical_spec(axes, shape, mesh))


def constrain(x, mesh: Mesh | None, axes: Sequence[str | None]):
    """with_sharding_constraint by logical axes; identity without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, sharding_of(mesh, axes, x.shape))


def put_batch(x, mesh: Mesh | None, axes: Sequence[str | None] = ("batch",)):
    """Place a host array whose first axis is the (global) batch on the mesh."""
    if mesh is None:
        return jax.numpy.asarray(x)
    axes = tuple(axes) + (None,) * (np.ndim(x) - len(axes))
    return jax.device_put(x, sharding_of(mesh, axes, np.shape(x)))


def to_host(x):
    """numpy value of an array that may span devices of other processes."""
    if jax.process_count() > 1 and isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


def global_batch(local, mesh: Mesh | None, axes: Sequence[str | None] = ("batch",)):
    """This process's rows of a batch -> one global array sharded over `data`."""
    if mesh is None:
        return jax.numpy.asarray(local)
    axes = tuple(axes) + (None,) * (np.ndim(local) - len(axes))
    return jax.make_array_from_process_local_data(sharding_of(mesh, axes, np.shape(local)), local)


def init_distributed(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, auto: bool = False) -> bool:
    """Join a multi-process run: from arguments, else JAX_COORDINATOR_ADDRESS /
    JAX_NUM_PROCESSES / JAX_PROCESS_ID, else (auto) the cluster's own detection (TPU pods,
    SLURM). Returns whether this is a multi-process run."""
    import os

    coordinator = coordinator or os.environ.get("JAX_COORDINATOR_ADDRESS")
    num_processes = num_processes or (int(os.environ["JAX_NUM_PROCESSES"]) if os.environ.get("JAX_NUM_PROCESSES") else None)
    if process_id is None and os.environ.get("JAX_PROCESS_ID"):
        process_id = int(os.environ["JAX_PROCESS_ID"])
    if coordinator is None and not auto:
        return False
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get("JAX_PLATFORMS", "") == "cpu":
        # CPU processes talk through gloo (the default CPU client has no collectives).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # And compile afresh: jax writes persistent-cache entries from process 0 only, under keys
        # that differ per process, so with a warm cache process 0 loads programs that the others
        # compile, and gloo then pairs their collectives wrongly ("collective mismatch: 36864 vs
        # 512", a killed-and-resumed two-process training run, tests/test_scale.py).
        jax.config.update("jax_enable_compilation_cache", False)
    jax.distributed.initialize(coordinator, num_processes, process_id)
    return jax.process_count() > 1
