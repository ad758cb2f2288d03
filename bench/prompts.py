"""Held-out prompts: code snippets cut, seeded, from the source of an installed package the
target never trained on (default numpy), tokenised as raw text, or (no tokenizer) seeded random
token ids of a similar length."""

from __future__ import annotations

import importlib.util
import random
import re
import textwrap
from pathlib import Path
from typing import Sequence

SKIP_DIRS = {"tests", "test", "__pycache__"}
DEF_LINE = re.compile(r"^\s*(?:async\s+def|def|class)\s+\w")


def package_root(package: str) -> Path:
    """The source directory of an installed package (its first search location)."""
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise SystemExit(f"error: package {package!r} is not installed (--heldout-package)")
    locations = list(spec.submodule_search_locations or [])
    if not locations:  # a plain module: its one file
        if not spec.origin:
            raise SystemExit(f"error: package {package!r} has no source files")
        return Path(spec.origin)
    return Path(locations[0])


def package_files(package: str) -> list[Path]:
    """The package's .py files, sorted, tests directories skipped."""
    root = package_root(package)
    if root.is_file():
        return [root]
    return sorted(f for f in root.rglob("*.py") if not SKIP_DIRS & set(f.relative_to(root).parts[:-1]))


def package_version(package: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(package)
    except Exception:  # not a distribution name, or no metadata
        return None


def heldout_snippets(package: str = "numpy", num: int = 16, seed: int = 0, lines: int = 6) -> list[dict]:
    """`num` code snippets from the package's source: the first `lines` lines (dedented) of a
    function or class. Files are visited in a seeded order, one snippet per file, so the result
    depends only on (package source, num, seed, lines)."""
    files = package_files(package)
    root = package_root(package)
    base = root.parent
    rng = random.Random(seed)
    order = list(range(len(files)))
    rng.shuffle(order)
    snippets = []
    for fi in order:
        if len(snippets) >= num:
            break
        try:
            text = files[fi].read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        src = text.splitlines()
        starts = [i for i, line in enumerate(src) if DEF_LINE.match(line)]
        if not starts:
            continue
        i = rng.choice(starts)
        snippet = textwrap.dedent("\n".join(src[i:i + lines])).rstrip() + "\n"
        if len(snippet.strip()) < 20:
            continue
        snippets.append(dict(file=str(files[fi].relative_to(base)), line=i + 1, text=snippet))
    if not snippets:
        raise SystemExit(f"error: no function or class found in the source of {package!r}")
    return snippets


def prompt_ids(snippets: list[dict], tokenizer, vocab_size: int, avoid: Sequence[int], max_tokens: int,
               seed: int) -> tuple[list[list[int]], str]:
    """Token ids of the snippets: tokenised raw text, or (no tokenizer) seeded random ids of a
    similar length (about 4 characters per token), avoiding the `avoid` ids (the mask token)."""
    if tokenizer is not None:
        ids = [list(tokenizer(s["text"], add_special_tokens=True)["input_ids"])[:max_tokens] for s in snippets]
        return ids, "text"
    import numpy as np

    rng = np.random.default_rng(seed)
    allowed = np.setdiff1d(np.arange(vocab_size), np.asarray(list(avoid), np.int64))
    out = []
    for s in snippets:
        n = int(min(max_tokens, max(4, round(len(s["text"]) / 4))))
        out.append(rng.choice(allowed, size=n).astype(int).tolist())
    return out, "random_token_ids"


def describe_prompts(prompts: list[list[int]], snippets: list[dict], kind: str, package: str, lines: int) -> str:
    """One line about the prompts (and the first prompt on a second): the held-out snippets as
    text, or, without a tokenizer, the random token ids that stand in for them (not the snippets)."""
    import statistics

    lens = [len(p) for p in prompts]
    version = package_version(package)
    source = f"{package} {version}" if version else package
    sizes = f"; {min(lens)}..{max(lens)} tokens (mean {statistics.mean(lens):.1f})\n"
    if kind == "text":
        return (f"prompts: {len(prompts)} held-out snippets from {source} ({lines} lines from a def/class each), "
                "tokenised as raw text (code continuation)" + sizes
                + f"  first: {snippets[0]['file']}:{snippets[0]['line']}: {snippets[0]['text'].splitlines()[0]!r}")
    first = prompts[0]
    ids = ", ".join(map(str, first)) if len(first) <= 10 else ", ".join(map(str, first[:8])) + f", ... {len(first)} ids"
    return (f"prompts: {len(prompts)} rows of seeded random token ids (NO TOKENIZER: not text; each as long as "
            f"a held-out snippet from {source} would be, about 4 characters a token)" + sizes
            + f"  first: [{ids}]")
