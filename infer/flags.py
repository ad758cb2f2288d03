"""The flags of `python -m infer` and `python -m train.generate_data`, and the job they describe;
the engine's flags, shared with `python -m infer.serve` and `python -m bench`.

`add_engine_flags` declares one flag per `EngineOptions` field a command offers, with the
options' defaults (a command whose default differs says so in one `overrides` entry, with its
reason); `EngineOptions.of(args)` makes the options from the parsed flags.
`add_generation_flags` declares one flag per `GenerationJob` field and the engine flags of
`BATCH_ENGINE_FLAGS` (the job's `options`), plus --summary-json; `job_from_args` makes the job
from the parsed flags (`GenerationJob.of`).
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from typing import Any

from dflash_jax.config import DTYPES
from dflash_jax.engine.options import EngineOptions
from dflash_jax.errors import flag
from dflash_jax.engine.sampling import ACCEPTANCE_RULES
from dflash_jax.engine.speculation import SPECULATION_MODES
from dflash_jax.generation import GenerationJob

JOB = GenerationJob  # its class attributes are the fields' defaults

# One flag per EngineOptions field: argparse's arguments, less the default (the field's).
ENGINE_FLAGS: dict[str, dict[str, Any]] = {
    "max_new_tokens": dict(type=int, metavar="N",
                           help="tokens to generate per row, and the most a row's own max_new_tokens may ask for "
                                "(default 256; 128 for the demo pair)"),
    "block_size": dict(type=int, metavar="B",
                       help="default: the drafter's; 1 = plain autoregressive decoding (the baseline)"),
    "draft_tokens": dict(type=int, metavar="K",
                         help="drafts the target verifies per cycle, 1..B-1 (default B-1, the whole block): the "
                              "drafter still denoises the whole block, the verify runs K+1 tokens; smaller K pays "
                              "where verify tokens cost compute (CPUs, large batches)"),
    "tree_budget": dict(type=int, metavar="N",
                        help="verify a draft tree of N nodes per cycle instead of the chain (DDTree): each block "
                             "position's top candidates, expanded best-first, checked in one target pass; more "
                             "tokens per cycle, output unchanged (greedy and seeded sampling equal plain "
                             "decoding). 0 (default): the chain. Not for hybrid (delta-net) targets"),
    "acceptance": dict(choices=ACCEPTANCE_RULES,
                       help="how a DFlash2 drafter's sampled rows accept drafts: rejection (default) draws the drafts "
                            "from its candidate selector and keeps each with probability min(1, p/q), the output "
                            "having the target's distribution; match drafts the selector's argmax and keeps a draft "
                            "while it equals the target's own sample, the output then equal to plain decoding's with "
                            "the same seed. Greedy rows, and DFlash drafters, always match"),
    "speculation": dict(choices=SPECULATION_MODES,
                        help="auto: compile plain decoding and a few draft lengths (0, 3, 7, B-1; with --draft-tokens "
                             "K or --tree-budget N: 0 and that) and run, at each sync, the one of the most expected "
                             "tokens/s, from each one's timed cost and the acceptance measured; output unchanged. "
                             "fixed: always --draft-tokens (or the tree), and what auto runs for a DFlash2 drafter's sampled rows "
                             "under --acceptance rejection (their tokens would depend on K)"),
    "draft_window": dict(type=int, metavar="N",
                         help="the drafter sees only each row's last N committed positions, its context cache a "
                              "ring of them (N plus a write's worth per row, even with --kv-pages): its memory "
                              "and cost stop growing with the context, the output is unchanged (default: all)"),
    "batch_size": dict(type=int, metavar="N", help="rows decoded together (slots refilled as rows finish)"),
    "dtype": dict(choices=sorted(DTYPES), help="parameter dtype (default: the checkpoint's)"),
    "max_prompt_len": dict(type=int, metavar="N",
                           help="longest prompt in tokens, which sizes the KV cache (default: the longest in the "
                                "input, rounded up); attention reads only what rows use, so a larger cache costs "
                                "memory, not time"),
    "kv_pages": dict(type=int, metavar="N",
                     help="keep K/V in a pool of N pages (of --page-size positions) shared by the rows: each row "
                          "holds the pages of its own prompt and max_new_tokens and returns them when it "
                          "finishes, so the cache is sized by N, not batch x the longest row, and many short rows "
                          "share what one long row would reserve; prompts wait for pages (default: per-row "
                          "caches)"),
    "prefix_cache": dict(choices=("on", "off"),
                         help="with --kv-pages, keep prompts' full pages cached and share them with later prompts "
                              "that start the same tokens, which prefill only the rest; least recently used pages are "
                              "evicted (default: on with a pool, unless the target keeps a per-row ring or state)"),
    "page_size": dict(type=int, metavar="N", help="K/V positions per page"),
    "sync_every": dict(type=int, metavar="N", help="decoding cycles per host sync"),
    "narrow_tail": dict(action="store_true",
                        help="once no prompt waits, move the running rows to narrower loops as they finish "
                             "(6, 4, 3, 2, 1 slots for a batch of 8). Pays where a cycle costs per row (a CPU, "
                             "large batches) and the tail is long against the compiles it adds (one loop per "
                             "width): a run has one tail"),
    "prefill_chunk": dict(type=int, metavar="N",
                          help="prompts longer than N tokens (a power of two >= 16) are prefilled N at a time, one "
                               "piece between rounds of cycles, so the running streams never wait for a whole "
                               "long prompt"),
    "mesh": dict(metavar="data=D,model=M",
                 help="device mesh: batch rows over `data`, heads/MLP/vocab over `model` "
                      "(default: every device on `data`; one device: no mesh)"),
    "constraint_states": dict(type=int, metavar="N",
                              help="structured output: the automaton states a request's constraint may have (a "
                                   "JSON schema, a regex, a choice, a required tool call); the device pool holds a "
                                   "region of N per slot, 4 bytes per 32 vocabulary tokens a state (19,456 at a "
                                   "152k vocabulary). 0: no constraints"),
    "constraint_edges": dict(type=int, metavar="N",
                             help="structured output: a constraint's transitions that leave the next state most of "
                                  "a state's tokens reach, 8 bytes each (default 1024 per state)"),
    "stall_timeout": dict(type=float, metavar="MINUTES",
                          help="end the run with an error (exit status 3) when the device makes no progress for "
                               "this long (compiles excluded); rows finished are kept; 0 = wait forever"),
}

# The engine flags of `python -m infer` (and train.generate_data): every field but the server's
# prefill chunk, in the order --help lists them.
BATCH_ENGINE_FLAGS = ("max_new_tokens", "block_size", "draft_tokens", "tree_budget", "acceptance", "speculation",
                      "draft_window", "batch_size", "dtype", "max_prompt_len", "kv_pages", "prefix_cache", "page_size",
                      "sync_every", "narrow_tail", "mesh", "stall_timeout")
# The engine flags of `python -m infer.serve`: no narrow tail (a server's batch has no tail).
SERVER_ENGINE_FLAGS = ("batch_size", "max_new_tokens", "max_prompt_len", "block_size", "draft_tokens", "tree_budget",
                       "acceptance", "speculation", "draft_window", "sync_every", "prefill_chunk", "kv_pages",
                       "prefix_cache", "page_size", "dtype", "mesh", "stall_timeout", "constraint_states",
                       "constraint_edges")


def add_engine_flags(parser, names=BATCH_ENGINE_FLAGS, *, overrides: dict | None = None,
                     helps: dict | None = None):
    """Declare the engine flags `names` (fields of `EngineOptions`) on a parser or argument group,
    each defaulting to the field's default. overrides: field -> this command's own default, one
    visible entry per difference (the server: {"sync_every": SERVER_SYNC_EVERY}, for latency);
    helps: field -> this command's help text, where the flag means more for it (the server's
    --max-prompt-len defaults to the target's context). A switch (--narrow-tail) whose command
    default is not False is --X/--no-X (None: unset, the command decides). Parse, then
    `EngineOptions.of(args)`."""
    defaults = {f.name: f.default for f in fields(EngineOptions)} | dict(overrides or {})
    for name in names:
        kwargs = dict(ENGINE_FLAGS[name])
        if helps and name in helps:
            kwargs["help"] = helps[name]
        if kwargs.get("action") == "store_true" and defaults[name] is not False:
            kwargs["action"] = argparse.BooleanOptionalAction
        if kwargs.get("action") != "store_true":
            kwargs["default"] = defaults[name]
        parser.add_argument(flag(name), **kwargs)


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
    p.add_argument("--temperature", type=float, default=JOB.temperature, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=JOB.top_p, help="nucleus sampling: keep the smallest set of tokens "
                                                                "whose probability reaches P (1 = off)")
    p.add_argument("--top-k", type=int, default=JOB.top_k, help="keep only the K most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=JOB.seed, help="seed of the sampling keys (per row and position): any integer, taken "
                                                               "modulo 2**32 (as the server's request seeds)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the stop tokens")
    p.add_argument("--compare-baseline", action="store_true",
                   help="also time plain decoding of the same prompts and report the speedup")
    p.add_argument("--enable-thinking", action="store_true",
                   help="pass enable_thinking=True to the chat template (Qwen3); off by default")
    # --speculation's default is the job's (`GenerationJob.speculation_mode`): auto, but fixed for the demo
    # on its own prompts, which is there to show DFlash's cycles.
    add_engine_flags(p.add_argument_group("engine"), BATCH_ENGINE_FLAGS, overrides={"speculation": None},
                     helps={"speculation": ENGINE_FLAGS["speculation"]["help"] + " (default: auto; fixed for the "
                                                                              "demo pair on its own prompts)"})
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
    names = [f.name for f in fields(GenerationJob) if f.name != "options"] + [f.name for f in fields(EngineOptions)]
    return GenerationJob.of(**{name: getattr(args, name) for name in names if hasattr(args, name)})
