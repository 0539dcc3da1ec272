"""What state a ``torch.optim`` optimizer keeps per parameter, known without any parameter's values.

The edge shows the cloud half's optimizer state as placeholders with the real keys, shapes and
dtypes; the cloud checks a state an edge loads against the same. Both learn them by building the
optimizer class with the same settings over ``meta`` tensors shaped like the parameters, each
with a gradient, and stepping it once: nothing is allocated, and what the step makes is what a
real one makes (the settings that only choose a kernel or the step count's device, ``fused``,
``foreach``, ``capturable``, ``differentiable``, are off for it: they change no key).
"""

from __future__ import annotations

import math
from typing import Any

import torch

#: Settings that only choose how a step runs, not what state it keeps.
_HOW_IT_RUNS = {"fused": False, "foreach": False, "capturable": False, "differentiable": False}

#: One state value's layout: its shape and dtype; for a Python number, ``()`` and its type.
Layout = tuple[tuple[int, ...], Any]

#: State values an optimizer may keep as Python numbers (transformers' Adafactor's step count).
NUMBERS = (bool, int, float)


def state_layout(cls: type, groups: list[tuple[dict[str, Any], list[tuple[torch.Size, torch.dtype]]]],
                 settings: dict[str, Any], numbers: bool = False) -> list[list[dict[str, Layout]]] | None:
    """Per group, per parameter (given as its shape and dtype), the state ``cls`` keeps after a
    step with a gradient: state key → (shape, dtype) of its tensors ({} where it keeps none), and
    with ``numbers`` → ((), type) of the values it keeps as Python numbers. None when ``cls``
    cannot step over ``meta`` tensors (one that reads a value on the host)."""
    metas = [[torch.empty(shape, dtype=dtype, device="meta", requires_grad=True) for shape, dtype in params]
             for _, params in groups]
    if not any(metas):
        return [[] for _ in groups]
    for group in metas:
        for meta in group:
            meta.grad = torch.empty_like(meta)
    try:
        dry = cls([{**_how_it_runs(group_settings), "params": params}
                   for (group_settings, _), params in zip(groups, metas) if params], **_how_it_runs(settings))
        # The step beneath torch's hook wrapper: the process-wide step hooks (a script's step
        # counter, a gradient guard, splitft's own) are the script's optimizers' business.
        step = type(dry).step
        while getattr(step, STEP_GUARD, False):  # the edge's guard of a step that raises
            step = step.__wrapped__
        with torch.no_grad():
            (step.__wrapped__ if getattr(step, "hooked", False) else step)(dry)
    except Exception:  # noqa: BLE001 — any optimizer's own failure on meta tensors means: not known here
        return None
    return [[{key: (tuple(value.shape), value.dtype) if isinstance(value, torch.Tensor) else ((), type(value))
              for key, value in dry.state.get(meta, {}).items()
              if isinstance(value, torch.Tensor) or (numbers and isinstance(value, NUMBERS))}
             for meta in group] for group in metas]


def _how_it_runs(settings: dict[str, Any]) -> dict[str, Any]:
    return {**settings, **{key: off for key, off in _HOW_IT_RUNS.items() if key in settings}}


def same_kind(value: Any, current: Any) -> bool:
    """Whether ``value`` (a setting as msgpack carries it) may replace an optimizer setting now
    ``current``, on either side: a flag for a flag (or for None, where torch decides, as ``foreach``
    and ``fused`` default), a name for a name or None (Muon's ``adjust_lr_fn``), a finite number for
    a number, as many finite numbers or None for a tuple (Adafactor's ``eps``, ``(None, 1e-3)``)."""
    if isinstance(current, (tuple, list)):
        return (isinstance(value, list) and len(value) == len(current)
                and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
                        for v in value))
    if isinstance(current, str) or isinstance(value, str):
        return all(v is None or (isinstance(v, str) and len(v) <= _NAME_LENGTH) for v in (value, current))
    if current is None or value is None:
        return all(v is None or isinstance(v, bool) for v in (value, current))
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(current, bool)
    if isinstance(current, (int, float)):
        return isinstance(value, (int, float)) and math.isfinite(value)
    return False


#: The longest name a setting may be changed to (torch's are a few words: ``"match_rms_adamw"``).
_NAME_LENGTH = 64


#: Marks the edge's wrapper of an optimizer class's ``step`` (``splitft.edge.optimizers``), which
#: shows the cloud's gradients again when the step raises; the dry run above steps beneath it.
STEP_GUARD = "__splitft_guard__"


__all__ = ["NUMBERS", "STEP_GUARD", "Layout", "same_kind", "state_layout"]
