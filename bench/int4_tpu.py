"""One INT4 projection at decode (compressed-tensors `pack-quantized`, group 32, as Kimi-K2.5's experts),
as the TPU compiler sees it.

    pip install -e '.[tpu]'                          # libtpu: compiles for a TPU topology here
    python bench/int4_tpu.py [--topology v5p:1x1x1] [--tokens 8,64] [--shape 7168,2048] [--hlo DIR]

x [tokens, in] bfloat16 times one weight [in, out] (default [7168, 2048]: an expert's gate or up
projection), compiled ahead of time for one chip (nothing runs), in these forms:

- `bf16`: the weight in bfloat16, one dot (what the checkpoint dequantized at load costs);
- `int4 materialize`: the weight as `dflash_jax.model.formats.int4` keeps it (int32 words of eight
  4-bit values [in / 8, out], a bfloat16 scale per 32 inputs [in / 32, out]), unpacked and scaled
  (`materialize`) in the program, then one dot: the engine's form;
- `int4 group-dot`: the engine's form (`group_dot`): the words bitcast to int4, one partial dot per
  group of 32 inputs with the int4 -> bfloat16 convert in the dot's operand, each partial scaled
  after it and summed, as the FP8 benchmark's `block_dot`;
- `int4 shift group-dot`: the same partial dots with the values unpacked by shifts and masks and
  laid out as rows of the weight first (the obvious unpack, for comparison).

Prints the compiler's estimate (`optimal_seconds`), bytes accessed (less the extra counts of
prefetched buffers, `dflash_jax.aot.prefetched_bytes`), the ideal (the stored weight read once at
the compiler's streaming rate) and HBM (arguments + temporaries: a temporary the size of the dense
weight means it was written out, not fused). Asserts nothing.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp

GROUP = 32


def forward(x, w, *, form: str):
    from dflash_jax.model.formats.int4 import group_dot, materialize

    if form == "bf16":
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    if form == "int4 materialize":
        return jnp.dot(x, materialize(w, jnp.bfloat16), preferred_element_type=jnp.float32).astype(jnp.bfloat16)
    if form == "int4 group-dot":
        return group_dot(x, w, jnp.bfloat16).astype(jnp.bfloat16)
    return shift_group_dot(x, w).astype(jnp.bfloat16)


def shift_group_dot(x, w):
    shifts = jnp.arange(0, 32, 4, dtype=jnp.int32)[:, None]
    packed, scale = w["_packed"], w["_scale"]
    q = (jnp.right_shift(packed[:, None, :], shifts) & 0xF) - 8  # [in / 8, 8, out]
    n_in, groups = packed.shape[0] * 8, scale.shape[0]
    q = q.reshape(groups, n_in // groups, -1).astype(jnp.bfloat16)
    partial = jnp.einsum("...gi,gio->...go", x.reshape(*x.shape[:-1], groups, n_in // groups), q,
                         preferred_element_type=jnp.float32)
    return (partial * scale.astype(jnp.float32)).sum(-2)


FORMS = ("bf16", "int4 materialize", "int4 group-dot", "int4 shift group-dot")


def weight(mesh, form: str, n_in: int, n_out: int):
    from dflash_jax.aot import abstract_replicated

    if form == "bf16":
        return abstract_replicated(mesh, (n_in, n_out), jnp.bfloat16)
    return {"_packed": abstract_replicated(mesh, (n_in // 8, n_out), jnp.int32),
            "_scale": abstract_replicated(mesh, (n_in // GROUP, n_out), jnp.bfloat16)}


def stored_bytes(form: str, n_in: int, n_out: int) -> float:
    return n_in * n_out * (2 if form == "bf16" else 0.5 + 2 / GROUP)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/int4_tpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:1x1x1", help="a one-chip TPU topology (v5p:1x1x1, v6e:1x1, ...)")
    p.add_argument("--tokens", default="8", help="tokens in the step (comma-separated)")
    p.add_argument("--shape", default="7168,2048", help="the weight's in,out")
    p.add_argument("--forms", default=",".join(FORMS), help="which forms (comma-separated)")
    p.add_argument("--hlo", type=Path, default=None, help="write each compiled HLO here")
    args = p.parse_args(argv)
    from dflash_jax import aot

    from bench.aot import one_chip

    target, mesh = one_chip(args.topology)
    n_in, n_out = (int(v) for v in args.shape.split(","))
    rate = 2.35e12 if target.chip_name == "v5p" else target.chip.bandwidth  # the compiler's streaming rate (v5p)
    print(f"TPU {args.topology}: x [tokens, {n_in}] @ W [{n_in}, {n_out}]; compiler estimates, nothing ran")
    for tokens in (int(t) for t in args.tokens.split(",")):
        for form in args.forms.split(","):
            x = aot.abstract_replicated(mesh, (tokens, n_in), jnp.bfloat16)
            r = aot.compile_for_tpu(jax.jit(functools.partial(forward, form=form)), (x, weight(mesh, form, n_in, n_out)),
                                    args.hlo, f"{form.replace(' ', '_')}-{tokens}")
            hbm_bytes = r["bytes"] - 4 * r["prefetched"]  # a prefetched buffer is counted five times
            ideal = stored_bytes(form, n_in, n_out)
            est = f"{r['seconds'] * 1e6:7.1f} us" if r["seconds"] else "   none"
            print(f"  tokens {tokens:3d} {form:20s} estimate {est} (ideal {ideal / rate * 1e6:6.1f} us: "
                  f"{ideal / 1e6:5.2f} MB stored), {hbm_bytes / 1e6:6.2f} MB accessed "
                  f"({r['prefetched'] / 1e6:.2f} MB prefetched), HBM {r['memory']['arguments'] / 1e6:5.2f} + "
                  f"{r['memory']['temporaries'] / 1e6:5.2f} MB; custom calls: {', '.join(r['custom_calls']) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
