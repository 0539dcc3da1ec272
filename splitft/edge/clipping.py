"""``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over a split model's parameters.

Scripts (and Accelerate, and ``transformers.Trainer`` through it) clip with the free functions
over ``model.parameters()``. Over a split model those are the edge's parameters only, so a plain
call would clip by the edge half's norm: a silent divergence. Once a split model exists, the two
functions are wrapped (looked up on ``torch.nn.utils`` at call time, as those callers do): a call
over exactly a split model's parameters runs the model's own method, which clips both halves
exactly; a call over some of them raises, naming the fix; any other call is torch's own.
A reference taken before :func:`splitft.split` ran (``from torch.nn.utils import
clip_grad_norm_`` at import time) is torch's function and is not routed: call
``model.clip_grad_norm_`` instead.
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


def _install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for what in ("clip_grad_norm_", "clip_grad_value_"):
        routed = _route(getattr(utils, what), what)
        setattr(utils, what, routed)
        setattr(clip_grad, what, routed)
    _INSTALLED = True


__all__ = ["register"]
