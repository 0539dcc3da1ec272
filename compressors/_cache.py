"""A small cache that a codec instance owns, keeping only its most recently used entries.

Codecs cache what they derive from a row size (keys, spectra, warm starts, checksum weights).
Row sizes come from payloads, which a peer controls: a cache keyed by them must be bounded and
must belong to the codec (so it ends with the session), never to a module.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import numpy as np
import torch

from .errors import CompressionError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def nbytes_of(value: Any) -> int:
    """Bytes of tensors and arrays in ``value`` (a tensor, an array, or tuples/lists of them)."""
    if isinstance(value, torch.Tensor):
        return value.element_size() * value.nelement()
    if isinstance(value, np.ndarray):
        return int(value.nbytes)
    if isinstance(value, (tuple, list)):
        return sum(nbytes_of(v) for v in value)
    return 0


class LRU(Generic[K, V]):
    """At most ``size`` entries; using or adding one makes it the newest, and adding beyond
    ``size`` drops the oldest. Dropped entries are recomputed when needed again."""

    def __init__(self, size: int) -> None:
        if not isinstance(size, int) or size < 1:
            raise CompressionError(f"cache size must be an int >= 1, got {size!r}")
        self.size = size
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The entry for ``key``, made by ``make()`` (and kept) when it is not held."""
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        value = make()
        self.put(key, value)
        return value

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.size:
            self._items.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def items(self) -> Iterator[tuple[K, V]]:
        return iter(list(self._items.items()))

    def clear(self) -> None:
        self._items.clear()

    def nbytes(self) -> int:
        """Bytes of the tensors and arrays held (keys and bookkeeping not counted)."""
        return sum(nbytes_of(v) for v in self._items.values())
