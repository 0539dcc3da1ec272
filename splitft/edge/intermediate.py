"""What a U-shape trunk's inner modules hand back to the edge's forward: nothing it may compute with.

The cloud runs a trunk of several modules as one chain and returns only the last one's output.
On the edge, the model's own forward still calls each trunk module in turn; the first call sends
the inputs and the calls after it pass the trunk's output along. What those calls return in the
middle of the trunk is therefore *not* the module's own output. A forward that reads it (an
auxiliary head on an inner layer, deep supervision, a skip connection around part of the trunk)
would silently compute on the wrong tensor, so it gets a :class:`TrunkIntermediate` instead: a
tensor that the next trunk module accepts and every operation refuses with a
:class:`~splitft.errors.CutError` naming the fix.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..wire import tree as trees
from ..errors import CutError
from .metadata import described

#: What may be asked of an inner output without reading it: it holds the trunk's final output's.
_HARMLESS = {getattr(torch.Tensor, name).__get__ for name in ("dtype", "device", "requires_grad", "layout",
                                                               "is_cuda", "is_cpu", "is_meta")}
_HARMLESS |= {torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.__hash__}


class TrunkIntermediate(torch.Tensor):
    """The output of ``module``, an inner module of a trunk that runs in the cloud, as the edge sees it."""

    _splitft_value: torch.Tensor
    _splitft_module: str
    _splitft_trunk: list[str]

    @staticmethod
    def __new__(cls, value: torch.Tensor, module: str, trunk: list[str]) -> TrunkIntermediate:
        made = torch.Tensor._make_wrapper_subclass(cls, value.shape, strides=value.stride(), dtype=value.dtype,
                                                   device=value.device)
        made._splitft_value = value
        made._splitft_module = module
        made._splitft_trunk = trunk
        return made

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's: unannotated
        return f"TrunkIntermediate(output of {self._splitft_module!r}, computed in the cloud and not sent back)"

    def refusal(self, what: str) -> str:
        trunk = self._splitft_trunk
        return (f"the model's forward (or a forward hook on {self._splitft_module!r}) {what} the output of "
                f"{self._splitft_module!r}, an inner module of the trunk {trunk[0]!r}..{trunk[-1]!r} that runs in the "
                f"cloud; only the trunk's last output comes back. Cut so that {self._splitft_module!r} ends the trunk "
                "(rejoin at the module after it), or move what reads it after the trunk (a hook: onto the trunk's "
                "last module)")

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in _HARMLESS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        inner = next(t for t in trees.leaves((args, kwargs or {})) if isinstance(t, TrunkIntermediate))
        if func is torch.Tensor.detach:  # torch.utils.checkpoint(layer, h, use_reentrant=True) detaches h
            raise CutError(f"the model's forward (or a forward hook on {inner._splitft_module!r}) detaches the output "
                           f"of {inner._splitft_module!r}, an inner module of a trunk that runs in the cloud (a hook "
                           "keeping it detached, or torch.utils.checkpoint(layer, h, use_reentrant=True) around a "
                           "trunk layer): a hook goes on the trunk's last module; checkpoint with "
                           "use_reentrant=False, or the whole model")
        raise CutError(inner.refusal(f"computes with ({described(func)})"))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's default is a plain function
            cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        inner = next(t for t in trees.leaves((args, kwargs or {})) if isinstance(t, TrunkIntermediate))
        raise CutError(inner.refusal(f"computes with ({func})"))


def hand_over(value: Any, module: str, trunk: list[str]) -> Any:
    """``value`` (the trunk's output) with each tensor made an inner output of ``module``."""
    return trees.rebuild(value, lambda t, path: TrunkIntermediate(t, module, trunk), other=lambda node, path: node)


__all__ = ["TrunkIntermediate", "hand_over"]
