"""`python -m train.demo_prompts`: code-continuation prompts cut from Python source files.

Used twice: prompts from the standard library (the demo target's own corpus) are what the
demo target regenerates to train the demo drafter; prompts from another package's source
(default numpy, which the target never saw) are the held-out benchmark prompts. Seeded:
the same files give the same prompts.

    python -m train.demo_prompts --out prompts.jsonl [--num 2000] [--source stdlib|PACKAGE] [--starts lines]
        [--exclude EARLIER.jsonl ...] [--id-prefix PREFIX]

Snippets start at a def/class line by default; `--starts lines` starts them at any code line
(not blank, not a comment), which gives far more distinct prompts from the same files.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import sys
from pathlib import Path


def source_files(source: str) -> list[Path]:
    if source == "stdlib":
        from train.demo_target import stdlib_files

        return stdlib_files()
    spec = importlib.util.find_spec(source)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"error: package {source!r} is not installed (or is not a package)")
    skip = {"tests", "test", "testing", "__pycache__"}
    files = []
    for root in spec.submodule_search_locations:
        files += [f for f in Path(root).rglob("*.py") if not skip & set(f.relative_to(root).parts)]
    return sorted(files)


STARTS = {
    "defs": lambda line: line.lstrip().startswith(("def ", "class ")),
    "lines": lambda line: bool(line.strip()) and not line.lstrip().startswith("#"),
}


def snippets(files: list[Path], num: int, seed: int, min_lines: int = 3, max_lines: int = 10,
             max_chars: int = 400, starts: str = "defs", exclude: frozenset = frozenset()) -> list[str]:
    """`num` distinct snippets (fewer if the files run out) starting at a def/class line
    (starts="defs") or at any code line (starts="lines"): openings a model should continue.
    Snippets in `exclude` are skipped; the rest come in the same order as without it."""
    is_start = STARTS[starts]
    rng = random.Random(seed)
    found = []
    for f in files:
        try:
            lines = f.read_text(encoding="utf-8").splitlines(keepends=True)
        except (UnicodeDecodeError, OSError):
            continue
        found += [(lines, i) for i, l in enumerate(lines) if is_start(l)]
    rng.shuffle(found)
    out, seen = [], set(exclude)
    for lines, i in found:
        text = "".join(lines[i:i + rng.randint(min_lines, max_lines)])[:max_chars]
        if text.strip() and text not in seen:
            seen.add(text)
            out.append(text)
        if len(out) == num:
            break
    return out


def prompts_in(path: str) -> list[str]:
    """The "prompt" of every line of a prompts or conversations JSONL file."""
    from dflash_jax.data import iter_jsonl_objects
    from dflash_jax.errors import DFlashError

    try:
        rows = [row for _, row in iter_jsonl_objects(path, DFlashError, "--exclude file")]
    except DFlashError as e:
        raise SystemExit(f"error: {e}") from None
    return [row["prompt"] for row in rows if isinstance(row.get("prompt"), str)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.demo_prompts", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--num", type=int, default=2000)
    p.add_argument("--source", default="stdlib", help="stdlib, or an installed package's name (e.g. numpy)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--starts", choices=sorted(STARTS), default="defs",
                   help="where snippets start: a def/class line (default) or any code line")
    p.add_argument("--exclude", nargs="+", default=[], metavar="FILE.jsonl",
                   help="skip snippets that are the prompt of a line in these files (earlier prompt sets)")
    p.add_argument("--id-prefix", default=None,
                   help="ids are PREFIX-0, PREFIX-1, ... (default: SOURCE, or SOURCE-lines with --starts lines)")
    args = p.parse_args(argv)
    texts = snippets(source_files(args.source), args.num, args.seed, starts=args.starts,
                     exclude=frozenset(t for path in args.exclude for t in prompts_in(path)))
    # ids stay unique when files of both kinds are concatenated (and "defs" keeps its old ids)
    prefix = args.id_prefix or (args.source if args.starts == "defs" else f"{args.source}-{args.starts}")
    with open(args.out, "w", encoding="utf-8") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"id": f"{prefix}-{i}", "prompt": t}) + "\n")
    print(f"wrote {len(texts)} prompts to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
