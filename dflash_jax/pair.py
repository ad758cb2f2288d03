"""A target and its DFlash drafter, loaded: configs, params, tokenizer, stop tokens and the mesh
they live on. The one loader of `python -m infer`, the server, the bench and the trainer.

    pair = load_pair("ckpt/qwen3-8b", "ckpt/qwen3-8b-dflash", dtype="bfloat16", mesh=engine_mesh(None))
    pair.target, pair.drafter      # ModelConfig, DrafterConfig (None: plain decoding)
    pair.tparams, pair.dparams     # on pair.mesh
    pair.tokenizer, pair.stop_tokens

A command that must fail fast on bad input before a weight is read loads in steps:
`open_pair` (directories and configs only), then `ModelPair.open_tokenizer` (tokenizer and stop
tokens), then `ModelPair.load_weights` (params, onto a mesh); `load_pair` is the three at once.
With no target, the bundled demo pair (`DEMO_DIR`).
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_jax.errors import InputError

DEMO_DIR = Path(__file__).resolve().parent / "demo"


def pair_dirs(target: str | Path | None, drafter: str | Path | None) -> tuple[Path, Path | None, bool]:
    """(target_dir, drafter_dir, demo): with no target, the bundled demo pair (and its drafter);
    a target without a drafter is plain decoding (drafter_dir None). A drafter without a target
    is an InputError."""
    if target is None and drafter is not None:
        raise InputError("--drafter needs --target, the model it drafts for")
    demo = target is None
    target_dir = Path(target) if target else DEMO_DIR / "target"
    drafter_dir = Path(drafter) if drafter else (DEMO_DIR / "drafter" if demo else None)
    return target_dir, drafter_dir, demo


def engine_mesh(spec: str | None):
    """The mesh a run's arrays live on: the one `spec` ("data=D,model=M") names; without one,
    every device on `data`, or no mesh (None) on a single device."""
    import jax

    from dflash_jax.sharding import make_mesh

    return make_mesh(spec) if (spec or jax.device_count() > 1) else None


@dataclass
class ModelPair:
    """A target and (optionally) its drafter. `drafter` is None for plain decoding: no drafter,
    or one not used (block size 1). tokenizer/stop_tokens are set by `open_tokenizer`, params and
    mesh by `load_weights`."""

    target_dir: Path
    drafter_dir: Path | None
    demo: bool
    target: Any  # ModelConfig
    drafter: Any = None  # DrafterConfig, or None
    warnings: list[str] = field(default_factory=list)  # the pair's mismatches (`check_pair`)
    tokenizer: Any = None  # None: the target has none (prompts as token ids only)
    stop_tokens: list[int] = field(default_factory=list)
    mesh: Any = None
    tparams: Any = None
    dparams: Any = None
    load_seconds: float = 0.0  # reading the weights
    dtype: str | None = None  # the params' dtype asked for (None: the checkpoint's)

    @property
    def drafting(self) -> bool:
        return self.drafter is not None

    def open_tokenizer(self, ignore_eos: bool = False) -> ModelPair:
        """Load the target's tokenizer (None where it has none) and its stop tokens (none with
        ignore_eos). Returns self."""
        self.tokenizer = load_tokenizer(self.target_dir)
        self.stop_tokens = [] if ignore_eos else stop_token_ids(self.target_dir, self.tokenizer)
        return self

    def load_weights(self, mesh=None, *, progress: bool = False, over_data: bool = False) -> ModelPair:
        """Read the params, every tensor straight into its shard on `mesh` (None: one device),
        so no device ever holds a model larger than itself. over_data: the target split over
        `data` as well (training's FSDP). Returns self."""
        from dflash_jax.checkpoint import load_drafter, load_target

        t = time.perf_counter()
        self.target, self.tparams = load_target(self.target_dir, dtype=self.dtype, progress=progress, mesh=mesh,
                                                over_data=over_data)
        if self.drafter is not None:
            self.drafter, self.dparams = load_drafter(self.drafter_dir, dtype=self.dtype, progress=progress,
                                                      mesh=mesh)
        self.load_seconds = time.perf_counter() - t
        self.mesh = mesh
        return self


def open_pair(target: str | Path | None = None, drafter: str | Path | None = None, *, dtype: str | None = None,
              use_drafter: bool = True) -> ModelPair:
    """The pair's directories and configs, checked, with no weight read (see `pair_dirs` for the
    defaults). use_drafter=False (block size 1): the drafter's config is not read."""
    from dflash_jax.checkpoint import read_model_config
    from dflash_jax.drafter import check_pair

    target_dir, drafter_dir, demo = pair_dirs(target, drafter)
    tcfg = read_model_config(target_dir, "target", dtype=dtype)
    pair = ModelPair(target_dir, drafter_dir, demo, tcfg, dtype=dtype)
    if drafter_dir is not None and use_drafter:
        pair.drafter = read_model_config(drafter_dir, "drafter", dtype=dtype)
        pair.warnings = check_pair(tcfg, pair.drafter)
    return pair


def load_pair(target: str | Path | None = None, drafter: str | Path | None = None, *, dtype: str | None = None,
              mesh=None, use_drafter: bool = True, ignore_eos: bool = False, progress: bool = False) -> ModelPair:
    """`open_pair`, `open_tokenizer` and `load_weights` at once: a pair ready to run. mesh: a
    Mesh (`engine_mesh(spec)` for a command's --mesh) or None (one device). Raises DFlashError."""
    pair = open_pair(target, drafter, dtype=dtype, use_drafter=use_drafter)
    return pair.open_tokenizer(ignore_eos).load_weights(mesh, progress=progress)


def load_tokenizer(target_dir: Path):
    """The Hugging Face tokenizer of a model directory; None where it has no tokenizer files."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((target_dir / n).is_file() for n in names):
        return None
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    # Without torch (the default install) transformers advises at import that its models are
    # unavailable: only its tokenizers are used here.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    from transformers import AutoTokenizer

    custom = _custom_tokenizer(target_dir)
    trust = os.environ.get(TRUST_REMOTE_CODE) == "1"
    if custom and not trust:
        raise InputError(f"the tokenizer in {target_dir} is the checkpoint's own code ({custom}, transformers' "
                         f"trust_remote_code); to run it set {TRUST_REMOTE_CODE}=1 (Kimi's also needs: pip install "
                         "tiktoken), or give rows as input_ids from a directory without tokenizer files")
    try:
        return AutoTokenizer.from_pretrained(str(target_dir), trust_remote_code=bool(custom))
    except Exception as e:  # transformers raises many types for broken tokenizer files
        missing = re.search(r"packages that were not found in your environment: ([\w, .-]+?)\. Run", str(e))
        if missing:
            raise InputError(f"the tokenizer in {target_dir} ({custom}) needs {missing.group(1)}: "
                             f"pip install {missing.group(1).replace(',', '')}") from None
        raise InputError(f"cannot load the tokenizer in {target_dir}: {str(e).splitlines()[0]}") from None


TRUST_REMOTE_CODE = "DFLASH_TRUST_REMOTE_CODE"  # "1": run a checkpoint's own tokenizer code (Kimi's tiktoken one)


def _custom_tokenizer(target_dir: Path) -> str | None:
    """The class of a tokenizer that is the checkpoint's own code (tokenizer_config.json's
    `auto_map`: Kimi's tiktoken-based `TikTokenTokenizer`), None for a transformers tokenizer."""
    path = target_dir / "tokenizer_config.json"
    try:
        auto = (json.loads(path.read_text()).get("auto_map") or {}).get("AutoTokenizer") if path.is_file() else None
    except (json.JSONDecodeError, AttributeError):
        return None
    names = [n for n in (auto if isinstance(auto, list) else [auto]) if isinstance(n, str)]
    return names[0] if names else None


def stop_token_ids(target_dir: Path, tokenizer) -> list[int]:
    """The ids that end a row: generation_config.json's eos_token_id, else config.json's, else the
    tokenizer's EOS."""
    ids: list = []
    for name in ("generation_config.json", "config.json"):
        path = target_dir / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            if eos is not None:
                ids = eos if isinstance(eos, list) else [eos]
                break
    if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
        ids = [tokenizer.eos_token_id]
    return [int(i) for i in ids]
