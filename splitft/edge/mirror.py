"""Mirroring: what the user's loop does to the edge's half that the cloud must do to its own.

The optimizer the user attaches is rebuilt in the cloud by class name and settings; its steps and
``zero_grad`` calls, the loss the cloud computes in a plain split, and the scale of an eager
backward are *operations* (:mod:`splitft.operations`) that ride on the next message the edge sends, which the
cloud applies before that message. So a step costs no extra round trip, and gradient
accumulation behaves exactly as it does locally.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..errors import ConfigError
from ..operations import ApplyEager, AttachOptimizer, ClampGrads, LoadWeights, ScaleGrads, SetLoss, Step, ZeroGrad, to_wire
from . import guards

if TYPE_CHECKING:
    from .requests import EdgeSession

# ---------------------------------------------------------------- the operations
# Typed records (splitft.operations), sent as the maps the cloud checks field by field.


def optimizer_op(op_id: int, name: str, settings: dict[str, Any]) -> dict:
    """Build (or, with a known id, keep) the cloud's optimizer: class ``name`` with ``settings``."""
    return to_wire(AttachOptimizer(name=name, settings=settings, id=op_id))


def step_op(step: int, lr: float | None) -> dict:
    """Step ``step`` of the optimizer; the cloud applies each id once, however often it arrives."""
    return to_wire(Step(id=step, lr=lr))


def zero_grad_op(set_to_none: bool) -> dict:
    return to_wire(ZeroGrad(set_to_none=bool(set_to_none)))


def scale_grads_op(factor: float) -> dict:
    """Multiply the cloud half's gradients (clipping by the global norm)."""
    return to_wire(ScaleGrads(factor=float(factor)))


def clamp_grads_op(value: float) -> dict:
    return to_wire(ClampGrads(value=float(value)))


def load_weights_op(weights: dict[str, Any]) -> dict:
    """Replace the cloud half's weights (arrays by their names in the original model)."""
    return to_wire(LoadWeights(weights=weights))


def loss_op(name: str, settings: dict[str, Any]) -> dict:
    """The torch.nn loss the cloud computes at the end of a plain split."""
    return to_wire(SetLoss(name=name, settings=settings))


def apply_op(call: int, scale: float) -> dict:
    """Eager backward: accumulate call ``call``'s parameter gradients, times the loss's incoming gradient."""
    return to_wire(ApplyEager(call=call, scale=scale))


# ---------------------------------------------------------------- optimizer and loss


def attach_optimizer(session: EdgeSession, optimizer: torch.optim.Optimizer, *, resume_state: dict | None,
                     on_step: Callable[[], None]) -> None:
    """Mirror ``optimizer`` in the cloud: same class and settings, stepping and zeroing when it does.

    ``resume_state`` (from an edge checkpoint) is loaded into it; the cloud then keeps the
    optimizer it restored. ``on_step`` runs after each mirrored step.
    """
    guards.attached(optimizer)  # refuses, before anything is queued, what the mirror would not carry exactly
    settings = optimizer_settings(optimizer)
    if resume_state is not None:
        optimizer.load_state_dict(resume_state)
        op_id = session.optimizer_id  # the cloud restored its optimizer: this attach is a no-op there
    else:
        session.optimizer_id += 1
        op_id = session.optimizer_id
    session.queue(optimizer_op(op_id, type(optimizer).__name__, settings))

    def stepped(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        lr = opt.param_groups[0].get("lr")
        session.step += 1
        session.queue(step_op(session.step, float(lr) if isinstance(lr, (int, float)) else None))
        if session.shared:
            # Other edges train the same cloud half: apply the step now, not with this edge's next
            # message, so it lands between the other edges' steps where the user's loop put it.
            session.sync()
        on_step()

    optimizer.register_step_post_hook(stepped)
    original = optimizer.zero_grad

    def zero_grad(set_to_none: bool = True) -> None:
        original(set_to_none)
        session.queue(zero_grad_op(set_to_none))

    optimizer.zero_grad = zero_grad  # type: ignore[method-assign]


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the cloud needs to build the same optimizer; refuses what it cannot rebuild by name."""
    cls = type(optimizer)
    if not cls.__module__.startswith("torch.optim") or getattr(torch.optim, cls.__name__, None) is not cls:
        raise ConfigError(f"the cloud mirrors torch.optim optimizers by name; {cls.__qualname__} is not one of them")
    # Only what the constructor takes: AdamW keeps a 'decoupled_weight_decay' default that its
    # __init__ does not accept, so mirroring every default would fail in the cloud.
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    return {k: _plain(v) for k, v in optimizer.defaults.items()
            if (takes_any or k in accepted) and _plain(v) is not _NOT_PLAIN}


def loss_settings(criterion: nn.Module) -> dict[str, Any]:
    """What the cloud needs to build the same torch.nn loss; refuses what it cannot rebuild by name."""
    cls = type(criterion)
    if getattr(nn, cls.__name__, None) is not cls or not issubclass(cls, nn.modules.loss._Loss):
        raise ConfigError(f"the cloud computes torch.nn losses by name; {cls.__qualname__} is not one")
    settings = {}
    for name in inspect.signature(cls).parameters:
        value = getattr(criterion, name, None)
        if isinstance(value, torch.Tensor):
            raise ConfigError(f"{cls.__name__}({name}=<tensor>) cannot be mirrored to the cloud")
        if _plain(value) is not _NOT_PLAIN and value is not None:
            settings[name] = value
    return settings


_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    """``value`` if msgpack can carry it as a setting, else a marker."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return list(value)
    return _NOT_PLAIN


__all__ = ["apply_op", "attach_optimizer", "loss_op", "loss_settings", "optimizer_op", "optimizer_settings",
           "step_op", "zero_grad_op", "scale_grads_op", "clamp_grads_op", "load_weights_op"]
