"""The optimizer state the edge holds for the cloud half's parameters: placeholders.

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

The state an optimizer's steps make is kept the same way: after the first step that gives a cloud
parameter state in the unsplit optimizer (its gradient existed), or a load of a state dict, its
entry in ``opt.state`` is a read-only :class:`CloudEntry` of :class:`~.placeholders.CloudMoment`
placeholders with the keys, shapes and dtypes the real one has
(:mod:`splitft.optimizer_layout`). A script that walks the optimizer's state (resetting or
scaling the moments, reading a step count) therefore meets the cloud half's entries where the
unsplit script does, and raises there instead of changing the edge half's alone; the values are
read with ``opt.state_dict()``, which fetches them.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from typing import Any

import torch

from ..errors import PlaceholderError
from ..optimizer_layout import Layout, state_layout
from .placeholders import CloudMoment, CloudState, RemoteTensor


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


_ABSENT = object()


class CloudEntry(dict):
    """``opt.state[p]`` of a cloud parameter, as its steps made it: placeholders, read-only.

    ``opaque``: the keys are not known here (the optimizer could not be stepped over ``meta``
    tensors); then reading any key, or walking the entry, raises too.
    """

    def __init__(self, name: str, items: dict[str, Any], opaque: bool = False) -> None:
        super().__init__(items)
        self.name, self.opaque = name, opaque

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        raise PlaceholderError(f"the optimizer state of cloud parameter {self.name!r} was written for a cloud "
                               "parameter: it lives in the cloud's copy of the optimizer, which the edge cannot "
                               "change (split training would silently differ from the unsplit model)")

    def _unknown(self, *args: Any, **kwargs: Any) -> Any:
        if self.opaque:
            raise PlaceholderError(f"the optimizer state of cloud parameter {self.name!r} lives in the cloud's copy "
                                   "of the optimizer, whose keys for it are known only there: read it from "
                                   "opt.state_dict()['state'] (fetched from the cloud, by the parameter's index; "
                                   "ASGD's averaged weights: copy them in with p.copy_(...) under torch.no_grad())")
        raise KeyError(args[0] if args else None)

    __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __setitem__(self, key: Any, value: Any) -> None:
        """Only the value it holds, set again (``v[k] = v[k].to(device)`` where it already is, as
        Lightning moves the state at its teardown): unsplit that changes nothing either."""
        if dict.get(self, key, _ABSENT) is not value:
            self._refuse()
    __missing__ = _unknown

    def get(self, key: Any, default: Any = None) -> Any:
        if self.opaque:
            self._unknown(key)
        return super().get(key, default)

    def __iter__(self) -> Any:
        if self.opaque:
            self._unknown()
        return super().__iter__()

    def keys(self) -> Any:
        if self.opaque:
            self._unknown()
        return super().keys()

    def values(self) -> Any:
        if self.opaque:
            self._unknown()
        return super().values()

    def items(self) -> Any:
        if self.opaque:
            self._unknown()
        return super().items()

    def __reduce_ex__(self, proto: Any) -> Any:
        raise PlaceholderError(f"copying or saving the optimizer state of cloud parameter {self.name!r}: it lives in "
                               "the cloud's copy of the optimizer; model.save_checkpoint(path) saves it")


def read_only(entry: dict[str, Any], name: str, remote: Any) -> CloudEntry:
    """A cloud parameter's entry as its constructor made it, as a :class:`CloudEntry`: its real
    tensors (Adagrad's step count) become placeholders, since the cloud's copy changes its own."""
    return CloudEntry(name, {key: CloudMoment(value, name, remote, value.dtype, None)
                             if isinstance(value, torch.Tensor) and not isinstance(value, RemoteTensor) else value
                             for key, value in entry.items()})


def layouts(optimizer: torch.optim.Optimizer, params: Container[int], settings: dict[str, Any],
            group_settings: list[dict[str, Any]], numbers: bool = False) -> dict[int, dict[str, Layout]] | None:
    """The state ``optimizer`` keeps for each of its parameters whose id is in ``params`` (by id),
    with the settings the cloud receives (:func:`~splitft.optimizer_layout.state_layout`, the
    values it keeps as Python numbers too with ``numbers``); None when it cannot be known ahead
    of a step."""
    groups, members = [], []
    for group, sent in zip(optimizer.param_groups, group_settings):
        found = [p for p in group["params"] if id(p) in params]
        groups.append((sent, [(p.shape, p.dtype) for p in found]))
        members.append(found)
    layout = state_layout(type(optimizer), groups, settings, numbers)
    if layout is None:
        return None
    return {id(p): keys for found, group in zip(members, layout) for p, keys in zip(found, group)}


def step_entries(optimizer: torch.optim.Optimizer, params: dict[int, str], remote: Any, settings: dict[str, Any],
                 group_settings: list[dict[str, Any]]) -> dict[torch.Tensor, CloudEntry]:
    """The entries ``optimizer``'s step makes for the cloud parameters ``params`` (id -> name), as
    :class:`CloudEntry` placeholders of the layout it keeps (:func:`layouts`). A parameter whose
    step makes no state (SGD without momentum) gets no entry."""
    found = layouts(optimizer, params, settings, group_settings)
    members = [p for group in optimizer.param_groups for p in group["params"] if id(p) in params]
    if found is None:
        return {p: CloudEntry(params[id(p)], {}, opaque=True) for p in members}
    return {p: placeholders(params[id(p)], found[id(p)], remote) for p in members if found[id(p)]}


def placeholders(name: str, keys: dict[str, Layout], remote: Any) -> CloudEntry:
    """A cloud parameter's entry of the given layout, as placeholders."""
    return CloudEntry(name, {key: CloudMoment(torch.empty(shape, device="meta"), name, remote, dtype, None)
                             for key, (shape, dtype) in keys.items()})


__all__ = ["CloudEntry", "constructor_state", "layouts", "placeholders", "read_only", "same_entry", "step_entries", "to_placeholders", "unchanged"]
