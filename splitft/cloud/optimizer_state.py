"""A session's optimizer state, read for an edge (``opt.state_dict()`` on a split model) and
replaced by one (``opt.load_state_dict``): by the half's parameter names, so the edge puts each
entry where its optimizer lists the parameter.

What an edge loads is checked against what this optimizer keeps
(:func:`splitft.optimizer_layout.state_layout`): every named parameter one of its own, every key
one it keeps, each array of that shape and castable to that dtype, finite. Nothing is loaded
until all of it passed, so a refused load changes nothing. The total is at most the state the
optimizer makes by itself, which the session's memory already counts on.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

import numpy as np
import torch

from ..errors import ConfigError, PolicyError, ProtocolError
from ..optimizer_layout import NUMBERS, same_kind, state_layout
from .blame import blame, short
from .half import tensors_from_wire


class Session(Protocol):
    """What is read of a session (:class:`~splitft.cloud.session.CloudSession`)."""

    @property
    def half(self) -> Any: ...

    @property
    def mirrored(self) -> Any: ...


def read(session: Session) -> dict[str, dict[str, Any]]:
    """The optimizer's state per parameter name: tensors on the host (bfloat16 as float32),
    Python numbers as they are."""
    optimizer = _own_optimizer(session, "read")
    out: dict[str, dict[str, Any]] = {}
    for param, entry in optimizer.state.items():
        out[session.half.name_of(param)] = {key: _host(value) if isinstance(value, torch.Tensor) else value
                                            for key, value in entry.items()
                                            if isinstance(value, (torch.Tensor, *NUMBERS))}
    return out


def load(session: Session, entries: Any, changes: Any = None) -> None:
    """Make ``entries`` the optimizer's state (the parameters not named have none) and ``changes``
    (per group, settings the loaded state dict holds) its groups' settings, all checked first."""
    optimizer = _own_optimizer(session, "replace")
    settings = _loaded_settings(optimizer, changes)
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise ProtocolError("load_optimizer_state.entries must map parameter names to maps of arrays")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(hasattr(p, "full_tensor") for p in params):
        raise ConfigError("this cloud shards the half over its ranks (FSDP2): a loaded optimizer state is not placed "
                          "on them; checkpoint with model.save_checkpoint(path)")
    index = {session.half.name_of(p): i for i, p in enumerate(params)}
    unknown = [name for name in entries if name not in index]
    if unknown:
        raise ProtocolError(f"load_optimizer_state names {short(unknown[0])}, not a parameter of this session's "
                            "optimizer")
    expected = _layout(optimizer, settings) if entries else []  # an empty state (a reset) needs no layout
    if expected is None:
        raise ConfigError(f"the state a {type(optimizer).__name__} keeps is not known to the cloud ahead of its "
                          "steps, so a loaded one cannot be checked; checkpoint with model.save_checkpoint(path)")
    state: dict[int, dict[str, Any]] = {}
    for name, arrays in entries.items():
        i = index[name]
        keys = expected[i]
        if not isinstance(arrays, dict):
            raise ProtocolError(f"load_optimizer_state of {name!r} must map state keys to arrays")
        if set(arrays) != set(keys):
            raise ProtocolError(f"load_optimizer_state of {name!r}: keys {short(sorted(map(str, arrays)))}; this "
                                f"{type(optimizer).__name__} keeps {short(sorted(keys))}")
        numbers = {key for key, (_, kind) in keys.items() if not isinstance(kind, torch.dtype)}
        state[i] = {}
        for key in numbers:  # a value the optimizer keeps as a Python number, of the type it keeps
            value, kind = arrays[key], keys[key][1]
            if type(value) is not kind or (kind is float and not math.isfinite(value)):
                raise ProtocolError(f"load_optimizer_state of {name!r}: {key!r} must be a finite {kind.__name__}, "
                                    f"got {short(value)}")
            state[i][key] = value
        values = tensors_from_wire({k: v for k, v in arrays.items() if k not in numbers},
                                   f"load_optimizer_state of {name!r}")
        for key, value in values.items():
            shape, dtype = keys[key]
            if tuple(value.shape) != shape:
                raise ProtocolError(f"load_optimizer_state of {name!r}: {key!r} has shape {tuple(value.shape)}, "
                                    f"not {shape}")
            if value.is_complex() and not dtype.is_complex:  # a cast would drop the imaginary part
                raise ProtocolError(f"load_optimizer_state of {name!r}: {key!r} is complex, not {dtype}")
            with blame(ProtocolError, f"load_optimizer_state of {name!r}: {key!r} cannot be cast to {dtype}"):
                value = value.to(dtype)
            if (value.is_floating_point() or value.is_complex()) and not torch.isfinite(value).all():
                raise ProtocolError(f"load_optimizer_state of {name!r}: {key!r} contains NaN or Inf")
            state[i][key] = value
    saved = optimizer.state_dict()
    for packed, changed in zip(saved["param_groups"], settings, strict=True):
        packed.update(changed)
    with blame(ConfigError, "the optimizer refused the state"):
        optimizer.load_state_dict({**saved, "state": state})


def _loaded_settings(optimizer: torch.optim.Optimizer, changes: Any) -> list[dict[str, Any]]:
    """Per group, the settings a load changes (checked as a step's changes are, its lr included)."""
    groups = optimizer.param_groups
    if changes is None:
        return [{} for _ in groups]
    if not isinstance(changes, list) or len(changes) != len(groups):
        raise ProtocolError(f"load_optimizer_state.changes must hold one map per parameter group ({len(groups)})")
    return [checked_settings(group, changed, "a loaded state", fixed=("params",))
            for group, changed in zip(groups, changes)]


def checked_settings(group: dict[str, Any], changes: Any, who: str, fixed: tuple[str, ...]) -> dict[str, Any]:
    """``changes`` to a parameter group's settings as the group holds them (tuples as tuples),
    each one the group has, not ``fixed``, and of its kind; refused whole otherwise."""
    if not isinstance(changes, dict):
        raise ProtocolError(f"a group's changed settings must be a map, got {short(changes)}")
    for key, value in changes.items():
        if key in fixed or key not in group:
            raise ProtocolError(f"{who} cannot change the optimizer's {short(key)}")
        if not same_kind(value, group[key]):
            raise ProtocolError(f"setting {key} must keep its type, got {short(value)}")
    return {key: tuple(value) if isinstance(group[key], tuple) else value for key, value in changes.items()}


def _own_optimizer(session: Session, what: str) -> torch.optim.Optimizer:
    if session.half.shared is not None:
        raise PolicyError(f"a shared cloud half's optimizer is every edge's; one edge may not {what} its state")
    optimizer = session.mirrored.own_optimizer
    if optimizer is None:
        raise ProtocolError(f"no optimizer is attached in this session: nothing to {what}")
    return optimizer


def _layout(optimizer: torch.optim.Optimizer, settings: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """Per parameter of ``optimizer`` (in its groups' order), the keys its state has with each
    group's ``settings`` in place, with their layout."""
    groups = [({**{k: v for k, v in group.items() if k != "params"}, **changed},
               [(p.shape, p.dtype) for p in group["params"]])
              for group, changed in zip(optimizer.param_groups, settings)]
    found = state_layout(type(optimizer), groups, {}, numbers=True)  # each group holds every setting
    return None if found is None else [keys for group in found for keys in group]


def _host(value: torch.Tensor) -> np.ndarray:
    full = value.full_tensor() if hasattr(value, "full_tensor") else value
    return (full.float() if full.dtype == torch.bfloat16 else full).detach().cpu().numpy()


__all__ = ["checked_settings", "load", "read"]
