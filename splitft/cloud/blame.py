"""Small helpers every cloud room uses: typed blame for the edge's input, how a peer's value is
quoted in an error, stage timers, and a log of internal errors a peer cannot flood."""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Literal

import compressors
import torch

from ..errors import CloudOutOfMemory, ModelError, SplitFTError, code_of, raised_name
from ..metrics import Timed
from ..wire.messages import Error
from ..wire.records import _short

#: A peer's value as an error quotes it: its repr, cut short (the wire's own rule, one import here).
short = _short


class _Blame:
    """The context :func:`blame` returns (a class: a request enters several)."""

    __slots__ = ("kind", "what")

    def __init__(self, kind: type[SplitFTError], what: str) -> None:
        self.kind, self.what = kind, what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> Literal[False]:
        if exc is None or not isinstance(exc, Exception) or isinstance(exc, _OURS):
            return False
        kind = CloudOutOfMemory if isinstance(exc, torch.OutOfMemoryError) else self.kind  # the batch's, as unsplit
        raise kind(f"{self.what}: {type(exc).__name__}: {str(exc)[:500]}") from exc


_OURS = (SplitFTError, compressors.CompressionError)


def blame(kind: type[SplitFTError], what: str) -> _Blame:
    """Turn an unexpected exception raised by edge-supplied input into a typed error.

    Our own typed errors pass through; anything else (a KeyError in a codec fed a malformed
    payload, a RuntimeError from a layer fed the wrong shape) is the edge's input, not our bug.
    Running out of memory is :class:`~splitft.errors.CloudOutOfMemory` whatever ``kind`` is.
    """
    return _Blame(kind, what)


class Stopwatch:
    """Seconds spent per stage of one request (``compute``, ``codec``), reported to the edge."""

    def __init__(self) -> None:
        self.seconds = {"compute": 0.0, "codec": 0.0}

    def __call__(self, stage: str) -> Timed:
        return Timed(self.seconds, stage)


class ErrorLog:
    """Internal errors are logged with a traceback at most once per ``interval`` seconds.

    Every such error still gets a typed reply; the log just cannot be flooded by a peer that found
    one and repeats it.
    """

    def __init__(self, log: logging.Logger, interval: float = 60.0) -> None:
        self.log, self.interval = log, interval
        self._last = -math.inf
        self.suppressed = 0

    def report(self, exc: BaseException, peer: bytes) -> None:
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            more = f" ({self.suppressed} more since the last one logged)" if self.suppressed else ""
            self.suppressed = 0
            self.log.error("internal error while serving peer %s%s", peer.hex(), more, exc_info=exc)
        else:
            self.suppressed += 1


def error_reply(exc: BaseException, seq: int, call: Any, max_chars: int) -> Error:
    """The typed ``error`` answering a request that raised ``exc``: its code, its text cut to
    ``max_chars``, the Python exception the half's code raised and where its generator was left."""
    return Error(code=code_of(exc), message=f"{type(exc).__name__}: {exc}"[:max_chars], seq=seq,
                 call=call if isinstance(call, int) and not isinstance(call, bool) else 0,
                 raised=raised_name(exc), rng=exc.rng if isinstance(exc, ModelError) else None)


__all__ = ["ErrorLog", "Stopwatch", "blame", "error_reply", "short"]
