"""How many times the script set torch's host generator: ``torch.set_rng_state``,
``torch.manual_seed``, and the exit of ``torch.random.fork_rng``, which calls the first; and the
checks a script's read of its state passes (``torch.get_rng_state``, also on entering ``fork_rng``).

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
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch

_count = 0
#: The state each of the last sets found, by the count it made (the script's draws before a set
#: show only there once the set replaced it).
_found: dict[int, torch.Tensor] = {}
_REMEMBERED = 16
_INSTALLING = threading.Lock()
#: The functions counted, where scripts and ``fork_rng`` look them up. Not ``torch.random``'s
#: own names: torch.compile puts the generator back through those around its tracing.
_SETTERS = ("set_rng_state", "manual_seed")
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
        return "untouched" if _same_state(torch.random.get_rng_state(), start) else "drew"
    found = _found.get(mark + 1)
    return "set" if found is not None and _same_state(found, start) else "drew"


def _same_state(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two generator states (byte tensors) compared as bytes: ``torch.equal`` is a tensor operation
    of its own kind, which this check, once a step, would run cold."""
    return a.numpy().tobytes() == b.numpy().tobytes()


def _counted(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def setter(*args: Any, **kwargs: Any) -> Any:
        global _count
        _count += 1
        _found[_count] = torch.random.get_rng_state()
        _found.pop(_count - _REMEMBERED, None)
        return original(*args, **kwargs)

    counted: Any = torch.compiler.disable(setter)  # run as it is inside compiled code, as torch's own is
    counted.__splitft_original__ = original
    return counted


def check_reads(check: Callable[[], None]) -> None:
    """Run ``check`` (a bound method, held weakly) before each read of the generator's state by
    ``torch.get_rng_state``. splitft's own reads go through ``torch.random.get_rng_state``."""
    with _INSTALLING:
        _READ_CHECKS[:] = [ref for ref in _READ_CHECKS if ref() is not None] + [weakref.WeakMethod(check)]


def _checked(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def get_rng_state() -> torch.Tensor:
        for ref in list(_READ_CHECKS):
            check = ref()
            if check is not None:
                check()
        return original()

    checked: Any = torch.compiler.disable(get_rng_state)
    checked.__splitft_original__ = original
    return checked


def install() -> None:
    """Count the setters of :data:`_SETTERS` in the ``torch`` namespace and check the reads of
    ``torch.get_rng_state``, once per process."""
    with _INSTALLING:
        for name in _SETTERS:
            current = getattr(torch, name)
            if not hasattr(current, "__splitft_original__"):
                setattr(torch, name, _counted(current))
        if not hasattr(torch.get_rng_state, "__splitft_original__"):
            torch.get_rng_state = _checked(torch.get_rng_state)


__all__ = ["check_reads", "count", "install"]
