"""An optimizer's settings as the cloud's copy is built and stepped with them: plain numbers and
flags only, of a class the cloud can build by name (:mod:`splitft.optimizer_classes`)."""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..errors import ConfigError
from ..optimizer_classes import LIBRARY_OPTIMIZERS, wire_name
from ..optimizer_layout import same_kind

#: Settings that cannot change without being replaced (a list or a tensor can, in place), and tuples of them.
IMMUTABLE = {bool, int, float, str}
PLAIN_KINDS = {type(None), *IMMUTABLE}
PLAIN_OR_TUPLE = {tuple, *PLAIN_KINDS}


def optimizer_settings(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What the cloud needs to build the same optimizer; refuses what it cannot rebuild by name."""
    cls = type(optimizer)
    if wire_name(cls) is None:
        base = next((b for b in cls.__mro__ if getattr(torch.optim, b.__name__, None) is b), None)
        raise ConfigError(f"the cloud mirrors torch.optim optimizers (and {', '.join(LIBRARY_OPTIMIZERS)}) by name; "
                          f"{cls.__module__}.{cls.__qualname__} is not one of them"
                          + (f" (a subclass of torch.optim.{base.__name__}, whose copy in the cloud would not run what "
                             f"{cls.__name__} adds): use torch.optim.{base.__name__} itself, and set what the subclass "
                             "changes on its param_groups (a learning rate, mirrored at each step)"
                             if base is not None and base is not torch.optim.Optimizer else
                             " (an optimizer of its own, whose code the cloud does not have): step the cloud half with "
                             "a torch.optim optimizer, or write the update as a loop over the parameters under "
                             "torch.no_grad() (p.add_(...) from p.grad), which is computed in the cloud"))
    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(f"{cls.__name__} steps by calling a closure (the loss evaluated again inside its step), "
                          "which the cloud's copy of the optimizer cannot repeat; use an optimizer whose step takes "
                          "the gradients as they are. One over edge parameters only stays local and steps as unsplit: "
                          "build it over the parameters it trains (temperature scaling's LBFGS([T]), not over a "
                          "wrapper's parameters() that hold the frozen model's too)")
    # Only what the constructor takes: AdamW keeps a 'decoupled_weight_decay' default that its
    # __init__ does not accept, so mirroring every default would fail in the cloud.
    accepted = inspect.signature(cls).parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    settings = {}
    for key, value in optimizer.defaults.items():
        if takes_any or key in accepted:
            settings[key] = plain_setting(value)
            if settings[key] is NOT_PLAIN:  # left out, the cloud's copy would step with its own default
                raise ConfigError(not_mirrored(cls.__name__, key, value))
    return settings


def not_mirrored(optimizer: str, key: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return (f"{optimizer}'s {key} is a tensor: torch steps with it in the tensor's own precision, which the "
                f"cloud's copy would not repeat bit for bit; set it as a Python number ({key}=float(...))")
    if type(value).__module__ == "numpy":
        return (f"{optimizer}'s {key} is {value!r}: a numpy number computes in its own precision in the step's "
                f"arithmetic, which the cloud's copy would not repeat bit for bit; set it as a Python number "
                f"(float(...))")
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) or type(v).__module__ == "numpy"
                                                for v in value):
        return (f"{optimizer}'s {key} is {value!r}: tensors or numpy numbers compute in their own precision in the "
                f"step's arithmetic, which the cloud's copy would not repeat bit for bit; set it as Python numbers "
                f"({key}=tuple(float(v) for v in ...))")
    return f"{optimizer}'s {key} is {value!r}; a split model mirrors plain numbers and flags, not this"


def refuse_other_kinds(optimizer: str, now: list[dict[str, Any]], sent: list[dict[str, Any]]) -> None:
    """Refuse, before a step runs, a group's setting changed to a value the cloud's copy does not
    take in place of the one it holds (:func:`~splitft.optimizer_layout.same_kind`): refused there,
    after the edge's half stepped, the two halves would be a step apart."""
    if now is sent:  # the settings as sent, unchanged (read every step: nothing to compare)
        return
    for group, before in zip(now, sent):
        for key, value in group.items():
            if value != before.get(key) and not same_kind(value, before.get(key)):
                raise ConfigError(f"{optimizer}'s {key} changed from {before.get(key)!r} to {value!r}: the cloud's copy "
                                  "takes a new value of a setting of the kind it holds (a number for a number, a flag "
                                  "for a flag, a name or None for a name, numbers or None for a tuple), and would not "
                                  f"step with this one. Build the optimizer with {key} of the new kind and attach it "
                                  "(model.attach(new)); nothing has stepped")


def unknown_layout(optimizer: str, loading: bool) -> str:
    """Why a state ``optimizer`` holds for cloud parameters cannot go to the cloud's copy, where
    the layout of what it keeps is only known by stepping it (ASGD, Adafactor), and what to do."""
    fix = ("use model.save_checkpoint(path) and split(..., resume_from=path)" if loading else
           f"this {optimizer} stepped before split(), and its state would go to the cloud's copy as such a load: "
           f"warm up split (split() first, then the same loop), or step the warm-up with another optimizer and "
           f"build the {optimizer} after split()")
    return (f"the state a {optimizer} keeps is not known ahead of its steps, so its cloud half's part cannot be "
            f"loaded; {fix}")


NOT_PLAIN = object()


def plain_setting(value: Any) -> Any:
    """``value`` if msgpack can carry it as a setting, else a marker."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(v is None or isinstance(v, (bool, int, float)) for v in value):
        return list(value)  # Adafactor's eps is (None, 1e-3)
    return NOT_PLAIN


__all__ = ["IMMUTABLE", "NOT_PLAIN", "PLAIN_KINDS", "PLAIN_OR_TUPLE", "not_mirrored", "optimizer_settings",
           "plain_setting", "refuse_other_kinds", "unknown_layout"]
