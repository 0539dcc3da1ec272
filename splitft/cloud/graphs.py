"""What a session keeps between requests of one step: graphs awaiting their backward, and eager
calls' parameter gradients awaiting the scale the edge's backward saw.

Both are bounded by ``Limits.max_pending_calls`` (the oldest goes first) and counted against the
session's memory (:mod:`.budget`); an optimizer step frees them, since they were built on weights
the step changed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from ..wire.coding import Coded
from ..errors import ModelError, ProtocolError
from .budget import modified_message

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
    saved: list[tuple[torch.Tensor, int]] = field(default_factory=list)  # for backward, with their versions
    through_cache: bool = False  # run through a key/value cache holding an earlier call's graph

    def rebuild(self) -> None:
        """Build the graph again from the same inputs, on the half's current weights (a shared
        half stepped by another edge since); a graph that cannot be rebuilt stays as it is."""
        if self.rerun is not None:
            self.inputs, self.outputs = self.rerun()


class Graphs:
    """Forward calls' graphs by call number, and eager calls' deferred gradients, at most ``most`` each.

    What they hold is kept as a running total (each entry's bytes counted once, when it comes),
    since the session's memory is checked several times a request.
    """

    def __init__(self, most: int) -> None:
        self.most = most
        self.pending: OrderedDict[int, Pending] = OrderedDict()
        self.deferred: OrderedDict[int, Deferred] = OrderedDict()
        self._deferred_bytes: dict[int, int] = {}
        self.exclusive: set[int] = set()  # deferred calls whose gradients share no memory (see defer)
        self._nbytes = 0

    def keep(self, call: int, pending: Pending) -> list[int]:
        """Keep call ``call``'s graph; returns the calls whose graphs were dropped to stay in bound."""
        replaced = self.pending.get(call)  # one graph per call number: a second replaces the first
        if replaced is not None:
            self._nbytes -= replaced.nbytes
        self.pending[call] = pending
        self._nbytes += pending.nbytes
        dropped = []
        while len(self.pending) > self.most:
            number, gone = self.pending.popitem(last=False)
            self._nbytes -= gone.nbytes
            dropped.append(number)
        return dropped

    def take(self, call: int) -> Pending | None:
        """Call ``call``'s graph, no longer kept (None: there is none)."""
        pending = self.pending.pop(call, None)
        if pending is not None:
            self._nbytes -= pending.nbytes
        return pending

    def applicable(self, call: int, last: bool = False) -> tuple[Deferred, bool]:
        """Eager call ``call``'s gradients, to be applied: refused when there are none (freed by a
        step, never sent), or when a tensor its graph saved changed in place since its forward (a
        script's ``w.mul_()`` or a load in between), which torch's backward refuses too. ``last``:
        no second apply of the call can come (the edge's graph is gone), so they are no longer
        kept, and given away as they are where each holds memory of its own (the bool)."""
        grads = self.deferred.get(call)
        if grads is None:
            raise ProtocolError(f"no eager call {call} to apply (freed by an optimizer step, or never sent)")
        pending = self.pending.get(call)
        for tensor, version in pending.saved if pending is not None else ():
            if tensor._version != version:
                raise ModelError(f"the cloud part's backward failed: {modified_message(tensor, version)}")
        owned = last and call in self.exclusive
        if last:
            self.applied(call)
        return grads, owned

    def defer(self, call: int, grads: Deferred, nbytes: int, exclusive: bool = False) -> None:
        """Keep an eager call's parameter gradients (``nbytes`` of them) until the edge says how to
        scale them; ``exclusive``: each is a tensor of its own (see :func:`sole_owners`), which may
        become its parameter's ``grad`` as it is."""
        self._nbytes += nbytes - self._deferred_bytes.get(call, 0)  # a second for the same call replaces the first
        self.deferred[call] = grads
        if exclusive:
            self.exclusive.add(call)
        else:
            self.exclusive.discard(call)
        self._deferred_bytes[call] = nbytes
        while len(self.deferred) > self.most:
            self.applied(next(iter(self.deferred)))

    def applied(self, call: int) -> Deferred | None:
        """An eager call's gradients, no longer kept (None: there are none)."""
        grads = self.deferred.pop(call, None)
        self.exclusive.discard(call)
        if grads is not None:
            self._nbytes -= self._deferred_bytes.pop(call)
        return grads

    def after_step(self, shared: bool) -> None:
        """An optimizer step: an own half's graphs can no longer be backpropagated correctly (a
        shared half's are rebuilt when stale), and no eager call's gradients may be applied."""
        if not shared:
            self.pending.clear()
        self.deferred.clear()
        self.exclusive.clear()
        self._deferred_bytes.clear()
        self._nbytes = sum(p.nbytes for p in self.pending.values())

    def nbytes(self) -> int:
        return self._nbytes


def sole_owners(inputs: Sequence[torch.Tensor | None], grads: Deferred) -> bool:
    """Whether the gradients one ``torch.autograd.grad`` returned (``inputs``'s and the parameters'
    in ``grads``) each hold memory of their own, all of it, laid out as their parameter: none
    shares it with another (``a + b`` passes one gradient to both, ``torch.cat`` slices one), none
    is a view of more (``w.sum()``'s is ones expanded). Such a gradient may become its parameter's
    ``grad`` as it is, as torch's engine hands a fresh gradient over."""
    seen = set()
    for param, grad in [(None, g) for g in inputs] + list(grads):
        if grad is None:
            continue
        if grad.layout != torch.strided:
            raise ModelError(f"the cloud half's backward made a {grad.layout} gradient (an embedding with "
                             "sparse=True?): its gradients cross the cut and are stepped as dense tensors; build the "
                             "cloud half's layers with sparse=False")
        storage = grad.untyped_storage()
        if (storage.nbytes() != grad.numel() * grad.element_size()
                or storage.data_ptr() in seen or (param is not None and grad.stride() != param.stride())):
            return False
        seen.add(storage.data_ptr())
    return True


__all__ = ["Deferred", "Graphs", "Pending", "sole_owners"]
