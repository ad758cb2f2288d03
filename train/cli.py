"""`python -m train`: its flags, and the dispatch to training (`trainer.train`) or, with --aot,
to the training step compiled for a TPU (`aot.run_train_aot`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_jax.errors import DFlashError
from dflash_jax.sharding import init_distributed
from infer.flags import add_distributed_flags
from train.aot import run_train_aot
from train.config import load_config
from train.trainer import done_message, log, train


def aot_report(cfg: dict, args) -> int:
    """--aot: compile the configured training step for the TPU topology and report; --json FILE
    writes the report there too."""
    report = run_train_aot(cfg, args)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0


# --dflash2: the drafter of a DFlash2 recipe (dflash_jax.dflash2.DFlash2Config's defaults), block 8.
DFLASH2_RECIPE = ["drafter.block_size=8", "drafter.dflash2={}"]


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train", description=(
        "Train a DFlash drafter against a frozen target. Settings come from --config (YAML) and "
        "key.sub=value overrides, e.g. train.steps=100 drafter.block_size=8."))
    p.add_argument("--config", required=True, help="YAML config (see configs/train/)")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_distributed_flags(p)
    aot = p.add_argument_group("--aot: compile the training step for a TPU and report (trains nothing; no TPU needed)")
    aot.add_argument("--aot", metavar="TOPOLOGY", help="e.g. v5p:1x1x1, v5e:2x2 (needs libtpu: pip install -e '.[tpu]')")
    aot.add_argument("--shape", default=None, help="a published target shape (qwen3-8b, ...) instead of the "
                     "config's target directory")
    aot.add_argument("--batch", type=_positive, default=None, help="sequences per step (default: one per data shard)")
    aot.add_argument("--conversations", type=_positive, default=800_000,
                     help="conversations the projected training time covers (default: the paper's 800k)")
    aot.add_argument("--chips", type=_positive, default=32, help="chips the projection trains on (default 32: v5p-64)")
    aot.add_argument("--hlo", default=None, metavar="DIR", help="write the step's scheduled TPU HLO here")
    aot.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    aot.add_argument("--dflash2", action="store_true", help="the DFlash2 recipe: a DFlash2 drafter (convolutions "
                     "of 2 taps over groups of 16 channels, a rank-256 selector over the top 16) of block 8, i.e. "
                     f"{' '.join(DFLASH2_RECIPE)} before the overrides given")
    args = p.parse_args(argv)
    try:
        init_distributed(args.coordinator, args.num_processes, args.process_id, auto=args.distributed)
        cfg = load_config(args.config, (DFLASH2_RECIPE if args.dflash2 else []) + args.overrides)
        if args.aot:
            return aot_report(cfg, args)
        summary = train(cfg, progress=not args.quiet)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    log(done_message(summary, cfg))
    return 0
