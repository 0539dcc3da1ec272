"""Error-bounded quantization (COMET's idea): a bound on each element's error, not a bit width.

``errbound:abs=A`` promises ``|decoded - x| <= A`` for every element; ``errbound:rel=R`` promises
``|decoded - x| <= R * max|x|`` over the tensor (the bound relative to its range); with both,
the tighter holds. The bound, not the bits, is what a user of lossy activations can reason about:
a fixed bit width gives a small error to a flat tensor and a large one to a tensor with outliers.

The tensor is cut into tiles of :data:`TILE` elements (in memory order). Each tile gets the
widest quantization step that keeps the bound after every rounding the decode does (float64
arithmetic, then the cast to the tensor's dtype), and the fewest bits that hold its codes: a tile
of small values costs a few bits, a tile of zeros none, and a tile the bound cannot be met in
with 16 bits or at the dtype's own precision (an outlier under a tight absolute bound) travels
raw, exactly. The step is chosen per tile so the bound holds, whatever the tile holds. Encoding
and decoding run on the host, in float64; only the decoded tensor moves to ``CodecContext.device``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from . import _wire, bitpack
from .base import Codec, CodecContext, Payload, tensor_meta
from .errors import CompressionError
from .quant import dequantize_nbytes
from .registry import register

#: Elements per tile: each costs 9 bytes of step and width, 0.1% of a float32 tile.
TILE = 1024
#: The width code of a tile sent raw.
RAW = 255
#: The relative bound when the spec gives none.
DEFAULT_REL = 0.01


def _bound(value: object, name: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise CompressionError(f"errbound: {name} must be a finite number > 0, got {value!r}")
    return float(value)


def _rounding(dtype: torch.dtype) -> tuple[float, float]:
    """(relative, absolute) error of rounding a float64 value to ``dtype``, at most."""
    info = torch.finfo(dtype)
    return float(info.eps) / 2 + 2.0 ** -50, float(info.smallest_normal) * float(info.eps)


@register
class ErrorBounded(Codec):
    """Each element's error within ``abs`` and/or ``rel * max|x|`` (default ``rel=0.01``), in as
    few bits per tile as that takes. The gradient passes straight through."""

    name = "errbound"
    default_grad_codec = "fixpoint:bits=8"
    negotiable_options = frozenset({"abs", "rel"})

    def __init__(self, *, abs: float | None = None, rel: float | None = None, seed: int = 0) -> None:  # noqa: A002
        super().__init__(seed=seed)
        self.abs = _bound(abs, "abs")
        self.rel = _bound(rel, "rel")
        if self.abs is None and self.rel is None:
            self.rel = DEFAULT_REL

    def bound(self, x: torch.Tensor) -> float:
        """The largest error any element of ``x`` may get."""
        limits = [b for b in (self.abs, None if self.rel is None else self.rel * float(x.abs().max()))
                  if b is not None]
        return min(limits)

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        n = x.numel()
        tiles = -(-n // TILE)
        flat = torch.zeros(tiles * TILE, dtype=torch.float64)
        flat[:n] = x.detach().reshape(-1).to("cpu", torch.float64)
        if not _wire.all_finite(flat):
            raise CompressionError("errbound got non-finite values (inf or NaN); they cannot be bounded")
        rows = flat.view(tiles, TILE)
        amax = rows.abs().amax(dim=1) if tiles else torch.zeros(0, dtype=torch.float64)
        rel_err, abs_err = _rounding(x.dtype)
        bound = self.bound(flat) if n else 1.0
        # s/2 + (M + s/2) * rel_err + abs_err <= bound, with M the tile's largest magnitude
        step = 2 * (bound - amax * rel_err - abs_err) / (1 + rel_err)
        codable = (step > 0) | (amax == 0)  # a tile of zeros costs no bits, whatever the bound
        safe = torch.where(step > 0, step, torch.ones_like(step))
        q = torch.round(rows / safe[:, None])
        top = q.abs().amax(dim=1) if tiles else q.new_zeros(0)
        bits = torch.where(top == 0, 0.0, torch.floor(torch.log2(torch.clamp(top, min=1))) + 2)
        bits = torch.where(codable & (bits <= 16), bits, float(RAW)).to(torch.int64)
        return self._payload(x, rows, q, safe, bits)

    def _payload(self, x: torch.Tensor, rows: torch.Tensor, q: torch.Tensor, step: torch.Tensor,
                 bits: torch.Tensor) -> Payload:
        width = bits.numpy()
        packed = []
        for b in range(1, 17):  # tiles of each width, packed together, narrowest first
            chosen = width == b
            if chosen.any():
                codes = (q[torch.from_numpy(chosen)] + (1 << (b - 1))).to(torch.int64).numpy()
                packed.append(bitpack.pack(codes.astype(np.uint16 if b > 8 else np.uint8).reshape(-1), b))
        raw_rows = rows[torch.from_numpy(width == RAW)].to(x.dtype if x.dtype != torch.bfloat16 else torch.float32)
        arrays = {"bits": width.astype(np.uint8), "step": step.numpy().astype(np.float64),
                  "q": np.concatenate(packed) if packed else np.zeros(0, np.uint8),
                  "raw": _wire.wire_float(raw_rows.reshape(-1))}
        return Payload(self.name, self.version, arrays, {**tensor_meta(x), "tile": TILE})

    def _read(self, payload: Payload) -> tuple[tuple[int, ...], torch.dtype, np.ndarray, np.ndarray, np.ndarray,
                                                np.ndarray]:
        """(shape, dtype, widths, steps, packed codes, raw values) of a payload, all checked."""
        self.check(payload)
        shape = _wire.meta_shape(payload)
        dtype = _wire.meta_float_dtype(payload)
        _wire.meta_int(payload, "tile", TILE, TILE)
        tiles = -(-math.prod(shape) // TILE)
        width = _wire.array(payload, "bits", np.uint8, (tiles,))
        if not np.isin(width, [*range(17), RAW]).all():
            raise CompressionError(f"errbound payload: tile widths must be 0..16 or {RAW} (raw)")
        step = _wire.array(payload, "step", np.float64, (tiles,))
        coded = width <= 16
        if not (np.isfinite(step[coded]).all() and (step[coded] > 0).all()):
            raise CompressionError("errbound payload: a coded tile's step is not a finite positive number")
        need = sum(bitpack.packed_nbytes(int((width == b).sum()) * TILE, b) for b in range(1, 17))
        packed = _wire.array(payload, "q", np.uint8, (need,))
        raw = _wire.array(payload, "raw", _wire.wire_float_dtype(dtype), (int((width == RAW).sum()) * TILE,))
        return shape, dtype, width, step, packed, raw

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        shape, dtype, width, step, packed, raw = self._read(payload)
        out = np.zeros((len(width), TILE), dtype=np.float64)
        offset = 0
        for b in range(1, 17):
            chosen = width == b
            count = int(chosen.sum()) * TILE
            if not count:
                continue
            size = bitpack.packed_nbytes(count, b)
            codes = bitpack.unpack(packed[offset:offset + size], b, count).astype(np.int64) - (1 << (b - 1))
            with np.errstate(over="ignore"):
                out[chosen] = codes.reshape(-1, TILE) * step[chosen][:, None]
            offset += size
        out[width == RAW] = raw.reshape(-1, TILE)
        if out.size and not np.abs(out).max() <= torch.finfo(dtype).max:  # NaN fails too
            raise CompressionError(f"errbound payload: steps decode to values beyond {dtype}'s range, "
                                   "which no sender makes")
        y = torch.from_numpy(out.reshape(-1)[:math.prod(shape)]).to(dtype).reshape(shape)
        return y if ctx.device is None else y.to(ctx.device)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The float64 tiles, each width's unpacking and products, then the output (twice: the
        cast and its copy onto the device)."""
        shape, dtype, width, *_ = self._read(payload)
        padded = len(width) * TILE
        unpack = sum(dequantize_nbytes(int((width == b).sum()) * TILE, b) + 16 * int((width == b).sum()) * TILE
                     for b in range(1, 17))
        return _wire.arrays_nbytes(payload) + 8 * padded + unpack + 2 * math.prod(shape) * max(dtype.itemsize, 4)

    def encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """A cast, a magnitude, a division, a rounding and a few reductions per element."""
        return 16 * (-(-math.prod(shape) // TILE) * TILE)
