"""Module-level values a layer's forward writes as it runs.

``global CALLS; CALLS += 1``, ``LOG.append(x.detach())``, ``SEEN[name] = x.shape``: in a layer of
the cloud half these writes land in the cloud's process, and the script's module keeps what its
import gave it, so a script that reads them (to log, to count, to decide) would silently see
other values than unsplit. What writes them is found in the layer class's code: its ``forward``
and the methods of its own that ``forward`` calls (``self._route(x)``), in the model's own
classes, as :mod:`.config_reads` reads them.
"""

from __future__ import annotations

import ast
import collections
import sys

from .config_reads import _methods

#: Methods of Python's containers that change them in place.
_MUTATORS = frozenset({"append", "extend", "insert", "add", "update", "setdefault", "pop", "popitem", "clear",
                       "remove", "discard", "appendleft", "extendleft", "popleft", "__setitem__", "__delitem__"})
_CONTAINERS = (list, dict, set, bytearray, collections.deque)


def globals_written(cls: type) -> tuple[str, ...]:
    """``module.NAME`` for each module-level name the forward of ``cls`` writes (rebinds, or
    changes in place when it holds a list, dict, set or deque), directly or through the
    methods of its own it calls."""
    found = _WRITTEN.get(cls)
    if found is None:
        found = _WRITTEN[cls] = _scan(cls)
    return found


_WRITTEN: dict[type, tuple[str, ...]] = {}


def _scan(cls: type) -> tuple[str, ...]:
    methods: dict[str, tuple[type, ast.FunctionDef | ast.AsyncFunctionDef]] = {}
    for base, method in _methods(cls):
        methods.setdefault(method.name, (base, method))  # the first in the MRO is the one that runs
    written: set[str] = set()
    todo, seen = ["forward"], set()
    while todo:
        name = todo.pop()
        if name in seen or name not in methods:
            continue
        seen.add(name)
        base, method = methods[name]
        module = sys.modules.get(base.__module__)
        if module is not None:
            written.update(f"{module.__name__}.{n}" for n in _written_in(method, vars(module)))
        todo += [node.func.attr for node in ast.walk(method) if isinstance(node, ast.Call)
                 and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name)
                 and node.func.value.id == "self"]
    return tuple(sorted(written))


def _written_in(function: ast.AST, module_vars: dict) -> set[str]:
    """The module-level names ``function`` rebinds (declared ``global``) or changes in place."""
    declared = {name for node in ast.walk(function) if isinstance(node, ast.Global) for name in node.names}
    local = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)
             and isinstance(node.ctx, ast.Store)} - declared
    local |= {node.arg for node in ast.walk(function) if isinstance(node, ast.arg)}

    def container(node: ast.AST) -> str | None:
        if isinstance(node, ast.Name) and node.id not in local and isinstance(module_vars.get(node.id), _CONTAINERS):
            return node.id
        return None

    written = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)
               and isinstance(node.ctx, (ast.Store, ast.Del)) and node.id in declared}
    for node in ast.walk(function):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, (ast.Store, ast.Del)):
            written.add(container(node.value) or "")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _MUTATORS:
            written.add(container(node.func.value) or "")
    return written - {""}


__all__ = ["globals_written"]
