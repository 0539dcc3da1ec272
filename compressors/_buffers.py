"""Per-sample rows that both ends of a delta codec keep in step: the rows, how many sends each
has seen, their checksums, and the bounds on how far a peer may grow them.

A row is a sample's last decoded value in float16, found by the sample's stable id. The buffer
lives where the traffic is coded (a numpy array on the host, a tensor on an accelerator; see
:mod:`compressors._rows`) and grows on demand up to ``capacity`` ids, or to
:data:`MAX_GROWN_BYTES` without one; a codec serving a peer also refuses ids at or beyond
``Bounds.max_ids``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ._cache import LRU, nbytes_of
from ._rows import hash_weights, place, row_checksums, row_checksums_tensor, row_words, row_words_of, weight_halves
from .errors import CompressionError
from .policy import Bounds

#: Buffers that grow on demand stop at this many bytes, so a stray (or hostile) sample id cannot
#: make an end allocate without bound; beyond it, give a capacity.
MAX_GROWN_BYTES = 4 << 30


def check_ids(ids: Any, count: int, where: str, codec: str) -> np.ndarray:
    """``count`` distinct non-negative integer sample ids as int64, or a CompressionError."""
    if ids is None:
        raise CompressionError(f"{codec} needs {where} when training: one stable integer id per sample (its index "
                               "in the data set), so both ends can find that sample's buffer; got none")
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu" or ids.shape != (count,):
        raise CompressionError(f"{codec} {where} must be {count} integers (one per sample), got dtype {ids.dtype} "
                               f"shape {ids.shape}")
    ids = ids.astype(np.int64)
    ordered = np.sort(ids)
    if ids.size and ordered[0] < 0:
        raise CompressionError(f"{codec} {where} must be >= 0, got {int(ordered[0])}")
    if (ordered[1:] == ordered[:-1]).any():
        raise CompressionError(f"{codec} {where} repeat within one batch; each sample may appear once per batch")
    return ids


class SampleRows:
    """The fp16 rows and step counts of every sample id one end has coded."""

    def __init__(self, codec: str, capacity: int = 0) -> None:
        self.codec, self.capacity = codec, capacity
        self.buf: np.ndarray | torch.Tensor | None = None  # (ids, D) float16
        self.steps = np.zeros(0, dtype=np.int64)  # sends applied per id
        self._weights: LRU[int, np.ndarray] = LRU(2)
        self._halves: LRU[tuple[int, str], torch.Tensor] = LRU(2)

    def rows_for(self, ids: np.ndarray, d: int, bounds: Bounds | None) -> int:
        """Rows the buffer must have to cover ``ids`` with rows of D values; raises, allocating
        nothing, for ids out of range."""
        if self.buf is not None and self.buf.shape[1] != d:
            raise CompressionError(f"{self.codec} buffers hold {self.buf.shape[1]} values per sample but this batch "
                                   f"has {d}; every sample must have the same shape (pad sequences to one length)")
        need = int(ids.max()) + 1 if ids.size else 0
        if bounds is not None and need > bounds.max_ids:
            raise CompressionError(f"{self.codec} sample id {need - 1} is beyond this end's bound max_ids="
                                   f"{bounds.max_ids} (ids must be < max_ids); number samples 0..N-1, or raise "
                                   "Bounds.max_ids on this end")
        have = 0 if self.buf is None else self.buf.shape[0]
        if self.capacity:
            if need > self.capacity:
                raise CompressionError(f"{self.codec} sample id {need - 1} is out of range: capacity={self.capacity}")
            need = self.capacity
        elif need * (2 * d + 8) > MAX_GROWN_BYTES:
            raise CompressionError(f"{self.codec} sample id {need - 1} would grow the buffers past "
                                   f"{MAX_GROWN_BYTES >> 30} GiB; set capacity=<number of samples>")
        if self.buf is not None and need <= have:
            return have
        return need if self.capacity else max(need, min(2 * have, MAX_GROWN_BYTES // (2 * d + 8)))

    def growth_nbytes(self, ids: np.ndarray, d: int, bounds: Bounds | None) -> int:
        """Bytes :meth:`ensure` would allocate for ``ids``: the new buffer and step counts."""
        rows = self.rows_for(ids, d, bounds)
        return 0 if self.buf is not None and rows == self.buf.shape[0] else rows * (2 * d + 8)

    def ensure(self, ids: np.ndarray, d: int, bounds: Bounds | None,
               dev: torch.device | None) -> np.ndarray | torch.Tensor:
        """The buffer, on the host (``dev`` None) or on ``dev``, covering every id in ``ids``."""
        rows = self.rows_for(ids, d, bounds)
        self.buf = place(self.buf, dev)
        have = 0 if self.buf is None else self.buf.shape[0]
        if self.buf is not None and rows == have:
            return self.buf
        try:
            grown: np.ndarray | torch.Tensor = (np.zeros((rows, d), dtype=np.float16) if dev is None
                                                else torch.zeros((rows, d), dtype=torch.float16, device=dev))
        except (MemoryError, torch.OutOfMemoryError):
            raise CompressionError(f"{self.codec} cannot hold buffers for {rows} samples x {d} values") from None
        if self.buf is not None:
            grown[:have] = self.buf
        self.buf = grown
        self.steps = np.concatenate([self.steps, np.zeros(rows - have, dtype=np.int64)])
        return grown

    def checksums(self, rows: torch.Tensor) -> np.ndarray:
        """The checksum of each (fp16) row, the same on the host and on a device."""
        if rows.device.type == "cpu":
            arr = rows.numpy()
            n = row_words(arr)
            return row_checksums(arr, self._weights.get(n, lambda: hash_weights(n)))
        n, dev = row_words_of(rows.shape[1]), rows.device
        halves = self._halves.get((n, str(dev)), lambda: weight_halves(self._weights.get(n, lambda: hash_weights(n)), dev))
        return row_checksums_tensor(rows, halves)

    def checksum_nbytes(self, b: int, d: int) -> int:
        """What :meth:`checksums` of B rows of D values allocates: padded rows, weights if new."""
        n = row_words_of(d)
        return b * (2 * d + 4) + (0 if n in self._weights else 6 * 8 * n) + 8 * b

    def nbytes(self) -> int:
        return nbytes_of(self.buf) + int(self.steps.nbytes) + self._weights.nbytes() + self._halves.nbytes()

    def state_dict(self) -> dict[str, Any]:
        if self.buf is None:
            return {}
        buf = self.buf.detach().to("cpu", copy=True) if isinstance(self.buf, torch.Tensor) else torch.from_numpy(self.buf.copy())
        return {"buffer": buf, "steps": torch.from_numpy(self.steps.copy())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"buffer", "steps"}
        if unknown:
            raise CompressionError(f"{self.codec} state has unknown keys {sorted(unknown)}; expected buffer, steps")
        buf, steps = state.get("buffer"), state.get("steps")
        if (buf is None) != (steps is None):
            raise CompressionError(f"{self.codec} state needs both 'buffer' and 'steps', or neither")
        if buf is None:
            self.buf, self.steps = None, np.zeros(0, dtype=np.int64)
            return
        if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.float16 and buf.dim() == 2):
            raise CompressionError(f"{self.codec} state 'buffer' must be a 2-D float16 tensor (ids x values per sample)")
        if not (isinstance(steps, torch.Tensor) and steps.dtype == torch.int64 and tuple(steps.shape) == (buf.shape[0],)):
            raise CompressionError(f"{self.codec} state 'steps' must be an int64 tensor of {buf.shape[0]} counts")
        if self.capacity and buf.shape[0] != self.capacity:
            raise CompressionError(f"{self.codec} state holds {buf.shape[0]} ids but this codec has capacity={self.capacity}")
        self.buf = buf.detach().cpu().numpy().copy()
        self.steps = steps.detach().cpu().numpy().astype(np.int64).copy()


def row_count(shape: tuple[int, ...]) -> tuple[int, int]:
    """(samples, values per sample) of a batch of ``shape``."""
    return shape[0], math.prod(shape[1:])
