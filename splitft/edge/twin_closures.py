"""Functions a cloud module keeps as attributes that reach its own modules or tensors: minGPT's
``m = self.mlp; self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))``, a bound method
kept as ``self.act = self._gelu``. The edge's twin of the module (:mod:`.ghosts`) shares the
module's other attributes, so its copy of such a function would call the original modules, whose
children are the edge's stand-ins; the cloud's module, built anew by the factory, calls its own.
:func:`rebind` gives each twin a copy of the function over the twins, as the cloud's has.
"""

from __future__ import annotations

import types
from typing import Any

from torch import nn

_EMPTY = object()


def rebind(memo: dict[int, Any]) -> None:
    """Point the functions kept by the twins in ``memo`` (original's id -> twin, modules and
    tensors) at the twins of what they reach."""
    for twin in list(memo.values()):
        if isinstance(twin, nn.Module):
            state = twin.__dict__
            for key, value in list(state.items()):
                moved = _moved(value, memo)
                if moved is not value:
                    state[key] = moved


def _moved(value: Any, memo: dict[int, Any]) -> Any:
    if isinstance(value, types.MethodType):
        owner = memo.get(id(value.__self__))
        return value if owner is None else types.MethodType(value.__func__, owner)
    if not isinstance(value, types.FunctionType) or not value.__closure__:
        return value
    contents = [_contents(cell) for cell in value.__closure__]
    if not any(id(c) in memo for c in contents if c is not _EMPTY):
        return value
    cells = tuple(types.CellType() if c is _EMPTY else types.CellType(memo.get(id(c), c)) for c in contents)
    moved = types.FunctionType(value.__code__, value.__globals__, value.__name__, value.__defaults__, cells)
    moved.__kwdefaults__, moved.__qualname__ = value.__kwdefaults__, value.__qualname__
    moved.__dict__.update(value.__dict__)
    return moved


def _contents(cell: types.CellType) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a cell not filled yet
        return _EMPTY


__all__ = ["rebind"]
