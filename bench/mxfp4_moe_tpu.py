"""One gpt-oss-120b expert projection at decode, MXFP4 kept against bfloat16, as the TPU compiler sees it.

    pip install -e '.[tpu]'                          # libtpu: compiles for a TPU topology here
    python bench/mxfp4_moe_tpu.py [--topology v5p:1x1x1] [--tokens 8] [--hlo DIR]

gpt-oss-120b: hidden 2880, 128 experts top-4 of width 2880 (gate_up 2880 -> 5760, down 2880 -> 2880).
At `tokens` tokens a step touches at most tokens x 4 experts; each touched expert runs on every
token of the step (`Batched`, the touched-experts form). Compiled ahead of time for one chip
(nothing runs), each projection in these forms:

- `bf16`: bfloat16 kernels, a plain batched dot;
- `mxfp4 materialized`: the MXFP4 arrays dequantized to bfloat16, then the dot;
- `mxfp4 product`: the format's own product (`dflash_jax.model.formats.mxfp4.batched`): a partial dot
  per 64 inputs with the FP4 convert inside it, scaled after;
- `... + take`: the same with the touched experts taken from the whole stack by `Weight.take`
  (`jnp.take`), as the touched-experts path calls it; the others are given the touched experts.

Prints the compiler's estimate, bytes accessed (less prefetched buffers' extra counts), HBM
(arguments + temporaries) and the ideal: the touched experts' weights once at 4.25 bits a weight.
Asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

HIDDEN, EXPERTS, TOP_K, WIDTH = 2880, 128, 4, 2880
FORMS = ("bf16", "mxfp4 materialized", "mxfp4 product", "bf16 + take", "mxfp4 product + take")


def project(x, arrays, ids, *, form, n_out):
    from dflash_jax.model.formats import mxfp4
    from dflash_jax.model.weights import Batched, Weight, project as seam

    k = ids.shape[0]
    xk = jnp.broadcast_to(x, (k,) + x.shape)
    if form.startswith("bf16"):
        w = arrays[""] if "take" not in form else jnp.take(arrays[""], ids, axis=0, mode="clip")
        return jnp.einsum("kmi,kio->kmo", xk, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    weight = Weight(arrays, mxfp4.mxfp4_format(n_out), jnp.bfloat16)
    if "take" in form:
        weight = weight.take(ids)
    if form == "mxfp4 materialized":
        return Batched(jnp.bfloat16)(xk, weight.dense)
    return seam(xk, weight, Batched(jnp.bfloat16))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/mxfp4_moe_tpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:1x1x1", help="a one-chip TPU topology")
    p.add_argument("--tokens", default="8", help="tokens in the step (comma-separated)")
    p.add_argument("--forms", default=",".join(FORMS), help="which forms (comma-separated)")
    p.add_argument("--hlo", type=Path, default=None, help="write each compiled HLO here")
    args = p.parse_args(argv)
    from dflash_jax import aot

    from bench.aot import one_chip

    target, mesh = one_chip(args.topology)
    rate = 2.35e12 if target.chip_name == "v5p" else target.chip.bandwidth  # the compiler's streaming rate (v5p)
    A = functools.partial(aot.abstract_replicated, mesh)
    print(f"TPU {args.topology}: gpt-oss-120b expert projections ({EXPERTS} experts top-{TOP_K}); compiler estimates")
    for tokens in (int(t) for t in args.tokens.split(",")):
        k = min(EXPERTS, tokens * TOP_K)
        for name, (n_in, n_out) in (("gate_up", (HIDDEN, 2 * WIDTH)), ("down", (WIDTH, HIDDEN))):
            ideal = k * n_in * n_out * 4.25 / 8
            print(f"  tokens {tokens}, {name} [{n_in} -> {n_out}], {k} touched experts: ideal {ideal / 1e6:.0f} MB "
                  f"= {ideal / rate * 1e3:.3f} ms")
            for form in args.forms.split(","):
                e = EXPERTS if "take" in form else k
                if form.startswith("bf16"):
                    arrays = {"": A((e, n_in, n_out), jnp.bfloat16)}
                else:
                    from dflash_jax.model.formats.mxfp4 import padded  # as stored: columns padded to whole lanes
                    arrays = {"_blocks": A((e, n_in, padded(n_out)), jnp.float4_e2m1fn),
                              "_scales": A((e, n_in // 32, padded(n_out)), jnp.uint8)}
                x, ids = A((tokens, n_in), jnp.bfloat16), A((k,), jnp.int32)
                r = aot.compile_for_tpu(jax.jit(functools.partial(project, form=form, n_out=n_out)), (x, arrays, ids), args.hlo,
                                        f"{name}-{form.replace(' ', '_').replace('+', 'and')}-{tokens}")
                hbm = r["bytes"] - 4 * r["prefetched"]
                est = f"{r['seconds'] * 1e3:7.3f} ms" if r["seconds"] else "   none"
                print(f"    {form:22s} estimate {est} ({r['seconds'] / (ideal / rate) if r['seconds'] else 0:5.2f}x "
                      f"ideal), {hbm / 1e6:7.0f} MB accessed, HBM {r['memory']['arguments'] / 2**30:5.2f} + "
                      f"{r['memory']['temporaries'] / 2**30:5.2f} GiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
