"""Figures from runs, the printed tables, the JSON file and the PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

# --------------------------------------------------------------------------- figures


def acceptance_figures(acceptance_lengths: list[list[int]], block_size: int) -> dict:
    """tau, histogram (lengths 1..L, L the longest possible: the block size, or K + 1 with K
    drafts verified), per-slot rate P(a >= k) = share of cycles with length > k."""
    flat = [a for row in acceptance_lengths for a in row]
    n = len(flat)
    hist = {k: 0 for k in range(1, block_size + 1)}
    for a in flat:
        hist[a] = hist.get(a, 0) + 1
    per_slot = [sum(1 for a in flat if a > k) / n if n else 0.0 for k in range(1, block_size)]
    return dict(tau=sum(flat) / n if n else 0.0, cycles=n, acceptance_histogram={str(k): v for k, v in hist.items()},
                per_slot_acceptance=per_slot)


def config_label(r: dict) -> str:
    """A row's block size, with the drafts verified per cycle when fewer than the block's, or the
    draft tree's nodes: "16", "16:7" (block 16, 7 drafts verified), "16t32" (block 16, a tree of
    32 nodes verified)."""
    b, k, n = r["block_size"], r.get("draft_tokens"), r.get("tree_budget")
    if n:
        return f"{b}t{n}"
    return str(b) if not k or k == b - 1 else f"{b}:{k}"


# --------------------------------------------------------------------------- formatting


def fmt_ms(s: float | None) -> str:
    return "-" if s is None else f"{1e3 * s:.3f}"


def fmt_compiles(c: dict[str, int]) -> str:
    return f"{c.get('prefill', 0)}/{c.get('run_cycles', 0)}/{c.get('xla_compiles', 0)}"


def fmt_bytes(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:.0f} MiB"


def fmt_gb(n: float) -> str:
    return f"{n / 1e9:.4f} GB"


# --------------------------------------------------------------------------- the suite's tables


def print_tables(result: dict):
    base = {r["batch_size"]: r for r in result["baseline"]}
    hf = {r["batch_size"]: r for r in (result.get("transformers") or {}).get("rows", [])}
    head = (f"{'batch':>5}  {'method':12}  {'block':>5}  {'tok/s':>9}  {'min..max':>17}  {'speedup':>7}  {'tau':>5}  "
            f"{'cycles':>6}  {'loop cyc':>8}  {'== baseline':>11}  {'compiles timed':>14}  {'host RSS':>9}  "
            f"{'device':>9}")
    print(head)
    print("-" * len(head))
    for batch in result["settings"]["batch_sizes"]:
        b = base[batch]
        runs = b["tokens_per_second_runs"]
        print(f"{batch:>5}  {'baseline':12}  {1:>5}  {b['tokens_per_second']:>9.1f}  "
              f"{f'{min(runs):.1f}..{max(runs):.1f}':>17}  {'1.00x':>7}  {1.0:>5.2f}  {b['cycles']:>6}  "
              f"{b['loop_cycles']:>8}  {'-':>11}  {fmt_compiles(b['compiles_timed']):>14}  "
              f"{fmt_bytes(b['host_peak_rss_bytes']):>9}  {fmt_bytes(b['device_peak_bytes']):>9}")
        for r in result["dflash"]:
            if r["batch_size"] != batch:
                continue
            runs = r["tokens_per_second_runs"]
            same = f"{r['rows_matching_baseline']}/{len(r['outputs'])}"
            print(f"{batch:>5}  {'dflash':12}  {config_label(r):>5}  {r['tokens_per_second']:>9.1f}  "
                  f"{f'{min(runs):.1f}..{max(runs):.1f}':>17}  {r['speedup']:>6.2f}x  {r['tau']:>5.2f}  "
                  f"{r['cycles']:>6}  {r['loop_cycles']:>8}  {same:>11}  {fmt_compiles(r['compiles_timed']):>14}  "
                  f"{fmt_bytes(r['host_peak_rss_bytes']):>9}  {fmt_bytes(r['device_peak_bytes']):>9}")
        if batch in hf:
            h = hf[batch]
            runs = h["tokens_per_second_runs"]
            same = f"{h['rows_matching_baseline']}/{len(h['outputs'])}"
            print(f"{batch:>5}  {'transformers':12}  {'-':>5}  {h['tokens_per_second']:>9.1f}  "
                  f"{f'{min(runs):.1f}..{max(runs):.1f}':>17}  "
                  f"{h['tokens_per_second'] / b['tokens_per_second']:>6.2f}x  {'-':>5}  {'-':>6}  {'-':>8}  "
                  f"{same:>11}  {'-':>14}  {'-':>9}  {'-':>9}")
    print("block B:K = the drafter denoises blocks of B, the target verifies only the first K drafts of each; "
          + ("BtN = the target verifies a draft tree of N nodes grown from each block (N + 1 tokens a cycle); "
             if any(r.get("tree_budget") for r in result["dflash"]) else "") +
          "speedup: against the baseline (this engine, no drafter) at the same batch size; cycles: the rows' "
          "cycles, summed; loop cyc: the cycles the engine's loop ran (continuous batching: rows join as slots "
          "free), counted in an untimed run; compiles: prefill traces / run_cycles traces / all XLA compiles "
          "during the timed runs (should be 0/0/0); == baseline: rows whose tokens equal the baseline's; "
          "host RSS / device: process peaks so far (device: n/a where the backend does not report it)")

    print("\nacceptance (length a+1 of each cycle; per-slot rate of slot k = P(a >= k), the share of cycles "
          "accepting draft k):")
    for r in result["dflash"]:
        hist = r["acceptance_histogram"]
        total = max(1, sum(hist.values()))
        verified = f", {r['verify_len']} tokens verified a cycle" if r.get("tree_budget") else ""
        print(f"  batch {r['batch_size']} block {config_label(r):>4}: tau {r['tau']:.3f} over {r['cycles']} cycles"
              + verified)
        print("    histogram  " + "  ".join(f"{k}:{v}({v / total:.0%})" for k, v in hist.items()))
        print("    per slot   " + "  ".join(f"{k}:{p:.2f}" for k, p in enumerate(r["per_slot_acceptance"], 1)))

    splits = [r for r in result["dflash"] if r.get("time_split")]
    if splits:
        print("\ntime split of one cycle (ms; the engine's own pieces, each jitted in a loop on the device, on "
              "the state after the engine's prefill of the first batch; median):")
        head = (f"{'batch':>5}  {'block':>5}  {'draft':>8}  {'verify':>8}  {'extend':>8}  {'commit':>8}  "
                f"{'passes':>8}  {'cycle':>8}  {'bookkeep':>8}  {'beyond p':>8}  {'AR step':>8}  {'AR cycle':>8}  "
                f"{'cost ratio':>10}  {'tau/cost':>8}  {'measured':>8}  {'host/cycle':>10}")
        print(head)
        print("-" * len(head))
        for batch in result["settings"]["batch_sizes"]:
            bs = base[batch].get("time_split")
            if bs:
                print(f"{batch:>5}  {'base':>5}  {'-':>8}  {fmt_ms(bs['ar_step_s']):>8}  {'-':>8}  "
                      f"{fmt_ms(bs['commit_s']):>8}  {'-':>8}  {fmt_ms(bs['cycle_s']):>8}  {'-':>8}  {'-':>8}  "
                      f"{fmt_ms(bs['ar_step_s']):>8}  {fmt_ms(bs['cycle_s']):>8}  {'-':>10}  {'-':>8}  {'-':>8}  "
                      f"{fmt_ms(bs['host_overhead_per_cycle_s']):>10}")
            for r in splits:
                if r["batch_size"] != batch:
                    continue
                s = dict(dict.fromkeys(("draft_s", "verify_s", "extend_s", "commit_s", "passes_s", "bookkeeping_s")),
                         **r["time_split"])  # a tree's: the cycle alone
                beyond = s.get("overhead_beyond_passes_fraction")
                print(f"{batch:>5}  {config_label(r):>5}  {fmt_ms(s['draft_s']):>8}  {fmt_ms(s['verify_s']):>8}  "
                      f"{fmt_ms(s['extend_s']):>8}  {fmt_ms(s['commit_s']):>8}  {fmt_ms(s['passes_s']):>8}  "
                      f"{fmt_ms(s['cycle_s']):>8}  {fmt_ms(s['bookkeeping_s']):>8}  "
                      f"{'-' if beyond is None else f'{beyond:.1%}':>8}  {fmt_ms(s['ar_step_s']):>8}  "
                      f"{fmt_ms(s['baseline_cycle_s']):>8}  {s['cost_ratio']:>10.3f}  {s['speedup_check']:>7.2f}x  "
                      f"{s['measured_speedup']:>7.2f}x  {fmt_ms(s['host_overhead_per_cycle_s']):>10}")
        print("draft = dflash_jax.engine.draft; verify = engine.verify (the target on [anchor, drafts], taps, the "
              "pick); extend = drafter.extend_context of the verified block's taps; commit = engine.accept + "
              "engine.commit (its extend_context included); passes = draft, verify and extend back to back in one "
              "loop body, as a cycle runs them; cycle = engine.cycle; bookkeep = cycle - passes (accept and "
              "commit beyond extend_context), beyond p = its share of the cycle; AR step = the baseline's verify "
              "(the target on 1 token); AR cycle = the baseline's whole cycle; cost ratio = cycle / AR step; "
              "tau/cost = tau / cost ratio (the speedup the pieces predict); host/cycle = (generate wall time - "
              "the run's prefill calls, replayed) / loop cycles - cycle (the device cycle is timed with every "
              "slot of the first batch busy; noise can make small figures negative)"
              + ("; a tree's row times its whole cycle alone (the pieces are the chain's)"
                 if any(r.get("tree_budget") for r in splits) else ""))
    print_tree_gains(result)


def print_tree_gains(result: dict):
    """Each draft tree's tau and tokens/s against the chain's (the same block, every draft
    verified) at each batch size: what the tree buys for its longer verify."""
    trees = [r for r in result["dflash"] if r.get("tree_budget")]
    if not trees:
        return
    print("\ndraft trees against the chain (same block and batch):")
    for r in trees:
        chain = next((c for c in result["dflash"] if c["batch_size"] == r["batch_size"] and not c.get("tree_budget")
                      and c["block_size"] == r["block_size"] and c["draft_tokens"] == c["block_size"] - 1), None)
        if chain is None:
            continue
        print(f"  batch {r['batch_size']} block {config_label(r):>5}: {r['verify_len']} tokens verified a cycle "
              f"(chain {chain['verify_len']}); tau {r['tau']:.2f} / {chain['tau']:.2f} = "
              f"{r['tau'] / chain['tau']:.2f}x the chain's; tok/s "
              f"{r['tokens_per_second'] / chain['tokens_per_second']:.2f}x the chain's")


# --------------------------------------------------------------------------- plot


def write_plot(result: dict, path: Path) -> str | None:
    """tokens/s per block size and batch (DFlash vs baseline vs transformers) and tau per block
    size; rows verifying K < B - 1 drafts are a second series at K + 1 tokens verified, draft trees
    a third at N + 1. Returns
    why it was skipped, or None."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed"
    rows = result.get("dflash") or []
    if not rows:
        return "nothing to plot"
    blocks = sorted({r["draft_tokens"] + 1 for r in rows})  # tokens verified per cycle
    batches = sorted({r["batch_size"] for r in rows})
    hf = {r["batch_size"]: r["tokens_per_second"] for r in (result.get("transformers") or {}).get("rows", [])}
    base = {r["batch_size"]: r["tokens_per_second"] for r in result.get("baseline", [])}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, batch in enumerate(batches):
        c = colors[i % len(colors)]
        mine = [r for r in rows if r["batch_size"] == batch]
        trees = sorted((r["verify_len"], r["tokens_per_second"], r["tau"]) for r in mine if r.get("tree_budget"))
        mine = [r for r in mine if not r.get("tree_budget")]
        whole = [r for r in mine if r["draft_tokens"] == r["block_size"] - 1]
        pts = sorted((r["block_size"], r["tokens_per_second"], r["tau"]) for r in whole)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], "o-", color=c, label=f"DFlash, batch {batch}")
        cut = sorted((r["draft_tokens"] + 1, r["tokens_per_second"], r["tau"], r["block_size"])
                     for r in mine if r not in whole)
        if cut:
            label = f"DFlash block {cut[0][3]}, K drafts verified, batch {batch}"
            ax1.plot([p[0] for p in cut], [p[1] for p in cut], "s--", color=c, mfc="none", label=label)
            ax2.plot([p[0] for p in cut], [p[2] for p in cut], "s--", color=c, mfc="none", label=label)
        if trees:
            label = f"DFlash draft tree (N + 1 verified), batch {batch}"
            ax1.plot([p[0] for p in trees], [p[1] for p in trees], "^:", color=c, label=label)
            ax2.plot([p[0] for p in trees], [p[2] for p in trees], "^:", color=c, label=label)
        if batch in base:
            ax1.axhline(base[batch], color=c, ls="--", lw=1, label=f"baseline (JAX AR), batch {batch}")
        if batch in hf:
            ax1.axhline(hf[batch], color=c, ls=":", lw=1, label=f"transformers, batch {batch}")
        ax2.plot([p[0] for p in pts], [p[2] for p in pts], "o-", color=c, label=f"batch {batch}")
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(blocks, [str(b) for b in blocks])
        ax.set_xlabel("tokens verified per cycle (block size B, K + 1, or a tree's N + 1)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("output tokens/s")
    ax1.set_yscale("log")
    ax1.legend(fontsize=7)
    ax2.set_ylabel("tau (mean acceptance length)")
    ax2.legend(fontsize=7)
    env = result["env"]
    fig.suptitle(f"{result['pair']['name']}  |  {env['backend']} {env['devices'][0]}  |  "
                 f"{result['settings']['max_new_tokens']} new tokens, "
                 f"{'greedy' if result['settings'].get('temperature', 0) == 0 else 'sampled'}", fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


# --------------------------------------------------------------------------- outputs


def write_outputs(result: dict, json_path, plot_path=None, plot: bool = False) -> None:
    """The JSON file (and, for the suite, the PNG plot next to it unless plot_path says where)."""
    path = Path(json_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if plot:
        where = Path(plot_path) if plot_path else path.parent / "bench.png"
        why = write_plot(result, where)
        result["plot"] = None if why else str(where)
        print(f"plot: not drawn ({why})" if why else f"wrote {where}")
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")
