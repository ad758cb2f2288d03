"""--cost: a hardware-independent cost report of one autoregressive step and one DFlash cycle.

Nothing is allocated and nothing runs: a published target (`--shape`: Qwen3-8B by default,
Qwen3.5-27B, a gated delta-net hybrid, or Gemma 4 31B, sliding and global layers of two head
shapes) + 5-layer block-16 drafter shapes (scaled) become abstract parameters (`jax.eval_shape`) and an abstract DecodeState (every row
running at --context committed positions), and the engine's own `run_cycles` is lowered and
compiled for them. XLA's `cost_analysis()` then gives the flops and bytes accessed of one cycle
(the cycle loop's body is counted once: one cycle).

XLA counts every loop body once. Two loops inside a cycle matter:
- the attention walk (`attention.attend`: a fori_loop over the pages rows have used, its trip
  count known only on the device) is counted as one page per attention call, where a row at
  context C walks ceil((C + verify_len) / page) pages in the target's verify and ceil(C / page)
  in the drafter;
- a cache write (`kv.write_kv`: a fori_loop over the rows) is counted as one row's write.
XLA also counts an embedding lookup (a gather fused with its consumer) as a read of the whole
table, where a lookup reads the rows it indexes (the AR step looks up once, the DFlash cycle
twice: the drafter's block and the verify's).
The corrected figure adds the K/V bytes of the pages beyond the one counted (read once each, as
a fused attention kernel reads them; XLA's unfused CPU walk also materialises score
intermediates, which are not added) and the other rows' writes (the update read and written,
as XLA counts a single row's write), and counts each lookup as its rows instead of the table;
flops add the pages' QK^T and PV products.

The ideal is what a cycle cannot avoid moving: every weight once (for DFlash the target's and
the drafter's, plus the target's LM head read once more by the drafter; an untied embedding
table counts as the rows looked up, which is all a lookup reads) and the K/V in use read
once (target layers x batch x context x kv_heads x head_dim x 2 x dtype bytes, and the drafter's
context K/V likewise). Rooflines are max(flops / peak, bytes / bandwidth).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time

from dflash_jax.shapes import published_configs

from bench.pairs import describe_published, param_bytes
from bench.report import fmt_gb


@dataclasses.dataclass(frozen=True)
class Hardware:
    name: str
    flops: float  # peak dense bfloat16 flop/s
    bandwidth: float  # memory bytes/s

    def roofline(self, flops: float, nbytes: float) -> tuple[float, str]:
        """(seconds, what bounds it)."""
        tc, tm = flops / self.flops, nbytes / self.bandwidth
        return (tm, "memory") if tm >= tc else (tc, "compute")


HARDWARE = (Hardware("H200", 989e12, 4.8e12), Hardware("TPU v5p", 459e12, 2.76e12))


def xla_cost(compiled) -> tuple[float, float]:
    """(flops, bytes accessed) of a compiled computation; cost_analysis() is a dict, or a list
    of one dict on some JAX versions."""
    ca = compiled.cost_analysis()
    if isinstance(ca, (list, tuple)):
        ca = ca[0]
    return float(ca.get("flops", 0.0)), float(ca.get("bytes accessed", 0.0))


def _dtype_bytes(config) -> int:
    return {"float32": 4, "bfloat16": 2}[config.dtype]


def abstract_inputs(spec, batch: int, context: int):
    """Abstract (tparams, dparams or None, state, stop_ids): shapes only, nothing allocated."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.drafter import abstract_drafter_params
    from dflash_jax.model import abstract_params

    from bench.timing import synthetic_state

    tparams = abstract_params(spec.target)
    dparams = abstract_drafter_params(spec.drafter) if spec.uses_drafter else None
    state = jax.eval_shape(lambda: synthetic_state(spec, batch, context))
    return tparams, dparams, state, jax.ShapeDtypeStruct((8,), jnp.int32)


def lm_head_bytes(spec, tparams) -> int:
    """Bytes of the target's output head (the embedding when tied), which the drafter borrows."""
    if spec.target.tie_word_embeddings:
        leaf = tparams["model"]["embed_tokens"]["embedding"]
    else:
        leaf = tparams["lm_head"]["kernel"]
    return int(leaf.size * leaf.dtype.itemsize)


def embedding_bytes(tparams) -> int:
    leaf = tparams["model"]["embed_tokens"]["embedding"]
    return int(leaf.size * leaf.dtype.itemsize)


@functools.cache
def gather_counts_table(dtype: str) -> bool:
    """Whether this XLA counts a fused embedding lookup as a read of its whole table (it does
    on the CPU backend of jax 0.10; checked, not assumed)."""
    import jax
    import jax.numpy as jnp

    table = jax.ShapeDtypeStruct((4096, 256), dtype)
    ids = jax.ShapeDtypeStruct((8,), jnp.int32)
    compiled = jax.jit(lambda t, i: jnp.take(t, i, axis=0) * 2).lower(table, ids).compile()
    return xla_cost(compiled)[1] >= 4096 * 256 * jnp.dtype(dtype).itemsize


def lookups(spec, batch: int) -> list[int]:
    """Rows looked up in the embedding per cycle, one entry per lookup: the verify's block
    (and the drafter's block)."""
    return [batch * spec.verify_len] + ([batch * spec.block_size] if spec.uses_drafter and spec.num_drafts else [])


def embedding_row_bytes(tparams) -> int:
    emb = tparams["model"]["embed_tokens"]["embedding"]
    return int(emb.shape[1] * emb.dtype.itemsize)


def lookup_bytes(spec, tparams, batch: int) -> list[int]:
    """Per lookup (as `lookups`), the bytes to add to XLA's figure so that it counts the rows
    read, not the table (negative; 0 where this XLA already counts rows)."""
    if not gather_counts_table(spec.target.dtype):
        return [0] * len(lookups(spec, batch))
    return [r * embedding_row_bytes(tparams) - embedding_bytes(tparams) for r in lookups(spec, batch)]


def lookup_correction(spec, tparams, batch: int) -> dict:
    rows = lookups(spec, batch)
    return dict(lookups=len(rows), lookup_rows=sum(rows), lookup_bytes=sum(lookup_bytes(spec, tparams, batch)))


def attention_layers(config):
    """Per attention layer (a hybrid's linear layers have none): (bytes of K or V at one
    position, head_dim, sliding window or None, whether it writes its own K/V: a layer sharing
    another's reads it only)."""
    out = []
    for i in range(config.num_hidden_layers):
        if config.is_linear(i):
            continue
        head_dim, kv_heads = config.attention_shape(i)
        if config.mla is not None:  # one latent a position, keys and values both: half of it "each"
            head_dim, kv_heads = config.mla.latent_dim, 0.5
        window = config.sliding_windows[i] if config.sliding_windows else None
        out.append((kv_heads * head_dim * _dtype_bytes(config), head_dim, window, config.kv_producer(i) == i))
    return out


def pages_walked(context: int, queries: int, page: int, max_len: int, window: int | None) -> int:
    """Pages an attention call walks for queries at context .. context + queries - 1 (keys
    below `context + queries`; a sliding layer from the page holding context - window + 1)."""
    last = math.ceil(min(context + queries, max_len) / page)
    first = 0 if window is None else min(max(context - window + 1, 0) // page, last)
    return last - first


def loop_correction(spec, batch: int, context: int, max_len: int) -> dict:
    """What XLA's once-per-loop-body count leaves out of one cycle at `context` (see the module
    docstring): bytes and flops of the extra pages walked, bytes of the other rows' writes.
    Per attention layer: its own head shape and window (Gemma 4's sliding and global layers);
    a layer sharing another's K/V walks its pages but writes none."""
    from dflash_jax.kv import page_size_of

    page = page_size_of(max_len, spec.page_size)
    v = spec.verify_len
    out = dict(page=page, target_pages=0, drafter_pages=0, target_page_bytes=0, drafter_page_bytes=0,
               target_write_bytes=0, drafter_write_bytes=0, target_page_flops=0, drafter_page_flops=0)
    models = [("target", spec.target, context, v)]  # the verify: keys up to context + v
    if spec.uses_drafter:
        models.append(("drafter", spec.drafter.model, context, 0))  # the drafter: its context only
    for name, c, ctx, new in models:
        queries = v if name == "target" else spec.block_size
        out[f"{name}_pages"] = pages_walked(ctx, new, page, max_len, None)  # a full-attention layer's
        for kv_position, head_dim, window, writes in attention_layers(c):
            extra = max(pages_walked(ctx, new, page, max_len, window) - 1, 0)
            out[f"{name}_page_bytes"] += extra * batch * page * kv_position * 2
            out[f"{name}_page_flops"] += extra * 4 * batch * c.num_attention_heads * queries * page * head_dim
            if writes:  # K and V, the other rows, the verify's positions each: the update read and written
                out[f"{name}_write_bytes"] += 2 * (batch - 1) * v * kv_position * 2
    out["bytes"] = sum(out[f"{n}_{k}_bytes"] for n in ("target", "drafter") for k in ("page", "write"))
    out["flops"] = out["target_page_flops"] + out["drafter_page_flops"]
    return out


def kv_in_use(config, batch: int, context: int) -> int:
    """K and V every attention layer reads at `context`, once (a sliding layer: its window; a latent
    cache: the latent, and a sparse-attention indexer's keys)."""
    kv = sum(batch * min(context, window or context) * kv_position * 2
             for kv_position, _, window, _ in attention_layers(config))
    if config.mla is not None and config.mla.indexer is not None:
        ix = config.mla.indexer
        kv += ix.num_slots(config.num_hidden_layers) * batch * context * ix.head_dim * _dtype_bytes(config)
    return int(kv)


def recurrent_state_bytes(config, batch: int) -> int:
    """A hybrid target's linear-attention states (float32) and convolution tails, read once and
    written once per step or cycle; 0 for a decoder without linear layers."""
    lin = config.linear_attention
    if not config.num_linear_layers:
        return 0
    state = lin.v_heads * lin.k_dim * lin.v_dim * 4
    tail = (lin.conv_kernel - 1) * lin.conv_dim * _dtype_bytes(config)
    return 2 * config.num_linear_layers * batch * (state + tail)


def ideal_bytes(spec, tparams, dparams, batch: int, context: int) -> dict:
    """Weights once (DFlash: target + drafter + the borrowed LM head once more; K = 0: the drafter's
    context projections only, `context_kv_weight_bytes`; a DFlash2 drafter's
    weights include its selector's two codebooks, read whole: `selector_codebook_bytes`) + the K/V
    in use read once (+ a hybrid's recurrent states read and written once)."""
    t = spec.target
    weights, embedding_rows = param_bytes(tparams), 0
    if not t.tie_word_embeddings:  # a lookup reads its rows; the LM head reads a tied table anyway
        weights -= embedding_bytes(tparams)
        embedding_rows = sum(lookups(spec, batch)) * embedding_row_bytes(tparams)
    out = dict(target_weights=weights, embedding_rows=embedding_rows, drafter_weights=0, lm_head_again=0,
               target_kv=kv_in_use(t, batch, context), target_state=recurrent_state_bytes(t, batch), drafter_kv=0)
    if spec.uses_drafter and spec.num_drafts:
        d = spec.drafter.model
        out.update(drafter_weights=param_bytes(dparams), lm_head_again=lm_head_bytes(spec, tparams),
                   drafter_kv=kv_in_use(d, batch, context))
    elif spec.uses_drafter:  # K = 0: no draft; the context still grows, through fc and each layer's K/V projections
        out["drafter_weights"] = context_kv_weight_bytes(dparams)
    out["bytes"] = sum(out.values())
    return out


def context_kv_weight_bytes(dparams) -> int:
    """Bytes of the drafter's weights that extending its context reads (`DFlashDrafter.context_kv`): fc,
    hidden_norm and each layer's k_proj, v_proj and k_norm (a K = 0 cycle reads no other)."""
    import jax

    def used(path) -> bool:
        names = [getattr(k, "key", "") for k in path]
        return names[0] in ("fc", "hidden_norm") or any(n in ("k_proj", "v_proj", "k_norm") for n in names)

    leaves = jax.tree_util.tree_leaves_with_path(dparams)
    return int(sum(x.size * x.dtype.itemsize for path, x in leaves if used(path)))


def selector_codebook_bytes(dparams) -> int:
    """Bytes of a DFlash2 drafter's two selector codebooks [vocab, rank] (0 for a DFlash drafter). The
    ideal counts them read whole; a cycle gathers only its candidates' rows, so there the ideal is
    generous to the program."""
    sel = (dparams or {}).get("candidate_selector") or {}
    return int(sum(sel[k].size * sel[k].dtype.itemsize for k in ("predecessor_codebook", "successor_codebook")
                   if k in sel))


def cycle_cost(spec, batch: int, context: int) -> dict:
    """Lower and compile the engine's run_cycles for abstract inputs; XLA's figures of one
    cycle, the loop correction, the corrected figures, the ideal and the ratio."""
    import jax
    import jax.numpy as jnp

    from dflash_jax.engine import run_cycles

    tparams, dparams, state, stop_ids = abstract_inputs(spec, batch, context)
    t = time.perf_counter()
    compiled = run_cycles.lower(tparams, dparams, spec, state, stop_ids, jax.ShapeDtypeStruct((), jnp.int32),
                                jax.ShapeDtypeStruct((), jnp.bool_)).compile()
    seconds = time.perf_counter() - t
    flops, nbytes = xla_cost(compiled)
    max_len = state.target_cache.max_len
    corr = loop_correction(spec, batch, context, max_len)
    corr.update(lookup_correction(spec, tparams, batch))
    corr["bytes"] += corr["lookup_bytes"]
    ideal = ideal_bytes(spec, tparams, dparams, batch, context)
    corrected = nbytes + corr["bytes"]
    return dict(block_size=spec.block_size, verify_len=spec.verify_len, batch_size=batch, context=context,
                cache_len=spec.cache_len, allocated_cache_len=max_len, page_size=corr["page"],
                xla_flops=flops, xla_bytes=nbytes, correction=corr, corrected_flops=flops + corr["flops"],
                corrected_bytes=corrected, ideal=ideal, ideal_bytes=ideal["bytes"],
                corrected_over_ideal=corrected / ideal["bytes"], compile_seconds=seconds)


def piece_costs(spec, batch: int, context: int) -> dict:
    """XLA's bytes of the engine's pieces of a DFlash cycle, each compiled alone (draft, verify,
    accept + commit), with the part of the correction that falls in each."""
    import jax

    from dflash_jax.engine import accept, commit, draft, verify
    from dflash_jax.model import ForwardOutput

    tparams, dparams, state, stop_ids = abstract_inputs(spec, batch, context)
    corr = loop_correction(spec, batch, context, state.target_cache.max_len)
    drafts = jax.ShapeDtypeStruct((batch, spec.num_drafts), "int32")
    tokens = jax.ShapeDtypeStruct((batch, spec.verify_len), "int32")
    verified = jax.eval_shape(lambda tp, s, b: verify(tp, spec, s, b)[1], tparams, state, tokens)

    def accept_commit(dp, s, d, tt, f, stop):
        out = ForwardOutput(logits=None, tap_features=f, cache=s.target_cache)
        return commit(dp, spec, s, tt, accept(d, tt), out, stop)

    lookup = lookup_bytes(spec, tparams, batch)  # the verify's lookup, then the drafter's
    jobs = dict(
        draft=(lambda tp, dp, a, ctx: draft(tp, dp, spec, a, ctx), (tparams, dparams, state.anchor,
                                                                     state.context_cache), (),
               corr["drafter_page_bytes"] + lookup[1]),
        verify=(lambda tp, s, b: verify(tp, spec, s, b), (tparams, state, tokens), (1,),
                corr["target_page_bytes"] + corr["target_write_bytes"] + lookup[0]),
        accept_commit=(accept_commit, (dparams, state, drafts, tokens, verified.tap_features, stop_ids), (1,),
                       corr["drafter_write_bytes"]),
    )
    out = {}
    for name, (fn, args, donate, extra) in jobs.items():
        _, nbytes = xla_cost(jax.jit(fn, donate_argnums=donate).lower(*args).compile())
        out[name] = dict(xla_bytes=nbytes, corrected_bytes=nbytes + extra)
    return out


def run_cost(args) -> dict:
    import warnings

    from dflash_jax.kv import cache_length
    from dflash_jax.engine import EngineSpec, Sampling

    scale = 0.25 if args.scale is None else args.scale
    dtype = args.dtype or "float32"
    batch = args.batch_size or 8
    context = args.context
    if context < 1:
        raise SystemExit("error: --context must be >= 1")
    target, drafter = published_configs(scale, dtype, args.shape)
    b = drafter.block_size
    asked = args.cache_len or context + 2 * b
    if asked < context + b:
        raise SystemExit(f"error: --cache-len {asked} cannot hold --context {context} + a block of {b}")
    cache_len = cache_length(asked, args.page_size)
    specs = lambda cache: dict(
        ar=EngineSpec(target=target, drafter=None, block_size=1, sampling=Sampling(), max_new_tokens=64,
                      cache_len=cache, page_size=args.page_size),
        dflash=EngineSpec(target=target, drafter=drafter, block_size=b, sampling=Sampling(), max_new_tokens=64,
                          cache_len=cache, page_size=args.page_size))
    print(describe_published(target, drafter, scale, dtype) + "; abstract weights (nothing allocated)")
    print(f"batch {batch}, context {context} positions in use per row, cache {cache_len} positions allocated "
          f"({asked} asked, whole pages of {args.page_size})")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Dd]onat.*")
        figs = {k: cycle_cost(s, batch, context) for k, s in specs(cache_len).items()}
        compare = None
        if args.compare_cache_len and cache_length(args.compare_cache_len, args.page_size) != cache_len:
            other = cache_length(max(args.compare_cache_len, context + 2 * b), args.page_size)
            compare = dict(cache_len=other, **{k: cycle_cost(s, batch, context) for k, s in specs(other).items()})
        pieces = None if args.no_pieces else piece_costs(specs(cache_len)["dflash"], batch, context)

    ar, df = figs["ar"], figs["dflash"]
    c_ar, c_df = ar["correction"], df["correction"]
    tap = args.paper_tau
    print("\nXLA's cost analysis counts a loop body once: the attention walk as one page per call, a cache write "
          "as one row's; and it counts an embedding lookup as a read of the whole table.\n"
          "corrected = XLA + the K/V of the pages walked beyond the one counted, read once each "
          f"(target: ceil((context + verify) / {c_df['page']}) = {c_ar['target_pages']} pages per layer for the "
          f"AR step, {c_df['target_pages']} for the DFlash verify; drafter: ceil(context / {c_df['page']}) = "
          f"{c_df['drafter_pages']}) + the other {batch - 1} rows' K/V writes (update read and written), with each "
          f"lookup (AR: {c_ar['lookups']}, DFlash: {c_df['lookups']}) counted as the rows it reads; flops "
          "add those pages' QK^T and PV products.\nideal = weights once (DFlash: target + drafter + the target's "
          "LM head once more, for the drafter; the embedding as the rows looked up) + the K/V in use read once.\n")
    rows = [
        ("tokens verified per row", lambda f: f"{f['verify_len']}"),
        ("XLA flops", lambda f: f"{f['xla_flops'] / 1e9:.3f} GFLOP"),
        ("corrected flops", lambda f: f"{f['corrected_flops'] / 1e9:.3f} GFLOP"),
        ("XLA bytes accessed", lambda f: fmt_gb(f["xla_bytes"])),
        ("  + pages beyond the one counted",
         lambda f: fmt_gb(f["correction"]["target_page_bytes"] + f["correction"]["drafter_page_bytes"])),
        ("  + other rows' K/V writes",
         lambda f: fmt_gb(f["correction"]["target_write_bytes"] + f["correction"]["drafter_write_bytes"])),
        ("  - lookups counted as the table", lambda f: fmt_gb(-f["correction"]["lookup_bytes"])),
        ("corrected bytes", lambda f: fmt_gb(f["corrected_bytes"])),
        ("ideal bytes", lambda f: fmt_gb(f["ideal_bytes"])),
        ("  weights (target + drafter)",
         lambda f: fmt_gb(f["ideal"]["target_weights"] + f["ideal"]["drafter_weights"])),
        ("  embedding rows looked up", lambda f: fmt_gb(f["ideal"]["embedding_rows"])),
        ("  LM head again (drafter)", lambda f: fmt_gb(f["ideal"]["lm_head_again"]) if f["block_size"] > 1 else "-"),
        ("  K/V in use, read once", lambda f: fmt_gb(f["ideal"]["target_kv"] + f["ideal"]["drafter_kv"])),
        ("  recurrent states, read + written", lambda f: fmt_gb(f["ideal"]["target_state"])),
        ("corrected / ideal", lambda f: f"{f['corrected_over_ideal']:.2f}x"),
    ]
    for hw in HARDWARE:
        for f in (ar, df):
            sec, bound = hw.roofline(f["corrected_flops"], f["corrected_bytes"])
            isec, ibound = hw.roofline(f["corrected_flops"], f["ideal_bytes"])
            f.setdefault("roofline", {})[hw.name] = dict(seconds=sec, bound=bound, ideal_seconds=isec,
                                                         ideal_bound=ibound)
        rows.append((f"{hw.name} roofline ({hw.flops / 1e12:.0f} TFLOP/s, {hw.bandwidth / 1e12:.2f} TB/s)",
                     lambda f, n=hw.name: f"{1e3 * f['roofline'][n]['seconds']:.3f} ms ({f['roofline'][n]['bound']})"))
        rows.append(("  at the ideal bytes",
                     lambda f, n=hw.name: f"{1e3 * f['roofline'][n]['ideal_seconds']:.3f} ms "
                                          f"({f['roofline'][n]['ideal_bound']})"))
    width = max(len(r[0]) for r in rows) + 2
    print(f"{'':{width}}{'AR step':>24}  {f'DFlash cycle (block {b})':>24}")
    for label, get in rows:
        print(f"{label:{width}}{get(ar):>24}  {get(df):>24}")

    projected = {}
    for hw in HARDWARE:
        r_ar, r_df = ar["roofline"][hw.name], df["roofline"][hw.name]
        projected[hw.name] = dict(
            cost_ratio=r_df["seconds"] / r_ar["seconds"], speedup=tap * r_ar["seconds"] / r_df["seconds"],
            ideal_cost_ratio=r_df["ideal_seconds"] / r_ar["ideal_seconds"],
            ideal_speedup=tap * r_ar["ideal_seconds"] / r_df["ideal_seconds"])
    print(f"\nprojected speedup at the paper's tau {tap} (tau x t_AR / t_cycle, rooflines of the corrected figures; "
          "in brackets at the ideal bytes): "
          + "; ".join(f"{n} {p['speedup']:.2f}x (t_cycle / t_AR {p['cost_ratio']:.2f}) "
                      f"[{p['ideal_speedup']:.2f}x]" for n, p in projected.items()))
    if dtype == "float32":
        print("  (float32 bytes: twice bfloat16's for weights and K/V; the ratios carry over, the times halve)")
    else:
        import jax

        if jax.default_backend() == "cpu":
            print("  (bfloat16 compiled for the CPU: its compiler converts bfloat16 to float32 and back around most "
                  "ops, which inflates XLA's bytes; float32 is the faithful figure here)")

    if compare:
        print(f"\nthe same at cache {compare['cache_len']} positions allocated (context still {context}):")
        for k, label in (("ar", "AR step"), ("dflash", "DFlash cycle")):
            f, g = figs[k], compare[k]
            g["growth_vs_cache_len"] = g["corrected_bytes"] / f["corrected_bytes"]
            print(f"  {label:13} XLA {fmt_gb(g['xla_bytes'])}, corrected {fmt_gb(g['corrected_bytes'])} "
                  f"({g['corrected_over_ideal']:.2f}x ideal; {g['growth_vs_cache_len']:.3f}x the figure at cache "
                  f"{cache_len})")
    if pieces:
        total = sum(p["corrected_bytes"] for p in pieces.values())
        print("\npieces of the DFlash cycle, each compiled alone (XLA / corrected bytes): "
              + "; ".join(f"{n.replace('_', ' + ')} {fmt_gb(p['xla_bytes'])} / {fmt_gb(p['corrected_bytes'])}"
                          for n, p in pieces.items())
              + f"; sum {fmt_gb(total)} ({total / df['corrected_bytes']:.2f}x the cycle's corrected bytes)")
    tparams = abstract_inputs(specs(cache_len)["ar"], 1, 1)[0]
    emb = embedding_bytes(tparams)
    return dict(
        shape=args.shape, scale=scale, dtype=dtype, batch_size=batch, context=context, cache_len_asked=asked,
        cache_len=cache_len,
        page_size=args.page_size, block_size=b, paper_tau=tap,
        target=dataclasses.asdict(target),
        drafter=dict(layers=drafter.model.num_hidden_layers, block_size=b, taps=list(drafter.target_layer_ids)),
        hardware={hw.name: dict(flops=hw.flops, bandwidth=hw.bandwidth) for hw in HARDWARE},
        ar=ar, dflash=df, projected=projected, compare=compare, pieces=pieces, embedding_table_bytes=emb,
        correction_note="corrected = XLA bytes + K/V of the pages beyond the one XLA counts per attention call "
                        "(read once each) + the other rows' K/V writes (read and written) - each lookup's table "
                        "+ its rows; flops add the pages' "
                        "QK^T and PV products",
    )
