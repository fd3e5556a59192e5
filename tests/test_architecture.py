"""The tree keeps its shape: no import circle (not even lazy or type-only), and ``import
dask_ddict`` stays light.  (Modules have no line budget: one is split when it holds two
ideas, never to meet a count.)"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import dask_ddict

ROOT = pathlib.Path(dask_ddict.__file__).parent


def _module(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: pathlib.Path, name: str) -> set[str]:
    """Every dask_ddict module ``path`` imports, anywhere in it (functions, TYPE_CHECKING)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names = [mod] + [f"{mod}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        out.update(n for n in names if n.startswith("dask_ddict"))
    return out


def graph() -> dict[str, set[str]]:
    files = {_module(p): p for p in ROOT.rglob("*.py")}
    edges = {}
    for name, path in files.items():
        targets = set()
        for imp in _imports(path, name):
            while imp and imp not in files:
                imp = imp.rpartition(".")[0]
            if imp and imp != name and not name.startswith(imp + "."):  # a package's own init
                targets.add(imp)
        edges[name] = targets
    return edges


def test_no_import_circle_not_even_lazy_or_type_only():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> None:
        state[n] = 1
        stack.append(n)
        for m in edges[n]:
            if state.get(m) == 1:
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m) :] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = 2

    for n in sorted(edges):
        if n not in state:
            visit(n)


def test_importing_the_package_loads_no_storage_and_no_server():
    code = (
        "import sys, dask_ddict; print(sorted(m for m in ('lmdb', 'zarr', "
        "'dask_ddict.host.server', 'dask_ddict.shard.manager') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_every_module_is_named_in_the_module_tree_page():
    """``docs/design/modules.md`` says where each part lives: a module it does not name
    (one added or renamed without saying what it holds) fails here."""
    page = (ROOT.parent / "docs" / "design" / "modules.md").read_text()
    unnamed = [
        str(p.relative_to(ROOT))
        for p in sorted(ROOT.rglob("*.py"))
        if p.name not in ("__init__.py", "__main__.py") and p.name not in page
    ]
    assert not unnamed, f"modules missing from docs/design/modules.md: {unnamed}"
