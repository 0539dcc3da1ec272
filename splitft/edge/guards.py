"""What a script does with torch's own functions to a split model: mirrored to the cloud half.

A split model's ``parameters()`` include the cloud half's, as placeholders (see
:func:`splitft.cut.ghost`), so the usual calls over ``model.parameters()`` reach them. This module
makes torch's own functions act on both halves when they are given a split model's parameters:

Optimizers. Any optimizer that holds cloud placeholders is mirrored: the first time it steps or
is zeroed it is attached to its split model (``model.attach(opt)`` does the same, earlier), so
optimizers built by ``transformers.Trainer`` or Accelerate are mirrored like the user's own. An
attached optimizer's steps and ``zero_grad`` calls are forwarded to the cloud (a global step
pre/post hook and ``Optimizer.zero_grad``); one that only holds edge parameters is local, as it
would be on the unsplit model.

Optimizer state. ``opt.load_state_dict`` of per-parameter state (moments) over a split model's
parameters would restore the edge half's only, so it is refused (settings alone load: they are
mirrored at the next step); ``model.save_checkpoint`` and ``split(resume_from=...)`` restore both
halves.

Loss scaling. ``torch.amp.GradScaler`` unscales, and checks for inf/NaN, the gradients of the
optimizer's parameters: for a mirrored optimizer the cloud half's are unscaled the same way and
checked too, so an overflow in either half skips the step in both.

Clipping. ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` over (some of) a split
model's parameters clip exactly those parameters' gradients in both halves, by their global
norm: the cloud reports the norms of the named ones. They are looked up on ``torch.nn.utils`` at
call time, as Accelerate and ``transformers.Trainer`` do; a reference taken before
:func:`splitft.split` first ran (``from torch.nn.utils import clip_grad_norm_`` at import time)
is torch's function and is not routed: call ``model.clip_grad_norm_`` instead.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ..errors import ConfigError
from . import clipping

#: id(parameter) -> (the parameter, its split model), both weakly: ids are checked against the
#: parameter itself, since a freed tensor's id may be reused (tensors are not hashable by value).
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}
_INSTALLED = False
#: Held while _OWNERS is pruned and filled and while the hooks are installed: edges split in
#: several threads of one process register at once, and the hooks must go in exactly once.
_REGISTERING = threading.Lock()
#: Optimizers mirrored to a cloud half, with their mirror (see splitft.edge.mirror.OptimizerMirror).
_MIRRORS: weakref.WeakKeyDictionary[torch.optim.Optimizer, Any] = weakref.WeakKeyDictionary()
#: Optimizers found to hold no cloud placeholder, with how many parameters they had then.
_LOCAL: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()


def register(model: Any) -> None:
    """Route torch's optimizers and clipping functions over ``model``'s parameters to ``model``."""
    with _REGISTERING:
        for key in [k for k, (p, m) in _OWNERS.items() if p() is None or m() is None]:
            del _OWNERS[key]
        for param in model.parameters():
            _OWNERS[id(param)] = (weakref.ref(param), weakref.ref(model))
        _install()


def mirrored(optimizer: torch.optim.Optimizer, mirror: Any) -> None:
    """``optimizer`` is now mirrored by ``mirror``: its steps and zero_grad calls reach the cloud."""
    _MIRRORS[optimizer] = mirror
    _LOCAL.pop(optimizer, None)


def _model_of(param: torch.Tensor) -> Any:
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()


def _owner(params: list[torch.Tensor], what: str) -> Any:
    """The one split model these parameters belong to (None: none of them is a split model's)."""
    owners = {id(m): m for m in (_model_of(p) for p in params) if m is not None}
    if len(owners) > 1:
        raise ConfigError(f"{what} was given the parameters of {len(owners)} split models at once; "
                          "call it once per model")
    return next(iter(owners.values()), None)


def _cloud_owner(optimizer: torch.optim.Optimizer) -> Any:
    """The split model whose cloud placeholders ``optimizer`` holds, or None."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    model = _owner(params, f"{type(optimizer).__name__}")
    if model is not None and not any(model.is_cloud(p) for p in params):
        return None  # edge parameters only: a local optimizer, as on the unsplit model
    return model


def _mirror_of(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer``'s mirror, attaching it to its split model the first time it is seen holding
    cloud placeholders; None for an optimizer that holds none."""
    mirror = _MIRRORS.get(optimizer)
    if mirror is not None:
        return mirror
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _LOCAL.get(optimizer) == count:
        return None  # checked already: one look per optimizer, not one per step
    model = _cloud_owner(optimizer)
    if model is None:
        _LOCAL[optimizer] = count
        return None
    model.attach(optimizer)
    return _MIRRORS[optimizer]


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    mirror = _mirror_of(optimizer)
    if mirror is not None:
        mirror.before_step()


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    mirror = _MIRRORS.get(optimizer)
    if mirror is not None:
        mirror.after_step()


def _zero_grad_mirrored(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def zero_grad(self: torch.optim.Optimizer, set_to_none: bool = True) -> None:
        original(self, set_to_none)
        mirror = _mirror_of(self)
        if mirror is not None:
            mirror.zeroed(set_to_none)

    zero_grad.__splitft_original__ = original  # type: ignore[attr-defined]
    return zero_grad


def _load_refused(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict) -> None:
        if state_dict.get("state") and (self in _MIRRORS or _cloud_owner(self) is not None):
            raise ConfigError(f"{type(self).__name__}.load_state_dict over a split model's parameters would "
                              "restore the edge half's optimizer state only (the cloud keeps its own); checkpoint with "
                              "model.save_checkpoint(path) and continue with split(..., resume_from=path)")
        original(self, state_dict)

    load_state_dict.__splitft_original__ = original  # type: ignore[attr-defined]
    return load_state_dict


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load ``state`` into ``optimizer`` past the refusal above (an edge checkpoint's own state)."""
    load = type(optimizer).load_state_dict
    getattr(load, "__splitft_original__", load)(optimizer, state)


def _unscale_mirrored(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def unscale_grads(self: Any, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                      allow_fp16: bool) -> dict:
        found = original(self, optimizer, inv_scale, found_inf, allow_fp16)
        mirror = _mirror_of(optimizer)
        if mirror is not None and mirror.unscale(float(inv_scale)):
            if found:
                next(iter(found.values())).fill_(1.0)
            else:
                found[found_inf.device] = torch.ones_like(found_inf)
        return found

    unscale_grads.__splitft_original__ = original  # type: ignore[attr-defined]
    return unscale_grads


def _route(original: Callable[..., Any], what: str) -> Callable[..., Any]:
    @functools.wraps(original)
    def routed(parameters: Iterable[torch.Tensor] | torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        model = _owner(params, f"torch.nn.utils.{what}")
        if model is None:
            return original(params, *args, **kwargs)
        kwargs.pop("foreach", None)
        return getattr(clipping, what)(model, params, *args, **kwargs)

    routed.__splitft_original__ = original  # type: ignore[attr-defined]
    return routed


def _install() -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(_before_step)
    register_optimizer_step_post_hook(_after_step)
    optimizer = torch.optim.Optimizer
    optimizer.zero_grad = _zero_grad_mirrored(optimizer.zero_grad)  # type: ignore[method-assign]
    optimizer.load_state_dict = _load_refused(optimizer.load_state_dict)  # type: ignore[method-assign]
    scaler = torch.amp.GradScaler
    scaler._unscale_grads_ = _unscale_mirrored(scaler._unscale_grads_)  # type: ignore[method-assign]
    import torch.nn.utils as utils
    import torch.nn.utils.clip_grad as clip_grad

    for what in ("clip_grad_norm_", "clip_grad_value_"):
        routed = _route(getattr(utils, what), what)
        setattr(utils, what, routed)
        setattr(clip_grad, what, routed)
    _INSTALLED = True


__all__ = ["load_optimizer_state", "mirrored", "register"]
