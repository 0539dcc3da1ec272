"""``split(..., metrics_path=PATH)``: one JSON record per optimizer step, appended as it is taken.

Each record holds the step's id, the seconds since the previous record, the session's traffic and
timings so far (:meth:`splitft.metrics.Metrics.snapshot`) and, for a protected model, the privacy
spent (:mod:`splitft.privacy`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from ..metrics import JsonlWriter, Metrics


class StepLog:
    """The records of one split model's steps, in the file at ``path``."""

    def __init__(self, path: str | os.PathLike) -> None:
        self._writer = JsonlWriter(Path(path))
        self._last = time.perf_counter()

    def write(self, step: int, metrics: Metrics, privacy: Any = None) -> None:
        """Step ``step`` was taken (``privacy``: the model's protection, if any)."""
        now = time.perf_counter()
        self._writer.write({"step": step, "seconds": now - self._last} | metrics.snapshot()
                           | ({"privacy": privacy.snapshot()} if privacy is not None else {}))
        self._last = now

    def close(self) -> None:
        self._writer.close()


__all__ = ["StepLog"]
