"""`python -m infer`: batch generation with a target and a DFlash drafter.

A thin edge over `dflash_jax.generation`: parse the flags (`infer.flags`), join a multi-host run
if asked, run the `GenerationJob` they describe, show its summary (`infer.job_output`), turn
library errors into a one-line message and exit status 2; a run some of whose rows could not
run exits 4, one whose output could not be written (a full disk) 5 (`EXIT_*` below).
"""

from __future__ import annotations

import argparse
import sys

from dflash_jax.engine.watchdog import STALL_EXIT_CODE
from dflash_jax.errors import DFlashError
from dflash_jax.pair import DEMO_DIR
from infer.flags import HelpFormatter, add_distributed_flags, add_generation_flags, job_from_args

__all__ = ["DEMO_DIR", "EXIT_BAD_INPUT", "EXIT_ROW_ERRORS", "EXIT_STALLED", "EXIT_WRITE_FAILED", "build_parser",
           "main", "run"]

# Exit statuses (also in --help and docs/inference.md).
EXIT_BAD_INPUT = 2  # bad flags or input, found before anything loads; nothing was generated
EXIT_STALLED = STALL_EXIT_CODE  # 3: the device made no progress for --stall-timeout minutes (the watchdog
#                                ends the process); finished rows are in --output
EXIT_ROW_ERRORS = 4  # the run finished, but some rows could not run (their lines hold "error")
EXIT_WRITE_FAILED = 5  # --output (or --summary-json) could not be written (a full disk); the rows written are
#                        kept, and a rerun resumes after them


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m infer",
        description="Batch generation with DFlash speculative decoding. With no --target/--drafter, "
        "runs the bundled demo pair (a small code model trained on the Python standard library and "
        "its DFlash drafter) on its built-in prompts, with --compare-baseline. "
        "--input is JSON lines, each an object with exactly one of: prompt (text), input_ids (token ids), "
        "messages (a chat: [{\"role\", \"content\"}, ...], through the chat template) or turns (the user's "
        "turns of a multi-turn chat, each answered in turn); and optionally id (a string or integer; "
        "default: the line number), max_new_tokens, temperature, top_p and top_k (the row's own, over the "
        "flags'), logit_bias ({\"token id\": bias}), and a constraint as the server takes it (structured "
        "output): response_format, "
        "structured_outputs, guided_json, guided_regex and guided_choice (one per row). Other keys are ignored, "
        "each named once in a warning.",
        epilog="A rerun with the same --output resumes: rows already there are skipped, if they were made from "
        "the same input lines with the same models and settings (each line records them in its \"fingerprint\"); "
        "anything else in the output is an error naming the line (--overwrite starts over). Rows that cannot run "
        "(a prompt longer than the context) are found before anything compiles and written as {\"id\", \"error\"} "
        "lines. Input rows may set their own max_new_tokens, temperature, top_p and top_k; a key one or two edits "
        "from one of these is an error (\"did you mean\"). Compiled programs are kept in a persistent cache "
        "(~/.cache/dflash-jax/jax; DFLASH_COMPILE_CACHE=off or =DIR), so a rerun starts in seconds. "
        "A second run on an --output another run is writing is refused (the output is locked for the run). "
        "Exit status: 0 done; 2 bad flags or input (nothing ran); 3 the device stalled (--stall-timeout); "
        "4 done, but some rows could not run; 5 the output could not be written (a full disk: the rows "
        "written are kept, and a rerun resumes).",
        formatter_class=HelpFormatter,
    )
    add_generation_flags(p)
    add_distributed_flags(p)
    return p


def run(args: argparse.Namespace, make_record=None) -> int:
    """The job the parsed flags describe (`add_generation_flags` and `add_distributed_flags`), its
    rows shaped by make_record (`dflash_jax.generation.run_job`): the exit status."""
    from dflash_jax.compiling import enable_compile_cache
    from dflash_jax.generation import OutputWriteError, run_job
    from dflash_jax.sharding import init_distributed
    from infer.job_output import Writer, report

    try:
        job = job_from_args(args)
        init_distributed(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
        enable_compile_cache(lambda *a: print(*a, file=sys.stderr))
        result = run_job(job, make_record=make_record, writer=Writer)
        report(result, args.summary_json, quiet=args.quiet)
    except OutputWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    errors = (result.summary or {}).get("errors", 0)
    if errors:
        where = f" (their lines in {args.output} hold \"error\")" if args.output else ""
        print(f"error: {errors} of {result.summary['rows']} rows could not run{where}", file=sys.stderr)
        return EXIT_ROW_ERRORS
    return 0


def main(argv=None) -> int:
    return run(build_parser().parse_args(argv))
