"""What a cloud module's ghost does with a move or a cast of its tensors (``.to()``, ``.half()``).

The cloud's module stays where and what the factory built: a move is the cloud's business and
leaves the ghost alone; a cast to another dtype or memory format, which unsplit would change what
the module computes, is refused before anything is cast.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
from torch import nn

from ..errors import CutError


def casts_refused(module: nn.Module, where: str) -> Callable[..., nn.Module]:
    """A cloud module's ``_apply`` (``.to()``, ``.half()``, ``.apply`` of a cast): a move leaves it
    alone (where the cloud half runs is the cloud's business); a cast to another dtype or memory
    format raises before anything is cast: the cloud's module would go on as it was built."""

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        tensors = list(itertools.chain(module.parameters(), module.buffers()))
        for dtype in {t.dtype for t in tensors}:
            if fn(torch.empty(0, dtype=dtype)).dtype != dtype:
                raise CutError(f"casting the model to another dtype would cast {where!r}, which runs in the cloud "
                               "and does not follow; cast the model before split()")
        for dim in {t.dim() for t in tensors} & {4, 5}:  # the ranks .to(memory_format=) converts
            if not fn(torch.empty((1, 2, 3, 4, 5)[:dim])).is_contiguous():
                raise CutError(f"converting {where!r} to another memory format (channels_last): it runs in the cloud, "
                               "whose module keeps the layout it was built with, so its convolutions would compute "
                               "a few bits apart from the unsplit model's. Convert it in the factory too (the cloud "
                               "builds the model with it) before split(), or convert edge modules only")
        return module

    return apply


__all__ = ["casts_refused"]
