"""The loss of a plain split, computed in the cloud: ``crit = model.remote_loss(criterion)``.

The model's forward stops at the cut and returns what would cross it; ``crit(out, target)``
sends that and the target, and the cloud runs its half and the loss.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .model import SplitModel


@dataclass
class CutActivation:
    """What reaches a plain cut when more than one value crosses (e.g. hidden states and a mask)."""

    args: tuple
    kwargs: dict


def call_parts(cut: Any) -> tuple[tuple, dict]:
    """The arguments of the cloud's call for what the model's forward returned at the cut."""
    if isinstance(cut, CutActivation):
        return cut.args, cut.kwargs
    return (cut,), {}


class RemoteLoss:
    """``crit(out, target)`` for a plain split: the cloud runs its part and the loss."""

    def __init__(self, split: SplitModel) -> None:
        self.split = split

    def __call__(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        args, kwargs = call_parts(out)
        return self.split._remote(args, kwargs, target)


__all__ = ["CutActivation", "RemoteLoss", "call_parts"]
