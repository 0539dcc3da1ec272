"""Float narrowing codecs."""

from __future__ import annotations

import torch

from .base import Codec, CodecContext, Payload, tensor_meta, to_numpy, torch_dtype
from .errors import CompressionError
from .registry import register


@register
class FP16(Codec):
    """Half precision on the wire: 2x smaller than fp32, relative error below 2^-11 in range.

    Values beyond the fp16 range (|x| > 65504) would become inf, so they raise instead of
    silently corrupting training.
    """

    name = "fp16"
    default_grad_codec = "fp16"

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        if not x.is_floating_point():
            raise CompressionError(f"fp16 codes floating tensors; got {x.dtype}")
        half = x.detach().to(torch.float16)
        if x.numel() and not torch.isfinite(half).all() and torch.isfinite(x).all():
            raise CompressionError(
                f"fp16 overflow: |x| reaches {x.abs().max().item():.3g} > 65504; use 'identity' or a scaled codec"
            )
        return Payload(self.name, self.version, {"x": to_numpy(half)}, tensor_meta(x))

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        self.check(payload)
        dtype = torch_dtype(payload.meta.get("dtype", "float32"))
        return torch.from_numpy(payload.arrays["x"]).to(dtype)
