"""The suite: baseline and DFlash engines on held-out prompts, every batch and block size, with
acceptance figures, losslessness, compile counts, peak memory, the time split of a cycle and
the transformers reference."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from bench.prompts import describe_prompts, heldout_snippets, package_version, prompt_ids
from bench.report import acceptance_figures, config_label, print_tables
from bench.timing import (
    bench_generator, first_state, host_peak_rss, device_peak_bytes, narrow_tail_default, split_figures, time_pieces,
    time_prefill,
)


def shown(path) -> str:
    """A path as results files record it: relative to the working directory when inside it."""
    if path is None:
        return None
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"error: {flag} must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"error: {flag} must be positive integers, got {text!r}")
    return values


def get_pair(args):
    """The pair the flags name: --random, --target/--drafter, or the bundled demo pair."""
    from bench.pairs import directory_pair, random_pair

    if args.random:
        if args.target or args.drafter:
            raise SystemExit("error: --random builds its own pair; drop --target/--drafter")
        return random_pair(args)
    return directory_pair(args.target, args.drafter, args.dtype)


def describe_pair(pair) -> str:
    t, d = pair.target, pair.drafter.model
    where = f" ({pair.target_dir} + {pair.drafter_dir})" if pair.target_dir else ""
    return (f"pair: {pair.name}{where}; loaded in {pair.load_seconds:.1f}s\n"
            f"  target: {t.model_type}, vocab {t.vocab_size}, hidden {t.hidden_size}, {t.num_hidden_layers} layers, "
            f"{t.num_attention_heads}/{t.num_key_value_heads} heads x {t.head_dim}, {t.dtype}; tokenizer: "
            f"{'yes' if pair.tokenizer is not None else 'none'}\n"
            f"  drafter: {d.num_hidden_layers} layers, trained block size {pair.drafter.block_size}, mask "
            f"{pair.drafter.mask_token_id}, taps {list(pair.drafter.target_layer_ids)}, {d.dtype}")


def pair_record(pair) -> dict:
    from dflash_jax.checkpoint import is_converted

    d = pair.drafter
    return dict(name=pair.name, target_dir=shown(pair.target_dir), drafter_dir=shown(pair.drafter_dir), demo=pair.demo,
                random=pair.random, tokenizer=pair.tokenizer is not None,
                target_converted=bool(pair.target_dir and is_converted(pair.target_dir)),
                target=dataclasses.asdict(pair.target),
                drafter=dict(layers=d.model.num_hidden_layers, block_size=d.block_size, mask_token_id=d.mask_token_id,
                             taps=list(d.target_layer_ids), dtype=d.model.dtype))


def heldout_prompts(args, pair, num: int | None = None):
    """(prompts, snippets, kind): the held-out snippets as token ids for this pair."""
    snippets = heldout_snippets(args.heldout_package, num or args.num_prompts, args.seed, args.prompt_lines)
    prompts, kind = prompt_ids(snippets, pair.tokenizer, pair.target.vocab_size, [pair.drafter.mask_token_id],
                               args.max_prompt_tokens, args.seed)
    return prompts, snippets, kind


def host_overhead(run: dict, prefill_s: float, cycle_s: float) -> float | None:
    """Seconds per loop cycle of a timed run not spent in prefill or in a cycle of the full
    batch's width; None once the tail narrowed (its cycles are cheaper than cycle_s)."""
    if run["slot_cycles"] != run["loop_cycles"] * run["batch_size"]:
        return None
    return (run["seconds"] - prefill_s) / run["loop_cycles"] - cycle_s


def run_suite(args, result: dict) -> int:
    from dflash_jax.engine import BatchEngine, Sampling
    from dflash_jax.errors import DFlashError

    try:
        pair = get_pair(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tcfg, tparams, dcfg, dparams = pair.target, pair.tparams, pair.drafter, pair.dparams
    if args.quick:
        args.no_split = args.no_transformers = True
    if args.block_sizes is None:
        block_sizes = [dcfg.block_size] if args.quick else [4, 8, 16]
    else:
        block_sizes = [b for b in int_list(args.block_sizes, "--block-sizes") if b > 1]
    if args.draft_tokens is None:
        draft_text = "" if args.quick else "3,5,7"
    else:
        draft_text = args.draft_tokens
    draft_tokens = int_list(draft_text, "--draft-tokens") if draft_text.strip() else []
    batch_sizes = int_list(args.batch_sizes, "--batch-sizes")
    hf_batches = int_list(args.hf_batch_sizes, "--hf-batch-sizes") if args.hf_batch_sizes else batch_sizes
    tree_budgets = int_list(args.tree_budgets, "--tree-budgets") if args.tree_budgets else []
    bad = [k for k in draft_tokens if not 1 <= k <= dcfg.block_size - 1]
    if bad:
        raise SystemExit(f"error: --draft-tokens {bad[0]} is outside 1..{dcfg.block_size - 1} (the drafter's "
                         f"block size is {dcfg.block_size})")
    # (block size, drafts verified per cycle, tree nodes verified per cycle): every block size with
    # its whole block, then the drafter's own block size with fewer drafts verified, then with a
    # draft tree of each budget
    configs = ([(b, None, 0) for b in block_sizes]
               + [(dcfg.block_size, k, 0) for k in draft_tokens
                  if k != dcfg.block_size - 1 or dcfg.block_size not in block_sizes]
               + [(dcfg.block_size, None, n) for n in tree_budgets])
    print(describe_pair(pair))
    prompts, snippets, kind = heldout_prompts(args, pair)
    print(describe_prompts(prompts, snippets, kind, args.heldout_package, args.prompt_lines))
    sampling = Sampling(temperature=args.temperature)
    how = "greedy" if sampling.greedy else f"temperature {args.temperature:g}"
    print(f"{how}, {args.max_new_tokens} new tokens per row (stop tokens ignored), median of {args.repeats} timed "
          f"runs after warm-up; block sizes {block_sizes}"
          + (f", block {dcfg.block_size} verifying {draft_tokens} drafts" if draft_tokens else "")
          + (f", block {dcfg.block_size} verifying trees of {tree_budgets} nodes" if tree_budgets else "")
          + f", batch sizes {batch_sizes}\n")

    lens = [len(p) for p in prompts]
    result.update(
        pair=pair_record(pair),
        prompts=dict(package=args.heldout_package, package_version=package_version(args.heldout_package), kind=kind,
                     lines=args.prompt_lines, lengths=lens, snippets=snippets, input_ids=prompts),
        settings=dict(block_sizes=block_sizes, draft_tokens=draft_tokens, tree_budgets=tree_budgets,
                      batch_sizes=batch_sizes,
                      max_new_tokens=args.max_new_tokens, repeats=args.repeats, seed=args.seed,
                      sync_every=args.sync_every, greedy=sampling.greedy, temperature=args.temperature,
                      stop_tokens="ignored", max_prompt_tokens=args.max_prompt_tokens, acceptance=args.acceptance,
                      narrow_tail=narrow_tail_default(args.narrow_tail)),
        baseline=[], dflash=[],
    )
    common = dict(max_new_tokens=args.max_new_tokens, max_prompt_len=max(lens), sampling=sampling,
                  stop_token_ids=(), sync_every=args.sync_every, narrow_tail=narrow_tail_default(args.narrow_tail),
                  speculation="fixed")
    split = dict(rounds=args.split_rounds, min_round_s=args.split_min_time)
    try:
        for batch in batch_sizes:
            gen0 = BatchEngine(tcfg, tparams, block_size=1, batch_size=batch, **common)
            base = bench_generator(gen0, prompts, args.repeats, args.seed)
            print(f"batch {batch}: baseline {base['tokens_per_second']:.1f} tok/s", flush=True)
            base_state = None
            if not args.no_split:
                base_state = first_state(gen0, prompts, args.seed)
                ar = time_pieces(tparams, None, None, None, gen0.spec, base_state, gen0.stop_ids, **split)
                prefill_s = time_prefill(gen0, base["_admissions"], args.seed, args.split_rounds)
                cyc = ar["ar_cycle"]["seconds"]
                base["time_split"] = dict(
                    ar_step_s=ar["ar_verify"]["seconds"], commit_s=ar["ar_commit"]["seconds"], cycle_s=cyc,
                    prefill_s=prefill_s, generate_s_per_loop_cycle=base["seconds"] / base["loop_cycles"],
                    host_overhead_per_cycle_s=host_overhead(base, prefill_s, cyc),
                    iterations={k: v["iterations"] for k, v in ar.items()})
            base.update(cycles=sum(len(a) for a in base["acceptance_lengths"]))
            result["baseline"].append(base)
            for b, k, n in configs:
                gen = BatchEngine(tcfg, tparams, dcfg, dparams, block_size=b, batch_size=batch, draft_tokens=k,
                                  tree_budget=n, acceptance=args.acceptance, **common)
                r = bench_generator(gen, prompts, args.repeats, args.seed)
                # a tree accepts at most one node per block position: B tokens, however many it verifies
                r.update(acceptance_figures(r["acceptance_lengths"], min(gen.spec.verify_len, b)))
                r["speedup"] = r["tokens_per_second"] / base["tokens_per_second"]
                r["rows_matching_baseline"] = sum(x == y for x, y in zip(r["outputs"], base["outputs"]))
                # rejection sampling keeps the target's distribution, not the baseline's tokens
                r["lossless"] = r["rows_matching_baseline"] == len(prompts) or gen.spec.rejection
                r["acceptance_rule"] = "rejection" if gen.spec.rejection else "match"
                if base_state is not None:
                    # the baseline's AR step and cycle are timed again, interleaved with these pieces
                    pieces = time_pieces(tparams, dparams, gen.spec, first_state(gen, prompts, args.seed), gen0.spec,
                                         base_state, gen.stop_ids, **split)
                    sec = {name: v["seconds"] for name, v in pieces.items()}
                    cyc, ar_step, ar_cycle = sec["cycle"], sec["ar_verify"], sec["ar_cycle"]
                    prefill_s = time_prefill(gen, r["_admissions"], args.seed, args.split_rounds)
                    r["time_split"] = dict(
                        **(split_figures(sec) if "draft" in sec else dict(cycle_s=cyc)),
                        ar_step_s=ar_step, baseline_cycle_s=ar_cycle,
                        cost_ratio=cyc / ar_step, speedup_check=r["tau"] / (cyc / ar_step),
                        cost_ratio_vs_baseline_cycle=cyc / ar_cycle,
                        speedup_check_vs_baseline_cycle=r["tau"] / (cyc / ar_cycle),
                        measured_speedup=r["speedup"],
                        prefill_s=prefill_s, generate_s_per_loop_cycle=r["seconds"] / r["loop_cycles"],
                        host_overhead_per_cycle_s=host_overhead(r, prefill_s, cyc),
                        iterations={name: v["iterations"] for name, v in pieces.items()},
                    )
                result["dflash"].append(r)
                print(f"batch {batch} block {config_label(r)}: dflash {r['tokens_per_second']:.1f} tok/s "
                      f"({r['speedup']:.2f}x), "
                      f"tau {r['tau']:.2f}, == baseline {r['rows_matching_baseline']}/{len(prompts)}", flush=True)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for r in result["baseline"] + result["dflash"]:
        del r["_admissions"]

    if args.no_transformers:
        result["transformers"] = dict(skipped="--no-transformers")
    elif pair.random:
        result["transformers"] = dict(skipped="a random pair in memory has no HF directory")
    elif result["pair"]["target_converted"]:
        result["transformers"] = dict(skipped="the target is a converted directory; transformers needs an HF one")
    elif not sampling.greedy:
        result["transformers"] = dict(skipped="sampled runs: the reference is greedy")
    else:
        from bench.hf import bench_transformers

        ref = result["baseline"][0]["outputs"]
        result["transformers"] = bench_transformers(pair.target_dir, tcfg.dtype, prompts, hf_batches,
                                                    args.max_new_tokens, args.repeats, ref, args.torch_threads)
    hf = result["transformers"]
    if "skipped" in hf:
        print(f"transformers: skipped ({hf['skipped']})")
    else:
        print(f"transformers {hf['transformers_version']} / torch {hf['torch_version']} ({hf['torch_threads']} "
              f"threads, {hf['dtype']}): " + ", ".join(
                  f"batch {r['batch_size']} {r['tokens_per_second']:.1f} tok/s" for r in hf["rows"]))

    print()
    print_tables(result)
    timed_compiles = {(r["batch_size"], config_label(r)): r["compiles_timed"]
                      for r in result["baseline"] + result["dflash"]}
    leaks = {k: v for k, v in timed_compiles.items() if v.get("prefill") or v.get("run_cycles")}
    lossy = [(r["batch_size"], config_label(r)) for r in result["dflash"] if not r["lossless"]]
    first = batch_sizes[0]
    by_batch = {}
    for r in result["baseline"] + result["dflash"]:
        by_batch.setdefault((config_label(r) if r in result["dflash"] else "1"), {})[r["batch_size"]] = r["outputs"]
    batch_variant = sorted({label for label, rows in by_batch.items() for b, out in rows.items() if out != rows[first]})
    print("\n" + ("losslessness" if sampling.greedy else "same tokens as the baseline (the same per-position keys)")
          + " (DFlash tokens == baseline tokens): "
          + ("every configuration" if not lossy else f"FAILS for (batch, block) {lossy}"))
    print(f"outputs independent of the batch size (== batch {first}): "
          + ("every configuration" if not batch_variant else f"NOT for block(s) {batch_variant}"))
    print("recompilations of prefill/run_cycles during timed runs: "
          + ("none" if not leaks else ", ".join(f"(batch, block) {k}: {v}" for k, v in leaks.items())))
    print(f"host peak RSS {host_peak_rss() / 2**20:.0f} MiB; device peak "
          + (f"{device_peak_bytes() / 2**20:.0f} MiB" if device_peak_bytes() is not None else "n/a"))
    result["summary"] = dict(
        lossless=not lossy, batch_invariant=not batch_variant,
        compilations_during_timed_runs=sum(v.get("prefill", 0) + v.get("run_cycles", 0)
                                           for v in timed_compiles.values()),
        host_peak_rss_bytes=host_peak_rss(), device_peak_bytes=device_peak_bytes())
    return 0
