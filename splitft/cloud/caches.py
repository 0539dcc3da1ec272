"""The key/value caches a session keeps for generation through the split.

When the edge generates with a transformers model, its decoder layers in the cloud need their
past keys and values at every new token. Those stay here: the edge sends a cache number
(:class:`splitft.wire.coding.CacheRef`), this store hands the cloud half the session's cache of that
number, and the cache's memory counts against the session's budget. The edge frees a cache
when its own cache object goes away; a session's caches go when the session ends.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..wire import tree as trees
from ..wire.coding import CacheRef
from ..errors import CapacityError, ConfigError, ProtocolError
from ..kv_caches import crop_held
from .blame import short

#: Caches one session may hold at once (one per generate() in flight; a finished one is freed).
MAX_CACHES = 4
#: The most sequences a cache change may leave in a cache (beams times prompts).
MAX_BATCH = 4096
#: The changes a generation makes to a cache, by the name of transformers' method for each.
_CHANGES = {"reorder": "reorder_cache", "select": "batch_select_indices", "repeat": "batch_repeat_interleave",
            "crop": "crop", "reset": "reset"}


_TOO_MANY = (f"this session already keeps {MAX_CACHES} key/value caches, one for each cache object alive on the edge "
             "that reached the cloud: a generation's, a copy of one, or the past_key_values of a forward with "
             "use_cache=True whose output the script keeps (transformers' models cache by default; pass "
             "use_cache=False where the cache is not used); let go of one before another starts")


class SessionCaches:
    """Cache number -> the cache the cloud half's layers update.

    Args:
        config: the transformers config the half's layers hold (:func:`model_config`), from which a
            cache makes each layer's kind of storage as the edge's generation does (a sliding
            window's layers keep only the window); None: every layer keeps all it is given.
    """

    def __init__(self, config: Any = None) -> None:
        self._caches: OrderedDict[int, Any] = OrderedDict()
        self.config = config

    def bind(self, tree: Any) -> Any:
        """``tree`` with each cache number replaced by this session's cache of that number."""
        return trees.rebuild(tree, lambda ref, path: self._get(ref.id),
                             is_leaf=lambda node: isinstance(node, CacheRef), other=lambda node, path: node)

    def _get(self, number: int, whole: bool = False) -> Any:
        """The cache of ``number``, made as the edge's generation makes one (from the model's config:
        a sliding window's layers keep only the window) unless ``whole`` (every layer keeps all)."""
        cache = self._caches.get(number)
        if cache is None:
            if len(self._caches) >= MAX_CACHES:
                raise CapacityError(_TOO_MANY)
            try:
                from transformers import DynamicCache
            except ImportError:
                raise ConfigError("the edge generates with a key/value cache, which needs transformers in the "
                                  "cloud: pip install transformers") from None
            cache = self._caches[number] = DynamicCache() if self.config is None or whole else \
                DynamicCache(config=self.config)
        return cache

    def hold_graphs(self, numbers: list[int]) -> bool:
        """Whether one of these caches holds an earlier call's graph (filled with gradients on)."""
        return any(isinstance(t, torch.Tensor) and t.requires_grad for number in numbers
                   for layer in getattr(self._caches.get(number), "layers", [])
                   for t in (getattr(layer, "keys", None), getattr(layer, "values", None)))

    def free(self, number: int) -> None:
        self._caches.pop(number, None)

    def change(self, number: int, kind: str, indices: Any, count: Any, fits: Callable[[int, str], None],
               source: Any = None) -> None:
        """What the edge's generation did to its cache ``number`` (beam search reordering it), done
        to this one: checked against its batch and priced against the session's memory first."""
        if not isinstance(kind, str) or kind not in (*_CHANGES, "copy", "whole") or not isinstance(number, int):
            raise ProtocolError(f"no cache change {short(kind)} of cache {short(number)}; known: "
                                f"{sorted([*_CHANGES, 'copy', 'whole'])}")
        if kind == "copy":
            self._copy(number, source, fits)
            return
        if kind == "whole":
            if number in self._caches:
                raise ProtocolError(f"cache {number} exists already: a cache is made whole as it begins")
            self._get(number, whole=True)
            return
        cache = self._caches.get(number)
        tensors = [t for layer in getattr(cache, "layers", []) for t in (getattr(layer, "keys", None),)
                   if isinstance(t, torch.Tensor) and t.dim() > 0]
        if cache is None or not tensors:
            return  # nothing the cloud's layers hold yet
        if kind == "reset":
            cache.reset()
            return
        batch, held = tensors[0].shape[0], self.nbytes_of(cache)
        if kind in ("reorder", "select"):
            if not (isinstance(indices, list) and 0 < len(indices) <= MAX_BATCH and all(
                    isinstance(i, int) and not isinstance(i, bool) and 0 <= i < batch for i in indices)):
                raise ProtocolError(f"a cache {kind} takes 1 to {MAX_BATCH} batch indices below {batch}, got "
                                    f"{short(indices)}")
            fits(held * len(indices) // batch, f"the key/value cache {kind}ed")
            getattr(cache, _CHANGES[kind])(torch.tensor(indices, dtype=torch.long, device=tensors[0].device))
        elif kind == "repeat":
            if not (isinstance(count, int) and not isinstance(count, bool) and 1 <= count and batch * count <= MAX_BATCH):
                raise ProtocolError(f"a cache repeat takes a count from 1 to {MAX_BATCH // batch}, got {short(count)}")
            fits(held * (count - 1), "the key/value cache repeated")
            cache.batch_repeat_interleave(count)
        else:
            if not (isinstance(count, int) and not isinstance(count, bool) and count <= 0):
                raise ProtocolError(f"a cache crop takes the tokens to drop as a count of 0 or less, got {short(count)}")
            crop_held(cache, count, type(cache).crop)

    def _copy(self, number: int, source: Any, fits: Callable[[int, str], None]) -> None:
        """Cache ``number`` (new) becomes a copy of cache ``source`` as it is now; nothing to copy
        where the cloud's layers never wrote ``source``."""
        if not isinstance(source, int) or isinstance(source, bool) or number in self._caches or source == number:
            raise ProtocolError(f"a cache copy makes a new cache from another, got {short(number)} from {short(source)}")
        cache = self._caches.get(source)
        if cache is None:
            return
        if len(self._caches) >= MAX_CACHES:
            raise CapacityError(_TOO_MANY)
        fits(self.nbytes_of(cache), "the key/value cache copied")
        self._caches[number] = copy.deepcopy(cache)

    @staticmethod
    def nbytes_of(cache: Any) -> int:
        total = 0
        for layer in getattr(cache, "layers", []):
            for name in ("keys", "values"):
                tensor = getattr(layer, name, None)
                if isinstance(tensor, torch.Tensor):
                    total += tensor.numel() * tensor.element_size()
        return total

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
        """Bytes the caches hold (read several times a step: a training session's has none, and no sum)."""
        return sum(self.nbytes_of(cache) for cache in self._caches.values()) if self._caches else 0


def model_config(half: nn.Module) -> Any:
    """The transformers config the layers of ``half`` hold (None where they hold none)."""
    for module in half.modules():
        config = getattr(module, "config", None)
        if type(config).__module__.startswith("transformers.") and callable(getattr(config, "to_dict", None)):
            return config
    return None


__all__ = ["MAX_BATCH", "MAX_CACHES", "SessionCaches", "model_config"]
