"""`python -m dflash_jax.convert --hf DIR --out DIR`: HF checkpoint -> dflash-jax format.

The converted directory holds an orbax checkpoint of the parameters (`params/`), the
original `config.json`, tokenizer and generation files, and `dflash_jax.json` metadata.
Everything that loads a model accepts either form.
"""

from __future__ import annotations

import argparse
import sys
import time

from dflash_jax.config import DTYPES
from dflash_jax.errors import DFlashError


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m dflash_jax.convert",
        description="Convert a Hugging Face checkpoint (safetensors, sharded or not; "
        "pytorch_model.bin with torch installed) into the dflash-jax orbax format.",
    )
    p.add_argument("--hf", required=True, metavar="DIR", help="Hugging Face model directory")
    p.add_argument("--out", required=True, metavar="DIR", help="output directory (must not exist)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="parameter dtype (default: the checkpoint's, bfloat16 for float16)")
    p.add_argument("--dequantize", action="store_true",
                   help="write a quantized checkpoint's weights dequantized into --dtype (default: kept in its format)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from dflash_jax.checkpoint import convert

    start = time.perf_counter()
    try:
        out = convert(args.hf, args.out, dtype=args.dtype, force=args.force, progress=not args.quiet,
                      dequantize=args.dequantize)
    except DFlashError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out} in {time.perf_counter() - start:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
