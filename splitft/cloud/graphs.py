"""What a session keeps between requests of one step: graphs awaiting their backward, and eager
calls' parameter gradients awaiting the scale the edge's backward saw.

Both are bounded by ``Limits.max_pending_calls`` (the oldest goes first) and counted against the
session's memory (:mod:`.budget`); an optimizer step frees them, since they were built on weights
the step changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from ..wire.coding import Coded
from .budget import tensors_nbytes

#: An eager call's parameter gradients: (parameter, its gradient for an incoming gradient of 1).
Deferred = list[tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class Pending:
    """A forward call's graph, kept until its backward arrives."""

    inputs: list[torch.Tensor]
    in_coded: list[Coded]
    in_grad: list[bool]
    outputs: list[torch.Tensor]
    out_coded: list[Coded]
    sample_ids: np.ndarray | None
    # What it takes to build the graph again (shared model: another edge stepped in between).
    rerun: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
    version: int = 0
    nbytes: int = 0  # what the graph holds: its inputs, outputs and the tensors saved for backward
    flops: int = 0  # its forward's arithmetic (its backward costs twice that) and its decode's
    decode_flops: int = 0

    def rebuild(self) -> None:
        """Build the graph again from the same inputs, on the half's current weights (a shared
        half stepped by another edge since); a graph that cannot be rebuilt stays as it is."""
        if self.rerun is not None:
            self.inputs, self.outputs = self.rerun()


class Graphs:
    """Forward calls' graphs by call number, and eager calls' deferred gradients, at most ``most`` each."""

    def __init__(self, most: int) -> None:
        self.most = most
        self.pending: OrderedDict[int, Pending] = OrderedDict()
        self.deferred: OrderedDict[int, Deferred] = OrderedDict()

    def keep(self, call: int, pending: Pending) -> list[int]:
        """Keep call ``call``'s graph; returns the calls whose graphs were dropped to stay in bound."""
        self.pending[call] = pending
        dropped = []
        while len(self.pending) > self.most:
            dropped.append(self.pending.popitem(last=False)[0])
        return dropped

    def take(self, call: int) -> Pending | None:
        """Call ``call``'s graph, no longer kept (None: there is none)."""
        return self.pending.pop(call, None)

    def defer(self, call: int, grads: Deferred) -> None:
        """Keep an eager call's parameter gradients until the edge says how to scale them."""
        self.deferred[call] = grads
        while len(self.deferred) > self.most:
            self.deferred.popitem(last=False)

    def after_step(self, shared: bool) -> None:
        """An optimizer step: an own half's graphs can no longer be backpropagated correctly (a
        shared half's are rebuilt when stale), and no eager call's gradients may be applied."""
        if not shared:
            self.pending.clear()
        self.deferred.clear()

    def nbytes(self) -> int:
        pending = sum(p.nbytes for p in self.pending.values())
        return pending + sum(tensors_nbytes(g for _, g in d) for d in self.deferred.values())


__all__ = ["Deferred", "Graphs", "Pending"]
