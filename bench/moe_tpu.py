"""The engine's MoE block (`dflash_jax.model.moe.MoE`), one layer of a published target, as the TPU compiler sees it.

    pip install -e '.[tpu]'                          # libtpu: compiles for a TPU topology here
    python bench/moe_tpu.py [--shape deepseek-v3] [--tokens 1,8,16,32] [--paths auto,touched,grouped]
                            [--format dense] [--topology v5p:1x1x1] [--hlo DIR]

One sparse layer of `--shape` (a published shape: deepseek-v3, kimi-k2.5, glm-5.1, gpt-oss-120b,
qwen3-30b-a3b, minimax-m2, ...), its weights stored in `--format` (a registered weight format:
`ModelConfig.weight_format`; the router stays dense), bfloat16 activations, compiled ahead of time
for one chip (nothing runs) at each token count, by path:

- `auto`: the engine's choice (`moe.touched_path`: the touched experts while tokens x top_k <
  experts, else the grouped matmuls);
- `touched`: forced, each distinct expert the step routes to picked from the stack in its stored
  format and run over every token of the step (`moe.touched_mlp`; every expert once N x k reaches
  the experts);
- `grouped`: forced, `ragged_dot` over the whole stack (`moe._grouped_mlp`);
- `tiled`: forced, the routed rows sorted by expert in tiles of `moe.TILE_ROWS`, one product a tile
  (`moe.tiled_mlp`).

Prints the compiler's estimate (`optimal_seconds`), bytes accessed (less the extra counts of
prefetched buffers), and the ideal: the layer's weights a step must read once at their stored
bytes (router, shared expert, and min(experts, tokens x top_k) experts, each at the stored bytes
of one expert: its share of the stacks' arrays, scales included), at the compiler's streaming
rate (v5p: 2.35 TB/s). Asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, when run as a script

PATHS = ("auto", "touched", "grouped", "tiled")


def layer_config(shape: str, weight_format: str):
    """One sparse layer of a published shape, bfloat16, its weights in `weight_format`."""
    from dflash_jax.families import model_config
    from dflash_jax.shapes import PUBLISHED_TARGETS

    if shape not in PUBLISHED_TARGETS:
        raise SystemExit(f"error: unknown shape {shape!r}; choose one of {', '.join(PUBLISHED_TARGETS)}")
    config = model_config(PUBLISHED_TARGETS[shape], dtype="bfloat16")
    if config.moe is None:
        raise SystemExit(f"error: {shape} has no mixture-of-experts layer")
    if weight_format == "mxfp4":  # a format per out width (`mxfp4.format_name`): the experts' projections by theirs
        from dflash_jax.model.formats import mxfp4

        widths = {"gate_up_proj": 2 * config.moe.intermediate_size, "gate_proj": config.moe.intermediate_size,
                  "up_proj": config.moe.intermediate_size, "down_proj": config.hidden_size}
        return config.replace(weight_format=tuple((f"*experts/{name}", mxfp4.mxfp4_format(n).name)
                                                  for name, n in widths.items()))
    return config.replace(weight_format=weight_format)


def compile_layer(config, tokens: int, path: str, mesh, hlo, name):
    """The MoE block at `tokens` tokens, compiled for the mesh's chip, on `path` (auto: the engine's choice)."""
    from dflash_jax import aot
    from dflash_jax.model import MoE
    from dflash_jax.model import moe as moe_module

    x = aot.abstract_replicated(mesh, (1, tokens, config.hidden_size), jnp.bfloat16)
    shapes = jax.eval_shape(lambda: MoE(config).init(jax.random.PRNGKey(0), jnp.zeros(x.shape, x.dtype)))["params"]
    params = jax.tree.map(lambda a: aot.abstract_replicated(mesh, a.shape, a.dtype), shapes)
    fn = jax.jit(lambda params, x: MoE(config).apply({"params": params}, x))
    with contextlib.nullcontext() if path == "auto" else moe_module.override(path):
        return aot.compile_for_tpu(fn, (params, x), hlo, name), shapes


def ideal_bytes(shapes, config, tokens: int) -> float:
    """The layer's weights once at their stored bytes, the experts min(experts, tokens x top_k) of them."""
    size = lambda tree: sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))
    experts = size(shapes["experts"])
    moe = config.moe
    return size(shapes) - experts + experts * min(moe.num_experts, tokens * moe.top_k) / moe.num_experts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python bench/moe_tpu.py", description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="deepseek-v3", help="a published MoE shape (dflash_jax.shapes)")
    p.add_argument("--tokens", default="1,8,16,32", help="tokens in the call (comma-separated)")
    p.add_argument("--paths", default="auto,touched,grouped", help="which paths (comma-separated: auto, touched, grouped)")
    p.add_argument("--format", default="dense", help="the experts' (and shared expert's) weight format")
    p.add_argument("--topology", default="v5p:1x1x1", help="a one-chip TPU topology (v5p:1x1x1, v6e:1x1, ...)")
    p.add_argument("--hlo", type=Path, default=None, help="write each compiled HLO here")
    args = p.parse_args(argv)
    from dflash_jax.model import moe as moe_module

    from bench.aot import one_chip

    target, mesh = one_chip(args.topology)
    if unknown := [x for x in args.paths.split(",") if x not in PATHS]:
        raise SystemExit(f"error: unknown path {unknown[0]!r} (known: {', '.join(PATHS)})")
    config = layer_config(args.shape, args.format)
    moe = config.moe
    rate = 2.35e12 if target.chip_name == "v5p" else target.chip.bandwidth  # the compiler's streaming rate (v5p)
    print(f"TPU {args.topology}: one {args.shape} MoE layer (hidden {config.hidden_size}, {moe.num_experts} experts "
          f"top-{moe.top_k} of width {moe.intermediate_size}, shared expert {moe.shared_expert_size}), weights "
          f"{args.format}; compiler estimates, nothing ran")
    for tokens in (int(t) for t in args.tokens.split(",")):
        row_cost = 2 if args.format == "mxfp4" else 1
        auto = ("tiled" if moe_module.tiled_path(tokens, moe, row_cost) else
                "touched" if moe_module.touched_path(tokens, moe, quantized=args.format != "dense") else "grouped")
        for path in args.paths.split(","):
            r, shapes = compile_layer(config, tokens, path, mesh, args.hlo, f"{args.shape}-{path}-{tokens}")
            ideal = ideal_bytes(shapes, config, tokens)
            label = f"{path} ({auto})" if path == "auto" else path
            if not r["compiled"]:
                print(f"  tokens {tokens:4d} {label:18s} does not fit: {r['asked'] or r['error']}")
                continue
            hbm_bytes = r["bytes"] - 4 * r["prefetched"]  # a prefetched buffer is counted five times
            est = f"{r['seconds'] * 1e3:7.3f} ms" if r["seconds"] else "   none"
            ratio = f"{r['seconds'] * rate / ideal:5.2f}x" if r["seconds"] else "  -"
            print(f"  tokens {tokens:4d} {label:18s} estimate {est} = {ratio} ideal {ideal / 1e9:6.2f} GB = "
                  f"{ideal / rate * 1e3:6.3f} ms; {hbm_bytes / 1e9:6.2f} GB accessed, {r['flops'] / 1e9:7.1f} GFLOP, "
                  f"HBM {r['memory']['arguments'] / 2**30:5.2f} + {r['memory']['temporaries'] / 2**30:5.2f} GiB; "
                  f"custom calls: {', '.join(r['custom_calls']) or '-'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
