"""The key/value caches a session keeps for generation through the split.

When the edge generates with a transformers model, its decoder layers in the cloud need their
past keys and values at every new token. Those stay here: the edge sends a cache number
(:class:`splitft.wire.coding.CacheRef`), this store hands the cloud half the session's cache of that
number, and the cache's memory counts against the session's budget. The edge frees a cache
when its own cache object goes away; a session's caches go when the session ends.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from ..wire import tree as trees
from ..wire.coding import CacheRef
from ..errors import CapacityError, ConfigError

#: Caches one session may hold at once (one per generate() in flight; a finished one is freed).
MAX_CACHES = 4


class SessionCaches:
    """Cache number -> the cache the cloud half's layers update."""

    def __init__(self) -> None:
        self._caches: OrderedDict[int, Any] = OrderedDict()

    def bind(self, tree: Any) -> Any:
        """``tree`` with each cache number replaced by this session's cache of that number."""
        return trees.rebuild(tree, lambda ref, path: self._get(ref.id),
                             is_leaf=lambda node: isinstance(node, CacheRef), other=lambda node, path: node)

    def _get(self, number: int) -> Any:
        cache = self._caches.get(number)
        if cache is None:
            if len(self._caches) >= MAX_CACHES:
                raise CapacityError(f"this session already keeps {MAX_CACHES} key/value caches; finish (or drop) a "
                                    "generation before starting another")
            try:
                from transformers import DynamicCache
            except ImportError:
                raise ConfigError("the edge generates with a key/value cache, which needs transformers in the "
                                  "cloud: pip install transformers") from None
            cache = self._caches[number] = DynamicCache()
        return cache

    def free(self, number: int) -> None:
        self._caches.pop(number, None)

    @staticmethod
    def named(tree: Any) -> list[int]:
        """The cache numbers ``tree`` names."""
        return [ref.id for ref in trees.leaves(tree, is_leaf=lambda node: isinstance(node, CacheRef))]

    def drop(self, numbers: list[int]) -> None:
        """Free these caches (a forward that failed, or went over the budget)."""
        for number in numbers:
            self.free(number)

    def clear(self) -> None:
        self._caches.clear()

    def nbytes(self) -> int:
        total = 0
        for cache in self._caches.values():
            for layer in getattr(cache, "layers", []):
                for name in ("keys", "values"):
                    tensor = getattr(layer, name, None)
                    if isinstance(tensor, torch.Tensor):
                        total += tensor.numel() * tensor.element_size()
        return total


__all__ = ["MAX_CACHES", "SessionCaches"]
