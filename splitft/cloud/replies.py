"""Request numbers and the reply cache: each request is applied once, a repeat is answered again.

Requests carry a sequence number; a session applies each number once, keeps its last few replies
and answers a repeated request from them, so a retry after a lost reply is harmless. A gap in the
numbers means requests were lost: the edge is told to resume, which re-sends them in order.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from ..errors import SessionLost
from ..wire import protocol
from .budget import nested_nbytes
from .limits import Limits

log = logging.getLogger(__name__)


class Replies:
    """One session's request numbers, its last replies, and how many repeats it was spared.

    ``last_seq`` is the last request applied; ``duplicates`` counts repeats answered from the
    cache and repeated optimizer steps skipped (what operators and load tests check for lost or
    repeated steps).
    """

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.last_seq = 0
        self.duplicates = 0
        self.nbytes = 0
        self._cache: OrderedDict[int, tuple[str, list, int]] = OrderedDict()  # seq → (type, frames, bytes)

    def resumed_at(self, seq: int) -> None:
        """Requests up to ``seq`` were applied (a session restored from its checkpoint)."""
        self.last_seq = seq

    def __len__(self) -> int:
        """Replies kept."""
        return len(self._cache)

    def is_new(self, seq: int) -> bool:
        """True for the next request; False for one applied already; raises on a gap."""
        if seq <= self.last_seq:
            return False
        if seq != self.last_seq + 1:
            raise SessionLost(f"request {seq} arrived but request {self.last_seq + 1} was expected "
                              "(requests were lost); resume the session to re-send them")
        return True

    def keep(self, seq: int, kind: str, frames: list, limits: Limits, held: int) -> int:
        """Record ``seq`` as applied and cache its reply, within the cache's count and the session's
        memory (``held``: what the session holds now, this cache included); returns how much the
        cache grew (less than nothing when it dropped older replies to fit)."""
        others, before = held - self.nbytes, self.nbytes
        self.last_seq = seq
        nbytes = nested_nbytes(frames)
        self._cache[seq] = (kind, frames, nbytes)
        self.nbytes += nbytes
        while self._cache and (len(self._cache) > limits.reply_cache
                               or others + self.nbytes > limits.session_memory_bytes):
            _, (_, _, dropped) = self._cache.popitem(last=False)
            self.nbytes -= dropped
        return self.nbytes - before

    def again(self, seq: int) -> tuple[list, str]:
        """The frames (and type) answering a repeat of request ``seq``; never applies it again."""
        self.duplicates += 1
        cached = self._cache.get(seq)
        if cached is None:
            text = (f"request {seq} was applied already and its reply is no longer kept (the session is at "
                    f"request {self.last_seq}); it is not applied again")
            return protocol.encode(protocol.Error(code="protocol", message=text, seq=seq)), "error"
        log.info("session %s: request %d repeated; answering from the reply cache", self.session_id, seq)
        return cached[1], cached[0]

    def repeated_step(self) -> None:
        """A repeated optimizer step was skipped (a request applied anew after its reply was lost)."""
        self.duplicates += 1


__all__ = ["Replies"]
