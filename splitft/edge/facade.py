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

from torch import nn

from .model import SplitModel


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
        return SplitModel.forward(self, *args, **kwargs)

    forward.__signature__ = signature.replace(parameters=params)  # type: ignore[attr-defined]
    forward.__doc__ = SplitModel.forward.__doc__
    members: dict[str, Any] = {"forward": forward, "__module__": __name__}
    if any(c.__module__.split(".")[0] in ("transformers", "peft") and c.__name__ in ("PreTrainedModel", "PeftModel")
           for c in model_class.__mro__):
        # isinstance(model, PreTrainedModel / PeftModel) holds, as for the model the user split: Trainer and
        # Accelerate then save with save_pretrained (a PEFT model's adapter files, a config) and load back.
        members["__class__"] = property(lambda self: model_class)
    return type(f"Split{model_class.__name__}", (SplitModel,), members)


__all__ = ["split_class"]
