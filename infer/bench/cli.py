"""The command line of `python -m infer.bench` (see the package docstring)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import warnings
from pathlib import Path

import infer.bench as package
from infer.bench.pairs import SHAPES
from infer.bench.published import PAPER_TAU
from infer.bench.report import write_outputs

BENCH_DIR = Path("runs/bench")


class ArgumentParser(argparse.ArgumentParser):
    """A bad flag is one line naming it, not the whole usage."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def default_json(args, mode: str) -> Path:
    """Each mode its own file, so one never overwrites another's: runs/bench/suite.json,
    cost-qwen3-8b-x0.25.json, moe-cost.json, ..."""
    name = mode.replace("_", "-")
    if mode == "suite" and args.random:
        name = "suite-random"
    if mode in ("cost", "published_shapes"):
        name += f"-{args.shape}-x{args.scale:g}"
    if mode == "aot":
        name += f"-{args.aot.replace(':', '-')}-{args.shape}" + (f"-x{args.scale:g}" if args.scale != 1 else "")
    return BENCH_DIR / f"{name}.json"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m infer.bench", description=package.__doc__.splitlines()[0],
                                epilog="\n".join(package.__doc__.splitlines()[1:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_argument_group("modes (default: the suite)")
    mode.add_argument("--cost", action="store_true",
                      help="hardware-independent cost report of an AR step and a DFlash cycle at the published "
                           "shapes (abstract weights: nothing allocated, nothing run)")
    mode.add_argument("--aot", metavar="TOPOLOGY",
                      help="compile prefill and the AR / DFlash run_cycles for a TPU topology (v5e:1x1, v5e:2x2, "
                           "v5p:1x1x1, v5p:2x2x1, ...) on this machine (needs libtpu: pip install -e '.[tpu]'); "
                           "the TPU compiler's time estimate, bytes, HBM per chip, the ideal at its streaming "
                           "rate, collectives")
    mode.add_argument("--moe-cost", action="store_true",
                      help="what a DFlash cycle costs against a decoding step for the published MoE targets "
                           "(gpt-oss-20b, Qwen3-30B-A3B): experts touched per verify, bytes, projected speedup")
    mode.add_argument("--published-shapes", action="store_true",
                      help="time the engine's pieces on a Qwen3-8B-shaped target + 5-layer drafter with random "
                           "weights")
    mode.add_argument("--cache-scaling", action="store_true",
                      help="tokens/s with a small and a large Generator max_prompt_len (allocated cache)")
    mode.add_argument("--mixed-workload", action="store_true",
                      help="tokens/s with per-row max_new_tokens spread out, against every row at the mean")
    mode.add_argument("--page-pool", action="store_true",
                      help="concurrent rows of a mixed-length workload in the same K/V memory: per-slot caches "
                           "against a page pool (Generator kv_pages)")
    mode.add_argument("--vllm", action="store_true",
                      help="this engine and vLLM (installed beside it) on the same pair and held-out prompts, plain "
                           "and DFlash, alternating runs: token equality, both engines' tau, tokens/s")
    mode.add_argument("--serve", action="store_true",
                      help="the OpenAI-compatible server (python -m infer.serve, in a subprocess) under 1, batch and 32 "
                           "concurrent streams: throughput, TTFT, inter-token latency, tokens equal offline, against "
                           "the offline engine on the same prompts")
    p.add_argument("--vllm-fix-knorm", action="store_true",
                   help="with --vllm: where vLLM's CPU rms_norm norms every DFlash drafter layer's context keys "
                        "with layer 0's k_norm weight (the bench says so), norm each layer's with its own weight "
                        "(vLLM runs in this process; infer.bench.vllm_peer)")

    pair = p.add_argument_group("pair")
    pair.add_argument("--target", metavar="DIR", help="target directory, HF or converted (default: the bundled "
                                                      "demo pair)")
    pair.add_argument("--drafter", metavar="DIR", help="drafter directory, HF or converted")
    pair.add_argument("--random", action="store_true",
                      help="a random tiny Qwen3 target and random drafter built in memory (tau near 1)")
    pair.add_argument("--hidden", type=int, default=128, help="--random: hidden size")
    pair.add_argument("--layers", type=int, default=6, help="--random: target layers")
    pair.add_argument("--heads", type=int, default=4, help="--random: attention heads (KV heads: half)")
    pair.add_argument("--vocab", type=int, default=1024, help="--random: vocabulary size")
    pair.add_argument("--drafter-layers", type=int, default=2, help="--random: drafter layers")
    pair.add_argument("--random-block-size", type=int, default=8, help="--random: the drafter's block size")
    pair.add_argument("--dtype", choices=("float32", "bfloat16"),
                      help="default: the checkpoint's (--random, --cost, workloads: float32; --published-shapes: "
                           "bfloat16)")

    suite = p.add_argument_group("suite")
    suite.add_argument("--quick", action="store_true",
                       help="the drafter's block size only, no --draft-tokens rows, no time split, no transformers")
    suite.add_argument("--heldout-package", default="numpy", help="installed package whose source gives the prompts")
    suite.add_argument("--num-prompts", type=int, default=16)
    suite.add_argument("--prompt-lines", type=int, default=6, help="lines per snippet")
    suite.add_argument("--max-prompt-tokens", type=int, default=128, help="prompts are cut to this many tokens")
    suite.add_argument("--block-sizes", default=None, help="comma-separated DFlash block sizes (default 4,8,16)")
    suite.add_argument("--draft-tokens", default=None, metavar="K,...",
                       help="also run the drafter's own block size verifying only its first K drafts per cycle "
                            "(Generator draft_tokens), for each K (default 3,5,7); '' for none")
    suite.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    suite.add_argument("--max-new-tokens", type=int, default=None,
                       help="new tokens per row (default 128; --cache-scaling: 64)")
    suite.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    suite.add_argument("--repeats", type=int, default=None, help="timed runs of each configuration (median; "
                                                                 "default 3, workloads 2)")
    suite.add_argument("--seed", type=int, default=0)
    suite.add_argument("--sync-every", type=int, default=8, help="cycles per host sync (Generator)")
    suite.add_argument("--narrow-tail", action=argparse.BooleanOptionalAction, default=None,
                       help="run the batch's tail on narrower loops (Generator(narrow_tail); default: on a CPU)")
    suite.add_argument("--no-split", action="store_true", help="skip the time split of a cycle")
    suite.add_argument("--split-rounds", type=int, default=7, help="time split: rounds per piece (median)")
    suite.add_argument("--split-min-time", type=float, default=0.05, help="time split: seconds per round at least")
    suite.add_argument("--no-transformers", action="store_true", help="skip the Hugging Face transformers comparison")
    suite.add_argument("--hf-batch-sizes", default=None, help="transformers batch sizes (default: --batch-sizes)")
    suite.add_argument("--torch-threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")

    shapes = p.add_argument_group("--cost, --moe-cost and --published-shapes")
    shapes.add_argument("--shape", choices=SHAPES, default="qwen3-8b",
                        help="--cost and --published-shapes: the published target (with a 5-layer block-16 drafter)")
    shapes.add_argument("--scale", type=float, default=None,
                        help="shrink layers and widths (head_dim kept); default --cost 0.25, --published-shapes 1")
    shapes.add_argument("--context", type=int, default=1024, help="positions of context in use per row")
    shapes.add_argument("--cache-len", type=int, default=None,
                        help="--cost: cache positions allocated (default context + 2 x block, rounded up to pages)")
    shapes.add_argument("--compare-cache-len", type=int, default=8192,
                        help="--cost: the same figures at this allocated cache too (0: skip)")
    shapes.add_argument("--batch-size", type=int, default=None,
                        help="--cost (default 8), --moe-cost (default: 1 and 8), --published-shapes (default 1), "
                             "workloads and --vllm (default 8)")
    shapes.add_argument("--page-size", type=int, default=128, help="cache positions per page")
    shapes.add_argument("--no-pieces", action="store_true", help="--cost: skip the pieces compiled alone")
    shapes.add_argument("--paper-tau", type=float, default=PAPER_TAU, help="tau to project the speedup with")

    aot = p.add_argument_group("--aot")
    aot.add_argument("--mesh", default=None, metavar="data=D,model=M",
                     help="how the topology's chips are split (default: every chip on model)")
    aot.add_argument("--programs", default="prefill,ar,dflash", help="which programs to compile, comma-separated")
    aot.add_argument("--hlo", default=None, metavar="DIR", help="write each program's scheduled TPU HLO here")
    aot.add_argument("--attention", choices=("kernel", "walk"), default="kernel",
                     help="the TPU attention: the Pallas kernel (the engine's on a TPU) or the portable walk")
    aot.add_argument("--kv-pages", type=int, default=None, metavar="N",
                     help="the caches as a page pool of N pages of --page-size shared by the rows (default: per-slot "
                          "caches)")

    work = p.add_argument_group("workloads")
    work.add_argument("--cache-prompt-lens", default="128,8192",
                      help="--cache-scaling: the small and large Generator max_prompt_len")
    work.add_argument("--mixed-prompts", type=int, default=48, help="--mixed-workload: prompts")
    work.add_argument("--mixed-range", default="8,256",
                      help="--mixed-workload, --page-pool: per-row max_new_tokens lo,hi")
    work.add_argument("--pool-slots", type=int, default=None,
                      help="--page-pool: the pool's batch slots (default 4 x --batch-size)")

    serve = p.add_argument_group("--serve")
    serve.add_argument("--serve-concurrency", default=None, metavar="C,...",
                       help="concurrent streams (default: 1, the batch size and 32); prompts: at least the largest")
    serve.add_argument("--serve-sync-every", type=int, default=2, help="the server's --sync-every")
    serve.add_argument("--serve-prefill-chunk", type=int, default=512, metavar="N",
                       help="the server's --prefill-chunk: longer prompts go in pieces of N between cycles")
    serve.add_argument("--serve-long-prompt", type=int, default=0, metavar="N",
                       help="also: the batch's other streams' inter-token latency while prompts of N tokens arrive "
                            "(0: skip)")

    p.add_argument("--json", default=None, metavar="PATH",
                   help=f"figures as JSON (default: {BENCH_DIR}/MODE.json, e.g. suite.json, cost-qwen3-8b-x0.25.json)")
    p.add_argument("--plot", default=None, metavar="PATH", help="suite: PNG plot (default: bench.png next to the JSON)")
    return p


def env_info() -> dict:
    import jax

    info = dict(jax_version=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                device_kind=jax.devices()[0].device_kind, python=platform.python_version(), cpus=os.cpu_count(),
                argv=["python -m infer.bench", *sys.argv[1:]])  # no path of this machine
    print(f"jax {info['jax_version']}, backend {info['backend']}, devices {jax.devices()}, "
          f"{info['cpus']} CPUs, python {info['python']}")
    return info


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m for m in ("aot", "cost", "moe_cost", "published_shapes", "cache_scaling", "mixed_workload",
                         "page_pool", "vllm", "serve") if getattr(args, m)]
    if len(modes) > 1:
        raise SystemExit("error: " + ", ".join("--" + m.replace("_", "-") for m in modes) + " are separate modes; "
                         "pick one")
    if args.vllm_fix_knorm and not args.vllm:
        raise SystemExit("error: --vllm-fix-knorm goes with --vllm")
    workload = bool({"cache_scaling", "mixed_workload", "page_pool"} & set(modes))
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if args.cache_scaling else 128
    if args.repeats is None:
        args.repeats = 2 if workload else 3
    for flag in ("num_prompts", "max_new_tokens", "repeats", "prompt_lines", "max_prompt_tokens", "split_rounds",
                 "page_size", "mixed_prompts"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 1")
    for flag in ("batch_size", "pool_slots", "kv_pages"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 1")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*[Dd]onat.*")  # backends that cannot donate still work
        return run(args, modes[0] if modes else "suite")


def run(args, mode: str) -> int:
    if args.scale is None:
        args.scale = 0.25 if mode == "cost" else 1.0
    if mode == "aot":
        # Compiling for a TPU needs no TPU: run jax on the CPU, so that an installed libtpu
        # does not look for a chip (set before jax is first imported).
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if args.json is None:
        args.json = str(default_json(args, mode))
    result = dict(env=env_info(), mode=mode)
    if mode == "suite":
        from infer.bench.suite import run_suite

        rc = run_suite(args, result)
        if rc == 0:
            write_outputs(result, args.json, args.plot, plot=True)
        return rc
    if mode == "aot":
        from infer.bench.aot import run_aot

        result["aot"] = run_aot(args)
    elif mode == "cost":
        from infer.bench.cost import run_cost

        result["cost"] = run_cost(args)
    elif mode == "moe_cost":
        from infer.bench.moe_cost import run_moe_cost

        result["moe_cost"] = run_moe_cost(args)
    elif mode == "published_shapes":
        from infer.bench.published import run_published_shapes

        result["published_shapes"] = run_published_shapes(args)
    elif mode == "cache_scaling":
        from infer.bench.workloads import run_cache_scaling

        result["cache_scaling"] = run_cache_scaling(args)
    elif mode == "mixed_workload":
        from infer.bench.workloads import run_mixed_workload

        result["mixed_workload"] = run_mixed_workload(args)
    elif mode == "serve":
        from infer.bench.serve_bench import run_serve_bench

        result["serve"] = run_serve_bench(args)
    elif mode == "vllm":
        from infer.bench.vllm_peer import run_vllm_peer

        result["vllm"] = run_vllm_peer(args)
    else:
        from infer.bench.workloads import run_page_pool

        result["page_pool"] = run_page_pool(args)
    write_outputs(result, args.json)
    return 0
