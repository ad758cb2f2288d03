"""--aot ... --batch-sweep N,...: the cost of a decoding cycle across batch sizes by the TPU compiler,
and what auto speculation (`dflash_jax.engine.speculation`) would choose from it.

At each batch of the sweep, on one chip, at `--context` positions per row (the cache the context
plus two blocks, per slot), the engine's run_cycles is compiled for:

  ar     plain decoding without a drafter (block 1): one step
  K = 0  the DFlash engine's plain cycle (`EngineSpec.with_drafts(0)`): one target step, and the
         drafter's context still extended with its taps
  K      (`--draft-sweep`, default the auto candidates 3, 7 and B - 1) the DFlash cycle verifying
         the first K drafts of the block

Per program: the compiler's estimate, bytes, flops, flops per HBM byte against the chip's ridge
(peak flop/s / HBM bytes/s), the ideal (`cost.ideal_bytes` at the compiler's streaming rate) and
HBM. A program whose arguments alone (weights + state) exceed the chip's HBM is not compiled: it is
reported as not fitting, with those bytes; one the compiler finds too big is reported with what
it asked for. Per program also the batch where it crosses the ridge (stops being memory-bound).
Each program's figures go to `.partial.json` beside --json as it compiles; a sweep run again with
the same settings takes them from there and compiles only the rest (a full sweep of Qwen3-8B is
some 50 compiles of 2 to 10 minutes each on 2 cores).

Per batch: each K's break-even tau against the AR step (t_cycle(K) / t_AR: a cycle pays when its
rows gain more tokens than that), and at the paper's tau (`--paper-tau` at K = B - 1, turned into
per-position acceptance rates by `rates_for_tau`) each K's projected tokens/s per row
(expected_tokens(rates, K) / t_cycle(K)), the best K, and the policy's own choice
(`speculation.choose` over the K = 0 cycle and the drafting ones) with its ratio to the best.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path


def _nbytes(tree) -> int:
    import jax

    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def sweep_specs(tcfg, dcfg, cache_len: int, page_size: int, mesh, drafts: list[int]) -> dict:
    """{label: EngineSpec}: 'ar', then 'k0' and 'k{K}' for each K of `drafts` (the DFlash engine verifying K)."""
    from dflash_jax.engine import EngineSpec, Sampling

    common = dict(target=tcfg, sampling=Sampling(), max_new_tokens=64, cache_len=cache_len, page_size=page_size,
                  mesh=mesh)
    dflash = EngineSpec(drafter=dcfg, block_size=dcfg.block_size, **common)
    out = dict(ar=EngineSpec(drafter=None, block_size=1, **common))
    for k in (0, *drafts):
        out[f"k{k}"] = dflash.with_drafts(k)
    return out


def compile_program(spec, target, mesh, batch: int, context: int, hlo_dir, name: str, rate: float, roofline) -> dict:
    """One run_cycles compiled for the chip (or, where its arguments exceed HBM, not): its figures
    (`roofline`: `bench.aot.roofline`, which places it against the chip's roof)."""
    import jax.numpy as jnp

    from dflash_jax.aot import abstract_replicated, abstract_sharded, compile_for_tpu
    from dflash_jax.engine import decode_state_shardings, run_cycles
    from dflash_jax.sharding import param_shardings

    from bench.cost import abstract_inputs, ideal_bytes

    chip = target.chip
    tparams, dparams, state, _ = abstract_inputs(spec, batch, context)
    arguments = _nbytes(tparams) + _nbytes(dparams) + _nbytes(state)
    fig = dict(batch=batch, draft_tokens=spec.num_drafts if spec.uses_drafter else None,
               verify_len=spec.verify_len, ideal=ideal_bytes(spec, tparams, dparams, batch, context))
    if arguments > chip.hbm:  # the weights and the state alone do not fit: nothing to compile
        return dict(fig, compiled=False, fits=False, skipped=True, arguments=arguments,
                    asked=f"its arguments alone are {arguments / 2**30:.1f} of {chip.hbm / 2**30:.2f} GiB HBM")
    tparams = abstract_sharded(tparams, param_shardings(tparams, mesh))
    dparams = None if dparams is None else abstract_sharded(dparams, param_shardings(dparams, mesh))
    args = (tparams, dparams, spec, abstract_sharded(state, decode_state_shardings(state, mesh)),
            abstract_replicated(mesh, (8,), jnp.int32), abstract_replicated(mesh, (), jnp.int32),
            abstract_replicated(mesh, (), jnp.bool_))
    fig.update(compile_for_tpu(run_cycles, args, hlo_dir, name))
    if not fig["compiled"]:
        return dict(fig, fits=False)
    fig["fits"] = fig["memory"]["total"] <= chip.hbm
    fig["ideal_seconds"] = fig["ideal"]["bytes"] / rate
    if fig["seconds"]:
        fig["ratio"] = fig["seconds"] / fig["ideal_seconds"]
    fig["roofline"] = roofline(fig, chip)
    return fig


def ridge_crossing(points: list[tuple[int, float | None]], ridge: float) -> dict:
    """points: (batch, flop/byte) in batch order -> the first batch of the sweep at or above the ridge,
    and the batch where the line through its neighbours (log-log) meets it; None if none reaches it."""
    known = [(b, x) for b, x in points if x]
    for (b0, x0), (b1, x1) in zip([(None, None), *known], known):
        if x1 < ridge:
            continue
        if b0 is None or x1 <= x0:
            return dict(first_batch=b1, batch=float(b1))
        t = (math.log(ridge) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return dict(first_batch=b1, batch=math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0))))
    return dict(first_batch=None, batch=None)


def policy_at(figs: dict, drafts: list[int], rates: list[float]) -> dict:
    """One batch's programs -> break-even taus, tokens/s per row per K, the best K and the policy's choice."""
    from dflash_jax.engine.speculation import choose, expected_tokens

    sec = {k: f.get("seconds") for k, f in figs.items() if f.get("compiled") and f.get("fits")}
    out = dict(tau_break={}, tokens_per_second={}, expected_tokens={})
    t_ar = sec.get("ar")
    costs = {k: sec[f"k{k}"] for k in (0, *drafts) if sec.get(f"k{k}")}
    for k, t in costs.items():
        out["expected_tokens"][str(k)] = expected_tokens(rates, k)
        out["tokens_per_second"][str(k)] = expected_tokens(rates, k) / t
        if t_ar:
            out["tau_break"][str(k)] = t / t_ar
    if t_ar:
        out["tokens_per_second"]["ar"] = 1.0 / t_ar
    if costs:
        tps = {k: expected_tokens(rates, k) / t for k, t in costs.items()}
        best, chosen = max(tps, key=lambda k: (tps[k], -k)), choose(costs, rates)
        out.update(best=best, choice=chosen, choice_over_best=tps[chosen] / tps[best])
        if t_ar:
            out["best_over_ar"] = tps[best] * t_ar
    return out


def run_sweep(args, target, mesh, tcfg, dcfg, batches: list[int], drafts: list[int], cache_len: int,
              streaming_rate, roofline) -> dict:
    """The sweep (module docstring): compiles batch by batch in the order given, printing each program's
    figures and writing the report so far next to --json (`.partial.json`) as it goes. streaming_rate,
    roofline: `bench.aot`'s (passed in: bench.aot runs this)."""
    from dflash_jax import attention as attention_
    from dflash_jax.engine.speculation import rates_for_tau
    from dflash_jax.model import abstract_params

    from bench.pairs import param_bytes

    chip, context, b = target.chip, args.context, dcfg.block_size
    hlo_dir = Path(args.hlo) if args.hlo else None
    specs = sweep_specs(tcfg, dcfg, cache_len, args.page_size, mesh, drafts)
    rates = rates_for_tau(args.paper_tau, b - 1)
    weights = param_bytes(abstract_params(tcfg))
    report = dict(topology=target.name, chip=target.chip_name, chip_spec=dataclasses.asdict(chip),
                  shape=args.shape, context=context, cache_len=cache_len, page_size=args.page_size,
                  batches=sorted(batches), draft_sweep=drafts, paper_tau=args.paper_tau, rates=rates,
                  ridge=chip.flops / chip.bandwidth, programs={}, streaming_rates={}, policy={})
    partial = Path(args.json).with_suffix(".partial.json") if args.json else None
    done = resumed(partial, report)
    print(f"sweep: batches {batches}, programs {list(specs)} at context {context} (cache {cache_len}); "
          f"ridge {report['ridge']:.0f} flop/byte" + (f"; {done} programs from {partial}" if done else ""), flush=True)
    with attention_.override("pallas", expected_live=context):
        for batch in batches:
            # the weight-streaming program at batch 8 is memory-bound; at 256 rows it is compute-bound, and
            # its rate would not be a memory rate
            rate = streaming_rate(target.devices[0], weights, min(batch, 8))
            report["streaming_rates"][str(batch)] = rate
            figs = {}
            for label, spec in specs.items():
                f = report["programs"].get(label, {}).get(str(batch))
                if f is None:
                    f = compile_program(spec, target, mesh, batch, context, hlo_dir, f"{label}-b{batch}-c{context}",
                                        rate, roofline)
                    report["programs"].setdefault(label, {})[str(batch)] = f
                    if partial:  # after every program: a sweep cut short resumes from here
                        partial.parent.mkdir(parents=True, exist_ok=True)
                        partial.write_text(json.dumps(report, indent=1) + "\n")
                figs[label] = f
                print("  " + program_line(label, f), flush=True)
            report["policy"][str(batch)] = policy_at(figs, drafts, rates)
    report["crossings"] = {label: ridge_crossing([(n, (by.get(str(n), {}).get("roofline") or {}).get("intensity"))
                                                  for n in sorted(batches)], report["ridge"])
                           for label, by in report["programs"].items()}
    print_sweep(report)
    return report


def resumed(partial: Path | None, report: dict) -> int:
    """Take the programs a cut-short sweep of the same settings compiled (its `.partial.json`) into
    `report`; how many."""
    if partial is None or not partial.exists():
        return 0
    old = json.loads(partial.read_text())
    same = ("topology", "shape", "context", "cache_len", "page_size", "paper_tau")
    if any(old.get(k) != report[k] for k in same):
        return 0
    report["programs"] = {label: dict(by) for label, by in old.get("programs", {}).items()}
    return sum(len(by) for by in report["programs"].values())


def program_line(label: str, f: dict) -> str:
    head = f"{label:4} batch {f['batch']:4}: "
    if not f.get("compiled"):
        return head + "does not fit (" + (f.get("asked") or f.get("error", "")[:80]) + ")"
    x = f["roofline"]
    return head + (f"{f['seconds'] * 1e3:8.2f} ms, {f['bytes'] / 1e9:6.1f} GB, {f['flops'] / 1e12:7.2f} TFLOP, "
                   f"{x['intensity']:6.1f} flop/byte, {f.get('ratio', 0):.2f}x ideal, "
                   f"HBM {f['memory']['total'] / 2**30:.1f} GiB; compiled in {f['compile_seconds']:.0f} s")


def print_sweep(r: dict) -> None:
    """The sweep's table: per batch each program's estimate (ms) and flop/byte, the break-even taus, the
    projected tokens/s per row at the paper's tau, the best K and the policy's choice."""
    labels = list(r["programs"])
    print(f"\ncost of a cycle across batch sizes ({r['chip']}, {r['shape']}, context {r['context']}, ridge "
          f"{r['ridge']:.0f} flop/byte): estimate ms (flop/byte)")
    print("batch  " + "  ".join(f"{x:>16}" for x in labels))
    for n in r["batches"]:
        cells = []
        for label in labels:
            f = r["programs"][label][str(n)]
            cells.append(f"{f['seconds'] * 1e3:7.2f} ({f['roofline']['intensity']:5.0f})" if f.get("seconds")
                         else "does not fit")
        print(f"{n:5}  " + "  ".join(f"{c:>16}" for c in cells))
    print("ridge crossed (flops per HBM byte >= the ridge) at batch: "
          + "; ".join(f"{label} {c['batch']:.0f} (first swept: {c['first_batch']})" if c["batch"]
                      else f"{label} not within the sweep" for label, c in r["crossings"].items()))
    print(f"\nat tau {r['paper_tau']} (K = B - 1; per-position acceptance {r['rates'][0]:.3f}): break-even tau "
          "t_cycle(K) / t_AR, tokens/s per row, best K, the policy's choice")
    for n in r["batches"]:
        p = r["policy"][str(n)]
        if "best" not in p:
            print(f"  batch {n}: no cycle fits")
            continue
        taus = ", ".join(f"K={k} {t:.2f}" for k, t in p["tau_break"].items())
        tps = ", ".join(f"{k} {t:.0f}" for k, t in p["tokens_per_second"].items())
        print(f"  batch {n}: tau_break {taus}; tokens/s/row {tps}; best K {p['best']}, chosen {p['choice']} "
              f"({p['choice_over_best']:.3f} of best)" + (f", {p['best_over_ar']:.2f}x AR" if "best_over_ar" in p
                                                          else ""))
