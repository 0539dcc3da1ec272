"""Tensors a script took from the cloud half's weights before ``split()``, given back to a load.

``init = net.state_dict()`` (no copy) before ``split()`` holds tensors that share memory with
the cloud half's parameters and buffers. Unsplit they are the live weights: a k-fold loop's
``model.load_state_dict(init)`` copies each weight onto itself and changes nothing. Split, the
weights live in the cloud and that memory kept the values of the cut, so sending it would rewind
the cloud half: a silent divergence. A load therefore recognises them by their memory (the edge's
twins of the cloud modules hold it, :class:`~splitft.cut.Chain`) and does as unsplit: a tensor
loaded into the weight it was taken from loads nothing; one loaded anywhere else (another key,
another split model) is refused, naming a copy taken after ``split()`` instead.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..cut import Chain
from ..errors import ConfigError

#: The twins of every split model of this process (their memory is what a script may still hold).
_CHAINS: weakref.WeakSet[Chain] = weakref.WeakSet()

_PLAIN = (torch.Tensor, nn.Parameter)


def remember(chain: Chain) -> None:
    """Watch ``chain``'s memory for loads of tensors taken before its split."""
    _CHAINS.add(chain)


def _view(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tensor.storage_offset(), tuple(tensor.shape), tensor.stride()


def _cut_memory() -> dict[int, tuple[Chain, list[tuple[str, tuple]]]]:
    """Each storage of the cloud halves' values as at their cut, by address: its chain and the
    weights in it (name and view)."""
    found: dict[int, tuple[Chain, list[tuple[str, tuple]]]] = {}
    for chain in list(_CHAINS):
        for name, twin in chain.qualified_state_dict().items():
            # after unsplit() the twins hold the placeholders (the values went back to the model)
            if type(twin) not in _PLAIN or twin.layout != torch.strided or twin.device.type == "meta":
                continue
            storage = twin.untyped_storage()
            if storage.nbytes():
                found.setdefault(storage.data_ptr(), (chain, []))[1].append((name, _view(twin)))
    return found


def loads_nothing(state_dict: Mapping[str, Any], chain: Chain) -> set[str]:
    """The keys of ``state_dict`` that hold, unchanged, the weight of ``chain`` they name, taken
    before the split: unsplit, loading them changes nothing. Raises for such a tensor given to
    another key or another split model."""
    memory: dict[int, tuple[Chain, list[tuple[str, tuple]]]] | None = None
    same: set[str] = set()
    for key, value in state_dict.items():
        if type(value) not in _PLAIN or value.layout != torch.strided or value.device.type == "meta":
            continue
        storage = value.untyped_storage()
        if not storage.nbytes():
            continue
        if memory is None:
            memory = _cut_memory()
        held = memory.get(storage.data_ptr())
        if held is None:
            continue
        owner, weights = held
        if owner is chain and (key, _view(value)) in weights:
            same.add(key)
            continue
        taken = next((name for name, _ in weights), "?")
        raise ConfigError(
            f"the tensor given for {key!r} was taken from the model before split() (from {taken!r}, without a copy: "
            "net.state_dict() or .data shares the weights' memory). Unsplit it would be that weight's value now; "
            "split, the weight trains in the cloud and this memory kept its value at the cut, so loading it would "
            "silently differ. Take the state after split() (model.state_dict(), which fetches the cloud's values), "
            "or copy it before split() (copy.deepcopy(net.state_dict()))")
    return same


__all__ = ["loads_nothing", "remember"]
