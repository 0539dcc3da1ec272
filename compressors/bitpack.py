"""Pack unsigned integers of 1 to 16 bits into a dense byte string, and back.

Quantizing codecs are only as small as their packing: an n-element, b-bit tensor must cost
``ceil(n * b / 8)`` bytes, not a byte per element. The layout is one little-endian bit stream:
value ``i`` occupies stream bits ``[i*b, (i+1)*b)``, least significant bit first, and stream bit
``k`` is bit ``k % 8`` of byte ``k // 8``. The fast paths (b = 1, 2, 4, 8, 16) produce exactly the
bytes of the general path; the tests pin that down.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import CompressionError

MAX_BITS = 16


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits take once packed."""
    return (int(count) * int(bits) + 7) // 8


def _check_bits(bits: int) -> int:
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS:
        raise CompressionError(f"bit width must be an int in 1..{MAX_BITS}, got {bits!r}")
    return int(bits)


def _lanes(width: int, spacing: int, total: int) -> int:
    """An integer of ``total`` bits with the low ``width`` bits of every ``spacing``-bit lane set."""
    return sum(((1 << width) - 1) << k for k in range(0, total, spacing))


# Widths 2 and 4 are packed SWAR-style: the 8/b values of one output byte sit one per byte in
# a little-endian word of 8/b bytes, and log2(8/b) shift-or-mask rounds squeeze neighbouring
# fields together (unpacking runs the rounds backwards). A handful of whole-array integer ops
# on contiguous words is several times faster than a loop over lanes with strided slices.
# Per width: the word dtype and, per round, (shift, mask after packing, mask after unpacking).
def _swar_plan(bits: int) -> tuple[np.dtype, list[tuple[int, int, int]]]:
    per = 8 // bits
    rounds = []
    for r in range(per.bit_length() - 1):
        spacing, width = 8 << r, bits << r  # fields before this round of packing
        rounds.append((spacing - width, _lanes(2 * width, 2 * spacing, 8 * per), _lanes(width, spacing, 8 * per)))
    return np.dtype(f"<u{per}"), rounds


_SWAR = {bits: _swar_plan(bits) for bits in (2, 4)}


def _pack_swar(v: np.ndarray, bits: int) -> np.ndarray:
    word, rounds = _SWAR[bits]
    per = word.itemsize
    n = v.size
    if n % per:
        padded = np.zeros(-(-n // per) * per, dtype=np.uint8)
        padded[:n] = v
        v = padded
    w = np.ascontiguousarray(v, dtype=np.uint8).view(word)
    for shift, packed_mask, _ in rounds:
        w = w | (w >> word.type(shift))
        w &= word.type(packed_mask)
    return w.astype(np.uint8)


def _unpack_swar(buf: np.ndarray, bits: int, count: int) -> np.ndarray:
    word, rounds = _SWAR[bits]
    w = buf.astype(word)
    for shift, _, unpacked_mask in reversed(rounds):
        w |= w << word.type(shift)
        w &= word.type(unpacked_mask)
    return w.view(np.uint8)[:count]


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack non-negative integers below ``2**bits`` (any shape, flattened) into uint8."""
    bits = _check_bits(bits)
    v = np.asarray(values).reshape(-1)
    if v.size and (v.dtype.kind not in "ui" or _out_of_range(v, bits)):
        raise CompressionError(
            f"pack: values must be integers in [0, {(1 << bits) - 1}] for {bits} bits, "
            f"got dtype {v.dtype} in [{v.min()}, {v.max()}]"
        )
    if bits == 8:
        return v.astype(np.uint8)
    if bits == 16:
        return v.astype("<u2").view(np.uint8).copy()
    if bits == 1:
        return np.packbits(v.astype(np.uint8, copy=False), bitorder="little")
    if bits in _SWAR:
        return _pack_swar(v.astype(np.uint8, copy=False), bits)
    # any other width: the bits of each value, LSB first, one row per value; keep ``bits`` columns
    width = 8 if bits < 8 else 16
    planes = np.unpackbits(v.astype(f"<u{width // 8}").view(np.uint8), bitorder="little").reshape(v.size, width)
    return np.packbits(planes[:, :bits].reshape(-1), bitorder="little")


def _out_of_range(v: np.ndarray, bits: int) -> bool:
    """Whether any value of an integer array falls outside [0, 2**bits), skipping the bounds
    its dtype already guarantees (a uint8 array cannot exceed 8 bits)."""
    if v.dtype.kind == "i" and v.min() < 0:
        return True
    return v.dtype.itemsize * 8 - (v.dtype.kind == "i") > bits and v.max() >= (1 << bits)


def unpack(buf: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack`: ``count`` values as uint16 (uint8 when ``bits <= 8``), in a new
    array the caller may modify."""
    bits = _check_bits(bits)
    count = int(count)
    buf = np.asarray(buf)
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != packed_nbytes(count, bits):
        raise CompressionError(
            f"unpack: expected {packed_nbytes(count, bits)} uint8 bytes for {count} values of "
            f"{bits} bits, got {buf.size} of dtype {buf.dtype} (ndim {buf.ndim})"
        )
    if bits == 8:
        return buf.copy()
    if bits == 16:
        return buf.view("<u2").astype(np.uint16)
    if bits == 1:
        return np.unpackbits(buf, count=count, bitorder="little")
    if bits in _SWAR:
        return _unpack_swar(buf, bits, count)
    planes = np.unpackbits(buf, count=count * bits, bitorder="little").reshape(count, bits)
    out = np.zeros(count, dtype=np.uint16)
    for t in range(bits):
        out |= planes[:, t].astype(np.uint16) << np.uint16(t)
    return out.astype(np.uint8 if bits < 8 else np.uint16, copy=False)


# ---------------------------------------------------------------- the same layout in torch
# For tensors on an accelerator: the values are packed where they live, and only the packed
# bytes cross to the host. One general bit-plane kernel serves every width; it writes exactly
# the bytes of the numpy paths above (the tests compare them).


def pack_tensor(values: torch.Tensor, bits: int) -> torch.Tensor:
    """:func:`pack` for a tensor of non-negative integers, on its device: a uint8 tensor."""
    bits = _check_bits(bits)
    v = values.reshape(-1).to(torch.int32)
    if v.numel():
        lo, hi = torch.aminmax(v)
        if int(lo) < 0 or int(hi) >= (1 << bits):
            raise CompressionError(f"pack: values must be integers in [0, {(1 << bits) - 1}] for {bits} bits, "
                                   f"got values in [{int(lo)}, {int(hi)}]")
    if bits == 8:
        return v.to(torch.uint8)
    shifts = torch.arange(bits, device=v.device, dtype=torch.int32)
    planes = ((v.unsqueeze(1) >> shifts) & 1).to(torch.uint8).reshape(-1)
    pad = -planes.numel() % 8
    if pad:
        planes = torch.cat([planes, planes.new_zeros(pad)])
    weights = torch.tensor([1 << k for k in range(8)], device=v.device, dtype=torch.int32)
    return (planes.view(-1, 8).to(torch.int32) * weights).sum(1, dtype=torch.int32).to(torch.uint8)


def unpack_tensor_nbytes(count: int, bits: int) -> int:
    """What :func:`unpack_tensor` allocates for ``count`` values beyond the host path's unpacking
    (``quant.dequantize_nbytes`` prices that): its bit-plane temporaries are int32, a word per
    bit. Bounded from measured peaks, so a device decode is priced before it runs."""
    return 8 * int(bits) * int(count)


def unpack_tensor(buf: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """:func:`unpack` on ``buf``'s device: ``count`` values as int32."""
    bits = _check_bits(bits)
    count = int(count)
    if buf.dtype != torch.uint8 or buf.dim() != 1 or buf.numel() != packed_nbytes(count, bits):
        raise CompressionError(
            f"unpack: expected {packed_nbytes(count, bits)} uint8 bytes for {count} values of "
            f"{bits} bits, got {buf.numel()} of dtype {buf.dtype} (ndim {buf.dim()})"
        )
    b = buf.to(torch.int32)
    if bits == 8:
        return b
    stream = ((b.unsqueeze(1) >> torch.arange(8, device=b.device, dtype=torch.int32)) & 1).reshape(-1)
    planes = stream[: count * bits].view(count, bits)
    return (planes << torch.arange(bits, device=b.device, dtype=torch.int32)).sum(1, dtype=torch.int32)
