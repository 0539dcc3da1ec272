"""Pack unsigned integers of 1 to 16 bits into a dense byte string, and back.

Quantizing codecs are only as small as their packing: an n-element, b-bit tensor must cost
``ceil(n * b / 8)`` bytes, not a byte per element. The layout is one little-endian bit stream:
value ``i`` occupies stream bits ``[i*b, (i+1)*b)``, least significant bit first, and stream bit
``k`` is bit ``k % 8`` of byte ``k // 8``. The fast paths (b = 1, 2, 4, 8, 16) produce exactly the
bytes of the general path; the tests pin that down.
"""

from __future__ import annotations

import numpy as np

from .errors import CompressionError

MAX_BITS = 16


def packed_nbytes(count: int, bits: int) -> int:
    """Bytes that ``count`` values of ``bits`` bits take once packed."""
    return (int(count) * int(bits) + 7) // 8


def _check_bits(bits: int) -> int:
    if not isinstance(bits, (int, np.integer)) or isinstance(bits, bool) or not 1 <= bits <= MAX_BITS:
        raise CompressionError(f"bit width must be an int in 1..{MAX_BITS}, got {bits!r}")
    return int(bits)


def pack(values: np.ndarray, bits: int) -> np.ndarray:
    """Pack non-negative integers below ``2**bits`` (any shape, flattened) into uint8."""
    bits = _check_bits(bits)
    v = np.asarray(values).reshape(-1)
    if v.size and (v.dtype.kind not in "ui" or v.min() < 0 or v.max() >= (1 << bits)):
        raise CompressionError(
            f"pack: values must be integers in [0, {(1 << bits) - 1}] for {bits} bits, "
            f"got dtype {v.dtype} in [{v.min()}, {v.max()}]"
        )
    n = v.size
    if bits == 8:
        return v.astype(np.uint8)
    if bits == 16:
        return v.astype("<u2").view(np.uint8).copy()
    if 8 % bits == 0:
        per = 8 // bits  # values per byte
        padded = np.zeros(-(-n // per) * per, dtype=np.uint8)
        padded[:n] = v
        lanes = padded.reshape(-1, per)
        out = np.zeros(lanes.shape[0], dtype=np.uint8)
        for j in range(per):
            out |= lanes[:, j] << np.uint8(j * bits)
        return out
    planes = ((v.astype(np.uint32)[:, None] >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    return np.packbits(planes.reshape(-1), bitorder="little")


def unpack(buf: np.ndarray, bits: int, count: int) -> np.ndarray:
    """Inverse of :func:`pack`: ``count`` values as uint16 (uint8 when ``bits <= 8``)."""
    bits = _check_bits(bits)
    count = int(count)
    buf = np.asarray(buf)
    if buf.dtype != np.uint8 or buf.ndim != 1 or buf.size != packed_nbytes(count, bits):
        raise CompressionError(
            f"unpack: expected {packed_nbytes(count, bits)} uint8 bytes for {count} values of "
            f"{bits} bits, got {buf.size} of dtype {buf.dtype} (ndim {buf.ndim})"
        )
    out_dtype = np.uint8 if bits <= 8 else np.uint16
    if bits == 8:
        return buf.copy()
    if bits == 16:
        return buf.view("<u2").astype(np.uint16)
    if 8 % bits == 0:
        per = 8 // bits
        mask = np.uint8((1 << bits) - 1)
        lanes = np.empty((buf.size, per), dtype=np.uint8)
        for j in range(per):
            lanes[:, j] = (buf >> np.uint8(j * bits)) & mask
        return lanes.reshape(-1)[:count]
    planes = np.unpackbits(buf, count=count * bits, bitorder="little").reshape(count, bits)
    out = np.zeros(count, dtype=np.uint16)
    for t in range(bits):
        out |= planes[:, t].astype(np.uint16) << np.uint16(t)
    return out.astype(out_dtype, copy=False)
