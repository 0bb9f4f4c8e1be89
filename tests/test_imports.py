"""The import graph of the cutefa package has no cycle, and the identity module is a leaf.

The graph is read from the source (``ast``), with every import statement counted, at module level
or inside a function: an import deferred into a function still closes a circle, only later.
Imports of the root package itself (``from cutefa import __version__``) are not edges: Python
initializes ``cutefa/__init__.py`` before any submodule, and that file imports nothing at module
level (a test below holds it to that).
"""

from __future__ import annotations

import ast
from pathlib import Path

import cutefa

PACKAGE = Path(cutefa.__file__).resolve().parent


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _owner(name: str, known: dict[str, Path]) -> str | None:
    """The module of the package that importing ``name`` runs last (itself, or its package)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of the package that ``path`` (module ``name``) imports anywhere in its text."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str | None] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {_owner(a.name, known) for a in node.names if a.name.split(".")[0] == "cutefa"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*parent, base] if base else parent)
            if base.split(".")[0] != "cutefa":
                continue
            for alias in node.names:  # ``from cutefa import pack``: the submodule
                full = f"{base}.{alias.name}"
                found.add(full if full in known else _owner(base, known))
    return {m for m in found if m is not None and m not in (name, "cutefa")}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every cycle a depth-first walk closes (empty when the graph is acyclic)."""
    state: dict[str, int] = {}
    found: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                found.append([*stack[stack.index(nxt) :], nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])
    return found


def test_the_graph_is_read_right():
    edges = graph()
    assert {"cutefa.compile", "cutefa.pack", "cutefa.identity", "cutefa.selection", "cutefa.cli"} <= set(
        edges
    )
    assert {"cutefa.compile", "cutefa.pack", "cutefa.ffi"} <= edges["cutefa.loader"]
    assert "cutefa.compile" in edges["cutefa.cli_compile"]  # imported inside a function: still an edge
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]


def test_no_import_cycle_in_the_package():
    assert cycles(graph()) == []


def test_identity_is_a_leaf_and_compile_and_pack_do_not_import_each_other():
    edges = graph()
    assert edges["cutefa.identity"] <= {"cutefa.model.spec"}
    assert "cutefa.compile" not in edges["cutefa.pack"]
    assert "cutefa.identity" in edges["cutefa.pack"]


def test_the_root_package_imports_nothing_at_module_level():
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    eager = [
        node
        for node in tree.body
        if isinstance(node, (ast.Import, ast.ImportFrom)) and (node.module or "").split(".")[0] == "cutefa"
    ]
    assert eager == []
