"""What a script does with torch's own functions to a split model: mirrored, or refused.

Clipping. ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over a split model's parameters.

Scripts (and Accelerate, and ``transformers.Trainer`` through it) clip with the free functions
over ``model.parameters()``. Over a split model those are the edge's parameters only, so a plain
call would clip by the edge half's norm: a silent divergence. Once a split model exists, the two
functions are wrapped (looked up on ``torch.nn.utils`` at call time, as those callers do): a call
over exactly a split model's parameters runs the model's own method, which clips both halves
exactly; a call over some of them raises, naming the fix; any other call is torch's own.
A reference taken before :func:`splitft.split` ran (``from torch.nn.utils import
clip_grad_norm_`` at import time) is torch's function and is not routed: call
``model.clip_grad_norm_`` instead.

Optimizers. An optimizer over a split model's parameters that was never attached
(``model.attach(opt)``) would step the edge half alone; one whose parameter groups or settings the
mirror does not carry (several groups, a scheduler changing momentum) would step the cloud half
differently. Both are refused before their step runs (a global optimizer step pre-hook), with the fix.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import ConfigError

#: id(parameter) -> (the parameter, its split model), both weakly: ids are checked against the
#: parameter itself, since a freed tensor's id may be reused (tensors are not hashable by value).
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_INSTALLED = False
_ATTACHED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
#: Optimizers found to hold no split model's parameter, with how many parameters they had then.
_CLEAN: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def register(model: Any) -> None:
    """Route the free clipping functions over ``model``'s parameters to ``model``."""
    for key in [k for k, (p, m) in _OWNERS.items() if p() is None or m() is None]:
        del _OWNERS[key]
    for param in model.parameters():
        _OWNERS[id(param)] = (weakref.ref(param), weakref.ref(model))
    _install()


def _model_of(param: torch.Tensor) -> Any:
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _owner(parameters: Any, what: str) -> tuple[Any, list]:
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    owners = {id(m): m for m in (_model_of(p) for p in params) if m is not None}
    if not owners:
        return None, params
    model = next(iter(owners.values()))
    if len(owners) > 1 or {id(p) for p in params} != {id(p) for p in model.parameters()}:
        raise ConfigError(f"torch.nn.utils.{what} was given some of a split model's edge parameters; it cannot "
                          f"see the cloud half's gradients. Call model.{what}(...) on the split model, which "
                          "clips both halves")
    return model, params


def _route(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def routed(parameters: Iterable[torch.Tensor] | torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        model, params = _owner(parameters, what)
        if model is None:
            return original(params, *args, **kwargs)
        kwargs.pop("foreach", None)
        return getattr(model, what)(*args, **kwargs)

    routed.__splitft_original__ = original  # type: ignore[attr-defined]
    return routed


def attached(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` is mirrored to the cloud: check before each step that the mirror is exact."""
    settings = _hyperparameters(optimizer)
    _check_mirrorable(optimizer, settings)
    _ATTACHED.add(optimizer)
    optimizer.register_step_pre_hook(lambda opt, args, kwargs: _check_mirrorable(opt, settings))


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each group's settings the constructor took, but the learning rate (mirrored at every step)."""
    keys = [k for k in optimizer.defaults if k != "lr"]
    return [{k: group.get(k) for k in keys} for group in optimizer.param_groups]


def _check_mirrorable(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> None:
    if len(optimizer.param_groups) != 1:
        raise ConfigError(f"{type(optimizer).__name__} has {len(optimizer.param_groups)} parameter groups; a split "
                          "model mirrors optimizers with one group (one learning rate and settings) for now: "
                          "build it from model.parameters()")
    now = _hyperparameters(optimizer)
    if now != settings:
        changed = sorted(k for k in now[0] if now[0].get(k) != settings[0].get(k))
        raise ConfigError(f"{type(optimizer).__name__}'s {', '.join(changed)} changed since it was attached; a split "
                          "model mirrors the learning rate of every step, not other settings (a scheduler "
                          "cycling momentum, say): keep them fixed")


def _unattached_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _ATTACHED:
        return
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _CLEAN.get(optimizer) == count:
        return  # checked already (any other optimizer in the process: one look, not one per step)
    for group in optimizer.param_groups:
        for param in group["params"]:
            if _model_of(param) is not None:
                raise ConfigError(f"this {type(optimizer).__name__} holds a split model's parameters but was not "
                                  "attached, so the cloud half would not step: opt = model.attach(opt)")
    _CLEAN[optimizer] = count


def _install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_unattached_step)
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for what in ("clip_grad_norm_", "clip_grad_value_"):
        routed = _route(getattr(utils, what), what)
        setattr(utils, what, routed)
        setattr(clip_grad, what, routed)
    _INSTALLED = True


__all__ = ["attached", "register"]
