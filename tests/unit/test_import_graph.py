"""No import cycle anywhere in ``tieredkv/``.

The graph has an edge for every ``import`` / ``from ... import`` of a ``tieredkv`` module, at
module level or inside a function (a lazy import only hides a cycle), but not under
``if TYPE_CHECKING:`` (never run). ``from package import name`` counts as an edge to
``package.name`` when that is a module, else to ``package``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import tieredkv

ROOT = Path(tieredkv.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    found = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}
    for ext in ROOT.rglob("*.so"):  # a built extension (tieredkv._fastrec) imports nothing of ours
        name = _module_name(ext.with_name(ext.name.split(".")[0] + ".py"))
        found.setdefault(name, ext)
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    if path.suffix != ".py":
        return set()
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def target(mod: str) -> str | None:
        while mod and mod not in modules:
            mod = mod.rpartition(".")[0]
        return mod or None

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("tieredkv") and (t := target(alias.name)):
                    found.add(t)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            if mod.startswith("tieredkv"):
                for alias in node.names:
                    sub = f"{mod}.{alias.name}"
                    t = sub if sub in modules else target(mod)
                    if t:
                        found.add(t)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    found.discard(name)
    return found


def _package_parents(name: str) -> set[str]:
    """Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first: edges to those."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0

    def strong(v: str) -> None:
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in graph:
                continue
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


def test_graph_sees_imports() -> None:
    graph = import_graph()
    assert "tieredkv.config" in graph
    assert "tieredkv.errors" in graph["tieredkv.config"]  # a plain module-level import is an edge


def test_finder_reports_a_cycle() -> None:
    assert find_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_in_tieredkv() -> None:
    graph = import_graph()
    # A package's __init__ importing its own submodules is how a package exports its names; a
    # submodule importing its package's __init__ back would still be caught through the rest.
    cycles = find_cycles(graph)
    lines = []
    for comp in cycles:
        members = set(comp)
        edges = sorted(f"{a} -> {b}" for a in comp for b in graph[a] if b in members)
        lines.append(" | ".join(comp) + "\n      " + "\n      ".join(edges))
    assert not cycles, "import cycles in tieredkv/:\n  " + "\n  ".join(lines)
