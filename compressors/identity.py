"""The codec that changes nothing: the baseline every other codec is measured against."""

from __future__ import annotations

import torch

from . import _wire
from .base import Codec, CodecContext, Payload, to_numpy
from .registry import register


@register
class Identity(Codec):
    """Sends the tensor as it is, in its own dtype. Split training through it equals local training."""

    name = "identity"

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        return Payload(self.name, self.version, {"x": to_numpy(x)})

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        self.check(payload)
        return _wire.tensor(_wire.array(payload, "x"))

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The array itself: decode copies it once when it is read-only (received bytes)."""
        self.check(payload)
        return int(_wire.array(payload, "x").nbytes)
