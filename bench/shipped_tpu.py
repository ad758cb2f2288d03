"""The biggest targets as their checkpoints ship (weights kept quantized on the device), as the TPU compiler sees them.

    pip install -e '.[tpu]'                      # libtpu: compiles for a TPU topology here
    python -m bench.shipped_tpu [--shapes deepseek-v3,kimi-k2.5,glm-5.1,minimax-m2.5,gpt-oss-120b]
                                [--batch 8] [--context 32768] [--layers A,B] [--json PATH]

Each target is the published config with the `quantization_config` its checkpoint ships
(`dflash_jax.shapes.SHIPPED_QUANTIZATION`: FP8 blocks, compressed-tensors INT4, MXFP4), so its
weights take the formats the loader would keep them in (`dflash_jax.model.formats`), with the
z-lab recipe's 5-layer block-16 drafter (bfloat16), batch 8 and a page pool of batch x context
tokens. A whole model is too big to compile here, so, as `bench/mla_tpu.py` does, each is cut to two
depths (`CUTS`: its dense layers and one or two sparse ones) and scaled: whole = cut + (layers - cut) x the
per-layer increment. Figures:

- fit: HBM per chip of the whole model over each v5p slice of `--slices` (every chip on `model`:
  experts split over the chips, attention by heads), the smallest that holds it (the compiled
  AR step's and DFlash cycle's memory analysis: arguments + temporaries, scaled);
- time: the AR step and the DFlash cycle on one chip (a per-chip time: `bench/aot.py` says why a
  partitioned program's estimate is not one), scaled, against the ideal at the stored precision:
  the weights once (a routed expert only if touched: of E experts, top-k routing, N tokens a layer,
  an expected E x (1 - (1 - k / E)^N) distinct, uniform and independent routing) plus the K/V in
  use, at the compiler's streaming rate. On a slice of n chips both divide by n (communication not
  counted). ratio = estimate / ideal.

Asserts nothing. The figures in docs/benchmarks.md ("The biggest targets as shipped") are its output.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = ("deepseek-v3", "kimi-k2.5", "glm-5.1", "minimax-m2.5", "gpt-oss-120b")
# The two depths each is cut to: its dense layers whole and one or two sparse layers past them, so the
# increment is a sparse layer (gpt-oss: a sliding and a full attention layer, halved).
CUTS = {"deepseek-v3": (4, 5), "glm-5.1": (4, 5), "kimi-k2.5": (2, 3), "minimax-m2.5": (2, 3), "gpt-oss-120b": (2, 4)}
SLICES = ("v5p:1x1x1", "v5p:2x1x1", "v5p:2x2x1", "v5p:2x2x2", "v5p:2x2x4", "v5p:2x4x4", "v5p:4x4x4")


def configs(shape: str, layers: int | None = None, dense: int | None = None):
    """(target, drafter) of a shipped target, cut to `layers` layers, its drafter tapping within them."""
    from dflash_jax.drafter import DrafterConfig, default_target_layer_ids, dense_drafter_model
    from dflash_jax.families import model_config
    from dflash_jax.shapes import shipped_config

    target = model_config(shipped_config(shape, layers, dense), dtype="bfloat16")
    n = target.num_hidden_layers
    return target, DrafterConfig(model=dense_drafter_model(target, 5), block_size=16,
                                 mask_token_id=target.vocab_size - 1, target_layer_ids=default_target_layer_ids(n, 5),
                                 num_target_layers=n)


def expert_fraction(config, tokens: int) -> float:
    """The expected share of a layer's routed experts that `tokens` tokens touch (uniform, independent)."""
    moe = config.moe
    if moe is None:
        return 1.0
    e, k = moe.num_experts, moe.top_k
    return 1.0 - (1.0 - k / e) ** tokens


def stored_bytes(params, config, tokens: int | None = None) -> int:
    """Bytes of a parameter tree as stored; with `tokens`, a routed expert stack's bytes times the
    share of its experts `tokens` tokens touch."""
    import jax

    share = 1.0 if tokens is None else expert_fraction(config, tokens)
    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        names = [getattr(k, "key", "") for k in path]
        routed = "experts" in names and not any("shared" in n for n in names)
        total += leaf.size * leaf.dtype.itemsize * (share if routed else 1.0)
    return int(total)


def programs_at(shape, topology_name, layers, batch, context, programs=("ar", "dflash"), dense=None):
    """The engine's programs compiled for `shape` cut to `layers`, on `topology_name` (every chip on model)."""
    from dflash_jax.aot import mesh_for, topology
    from dflash_jax.kv import cache_length

    from bench.aot import engine_programs

    mesh = mesh_for(topology(topology_name), None)
    target, drafter = configs(shape, layers, dense)
    cache_len = cache_length(context + 2 * drafter.block_size, 256)
    figs = engine_programs(target, drafter, mesh, batch, context, cache_len, 256, None, programs, tag=f"-{layers}l",
                           kv_pages=batch * cache_len // 256)
    return target, drafter, figs


def whole(fa: dict, fb: dict, a: int, b: int, full: int, key) -> float:
    """A figure of the whole model from two cuts: cut a + (full - a) x the per-layer increment."""
    va, vb = key(fa), key(fb)
    return va + (full - a) * (vb - va) / (b - a)


def ideal(target, drafter, batch: int, context: int, block: int | None) -> dict:
    """Ideal bytes of an AR step (block None) or a DFlash cycle at the stored precision."""
    from dflash_jax.drafter import abstract_drafter_params
    from dflash_jax.model import abstract_params

    from bench.cost import kv_in_use

    tparams = abstract_params(target)
    tokens = batch if block is None else batch * block
    emb = tparams["model"]["embed_tokens"]["embedding"]
    weights = stored_bytes(tparams, target, tokens) - emb.size * emb.dtype.itemsize  # a lookup reads its rows only
    out = dict(weights=weights, kv=kv_in_use(target, batch, context), drafter=0, drafter_kv=0)
    if block is not None:
        head = tparams["lm_head"]["kernel"]
        out.update(drafter=stored_bytes(abstract_drafter_params(drafter), drafter) + head.size * head.dtype.itemsize,
                   drafter_kv=kv_in_use(drafter.model, batch, context))
    out["bytes"] = sum(out.values())
    return out


def run_shape(shape: str, args) -> dict:
    from bench.aot import streaming_rate
    from dflash_jax.aot import topology
    from dflash_jax.shapes import SHIPPED_SHAPES, PUBLISHED_TARGETS

    a, b = args.layers or CUTS[shape]
    full = PUBLISHED_TARGETS[SHIPPED_SHAPES.get(shape, shape)]["num_hidden_layers"]
    out = dict(shape=shape, layers=full, cuts=[a, b])
    # time: one chip
    one = topology("v5p:1x1x1")
    figs = {n: programs_at(shape, "v5p:1x1x1", n, args.batch, args.context)[2] for n in (a, b)}
    full_target, full_drafter = configs(shape)
    for name, block in (("ar", None), ("dflash", full_drafter.block_size)):
        fa, fb = figs[a][name], figs[b][name]
        if not (fa.get("compiled") and fb.get("compiled")):
            out[name] = dict(compiled=False, error=fa.get("error") or fb.get("error"))
            print(f"  {shape} {name}: did not compile on one chip: {(out[name]['error'] or '')[:200]}", flush=True)
            continue
        out[name] = dict(hbm_one_chip=whole(fa, fb, a, b, full, lambda f: f["memory"]["total"]))
        if not (fa.get("seconds") and fb.get("seconds")):
            print(f"  {shape} {name}: the compiler gave no time estimate", flush=True)
            continue
        need = ideal(full_target, full_drafter, args.batch, args.context, block)
        rate = streaming_rate(one.devices[0], int(need["weights"] / full), args.batch)
        seconds = whole(fa, fb, a, b, full, lambda f: f["seconds"])
        out[name].update(seconds=seconds, ideal=need, ideal_seconds=need["bytes"] / rate,
                         ratio=seconds / (need["bytes"] / rate))
        print(f"  {shape} {name}: estimate {seconds * 1e3:.1f} ms on one chip; ideal {need['bytes'] / 1e9:.1f} GB = "
              f"{need['bytes'] / rate * 1e3:.1f} ms: {out[name]['ratio']:.2f}x", flush=True)
    # fit: the smallest slice whose chips each hold the whole model's share
    for slice_name in args.slices:
        chips = topology(slice_name).num_chips
        hbm_one = max(out[n].get("hbm_one_chip", 0) for n in ("ar", "dflash"))
        if hbm_one / chips > topology(slice_name).chip.hbm:  # cannot fit even perfectly split: skip the compile
            continue
        fit = figs if chips == 1 else {n: programs_at(shape, slice_name, n, args.batch, args.context)[2]
                                        for n in (a, b)}
        hbm = {name: whole(fit[a][name], fit[b][name], a, b, full, lambda f: f["memory"]["total"])
               for name in ("ar", "dflash") if fit[a][name].get("compiled") and fit[b][name].get("compiled")}
        cap = topology(slice_name).chip.hbm
        print(f"  {shape} on {slice_name} ({chips} chips): " + ", ".join(
            f"{k} {v / 2**30:.1f} GiB a chip" for k, v in hbm.items()) + f" of {cap / 2**30:.1f}", flush=True)
        if len(hbm) == 2 and max(hbm.values()) <= cap:
            out["fit"] = dict(slice=slice_name, chips=chips, hbm=hbm, chip_hbm=cap)
            for name in ("ar", "dflash"):
                if "seconds" in out[name]:
                    out[name].update(slice_seconds=out[name]["seconds"] / chips,
                                     slice_ideal_seconds=out[name]["ideal_seconds"] / chips)
            break
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.shipped_tpu", description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--context", type=int, default=32768, help="tokens a row holds (the page pool: batch x context)")
    p.add_argument("--layers", help="the two cut depths compiled (their first dense layers kept; default: CUTS)")
    p.add_argument("--slices", default=",".join(SLICES), help="v5p slices tried for the fit, smallest first")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args(argv)
    args.layers = tuple(int(n) for n in args.layers.split(",")) if args.layers else None
    args.slices = args.slices.split(",")
    rows = [run_shape(s, args) for s in args.shapes.split(",")]
    print("\n| target (as shipped) | smallest v5p slice | HBM a chip (AR / DFlash) | AR step: estimate / ideal | "
          "DFlash cycle: estimate / ideal |")
    print("|---|---|---|---|---|")
    for r in rows:
        fit = r.get("fit")
        cells = [r["shape"], f"{fit['slice']} ({fit['chips']} chips)" if fit else "none tried fits",
                 " / ".join(f"{fit['hbm'][k] / 2**30:.1f}" for k in ("ar", "dflash")) + " GiB" if fit else "-"]
        for name in ("ar", "dflash"):
            f = r.get(name, {})
            cells.append(f"{f['seconds'] * 1e3:.1f} / {f['ideal_seconds'] * 1e3:.1f} ms one chip ({f['ratio']:.2f}x)"
                         if "seconds" in f else "did not compile")
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
