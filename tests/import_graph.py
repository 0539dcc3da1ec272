"""The imports a package's modules run when they are loaded, and the cycles among them.

An import under ``if TYPE_CHECKING:`` or inside a function runs later or never, so it makes no
cycle at load time; every other import in a module's body does (class bodies and ``try`` blocks
included). An import put inside a function to dodge a cycle still ties the two modules together,
so ``deferred`` counts those too; ``typing`` counts the imports made for type checkers only.
Read with :mod:`ast`, nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(body: list[ast.stmt], deferred: bool, typing: bool = False) -> list[ast.Import | ast.ImportFrom]:
    """The import statements among ``body`` that run when the module loads (``deferred``: and
    those inside its functions, which run when they are called; ``typing``: and those under
    ``if TYPE_CHECKING:``)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if deferred:
                found += _runtime_imports(node.body, deferred, typing)
        elif isinstance(node, ast.If):
            if typing or not _type_checking(node.test):
                found += _runtime_imports(node.body, deferred, typing)
            found += _runtime_imports(node.orelse, deferred, typing)
        elif isinstance(node, ast.ClassDef):
            found += _runtime_imports(node.body, deferred, typing)
        elif isinstance(node, (ast.Try, ast.With, ast.For, ast.While)):
            for block in ("body", "orelse", "finalbody"):
                found += _runtime_imports(getattr(node, block, []), deferred, typing)
            for handler in getattr(node, "handlers", []):
                found += _runtime_imports(handler.body, deferred, typing)
    return found


def _resolve(module: str, is_package: bool, node: ast.Import | ast.ImportFrom, known: set[str]) -> set[str]:
    """The modules of ``known`` an import statement in ``module`` loads (a package's submodule, when
    ``from package import name`` names one; else the package itself)."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names if a.name in known}
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    out = set()
    for alias in node.names:
        child = f"{target}.{alias.name}"
        if child in known:
            out.add(child)
        elif target in known:
            out.add(target)
    return out


def runtime_imports(package: Path, deferred: bool = False, typing: bool = False) -> dict[str, set[str]]:
    """Module → the modules of ``package`` (a folder) it imports when it loads (``deferred``: or
    when one of its functions runs: an import put inside a function to break a cycle still is one)."""
    root = package.parent
    paths = {_module_name(p, root): p for p in sorted(package.rglob("*.py")) if "__pycache__" not in p.parts}
    known = set(paths)
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        graph[name] = set()
        for node in _runtime_imports(tree.body, deferred, typing):
            graph[name] |= _resolve(name, path.name == "__init__.py", node, known) - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (each a cycle or several), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's algorithm; a package's modules are few, recursion is fine
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
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def runtime_cycles(package: Path, within: str | None = None, deferred: bool = False,
                   typing: bool = False) -> list[list[str]]:
    """The runtime import cycles among ``package``'s modules; ``within``: only those among the
    modules under that dotted prefix (``"splitft.cloud"``); ``deferred``: imports inside functions
    count too; ``typing``: and those for type checkers."""
    graph = runtime_imports(package, deferred, typing)
    if within is not None:
        inside = {m for m in graph if m == within or m.startswith(within + ".")}
        graph = {m: deps & inside for m, deps in graph.items() if m in inside}
    return cycles(graph)
