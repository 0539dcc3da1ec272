"""The code a cloud half runs, as this process has it: the methods of its modules' classes and the
module functions those methods call (``F.relu``), each known by where it was defined.

The cloud imports the same classes in its own process. A script that replaced one in this process
(``nn.ReLU.forward = ...``, ``LlamaAttention.forward = flash_forward``, ``F.gelu = my_gelu``)
would have the unsplit model compute one way and the cloud's layers another, silently. The
handshake compares :func:`identities` (part of the structure hash); after the cut, :class:`CodeGuard`
refuses a forward once one of them was replaced in this process.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import inspect
import operator
import random
import sys
import textwrap
import types
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from .errors import ConfigError

#: Attributes a module's own machinery sets as it runs, which leave the values it computes alone:
#: how a layer is checkpointed (``gradient_checkpointing_enable()``).
RUNTIME_ATTRIBUTES = frozenset({"_gradient_checkpointing_func"})
#: Class attributes that are code: what a replacement of a method puts in a class's dict.
_CODE = (types.FunctionType, types.BuiltinFunctionType, staticmethod, classmethod, property, type)


def _bases(cls: type) -> tuple[type, ...]:
    """``cls`` and its bases whose methods are the model's code (``nn.Module`` and ``object`` aside)."""
    return tuple(base for base in cls.__mro__ if base not in (object, nn.Module))


def _name(value: Any, home: str | None = None) -> str:
    """Where ``value`` was defined: ``module.qualified.name``, or the qualified name alone when
    it was defined in ``home`` (a method in its class's module, which a script run as ``__main__``
    knows under another name than the cloud's import)."""
    value = getattr(value, "__func__", None) or getattr(value, "fget", None) or value
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", type(value).__qualname__)
    return qualname if module == home else f"{module}.{qualname}"


def _methods(cls: type) -> dict[str, str]:
    """Where each code attribute ``cls`` resolves was defined, by name (the first of its bases
    that has each)."""
    found: dict[str, str] = {}
    for base in _bases(cls):
        for name, value in vars(base).items():
            if isinstance(value, _CODE) and name not in found and not name.startswith("__"):
                found[name] = _name(value, base.__module__)
    return found


@functools.cache
def _module_attributes(code: Any) -> tuple[tuple[str, str, str], ...]:
    """``(module, name, attribute)`` of each ``name.attribute`` the source of ``code`` (a class's
    methods, or a function) reads, where ``name`` is a module its code imported (``F.relu``:
    ``torch.nn.functional``, ``F``, ``relu``), and of each function or class of its own module it
    calls by name (``name`` empty)."""
    module = sys.modules.get(getattr(code, "__module__", None) or "")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return ()  # no source at hand (a class built at run time, a compiled one)
    if module is None:
        return ()
    found = set()
    names = vars(module)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and isinstance(node.ctx, ast.Load)
                and isinstance(names.get(node.value.id), types.ModuleType)):
            found.add((names[node.value.id].__name__, node.value.id, node.attr))
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and isinstance(names.get(node.id), _CODE):
            found.add((module.__name__, "", node.id))  # a function of its own module (apply_rotary_pos_emb)
    return tuple(sorted(found))


#: How far calls are followed from a class's methods: the module functions they call (``F.relu``),
#: and those that these call (``torch.relu``, which ``F.relu`` runs: a patch of it changes the layer too).
_DEPTH = 2


def _called(cls: type) -> list[tuple[types.ModuleType, str, str, Any]]:
    """The module functions (and classes) the methods of ``cls`` and its bases call, and those the
    functions among them call in turn, as they are now: ``(module, name.attribute as the code writes
    it, attribute, value)``."""
    found: list[tuple[types.ModuleType, str, str, Any]] = []
    seen: set[tuple[int, str]] = set()
    readers: list[tuple[Any, int]] = [(base, 1) for base in _bases(cls)]
    while readers:
        code, depth = readers.pop(0)
        for module_name, alias, attribute in _module_attributes(code):
            module = sys.modules.get(module_name)
            try:  # read as the code reads it: a lazy module (transformers') imports what it names now
                value = getattr(module, attribute) if module is not None else None
            except Exception:  # noqa: BLE001 - a name the module does not have (yet): nothing to compare
                continue
            if module is None or not isinstance(value, _CODE) or vars(module).get(attribute) is not value \
                    or (id(module), attribute) in seen:
                continue
            seen.add((id(module), attribute))
            found.append((module, f"{alias}.{attribute}" if alias else attribute, attribute, value))
            if depth < _DEPTH and isinstance(value, types.FunctionType):
                readers.append((value, depth + 1))
    return found


def other_generators(cls: type) -> str | None:
    """Where the methods of ``cls`` (``__init__`` aside), or the module functions they call, draw
    from Python's ``random`` or NumPy's global generator (a stochastic depth written with
    ``random.random()``): the cloud's process has its own of those, which the edge's do not steer,
    where torch's host generator the split carries across. The first such use, or None."""
    if cls not in _OTHER_GENERATORS:
        _OTHER_GENERATORS[cls] = _other_generators(cls)
    return _OTHER_GENERATORS[cls]


_OTHER_GENERATORS: dict[type, str | None] = {}
#: Generators whose methods a module may import by name (``from numpy.random import normal``: a
#: method of NumPy's global generator), drawing from the process's own stream.
_PROCESS_GENERATORS = (random.Random, np.random.RandomState)
#: Generators a module may hold and draw from (``self.gen = torch.Generator()``, ``random.Random(0)``,
#: ``np.random.default_rng(0)``): a cloud module's draws from the cloud's copy.
GENERATORS = (torch.Generator, random.Random, np.random.RandomState, np.random.Generator)


def _other_generators(cls: type) -> str | None:
    readers: list[tuple[Any, int]] = [(value, 1) for base in _bases(cls) for name, value in vars(base).items()
                                      if isinstance(value, types.FunctionType) and name != "__init__"]
    seen: set[int] = set()
    while readers:
        code, depth = readers.pop(0)
        drawing = _generator_methods_named(code)
        if drawing is not None:
            return drawing
        for module_name, alias, attribute in _module_attributes(code):
            if module_name == "random" or module_name.startswith("numpy.random") or (
                    module_name == "numpy" and attribute == "random"):
                return f"{alias or module_name}.{attribute}"
            value = getattr(sys.modules.get(module_name), attribute, None)
            if module_name.startswith("random") or getattr(value, "__module__", None) == "random" \
                    or isinstance(getattr(value, "__self__", None), _PROCESS_GENERATORS):
                return f"{alias}.{attribute}" if alias else attribute
            if depth < _DEPTH and isinstance(value, types.FunctionType) and id(value) not in seen:
                seen.add(id(value))
                readers.append((value, depth + 1))
    return None


def _generator_methods_named(code: Any) -> str | None:
    """A name ``code`` calls that its module bound to a method of a process generator
    (``from numpy.random import normal``), or None."""
    module = sys.modules.get(getattr(code, "__module__", None) or "")
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(code)))
    except (OSError, TypeError, SyntaxError):
        return None
    names = vars(module) if module is not None else {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and isinstance(
                getattr(names.get(node.id), "__self__", None), _PROCESS_GENERATORS):
            return node.id
    return None


def _submodules(modules: list[tuple[str, nn.Module]]) -> dict[str, nn.Module]:
    return {f"{name}.{key}" if key else name: sub for name, module in modules for key, sub in module.named_modules()}


def _classes(modules: list[tuple[str, nn.Module]]) -> dict[str, type]:
    return {where: type(sub) for where, sub in _submodules(modules).items()}


def _instance_code(module: nn.Module) -> list[str]:
    """Code set on the module itself (``layer.forward = f``), which its class does not show."""
    found = []
    for name, value in vars(module).items():
        if name not in RUNTIME_ATTRIBUTES and isinstance(value, (types.FunctionType, types.MethodType, functools.partial)):
            found.append(f"self.{name}={_name(getattr(value, 'func', value))}")
    return sorted(found)


def identities(modules: list[tuple[str, nn.Module]]) -> dict[str, str]:
    """A digest, by module, of where the code it runs was defined: its class's methods, the module
    functions they call and code set on the module itself (what the structure hash compares)."""
    found = {}
    for where, sub in _submodules(modules).items():
        cls = type(sub)
        parts = sorted(f"{name}={defined}" for name, defined in _methods(cls).items())
        parts += sorted(f"{written}={_name(value, module.__name__)}" for module, written, _, value in _called(cls))
        parts += _instance_code(sub)
        found[where] = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    return found


class CodeGuard:
    """Refuses a forward once a method of a cloud module's class, or a module function those
    methods call, was replaced in this process after the cut (a few dict lookups a call)."""

    def __init__(self, modules: list[tuple[str, nn.Module]]) -> None:
        self._watched: list[tuple[Mapping[str, Any], str, Any, str]] = []
        seen: set[tuple[int, str]] = set()
        for where, cls in _classes(modules).items():
            for base in _bases(cls):
                for name, value in vars(base).items():
                    if isinstance(value, _CODE) and not name.startswith("__") and (id(base), name) not in seen:
                        seen.add((id(base), name))
                        self._watched.append((base.__dict__, name, value, f"{base.__qualname__}.{name}"))
            for module, _, attribute, value in _called(cls):
                if (id(module), attribute) not in seen:
                    seen.add((id(module), attribute))
                    self._watched.append((module.__dict__, attribute, value, f"{module.__name__}.{attribute}"))
        self._sizes: list[tuple[Mapping[str, Any], int, str]] = [(base.__dict__, len(base.__dict__), base.__qualname__)
                       for base in {b for cls in _classes(modules).values() for b in _bases(cls)}]

        # the same, as columns compared in one go: the check runs before each forward of the cloud half
        self._namespaces = [namespace for namespace, _, _, _ in self._watched]
        self._names = [name for _, name, _, _ in self._watched]
        self._values = [value for _, _, value, _ in self._watched]

    def check(self) -> None:
        try:
            if (list(map(operator.getitem, self._namespaces, self._names)) == self._values
                    and all(len(namespace) == size for namespace, size, _ in self._sizes)):
                return  # == on code objects is identity: nothing was replaced
        except KeyError:
            pass  # one was deleted: named below
        for namespace, name, value, shown in self._watched:
            if namespace.get(name) is not value:
                raise ConfigError(f"{shown} was replaced after split() (a patch of the code a cloud module runs): "
                                  "the cloud's process runs the code it imported, so training would silently differ "
                                  "from the unsplit model. Patch it where the cloud imports it too (in the factory's "
                                  "module, before the model is built), before split(), or put it back")
        for i, (namespace, size, shown) in enumerate(self._sizes):
            if len(namespace) != size:  # a method added to a class, over one of its bases'
                added = [name for name, value in namespace.items() if isinstance(value, _CODE)
                         and not any(n is namespace and k == name for n, k, _, _ in self._watched)]
                if added:
                    raise ConfigError(f"{shown}.{added[0]} was added after split(), over the code a cloud module "
                                      "runs: the cloud's process runs the code it imported, so training would "
                                      "silently differ from the unsplit model. Patch it where the cloud imports it too "
                                      "(in the factory's module), before split(), or remove it")
                self._sizes[i] = (namespace, len(namespace), shown)  # something else was set on the class


__all__ = ["GENERATORS", "RUNTIME_ATTRIBUTES", "CodeGuard", "identities"]
