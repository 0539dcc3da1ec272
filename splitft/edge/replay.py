"""What the edge keeps so that it can re-send what a failed link lost (see :mod:`splitft.edge.requests`)."""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass
class _Entry:
    frames: list
    steps: list[int] = field(default_factory=list)  # optimizer step ids the request carries
    checkpoint: bool = False  # the request asks the cloud for a checkpoint
    nbytes: int = 0
    borrowed: bool = False  # ``frames`` are the sent objects themselves (views of live tensors)


class ReplayLog:
    """Requests that may have to be sent again, by sequence number, as the bytes sent.

    The frames may be views of tensors a script can change once it has control again, so the log
    keeps its own copy of each. A request whose reply is read before the script runs again (a
    synchronous step: every request of a plain training loop) may be logged *borrowed*, the frames
    themselves: nothing can change them while it is in flight, and when its reply comes without a
    checkpoint to wait for it is dropped, so most steps never copy their activation at all.
    :meth:`own` copies whatever borrowed entry is still kept, before control goes back.
    """

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._borrowed: set[int] = set()
        self._scopes = threading.local()  # .depth: borrowing() scopes this thread is in
        self.nbytes = 0

    @contextmanager
    def borrowing(self) -> Iterator[None]:
        """A scope whose requests all have their replies read before it ends, with no script code
        run in between: what :meth:`add` logs in it is borrowed, and what is still kept of it is
        copied when the scope ends, normally or not."""
        depth = getattr(self._scopes, "depth", 0)
        self._scopes.depth = depth + 1
        try:
            yield
        finally:
            self._scopes.depth = depth
            if not depth:
                self.own()

    def add(self, seq: int, frames: list, steps: list[int], checkpoint: bool = False) -> None:
        borrowed = getattr(self._scopes, "depth", 0) > 0
        kept = list(frames) if borrowed else [memoryview(f).tobytes() for f in frames]
        self.drop(seq)
        self._entries[seq] = _Entry(kept, list(steps), checkpoint, sum(memoryview(f).nbytes for f in kept), borrowed)
        self.nbytes += self._entries[seq].nbytes
        if borrowed:
            self._borrowed.add(seq)

    def own(self) -> None:
        """Copy the frames of every borrowed entry still kept (the script is about to run again)."""
        for seq in list(self._borrowed):
            entry = self._entries[seq]
            entry.frames, entry.borrowed = [memoryview(f).tobytes() for f in entry.frames], False
        self._borrowed.clear()

    def drop(self, seq: int) -> None:
        entry = self._entries.pop(seq, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
            self._borrowed.discard(seq)

    def trim_before(self, seq: int) -> None:
        """Forget every request numbered below ``seq``."""
        for old in [s for s in self._entries if s < seq]:
            self.drop(old)

    def steps_of(self, seq: int) -> list[int]:
        entry = self._entries.get(seq)
        return entry.steps if entry is not None else []

    def checkpointed(self, seq: int) -> bool:
        entry = self._entries.get(seq)
        return entry is not None and entry.checkpoint

    def after(self, seq: int) -> list[tuple[int, list[bytes]]]:
        """The requests numbered above ``seq``, in order."""
        return [(s, e.frames) for s, e in self._entries.items() if s > seq]

    def get(self, seq: int) -> list[bytes] | None:
        entry = self._entries.get(seq)
        return entry.frames if entry is not None else None

    @property
    def first(self) -> int | None:
        return next(iter(self._entries), None)


class Backoff:
    """Exponential waits between reconnection attempts, with jitter so many edges spread out."""

    def __init__(self, initial: float = 0.1, maximum: float = 5.0, factor: float = 2.0,
                 rng: random.Random | None = None) -> None:
        self.maximum, self.factor = maximum, factor
        self._next = initial
        self._rng = rng or random.Random()

    def next(self) -> float:
        delay = self._next * (0.5 + self._rng.random() / 2)
        self._next = min(self.maximum, self._next * self.factor)
        return delay


__all__ = ["Backoff", "ReplayLog"]
