"""An optimizer's state dict as torch's own load takes it, for both halves of a split model.

The cloud half's state values travel as arrays and come back as the tensors the unsplit
optimizer would hold (:func:`local_value`, :func:`placed`, :func:`wire_value`); the optimizer's
load hooks run once over the whole state dict, as torch runs them, not once per half
(:func:`pre_hooked`, :func:`load_hooks_aside`).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..optimizer_layout import Layout
from .placeholders import RemoteTensor

LOAD_PRE_HOOKS, LOAD_POST_HOOKS = "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"


#: An entry of a cloud parameter that is not the optimizer's state: loaded, or (``False``) held before attachment.
NOT_ITS_STATE = {
    True: "{name}.load_state_dict: the entry of cloud parameter {pname!r} is not the state this {name} keeps ({keys} "
          "with their shapes): a state dict of another optimizer or model?",
    False: "this {name} holds an entry for cloud parameter {pname!r} that is not the state it keeps ({keys} with their "
           "shapes), written before it was attached (opt.state[p][key] = ..., as SAM keeps the weights before its "
           "perturbation): the cloud's copy of the optimizer keeps the cloud half's state, which the edge cannot set. "
           "Keep such values in a dict of the script's own ({{p: p.detach().clone() for p in params}})",
}


def pre_hooked(optimizer: torch.optim.Optimizer, saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` as the optimizer's load pre-hooks leave it, run as torch's load runs them."""
    saved = saved.copy()  # what torch's load hands its hooks
    for hook in list(getattr(optimizer, LOAD_PRE_HOOKS, {}).values()):
        changed = hook(optimizer, saved)
        if changed is not None:
            saved = changed
    return saved


@contextlib.contextmanager
def load_hooks_aside(optimizer: torch.optim.Optimizer, post: bool) -> Iterator[None]:
    """Torch's load within runs no pre-hook (they ran on the whole state dict), nor, with
    ``post``, a post-hook. The tables are the optimizer's own: no other optimizer is touched."""
    tables = (LOAD_PRE_HOOKS, LOAD_POST_HOOKS) if post else (LOAD_PRE_HOOKS,)
    kept = {table: vars(optimizer)[table] for table in tables if table in vars(optimizer)}
    for table in kept:
        setattr(optimizer, table, collections.OrderedDict())
    try:
        yield
    finally:
        for table, hooks in kept.items():
            setattr(optimizer, table, hooks)


def local_value(array: Any, placeholder: Any) -> torch.Tensor:
    """A fetched value (an optimizer's state, a cloud weight) as the unsplit model or optimizer
    holds it: in the placeholder's dtype (bfloat16 travels as float32)."""
    value = torch.tensor(array)
    return value.to(placeholder.dtype) if isinstance(placeholder, torch.Tensor) else value


def placed(param: torch.Tensor, key: str, value: torch.Tensor, index: int, groups: list) -> torch.Tensor:
    """A state value where torch's ``load_state_dict`` puts it for ``param`` (its dtype and device,
    a step count as it is)."""
    return torch.optim.Optimizer._process_value_according_to_param_policy(param, value, index, groups, key)


def wire_value(value: torch.Tensor) -> Any:
    """A state value as it travels (bfloat16, which numpy lacks, as float32: exact)."""
    value = value.detach().cpu()
    return (value.float() if value.dtype == torch.bfloat16 else value).numpy().copy()


def by_place(saved: dict[str, Any]) -> tuple[dict[Any, int], dict[int, Any]]:
    """A state dict's entries by their keys' places in its groups' params, as torch's load matches
    them to the optimizer's parameters (the keys are positions, or the parameter names
    ``torch.distributed.checkpoint``'s state dicts use): (place of each key, entry by place)."""
    place = {k: i for i, k in enumerate(k for group in saved.get("param_groups", ()) if isinstance(group, dict)
                                         for k in group.get("params", ()))}
    return place, {place[k]: entry for k, entry in saved.get("state", {}).items() if k in place}


def fits(value: Any, layout: Layout) -> bool:
    """Whether a state value is of the layout the optimizer keeps: a tensor of that shape, or a
    Python number of that type."""
    shape, kind = layout
    if isinstance(kind, torch.dtype):
        return isinstance(value, torch.Tensor) and not isinstance(value, RemoteTensor) and tuple(value.shape) == shape
    return type(value) is kind


__all__ = ["NOT_ITS_STATE", "by_place", "fits", "load_hooks_aside", "local_value", "placed", "pre_hooked", "wire_value"]
