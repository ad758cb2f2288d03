"""--aot TOPOLOGY: the engine compiled ahead of time for a TPU, judged by the TPU compiler itself.

No TPU is needed: with libtpu installed (`pip install -e '.[tpu]'`), jax compiles for a TPU
topology on any machine. A published target (`--shape`) + its 5-layer block-16 drafter become
abstract bfloat16 parameters, sharded over the topology's chips by the project's mesh rules
(`--mesh`, default every chip on `model`), and the engine's own programs are compiled:

  prefill  admit `batch` prompts of `--context` tokens into an empty state
  ar       run_cycles of plain decoding (block 1): one step per loop iteration
  dflash   run_cycles of DFlash (block 16): one cycle per loop iteration
  tree N   (`--tree-budgets N,...`) the dflash program verifying a draft tree of N nodes a cycle
           (N + 1 tokens in the verify pass, not 16), beside the chain, on the same cache
  dflash2  a shape with a DFlash2 drafter (`--shape qwen3.8-27b`): run_cycles of DFlash2 (its
           convolutions, and the candidate selector's walk drafting; greedy), compiled beside
           `dflash`, which is then the same drafter without DFlash2's additions (a plain DFlash
           drafter of the same layers, block and taps); the report gives DFlash2 / DFlash

Per program the compiled executable gives:
- the compiler's time estimate (`optimal_seconds`), flops and bytes accessed. A loop body is
  counted once, so a run_cycles figure is one step or cycle plus what runs once around the
  loop. For a program partitioned over several chips these are not a per-chip time (the
  estimate can come out negative): time single-chip programs, use several chips for HBM and
  communication.
- HBM per chip (`memory_analysis`: arguments + outputs not aliased to them + temporaries)
  against the chip's capacity, and the collectives in the HLO (a weight all-gathered would
  show as an all-gather of a parameter's shard).
- the ideal: what a step or cycle cannot avoid moving (`cost.ideal_bytes`: weights once, the
  K/V in use once; a DFlash2 drafter's weights include its selector's two codebooks, counted as
  read whole, 2 x vocab x rank), in time at the compiler's own streaming rate, calibrated on a pure
  weight-streaming program (a `lax.scan` of batch-row matvecs over stacked square weights of
  the same bytes) compiled for the same chip. ratio = estimate / ideal time.
- the projected speedup at tau (`--paper-tau`, 6.49): tau x t_step / t_cycle. A tree's at its
  `--tree-tau`, and always the tau it needs to match the chain's: paper_tau x t_tree / t_chain.
- how far each step or cycle is from the compute roof: flops / HBM bytes (arithmetic intensity)
  against the chip's ridge (peak flop/s / HBM bytes/s), and the time its flops take at peak as a
  share of the estimate. A verify of more tokens adds flops, not bytes, until it crosses the ridge.

`--hlo DIR` writes each program's scheduled TPU HLO. A program that does not fit fails to
compile with RESOURCE_EXHAUSTED; the report says so with the HBM the compiler asked for.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from dflash_jax.aot import (COLLECTIVES, GIB, AotError, abstract_replicated, abstract_sharded, compile_for_tpu,
                            cost_of, mesh_for, topology)


def one_chip(topology_name: str):
    """(topology, its one-chip mesh) for a stand-alone TPU bench; a bad or multi-chip topology exits
    with a one-line error (a one-chip estimate is what these benches print)."""
    try:
        target = topology(topology_name)
    except AotError as e:
        raise SystemExit(f"error: {e}") from None
    if target.num_chips != 1:
        raise SystemExit(f"error: {topology_name} has {target.num_chips} chips; give a one-chip topology")
    return target, mesh_for(target, "data=1,model=1")


@functools.cache
def streaming_rate(device, nbytes: int, batch: int) -> float:
    """Bytes/s the compiler gives a pure weight-streaming program on one chip: an unrolled chain
    of [batch, d] x [d, d] matvecs over stacked bfloat16 weights of about `nbytes` (d = 4096; at
    most 2 GiB of them: the rate does not depend on the total, the compile time does)."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    d = 4096
    n = max(1, min(64, round(nbytes / (d * d * 2))))
    mesh = Mesh(np.array([device]), ("x",))
    sds = lambda shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=NamedSharding(mesh, P()))

    def stream(h, w):
        return jax.lax.scan(lambda x, wi: ((x @ wi).astype(x.dtype), None), h, w, unroll=True)[0]  # counted whole

    compiled = jax.jit(stream).trace(sds((batch, d)), sds((n, d, d))).lower().compile()
    return n * d * d * 2 / cost_of(compiled)["seconds"]


def engine_programs(target_cfg, drafter_cfg, mesh, batch: int, context: int, cache_len: int, page_size: int,
                    hlo_dir: Path | None, programs: tuple[str, ...], tag: str = "", attention: str = "kernel",
                    kv_pages: int | None = None, tree_budgets: tuple[int, ...] = ()) -> dict:
    """Compile the engine's prefill / AR run_cycles / DFlash run_cycles on `mesh` for abstract
    inputs; per program its `compile_for_tpu` figures and the ideal bytes. attention: the Pallas
    kernel (what the engine runs on a TPU; its cost estimate charges a row `context` positions) or
    the portable walk. kv_pages: the caches as a page pool of that many pages. tree_budgets: also
    the DFlash run_cycles verifying a draft tree of each budget (programs "tree16", ...)."""
    from dflash_jax import attention as attention_

    # The walk, or the kernel charged `context` positions a row in its cost estimate.
    choice = attention_.override("walk") if attention == "walk" else attention_.override("pallas", expected_live=context)
    with choice:
        return _engine_programs(target_cfg, drafter_cfg, mesh, batch, context, cache_len, page_size, hlo_dir,
                                programs, tag, kv_pages, tree_budgets)


def _engine_programs(target_cfg, drafter_cfg, mesh, batch, context, cache_len, page_size, hlo_dir, programs, tag,
                     kv_pages, tree_budgets):
    import jax
    import jax.numpy as jnp

    from dflash_jax.engine import (EngineSpec, Sampling, decode_state_shardings, init_state, prefill, rows_of,
                                   run_cycles)
    from dflash_jax.engine.constraints import DEFAULT_STATES, EDGES_PER_STATE
    from dflash_jax.sharding import param_shardings

    from bench.cost import abstract_inputs, ideal_bytes, selector_codebook_bytes

    specs = dict(
        ar=EngineSpec(target=target_cfg, drafter=None, block_size=1, sampling=Sampling(), max_new_tokens=64,
                      cache_len=cache_len, page_size=page_size, mesh=mesh, kv_pages=kv_pages),
        dflash=EngineSpec(target=target_cfg, drafter=drafter_cfg, block_size=drafter_cfg.block_size,
                          sampling=Sampling(), max_new_tokens=64, cache_len=cache_len, page_size=page_size, mesh=mesh,
                          kv_pages=kv_pages))
    if drafter_cfg.dflash2 is not None:  # DFlash2, and beside it DFlash: the same drafter without its additions
        specs["dflash2"] = specs["dflash"]
        specs["dflash"] = dataclasses.replace(specs["dflash2"], drafter=dataclasses.replace(drafter_cfg, dflash2=None))
    specs["prefill"] = specs.get("dflash2", specs["dflash"])
    # The DFlash cycle of an engine holding constraints (the server's default pool: every row's
    # logits masked by its automaton's state, the drafts along the masked chain, commit's walk).
    specs["constrained"] = dataclasses.replace(specs["dflash"], constraint_states=DEFAULT_STATES,
                                               constraint_edges=DEFAULT_STATES * EDGES_PER_STATE)
    for n in tree_budgets:
        specs[f"tree{n}"] = dataclasses.replace(specs["dflash"], tree_budget=n)
    programs = (*programs, *(f"tree{n}" for n in tree_budgets))
    rep = functools.partial(abstract_replicated, mesh)
    out = {}
    for name in programs:
        spec = specs[name]
        tparams, dparams, state, _ = abstract_inputs(spec, batch, context)
        tparams = abstract_sharded(tparams, param_shardings(tparams, mesh))
        dparams = None if dparams is None else abstract_sharded(dparams, param_shardings(dparams, mesh))
        if name == "prefill":
            empty = jax.eval_shape(functools.partial(init_state, spec, batch))
            args = (tparams, dparams, spec, abstract_sharded(empty, decode_state_shardings(empty, mesh)),
                    rep((batch, context), jnp.int32), rep((batch,), jnp.int32), rep((batch,), jnp.int32),
                    rep((batch,), jnp.uint32), rep((), jnp.int32), rep((batch,), jnp.int32), rep((8,), jnp.int32),
                    jax.tree.map(lambda x: rep(x.shape, x.dtype), rows_of([spec.sampling], batch)),
                    None if kv_pages is None else rep(empty.target_cache.pages.shape, jnp.int32))
            fig = compile_for_tpu(prefill, args, hlo_dir, f"prefill{tag}")
        else:
            args = (tparams, dparams, spec, abstract_sharded(state, decode_state_shardings(state, mesh)),
                    rep((8,), jnp.int32), rep((), jnp.int32), rep((), jnp.bool_))
            fig = compile_for_tpu(run_cycles, args, hlo_dir, f"{name}{tag}")
            fig["ideal"] = ideal_bytes(spec, tparams, dparams, batch, context)
            fig["selector_codebooks"] = selector_codebook_bytes(dparams)  # within the ideal's drafter_weights
        fig.update(block_size=spec.block_size if name != "prefill" else None, verify_len=spec.verify_len,
                   constraint_states=spec.constraint_states,
                   tree_budget=spec.tree_budget if name != "prefill" else None, cache_len=cache_len)
        out[name] = fig
        print(f"  compiled {name}{tag} in {fig['compile_seconds']:.0f} s" if fig["compiled"]
              else f"  {name}{tag} did not compile: {fig['error'][:200]}", flush=True)
    return out


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


def tree_taus(text: str | None, budgets: list[int]) -> dict[int, float]:
    """--tree-tau "32=8.1,64=8.6" -> {32: 8.1, 64: 8.6}, each budget one of --tree-budgets."""
    out = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        n, _, tau = item.partition("=")
        try:
            out[int(n)] = float(tau)
        except ValueError:
            raise SystemExit(f"error: --tree-tau takes N=TAU,... (got {text!r})") from None
    unknown = set(out) - set(budgets)
    if unknown:
        raise SystemExit(f"error: --tree-tau {min(unknown)}: not one of --tree-budgets {budgets}")
    return out


def roofline(f: dict, chip) -> dict:
    """Where a program sits against the chip's roof: flops per HBM byte (the prefetch-corrected
    bytes where known) against the ridge, and its flops' time at peak over the estimate."""
    nbytes = f.get("hbm_bytes") or f["bytes"]
    out = dict(intensity=f["flops"] / nbytes if nbytes else None, ridge=chip.flops / chip.bandwidth,
               compute_seconds=f["flops"] / chip.flops)
    out["compute_share"] = out["compute_seconds"] / f["seconds"] if f.get("seconds") else None
    return out


def run_aot(args) -> dict:
    import jax

    from dflash_jax.kv import cache_length
    from dflash_jax.model import abstract_params
    from dflash_jax.sharding import MeshError

    from dflash_jax.shapes import published_configs

    from bench.pairs import describe_published, param_bytes
    from bench.suite import int_list

    try:
        target = topology(args.aot)
        mesh = mesh_for(target, args.mesh)
    except (AotError, MeshError) as e:
        raise SystemExit(f"error: {e}") from None
    programs = tuple(p.strip() for p in args.programs.split(",") if p.strip())
    unknown = set(programs) - {"prefill", "ar", "dflash", "dflash2", "constrained"}
    if unknown or not programs:
        raise SystemExit(f"error: --programs takes prefill, ar, dflash, dflash2 and constrained, comma-separated "
                         f"(got {args.programs!r})")
    scale = 1.0 if args.scale is None else args.scale
    dtype = args.dtype or "bfloat16"
    batch, context = args.batch_size or 8, args.context
    tcfg, dcfg = published_configs(scale, dtype, args.shape)
    if dcfg.dflash2 is None and "dflash2" in programs:
        raise SystemExit(f"error: --programs dflash2 needs a shape with a DFlash2 drafter (--shape {args.shape} "
                         "has none)")
    if dcfg.dflash2 is not None and "dflash" in programs and "dflash2" not in programs:
        # a DFlash2 drafter's cycle, and beside it the DFlash cycle of the same shapes
        programs = tuple(q for p in programs for q in (("dflash2", p) if p == "dflash" else (p,)))
    b = dcfg.block_size
    budgets = int_list(args.tree_budgets, "--tree-budgets") if getattr(args, "tree_budgets", None) else []
    taus = tree_taus(getattr(args, "tree_tau", None), budgets)
    if budgets and "dflash" not in programs:
        raise SystemExit("error: --tree-budgets compiles the dflash program with a tree: add dflash to --programs")
    # a tree writes its N + 1 nodes from the row's length before it keeps the accepted path: every
    # program gets room for the largest, so all compare on one cache
    room = max([2 * b, *(n + 1 for n in budgets)])
    cache_len = cache_length(args.cache_len or context + room, args.page_size)
    written = max([b, *(n + 1 for n in budgets)])  # positions a cycle writes past a row's length
    if cache_len < context + written:
        raise SystemExit(f"error: --cache-len {cache_len} cannot hold --context {context} + "
                         + (f"a tree of {written - 1} nodes" if written > b else f"a block of {b}"))
    hlo_dir = Path(args.hlo) if args.hlo else None
    chip = target.chip
    print(f"TPU {target.name}: {target.num_chips} {target.chip_name} chip(s), {_gib(chip.hbm)} HBM each; mesh "
          f"{dict(mesh.shape)}; jax {jax.__version__}")
    print(describe_published(tcfg, dcfg, scale, dtype) + "; abstract weights (nothing allocated)")
    if getattr(args, "batch_sweep", None):
        return _sweep(args, target, mesh, tcfg, dcfg, cache_len)
    print(f"batch {batch}, context {context}, cache {cache_len} positions per row (pages of {args.page_size})",
          flush=True)
    attention = getattr(args, "attention", "kernel")
    print(f"attention: {'the Pallas kernel' if attention == 'kernel' else 'the portable walk'}")
    kv_pages = getattr(args, "kv_pages", None)
    if kv_pages is not None:
        print(f"K/V in a page pool of {kv_pages} pages ({kv_pages * args.page_size} positions; per-slot caches: "
              f"{batch * cache_len})")
    if budgets:
        print(f"draft trees of {budgets} nodes: the DFlash cycle compiled with each")
    figs = engine_programs(tcfg, dcfg, mesh, batch, context, cache_len, args.page_size, hlo_dir, programs,
                           attention=attention, kv_pages=kv_pages, tree_budgets=tuple(budgets))
    compare = None
    other = cache_length(max(args.compare_cache_len or 0, context + room), args.page_size)
    if args.compare_cache_len and other != cache_len:
        compare = dict(cache_len=other, **engine_programs(tcfg, dcfg, mesh, batch, context, other, args.page_size,
                                                          hlo_dir, tuple(p for p in programs if p != "prefill"),
                                                          tag=f"-cache{other}", attention=attention,
                                                          kv_pages=kv_pages, tree_budgets=tuple(budgets)))
    one_chip = target.num_chips == 1
    weights = param_bytes(abstract_params(tcfg))
    rate = streaming_rate(target.devices[0], weights, batch) if one_chip else None
    for f in [*figs.values(), *((v for k, v in compare.items() if k != "cache_len") if compare else ())]:
        mem = f.get("memory")
        if mem:
            f["fits"] = mem["total"] <= chip.hbm
        if f.get("compiled") and "ideal" in f and rate and f["seconds"]:
            f["ideal_seconds"] = f["ideal"]["bytes"] / rate
            f["ratio"] = f["seconds"] / f["ideal_seconds"]
            # the same bytes with each prefetched buffer read from HBM once
            f["hbm_bytes"] = f["bytes"] - 4 * f["prefetched"]
            f["hbm_ratio"] = f["hbm_bytes"] / f["ideal"]["bytes"]
        if f.get("compiled") and one_chip:
            f["roofline"] = roofline(f, chip)
    report = dict(topology=target.name, chip=target.chip_name, chips=target.num_chips,
                  chip_spec=dataclasses.asdict(chip), mesh=dict(mesh.shape), shape=args.shape, scale=scale,
                  dtype=dtype, batch_size=batch, context=context, cache_len=cache_len, page_size=args.page_size,
                  attention=attention, kv_pages=kv_pages, paper_tau=args.paper_tau, streaming_rate=rate,
                  target_weight_bytes=weights, programs=figs, compare=compare, tree_budgets=budgets,
                  tree_tau={str(n): t for n, t in taus.items()})
    if one_chip and all(figs.get(k, {}).get("seconds") for k in ("dflash2", "dflash")):
        d2, d1 = figs["dflash2"], figs["dflash"]
        report["dflash2_over_dflash"] = dict(
            seconds=d2["seconds"] / d1["seconds"], bytes=d2["bytes"] / d1["bytes"],
            ideal=d2["ideal"]["bytes"] / d1["ideal"]["bytes"], flops=d2["flops"] / d1["flops"])
    if one_chip and all(figs.get(k, {}).get("seconds") for k in ("constrained", "dflash")):
        c, d1 = figs["constrained"], figs["dflash"]
        report["constrained_over_dflash"] = dict(seconds=c["seconds"] / d1["seconds"], bytes=c["bytes"] / d1["bytes"],
                                                 flops=c["flops"] / d1["flops"])
    if one_chip and all(figs.get(k, {}).get("seconds") for k in ("ar", "dflash2")):
        report["dflash2_cycle_over_step"] = figs["dflash2"]["seconds"] / figs["ar"]["seconds"]
    if one_chip and all(figs.get(k, {}).get("seconds") for k in ("ar", "dflash")):
        report["cycle_over_step"] = figs["dflash"]["seconds"] / figs["ar"]["seconds"]
        report["projected_speedup"] = args.paper_tau / report["cycle_over_step"]
        report["trees"] = {}
        for n in budgets:
            t_tree = figs[f"tree{n}"].get("seconds")
            if not t_tree:
                continue
            tree = dict(cycle_over_step=t_tree / figs["ar"]["seconds"],
                        cycle_over_chain=t_tree / figs["dflash"]["seconds"])
            # the tau at which tau x t_step / t_tree equals the chain's paper_tau x t_step / t_chain
            tree["tau_needed"] = args.paper_tau * tree["cycle_over_chain"]
            if n in taus:
                tree.update(tau=taus[n], projected_speedup=taus[n] / tree["cycle_over_step"])
            report["trees"][str(n)] = tree
    print_report(report)
    return report


def _sweep(args, target, mesh, tcfg, dcfg, cache_len: int) -> dict:
    """--batch-sweep (`bench.aot_sweep`): one chip, AR + K = 0 + each --draft-sweep K at each batch."""
    from dflash_jax.engine.speculation import default_candidates

    from bench.aot_sweep import run_sweep
    from bench.suite import int_list

    b = dcfg.block_size
    if target.num_chips != 1:
        raise SystemExit("error: --batch-sweep compares the compiler's times on one chip: give a 1-chip topology")
    batches = int_list(args.batch_sweep, "--batch-sweep")
    drafts = (int_list(args.draft_sweep, "--draft-sweep") if getattr(args, "draft_sweep", None)
              else [k for k in default_candidates(b) if k])
    if any(k > b - 1 for k in drafts):
        raise SystemExit(f"error: --draft-sweep takes draft lengths 1..{b - 1} (block {b}), got {args.draft_sweep!r}")
    return run_sweep(args, target, mesh, tcfg, dcfg, batches, sorted(set(drafts)), cache_len, streaming_rate, roofline)


def print_report(r: dict) -> None:
    one_chip = r["chips"] == 1
    rate = r["streaming_rate"]
    print()
    if rate:
        print(f"streaming rate: {rate / 1e12:.2f} TB/s (the compiler's estimate for a pure weight-streaming program "
              f"of the target's {r['target_weight_bytes'] / 1e9:.1f} GB, batch {r['batch_size']}; "
              f"HBM {r['chip_spec']['bandwidth'] / 1e12:.2f} TB/s)")
    else:
        print("several chips: the compiler's estimate of a partitioned program is not a per-chip time; "
              "the figures that count here are HBM per chip and the collectives")
    rows = [("program", "estimate", "bytes", "ideal", "ratio", "HBM per chip (args + temp)", "fits")]

    def row(label, f):
        if not f.get("compiled"):
            return (label, "does not compile", "", "", "", f.get("asked") or f["error"][:60], "no")
        mem = f["memory"]
        est = f"{f['seconds'] * 1e3:.2f} ms" if one_chip and f["seconds"] else "none" if one_chip else "-"
        ideal = f"{f['ideal']['bytes'] / 1e9:.1f} GB" if "ideal" in f else "-"
        if "ideal_seconds" in f:
            ideal += f" = {f['ideal_seconds'] * 1e3:.2f} ms"
        ratio = f"{f['ratio']:.2f}x" if "ratio" in f else "-"
        return (label, est, f"{f['bytes'] / 1e9:.1f} GB", ideal, ratio,
                f"{_gib(mem['total'])} ({_gib(mem['arguments'])} + {_gib(mem['temporaries'])})",
                "yes" if f["fits"] else "NO")

    names = dict(prefill=f"prefill {r['batch_size']} x {r['context']}", ar="AR step",
                 dflash=f"DFlash cycle, B={r['programs'].get('dflash', {}).get('block_size', 16)}",
                 dflash2=f"DFlash2 cycle, B={r['programs'].get('dflash2', {}).get('block_size', 16)}",
                 constrained=f"constrained cycle, B={r['programs'].get('constrained', {}).get('block_size', 16)}",
                 **{f"tree{n}": f"DFlash tree {n}" for n in r.get("tree_budgets", ())})
    for k, f in r["programs"].items():
        rows.append(row(f"{names[k]} (cache {r['cache_len']})" if k != "prefill" else names[k], f))
    if r["compare"]:
        for k, f in r["compare"].items():
            if k != "cache_len":
                rows.append(row(f"{names[k]} (cache {r['compare']['cache_len']})", f))
    widths = [max(len(str(x[i])) for x in rows) for i in range(len(rows[0]))]
    for x in rows:
        print("  ".join(f"{str(v):{w}}" for v, w in zip(x, widths)))
    if "dflash2_over_dflash" in r:
        x, d2 = r["dflash2_over_dflash"], r["programs"]["dflash2"]
        ideal = d2["ideal"]
        print(f"\nDFlash2 / DFlash (the same drafter without DFlash2's convolutions and selector): estimate "
              f"{x['seconds']:.3f}x, bytes {x['bytes']:.3f}x, flops {x['flops']:.3f}x, ideal {x['ideal']:.3f}x; the "
              f"DFlash2 ideal counts the selector's two codebooks read whole "
              f"({d2['selector_codebooks'] / 1e9:.2f} GB of its {ideal['drafter_weights'] / 1e9:.2f} GB of drafter "
              f"weights) and the LM head a second time ({ideal['lm_head_again'] / 1e9:.2f} GB)")
    if "constrained_over_dflash" in r:
        x = r["constrained_over_dflash"]
        print(f"\nconstrained / DFlash cycle (a pool of {r['programs']['constrained']['constraint_states']} automaton "
              f"states a slot: logits masked at every verified position, drafts along the masked chain): estimate "
              f"{x['seconds']:.3f}x, bytes {x['bytes']:.3f}x, flops {x['flops']:.3f}x")
    if "dflash2_cycle_over_step" in r:
        print(f"DFlash2 cycle / AR step {r['dflash2_cycle_over_step']:.2f}: the tau DFlash2 needs for a speedup of s "
              f"is s x {r['dflash2_cycle_over_step']:.2f}")
    if "projected_speedup" in r:
        print(f"\ncycle / step {r['cycle_over_step']:.2f}: projected speedup at tau {r['paper_tau']} "
              f"{r['projected_speedup']:.2f}x (tau x t_step / t_cycle, the compiler's estimates)")
        for n, t in r.get("trees", {}).items():
            at = (f"projected speedup at tau {t['tau']} {t['projected_speedup']:.2f}x" if "tau" in t
                  else "no --tree-tau given")
            print(f"  DFlash tree {n}: cycle / step {t['cycle_over_step']:.2f}, {t['cycle_over_chain']:.2f}x the "
                  f"chain's cycle; {at}; tau needed to match the chain at tau {r['paper_tau']}: "
                  f"{t['tau_needed']:.2f} ({t['cycle_over_chain']:.2f}x its tau)")
    prefetch = [(f"{names[k]} (cache {r['cache_len']})", f) for k, f in r["programs"].items() if "hbm_ratio" in f]
    if r["compare"]:
        prefetch += [(f"{names[k]} (cache {r['compare']['cache_len']})", f) for k, f in r["compare"].items()
                     if k != "cache_len" and "hbm_ratio" in f]
    if prefetch:
        print("bytes accessed count a buffer prefetched into on-chip memory five times; with each read from HBM "
              "once:")
        for label, f in prefetch:
            print(f"  {label}: {f['prefetched'] / 1e9:.2f} GB prefetched; {f['hbm_bytes'] / 1e9:.1f} GB, "
                  f"{f['hbm_ratio']:.2f}x the ideal")
    for k, f in r["programs"].items():
        if f.get("compiled"):
            c = f["collectives"]
            comm = ", ".join(f"{c[n]} {n}" for n in COLLECTIVES if c[n]) or "no collectives"
            print(f"{names[k]}: {f['while_loops']} while loops; {comm}; custom calls: "
                  f"{', '.join(f['custom_calls']) or 'none'}; compiled in {f['compile_seconds']:.0f} s")
            if c["all_gathered"]:
                print(f"  all-gathered: {', '.join(c['all_gathered'][:6])}")
    print_roofline(r, names)


def print_roofline(r: dict, names: dict) -> None:
    """Per single-chip program: its flops, arithmetic intensity against the chip's ridge, and its
    flops' time at peak as a share of the estimate (near 100 %: compute-bound)."""
    figs = [(k, f) for k, f in r["programs"].items() if f.get("roofline")]
    if not figs:
        return
    spec = r["chip_spec"]
    ridge = spec["flops"] / spec["bandwidth"]
    print(f"\nagainst the roof ({r['chip']}: {spec['flops'] / 1e12:.0f} TFLOP/s bfloat16, "
          f"{spec['bandwidth'] / 1e12:.2f} TB/s HBM, ridge {ridge:.0f} flop/byte):")
    rows = [("program", "verify", "flops", "flop/byte", "flops at peak", "share of estimate")]
    for k, f in figs:
        x = f["roofline"]
        rows.append((names[k], str(f["verify_len"]) if k != "prefill" else "-", f"{f['flops'] / 1e12:.3f} T",
                     f"{x['intensity']:.1f}" if x["intensity"] else "-", f"{x['compute_seconds'] * 1e3:.2f} ms",
                     f"{x['compute_share']:.0%}" if x["compute_share"] is not None else "-"))
    widths = [max(len(str(x[i])) for x in rows) for i in range(len(rows[0]))]
    for x in rows:
        print("  " + "  ".join(f"{str(v):{w}}" for v, w in zip(x, widths)))
    print("flop/byte: flops over the HBM bytes (prefetched buffers counted once); below the ridge a program is "
          "bound by memory; share: its flops at peak over the compiler's estimate (a loop body counted once)")
