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
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import CapacityError
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


@dataclass(frozen=True)
class Holdings:
    """What one rank keeps of a half it may hold only a shard of (``--split-batch --shard``)."""

    held: int  # parameter values on this rank
    total: int  # parameter values of the whole half
    param_bytes: int
    optimizer_bytes: int

    def describe(self) -> str:
        return (f"holds {self.held:,} of the half's {self.total:,} parameter values "
                f"({self.param_bytes / 2**20:.2f} MiB) and {self.optimizer_bytes / 2**20:.2f} MiB of optimizer state")


def holdings(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> Holdings:
    """Parameters and optimizer state this process holds: a sharded tensor counts its local shard only."""
    params = list(module.parameters())
    local = [_local(p) for p in params]
    state = [_local(v) for entry in (optimizer.state.values() if optimizer is not None else ())
             for v in entry.values() if isinstance(v, torch.Tensor)]
    return Holdings(sum(t.numel() for t in local), sum(p.numel() for p in params), tensors_nbytes(local),
                    tensors_nbytes(state))


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (a plain tensor as it is)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def nested_nbytes(frames: Iterable[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


class GraphMeter:
    """Counts the bytes autograd saves for backward inside a ``with`` block.

    Parameters are not counted (they are held anyway; a sharded half's gathered ones are freed
    after its forward); each storage is counted once.
    """

    def __init__(self, module: nn.Module, held: frozenset[int] | None = None) -> None:
        self._held = parameter_storages(module) if held is None else held
        self._seen: set[int] = set()
        self.nbytes = 0
        #: What the graph saved, each with its version then: changed in place before the graph is
        #: done with (a script's ``w.mul_()``, a load), it makes the graph's gradients wrong.
        self.saved: list[tuple[torch.Tensor, int]] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)

    def _pack(self, tensor: torch.Tensor) -> tuple[torch.Tensor, int]:
        # With hooks, torch no longer checks that a saved tensor was not changed in place before
        # its backward; the version saved beside it lets the unpack check it as torch would.
        cls = tensor.__class__  # a plain tensor (most of what is saved) skips Parameter's Python instance check
        if cls is nn.Parameter or (cls is not torch.Tensor and isinstance(tensor, nn.Parameter)):
            packed = tensor, tensor._version
            self.saved.append(packed)
            return packed
        try:
            storage = tensor.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in self._held and ptr not in self._seen:
                self._seen.add(ptr)
                self.nbytes += storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, nested)
            self.nbytes += tensor.numel() * tensor.element_size()
        # Not the tensor itself: a node's saved output would hold its own node (output -> grad_fn
        # -> saved output), a cycle through C++ that no collector sees, so a graph never
        # backpropagated (or kept with retain_graph) would never be freed. The values are all the
        # backward reads (and the version counter, which a detached tensor shares).
        packed = tensor.detach(), tensor._version
        self.saved.append(packed)
        return packed

    def __enter__(self) -> "GraphMeter":
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)
        del self._hooks  # it holds this meter's bound method: a cycle that would keep what was saved


def parameter_storages(module: nn.Module) -> frozenset[int]:
    """Where ``module``'s parameters keep their values (a sharded one's local shard): what a
    :class:`GraphMeter` does not count, and may be given once for many forwards."""
    return frozenset(_local(p).untyped_storage().data_ptr() for p in module.parameters())


def _unpack(packed: tuple[torch.Tensor, int]) -> torch.Tensor:
    tensor, version = packed
    if tensor._version != version:
        raise RuntimeError(modified_message(tensor, version))
    return tensor


def modified_message(tensor: torch.Tensor, version: int) -> str:
    """Torch's own complaint about a saved tensor changed in place before its backward."""
    return (f"one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{tensor.dtype} {list(tensor.shape)}] is at version {tensor._version}; expected version {version} "
            "instead (a cloud weight changed between its forward and its backward, which torch refuses too, but "
            "for a write through p.data: unsplit, torch does not see that one, and its backward reads the changed "
            "weight, which the cloud's backward cannot repeat. Change the weights after loss.backward())")


def expanded_nbytes(shape: tuple[int, ...], itemsize: int) -> int:
    return math.prod(shape) * itemsize


class MemoryBook:
    """Held bytes per session, against the per-session budget and the cloud's total.

    ``reclaim(session, origin, wanted, over)`` is asked to free ``over`` bytes of other sessions
    before a request that does not fit the total is refused (the server evicts idle sessions and
    those of origins holding more than the asker; :mod:`splitft.cloud.admission`). Refusals say what
    the asking session may hold, never how much the cloud has left: that would tell a hostile edge
    exactly how much to ask for to leave nothing to anyone else.
    """

    def __init__(self, limits: Limits, reclaim: Callable[[str, str | None, int, int], None] | None = None) -> None:
        self.limits = limits
        self.held: dict[str, int] = {}
        self.reclaim = reclaim

    @property
    def total(self) -> int:
        return sum(self.held.values())

    def check(self, session: str, now: int, extra: int, what: str, origin: str | None = None) -> None:
        """Raise :class:`CapacityError` unless ``extra`` more bytes fit beside ``now`` held.

        ``origin`` names who asks when ``session`` is not booked yet (a model being admitted);
        without either, nothing is evicted to make room.
        """
        if now + extra > self.limits.session_memory_bytes:
            raise CapacityError(
                f"{what} needs {mib(extra)} more; this session holds {mib(now)} and may hold "
                f"{mib(self.limits.session_memory_bytes)} (--session-memory-mb). Send smaller batches, "
                "backpropagate or drop pending forward calls, or use a smaller model")
        over = self._over(session, now + extra)
        if over > 0 and self.reclaim is not None:
            self.reclaim(session, origin, now + extra, over)
            over = self._over(session, now + extra)
        if over > 0:
            raise CapacityError(
                f"{what} needs {mib(extra)} more, and this cloud has no room for it now: its memory is held by "
                f"sessions that are training. This session holds {mib(now)} and may hold "
                f"{mib(self.limits.session_memory_bytes)}; try again later, or ask for less")

    def _over(self, session: str, wanted: int) -> int:
        """Bytes beyond the total if ``session`` held ``wanted``."""
        return self.total - self.held.get(session, 0) + wanted - self.limits.memory_bytes

    def set(self, session: str, nbytes: int) -> None:
        self.held[session] = int(nbytes)

    def drop(self, session: str) -> None:
        self.held.pop(session, None)


__all__ = ["GraphMeter", "Holdings", "MemoryBook", "holdings", "model_nbytes", "modified_message",
           "parameter_storages", "tensors_nbytes"]
