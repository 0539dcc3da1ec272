"""The codec that changes nothing: the baseline every other codec is measured against."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from . import _wire
from ._device import ALIGNMENT
from .base import Codec, CodecContext, Payload, to_numpy
from .errors import CompressionError
from .registry import register


@register
class Identity(Codec):
    """Sends the tensor as it is, in its own dtype. Split training through it equals local training."""

    name = "identity"

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        if x.is_cpu and x.is_contiguous() and x.dtype != torch.bfloat16:  # the common case, checked least
            return Payload(self.name, self.version, {"x": (x.detach() if x.requires_grad else x).numpy()})
        meta: dict[str, Any] = {}
        order = None if x.is_contiguous() else dense_order(x)
        if order is not None:  # its bytes as they lie, and the order of its dimensions in them
            x, meta["order"] = x.permute(order), order
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: its 16 bits travel as uint16, exactly
            meta["dtype"] = "bfloat16"
            return Payload(self.name, self.version, {"x": to_numpy(x.view(torch.uint16))}, meta)
        return Payload(self.name, self.version, {"x": to_numpy(x)}, meta)

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        self.check(payload)
        meta = payload.meta
        if not meta:
            return _wire.tensor(_wire.array(payload, "x"), ctx.device)
        if set(meta) - {"dtype", "order"} or meta.get("dtype", "bfloat16") != "bfloat16":
            raise CompressionError(f"identity payload metadata may hold 'dtype' ('bfloat16') and 'order', "
                                   f"got {str(meta)[:80]}")
        bf16 = "dtype" in meta
        array = _wire.array(payload, "x", dtype=np.uint16) if bf16 else _wire.array(payload, "x")
        order = meta.get("order")
        if order is not None and not (isinstance(order, list) and all(type(d) is int for d in order)
                                      and sorted(order) == list(range(array.ndim))):
            raise CompressionError(f"identity payload 'order' must list the array's {array.ndim} dimensions, "
                                   f"got {str(order)[:80]}")
        tensor = _wire.tensor(array, ctx.device)
        if bf16:  # integers may stay where they were received; floats are computed from aligned memory
            tensor = (tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()).view(torch.bfloat16)
        return tensor if order is None else tensor.permute([order.index(d) for d in range(len(order))])

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The array itself: decode copies it once when it is read-only (received bytes)."""
        self.check(payload)
        return int(_wire.array(payload, "x").nbytes)


def dense_order(x: torch.Tensor) -> list[int] | None:
    """The order of ``x``'s dimensions in memory, outermost first, where ``x`` is a permutation of
    a contiguous tensor (a transpose, ``channels_last``): sent in that order and permuted back, it
    arrives with the sender's strides, and what is computed from it rounds as the sender's would.
    None where it is not (a slice, an expanded tensor): those travel contiguous."""
    if x.dim() < 2:
        return None
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return order if order != list(range(x.dim())) and x.permute(order).is_contiguous() else None
