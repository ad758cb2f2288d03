"""Pieces of bench/device_check.sh that are not a `python -m bench` mode.

  exactness  the backend's attention path (on a GPU: cuDNN, `dflash_jax.attention.cudnn`)
             against the portable page walk, bfloat16, at decode / verify / prefill-chunk shapes
             of the published heads (GQA 32/8 x 128, 64/8 x 64, 32/16 x 256) and a sliding window
  roofline   an AR step's and a DFlash cycle's measured milliseconds (a --published-shapes JSON)
             against the HBM roofline of the ideal bytes (weights once, K/V in use once)
"""

from __future__ import annotations

import argparse
import functools
import json
import sys


def exactness(tiny: bool) -> int:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dflash_jax.attention import AttentionMetadata, LayerKV, attend, override, select

    def call(q, q_pos, k, v, window):
        return attend(q, None, None, LayerKV(k, v, 0), AttentionMetadata.causal(q_pos, window=window))[0]

    shapes = [(8, 4, 128), (8, 8, 64), (16, 2, 256)] if not tiny else [(2, 2, 64)]  # kv heads, groups, head_dim
    length = 2048 if not tiny else 256
    worst, printed = 0.0, False
    for kv, groups, d in shapes:
        for t, window in ((1, None), (16, None), (16, 128), (64, None)):
            rs = np.random.RandomState(t + d)
            n = 4
            offsets = rs.randint(0, length - t, n)
            q_pos = jnp.asarray(offsets[:, None] + np.arange(t)[None, :])
            k = jnp.asarray(rs.randn(1, n, length, kv * d), jnp.bfloat16)  # a position's heads one row, as cached
            v = jnp.asarray(rs.randn(1, n, length, kv * d), jnp.bfloat16)
            q = jnp.asarray(rs.randn(n, t, kv, groups, d), jnp.bfloat16)
            name, reason = select(AttentionMetadata.causal(q_pos, window=window), q, LayerKV(k, v, 0),
                                  jax.default_backend())
            if not printed:  # the path of the first shape (the rest take the same unless a rule says otherwise)
                print(f"backend {jax.default_backend()}: attention path {name} ({reason})")
                printed = True
            got = jax.jit(functools.partial(call, window=window))(q, q_pos, k, v)
            with override("walk"):
                ref = jax.jit(functools.partial(call, window=window))(q, q_pos, k, v)
            err = float(jnp.max(jnp.abs(got - ref)))
            worst = max(worst, err)
            print(f"  kv {kv} x groups {groups} x head_dim {d}, {t} queries, window {window}: max |diff| {err:.2e}")
    ok = worst < 2e-2  # bfloat16 inputs, float32 softmax in both: rounding of the probabilities only
    print(f"exactness: worst {worst:.2e} ({'ok' if ok else 'FAILED'}, bound 2e-2)")
    return 0 if ok else 1


def roofline(path: str, bandwidth: float | None) -> int:
    import jax

    from bench.cost import abstract_inputs, ideal_bytes
    from dflash_jax.engine import EngineSpec, Sampling
    from dflash_jax.shapes import published_configs

    r = json.load(open(path))["published_shapes"]
    kind = jax.devices()[0].device_kind
    bw = bandwidth or {"NVIDIA H200": 4.8e12, "NVIDIA H100 80GB HBM3": 3.35e12}.get(kind, 3.35e12)
    target, drafter = published_configs(r["scale"], r["dtype"], r.get("shape", "qwen3-8b"))
    batch, context = r["batch_size"], r["context"]
    common = dict(target=target, sampling=Sampling(), max_new_tokens=64)
    for name, spec, seconds in (
            ("AR step", EngineSpec(drafter=None, block_size=1, cache_len=context + 2, **common), r["ar_step_s"]),
            ("DFlash cycle", EngineSpec(drafter=drafter, block_size=drafter.block_size,
                                        cache_len=context + 2 * drafter.block_size, **common), r["cycle_s"])):
        tp, dp, _, _ = abstract_inputs(spec, batch, context)
        ideal = ideal_bytes(spec, tp, dp, batch, context)["bytes"]
        print(f"  {name:13s} {seconds * 1e3:8.3f} ms measured; ideal {ideal / 1e9:.2f} GB at {bw / 1e12:.2f} TB/s = "
              f"{ideal / bw * 1e3:.3f} ms; ratio {seconds / (ideal / bw):.2f}x")
    print(f"  cycle / step {r['cycle_s'] / r['ar_step_s']:.2f}; projected speedup at tau {r['paper_tau']}: "
          f"{r['paper_tau'] * r['ar_step_s'] / r['cycle_s']:.2f}x ({kind})")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.device_check", description=__doc__.splitlines()[0])
    p.add_argument("part", choices=("exactness", "roofline"))
    p.add_argument("--tiny", action="store_true", help="exactness: small shapes (a CPU run of the script)")
    p.add_argument("--json", help="roofline: the JSON of python -m bench --published-shapes")
    p.add_argument("--bandwidth", type=float, help="roofline: HBM bytes/s (default by device kind; H200 4.8e12)")
    a = p.parse_args(argv)
    if a.part == "exactness":
        return exactness(a.tiny)
    if not a.json:
        p.error("roofline needs --json")
    return roofline(a.json, a.bandwidth)


if __name__ == "__main__":
    sys.exit(main())
