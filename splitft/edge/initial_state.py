"""The state an optimizer's constructor makes for the cloud half's parameters.

Some optimizers start their state in the constructor (Adagrad: a step count and an accumulator of
``initial_accumulator_value`` per parameter). Over a split model the cloud half's entries are made
from placeholders (:class:`~.placeholders.CloudState`), and the cloud's copy of the optimizer,
built by class name with the same settings, makes the same state over the real parameters. So an
entry for a cloud parameter is harmless exactly when it is still what the constructor made: the
mirror checks that when it attaches (the constructor is run again over the cloud parameters, with
the settings the cloud receives, and the two compared), and keeps the entries it accepted, so that
state a script writes for a cloud parameter later is told apart from them and refused. An optimizer
built before ``split()`` made real tensors: equal to the constructor's, they are replaced by its
placeholders, so the edge does not hold the cloud half's state.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .placeholders import CloudState, RemoteTensor


def constructor_state(optimizer: torch.optim.Optimizer, owns: Callable[[torch.Tensor], bool], settings: dict[str, Any],
                      group_settings: list[dict[str, Any]]) -> dict[torch.Tensor, dict[str, Any]]:
    """What the cloud's copy starts from: the state ``type(optimizer)(groups, **settings)`` makes in
    its constructor for the cloud parameters ``optimizer`` holds, each group with the settings the
    cloud receives for it (``group_settings``, in the order of ``optimizer.param_groups``)."""
    groups = [{**sent, "params": [p for p in group["params"] if owns(p)]}
              for group, sent in zip(optimizer.param_groups, group_settings)]
    groups = [group for group in groups if group["params"]]
    if not groups:
        return {}
    return {p: entry for p, entry in type(optimizer)(groups, **settings).state.items() if entry}


def same_entry(got: dict[str, Any], made: dict[str, Any]) -> bool:
    """Whether an optimizer's entry for a parameter is the one its constructor made."""
    return got.keys() == made.keys() and all(_same(got[key], made[key]) for key in made)


def _same(got: Any, made: Any) -> bool:
    if isinstance(made, CloudState) and isinstance(got, torch.Tensor) and not isinstance(got, RemoteTensor):
        return _filled(got, made)  # made before split(), from the parameter it was then
    if isinstance(made, CloudState) or isinstance(got, CloudState):
        return isinstance(got, CloudState) and isinstance(made, CloudState) and got.recipe() == made.recipe()
    if isinstance(made, torch.Tensor) or isinstance(got, torch.Tensor):
        return (isinstance(got, torch.Tensor) and isinstance(made, torch.Tensor) and type(got) is type(made)
                and (got.dtype, got.shape, got.device) == (made.dtype, made.shape, made.device)
                and (got.device.type == "meta" or torch.equal(got, made)))
    return type(got) is type(made) and bool(got == made)


def _filled(got: torch.Tensor, made: CloudState) -> bool:
    """Whether a real tensor is what ``made`` stands for (its shape, dtype, and fill everywhere)."""
    fill = made._splitft_fill
    return (got.shape == made.shape and got.dtype == made.dtype and got.layout == torch.strided
            and (fill is None or bool((got == fill).all())))


def to_placeholders(entry: dict[str, Any], made: dict[str, Any]) -> None:
    """Put ``made``'s placeholders in ``entry`` where it holds real tensors of the same values
    (an optimizer built before ``split()``): the cloud's copy keeps them, the edge need not."""
    for key, value in made.items():
        if isinstance(value, CloudState) and not isinstance(entry[key], CloudState):
            entry[key] = value


def unchanged(state: dict[torch.Tensor, dict[str, Any]],
              kept: list[tuple[torch.Tensor, dict[str, Any], dict[str, Any]]]) -> bool:
    """Whether every kept entry (parameter, the entry, a copy of its items) is still in ``state``,
    the same object with the same values: a cheap look, by identity, once per step."""
    for param, entry, items in kept:
        if state.get(param) is not entry or len(entry) != len(items):
            return False
        for key, value in items.items():
            if entry.get(key) is not value:
                return False
    return True


__all__ = ["constructor_state", "same_entry", "to_placeholders", "unchanged"]
