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
        elif not x.is_contiguous() and gapped(x.shape, x.stride()):  # its values, and the strides to lay them out
            meta["strides"] = list(x.stride())
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: its 16 bits travel as uint16, exactly
            meta["dtype"] = "bfloat16"
            return Payload(self.name, self.version, {"x": to_numpy(x.view(torch.uint16))}, meta)
        return Payload(self.name, self.version, {"x": to_numpy(x)}, meta)

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        self.check(payload)
        meta = payload.meta
        if not meta:
            return _wire.tensor(_wire.array(payload, "x"), ctx.device)
        if set(meta) - {"dtype", "order", "strides"} or meta.get("dtype", "bfloat16") != "bfloat16" or \
                {"order", "strides"} <= set(meta):
            raise CompressionError(f"identity payload metadata may hold 'dtype' ('bfloat16') and 'order' or "
                                   f"'strides', got {str(meta)[:80]}")
        bf16 = "dtype" in meta
        array = _wire.array(payload, "x", dtype=np.uint16) if bf16 else _wire.array(payload, "x")
        order = meta.get("order")
        if order is not None and not (isinstance(order, list) and all(type(d) is int for d in order)
                                      and sorted(order) == list(range(array.ndim))):
            raise CompressionError(f"identity payload 'order' must list the array's {array.ndim} dimensions, "
                                   f"got {str(order)[:80]}")
        strides = meta.get("strides")
        if strides is not None and not (isinstance(strides, list) and len(strides) == array.ndim
                                        and all(type(d) is int for d in strides)
                                        and gapped(array.shape, strides)):
            raise CompressionError(f"identity payload 'strides' must lay out the array's {array.ndim} dimensions "
                                   f"without overlap, in at most {GAPS}x its size, got {str(strides)[:80]}")
        tensor = _wire.tensor(array, ctx.device)
        if strides is not None:  # laid out as the sender's: what is computed from it rounds as the sender's would
            tensor = torch.empty_strided(tensor.shape, strides, dtype=tensor.dtype, device=tensor.device).copy_(tensor)
        if bf16:  # integers may stay where they were received; floats are computed from aligned memory
            tensor = (tensor if tensor.data_ptr() % ALIGNMENT == 0 else tensor.clone()).view(torch.bfloat16)
        return tensor if order is None else tensor.permute([order.index(d) for d in range(len(order))])

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The array itself: decode copies it once when it is read-only (received bytes), and
        into the memory its strides span when it has them."""
        self.check(payload)
        nbytes = int(_wire.array(payload, "x").nbytes)
        return nbytes * (1 + GAPS) if "strides" in payload.meta else nbytes


def dense_order(x: torch.Tensor) -> list[int] | None:
    """The order of ``x``'s dimensions in memory, outermost first, where ``x`` is a permutation of
    a contiguous tensor (a transpose, ``channels_last``): sent in that order and permuted back, it
    arrives with the sender's strides, and what is computed from it rounds as the sender's would.
    None where it is not (a slice, an expanded tensor): those travel contiguous."""
    if x.dim() < 2:
        return None
    order = sorted(range(x.dim()), key=lambda d: -x.stride(d))
    return order if order != list(range(x.dim())) and x.permute(order).is_contiguous() else None


#: The most memory a tensor sent with its strides may span, as a multiple of its values: the real
#: part of a complex tensor spans 2x; a narrow slice of a wide one travels contiguous instead.
GAPS = 4


def gapped(shape: Any, strides: Any) -> bool:
    """Whether a layout is one the identity codec rebuilds from its strides: no element shares
    memory with another (positive strides, each dimension past the span of those inside it), and
    the memory spanned at most :data:`GAPS` times the values'. A tensor with gaps between its
    values (``view_as_real(z)[..., 0]``, ``x[:, ::2]``) is computed by torch in its own order,
    which a contiguous copy would not repeat."""
    numel = int(np.prod(shape, dtype=np.int64)) if len(shape) else 1
    if numel == 0 or any(s < 0 for s in strides) or any(s < 1 for s, n in zip(strides, shape) if n > 1):
        return False
    span = 1
    for stride, size in sorted(((s, n) for s, n in zip(strides, shape) if n > 1)):
        if stride < span:
            return False
        span = stride * (size - 1) + span
    return span <= GAPS * numel
