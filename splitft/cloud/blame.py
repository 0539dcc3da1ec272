"""Small helpers every cloud room uses: typed blame for the edge's input, and stage timers."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import compressors

from ..errors import SplitFTError


@contextmanager
def blame(kind: type[SplitFTError], what: str) -> Iterator[None]:
    """Turn an unexpected exception raised by edge-supplied input into a typed error.

    Our own typed errors pass through; anything else (a KeyError in a codec fed a malformed
    payload, a RuntimeError from a layer fed the wrong shape) is the edge's input, not our bug.
    """
    try:
        yield
    except (SplitFTError, compressors.CompressionError):
        raise
    except Exception as exc:
        raise kind(f"{what}: {type(exc).__name__}: {str(exc)[:500]}") from exc


class Stopwatch:
    """Seconds spent per stage of one request (``compute``, ``codec``), reported to the edge."""

    def __init__(self) -> None:
        self.seconds = {"compute": 0.0, "codec": 0.0}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start
