"""The command line of `python -m bench` (see the package docstring)."""

from __future__ import annotations

import argparse
import os
import platform
import sys
import textwrap
import warnings
from pathlib import Path

from dflash_jax.engine.options import SERVER_SYNC_EVERY, EngineOptions
from dflash_jax.errors import InputError
from dflash_jax.shapes import SHAPES
from bench.published import PAPER_TAU
from bench.report import write_outputs
from infer.flags import add_engine_flags

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
    if mode == "serve" and args.serve_speculation:
        name = "serve-speculation"
    if mode in ("cost", "published_shapes"):
        name += f"-{args.shape}-x{args.scale:g}"
    if mode == "aot":
        name += f"-{args.aot.replace(':', '-')}-{args.shape}" + (f"-x{args.scale:g}" if args.scale != 1 else "")
        if args.batch_sweep:
            name += f"-sweep-c{args.context}"
    return BENCH_DIR / f"{name}.json"


USAGE = "%(prog)s [MODE FLAG] [options]   (no mode flag: the suite)"

DESCRIPTION = """\
DFlash speculative decoding benchmarks: figures printed and written as JSON,
no timing asserted; one device, stop tokens ignored (max_new_tokens per row)."""

EPILOG = """\
examples (more, what each figure means, results: docs/benchmarks.md):
  python -m bench                    # the suite, bundled demo pair
  python -m bench --random --quick   # a quick table on a random pair
  python -m bench --cost --scale 1   # what a cycle costs, nothing run"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """A flag and its help on one line where they fit (help from column 27), a group's one-line
    description right above its flags, and no line broken at a flag's hyphen."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=27)

    def add_text(self, text):
        if text is None or text is argparse.SUPPRESS or self._current_section is self._root_section:
            return super().add_text(text)
        self._add_item(lambda t: self._format_text(t)[:-1], [text])  # a group's: no blank line after it

    def _split_lines(self, text, width):
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m bench", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                       formatter_class=HelpFormatter, add_help=False)

    add_general_flags(p.add_argument_group("general options"))
    add_suite_flags(p)
    add_mode_flags(p)
    return p


def add_general_flags(gen):
    """The flags every mode reads (the pair, the prompts, the engine's settings, where figures go)."""
    gen.add_argument("-h", "--help", action="help", help="show this help and exit")
    gen.add_argument("--target", metavar="DIR", help="HF or converted (default: the bundled demo pair)")
    gen.add_argument("--drafter", metavar="DIR", help="HF or converted, with --target")
    add_engine_flags(gen, ("dtype",), helps={"dtype": "the checkpoint's; f32: --random/--cost/workloads, "
                                                      "bf16: published"})
    gen.add_argument("--heldout-package", default="numpy", metavar="PKG",
                     help="installed package giving prompts (default numpy)")
    gen.add_argument("--num-prompts", type=int, default=16, metavar="N", help="held-out prompts (default 16)")
    gen.add_argument("--prompt-lines", type=int, default=6, metavar="N", help="lines per snippet (default 6)")
    gen.add_argument("--max-prompt-tokens", type=int, default=128, metavar="N",
                     help="prompts cut to this many tokens (default 128)")
    # Unset, each mode's own (`check_args`, the modes).
    add_engine_flags(gen, ("batch_size", "max_new_tokens"), overrides={"batch_size": None, "max_new_tokens": None},
                     helps={"batch_size": "rows, 8 (--moe-cost 1 and 8, --published-shapes 1)",
                            "max_new_tokens": "per row (default 128; --cache-scaling: 64)"})
    gen.add_argument("--repeats", type=int, default=None, metavar="N",
                     help="timed runs of each, median (default 3; workloads 2)")
    gen.add_argument("--seed", type=int, default=0, metavar="N",
                     help="prompts, random weights, sampling (default 0)")
    # python -m infer's engine defaults (sync every 8 cycles: throughput).
    add_engine_flags(gen, ("sync_every",), helps={"sync_every": "cycles per host sync (BatchEngine; default %(default)s)"})
    # Not python -m infer's --narrow-tail (off unless given): unset, the platform's default
    # (`bench.timing.narrow_tail_default`).
    add_engine_flags(gen, ("narrow_tail", "page_size"), overrides={"narrow_tail": None},
                     helps={"narrow_tail": "the batch's tail on narrower loops (default: CPU)",
                            "page_size": "cache positions per page (default %(default)s)"})
    gen.add_argument("--json", default=None, metavar="PATH",
                     help=f"figures (default: {BENCH_DIR}/<mode, settings>.json)")
    gen.add_argument("--plot", default=None, metavar="PATH",
                     help="the suite's PNG (default: bench.png beside --json)")


def add_suite_flags(p):
    """The random pair's and the suite's (the default mode's) groups."""
    rnd = p.add_argument_group("random pair", "a tiny random Qwen3 target and drafter built in memory (tau near 1)")
    rnd.add_argument("--random", action="store_true", help="use it, not --target/--drafter")
    rnd.add_argument("--hidden", type=int, default=128, metavar="N", help="hidden size (default 128)")
    rnd.add_argument("--layers", type=int, default=6, metavar="N", help="target layers (default 6)")
    rnd.add_argument("--heads", type=int, default=4, metavar="N",
                     help="attention heads, KV heads half (default 4)")
    rnd.add_argument("--vocab", type=int, default=1024, metavar="N", help="vocabulary size (default 1024)")
    rnd.add_argument("--drafter-layers", type=int, default=2, metavar="N", help="drafter layers (default 2)")
    rnd.add_argument("--random-block-size", type=int, default=8, metavar="B",
                     help="the drafter's block size (default 8)")

    suite = p.add_argument_group("the suite (default mode)",
                                 "tau, acceptance, tokens/s: DFlash, no drafter, transformers; time split")
    suite.add_argument("--quick", action="store_true",
                       help="the drafter's block only: no K, split, transformers")
    suite.add_argument("--block-sizes", default=None, metavar="B,...", help="DFlash block sizes (default 4,8,16)")
    suite.add_argument("--draft-tokens", default=None, metavar="K,...",
                       help="also verify only the first K drafts per cycle, each K (default 3,5,7; '': none; "
                            "--vllm: one K)")
    suite.add_argument("--tree-budgets", default=None, metavar="N,...",
                       help="also verify a draft tree of N nodes per cycle, each N (default none; --aot: "
                            "compiled)")
    suite.add_argument("--batch-sizes", default="1,8", metavar="N,...", help="batch sizes (default 1,8)")
    suite.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0: greedy (default 0)")
    add_engine_flags(suite, ("acceptance",), helps={"acceptance": "DFlash2, sampled: rejection (default) or match"})
    suite.add_argument("--no-split", action="store_true", help="skip the time split of a cycle")
    suite.add_argument("--split-rounds", type=int, default=7, metavar="N",
                       help="time split: rounds per piece, median (default 7)")
    suite.add_argument("--split-min-time", type=float, default=0.05, metavar="S",
                       help="time split: least seconds a round (default 0.05)")
    suite.add_argument("--no-transformers", action="store_true",
                       help="skip the Hugging Face transformers comparison")
    suite.add_argument("--hf-batch-sizes", default=None, metavar="N,...",
                       help="transformers' (default: --batch-sizes)")
    suite.add_argument("--torch-threads", type=int, default=None, metavar="N",
                       help="torch.set_num_threads (default: torch's)")


def add_mode_flags(p):
    """One group per mode besides the suite (its flag, then the flags only it reads)."""
    shapes = p.add_argument_group("published shapes", "for --cost, --aot, --published-shapes (--moe-cost: "
                                                      "--context, --paper-tau)")
    shapes.add_argument("--shape", choices=SHAPES, default="qwen3-8b", metavar="NAME",
                        help="target (a 5-layer block-16 drafter; default the first): " + ", ".join(SHAPES)
                             + " (qwen3.8-27b: qwen3.5-27b with Qwen3.8-27B-DFlash2's, block 8)")
    shapes.add_argument("--scale", type=float, default=None, metavar="X",
                        help="shrink all but head_dim (--cost: 0.25, else 1)")
    shapes.add_argument("--context", type=int, default=1024, metavar="N",
                        help="positions in use per row (default 1024)")
    shapes.add_argument("--cache-len", type=int, default=None, metavar="N",
                        help="allocated (default: context + 2 x block, in pages)")
    shapes.add_argument("--compare-cache-len", type=int, default=8192, metavar="N",
                        help="figures at this cache too (default 8192; 0: skip)")
    shapes.add_argument("--paper-tau", type=float, default=PAPER_TAU, metavar="TAU",
                        help=f"tau to project the speedup with (default {PAPER_TAU})")

    cost = p.add_argument_group("--cost", "XLA's flops and bytes of an AR step and a DFlash cycle; nothing run")
    cost.add_argument("--cost", action="store_true", help="abstract weights; rooflines, projected speedup")
    cost.add_argument("--no-pieces", action="store_true", help="skip the pieces compiled alone")

    aot = p.add_argument_group("--aot", "TPU compiler's time, bytes, HBM/chip, collectives; compiled on this machine")
    aot.add_argument("--aot", metavar="TOPOLOGY",
                     help="v5e:1x1, v5p:2x2x1, ...; needs libtpu ('.[tpu]')")
    add_engine_flags(aot, ("mesh",), helps={"mesh": "the chips' split (default: all on model)"})
    aot.add_argument("--programs", default="prefill,ar,dflash", metavar="P,...",
                     help="default prefill,ar,dflash (DFlash2 shape: dflash is both cycles); also "
                          "constrained")
    aot.add_argument("--hlo", default=None, metavar="DIR", help="write each program's scheduled TPU HLO here")
    aot.add_argument("--attention", choices=("kernel", "walk"), default="kernel", metavar="KIND",
                     help="kernel (Pallas, the TPU engine's; default) or walk")
    aot.add_argument("--tree-tau", default=None, metavar="N=TAU,...",
                     help="tau of each --tree-budgets N, for its speedup (default: print the tau that "
                          "matches the chain's)")
    aot.add_argument("--batch-sweep", default=None, metavar="N,...",
                     help="one chip: AR, the K = 0 cycle and each --draft-sweep K at each batch; the break-even "
                          "tau, tokens/s at --paper-tau and auto speculation's choice")
    aot.add_argument("--draft-sweep", default=None, metavar="K,...",
                     help="draft lengths of --batch-sweep (default auto speculation's: 3,7,B-1)")
    add_engine_flags(aot, ("kv_pages",), helps={"kv_pages": "caches in a pool of N pages (default: per slot)"})

    moe = p.add_argument_group("--moe-cost", "a DFlash cycle vs a decoding step: gpt-oss-20b, Qwen3-30B-A3B")
    moe.add_argument("--moe-cost", action="store_true", help="experts a verify touches, bytes, speedup")

    pub = p.add_argument_group("--published-shapes", "the engine's pieces timed at --shape, random weights")
    pub.add_argument("--published-shapes", action="store_true",
                     help="AR step, verify, draft, cycle; takes --split-*")

    cache = p.add_argument_group("--cache-scaling", "tokens/s with a small and a large BatchEngine max_prompt_len")
    cache.add_argument("--cache-scaling", action="store_true", help="what an allocated cache costs")
    cache.add_argument("--cache-prompt-lens", default="128,8192", metavar="S,L",
                       help="the two max_prompt_len (default 128,8192)")

    mixed = p.add_argument_group("--mixed-workload", "tokens/s with per-row max_new_tokens spread out, against "
                                                     "all at the mean")
    mixed.add_argument("--mixed-workload", action="store_true", help="held-out prompts, seeded lengths")
    mixed.add_argument("--mixed-prompts", type=int, default=48, metavar="N", help="prompts (default 48)")
    mixed.add_argument("--mixed-range", default="8,256", metavar="LO,HI",
                       help="per-row max_new_tokens (default 8,256)")

    pool = p.add_argument_group("--page-pool", "concurrent rows in the same K/V memory: per-slot caches vs a page pool")
    pool.add_argument("--page-pool", action="store_true", help="kv_pages; takes --mixed-prompts, --mixed-range")
    pool.add_argument("--pool-slots", type=int, default=None, metavar="N",
                      help="the pool's batch slots (default 4 x --batch-size)")

    vllm = p.add_argument_group("--vllm", "this engine and vLLM (installed beside it): tokens equal, tau, tokens/s")
    vllm.add_argument("--vllm", action="store_true",
                      help="same pair and prompts, plain/DFlash alternating")
    vllm.add_argument("--vllm-fix-knorm", action="store_true",
                      help="each layer's own k_norm (vLLM CPU uses layer 0's)")

    window = p.add_argument_group("--draft-window", "tau, tokens/s, context-cache bytes on long prompts, "
                                                    "each window and none")
    window.add_argument("--draft-window", metavar="N,...", help="draft windows (e.g. 256,1024)")
    window.add_argument("--long-prompts", default="2048,3000", metavar="LO,HI",
                        help="tokens, held-out prompts joined (default 2048,3000)")

    serve = p.add_argument_group("--serve", "python -m infer.serve (a subprocess) against the offline engine, same tokens")
    serve.add_argument("--serve", action="store_true", help="throughput, TTFT, inter-token latency (ITL)")
    serve.add_argument("--serve-speculation", action="store_true", help="tokens/s: plain, fixed, auto servers")
    serve.add_argument("--serve-concurrency", default=None, metavar="C,...",
                       help="streams (default 1, batch, 32); prompts >= largest")
    serve.add_argument("--serve-sync-every", type=int, default=SERVER_SYNC_EVERY, metavar="N",
                       help="the server's --sync-every (default %(default)s)")
    serve.add_argument("--serve-prefill-chunk", type=int, default=512, metavar="N",
                       help="the server's --prefill-chunk (default 512)")
    serve.add_argument("--serve-long-prompt", type=int, default=0, metavar="N",
                       help="others' ITL while N-token prompts arrive (0: skip)")
    serve.add_argument("--prefix-cache-ttft", action="store_true",
                       help="mode: TTFT on a cached 1024-token prefix")


def env_info() -> dict:
    import jax

    info = dict(jax_version=jax.__version__, backend=jax.default_backend(), devices=[str(d) for d in jax.devices()],
                device_kind=jax.devices()[0].device_kind, python=platform.python_version(), cpus=os.cpu_count(),
                argv=["python -m bench", *sys.argv[1:]])  # no path of this machine
    print(f"jax {info['jax_version']}, backend {info['backend']}, devices {jax.devices()}, "
          f"{info['cpus']} CPUs, python {info['python']}")
    return info


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    modes = [m for m in ("aot", "cost", "moe_cost", "published_shapes", "cache_scaling", "mixed_workload",
                         "page_pool", "vllm", "serve", "prefix_cache_ttft", "draft_window") if getattr(args, m)]
    if len(modes) > 1:
        raise SystemExit("error: " + ", ".join("--" + m.replace("_", "-") for m in modes) + " are separate modes; "
                         "pick one")
    if args.vllm_fix_knorm and not args.vllm:
        raise SystemExit("error: --vllm-fix-knorm goes with --vllm")
    workload = bool({"cache_scaling", "mixed_workload", "page_pool"} & set(modes))
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if args.cache_scaling else 128
    if args.repeats is None:
        args.repeats = 1 if args.draft_window else 2 if workload else 3
    for flag in ("num_prompts", "repeats", "prompt_lines", "max_prompt_tokens", "split_rounds", "mixed_prompts"):
        if getattr(args, flag) < 1:
            raise SystemExit(f"error: --{flag.replace('_', '-')} must be >= 1")
    if args.pool_slots is not None and args.pool_slots < 1:
        raise SystemExit("error: --pool-slots must be >= 1")
    try:  # the engine flags, checked as every command checks them
        # (its --draft-tokens is a list, checked by the suite; --batch-size unset is each mode's own)
        EngineOptions(**{name: getattr(args, name) for name in ("batch_size", "max_new_tokens", "kv_pages",
                                                                 "page_size", "sync_every", "dtype", "mesh")
                         if getattr(args, name) is not None})
    except InputError as e:
        raise SystemExit(f"error: {e}") from None
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
        from bench.suite import run_suite

        rc = run_suite(args, result)
        if rc == 0:
            write_outputs(result, args.json, args.plot, plot=True)
        return rc
    if mode == "aot":
        from bench.aot import run_aot

        result["aot"] = run_aot(args)
    elif mode == "cost":
        from bench.cost import run_cost

        result["cost"] = run_cost(args)
    elif mode == "moe_cost":
        from bench.moe_cost import run_moe_cost

        result["moe_cost"] = run_moe_cost(args)
    elif mode == "published_shapes":
        from bench.published import run_published_shapes

        result["published_shapes"] = run_published_shapes(args)
    elif mode == "cache_scaling":
        from bench.workloads import run_cache_scaling

        result["cache_scaling"] = run_cache_scaling(args)
    elif mode == "mixed_workload":
        from bench.workloads import run_mixed_workload

        result["mixed_workload"] = run_mixed_workload(args)
    elif mode == "serve":
        from bench.serve_bench import run_serve_bench, run_speculation_bench

        if args.serve_speculation:
            result["serve_speculation"] = run_speculation_bench(args)
        else:
            result["serve"] = run_serve_bench(args)
    elif mode == "prefix_cache_ttft":
        from bench.prefix_bench import run_prefix_ttft

        result["prefix_cache_ttft"] = run_prefix_ttft(args)
    elif mode == "draft_window":
        from bench.draft_window import run_draft_window

        result["draft_window"] = run_draft_window(args)
    elif mode == "vllm":
        from bench.vllm_peer import run_vllm_peer

        result["vllm"] = run_vllm_peer(args)
    else:
        from bench.workloads import run_page_pool

        result["page_pool"] = run_page_pool(args)
    write_outputs(result, args.json)
    return 0
