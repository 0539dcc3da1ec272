"""Mirroring: what the user's loop does to the edge's half that the cloud must do to its own.

The optimizer the user attaches is rebuilt in the cloud by class name and settings; its steps and
``zero_grad`` calls, the loss the cloud computes in a plain split, and the scale of an eager
backward are *operations* (:mod:`splitft.wire.operations`) that ride on the next message the edge sends, which the
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
from . import optimizers
from ..wire.operations import AttachOptimizer, Step

if TYPE_CHECKING:
    from .requests import EdgeSession

# ---------------------------------------------------------------- optimizer and loss


class OptimizerMirror:
    """The cloud's copy of one optimizer: built when it is attached, stepped and zeroed with it.

    The cloud builds the same class with the same settings over the same parameter groups (by
    the cloud parameters' names); each step carries the groups' learning rates and any other
    setting a scheduler changed since the previous one. While the edge's optimizer steps, the
    cloud's gradients are hidden from it (``cloud_half.hidden``): the cloud steps its parameters.

    Args:
        session: the edge's session.
        optimizer: the user's optimizer.
        cloud_names: id of each cloud parameter's placeholder -> its name in the unsplit model.
        cloud_half: the edge's record of the cloud's gradients.
        resume_state: optimizer state from an edge checkpoint; the cloud kept its optimizer.
        on_step: runs after each mirrored step.
    """

    def __init__(self, session: EdgeSession, optimizer: torch.optim.Optimizer, cloud_names: dict[int, str],
                 cloud_half: Any, *, resume_state: dict | None, on_step: Callable[[], None]) -> None:
        self.session, self.optimizer, self.on_step = session, optimizer, on_step
        self.cloud_half = cloud_half
        self.settings = optimizer_settings(optimizer)
        self.members = _members(optimizer)
        self.sent = self._group_settings()
        groups = [{"names": [cloud_names[id(p)] for p in group["params"] if id(p) in cloud_names],
                   "settings": settings} for group, settings in zip(optimizer.param_groups, self.sent)]
        names = [name for group in groups for name in group["names"]]
        #: The cloud parameters this optimizer holds (None: all of them).
        self.names: list[str] | None = None if len(names) == len(cloud_names) else names
        if len(groups) == 1 and len(groups[0]["names"]) == len(cloud_names) and self.sent[0] == self.settings:
            groups = None  # the common case, as small on the wire as it was before groups
        if resume_state is not None:
            optimizers.load_optimizer_state(optimizer, resume_state)
            op_id = session.optimizer_id  # the cloud restored its optimizer: this attach is a no-op there
        else:
            session.optimizer_id += 1
            op_id = session.optimizer_id
        session.outbox.queue(AttachOptimizer(name=type(optimizer).__name__, settings=self.settings, id=op_id,
                                             groups=groups))

    def _group_settings(self) -> list[dict[str, Any]]:
        out = []
        for group in self.optimizer.param_groups:
            settings = {}
            for key in self.settings:
                value = _plain(_scalar(group.get(key)))
                if value is _NOT_PLAIN:
                    raise ConfigError(f"{type(self.optimizer).__name__}'s {key} is {group.get(key)!r}; a split model "
                                      "mirrors plain numbers and flags, not this")
                settings[key] = value
            out.append(settings)
        return out

    def before_step(self) -> None:
        """Refuse, before the step runs, what the mirror would not carry: groups added or changed."""
        if _members(self.optimizer) != self.members:
            raise ConfigError(f"{type(self.optimizer).__name__}'s parameter groups changed since it was attached "
                              "(add_param_group, or a group's params list edited); a split model mirrors the groups "
                              "it was attached with: build a new optimizer and attach it")
        self.cloud_half.hidden = True

    def after_step(self) -> None:
        self.cloud_half.hidden = False
        now = self._group_settings()
        lrs = [group.get("lr") for group in now]
        changes = [{k: v for k, v in group.items() if k != "lr" and v != before.get(k)}
                   for group, before in zip(now, self.sent)]
        self.sent = now
        session = self.session
        session.step += 1
        single = len(lrs) == 1
        session.outbox.queue(Step(id=session.step, lr=lrs[0] if single else None, lrs=None if single else lrs,
                                  changes=changes if any(changes) else None))
        if session.shared:
            # Other edges train the same cloud half: apply the step now, not with this edge's next
            # message, so it lands between the other edges' steps where the user's loop put it.
            session.sync()
        self.on_step()


def _members(optimizer: torch.optim.Optimizer) -> list[tuple[int, ...]]:
    return [tuple(map(id, group["params"])) for group in optimizer.param_groups]


def _scalar(value: Any) -> Any:
    """A one-element tensor setting (a tensor learning rate) as a number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return value


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


__all__ = ["OptimizerMirror", "loss_settings", "optimizer_settings"]
