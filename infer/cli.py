"""`python -m infer`: batch generation with a target and a DFlash drafter.

A thin edge over `dflash_jax.generation`: parse the flags (`infer.flags`), join a multi-host run
if asked, run the `GenerationJob` they describe, show its summary (`infer.job_output`), turn
library errors into a one-line message and exit code 2.
"""

from __future__ import annotations

import argparse
import sys

from dflash_jax.errors import DFlashError
from dflash_jax.generation import DEMO_DIR
from infer.flags import HelpFormatter, add_distributed_flags, add_generation_flags, job_from_args

__all__ = ["DEMO_DIR", "build_parser", "main", "run"]


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


def run(args: argparse.Namespace, make_record=None) -> int:
    """The job the parsed flags describe (`add_generation_flags` and `add_distributed_flags`), its
    rows shaped by make_record (`dflash_jax.generation.run_job`): the exit status."""
    from dflash_jax.generation import run_job
    from dflash_jax.sharding import init_distributed
    from infer.job_output import Writer, report

    try:
        job = job_from_args(args)
        init_distributed(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
        report(run_job(job, make_record=make_record, writer=Writer), args.summary_json, quiet=args.quiet)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
