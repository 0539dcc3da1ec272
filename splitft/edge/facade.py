"""What a split model looks like from outside: the model it wraps.

Libraries read a model's class and its forward's signature: ``transformers.Trainer`` keeps the
dataset columns the forward names and finds the labels there, and saves a ``PreTrainedModel`` or
a ``PeftModel`` with ``save_pretrained``. The split model's class is made per wrapped class so it
answers both as the wrapped model does.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch.fx
from torch import nn

from ..errors import ConfigError
from .ghost_classes import Ghost
from .model import SplitModel


#: torch.fx.symbolic_trace or torch.export of a split model.
TRACED = ("torch.fx.symbolic_trace / torch.export of a split model: the trace would record the edge's half and a "
          "call of the cloud it cannot run (its tensors are placeholders here). Trace edge modules alone, or export "
          "the model model.unsplit() gives (which ends the session)")


@functools.lru_cache(maxsize=None)
def split_class(model_class: type[nn.Module]) -> type[SplitModel]:
    """The SplitModel subclass for models of ``model_class``: its ``forward`` has their forward's
    signature (plus ``sample_ids``), so callers that read it see the model they know —
    ``transformers.Trainer`` keeps the dataset columns the forward names and finds the labels in
    it, on the class."""
    try:
        signature = inspect.signature(model_class.forward)
    except (TypeError, ValueError):
        return SplitModel
    params = list(signature.parameters.values())
    if "sample_ids" not in signature.parameters:
        extra = inspect.Parameter("sample_ids", inspect.Parameter.KEYWORD_ONLY, default=None)
        at = next((i for i, p in enumerate(params) if p.kind is p.VAR_KEYWORD), len(params))
        params.insert(at, extra)

    def forward(self: SplitModel, *args: Any, **kwargs: Any) -> Any:
        if getattr(torch.fx._symbolic_trace, "_is_fx_tracing_flag", False):  # is_fx_tracing() logs each call
            raise ConfigError(TRACED)
        return SplitModel.forward(self, *args, **kwargs)

    forward.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    forward.__doc__ = SplitModel.forward.__doc__
    members: dict[str, Any] = {"forward": forward, "__module__": __name__}
    for name in _READING:  # model[-1], len(model), for block in model: Python looks these up on the class
        if _defines(model_class, name):
            members[name] = _to_wrapped(name)
    if issubclass(model_class, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
        for name in _REPLACING:
            if _defines(model_class, name):
                members[name] = _refuse_replacing
        members["__setitem__"] = _set_item
    # isinstance(model, Net) holds, as for the model the user split: a script that picks its parameter groups
    # by class, a utility that checks for nn.Sequential; Trainer and Accelerate find a PreTrainedModel or
    # PeftModel and save with save_pretrained (a PEFT model's adapter files, a config) and load back.
    members["__class__"] = property(lambda self: model_class)
    return type(f"Split{model_class.__name__}", (SplitModel,), members)


#: A container's reading methods, answered by the wrapped model (its modules, the cloud's as ghosts).
_READING = ("__getitem__", "__len__", "__iter__", "__contains__", "__reversed__")
#: torch's containers' methods that put another module in place of one: the cut is made.
_REPLACING = ("__setitem__", "__delitem__", "append", "extend", "insert", "pop", "update", "clear")


def _defines(model_class: type, name: str) -> bool:
    """Whether ``model_class`` has ``name`` where a plain module has not (a container's)."""
    return getattr(model_class, name, None) is not None and getattr(nn.Module, name, None) is None


def _to_wrapped(name: str) -> Any:
    def method(self: SplitModel, *args: Any) -> Any:
        return getattr(self.wrapped, name)(*args)

    method.__name__ = name
    return method


def _set_item(self: SplitModel, index: Any, module: Any) -> None:
    """``model[i] = layer``: an edge module replaced in place (an activation swapped, a layer made
    anew), as ``setattr`` of its name replaces it; a module that is or holds a cloud one cannot be."""
    wrapped: Any = self.wrapped  # a torch container
    try:
        current = wrapped[index]
    except (IndexError, KeyError, TypeError):
        current = None
    if isinstance(current, nn.Module) and not any(isinstance(m, Ghost) for m in current.modules()):
        wrapped[index] = module
        return
    _refuse_replacing(self)


def _refuse_replacing(self: SplitModel, *args: Any, **kwargs: Any) -> Any:
    raise ConfigError(f"{type(self.wrapped).__name__}'s modules cannot be added, replaced or removed once it is split: "
                      "the cloud half is built from the model as it was cut; change the model, then split it")


__all__ = ["split_class"]
