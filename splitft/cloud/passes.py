"""One backward pass of the edge, summed before it reaches the cloud half's gradients.

Torch's engine sums what one backward pass brings a parameter from several places (a loss over
two forward calls, two views of a batch) and adds that sum to ``p.grad`` once. The cloud half gets
such a pass as several contributions, one per forward call (an eager call's ``apply``, a call's
``backward``); added to ``p.grad`` one by one they round differently once ``p.grad`` holds
gradients already (``(g + a) + b`` against ``g + (a + b)``), and split training would drift from
the unsplit model by an ulp a step. So the contributions of one pass (the edge names it) are
summed here in the order they came, which is the order the edge's engine reached them, and added
to ``p.grad`` before anything else the session does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .budget import tensors_nbytes


class PassGrads:
    """The open pass's gradients by parameter, not yet added to the parameters' ``grad``."""

    def __init__(self) -> None:
        self.current: int | None = None
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(parameter) -> (parameter, sum)

    def is_open(self, pass_id: int | None) -> bool:
        """Whether ``pass_id`` names the pass being summed (more of it may come)."""
        return pass_id is not None and pass_id == self.current

    def add(self, pass_id: int | None, grads: Sequence[tuple[torch.Tensor, torch.Tensor | None]],
            scale: float = 1.0, owned: bool = False) -> None:
        """Add one contribution (each parameter's gradient, times ``scale``) to pass ``pass_id``;
        a contribution of another pass (or of none) closes the open one first, and one of no pass
        is added at once. ``owned``: the gradients are fresh tensors nothing else holds (kept as
        they are when the scale is 1)."""
        if not self.is_open(pass_id):
            self.flush()
            self.current = pass_id
        for param, grad in grads:
            if grad is None:
                continue
            entry = self._sums.get(id(param))
            if entry is None:
                own = grad if owned and scale == 1.0 else grad * scale  # a tensor nothing else holds
                self._sums[id(param)] = (param, own)
            else:
                entry[1].add_(grad, alpha=scale)
        if pass_id is None:
            self.flush()

    def flush(self) -> None:
        """Add the open pass's sums to the parameters' gradients, as the engine does at a pass's end."""
        if not self._sums:  # most flushes (one before each operation of a step) find none: no grad mode switched
            self.current = None
            return
        with torch.no_grad():
            for param, total in self._sums.values():
                if param.grad is None:
                    param.grad = total
                else:
                    param.grad.add_(total)
        self._sums.clear()
        self.current = None

    def holds(self, param: torch.Tensor) -> bool:
        """Whether the open pass brought ``param`` a gradient (not in its ``grad`` yet)."""
        return id(param) in self._sums

    def nbytes(self) -> int:
        return tensors_nbytes(total for _, total in self._sums.values()) if self._sums else 0


__all__ = ["PassGrads"]
