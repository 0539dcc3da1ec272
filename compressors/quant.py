"""Float narrowing and n-bit fixed-point codecs.

The fixed-point quantizer is also the building block of AC-SGD (``delta.py``), which quantizes
activation deltas with it, and the default gradient codec of the non-linear forward codecs.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _wire, bitpack
from ._device import download, upload, use_torch
from .base import Codec, CodecContext, Payload, tensor_meta, to_numpy
from .errors import CompressionError
from .registry import register

#: Added to every scale before dividing, so an all-zero channel quantizes to zeros, not NaN.
SCALE_EPS = 1e-6
FP16_MAX = 65504.0


@register
class FP16(Codec):
    """Half precision on the wire: 2x smaller than fp32, relative error below 2^-11 in range.

    Values beyond the fp16 range (|x| > 65504) would become inf, so they raise instead of
    silently corrupting training.
    """

    name = "fp16"
    default_grad_codec = "fp16"

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The fp16 array copied out of the read-only wire buffer, then the output dtype."""
        self.check(payload)
        shape = _wire.meta_shape(payload)
        dtype = _wire.meta_float_dtype(payload)
        n = math.prod(shape)
        _wire.array(payload, "x", np.float16, shape)
        return n * (2 + dtype.itemsize)

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        if not x.is_floating_point():
            raise CompressionError(f"fp16 codes floating tensors; got {x.dtype}")
        half = x.detach().to(torch.float16)
        # the half tensor is checked first: only when it holds inf or NaN is the input read again
        if not _wire.all_finite(half) and _wire.all_finite(x):
            raise CompressionError(
                f"fp16 overflow: |x| reaches {x.abs().max().item():.3g} > 65504; use 'identity' or a scaled codec"
            )
        return Payload(self.name, self.version, {"x": to_numpy(half)}, tensor_meta(x))

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        self.check(payload)
        dtype = _wire.meta_float_dtype(payload)
        return _wire.tensor(_wire.array(payload, "x", np.float16, _wire.meta_shape(payload)), ctx.device).to(dtype)


def check_bits(bits: object, lo: int = 2, hi: int = 16) -> int:
    """Validate a bit-width setting (shared by the codecs that quantize)."""
    if not isinstance(bits, int) or isinstance(bits, bool) or not lo <= bits <= hi:
        raise CompressionError(f"bits must be an int in {lo}..{hi}, got {bits!r}")
    return bits


def channel_axis(ndim: int, channel_dim: int) -> int | None:
    """The dim that gets its own scale: ``channel_dim`` for tensors of 2 or more dims, else none."""
    if ndim < 2:
        return None
    if not -ndim <= channel_dim < ndim:
        raise CompressionError(
            f"channel_dim={channel_dim} is out of range for a {ndim}-D tensor; "
            f"use a dim in [{-ndim}, {ndim - 1}]"
        )
    return channel_dim % ndim


def _scale_view(shape: tuple[int, ...], axis: int | None) -> list[int]:
    view = [1] * len(shape)
    if axis is not None:
        view[axis] = shape[axis]
    return view


def channel_scales(x: torch.Tensor, axis: int | None) -> np.ndarray:
    """max|x| per channel as fp16, rounded *up* so that no element exceeds its scale."""
    count = 1 if axis is None else x.shape[axis]
    if x.numel() == 0:
        return np.zeros(count, dtype=np.float16)
    dims = [d for d in range(x.dim()) if d != axis]
    amax = x.detach().abs().amax(dim=dims) if dims else x.detach().abs()
    s = amax.to(torch.float32).reshape(count).cpu().numpy()
    top = float(s.max())  # NaN propagates through max
    if not math.isfinite(top):
        raise CompressionError("fixpoint got non-finite values (inf or NaN); they cannot be quantized")
    if top > FP16_MAX:
        raise CompressionError(
            f"fixpoint scale overflows fp16: max|x| reaches {top:.3g} > 65504; "
            "normalise the activations or use 'identity'"
        )
    s16 = s.astype(np.float16)
    # the scales are >= 0, where the next fp16 up is the next bit pattern up
    s16.view(np.uint16)[...] += s16.astype(np.float32) < s
    return s16


def _steps(scale: np.ndarray, half: int, shape: tuple[int, ...], axis: int | None) -> torch.Tensor:
    """(s + 1e-6) / 2^(b-1) per channel, shaped to broadcast over a tensor of ``shape``.

    Dividing by a power of two is exact, so x / step rounds exactly like x / (s + 1e-6) * 2^(b-1)
    (one division instead of a division and a multiplication), and code * step is the
    documented dequantization.
    """
    step = (scale.astype(np.float32) + np.float32(SCALE_EPS)) / np.float32(half)
    return torch.from_numpy(step.reshape(_scale_view(shape, axis)))


def quantize(x: torch.Tensor, bits: int, axis: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel symmetric fixed point: (packed b-bit codes, fp16 scales).

    q = clip(round(x / (s + 1e-6) * 2^(b-1)), -2^(b-1), 2^(b-1) - 1), computed in float32 with
    round-half-to-even, so any two machines produce the same codes.
    """
    packed, scale, _, _ = quantize_parts(x, bits, axis)
    return packed, scale


def quantize_parts(x: torch.Tensor, bits: int, axis: int | None
                   ) -> tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor]:
    """:func:`quantize`, plus the signed codes q (a float32 tensor shaped like ``x``, the caller's
    to modify) and the steps they are multiplied by, so ``q * step`` is exactly what
    :func:`dequantize` returns, without unpacking what was just packed."""
    scale = channel_scales(x, axis)
    half = 1 << (bits - 1)
    x32 = x.detach().to(torch.float32)
    step = _steps(scale, half, tuple(x.shape), axis).to(x32.device)
    # + 0 turns the -0 that rounding leaves for small negatives into the +0 an integer code
    # dequantizes to: -0 + -0 is -0 but +0 + -0 is +0, so a sender adding the codes to a buffer
    # row holding -0 would keep a zero of the other sign than its receiver (and its checksum)
    q = torch.div(x32, step).round_().clamp_(-half, half - 1).add_(0.0)
    if use_torch(x.device):  # packed where the tensor lives; only the packed bytes cross
        packed = bitpack.pack_tensor(q.to(torch.int32) + half, bits)
        return download(packed), scale, q, step
    # The signed codes fit the signed integer of the packed width; adding 2^(b-1) to its two's
    # complement bits, wrapping, gives the offset code (q + 2^(b-1)) without a wider copy.
    codes = q.to(torch.int8 if bits <= 8 else torch.int16).numpy()
    codes = codes.view(np.uint8 if bits <= 8 else np.uint16)
    codes += codes.dtype.type(half)
    return bitpack.pack(codes, bits), scale, q, step


def dequantize_nbytes(count: int, bits: int) -> int:
    """An upper bound on the bytes :func:`dequantize` allocates for ``count`` values: unpacking
    (a byte per bit, plus uint16 words, their shifted copies and the narrowed codes, on the
    general path), the float32 result, and 2 bytes per value of allocator headroom."""
    return int(count) * (int(bits) + 7 + 4 + 2)


def dequantize(packed: np.ndarray, scale: np.ndarray, bits: int, shape: tuple[int, ...],
               axis: int | None, device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse of :func:`quantize` in float32, on ``device`` (the host when None). Both ends of a
    link get bit-identical values."""
    if not np.isfinite(scale).all():
        raise CompressionError("payload carries non-finite quantizer scales, which no sender makes")
    half = 1 << (bits - 1)
    n = math.prod(shape)
    if use_torch(device):  # only the packed bytes travel to the device; they are expanded there
        codes32 = bitpack.unpack_tensor(upload(packed, device), bits, n) - half
        return codes32.to(torch.float32).reshape(shape).mul_(_steps(scale, half, shape, axis).to(codes32.device))
    codes = bitpack.unpack(packed, bits, n)
    # the inverse of the wrap in quantize: code - 2^(b-1), wrapping, read as signed
    codes -= codes.dtype.type(half)
    signed = codes.view(np.int8 if bits <= 8 else np.int16)
    return torch.from_numpy(signed).to(torch.float32).reshape(shape).mul_(_steps(scale, half, shape, axis))


@register
class Fixpoint(Codec):
    """n-bit fixed point with one fp16 scale per channel: ~32/b times smaller than fp32.

    Each element costs exactly ``bits`` bits and each channel (dim ``channel_dim`` of a tensor of
    2 or more dims; one scale for 1-D) 2 bytes of scale. The error per element is at most
    scale / 2^(b-1). Rounding is deterministic, so the sender can reproduce what the receiver
    decodes (AC-SGD relies on that). The gradient passes straight through.
    """

    name = "fixpoint"
    default_grad_codec = "fixpoint:bits=8"
    negotiable_options = frozenset({"bits", "channel_dim"})

    def __init__(self, *, bits: int = 8, channel_dim: int = 1, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.bits = check_bits(bits)
        if not isinstance(channel_dim, int) or isinstance(channel_dim, bool):
            raise CompressionError(f"channel_dim must be an int (1 for NCHW or (B, L, H) rows, -1 for hidden), got {channel_dim!r}")
        self.channel_dim = channel_dim

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        axis = channel_axis(x.dim(), self.channel_dim)
        packed, scale = quantize(x, self.bits, axis)
        meta = {**tensor_meta(x), "bits": self.bits, "axis": axis}
        return Payload(self.name, self.version, {"q": packed, "scale": scale}, meta)

    def _read(self, payload: Payload
              ) -> tuple[tuple[int, ...], torch.dtype, int, int | None, np.ndarray, np.ndarray]:
        """(shape, dtype, bits, axis, scale, packed codes) of a payload, all checked."""
        self.check(payload)
        shape = _wire.meta_shape(payload)
        dtype = _wire.meta_float_dtype(payload)
        bits = _wire.meta_int(payload, "bits", 2, 16)
        axis = payload.meta.get("axis")
        if axis is not None:
            axis = _wire.meta_int(payload, "axis", 0, max(len(shape) - 1, 0))
            if len(shape) < 2:
                raise CompressionError(f"fixpoint payload: axis {axis} given for a {len(shape)}-D tensor")
        count = 1 if axis is None else shape[axis]
        scale = _wire.array(payload, "scale", np.float16, (count,))
        packed = _wire.array(payload, "q", np.uint8, (bitpack.packed_nbytes(math.prod(shape), bits),))
        return shape, dtype, bits, axis, scale, packed

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        shape, dtype, bits, axis, scale, packed = self._read(payload)
        return dequantize(packed, scale, bits, shape, axis, ctx.device).to(dtype)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """Unpacking and dequantizing in float32, then the output dtype: up to ~27 bytes per
        element for a payload of ``bits / 8`` bytes per element, so a float64 tensor decodes
        from 2-bit codes to ~80 times the bytes that travelled."""
        shape, dtype, bits, *_ = self._read(payload)
        n = math.prod(shape)
        device = bitpack.unpack_tensor_nbytes(n, bits) if use_torch(ctx.device) else 0
        return dequantize_nbytes(n, bits) + n * dtype.itemsize + device
