"""The loss of a plain split, computed in the cloud: ``crit = model.remote_loss(criterion)``.

The model's forward stops at the cut and returns what would cross it; ``crit(out, target)``
sends that and the target, and the cloud runs its half and the loss.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


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


#: Calls the cloud half with ``(args, kwargs, target)``: the split model's call through the cut.
CloudCall = Callable[[tuple, dict, Any], Any]


class RemoteLoss:
    """``crit(out, target)`` for a plain split: the cloud runs its part and the loss."""

    def __init__(self, call: CloudCall, before: Callable[[], None] | None = None) -> None:
        self.call = call
        self.before = before  # sends the criterion again if it is not the cloud's as it is now

    def __call__(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        if self.before is not None:
            self.before()
        args, kwargs = call_parts(out)
        return self.call(args, kwargs, target)


__all__ = ["CloudCall", "CutActivation", "RemoteLoss", "call_parts"]
