"""Request numbers and the reply cache: each request is applied once, a repeat is answered again.

Requests carry a sequence number; a session applies each number once, keeps its last few replies
and answers a repeated request from them, so a retry after a lost reply is harmless. A gap in the
numbers means requests were lost: the edge is told to resume, which re-sends them in order.
"""

from __future__ import annotations

import logging

from ..wire import protocol
from .budget import nested_nbytes
from ..errors import SessionLost
from .limits import Limits
from .session import CloudSession

log = logging.getLogger(__name__)


def is_new(session: CloudSession, seq: int) -> bool:
    """True for the next request of ``session``; False for one applied already; raises on a gap."""
    if seq <= session.last_seq:
        return False
    if seq != session.last_seq + 1:
        raise SessionLost(f"request {seq} arrived but request {session.last_seq + 1} was expected "
                          "(requests were lost); resume the session to re-send them")
    return True


def keep(session: CloudSession, seq: int, kind: str, frames: list, limits: Limits) -> None:
    """Record ``seq`` as applied and cache its reply, within the cache's count and the session's memory."""
    session.last_seq = seq
    nbytes = nested_nbytes(frames)
    session.replies[seq] = (kind, frames, nbytes)
    session.reply_bytes += nbytes
    while session.replies and (len(session.replies) > limits.reply_cache
                               or session.held_bytes() > limits.session_memory_bytes):
        _, (_, _, dropped) = session.replies.popitem(last=False)
        session.reply_bytes -= dropped


def again(session: CloudSession, seq: int) -> tuple[list, str]:
    """The frames (and type) answering a repeat of request ``seq``; never applies it again."""
    session.duplicates += 1
    cached = session.replies.get(seq)
    if cached is None:
        text = (f"request {seq} was applied already and its reply is no longer kept (the session is at "
                f"request {session.last_seq}); it is not applied again")
        return protocol.encode(protocol.Error(code="protocol", message=text, seq=seq)), "error"
    log.info("session %s: request %d repeated; answering from the reply cache", session.id, seq)
    return cached[1], cached[0]


__all__ = ["again", "is_new", "keep"]
