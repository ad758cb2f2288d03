"""Multi-head latent attention as the TPU compiler sees it, on a CPU-only machine (libtpu AOT).

    python -m bench.mla_tpu [--topology v5p:1x1x1] [--batch 8] [--contexts 4096,32768]

Compiles one MLA attention layer of a published shape (`--shape`: deepseek-v3, kimi-k2.5, glm-5.1)
for one TPU chip, as the engine runs it: the absorbed form over a latent cache (the Pallas kernel,
its cost estimate charged `context` positions a row), for a decode step (1 token a row), a DFlash
verify (16) and a prefill chunk (512). Per program: the compiler's time estimate, bytes, HBM, and the ideal: the layer's
weights once plus the latent cache in use (batch x context x (kv_lora_rank + qk_rope_head_dim) x 2
bytes), in time at the compiler's own streaming rate (`bench.aot.streaming_rate`). ratio = estimate /
ideal. Beside it the expanded form (the latent up-projected per head over the whole context, as
transformers attends) for scale. Prints a table (and `--json PATH`); asserts nothing.

    python -m bench.mla_tpu --per-layer [--contexts 32768]          # a decode layer in the engine
    python -m bench.mla_tpu --fits v5p:2x4x4 --shape kimi-k2.5 --layers 2,3 --contexts 32768

`--per-layer`: the engine's AR step and DFlash cycle for the shape cut to 2 and to 3 dense layers; the
difference is one layer, against its ideal. `--fits`: HBM per chip of the whole shape over a topology,
scaled from two cut depths (docs/benchmarks.md, "Multi-head latent attention on a TPU").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def attention_program(config, batch: int, t: int, context: int, absorbed: bool = True):
    """(jitted fn, abstract args) of one MLA layer: x [batch, t, hidden] at positions context..,
    over a cache holding `context` positions a row. absorbed=False: the expanded form."""
    import functools

    import jax
    import jax.numpy as jnp

    from dflash_jax.kv import cache_length, init_cache
    from dflash_jax.model.layers import rope_angles
    from dflash_jax.model.mla import LatentAttention

    cache_len = cache_length(context + t, 256)
    layer = LatentAttention(config, 0)
    cache = jax.eval_shape(functools.partial(init_cache, config.replace(num_hidden_layers=1), batch, cache_len,
                                             page_size=256))
    cache = cache.replace(lengths=jax.ShapeDtypeStruct((batch,), jnp.int32))
    x = jax.ShapeDtypeStruct((batch, t, config.hidden_size), jnp.bfloat16)
    positions = jax.ShapeDtypeStruct((batch, t), jnp.int32)

    def apply(params, x, cache, positions):
        cos, sin = rope_angles(config, positions, 0)
        if absorbed:
            out, cache, _ = layer.apply({"params": params}, x, cos, sin, cache, positions, None)
            return out, cache.k
        return expanded(params, config, x, cos, sin, cache, positions), cache.k

    def init(x, cache, positions):
        cos, sin = rope_angles(config, positions, 0)
        return layer.init(jax.random.PRNGKey(0), x, cos, sin, cache, positions, None)["params"]

    params = jax.eval_shape(init, x, cache, positions)
    return jax.jit(apply, donate_argnums=2), (params, x, cache, positions)


def expanded(params, config, x, cos, sin, cache, positions):
    """transformers' form, for the cost comparison: the cached latent up-projected through kv_b_proj to
    every head's key and value over the whole cache, then multi-head attention of qk_head_dim-wide
    heads (RoPE and the norms left out: they cost the same in both forms)."""
    import jax
    import jax.numpy as jnp

    m, h = config.mla, config.num_attention_heads
    b, t, _ = x.shape
    q = (x @ params["q_a_proj"]["kernel"]) @ params["q_b_proj"]["kernel"]
    q = q.reshape(b, t, h, m.qk_head_dim)
    latent = jnp.concatenate([cache.k[0], cache.v[0]], axis=-1)  # [batch, S, latent]
    kv = jnp.einsum("bsl,xl->bsx", latent[..., :m.kv_lora_rank], params["kv_b_proj"]["kernel"])
    kv = kv.reshape(*kv.shape[:2], h, m.qk_nope_head_dim + m.v_head_dim)
    s = (jnp.einsum("bthn,bshn->bhts", q[..., :m.qk_nope_head_dim], kv[..., :m.qk_nope_head_dim])
         + jnp.einsum("bthr,bsr->bhts", q[..., m.qk_nope_head_dim:], latent[..., m.kv_lora_rank:]))
    mask = jnp.arange(latent.shape[1])[None, None, None, :] <= positions[:, None, :, None]
    p = jax.nn.softmax(jnp.where(mask, s.astype(jnp.float32), -jnp.inf), axis=-1).astype(x.dtype)
    out = jnp.einsum("bhts,bshv->bthv", p, kv[..., m.qk_nope_head_dim:])
    return out.reshape(b, t, -1) @ params["o_proj"]["kernel"]


def shortened(shape: str, layers: int, dense: int | None = None):
    """(target, drafter) of a published shape cut to `layers` layers (its first dense layers kept,
    or `dense` of them), with the shape's 5-layer drafter tapping within them."""
    import dataclasses

    from dflash_jax.drafter import default_target_layer_ids
    from dflash_jax.families import model_config
    from dflash_jax.shapes import PUBLISHED_TARGETS, published_configs

    hf = dict(PUBLISHED_TARGETS[shape], num_hidden_layers=layers)
    if "first_k_dense_replace" in hf:
        hf["first_k_dense_replace"] = min(hf["first_k_dense_replace"] if dense is None else dense, layers)
    if hf.get("layer_types"):
        hf["layer_types"] = hf["layer_types"][:layers]
    target = model_config(hf, dtype="bfloat16")
    _, drafter = published_configs(1.0, "bfloat16", shape)
    taps = default_target_layer_ids(layers, len(drafter.target_layer_ids))
    return target, dataclasses.replace(drafter, target_layer_ids=taps, num_target_layers=layers)


def per_layer(shape: str, topology_name: str, mesh_text: str | None, layers: tuple[int, int], batch: int,
              context: int, programs=("ar", "dflash"), dense: int | None = None, kv_pages: bool = False) -> dict:
    """The engine's programs (`bench.aot.engine_programs`, the Pallas kernel charged `context`
    positions a row) compiled for a shape cut to layers[0] and to layers[1] layers: per program the
    figures of each and the per-layer increment (estimate, bytes, HBM per chip, ideal)."""
    from dflash_jax.aot import mesh_for, topology
    from dflash_jax.kv import cache_length

    from bench.aot import engine_programs

    target = topology(topology_name)
    mesh = mesh_for(target, mesh_text)
    out = {}
    for n in layers:
        tcfg, dcfg = shortened(shape, n, dense)
        cache_len = cache_length(context + 2 * dcfg.block_size, 256)
        pages = batch * cache_len // 256 if kv_pages else None
        out[n] = engine_programs(tcfg, dcfg, mesh, batch, context, cache_len, 256, None, programs, tag=f"-{n}l",
                                 kv_pages=pages)
    a, b = layers
    inc = {}
    for name in programs:
        fa, fb = out[a][name], out[b][name]
        if not (fa.get("compiled") and fb.get("compiled")):
            inc[name] = dict(compiled=False, error=fa.get("error") or fb.get("error"),
                             asked=fa.get("asked") or fb.get("asked"))
            continue
        per = lambda key, fa=fa, fb=fb: (fb[key] - fa[key]) / (b - a)  # noqa: E731
        inc[name] = dict(seconds=per("seconds") if fa["seconds"] and fb["seconds"] else None, bytes=per("bytes"),
                         prefetched=per("prefetched"), hbm=(fb["memory"]["total"] - fa["memory"]["total"]) / (b - a),
                         ideal=(fb["ideal"]["bytes"] - fa["ideal"]["bytes"]) / (b - a) if "ideal" in fa else None,
                         base=fa)
    return dict(shape=shape, topology=topology_name, chips=target.num_chips, chip_hbm=target.chip.hbm,
                mesh=dict(mesh.shape), layers=layers, batch=batch, context=context, increments=inc, programs=out)


def weight_bytes(params) -> int:
    import jax

    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mla_tpu", description=__doc__.splitlines()[0])
    p.add_argument("--topology", default="v5p:1x1x1", help="a one-chip TPU topology (v5p:1x1x1, v5e:1x1, v6e:1x1)")
    p.add_argument("--shape", default="deepseek-v3", help="deepseek-v3, kimi-k2.5 or glm-5.1 (its MLA layer)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--contexts", default="4096,32768", help="positions a row holds, comma-separated")
    p.add_argument("--json", help="also write the figures here")
    p.add_argument("--hlo", help="write each program's scheduled TPU HLO into this directory")
    p.add_argument("--tokens", default="1,16,512", help="tokens a row per program (decode 1, verify 16, prefill)")
    p.add_argument("--per-layer", action="store_true",
                   help="instead: one decode layer as the engine runs it (--shape cut to 2 and 3 dense layers, "
                        "the AR step and DFlash cycle on --topology): the increment against its ideal")
    p.add_argument("--fits", metavar="TOPOLOGY",
                   help="instead: HBM per chip of the whole --shape over TOPOLOGY (every chip on model; caches in "
                        "a page pool of the first --contexts), scaled from --layers")
    p.add_argument("--layers", default="4,5", help="--fits: the two cut depths measured (their first dense layers "
                                                   "kept: kimi-k2.5 2,3; qwen3-coder-next 4,8)")
    args = p.parse_args(argv)
    if args.per_layer or args.fits:
        return _layer_reports(args)

    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P

    from dflash_jax import attention
    from dflash_jax.aot import AotError, compile_for_tpu, mesh_for, topology
    from dflash_jax.shapes import published_configs

    from bench.aot import streaming_rate

    try:
        target = topology(args.topology)
        mesh = mesh_for(target, None)
    except AotError as e:
        raise SystemExit(f"error: {e}") from None
    if target.num_chips != 1:
        raise SystemExit("error: give a one-chip topology: the estimate is a one-chip time")
    one_chip = NamedSharding(mesh, P())
    config, _ = published_configs(1.0, "bfloat16", args.shape)
    if config.mla is None:
        raise SystemExit(f"error: --shape {args.shape} has no latent attention")
    config = config.replace(num_hidden_layers=1, mla=config.mla.__class__(**{**config.mla.__dict__, "indexer": None}))
    m = config.mla
    print(f"TPU {args.topology}; {args.shape}'s MLA layer: {config.num_attention_heads} heads, q latent "
          f"{m.q_lora_rank}, K/V latent {m.kv_lora_rank} + {m.qk_rope_head_dim}, nope {m.qk_nope_head_dim}, "
          f"v {m.v_head_dim}; batch {args.batch}; bfloat16; jax {jax.__version__}")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for t in (int(n) for n in args.tokens.split(",")):
            label = {1: "decode (1 token)", 16: "verify (16 tokens)"}.get(t, f"prefill ({t} tokens)")
            for absorbed in (True, False):
                fn, inputs = attention_program(config, args.batch, t, context, absorbed)
                inputs = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_chip), inputs)
                with attention.override("pallas", expected_live=context):
                    fig = compile_for_tpu(fn, inputs, Path(args.hlo) if args.hlo else None,
                                          f"mla-{'absorbed' if absorbed else 'expanded'}-{t}-{context}")
                params = weight_bytes(inputs[0])
                cache = args.batch * context * m.latent_dim * 2
                rate = streaming_rate(target.devices[0], params, args.batch)
                ideal = (params + cache) / rate
                rows.append(dict(context=context, tokens=t, form="absorbed" if absorbed else "expanded",
                                 seconds=fig.get("seconds"), bytes=fig.get("bytes"), flops=fig.get("flops"),
                                 hbm=fig.get("memory", {}).get("total"), weights=params, latent_cache=cache,
                                 prefetched=fig.get("prefetched"),
                                 ideal_seconds=ideal, ratio=fig["seconds"] / ideal if fig.get("seconds") else None,
                                 custom_calls=fig.get("custom_calls")))
                r = rows[-1]
                print(f"  context {context:6d} {label:19s} {r['form']:8s} estimate "
                      f"{(r['seconds'] or float('nan')) * 1e6:8.1f} us, {(r['bytes'] or 0) / 1e6:8.1f} MB accessed; ideal "
                      f"{ideal * 1e6:7.1f} us (weights {params / 1e6:.0f} MB + latent {cache / 1e6:.0f} MB): "
                      f"{r['ratio'] or float('nan'):.2f}x; prefetched {(r['prefetched'] or 0) / 1e6:.0f} MB", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(topology=args.topology, shape=args.shape, batch=args.batch,
                                                   rows=rows), indent=1))
    return 0


def _layer_reports(args) -> int:
    """--per-layer and --fits: print (and --json) the engine's per-layer increments."""
    from bench.aot import streaming_rate
    from dflash_jax.aot import topology
    from dflash_jax.shapes import PUBLISHED_TARGETS

    context = int(args.contexts.split(",")[0])
    if args.per_layer:
        r = per_layer(args.shape, args.topology, None, (2, 3), args.batch, context, dense=99)
        rate = streaming_rate(topology(args.topology).devices[0], int(r["increments"]["ar"]["ideal"]), args.batch)
        rows = {}
        for name, inc in r["increments"].items():
            ratio = inc["seconds"] / (inc["ideal"] / rate) if inc.get("seconds") else None
            rows[name] = dict(seconds=inc.get("seconds"), bytes=inc.get("bytes"), ideal=inc.get("ideal"),
                              ideal_seconds=inc["ideal"] / rate, ratio=ratio)
            print(f"  {args.shape} one decode layer, {name}, context {context}: estimate "
                  f"{(inc.get('seconds') or float('nan')) * 1e3:.3f} ms, {inc['bytes'] / 1e9:.2f} GB; ideal "
                  f"{inc['ideal'] / 1e9:.2f} GB = {inc['ideal'] / rate * 1e3:.3f} ms: {ratio or float('nan'):.2f}x")
    else:
        layers = tuple(int(n) for n in args.layers.split(","))
        r = per_layer(args.shape, args.fits, None, layers, args.batch, context, kv_pages=True)
        full = PUBLISHED_TARGETS[args.shape]["num_hidden_layers"]
        rows = {}
        for name, inc in r["increments"].items():
            if "base" not in inc:
                rows[name] = dict(compiled=False, error=inc.get("error"), asked=inc.get("asked"))
                print(f"  {args.shape} {name}: did not compile at {layers}: {inc.get('asked') or inc.get('error')}")
                continue
            hbm = inc["base"]["memory"]["total"] + (full - layers[0]) * inc["hbm"]
            rows[name] = dict(hbm=hbm, per_layer_hbm=inc["hbm"], fits=hbm <= r["chip_hbm"])
            print(f"  {args.shape} ({full} layers) on {args.fits}, {name}: {hbm / 2**30:.1f} GiB a chip "
                  f"({inc['hbm'] / 2**30:.2f} GiB a layer) of {r['chip_hbm'] / 2**30:.1f}: "
                  f"{'fits' if hbm <= r['chip_hbm'] else 'does not fit'}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(shape=args.shape, batch=args.batch, context=context, rows=rows),
                                              indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
