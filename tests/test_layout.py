"""The source layout's rules, checked on the source itself (no model, under a second):

- no import circle among the project's modules (imports inside functions count; imports under
  `if TYPE_CHECKING:` do not, they never run);
- the library (`dflash_jax`) imports none of the CLIs, the benchmarks or the tests, and `train/`
  does not import the benchmarks;
- no function in the library or the server is longer than 120 lines.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_jax", "infer", "train", "bench")
LONGEST = 120


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")) if (ROOT / pkg).is_dir() else []:
            if "demo" in path.relative_to(ROOT).parts[1:2]:
                continue
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The project modules `name` imports (at run time)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node):
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                found.add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    out = set()
    for mod in found:
        while mod and mod not in modules:  # `import a.b.c` of a package path: the deepest module of ours
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            out.add(mod)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def test_the_checker_finds_a_circle_and_a_long_function(tmp_path):
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
    src = tmp_path / "m.py"
    src.write_text("def f():\n" + "    x = 1\n" * (LONGEST + 1) + "\ndef g():\n    pass\n")
    assert [name for name, _ in _long_functions(src)] == ["f"]


def test_no_import_circle():
    cycles = _cycles(_graph())
    assert not cycles, "import circles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_library_imports_no_tooling():
    bad = [(mod, dep) for mod, deps in _graph().items() for dep in deps
           if (mod.startswith("dflash_jax") and dep.split(".")[0] in ("infer", "train", "bench", "tests"))
           or (mod.startswith("train") and dep.split(".")[0] == "bench")]
    assert not bad, bad


def _long_functions(path: Path):
    tree = ast.parse(path.read_text(), str(path))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            length = node.end_lineno - node.lineno + 1
            if length > LONGEST:
                yield node.name, length


@pytest.mark.parametrize("root", ["dflash_jax", "infer/serve"])
def test_no_function_is_longer_than_120_lines(root):
    base = ROOT / root
    paths = sorted(base.rglob("*.py")) if base.is_dir() else [base.with_suffix(".py")]
    long = [f"{p.relative_to(ROOT)}:{name} ({n} lines)" for p in paths for name, n in _long_functions(p)]
    assert not long, long


def _readme_layout_paths() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return [p for row in rows for p in re.findall(r"`([\w./-]+/?)`", row.split("|")[1])]


def test_the_readme_layout_table_matches_the_tree():
    """Every path the README's layout table names exists, and every package of the library and
    every top-level package has a row."""
    paths = _readme_layout_paths()
    assert paths, "README.md has no '## Layout' table"
    missing = [p for p in paths if not (ROOT / p).exists()]
    assert not missing, f"the README's layout table names paths that do not exist: {missing}"
    listed = {p.rstrip("/") for p in paths}
    packages = [f"dflash_jax/{d.name}" for d in sorted((ROOT / "dflash_jax").iterdir())
                if (d / "__init__.py").exists()] + [p for p in ("infer", "train", "bench", "tests")]
    unlisted = [p for p in packages if p not in listed]
    assert not unlisted, f"packages missing from the README's layout table: {unlisted}"
