"""`python -m infer`: batch generation with a target and a DFlash drafter.

A thin edge over `dflash_jax.generation`: parse the flags, join a multi-host run if asked,
run the job, turn library errors into a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from dflash_jax.errors import DFlashError
from dflash_jax.generation import DEMO_DIR, HelpFormatter, add_distributed_flags, add_generation_flags, run_generation

__all__ = ["DEMO_DIR", "build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infer",
        description="Batch generation with DFlash speculative decoding. With no --target/--drafter, "
        "runs the bundled demo pair (a small code model trained on the Python standard library and "
        "its DFlash drafter) on its built-in prompts, with --compare-baseline.",
        formatter_class=HelpFormatter,
    )
    add_generation_flags(p)
    add_distributed_flags(p)
    return p


def main(argv=None) -> int:
    from dflash_jax.sharding import init_distributed

    args = build_parser().parse_args(argv)
    try:
        init_distributed(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
        return run_generation(args)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
