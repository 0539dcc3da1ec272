"""How many times the script set torch's host generator: ``torch.set_rng_state`` (also as
``torch.random.set_rng_state``), ``torch.manual_seed``, and the exit of ``torch.random.fork_rng``,
which calls the first; and the checks a script's read of its state passes (``torch.get_rng_state``,
also as ``torch.random.get_rng_state`` and on entering ``fork_rng``). Names a script bound before
``split()`` (``from torch import get_rng_state``) and ``torch.default_generator``'s own methods
are not seen.

A plain split's cloud half runs at the remote loss, not at ``model(x)``; its dropout draws from
the generator state ``model(x)`` saw, and the edge's generator then goes on from where the half
left it, as the unsplit model's would. A generator found at that same state at the loss is either
untouched since ``model(x)`` or put back there (``with torch.random.fork_rng(): out = model(x)``),
and the two differ: put back, the unsplit model's generator stays where it was put. The state
alone cannot tell them apart; this count can, with the state each set found (the script drew
before it or not).
"""

from __future__ import annotations

import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ..generator_state import host_state

_count = 0
#: The state each of the last sets found, by the count it made (the script's draws before a set
#: show only there once the set replaced it).
_found: dict[int, torch.Tensor] = {}
_REMEMBERED = 16
_INSTALLING = threading.Lock()
#: The functions counted, where scripts and ``fork_rng`` look them up: in ``torch`` and in
#: ``torch.random`` (calls from torch.compile, which puts the generator back through the latter
#: around its tracing, are not the script's). splitft's own calls go to the generator itself
#: (``torch.default_generator``), which no script's read or set is mistaken for.
_SETTERS = (("torch", "set_rng_state"), ("torch", "manual_seed"), ("torch.random", "set_rng_state"))
_READERS = (("torch", "get_rng_state"), ("torch.random", "get_rng_state"))
_MODULES = {"torch": torch, "torch.random": torch.random}
#: Run before the script reads the generator's state: each split model's refusal of a read its
#: pending cloud forward would make wrong (see :meth:`.stray.StrayForwards.refuse_generator_read`).
_READ_CHECKS: list[weakref.WeakMethod] = []


def count() -> int:
    """How many times the host generator was set so far in this process (through torch's functions)."""
    return _count


def since(mark: int, start: torch.Tensor) -> str:
    """What became of the host generator since :func:`count` was ``mark`` and its state ``start``:
    ``"untouched"``; ``"set"``, nothing drawn before the first set (what follows it is the
    script's); or ``"drew"``: drawn from before any set, or set so often that this is not known."""
    if _count == mark:
        return "untouched" if _same_state(host_state(), start) else "drew"
    found = _found.get(mark + 1)
    return "set" if found is not None and _same_state(found, start) else "drew"


def _same_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two generator states (byte tensors) compared as bytes: ``torch.equal`` is a tensor operation
    of its own kind, which this check, once a step, would run cold."""
    return a.numpy().tobytes() == b.numpy().tobytes()


def _from_torch_compile() -> bool:
    """Whether what called the wrapped function (past the wrapper torch.compiler.disable puts
    around it) is torch.compile's own machinery."""
    frame: Any = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "torch._dynamo.eval_frame":
        frame = frame.f_back
    return frame is not None and str(frame.f_globals.get("__name__", "")).startswith("torch._dynamo")


def _counted(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def setter(*args: Any, **kwargs: Any) -> Any:
        global _count
        if _from_torch_compile():
            return original(*args, **kwargs)
        _count += 1
        _found[_count] = host_state()
        _found.pop(_count - _REMEMBERED, None)
        return original(*args, **kwargs)

    counted: Any = torch.compiler.disable(setter)  # run as it is inside compiled code, as torch's own is
    counted.__splitft_original__ = original
    return counted


def check_reads(check: Callable[[], None]) -> None:
    """Run ``check`` (a bound method, held weakly) before each read of the generator's state by
    ``torch.get_rng_state`` or ``torch.random.get_rng_state``. splitft's own reads ask
    ``torch.default_generator`` itself."""
    with _INSTALLING:
        _READ_CHECKS[:] = [ref for ref in _READ_CHECKS if ref() is not None] + [weakref.WeakMethod(check)]


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_rng_state() -> torch.Tensor:
        for ref in list(_READ_CHECKS) if not _from_torch_compile() else ():
            check = ref()
            if check is not None:
                check()
        return original()

    checked: Any = torch.compiler.disable(get_rng_state)
    checked.__splitft_original__ = original
    return checked


def install() -> None:
    """Count the setters of :data:`_SETTERS` and check the reads of :data:`_READERS`, once per process."""
    with _INSTALLING:
        for names, wrap in ((_SETTERS, _counted), (_READERS, _checked)):
            for module, name in names:
                current = getattr(_MODULES[module], name)
                if not hasattr(current, "__splitft_original__"):
                    setattr(_MODULES[module], name, wrap(current))


__all__ = ["check_reads", "count", "install"]
