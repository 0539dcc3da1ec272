"""A forward repeated for another loss of one ``model(x)``: exact, or refused.

Unsplit, ``loss = crit(out, y)`` and a metric ``crit(out, y)`` logged beside it read one run of
the cloud half. Split, the loss is computed in the cloud, so the second call runs the half again
(``forward.again``) from the state the first left. That reproduces the first run when the first
changed nothing the half reads: the session's generator is put back to where the first run began
(:meth:`CloudSession._traceless`), and normalisation layers in training mode update running
statistics their output does not read. Any other state a forward moves (a buffer it updates in
place, such as an average of its activations or a queue of embeddings, a Python counter, a list
it appends to, a generator a module holds) would make the repeat compute from the state after
the first run: the second loss would differ from the unsplit one. So that state is read before the
repeat, put back after it, and the repeat is refused if it moved any of it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.modules.batchnorm import _NormBase

from ..cut import Chain
from ..errors import ModelError

_PLAIN = (bool, int, float, complex, str, bytes, type(None))


def _named_modules(chain: Chain) -> Iterator[tuple[str, nn.Module]]:
    for name, stage in zip(chain.names, chain.stages):
        yield from stage.named_modules(prefix=name)


def _generator_state(value: Any) -> Any:
    """A generator's state, copied, or None for a value that is none."""
    if isinstance(value, torch.Generator):
        return value.get_state()
    if isinstance(value, random.Random):
        return value.getstate()
    if isinstance(value, np.random.Generator):
        return value.bit_generator.state
    if isinstance(value, np.random.RandomState):
        return value.get_state()
    return None


def _set_generator_state(value: Any, state: Any) -> None:
    if isinstance(value, torch.Generator):
        value.set_state(state)
    elif isinstance(value, random.Random):
        value.setstate(state)
    elif isinstance(value, np.random.Generator):
        value.bit_generator.state = state
    else:
        value.set_state(state)


def _same_generator_state(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, tuple) and len(a) == 5 and isinstance(a[1], np.ndarray):  # RandomState.get_state()
        return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]
    return bool(a == b)


class Snapshot:
    """The state of a cloud half's modules that a forward may move, read before a repeated forward."""

    def __init__(self, chain: Chain) -> None:
        self.buffers: list[tuple[str, torch.Tensor, torch.Tensor, bool]] = []
        self.attributes: list[tuple[str, nn.Module, str, Any]] = []
        for path, module in _named_modules(chain):
            statistics = isinstance(module, _NormBase) and module.training
            for name, buffer in module.named_buffers(recurse=False):
                self.buffers.append((f"{path}.{name}", buffer, buffer.detach().clone(), statistics))
            for key, value in vars(module).items():
                if key.startswith("_splitft") or key in _TORCH_OWN:
                    continue
                if isinstance(value, _PLAIN):
                    self.attributes.append((f"{path}.{key}", module, key, ("value", value)))
                elif isinstance(value, list):
                    self.attributes.append((f"{path}.{key}", module, key, ("list", value, list(value))))
                elif (state := _generator_state(value)) is not None:
                    self.attributes.append((f"{path}.{key}", module, key, ("generator", value, state)))

    def put_back(self) -> list[str]:
        """Put the state back as it was read; the names of what the repeat moved (normalisation
        layers' running statistics in training mode aside)."""
        moved = []
        with torch.no_grad():
            for name, buffer, before, statistics in self.buffers:
                if not torch.equal(buffer, before):
                    buffer.data.copy_(before)  # not a new version: a graph may hold the buffer
                    if not statistics:
                        moved.append(name)
        for name, module, key, (kind, *was) in self.attributes:
            now = vars(module).get(key, _MISSING)
            if kind == "value":
                if now is _MISSING or type(now) is not type(was[0]) or now != was[0]:
                    moved.append(name)
                    setattr(module, key, was[0])
            elif kind == "list":
                items, before = was
                if now is not items or len(items) != len(before) or any(a is not b for a, b in zip(items, before)):
                    moved.append(name)
                    items[:] = before
                    setattr(module, key, items)
            else:
                generator, state = was
                if now is not generator or not _same_generator_state(_generator_state(generator), state):
                    moved.append(name)
                    _set_generator_state(generator, state)
                    setattr(module, key, generator)
        return moved


def refuse_moved(moved: list[str]) -> None:
    """Refuse a repeated forward that moved the half's own state (see the module's docstring)."""
    if moved:
        raise ModelError(
            f"a second loss of one model(x) runs the cloud half again, and its forward moved {moved[0]!r}"
            f"{f' (and {len(moved) - 1} more)' if len(moved) > 1 else ''}, which it keeps from call to call (a "
            "buffer updated in place, a counter, a list, a generator it holds): the second run would start from "
            "what the first left, and its loss would differ from the unsplit one. Compute the second value from the "
            "first loss (loss.item()), or from one call: run the model again (model(x)) for another loss, or cut a "
            "U-shape so the loss is computed on the edge from the one output")


_MISSING = object()
#: What torch keeps in a module's ``__dict__`` itself (hooks, tables, its mode).
_TORCH_OWN = frozenset({"training", "_parameters", "_buffers", "_modules", "_non_persistent_buffers_set",
                        "_backward_pre_hooks", "_backward_hooks", "_is_full_backward_hook", "_forward_hooks",
                        "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                        "_forward_pre_hooks_with_kwargs", "_state_dict_hooks", "_state_dict_pre_hooks",
                        "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks"})


__all__ = ["Snapshot", "refuse_moved"]
