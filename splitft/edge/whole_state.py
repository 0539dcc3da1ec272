"""A split model's whole state through torch's state-dict API: the unsplit model's key names, the
cloud half's entries loaded in the cloud.

``load_state_dict`` splits what it is given: the cloud half's entries go to the cloud in one
``load`` operation (checked there before any of it loads), the rest loads into the wrapped model,
with the checkpoint's module versions; missing and unexpected keys and shape mismatches are
reported as torch reports them. A split model held by another module is reached by torch's own
load of that module (:func:`load_nested`), which then walks into the wrapped model under a prefix
where nothing is; :func:`forget_inner_keys` drops what that walk reports.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..cut import Chain
from ..errors import ConfigError, ProtocolError
from ..wire.operations import LoadWeights
from .cloud_half import values_to_send
from .fetched_state import FetchedCloudState
from .placeholders import CloudTensor
from .requests import EdgeSession
from .taken_before import loads_nothing


def load_whole_state(wrapped: nn.Module, state_dict: Mapping[str, Any], strict: bool, assign: bool, *,
                     cloud_names: set[str], cloud_params: set[str], session: EdgeSession,
                     moment: Callable[[], Hashable], chain: Chain) -> Any:
    """Load ``state_dict`` into the split model whose cloud half holds ``cloud_names`` (its
    parameters ``cloud_params``; its values as at the cut in ``chain``) and whose fetched entries
    are stamped by ``moment``."""
    if assign:
        _refuse_assigning_cloud_parameters(state_dict, cloud_names & cloud_params)
    own = {k: v for k, v in wrapped.state_dict(keep_vars=True).items() if k in cloud_names}
    shapes = {k: tuple(v.shape) for k, v in own.items()}
    cloud, errors = {}, []
    unchanged = loads_nothing(state_dict, chain)  # the live weight itself, unsplit: a copy onto itself
    unchanged |= {k for k, v in state_dict.items() if k in own and _same_placeholder(v, own[k])}
    for key, value in state_dict.items():
        if key in cloud_names and key not in unchanged:
            array = values_to_send(value)
            if array.shape == shapes[key]:
                cloud[key] = array
            else:
                errors.append(f"size mismatch for {key}: copying a param with shape {array.shape} from "
                              f"checkpoint, the shape in current model is {shapes[key]}.")
    if cloud:
        before = moment()
        session.outbox.queue(LoadWeights(weights=cloud, partial=cloud.keys() != cloud_names))
        session.sync()  # applied now, so a bad tensor is reported here
        for key in cloud:  # this model's fetched entry, just loaded, holds the cloud's values still
            value = state_dict[key]
            if (isinstance(value, FetchedCloudState) and value._splitft_now is moment
                    and value._splitft_moment == before):
                value._splitft_moment = moment()
    edge_part = OrderedDict((k, v) for k, v in state_dict.items() if k not in cloud_names)
    metadata = getattr(state_dict, "_metadata", None)
    if metadata is not None:  # each module's version, as torch keeps it: without it, its loader would
        edge_part._metadata = metadata  # type: ignore[attr-defined]  # migrate a current checkpoint as an old one
    try:
        result = wrapped.load_state_dict(edge_part, strict=False, assign=assign)
    except RuntimeError as exc:  # an edge tensor of another shape: torch loads the rest, then raises
        raise RuntimeError("\n\t".join([str(exc), *errors])) from None
    missing = [k for k in result.missing_keys if k not in state_dict]
    if errors or (strict and (missing or result.unexpected_keys)):
        raise RuntimeError(f"Error(s) in loading state_dict for {type(wrapped).__name__}: missing keys "
                           f"{missing[:5]}, unexpected keys {result.unexpected_keys[:5]}"
                           + "".join(f"\n\t{e}" for e in errors))
    return type(result)(missing, result.unexpected_keys)


def _same_placeholder(value: Any, own: Any) -> bool:
    """Whether ``value`` is the cloud tensor's own placeholder (or its ``.data`` / ``detach()``):
    the live weight, kept without a copy (``model.state_dict(keep_vars=True)``, ``{n: p.data}``),
    which unsplit loads onto itself and changes nothing."""
    return (isinstance(value, CloudTensor) and type(value) is type(own)
            and value._splitft_name == own._splitft_name and value._splitft_remote is own._splitft_remote)


def load_nested(model: nn.Module, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict,
                missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
    """torch's load of a module holding the split model ``model`` (its ``_load_from_state_dict``)."""
    mine = {key[len(prefix):]: value for key, value in state_dict.items() if key.startswith(prefix)}
    try:
        result = model.load_state_dict(mine, strict=False,
                                       assign=bool(local_metadata.get("assign_to_params_buffers", False)))
    except RuntimeError as exc:
        error_msgs.append(str(exc))
        return
    missing, unexpected = [prefix + k for k in result.missing_keys], [prefix + k for k in result.unexpected_keys]
    missing_keys.extend(missing)
    unexpected_keys.extend(unexpected)
    model.__dict__["_splitft_loading"] = (prefix + "model.", set(missing), set(unexpected))


def forget_inner_keys(model: nn.Module, incompatible: Any) -> None:
    """After torch's load walked into a nested split model's wrapped model: drop the keys that walk
    reported, which the split model's own load answered already."""
    loading = model.__dict__.pop("_splitft_loading", None)
    if loading is None:
        return
    inner, missing, unexpected = loading
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(inner) or k in missing]
    incompatible.unexpected_keys[:] = [k for k in incompatible.unexpected_keys
                                       if not k.startswith(inner) or k in unexpected]


def pending_cloud_grads(session: EdgeSession, names: Mapping[str, torch.Tensor],
                        pending: set[str]) -> dict[str, np.ndarray]:
    """The cloud's gradients, where backward passes summed some that no step or ``zero_grad`` took
    yet (``pending``): ``unsplit()`` between a backward and its step hands them to the whole model,
    whose parameters would hold them unsplit. Checked against ``names`` (the cloud parameters'
    placeholders by name): one of another name or shape is the cloud's error, before anything changes."""
    if not pending:
        return {}
    grads = session.sync_reply(want_grads=True).grads
    if not isinstance(grads, dict):
        raise ProtocolError(f"the cloud answered a request for its gradients with {type(grads).__name__}")
    for name, array in grads.items():
        param = names.get(name) if isinstance(name, str) else None
        if param is None or not isinstance(array, np.ndarray) or tuple(array.shape) != tuple(param.shape):
            raise ProtocolError(f"the cloud sent a gradient for {name!r} of shape {getattr(array, 'shape', '?')}, "
                                "which is not one of its half's parameters' (their names and shapes)")
    return grads


def put_grads(whole: nn.Module, grads: Mapping[str, np.ndarray]) -> None:
    """``grads`` (by parameter name) as the ``.grad`` of ``whole``'s parameters, in their dtype and device."""
    for name, array in grads.items():
        param = whole.get_parameter(name)
        param.grad = torch.tensor(array).to(dtype=param.dtype, device=param.device)


def _refuse_assigning_cloud_parameters(state_dict: Mapping[str, Any], cloud_params: set[str]) -> None:
    """``load_state_dict(assign=True)`` puts new parameter objects in the model, in the checkpoint's
    dtype: an optimizer built before it keeps the old ones, so unsplit it no longer trains the
    model. The cloud half's parameters stay the objects every optimizer holds (their values are
    loaded), so that cannot be repeated: refused before anything loads."""
    given = sorted(k for k in state_dict if k in cloud_params)
    if given:
        raise ConfigError(f"load_state_dict(assign=True) would replace cloud parameter {given[0]!r} "
                          f"({len(given)} in all) with new objects: an optimizer built before the load would keep "
                          "the old ones and, unsplit, no longer train the model, while the cloud half keeps its "
                          "parameters (it loads their values). Load with assign=False (the values load the same; "
                          "build the optimizer after the load for one over the loaded weights), or load before split()")


__all__ = ["forget_inner_keys", "load_nested", "load_whole_state"]
