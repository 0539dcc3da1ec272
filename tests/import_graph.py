"""The import graph of a package as Python runs it, read with ``ast``: which modules a module
imports while it is being imported, and the cycles among them.

An import counts when it runs at import time: at module level, inside a module-level ``if``,
``try`` or ``with``, or in a class body. Imports inside functions run later, and those under
``if TYPE_CHECKING:`` never run, so neither counts (``type_checking=True`` counts the latter, to
see the cycles a type checker walks). Importing ``package.module`` runs ``package/__init__.py``
first; that implicit step is not an edge (nor is ``from . import name`` an edge to the package
that holds the importing module: it is being imported already), as in the tools that draw import
graphs.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_statements(body: list[ast.stmt], type_checking: bool) -> Iterator[ast.stmt]:
    """The statements of ``body`` that run when the module is imported (functions' bodies do not)."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        yield node
        if isinstance(node, ast.If):
            if type_checking or not _is_type_checking(node.test):
                yield from _runtime_statements(node.body, type_checking)
            yield from _runtime_statements(node.orelse, type_checking)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *(h.body for h in node.handlers)):
                yield from _runtime_statements(block, type_checking)
        elif isinstance(node, (ast.With, ast.ClassDef)):
            yield from _runtime_statements(node.body, type_checking)


def import_graph(package: Path, *, type_checking: bool = False) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports at import time (dotted names)."""
    root = Path(package)
    modules = {_module_name(root, path): path for path in sorted(root.rglob("*.py"))}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        found: set[str] = set()
        for node in _runtime_statements(ast.parse(path.read_text(), str(path)).body, type_checking):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if not (name == source or name.startswith(source + ".")):
                    found.add(source)  # an ancestor package is imported already: its names are no edge
                found.update(f"{source}.{alias.name}" for alias in node.names)  # a submodule, when it is one
        graph[name] = {m for m in found if m in modules and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                group.append(top)
                if top == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def runtime_cycles(package: Path, *, within: str | None = None, type_checking: bool = False) -> list[list[str]]:
    """The import cycles of ``package`` (only among modules whose name starts with ``within``)."""
    graph = import_graph(package, type_checking=type_checking)
    if within is not None:
        graph = {k: {m for m in v if m.startswith(within)} for k, v in graph.items() if k.startswith(within)}
    return cycles(graph)
