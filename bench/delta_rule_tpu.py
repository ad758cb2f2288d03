"""The chunked gated delta rule as the TPU compiler sees it, on a CPU-only machine.

    pip install "jax[tpu]==<this jax version>"      # libtpu: compiles for a TPU topology here
    python bench/delta_rule_tpu.py [--topology v5p:1x1x1] [--batch 8]

Compiles `delta_rule.chunked` ahead of time for one TPU chip at a Qwen3.5-27B linear layer's
shapes (16 q/k heads x 128, 48 value heads x 128), for a verify (one chunk of 16 positions per
row) and a 1024-token prefill (chunks of 64), and prints the compiler's time estimate
(`optimal_seconds`), flops and bytes accessed, beside the same rule with the chunk systems solved
by `jax.scipy.linalg.solve_triangular` (what the engine used before: a LAPACK call on the CPU, an
opaque custom call on the TPU, so its estimate is missing). Prints; asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
import re
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np


def solve_inverse(lower):
    """(I + L)^-1 through the triangular solve (the reference)."""
    n = lower.shape[-1]
    eye = jnp.broadcast_to(jnp.eye(n, dtype=lower.dtype), lower.shape)
    return jax.scipy.linalg.solve_triangular(eye + lower, eye, lower=True, unit_diagonal=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/delta_rule_tpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:1x1x1", help="a one-chip TPU topology (v5e:1x1, v5p:1x1x1, v6e:1x1)")
    p.add_argument("--batch", type=int, default=8)
    args = p.parse_args(argv)
    from jax.experimental import topologies
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from dflash_jax.model import delta_rule

    bounds = {"v5p": (1, 1, 1)}.get(args.topology.split(":")[0], (1, 1, 1))
    try:
        topo = topologies.get_topology_desc(platform="tpu", topology_name=args.topology, chip_config_name="default",
                                            chips_per_host_bounds=bounds, num_slices=1)
    except Exception as e:  # no libtpu, or an unknown topology
        raise SystemExit(f"error: cannot compile for TPU {args.topology}: {str(e).splitlines()[0]} "
                         "(pip install \"jax[tpu]\" at this jax version)") from None
    mesh = Mesh(np.array(topo.devices).reshape(-1)[:1], ("model",))
    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32, sharding=NamedSharding(mesh, P()))
    b, kh, vh, d = args.batch, 16, 48, 128
    print(f"TPU {args.topology}, Qwen3.5-27B linear layer (q/k {kh}x{d}, values {vh}x{d}), batch {b}, float32")
    for what, t, chunk in (("verify (16 positions)", 16, 16), ("prefill (1024 positions)", 1024, 64)):
        shapes = [sds((b, t, kh, d)), sds((b, t, kh, d)), sds((b, t, vh, d)), sds((b, t, vh)), sds((b, t, vh)),
                  sds((b, vh, d, d))]
        for name, inverse in (("elementwise inverse (ours)", delta_rule.unit_lower_inverse),
                              ("triangular solve", solve_inverse)):
            with mock.patch.object(delta_rule, "unit_lower_inverse", inverse):
                fn = jax.jit(functools.partial(delta_rule.chunked, chunk=chunk))
                compiled = fn.trace(*shapes).lower().compile()
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list) else cost
            seconds = cost.get("optimal_seconds", float("nan"))
            calls = sorted(set(re.findall(r'custom_call_target="([^"]+)"', compiled.as_text())) - {"AllocateBuffer"})
            estimate = f"{seconds * 1e6:9.1f} us" if seconds > 0 else "     none"
            print(f"  {what:25s} {name:27s} estimate {estimate}, {cost.get('flops', 0) / 1e9:6.2f} GFLOP, "
                  f"{cost.get('bytes accessed', 0) / 1e6:8.1f} MB accessed; custom calls: {', '.join(calls) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
