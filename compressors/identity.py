"""The codec that changes nothing: the baseline every other codec is measured against."""

from __future__ import annotations

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
        if x.dtype == torch.bfloat16:  # numpy has no bfloat16: its 16 bits travel as uint16, exactly
            return Payload(self.name, self.version, {"x": to_numpy(x.view(torch.uint16))}, {"dtype": "bfloat16"})
        if x.is_cpu and x.is_contiguous():  # the common case, without to_numpy's general checks
            return Payload(self.name, self.version, {"x": (x.detach() if x.requires_grad else x).numpy()})
        return Payload(self.name, self.version, {"x": to_numpy(x)})

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        self.check(payload)
        if payload.meta:
            if payload.meta != {"dtype": "bfloat16"}:
                raise CompressionError(f"identity payload metadata must be empty or {{'dtype': 'bfloat16'}}, "
                                       f"got {str(payload.meta)[:80]}")
            bits = _wire.tensor(_wire.array(payload, "x", dtype=np.uint16), ctx.device)
            # integers may stay where they were received; floats are computed from aligned memory
            return (bits if bits.data_ptr() % ALIGNMENT == 0 else bits.clone()).view(torch.bfloat16)
        return _wire.tensor(_wire.array(payload, "x"), ctx.device)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The array itself: decode copies it once when it is read-only (received bytes)."""
        self.check(payload)
        return int(_wire.array(payload, "x").nbytes)
