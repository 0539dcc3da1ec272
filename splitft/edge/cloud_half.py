"""The edge's handle on the cloud half's tensors: which gradients exist there, and the operations
that reach them.

The placeholders (:mod:`.placeholders`) ask this room for everything they cannot answer from
their shape: ``p.grad`` (the cloud has a gradient for ``p`` exactly when this room says so), its
norm (fetched in one round trip for every cloud gradient, then kept until a gradient changes),
and the changes a script makes (clearing, scaling, clamping gradients; new values for a weight),
which ride as operations on the next message in the order the script made them.

Which gradients exist is known without asking: a backward through the cut gives one to every
cloud parameter that required a gradient at the forward, except those the cloud reported its
graph did not reach (``unreached`` in the reply); clearing ``p.grad`` removes it. While a
mirrored optimizer steps, the cloud's gradients are hidden, so the edge's optimizer leaves the
cloud's parameters to the cloud's step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from compressors import host_tensor

from ..cut import Chain
from ..errors import PlaceholderError
from ..wire.expressions import dtype_of
from ..wire.operations import ClampGrads, Compute, LoadWeights, Operation, ScaleGrads, ZeroGrad
from . import cloud_values
from .placeholders import CloudGrad, CloudTensor, remote_of

log = logging.getLogger(__name__)


class CloudHalf:
    """The cloud half's tensors as the edge tracks them.

    Args:
        queue: puts an operation on the next message (:meth:`.outbox.Outbox.queue`).
        fetch_norms: asks the cloud for the ``norm_type`` norm of each of its parameters'
            gradients, in :attr:`order`; None where it has none (one round trip).
        fetch_values: asks the cloud for the values of expressions over its tensors
            (:mod:`.cloud_values`), as ``[array, dtype name]`` each (one round trip).
        version: a count that moves whenever the cloud half's tensors may have changed (an
            operation queued, a forward sent).
    """

    def __init__(self, queue: Callable[[Operation], None],
                 fetch_norms: Callable[[float], list[float | None]],
                 fetch_values: Callable[[list], list] | None = None,
                 version: Callable[[], int] = lambda: 0) -> None:
        self._queue = queue
        self._fetch_norms = fetch_norms
        self._fetch_values = fetch_values
        self.version = version
        self.order: list[str] = []  # the cloud half's parameter names, in the order the cloud answers norms
        self.params: dict[str, CloudTensor] = {}  # name in the unsplit model -> placeholder
        self.names_by_id: dict[int, str] = {}  # id of a placeholder -> its name
        self.has_grad: set[str] = set()
        self.unreached: frozenset[str] = frozenset()  # trainable, but the last reported graph gave no gradient
        #: Each gradient's handle, and the device it was made on: moving the model makes new ones, as torch's does.
        self._grads: dict[str, tuple[CloudGrad, torch.device]] = {}
        self._norms: dict[float, dict[str, torch.Tensor]] = {}
        self.hidden = False  # a mirrored optimizer is stepping: the cloud steps its own parameters
        self.device = torch.device("cpu")  # where the edge's tensors (and so the gradients' handles) are

    def bind(self, model: nn.Module, chain: Chain) -> None:
        """Find the placeholders of the cloud half's parameters the cut installed in ``model``
        (named as in the unsplit model); ``chain`` holds the cloud's modules."""
        for name in chain.names:
            for key, param in model.get_submodule(name).named_parameters():
                if id(param) not in self.names_by_id:
                    self.params[f"{name}.{key}"] = param  # type: ignore[assignment]  # a CloudTensor
                    self.names_by_id[id(param)] = f"{name}.{key}"
        self.order = list(chain.qualified_parameters())

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is a placeholder of this cloud half's."""
        return remote_of(tensor) is self

    # ------------------------------------------------------------ gradients

    def grad_of(self, name: str) -> CloudGrad | None:
        if self.hidden or name not in self.has_grad:
            return None
        made = self._grads.get(name)
        if made is None or made[1] != self.device:
            made = self._grads[name] = (CloudGrad(self.params[name], name, self), self.device)
        return made[0]

    def clear_grad(self, name: str) -> None:
        """``p.grad = None``: the cloud clears it too (``zero_grad()``, by the optimizer or the model)."""
        if name in self.has_grad:
            self.has_grad.discard(name)  # its handle is kept (it holds no values): the next p.grad returns it again
            self._changed()
            self._queue(ZeroGrad(set_to_none=True, names=[name]))

    def assign_grad(self, name: str, value: Any) -> None:
        """``p.grad = g``: the cloud's gradient of ``name`` takes ``g``'s values (an edge tensor, or
        one computed from the cloud half's: PCGrad's projection, a zero gradient filled in for a
        parameter the backward did not reach), checked first as torch checks the assignment."""
        param = self.params[name]
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"assigned grad expected to be a Tensor or None but got grad of {type(value).__name__}")
        if value.shape != param.shape:
            raise RuntimeError(f"attempting to assign a gradient of size '{list(value.shape)}' to a tensor of size "
                               f"'{list(param.shape)}' (cloud parameter {name!r}). Please ensure that the gradient and "
                               "the tensor are the same size")
        if value.dtype != param.dtype:
            raise RuntimeError(f"attempting to assign a gradient with dtype '{value.dtype}' to a tensor with dtype "
                               f"'{param.dtype}' (cloud parameter {name!r}). Please ensure that the gradient and the "
                               "tensor have the same dtype")
        op = cloud_values.grad_assignment(name, value, self)
        self.has_grad.add(name)
        self._changed()
        self._queue(op)

    def backward_reached(self, trainable: Iterable[str], unreached: Iterable[str] | None) -> None:
        """A backward reached the cut: the cloud's parameters that required a gradient at the
        forward and still do (torch asks at the backward) have one now, but those the cloud said
        its graph did not reach."""
        if unreached is not None:
            self.unreached = frozenset(unreached)
        with torch._C.DisableTorchFunctionSubclass():  # a flag read on each placeholder
            self.has_grad.update(n for n in trainable if n not in self.unreached and self.params[n].requires_grad)
        self._changed()

    def grad_norms(self, names: list[str], norm_type: float) -> list[torch.Tensor]:
        """The ``norm_type`` norm of each named gradient, as the cloud computed it (bitwise)."""
        norms = self._norms.get(norm_type)
        if norms is None or any(n not in norms for n in names):
            fetched = self._fetch_norms(norm_type)
            norms = self._norms[norm_type] = {}
            for name, norm in zip(self.order, fetched):
                if norm is not None:
                    norms[name] = torch.tensor(norm, dtype=self.params[name].dtype, device=self.device)
            missing = [n for n in names if n not in norms]
            if missing:
                raise PlaceholderError(f"the cloud has no gradient for {missing[:3]}, which the edge expected after "
                                       "the last backward; the session's record of gradients is out of step")
        return [norms[n] for n in names]

    def change_grads(self, names: list[str], kind: str, value: Any) -> None:
        """In-place changes of cloud gradients (``mul_``, ``div_``, ``clamp_``..., ``zero_``), in the cloud."""
        self._changed()
        if kind in ("mul", "div"):
            self._queue(ScaleGrads(factor=float(value), names=list(names), divide=kind == "div"))
        elif kind == "zero":
            self._queue(ZeroGrad(set_to_none=False, names=list(names)))
        else:
            low, high = value
            self._queue(ClampGrads(low=low, high=high, names=list(names)))

    def computed(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A torch call on this half's placeholders that the cloud can compute (:mod:`.cloud_values`);
        NotImplemented where it cannot, and the placeholder refuses it."""
        return cloud_values.handle(func, args, kwargs)

    def compute(self, op: Compute) -> None:
        """An in-place call on a cloud gradient or weight (:mod:`.cloud_values`), in the cloud."""
        self._changed()
        self._queue(op)

    def evaluate(self, nodes: list[dict]) -> list[torch.Tensor]:
        """The values of expressions over the cloud half's tensors, as the cloud computed them."""
        if self._fetch_values is None:
            raise PlaceholderError("this split model computes nothing from its cloud half's tensors")
        fetched = self._fetch_values(nodes)
        if len(fetched) != len(nodes):
            raise PlaceholderError(f"the cloud answered {len(fetched)} values for {len(nodes)} expressions")
        return [_value(array, dtype) for array, dtype in fetched]

    def _changed(self) -> None:
        self._norms.clear()

    # ------------------------------------------------------------ values

    def push_values(self, name: str, value: torch.Tensor) -> None:
        """New values for a cloud parameter or buffer (``copy_``, ``zero_``, ``fill_``, a draw on its placeholder)."""
        self._queue(LoadWeights(weights={name: values_to_send(value).copy()}, partial=True))  # the script may change value first


def _value(array: Any, dtype: Any) -> torch.Tensor:
    """A value the cloud computed, in its dtype (bfloat16 travels as float32: exact), in memory
    torch aligned: math kernels pick their order of summation by alignment."""
    tensor = host_tensor(np.asarray(array))
    wanted = dtype_of(dtype)
    return tensor if tensor.dtype == wanted else tensor.to(wanted)


def values_to_send(value: Any) -> np.ndarray:
    """A tensor's values as the cloud receives them: on the host, bfloat16 as float32 (numpy has no
    bfloat16; the cloud casts it back exactly)."""
    tensor = torch.as_tensor(value).detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).contiguous().numpy()


__all__ = ["CloudHalf", "values_to_send"]
