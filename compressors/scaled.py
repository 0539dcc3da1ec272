"""Few-bit codes with one scale per tile of the last dim: the quantizer that survives an LLM.

The residual stream of a pre-trained LLM carries a few values in the thousands among values near
one (massive activations: the first token, a few hidden channels). A scale per hidden channel
over the whole batch (``fixpoint``) spends its codes on them and rounds everything else to zero.
Here each *tile* (``tile`` consecutive values of the last dim, a whole token by default) gets its
own scale, so one token's outliers cost that token only, and the levels are those that suit the
values a rotation leaves (``hadamard`` before this codec, see :mod:`compressors.chain`): nearly
Gaussian, so a scale of the tile's RMS and the Lloyd-Max levels of a unit normal (Max, 1960) give
the least mean squared error a fixed-rate scalar code can, at 1 to 4 bits. ``levels=uniform``
instead spreads 2^b evenly spaced levels over +-max|x| of the tile, which never clips.

Scales travel as bfloat16 (the top half of a float32): the range of float32, so gradients of
1e-7 and activations of 1e4 both keep a scale, at 2 bytes per tile.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _wire, bitpack
from ._cache import LRU
from ._device import download, upload, use_torch
from .base import Codec, CodecContext, Payload, tensor_meta
from .errors import CompressionError
from .registry import register

#: Positive Lloyd-Max levels of a unit normal (the negative ones mirror them), per bit width.
NORMAL_LEVELS = {
    1: (0.7979,),
    2: (0.4528, 1.5104),
    3: (0.2451, 0.7560, 1.3439, 2.1520),
    4: (0.1284, 0.3881, 0.6568, 0.9424, 1.2562, 1.6181, 2.0690, 2.7326),
}
LEVELS = ("normal", "uniform")
#: Largest finite bfloat16, as float32 bits >> 16.
BF16_MAX_BITS = 0x7F7F


def bf16_up(s: torch.Tensor) -> torch.Tensor:
    """Non-negative finite float32 scales as bfloat16 bit patterns (int32 holding 16 bits),
    rounded up so that no scaled value exceeds its scale, saturating at the largest finite one."""
    bits = s.to(torch.float32).contiguous().view(torch.int32)
    up = (bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)
    return up.clamp_(max=BF16_MAX_BITS)


def bf16_value(bits: torch.Tensor) -> torch.Tensor:
    """float32 values of bfloat16 bit patterns (an int32 or int64 tensor of 16-bit values)."""
    return (bits.to(torch.int32) << 16).view(torch.float32)


def tile_size(tile: int, d: int) -> int:
    """Values per tile along a last dim of ``d``: ``tile``, or the whole dim for 0 (at least 1)."""
    return max(1, d if tile == 0 or tile > d else tile)


def rows_of(shape: tuple[int, ...]) -> tuple[int, int]:
    """(rows, last dim) of a tensor of ``shape``: a 0-D or 1-D tensor is one row."""
    if not shape:
        return 1, 1
    return math.prod(shape[:-1]), shape[-1]


def tile_view(x: torch.Tensor, t: int) -> torch.Tensor:
    """(rows, tiles, t) view of (rows, d) values, the last tile zero-padded when t does not divide d."""
    n, d = x.shape
    pad = -d % t
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(n, (d + pad) // t, t)


def per_value(scale: torch.Tensor, t: int, d: int) -> torch.Tensor:
    """(rows, tiles) scales spread to (rows, d), one per value."""
    return scale.repeat_interleave(t, dim=1)[:, :d]


def tile_scales(tiles: torch.Tensor, d: int, kind: str) -> torch.Tensor:
    """(rows, tiles) scales of (rows, tiles, t) values from a last dim of ``d``: max|x|, or for
    normal levels the RMS, computed relative to max|x| so that neither 1e-30 nor 1e30 squared
    leaves float32."""
    top = tiles.abs().amax(2) if tiles.numel() else tiles.new_zeros(tiles.shape[:2])
    if kind != "normal":
        return top
    t = tiles.shape[2]
    counts = torch.full((tiles.shape[1],), float(t), device=tiles.device)
    if d % t:
        counts[-1] = float(d % t)
    unit = tiles / top.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(2)
    return (unit.square().sum(2) / counts).sqrt_().mul_(top)


class _Levels:
    """The code book of one setting: levels (float32, ascending) and decision thresholds."""

    def __init__(self, kind: str, bits: int) -> None:
        if kind == "normal":
            pos = torch.tensor(NORMAL_LEVELS[bits], dtype=torch.float32)
            self.levels = torch.cat([-pos.flip(0), pos])
        else:
            n = 1 << bits
            self.levels = torch.linspace(-1.0, 1.0, n, dtype=torch.float32) if n > 1 else torch.zeros(1)
        self.thresholds = (self.levels[1:] + self.levels[:-1]) / 2

    def on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        return self.levels.to(device), self.thresholds.to(device)


@register
class Quant(Codec):
    """b-bit codes with one bfloat16 scale per tile of the last dim (a token by default).

    Options (all negotiable, none costly):
      ``bits`` (2): bits per value, 1..8.
      ``tile`` (0): values per scale along the last dim; 0 means the whole dim (a token of hidden
        states). A tile that does not divide the dim leaves a shorter last tile.
      ``levels`` ("normal"): the RMS of the tile times the Lloyd-Max levels of a unit normal
        (1 to 4 bits), for values a rotation has made Gaussian; "uniform": 2^b evenly spaced
        levels over +-max|x| of the tile (no value is clipped).
      ``stochastic`` (false): round to one of the two nearest levels at random, in proportion to
        nearness, so a code is unbiased within the outer levels (for gradients); the draws come
        from this codec's own generator, seeded from ``seed``.
      ``eval_bits`` (0): evaluation sends (``CodecContext.train`` false) at this many bits with
        uniform levels instead (e.g. 8: nearly lossless), 0 for the training setting. Evaluation
        traffic is then not what training traffic is; benchmarks say so.
      ``first_bits`` (0): bits for a batch that holds samples' first sends under a ``delta``
        stage (``CodecContext.first``), which carry the whole sample rather than a change; 0
        for ``bits``.

    Cost on the wire: ``bits`` per value plus 2 bytes per tile. The gradient passes straight
    through (pair it with a gradient codec: ``quant:bits=4`` by default).
    """

    name = "quant"
    default_grad_codec = "quant:bits=4"
    negotiable_options = frozenset({"bits", "tile", "levels", "stochastic", "eval_bits", "first_bits"})

    def __init__(self, *, bits: int = 2, tile: int = 0, levels: str = "normal", stochastic: bool = False,
                 eval_bits: int = 0, first_bits: int = 0, seed: int = 0) -> None:
        super().__init__(seed=seed)
        for opt, value, lo, hi in (("bits", bits, 1, 8), ("tile", tile, 0, 1 << 24), ("eval_bits", eval_bits, 0, 8),
                                   ("first_bits", first_bits, 0, 8)):
            if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
                raise CompressionError(f"quant option {opt} must be an int in {lo}..{hi}, got {value!r}")
        if levels not in LEVELS:
            raise CompressionError(f"quant option levels must be one of {', '.join(LEVELS)}, got {levels!r}")
        for opt, value in (("bits", bits), ("first_bits", first_bits or bits)):
            if levels == "normal" and value not in NORMAL_LEVELS:
                raise CompressionError(f"quant levels=normal has Lloyd-Max levels for 1-4 bits, got {opt}={value}; "
                                       "use levels=uniform for more bits")
        if not isinstance(stochastic, bool):
            raise CompressionError(f"quant option stochastic must be true or false, got {stochastic!r}")
        self.bits, self.tile, self.levels, self.stochastic = bits, tile, levels, stochastic
        self.eval_bits, self.first_bits = eval_bits, first_bits
        self._books: dict[tuple[str, int], _Levels] = {}
        self._gens: LRU[str, torch.Generator] = LRU(2)

    # -- the code book ---------------------------------------------------------------------

    def _book(self, kind: str, bits: int) -> _Levels:
        key = (kind, bits)
        if key not in self._books:  # at most 3 settings per instance: training, first sends, evaluation
            self._books[key] = _Levels(kind, bits)
        return self._books[key]

    def _setting(self, ctx: CodecContext) -> tuple[str, int]:
        if not ctx.train and self.eval_bits:
            return "uniform", self.eval_bits
        return self.levels, (self.first_bits or self.bits) if ctx.first else self.bits

    def _generator(self, device: torch.device) -> torch.Generator:
        return self._gens.get(str(device), lambda: torch.Generator(device=device).manual_seed(self.seed))

    # -- encode ----------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        kind, bits = self._setting(ctx)
        n, d = rows_of(tuple(x.shape))
        t = tile_size(self.tile, d)
        rows = x.detach().reshape(n, d).to(torch.float32)
        if not _wire.all_finite(rows):
            raise CompressionError("quant got non-finite values (inf or NaN); they cannot be quantized")
        scale_bits = bf16_up(tile_scales(tile_view(rows, t), d, kind))
        scale = bf16_value(scale_bits)
        codes = self._codes(rows, scale, t, kind, bits)
        if use_torch(x.device):
            packed = download(bitpack.pack_tensor(codes, bits))
        else:
            packed = bitpack.pack(codes.to(torch.uint8).numpy(), bits)
        meta = {**tensor_meta(x), "bits": bits, "tile": t, "levels": kind}
        return Payload(self.name, self.version, {"q": packed, "scale": download(scale_bits.to(torch.int32)).astype(np.uint16).reshape(-1)},
                       meta)

    def _codes(self, rows: torch.Tensor, scale: torch.Tensor, t: int, kind: str, bits: int) -> torch.Tensor:
        """Level indices in [0, 2^b) of (rows, d) values, given their (rows, tiles) scales."""
        levels, thresholds = self._book(kind, bits).on(rows.device)
        d = rows.shape[1]
        u = (rows / per_value(scale, t, d).clamp_min(torch.finfo(torch.float32).tiny)).contiguous()
        if not self.stochastic or levels.numel() < 2:
            return torch.bucketize(u, thresholds)
        lo = (torch.bucketize(u, levels) - 1).clamp_(0, levels.numel() - 2)
        below, above = levels[lo], levels[lo + 1]
        p = ((u - below) / (above - below)).clamp_(0, 1)
        draw = torch.rand(u.shape, generator=self._generator(u.device), device=u.device)
        return lo + (draw < p).to(lo.dtype)

    # -- decode ----------------------------------------------------------------------------

    def _read(self, payload: Payload) -> tuple[tuple[int, ...], torch.dtype, str, int, int, np.ndarray, np.ndarray]:
        """(shape, dtype, levels, bits, tile, scale bits, packed codes) of a payload, all checked."""
        self.check(payload)
        shape = _wire.meta_shape(payload)
        dtype = _wire.meta_float_dtype(payload)
        kind = _wire.meta_str(payload, "levels", LEVELS)
        bits = _wire.meta_int(payload, "bits", 1, 8)
        if kind == "normal" and bits not in NORMAL_LEVELS:
            raise CompressionError(f"quant payload: levels=normal with bits={bits} (1-4 only)")
        n, d = rows_of(shape)
        t = _wire.meta_int(payload, "tile", 1, max(d, 1))
        scale = _wire.array(payload, "scale", np.uint16, (n * -(-d // t),))
        packed = _wire.array(payload, "q", np.uint8, (bitpack.packed_nbytes(n * d, bits),))
        return shape, dtype, kind, bits, t, scale, packed

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        shape, dtype, kind, bits, t, scale_bits, packed = self._read(payload)
        n, d = rows_of(shape)
        if use_torch(ctx.device):
            codes = bitpack.unpack_tensor(upload(packed, ctx.device), bits, n * d).long()
            scale_t = upload(scale_bits.astype(np.int32), ctx.device)
        else:
            codes = torch.from_numpy(bitpack.unpack(packed, bits, n * d).astype(np.int64))
            scale_t = torch.from_numpy(scale_bits.astype(np.int32))
        scale = bf16_value(scale_t).reshape(n, -(-d // t))
        if not torch.isfinite(scale).all():
            raise CompressionError("quant payload carries non-finite scales, which no sender makes")
        levels, _ = self._book(kind, bits).on(codes.device)
        values = levels[codes].reshape(n, d).mul_(per_value(scale, t, d))
        return values.reshape(shape).to(dtype)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """Unpacking (a byte or two per value, int64 indices), the float32 levels, the scales
        spread to every value, and the output in its dtype: up to ~40 bytes per value."""
        shape, dtype, kind, bits, *_ = self._read(payload)
        n = math.prod(shape)
        device = bitpack.unpack_tensor_nbytes(n, bits) + 8 * n if use_torch(ctx.device) else 0
        book = 0 if (kind, bits) in self._books else 4 * 2 * (1 << bits) + 256  # the code book, made on first use
        return n * (2 + 8 + 4 + 4 + 8 + 4 + dtype.itemsize) + 16 * (n // max(1, rows_of(shape)[1]) + 1) + device + book

    def decode_flops(self, payload: Payload, ctx: CodecContext) -> int:
        """A few operations per value: the cost in bytes bounds them."""
        return self.decode_cost(payload, ctx)

    def encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Squares, sums and scaling, a binary search over at most 2^8 levels, packing."""
        return 24 * math.prod(shape)

    def held_nbytes(self) -> int:
        return sum(b.levels.nbytes + b.thresholds.nbytes for b in self._books.values()) + 64 * len(self._gens)
