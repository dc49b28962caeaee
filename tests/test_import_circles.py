"""No import circle among the project's modules (engine/, server/, setup/, bench/, tools/), read from the source's
import statements at module level and inside functions alike, as /work/shared/hooks/import_circles.py reads them.

Beyond the hook, a package's __init__ is a module of its own where its own names are imported (`from engine.arch
import family` runs engine/arch/__init__.py and everything it imports), while `from pkg import submodule` is an
import of the submodule only; and engine/arch/__init__.py's imports by name (the families engine/supported.py
lists) count as the imports they are.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
ROOTS = ("engine", "server", "setup", "bench", "tools")


def modules(root: Path, packages=ROOTS) -> dict[str, Path]:
    """Dotted module name -> its file; a package's __init__.py under the package's name."""
    out = {}
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _known(name: str, mods) -> str | None:
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def imports(name: str, path: Path, mods) -> set[str]:
    """The project modules that `name`'s import statements import, wherever in the file they stand."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out |= {_known(a.name, mods) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in mods else _known(base, mods))
    out.discard(None)
    out.discard(name)
    return out


def graph(root: Path = ROOT, packages=ROOTS, by_name: dict[str, list[str]] | None = None) -> dict[str, set[str]]:
    """Module -> the modules it imports. by_name: imports made by name (importlib), module -> the ones it makes."""
    mods = modules(root, packages)
    g = {m: imports(m, p, mods) for m, p in mods.items()}
    for m, targets in (by_name or {}).items():
        g[m] |= set(targets)
    return g


def circles(g: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected sets of more than one module (Tarjan's algorithm), each sorted."""
    index, low, on, stack, found = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                found.append(tuple(sorted(scc)))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10_000))
    try:
        for v in sorted(g):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return sorted(found)


def project_graph() -> dict[str, set[str]]:
    from engine.supported import FAMILIES       # engine/arch/__init__.py imports these by name
    return graph(by_name={"engine.arch": [f"engine.arch.{f}" for f in FAMILIES]})


def test_no_import_circle():
    found = circles(project_graph())
    assert found == [], "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_registry_imports_are_seen():
    """The families are edges of engine.arch, and the GGUF reader reaches them only through it."""
    g = project_graph()
    assert {"engine.arch.dense", "engine.arch.qwen3next"} <= g["engine.arch"]
    assert "engine.arch" in g["engine.gguf_model"] and "engine.gguf_model" not in g["engine.arch.base"]


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_circles_are_found_at_module_level_in_functions_and_through_a_package(tmp_path):
    _write(tmp_path, {
        "pkg/__init__.py": "from pkg import reg\n",
        "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "def f():\n    from .a import x\n",                 # function level, relative
        "pkg/reg.py": "from pkg.c import thing\n",
        "pkg/c.py": "from pkg import helper_name\n",                  # a name of pkg/__init__.py: runs it
        "pkg/d.py": "from pkg import a, b\n",                         # submodules only: no edge to the package
        "pkg/e.py": "import pkg.d\nfrom . import d\n",
        "other/__init__.py": "",
        "other/x.py": "def g():\n    import pkg.e\n",
    })
    found = circles(graph(tmp_path, ("pkg", "other")))
    assert found == [("pkg", "pkg.c", "pkg.reg"), ("pkg.a", "pkg.b")]
    assert circles(graph(tmp_path, ("pkg", "other"), {"pkg.d": ["pkg.e"]})) == [
        ("pkg", "pkg.c", "pkg.reg"), ("pkg.a", "pkg.b"), ("pkg.d", "pkg.e")]
