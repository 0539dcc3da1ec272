"""A view of a cloud tensor's values taken on the edge (``p.grad.view(-1)``, ``p.grad.flatten()``,
``torch.cat([p.grad.view(-1) for p in params])`` for a global gradient norm or similarity,
``parameters_to_vector`` of the gradients, ``p.t()`` under ``torch.no_grad()``).

Unsplit, such a view shares the tensor's memory: it reads the values of the moment it is read, and
a write into it changes the gradient or weight. Split, it is a view of the values fetched now, so
it stands for the cloud's tensor as a state dict's entry does (:mod:`.fetched_state`): read while
the cloud half is as it was, refused (naming the fix) once the cloud half may have changed, and
refused when written.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .fetched_state import FetchedCloudState, StateSource
from .placeholders import CloudGrad, CloudTensor

_PLAIN = (bool, float, complex, str, type(None), torch.dtype, torch.device, torch.Size)


def read_only_views(func: Any, result: Any, read: list[tuple[torch.Tensor, torch.Tensor]],
                    now: Callable[[], Hashable]) -> Any:
    """``result`` (``func`` run on the fetched copies in ``read``: (cloud tensor, its copy) pairs)
    with a copy itself made its cloud tensor again, and each other tensor that shares a copy's
    memory a read-only view standing for that cloud tensor at the moment ``now()`` tells; None
    where it holds anything else of a copy's (an address, an object) or a copy of what is no
    gradient, weight or buffer."""
    spans = [(t, c.untyped_storage().data_ptr(), c.untyped_storage().nbytes()) for t, c in read]
    itself = {id(c): t for t, c in read}
    leaves, spec = tree_flatten(result)
    moment = now()
    out = []
    for item in leaves:
        if isinstance(item, torch.Tensor) and id(item) in itself:  # unsplit, the tensor itself (p.contiguous())
            item = itself[id(item)]
        elif isinstance(item, torch.Tensor):
            if item.layout != torch.strided or item.device.type != "cpu":
                return None
            at = item.untyped_storage().data_ptr()
            owner = next((t for t, start, size in spans if start <= at < start + size), None)
            if owner is not None:
                if not isinstance(owner, (CloudGrad, CloudTensor)):
                    return None
                item = FetchedCloudState(item, owner._splitft_name, now, moment, _source(func, owner))
        elif isinstance(item, int) and any(start <= item < start + size for _, start, size in spans):
            return None  # an address of a copy (data_ptr()): unsplit, the cloud tensor's
        elif not isinstance(item, (int, *_PLAIN)):
            return None
        out.append(item)
    return tree_unflatten(out, spec)


def _source(func: Any, owner: torch.Tensor) -> StateSource:
    called = getattr(func, "__name__", "a view")
    if isinstance(owner, CloudGrad):
        return StateSource(f"p.grad.{called}(...)", "the gradient",
                           "Change the gradient itself (p.grad.mul_(...), p.grad.zero_()), or view a copy of your own "
                           "(p.grad.clone().view(-1))")
    return StateSource(f"p.{called}(...)", "the cloud tensor",
                       "Write to the tensor itself (with torch.no_grad(): p.mul_(...)), or view a copy of your own "
                       "(p.detach().clone())")


__all__ = ["read_only_views"]
