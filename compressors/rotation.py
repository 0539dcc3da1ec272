"""A random Hadamard rotation of the last dim, before the codec after it and after its decode.

An LLM's hidden states put most of their energy in a few channels (SmolLM2: 4 of 576 channels
hold 56% after layer 1, one holds 91% after layer 27), so a quantizer with one scale per token
spends its levels on them. Flipping signs at random and mixing blocks of channels with a
Walsh-Hadamard matrix spreads each outlier over its whole block and leaves values that are
nearly Gaussian, which the ``quant`` codec's normal levels code with the least error (as in
QuaRot and TAH-Quant). The rotation is orthogonal: the inverse is its transpose, which costs
the same few additions, and it needs no payload: both ends draw the same signs from the codec
seed they share.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import _wire
from ._cache import LRU
from .base import CodecContext, Payload, tensor_meta
from .chain import Stage, unnest
from .errors import CompressionError
from .registry import register

#: Largest block the rotation mixes (work per value grows with its log).
MAX_BLOCK = 1 << 20


def block_for(d: int, block: int) -> int:
    """The block a last dim of ``d`` is rotated in: the largest power of two dividing ``d``,
    at most ``block`` (0: no limit but :data:`MAX_BLOCK`)."""
    if d <= 0:
        return 1
    largest = d & -d
    return min(largest, block or MAX_BLOCK, MAX_BLOCK)


def hadamard(y: torch.Tensor, b: int) -> torch.Tensor:
    """The orthonormal Walsh-Hadamard transform of blocks of ``b`` along the last dim of ``y``
    (a power of two dividing it): log2(b) rounds of sums and differences. It is its own inverse."""
    shape = y.shape
    lead = y.reshape(-1, shape[-1] // b, b)
    h = 1
    while h < b:
        pairs = lead.reshape(lead.shape[0], lead.shape[1], b // (2 * h), 2, h)
        a, c = pairs[..., 0, :], pairs[..., 1, :]
        lead = torch.stack((a + c, a - c), dim=-2)
        h *= 2
    return (lead.reshape(shape) * (1.0 / math.sqrt(b))).to(y.dtype)


@register
class Hadamard(Stage):
    """Rotates the last dim (random signs, then Walsh-Hadamard blocks) before the next codec.

    Options: ``block`` (0): the most channels one block mixes; 0 takes the largest power of two
    that divides the last dim (64 for SmolLM2's 576). Orthogonal, so exact to invert up to
    rounding; adds no bytes. Its adjoint is the rotation itself, so a gradient crosses in the
    rotated basis (the gradient codec then sees nearly Gaussian values too) and the sender
    rotates it back.
    """

    name = "hadamard"
    negotiable_options = frozenset({"block"})

    def __init__(self, *, block: int = 0, seed: int = 0) -> None:
        super().__init__(seed=seed)
        if not isinstance(block, int) or isinstance(block, bool) or block < 0 or block & (block - 1) \
                or block > MAX_BLOCK:
            raise CompressionError(f"hadamard option block must be 0 or a power of two up to {MAX_BLOCK}, got {block!r}")
        self.block = block
        self._signs: LRU[tuple[int, str], torch.Tensor] = LRU(2)

    def _signs_for(self, d: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        def make() -> torch.Tensor:
            draw = np.random.default_rng(self.seed).integers(0, 2, size=d, dtype=np.int8)
            return torch.from_numpy(draw.astype(np.float32) * 2 - 1).to(device)
        return self._signs.get((d, str(device)), make).to(dtype)

    def _rotate(self, x: torch.Tensor, b: int, inverse: bool) -> torch.Tensor:
        """R x = H (s * x), R^-1 y = s * (H y): H symmetric and its own inverse, s = +-1."""
        d = x.shape[-1]
        signs = self._signs_for(d, x.device, x.dtype)
        return signs * hadamard(x, b) if inverse else hadamard(signs * x, b)

    @staticmethod
    def _work_dtype(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def forward(self, x: torch.Tensor, ctx: CodecContext) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
        _wire.require_float(self.name, x)
        d = x.shape[-1] if x.dim() else 1
        b = block_for(d, self.block)
        y = x.detach().reshape(x.shape or (1,)).to(self._work_dtype(x.dtype))
        return self._rotate(y, b, inverse=False).reshape(x.shape), {}, {**tensor_meta(x), "block": b}

    def _own(self, arrays: dict[str, Any], meta: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype, int]:
        if arrays:
            raise CompressionError(f"hadamard payload carries arrays of its own ({sorted(arrays)}); it has none")
        own = Payload(self.name, self.version, {}, meta)
        shape, dtype = _wire.meta_shape(own), _wire.meta_float_dtype(own)
        d = shape[-1] if shape else 1
        b = _wire.meta_int(own, "block", 1, MAX_BLOCK)
        if b != block_for(d, b) or (self.block and b > self.block):
            raise CompressionError(f"hadamard payload: block {b} is not a power of two dividing {d} within this "
                                   f"end's block={self.block}")
        return shape, dtype, b

    def backward(self, y: torch.Tensor, arrays: dict[str, Any], meta: dict[str, Any], ctx: CodecContext) -> torch.Tensor:
        shape, dtype, b = self._own(arrays, meta)
        if tuple(y.shape) != shape:
            raise CompressionError(f"hadamard payload: the next codec decoded shape {tuple(y.shape)}, expected {shape}")
        z = y.reshape(shape or (1,)).to(self._work_dtype(dtype))
        return self._rotate(z, b, inverse=True).reshape(shape).to(dtype)

    def own_decode_cost(self, arrays: dict[str, Any], meta: dict[str, Any], inner: Payload, ctx: CodecContext) -> int:
        """The decoded tensor in the working dtype, two rounds of sums at a time, the result."""
        shape, dtype, _ = self._own(arrays, meta)
        n = math.prod(shape)
        return n * (4 * 8 + dtype.itemsize) + 8 * (shape[-1] if shape else 1)

    def own_decode_flops(self, arrays: dict[str, Any], meta: dict[str, Any], inner: Payload, ctx: CodecContext) -> int:
        shape, _, b = self._own(arrays, meta)
        return math.prod(shape) * (2 * int(math.log2(b)) + 3)

    def own_encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        b = block_for(shape[-1] if shape else 1, self.block)
        return math.prod(shape) * (2 * int(math.log2(b)) + 3)

    def decode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """The decode is R^-1 (inner decode), so the inner decode's gradient is R grad."""
        own, meta, inner = unnest(self, payload)
        shape, _, b = self._own(own, meta)
        g = self._rotate(grad.reshape(shape or (1,)).to(self._work_dtype(grad.dtype)), b, inverse=False)
        return self.inner.decode_adjoint(g.reshape(grad.shape).to(grad.dtype), inner, ctx)

    def encode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """The encode codes R x, so the input's gradient is R^T = R^-1 of the inner one's."""
        own, meta, inner = unnest(self, payload)
        shape, _, b = self._own(own, meta)
        g = self.inner.encode_adjoint(grad, inner, ctx)
        out = self._rotate(g.reshape(shape or (1,)).to(self._work_dtype(g.dtype)), b, inverse=True)
        return out.reshape(g.shape).to(g.dtype)

    def own_held_nbytes(self) -> int:
        return self._signs.nbytes()
