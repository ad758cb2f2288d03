"""The flags of `python -m infer` and `python -m train.generate_data`, and the job they describe.

`add_generation_flags` declares one flag per `GenerationJob` field (its defaults are the job's),
plus --summary-json; `job_from_args` makes the job from the parsed flags.
"""

from __future__ import annotations

import argparse
from dataclasses import fields

from dflash_jax.generation import DTYPES, GenerationJob

JOB = GenerationJob  # its class attributes are the fields' defaults


class HelpFormatter(argparse.HelpFormatter):
    """Every flag's help ends with its default, where it has one worth showing."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.default is not None and action.default is not False and action.default != argparse.SUPPRESS
        if shown and "default" not in text:
            text += " (default: %(default)s)"
        return text


def add_generation_flags(p: argparse.ArgumentParser):
    """The flags of `python -m infer` (and `train.generate_data`)."""
    p.add_argument("--target", "--model", dest="target", metavar="DIR",
                   help="target model: Hugging Face directory or one written by dflash_jax.convert")
    p.add_argument("--drafter", "--draft-model", dest="drafter", metavar="DIR",
                   help="DFlash drafter (z-lab HF format or converted); without it, plain decoding")
    p.add_argument("--input", metavar="FILE.jsonl", help="prompts, one JSON object per line")
    p.add_argument("--output", metavar="FILE.jsonl",
                   help="results, appended as rows finish; a rerun skips the rows already there, made from the same "
                        "input lines and settings, and refuses an output holding anything else (default: stdout)")
    p.add_argument("--overwrite", action="store_true",
                   help="start --output over (its lines are deleted) instead of resuming it")
    p.add_argument("--max-new-tokens", type=int, default=JOB.max_new_tokens,
                   help="tokens to generate per row, and the most a row's own max_new_tokens may ask for "
                        "(default 256; 128 for the demo pair)")
    p.add_argument("--temperature", type=float, default=JOB.temperature, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=JOB.top_p, help="nucleus sampling: keep the smallest set of tokens "
                                                                "whose probability reaches P (1 = off)")
    p.add_argument("--top-k", type=int, default=JOB.top_k, help="keep only the K most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=JOB.seed, help="seed of the sampling keys (per row and position)")
    p.add_argument("--block-size", type=int, default=JOB.block_size,
                   help="default: the drafter's; 1 = plain autoregressive decoding (the baseline)")
    p.add_argument("--draft-tokens", type=int, default=JOB.draft_tokens, metavar="K",
                   help="drafts the target verifies per cycle, 1..B-1 (default B-1, the whole block): the "
                        "drafter still denoises the whole block, the verify runs K+1 tokens; smaller K pays "
                        "where verify tokens cost compute (CPUs, large batches)")
    p.add_argument("--batch-size", type=int, default=JOB.batch_size,
                   help="rows decoded together (slots refilled as rows finish)")
    p.add_argument("--dtype", choices=DTYPES, default=JOB.dtype,
                   help="parameter dtype (default: the checkpoint's)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the stop tokens")
    p.add_argument("--compare-baseline", action="store_true",
                   help="also time plain decoding of the same prompts and report the speedup")
    p.add_argument("--enable-thinking", action="store_true",
                   help="pass enable_thinking=True to the chat template (Qwen3); off by default")
    p.add_argument("--max-prompt-len", type=int, default=JOB.max_prompt_len,
                   help="longest prompt in tokens, which sizes the KV cache (default: the longest in the input, "
                        "rounded up); attention reads only what rows use, so a larger cache costs memory, not time")
    p.add_argument("--kv-pages", type=int, default=JOB.kv_pages, metavar="N",
                   help="keep K/V in a pool of N pages (of --page-size positions) shared by the rows: each row "
                        "holds the pages of its own prompt and max_new_tokens and returns them when it finishes, "
                        "so the cache is sized by N, not batch x the longest row, and many short rows share what "
                        "one long row would reserve; prompts wait for pages (default: per-row caches)")
    p.add_argument("--page-size", type=int, default=JOB.page_size, help="K/V positions per page (default 128)")
    p.add_argument("--sync-every", type=int, default=JOB.sync_every, help="decoding cycles per host sync")
    p.add_argument("--narrow-tail", action="store_true",
                   help="once no prompt waits, move the running rows to narrower loops as they finish "
                        "(6, 4, 3, 2, 1 slots for a batch of 8). Pays where a cycle costs per row (a CPU, "
                        "large batches) and the tail is long against the compiles it adds (one loop per "
                        "width): a run has one tail")
    p.add_argument("--mesh", default=JOB.mesh, metavar="data=D,model=M",
                   help="device mesh: batch rows over `data`, heads/MLP/vocab over `model` "
                        "(default: every device on `data`; one device: no mesh)")
    p.add_argument("--stall-timeout", type=float, default=JOB.stall_timeout, metavar="MINUTES",
                   help="end the run with an error (exit status 3) when the device makes no progress for this "
                        "long (compiles excluded); rows finished are kept; 0 = wait forever")
    p.add_argument("--summary-json", metavar="FILE", help="also write the summary as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar or progress messages (the summary stays)")


def add_distributed_flags(p: argparse.ArgumentParser):
    g = p.add_argument_group("multi-host (or set JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID)")
    g.add_argument("--coordinator", metavar="HOST:PORT", help="address of process 0's coordinator")
    g.add_argument("--num-processes", type=int, help="number of processes")
    g.add_argument("--process-id", type=int, help="this process's index")
    g.add_argument("--distributed", action="store_true",
                   help="join a multi-host run using the cluster's auto-detection (TPU pods, SLURM)")


def job_from_args(args: argparse.Namespace) -> GenerationJob:
    """The job the flags of `add_generation_flags` describe (checked: a bad flag is an InputError)."""
    return GenerationJob(**{f.name: getattr(args, f.name) for f in fields(GenerationJob)})
