"""The cloud decoder layers' entries in the edge's key/value cache: their shapes, without values.

transformers sizes a forward's attention masks from the cache, on the edge, before any layer runs
(``get_mask_sizes`` of the first layer of each kind: full attention, a sliding window), and answers
``get_seq_length`` from it. The cloud layers' keys and values stay in the cloud, so their entries
here would stay empty, and a model whose first full-attention layer runs in the cloud (Gemma 2 and
3 interleave sliding and full layers) would get masks sized for no past: its padded, chunked or
assisted generation would attend where the unsplit model does not. After each call through the
cloud, those entries grow by the call's tokens as :class:`ShadowKV`, the shape of keys (batch, one
head, tokens, one channel) on the meta device, which the cache's own code crops, reorders,
selects, repeats and resets as it would the real ones, and which refuses to be read.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree

from ..errors import CutError
from .metadata import METADATA

#: What the cache's own code does to a layer's keys and values: each gives a shape from shapes.
_SHAPE_OPS = frozenset({torch.cat, torch.Tensor.__getitem__, torch.Tensor.index_select, torch.Tensor.repeat_interleave,
                        torch.repeat_interleave, torch.Tensor.narrow, torch.Tensor.contiguous, torch.Tensor.to,
                        torch.Tensor.detach})


class ShadowKV(torch.Tensor):
    """A cloud layer's keys or values in the edge's cache: a shape, no values (see the module)."""

    _splitft_meta: torch.Tensor

    @staticmethod
    def __new__(cls, meta: torch.Tensor, dtype: torch.dtype, device: torch.device) -> ShadowKV:
        made: Any = torch.Tensor._make_wrapper_subclass(cls, meta.shape, dtype=dtype, device=device)
        made._splitft_meta = meta
        return made

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's: unannotated
        return f"ShadowKV(a cloud decoder layer's keys or values, kept in the cloud; shape={tuple(self.shape)})"

    def __deepcopy__(self, memo: dict) -> ShadowKV:
        return ShadowKV(self._splitft_meta, self.dtype, self.device)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise _refusal("saving")

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func not in _SHAPE_OPS:
            raise _refusal(str(getattr(func, "__qualname__", None) or getattr(func, "__name__", func)))
        model = next(t for t in _pytree.tree_leaves((args, kwargs)) if isinstance(t, ShadowKV))
        out = func(*_pytree.tree_map(_as_meta, args), **_pytree.tree_map(_as_meta, kwargs))
        return ShadowKV(out, model.dtype, model.device) if isinstance(out, torch.Tensor) else out

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's default is a plain function
            cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise _refusal(str(func))


def _as_meta(value: Any) -> Any:
    if isinstance(value, ShadowKV):
        return value._splitft_meta
    if isinstance(value, torch.Tensor):
        if value.dtype == torch.bool:  # a mask selects by its values: the rows it keeps, by number
            value = value.nonzero().squeeze(-1)
        return value.to("meta")
    if isinstance(value, torch.device):
        return torch.device("meta")
    return value


def _refusal(what: str) -> CutError:
    return CutError(f"{what} on the keys or values of a decoder layer that runs in the cloud: they stay there (the "
                    "edge's cache holds their shape only, for the masks it sizes). Read the edge layers' entries, or "
                    "the whole cache of the unsplit model (model.unsplit())")


def decoder_layers(modules: Iterable[nn.Module]) -> list[int]:
    """The cache indices of the decoder layers among ``modules`` (transformers' attention modules
    carry their ``layer_idx``)."""
    found: set[int] = set()
    for module in modules:
        for m in module.modules():
            index = getattr(m, "layer_idx", None)
            if isinstance(index, int) and not isinstance(index, bool):
                found.add(index)
    return sorted(found)


#: Each followed cache's cloud-layer entries as splitft last left them: one replaced since was
#: replaced by the script (a cache edited by hand), which the cloud's part would not follow.
_LEFT: weakref.WeakKeyDictionary[Any, list[tuple[int, Any, Any]]] = weakref.WeakKeyDictionary()


def mark(cache: Any, layers: list[int]) -> None:
    """The cloud ``layers``' entries of ``cache`` are as the cloud's part of it is now."""
    held = getattr(cache, "layers", [])
    _LEFT[cache] = [(i, getattr(held[i], "keys", None), getattr(held[i], "values", None))
                    for i in layers if i < len(held)]


def refuse_edits(cache: Any) -> None:
    """Refuse a cache whose cloud-layer entries the script replaced since (keys cut by hand to
    evict old tokens): the cloud's part of it would not follow, and the call would attend to them."""
    held = getattr(cache, "layers", [])
    for i, keys, values in _LEFT.get(cache, ()):
        if i < len(held) and (getattr(held[i], "keys", None) is not keys or getattr(held[i], "values", None) is not values):
            raise CutError(f"the keys or values of cache layer {i}, a decoder layer that runs in the cloud, were changed "
                           "outside the cache's own methods (crop, reorder_cache, batch_select_indices, "
                           "batch_repeat_interleave, reset, which reach the cloud): the cloud's part of the cache "
                           "would not follow. Change the cache through those, or use the unsplit model")


def grow(cache: Any, layers: list[int], batch: int, tokens: int, dtype: torch.dtype, device: torch.device) -> None:
    """The cloud ``layers``' entries of the edge's ``cache`` after a call that gave them ``tokens``
    more tokens for each of ``batch`` sequences, updated as the cache updates its layers."""
    update = getattr(cache, "update", None)
    if update is None or tokens <= 0:
        return
    meta = torch.empty(batch, 1, tokens, 1, device="meta")
    for index in layers:
        update(ShadowKV(meta, dtype, device), ShadowKV(meta, dtype, device), index)
    mark(cache, layers)


__all__ = ["ShadowKV", "decoder_layers", "grow", "mark", "refuse_edits"]
