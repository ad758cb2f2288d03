"""Where the reference outputs of the PyTorch implementation live (../shared/fixtures)."""

import os
from pathlib import Path

ROOT = Path(os.environ.get("DFLASH_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures"))
TINY = ROOT / "tiny-qwen3-dflash"


def tiny() -> Path:
    if not (TINY / "expected.npz").is_file():
        raise FileNotFoundError(
            f"parity fixtures not found at {TINY}; check out shared/ beside the repo or set DFLASH_FIXTURES"
        )
    return TINY
