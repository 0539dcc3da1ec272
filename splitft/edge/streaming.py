"""Streaming: a bounded window of training steps in flight when nothing must come back.

An edge trained with a frozen bottom (SFT's eliminated link) in a plain split needs nothing
from the cloud to take its next step: the cloud computes the loss and its own gradients with
the forward (eager backward), and the edge's optimizer step rides on the next message. So the
edge need not wait a round trip per step. With ``Schedule(window=W)`` it sends up to W steps'
forwards before it waits for the oldest reply (credit-based flow control: a step's inputs and
its place in the request log are held until its reply, so memory is bounded by W).

The loss such a step returns is a :class:`PendingTensor`: backpropagating from it, detaching
it, asking its shape or dtype does not wait; reading its value (``float(loss)``, printing it,
arithmetic) waits for the reply, and every older one, in order. The cloud applies the messages
in the order they were sent, exactly as it would one at a time, so the weights equal
synchronous training's. An error the cloud reports for a streamed step is raised when that
step is settled: at a later step, at the next synchronous call, or when the session closes.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ProtocolError, SplitFTError


def stash_weights(model: torch.nn.Module, skip: Iterable[torch.Tensor]) -> tuple[list, dict[str, torch.Tensor]]:
    """Delayed gradients: copies of ``model``'s weights (those not in ``skip``) for this step's
    forward to run on (``torch.func.functional_call``), kept until its cut gradient arrives a step
    later, when the optimizer has already changed the weights. Returns (weight, copy) pairs and
    the copies by name; a copy's gradient, whenever it comes, is added to its weight's."""
    skipped = set(map(id, skip))
    named = [(n, p) for n, p in model.named_parameters() if id(p) not in skipped]
    copies = {n: p.detach().clone().requires_grad_(p.requires_grad) for n, p in named}
    for n, p in named:
        if p.requires_grad:
            copies[n].register_post_accumulate_grad_hook(functools.partial(_into_grad, p))
    return [(p, copies[n]) for n, p in named], copies


def _into_grad(param: torch.Tensor, copy: torch.Tensor) -> None:
    """Add a stashed copy's gradient to its weight's, as if the forward had used the weight."""
    grad = copy.grad
    assert grad is not None  # a post-accumulate-grad hook runs once the gradient is there
    with torch.no_grad():
        param.grad = grad if param.grad is None else param.grad + grad
    copy.grad = None


class StreamError(SplitFTError):
    """A streamed step failed in the cloud; raised when that step is settled (and after)."""


#: Functions of a pending tensor that need no value: autograd, detaching, metadata.
_NO_WAIT = frozenset({"backward", "detach", "size", "dim", "numel", "shape", "dtype", "device", "requires_grad",
                      "grad_fn", "is_leaf", "ndim", "layout", "is_floating_point", "element_size", "grad",
                      "_backward_hooks", "__hash__", "data_ptr"})


def _name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property of the tensor (shape, grad_fn, ...)
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class PendingTensor(torch.Tensor):
    """A streamed step's output: its value arrives with the step's reply (see the module)."""

    _settle: Callable[[], None] | None = None

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = _name(func)
        if name not in _NO_WAIT:
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, PendingTensor) and arg._settle is not None:
                    arg._settle()
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name == "detach" and isinstance(args[0], PendingTensor) and args[0]._settle is not None:
            out = out.as_subclass(PendingTensor)  # shares the storage the reply is written into
            out._settle = args[0]._settle
        return out


def pending_like(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> PendingTensor:
    """An output to be filled by its reply (zeros until then; nothing reads it before)."""
    return torch.zeros(shape, dtype=dtype, device=device).as_subclass(PendingTensor)


def fill(placeholder: torch.Tensor, value: torch.Tensor) -> None:
    """Write a reply's value into a pending output (and every detached view of it)."""
    if value.shape != placeholder.shape:
        raise ProtocolError(f"a streamed step's output came back with shape {tuple(value.shape)}, "
                            f"expected {tuple(placeholder.shape)}")
    with torch._C.DisableTorchFunctionSubclass(), torch.no_grad():
        placeholder.detach().copy_(value)


@dataclass
class Inflight:
    """One streamed step: what settles it, and the pending outputs it fills."""

    settle: Callable[[], list[torch.Tensor]]  # awaits and decodes the reply; the step's outputs
    outputs: list[PendingTensor] = field(default_factory=list)
    done: bool = False


class Window:
    """The steps in flight, oldest first; settled strictly in the order they were sent."""

    def __init__(self) -> None:
        self._steps: deque[Inflight] = deque()
        self._failed: BaseException | None = None

    def __len__(self) -> int:
        return len(self._steps)

    def push(self, step: Inflight) -> None:
        for out in step.outputs:
            out._settle = lambda s=step: self.settle_through(s)
        self._steps.append(step)

    def settle_through(self, step: Inflight) -> None:
        """Settle every step up to and including ``step``."""
        while not step.done:
            self.settle_oldest()

    def settle_oldest(self) -> None:
        if self._failed is not None:
            raise StreamError(f"an earlier streamed step failed: {self._failed}") from self._failed
        step = self._steps.popleft()
        try:
            values = step.settle()
        except BaseException as exc:
            self._failed = exc
            step.done = True
            raise
        for placeholder, value in zip(step.outputs, values):
            fill(placeholder, value)
            placeholder._settle = None
        step.done = True

    def make_room(self, window: int) -> None:
        """Settle the oldest steps until fewer than ``window`` are in flight."""
        while len(self._steps) >= window:
            self.settle_oldest()

    def drain(self) -> None:
        """Settle every step in flight (before a synchronous call, a checkpoint, the goodbye)."""
        while self._steps:
            self.settle_oldest()
        if self._failed is not None:
            raise StreamError(f"an earlier streamed step failed: {self._failed}") from self._failed


__all__ = ["Inflight", "PendingTensor", "StreamError", "Window", "fill", "pending_like", "stash_weights"]
