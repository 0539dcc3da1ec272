"""What the edge keeps so that it can re-send what a failed link lost (see :mod:`splitft.edge.requests`)."""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class _Entry:
    frames: list[bytes]
    steps: list[int] = field(default_factory=list)  # optimizer step ids the request carries
    checkpoint: bool = False  # the request asks the cloud for a checkpoint
    nbytes: int = 0


class ReplayLog:
    """Requests that may have to be sent again, by sequence number, as the bytes sent."""

    def __init__(self) -> None:
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self.nbytes = 0

    def add(self, seq: int, frames: list, steps: list[int], checkpoint: bool = False) -> None:
        # Our own copy: the frames may be views of tensors the caller changes later.
        copies = [memoryview(f).tobytes() for f in frames]
        self.drop(seq)
        self._entries[seq] = _Entry(copies, list(steps), checkpoint, sum(len(f) for f in copies))
        self.nbytes += self._entries[seq].nbytes

    def drop(self, seq: int) -> None:
        entry = self._entries.pop(seq, None)
        if entry is not None:
            self.nbytes -= entry.nbytes

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
