"""The cloud's memory book: what each session holds, checked before more is taken.

A session's holdings are its copy of the cloud half (weights, gradients, optimizer state), its
codecs' buffers and caches, the graphs of forward calls awaiting their backward (measured exactly:
every tensor autograd saves passes through :class:`GraphMeter`), deferred eager gradients and the
replies it keeps for repeats. A request is refused with ``capacity`` when what it would add —
its decoded tensors, bounded before decoding by each codec's ``decode_cost`` — does not fit the
session's budget or the cloud's total; the session and every other one keep serving.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from .errors import CapacityError
from .limits import Limits, mib

#: Adam keeps two moments per parameter, and a gradient: weights x 4 bounds the usual optimizers.
MODEL_STATE_FACTOR = 4


def tensors_nbytes(tensors: Iterable[torch.Tensor | None]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def model_nbytes(module: nn.Module) -> int:
    """What a trained copy of ``module`` holds: weights, gradients and optimizer state, bounded."""
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    buffers = sum(b.numel() * b.element_size() for b in module.buffers())
    return MODEL_STATE_FACTOR * params + buffers


def nested_nbytes(frames: Iterable[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class GraphMeter:
    """Counts the bytes autograd saves for backward inside a ``with`` block.

    Parameters are not counted (they are held anyway); each storage is counted once.
    """

    def __init__(self, module: nn.Module) -> None:
        self._held = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self._seen: set[int] = set()
        self.nbytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        try:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._held and ptr not in self._seen:
                self._seen.add(ptr)
                self.nbytes += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            self.nbytes += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self) -> "GraphMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def expanded_nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shape) * itemsize


class MemoryBook:
    """Held bytes per session, against the per-session budget and the cloud's total."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.held: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def check(self, session: str, now: int, extra: int, what: str) -> None:
        """Raise :class:`CapacityError` unless ``extra`` more bytes fit beside ``now`` held."""
        if now + extra > self.limits.session_memory_bytes:
            raise CapacityError(
                f"{what} needs {mib(extra)} more; this session holds {mib(now)} and may hold "
                f"{mib(self.limits.session_memory_bytes)} (--session-memory-mb). Send smaller batches, "
                "backpropagate or drop pending forward calls, or use a smaller model")
        others = self.total - self.held.get(session, 0)
        if others + now + extra > self.limits.memory_bytes:
            raise CapacityError(
                f"{what} needs {mib(extra)} more, but this cloud's sessions already hold {mib(others + now)} "
                f"of {mib(self.limits.memory_bytes)} (--memory-mb); try again later")

    def set(self, session: str, nbytes: int) -> None:
        self.held[session] = int(nbytes)

    def drop(self, session: str) -> None:
        self.held.pop(session, None)


__all__ = ["GraphMeter", "MemoryBook", "model_nbytes", "tensors_nbytes"]
