"""The source layout's rules, checked on the source itself (no model, under a second):

- no import circle among the project's modules (imports inside functions count; imports under
  `if TYPE_CHECKING:` do not, they never run);
- the library (`dflash_jax`) imports none of the CLIs, the benchmarks or the tests, and `train/`
  does not import the benchmarks;
- no function in the library or the server is longer than 120 lines;
- docs/layout.md and every package's docstring name each module of their package (a module added
  without a word about it is a failure, not a stale doc).
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


# --------------------------------------------------------------------------- docs name every module


def _package_modules(package: Path) -> list[str]:
    """A package's modules and subpackages, by name (not `__init__` or `__main__`)."""
    return sorted([p.stem for p in package.glob("*.py") if not p.name.startswith("__")]
                  + [d.name for d in package.iterdir() if (d / "__init__.py").is_file()])


def _unnamed(text: str, names) -> list[str]:
    """The names text does not mention in backticks: `name`, `name.py`, `name/` or a dotted path
    ending in it (`dflash_jax.engine.tree`)."""
    return [n for n in names if not re.search(rf"`[^`\n]*?(?<![\w-]){re.escape(n)}(?:\.py|/)?`", text)]


def _packages() -> list[Path]:
    return [init.parent for pkg in PACKAGES for init in sorted((ROOT / pkg).rglob("__init__.py"))]


def _docstring_gaps(package: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    return _unnamed(doc, _package_modules(package))


def _layout_rows(text: str) -> dict[str, str]:
    """docs/layout.md's table rows by the path in their first cell: `kv/` (the library's table,
    under dflash_jax/) or `infer/serve/` (the edges'), each row's whole text."""
    rows = {}
    for section in text.split("\n## ")[1:]:
        base = "dflash_jax/" if section.startswith("The library") else ""
        for line in section.splitlines():
            cells = line.split("|")
            if line.startswith("| `") and len(cells) > 2:
                for path in re.findall(r"`([\w./-]+)`", cells[1]):
                    rows[base + path.rstrip("/")] = line
    return rows


def _layout_gaps(package: Path, rows: dict[str, str]) -> list[str]:
    """The modules of a package its row in docs/layout.md does not name (a subpackage with a row of
    its own counts as named); for the library's own modules, those without a row."""
    rel = package.relative_to(ROOT).as_posix() if package.is_relative_to(ROOT) else package.name
    subpackages = {m for m in _package_modules(package) if f"{rel}/{m}" in rows}
    names = [m for m in _package_modules(package) if m not in subpackages]
    if rel == "dflash_jax":
        return [m for m in names if f"dflash_jax/{m}.py" not in rows and f"dflash_jax/{m}" not in rows]
    if rel not in rows:
        return names
    return _unnamed(rows[rel], names)


def test_the_doc_checker_finds_a_module_left_out(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "sub" / "__init__.py").write_text("")
    for name in ("__init__", "__main__", "alpha", "beta", "alpha_beta"):
        (pkg / f"{name}.py").write_text("")
    assert _package_modules(pkg) == ["alpha", "alpha_beta", "beta", "sub"]
    (pkg / "__init__.py").write_text('"""A package: `alpha.py`, `pkg.alpha_beta` and `sub/`."""\n')
    assert _docstring_gaps(pkg) == ["beta"]  # `alpha` and `alpha_beta` name no beta
    row = "| `pkg/` | `alpha`, `beta.py` |"
    assert _layout_gaps(pkg, {"pkg": row}) == ["alpha_beta", "sub"]
    assert _layout_gaps(pkg, {"pkg": row + " `alpha_beta`", "pkg/sub": "| `pkg/sub/` | |"}) == []
    assert _layout_gaps(pkg, {}) == ["alpha", "alpha_beta", "beta", "sub"]


def test_every_package_docstring_names_its_modules():
    gaps = {p.relative_to(ROOT).as_posix(): g for p in _packages() if (g := _docstring_gaps(p))}
    assert not gaps, f"package docstrings (__init__.py) that do not name these modules: {gaps}"


def test_the_layout_doc_names_every_module():
    rows = _layout_rows((ROOT / "docs" / "layout.md").read_text())
    assert "dflash_jax/engine" in rows and "bench" in rows, sorted(rows)
    gaps = {p.relative_to(ROOT).as_posix(): g for p in _packages() if (g := _layout_gaps(p, rows))}
    assert not gaps, f"docs/layout.md does not name these modules (in their package's row): {gaps}"
