"""AC-SGD's per-sample rows, on the host and on the tensor's own device: where the buffer
lives, gathering and storing its rows, and their checksums.

Both ends of an AC-SGD link checksum every buffer row they update and compare the sums, so a
sum must come out bit for bit the same whichever end computed it and where: numpy on the host
(:func:`row_checksums`, the definition), torch on an accelerator (:func:`row_checksums_tensor`).
The torch kernel never relies on signed 64-bit overflow, which C++ leaves undefined: it splits
words and weights into 16-bit halves, sums the partial products exactly in int64 on the device,
and wraps the b combined results modulo 2^64 in numpy's unsigned arithmetic on the host.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ._device import download
from .errors import CompressionError

#: Rows of at least this many 32-bit words (4 GiB) cannot be summed exactly in int64 halves.
MAX_DEVICE_WORDS = 1 << 30
#: 32-bit words checksummed at a time on a device: at most ~14 MiB of int64 temporaries.
CHUNK_WORDS = 1 << 18


def hash_weights(count: int) -> np.ndarray:
    """``count`` odd 32-bit weights, a fixed function of the position (a splitmix64 stream), so
    every machine and library version derives the same ones."""
    z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return (z >> np.uint64(32)).astype(np.uint32) | np.uint32(1)


def row_words(rows: np.ndarray) -> int:
    """32-bit words per row that :func:`row_checksums` sums (the row's bytes, zero-padded)."""
    return -(-(rows.dtype.itemsize * math.prod(rows.shape[1:])) // 4)


def row_words_of(d: int) -> int:
    """:func:`row_words` for rows of D fp16 values."""
    return -(-2 * d // 4)


def row_checksums(rows: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """A 64-bit checksum of each row's bytes: sum over its 32-bit words u_j of w_j * u_j mod 2^64.

    One vectorised multiply-add pass, about 2x cheaper than zlib.crc32 row by row. Each product
    fits in 64 bits, so a change confined to one word always changes the sum, and no fixed bit
    pattern (a sign or exponent flip repeated in several words) is shifted out of it as with
    64-bit words; changes in several words cancel only if their weighted sum happens to be a
    multiple of 2^64. Rows whose size is not a multiple of 4 bytes are padded with zeros.

    ``weights`` are ``hash_weights(row_words(rows))``, for a caller that keeps them between
    calls (a codec instance does; nothing is cached at module level).
    """
    rows = np.ascontiguousarray(rows)
    b = rows.shape[0]
    raw = rows.reshape(b, math.prod(rows.shape[1:])).view(np.uint8)
    if raw.shape[1] % 4:
        padded = np.zeros((b, -(-raw.shape[1] // 4) * 4), dtype=np.uint8)
        padded[:, : raw.shape[1]] = raw
        raw = padded
    words = raw.view("<u4")
    n = words.shape[1]
    if weights is None:
        weights = hash_weights(n)
    elif weights.shape != (n,) or weights.dtype != np.uint32:
        raise CompressionError(f"row_checksums: expected {n} uint32 weights, got {weights.dtype} {weights.shape}")
    return np.einsum("ij,j->i", words, weights, dtype=np.uint64, casting="safe")


def weight_halves(weights: np.ndarray, device: torch.device) -> torch.Tensor:
    """The checksum weights as a (2, n) int64 tensor on ``device``: low and high 16-bit halves."""
    w = weights.astype(np.int64)
    return torch.from_numpy(np.stack([w & 0xFFFF, w >> 16])).to(device)


def row_checksums_tensor(rows: torch.Tensor, halves: torch.Tensor) -> np.ndarray:
    """:func:`row_checksums` of a (B, D) float16 tensor, summed on its device: only the 3 B
    partial sums cross to the host.

    With u = ul + 2^16 uh and w = wl + 2^16 wh, sum w u = A + 2^16 M + 2^32 C for
    A = sum wl ul, M = sum (wl uh + wh ul), C = sum wh uh: every term is below 2^32 and there
    are fewer than 2^31 of them, so each sum is exact in int64; the wrap modulo 2^64 happens
    on the host, in uint64. Word j holds values 2j (low half) and 2j + 1 (high half), as the
    little-endian bytes :func:`row_checksums` reads. Rows go in chunks of about
    ``CHUNK_WORDS`` words, so the int64 temporaries stay bounded whatever the batch.
    """
    b, d = rows.shape
    n = row_words_of(d)
    if rows.dtype != torch.float16 or tuple(halves.shape) != (2, n) or halves.dtype != torch.int64:
        raise CompressionError(f"row_checksums_tensor: expected float16 rows and (2, {n}) int64 weight halves, "
                               f"got {rows.dtype} rows and {halves.dtype} {tuple(halves.shape)} halves")
    if n >= MAX_DEVICE_WORDS:
        raise CompressionError(f"acsgd rows of {d} values are too long to checksum on a device (at most {2 * MAX_DEVICE_WORDS - 2})")
    step = _chunk_rows(b, n)
    parts = [_partial_sums(rows[i:i + step], halves) for i in range(0, b, step)]
    a, m, c = download(torch.cat(parts, 1) if parts else halves.new_zeros(3, 0)).astype(np.uint64)
    return a + (m << np.uint64(16)) + (c << np.uint64(32))


def _chunk_rows(b: int, n: int) -> int:
    return max(1, min(b, CHUNK_WORDS // max(n, 1)))


def _partial_sums(rows: torch.Tensor, halves: torch.Tensor) -> torch.Tensor:
    """(A, M, C) of :func:`row_checksums_tensor` for some rows: a (3, rows) int64 tensor."""
    bits = rows.contiguous().view(torch.int16)
    if bits.shape[1] % 2:
        bits = torch.cat([bits, bits.new_zeros(bits.shape[0], 1)], dim=1)
    u = bits.to(torch.int64).bitwise_and_(0xFFFF)  # int64 throughout: no mixed-dtype casts
    lo, hi = u[:, 0::2], u[:, 1::2]
    wl, wh = halves[0], halves[1]
    return torch.stack([(lo * wl).sum(1), (lo * wh).sum(1) + (hi * wl).sum(1), (hi * wh).sum(1)])


def device_checksum_nbytes(b: int, d: int) -> int:
    """An upper bound on what :func:`row_checksums_tensor` allocates for B rows of D values,
    its steps summed: per chunk a padded copy, the int64 halves and four products; the
    partial sums of every row."""
    n = row_words_of(d)
    return 56 * _chunk_rows(b, n) * n + 64 * b


def index(ids: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host indices as an int64 tensor on ``device`` (one small copy to an accelerator)."""
    return torch.from_numpy(ids).to(device)


def split(z: torch.Tensor, full: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of ``z`` where ``full``, rows where not), without a copy when either side is empty.

    Boolean-mask indexing is several times slower than index lists in torch; the mixed case
    (a partial resync) uses index lists.
    """
    n_full = int(full.sum())
    if n_full == 0:
        return z[:0], z
    if n_full == full.size:
        return z, z[:0]
    return z[index(np.flatnonzero(full), z.device)], z[index(np.flatnonzero(~full), z.device)]


def fits_fp16(x: torch.Tensor) -> bool:
    """Whether a float32 tensor rounds to finite fp16 values: |x| < 65520, one min/max pass
    (cheaper than converting and then testing the fp16 values)."""
    if x.numel() == 0:
        return True
    lo, hi = torch.aminmax(x)
    return -65520.0 < lo.item() and hi.item() < 65520.0


def merge(full: np.ndarray, full_rows: torch.Tensor, keep_rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`split`: a (B, D) tensor of ``dtype``, ``full_rows`` where ``full``, on
    their device."""
    if not full.any():
        return keep_rows.to(dtype)
    if full.all():
        return full_rows.to(dtype)
    dev = full_rows.device
    out = torch.empty((full.size, full_rows.shape[1]), dtype=dtype, device=dev)
    out[index(np.flatnonzero(full), dev)] = full_rows.to(dtype)
    out[index(np.flatnonzero(~full), dev)] = keep_rows.to(dtype)
    return out


def place(buf: np.ndarray | torch.Tensor | None, dev: torch.device | None) -> np.ndarray | torch.Tensor | None:
    """``buf`` where a call on ``dev`` codes: a numpy array for the host path (``dev`` None),
    else a tensor on ``dev``. A CPU tensor and a numpy array share memory: no copy on the host."""
    if buf is None:
        return None
    if dev is None:
        return buf.detach().cpu().numpy() if isinstance(buf, torch.Tensor) else buf
    if isinstance(buf, np.ndarray):
        return torch.from_numpy(buf).to(dev)
    return buf if buf.device == dev else buf.to(dev)


def move_nbytes(buf: np.ndarray | torch.Tensor | None, dev: torch.device | None) -> int:
    """Bytes :func:`place` would allocate to move ``buf`` for a call on ``dev``."""
    if buf is None:
        return 0
    here = buf.device if isinstance(buf, torch.Tensor) else torch.device("cpu")
    there = torch.device("cpu") if dev is None else dev
    return 0 if here == there or here.type == there.type == "cpu" else int(buf.nbytes)


def _as_tensor(buf: np.ndarray | torch.Tensor) -> torch.Tensor:
    return buf if isinstance(buf, torch.Tensor) else torch.from_numpy(buf)


def gather(buf: np.ndarray | torch.Tensor, ids: np.ndarray, dev: torch.device | None) -> torch.Tensor:
    """Buffer rows ``ids`` in float32, on the host (``dev`` None) or on ``dev``."""
    if dev is None:
        return torch.from_numpy(buf[ids]).to(torch.float32)
    return _as_tensor(buf)[index(ids, dev)].to(torch.float32)


def store(buf: np.ndarray | torch.Tensor, ids: np.ndarray, rows: torch.Tensor, dev: torch.device | None) -> None:
    """Write updated fp16 rows into the buffer, on the host (``dev`` None) or on ``dev``."""
    if dev is None:
        buf[ids] = rows.numpy()
    else:
        _as_tensor(buf)[index(ids, dev)] = rows
