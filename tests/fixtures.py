"""Where the reference outputs of the PyTorch implementation live: tests/reference/ in the
repository (outputs of z-lab's reference implementation for a tiny pair, 1.6 MB), or the
directory $DFLASH_FIXTURES names."""

import os
from pathlib import Path

ROOT = Path(os.environ.get("DFLASH_FIXTURES", Path(__file__).resolve().parent / "reference"))
TINY = ROOT / "tiny-qwen3-dflash"


def tiny() -> Path:
    if not (TINY / "expected.npz").is_file():
        raise FileNotFoundError(f"parity fixtures not found at {TINY} (tests/reference/ is part of the repository; "
                                f"is $DFLASH_FIXTURES set to another directory?)")
    return TINY
