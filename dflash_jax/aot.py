"""Compiling for a TPU topology on any machine, ahead of time: with libtpu installed
(`pip install -e '.[tpu]'`), jax compiles for a TPU's devices without one, and the compiled
executable tells what the chip would do with the program.

- `topology("v5p:1x1x1")`: the topology's chip kind (`Chip`: HBM, bandwidth, peak flops) and
  devices; `mesh_for(topology, "data=2,model=2")`: the project's (data, model) mesh over them.
- `abstract_sharded` / `abstract_replicated`: abstract inputs (nothing allocated) placed on that mesh.
- `compile_for_tpu(fn, args, hlo_dir, name)`: a jitted function traced for the TPU, lowered and
  compiled, and the compiler's figures: its time estimate, flops and bytes (`cost_of`), HBM per
  chip (`memory_of`), the collectives, custom calls and on-chip prefetches in its HLO
  (`collectives_of`, `custom_calls_of`, `prefetched_bytes`); a program that does not fit is a
  result (RESOURCE_EXHAUSTED, with the HBM the compiler asked for), not an error.

`python -m bench --aot` compiles the engine's programs with these, `python -m train --aot`
the training step.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from pathlib import Path

GIB = 1 << 30


@dataclasses.dataclass(frozen=True)
class Chip:
    """A TPU chip kind's figures: what a program's HBM and time are judged against."""

    hbm: int  # bytes per chip
    bandwidth: float  # HBM bytes/s
    flops: float  # peak dense bfloat16 flop/s
    host_bounds: tuple[int, int, int]  # the most chips one host holds along each axis


CHIPS = {
    "v4": Chip(32 * GIB, 1.2e12, 275e12, (2, 2, 1)),
    "v5e": Chip(int(15.75 * GIB), 0.82e12, 197e12, (2, 4, 1)),  # 16 GiB, 15.75 usable (the compiler's figure)
    "v5p": Chip(95 * GIB, 2.76e12, 459e12, (2, 2, 1)),
    "v6e": Chip(32 * GIB, 1.64e12, 918e12, (2, 4, 1)),
}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


class AotError(Exception):
    """A topology that cannot be compiled for: unknown, or no libtpu to compile with."""


@dataclasses.dataclass
class Topology:
    """A TPU topology to compile for: its name, chip kind and devices."""

    name: str
    chip_name: str
    chip: Chip
    devices: list

    @property
    def num_chips(self) -> int:
        return len(self.devices)


def topology(name: str) -> Topology:
    """'v5p:1x1x1', 'v5e:2x2', ... -> its devices, from libtpu (no TPU needed). Raises AotError."""
    kind, _, dims_text = name.partition(":")
    if kind not in CHIPS or not re.fullmatch(r"\d+(x\d+){1,2}", dims_text):
        raise AotError(f"unknown TPU topology {name!r}: give KIND:AxB[xC] with KIND one of {', '.join(CHIPS)} "
                       "(e.g. v5e:2x2, v5p:1x1x1, v5p:2x2x1)")
    dims = tuple(int(d) for d in dims_text.split("x")) + (1,) * (3 - len(dims_text.split("x")))
    # libtpu asks the cloud metadata server where it runs unless told not to (about 20 s here)
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # nor take the lock that keeps a second process off a real chip: nothing runs on one here
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    try:
        from jax.experimental import topologies

        bounds = tuple(min(d, h) for d, h in zip(dims, CHIPS[kind].host_bounds))
        topo = topologies.get_topology_desc(platform="tpu", topology_name=name, chip_config_name="default",
                                            chips_per_host_bounds=bounds, num_slices=1)
    except Exception as e:  # no libtpu, or a topology it does not know
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        try:
            import libtpu  # noqa: F401

            hint = ""
        except ImportError:
            hint = "; install libtpu: pip install -e '.[tpu]'"
        raise AotError(f"cannot compile for TPU {name}: {first}{hint}") from None
    return Topology(name, kind, CHIPS[kind], list(topo.devices))


def mesh_for(target: Topology, text: str | None):
    """The project's (data, model) mesh over the topology's chips; default every chip on model."""
    import numpy as np
    from jax.sharding import AxisType, Mesh

    from dflash_jax.sharding import AXES, parse_mesh

    sizes = parse_mesh(text or f"data=1,model={target.num_chips}", target.num_chips)
    devices = np.array(target.devices).reshape(tuple(sizes[a] for a in AXES))
    return Mesh(devices, AXES, axis_types=(AxisType.Auto,) * len(AXES))


def abstract_sharded(tree, shardings):
    """`tree`'s arrays as abstract arrays (shape, dtype) placed by `shardings` (a matching tree)."""
    import jax

    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings)


def abstract_replicated(mesh, shape, dtype):
    """An abstract array of `shape` and `dtype` replicated over every device of `mesh`."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))


def cost_of(compiled) -> dict:
    """The compiler's estimate (seconds; None where it gives none: a negative sentinel, e.g. for
    an op it has no model of), flops and bytes accessed."""
    ca = compiled.cost_analysis()
    ca = ca[0] if isinstance(ca, (list, tuple)) else ca
    seconds = float(ca.get("optimal_seconds", -1.0))
    return dict(seconds=seconds if seconds > 0 else None, flops=float(ca.get("flops", 0.0)),
                bytes=float(ca.get("bytes accessed", 0.0)))


def memory_of(compiled) -> dict:
    """HBM per chip a compiled program needs: arguments + outputs not aliased to them + temporaries."""
    m = compiled.memory_analysis()
    args, out, alias, temp = (int(getattr(m, f"{k}_size_in_bytes")) for k in ("argument", "output", "alias", "temp"))
    return dict(arguments=args, outputs=out - alias, temporaries=temp, total=args + out - alias + temp)


def collectives_of(hlo: str) -> dict:
    """Count of each collective in a compiled HLO, and the shapes all-gathered."""
    out = {c: len(re.findall(rf"= \S+ {c}(?:-start)?\(", hlo)) for c in COLLECTIVES}
    out["all_gathered"] = sorted(set(re.findall(r"= (\S+) all-gather(?:-start)?\(", hlo)))[:20]
    return out


_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "f32": 4, "s32": 4, "u32": 4}


def prefetched_bytes(hlo: str) -> int:
    """Bytes the scheduled HLO copies into on-chip memory ahead of use (`copy-start` into memory
    space 1: the compiler prefetching weights into VMEM). The cost analysis counts such a buffer
    five times, as if every on-chip move were HBM traffic: compiled for a v5p, a chain of n
    batch-8 matvecs over separate [4096, 4096] weights, p of them prefetched, is counted at
    exactly n + 4p weights (n = 1..16). The chip reads it from HBM once."""
    total = 0
    for m in re.finditer(r"copy-start\.?\d* = \((\w+)\[([\d,]*)\]\{[^}]*S\(1\)\}", hlo):
        n = 1
        for dim in m.group(2).split(","):
            n *= int(dim) if dim else 1
        total += n * _DTYPE_BYTES.get(m.group(1), 4)
    return total


def custom_calls_of(hlo: str) -> list[str]:
    """The custom calls (kernels) a compiled HLO makes, by target name."""
    return sorted(set(re.findall(r'custom_call_target="([^"]+)"', hlo)) - {"AllocateBuffer"})


def compile_for_tpu(fn, args, hlo_dir: Path | None, name: str, **static) -> dict:
    """Compile a jitted function for a TPU, for abstract args (and static keyword arguments):
    its figures (`compiled`, `compile_seconds`, `cost_of`'s, `prefetched`, `memory`, `collectives`,
    `custom_calls`, `while_loops`), or, where it does not fit in HBM, `compiled=False` with the
    compiler's `error` and the HBM it `asked` for. `hlo_dir`: write the scheduled HLO there as
    `{name}.hlo.txt`. Other compile errors raise."""
    from dflash_jax.platform import compiling_for

    t = time.perf_counter()
    try:
        with compiling_for("tpu"):
            compiled = fn.trace(*args, **static).lower().compile()
    except Exception as e:  # jax raises XlaRuntimeError; only running out of HBM is a result
        text = str(e)
        if "RESOURCE_EXHAUSTED" not in text:
            raise
        asked = re.search(r"\(([\d.]+[GM])\) exceeds available HBM \(([\d.]+[GM])\)", text)
        return dict(compiled=False, error=text.strip().splitlines()[0][:400],
                    asked=f"needs {asked.group(1)} of {asked.group(2)} HBM" if asked else None,
                    compile_seconds=time.perf_counter() - t)
    seconds = time.perf_counter() - t
    hlo = compiled.as_text()
    if hlo_dir is not None:
        hlo_dir.mkdir(parents=True, exist_ok=True)
        (hlo_dir / f"{name}.hlo.txt").write_text(hlo)
    return dict(compiled=True, compile_seconds=seconds, **cost_of(compiled), prefetched=prefetched_bytes(hlo),
                memory=memory_of(compiled),
                collectives=collectives_of(hlo), custom_calls=custom_calls_of(hlo),
                while_loops=len(re.findall(r"\bwhile\(", hlo)))
