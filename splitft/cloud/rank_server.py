"""One rank's server in a cloud of several: the front door's placement and the shared bookkeeping.

Rank 0 listens on the public address. A new edge's hello is placed on the least-loaded live rank
(:meth:`RankGroup.place`); when that is another rank, the answer is a ``redirect`` naming where
the session lives, and the edge sends its hello there. A resuming hello (the edge lost its link)
is sent to the rank that holds the session while that rank lives, and placed anew when it died:
the rank it lands on restores the session from the shared checkpoint folder, and the edge
re-sends what was lost, as after any cloud restart (:mod:`.snapshots`).

Every rank answers the hellos that reach it like a one-process cloud, with its own limits.
Two rules keep a session that moved from being ended twice: only the rank the group's table names
as its holder deletes its checkpoints or counts it as ended (a stalled rank that wakes up and
expires its stale copy does neither).
"""

from __future__ import annotations

import time
from typing import Any

import transports

from ..errors import ConfigError
from ..wire.protocol import Hello, Message, Redirect
from .jobs import Job
from .ranks import BEAT_EVERY, RankGroup
from .server import CloudServer
from .session import CloudSession


class RankServer(CloudServer):
    """A :class:`CloudServer` that is one rank of a cloud; ``options`` are CloudServer's.

    ``max_sessions`` counts sessions ended on every rank of the job: each rank stops once the job
    has ended that many and it holds none.
    """

    def __init__(self, listener: transports.Listener, factories: Any, *, group: RankGroup, **options: Any) -> None:
        if options.get("shared_model"):
            raise ConfigError("--shared-model trains one cloud half per process; with several ranks the edges "
                              "on different ranks would train different halves. Run a shared model on one rank")
        super().__init__(listener, factories, **options)
        self.group = group
        self._last_tick = float("-inf")
        group.start_heartbeat(lambda: len(self.by_id))

    def expire(self, now: float | None = None) -> None:
        super().expire(now)
        tick = time.monotonic()
        if tick - self._last_tick >= BEAT_EVERY:
            self._last_tick = tick
            total = self.group.add_ended(0)
            if total is not None:
                self.ended = max(self.ended, total)
            if self.group.rank == 0:
                self.group.observe()

    def _on_hello(self, peer: bytes, msg: Hello, seq: int) -> Message | Job:
        try:
            target = self._target(peer, msg) if self.group.rank == 0 else self.group.rank
            if target != self.group.rank:
                self.event(f"{'resuming ' if msg.resume else ''}hello placed on rank {target}")
                return Redirect(address=self.group.addresses[target], rank=target)
            return super()._on_hello(peer, msg, seq)
        finally:
            self.group.hellos += 1  # after the session is bound (or refused): the front door reads both at once

    def _target(self, peer: bytes, msg: Hello) -> int:
        """The rank a hello at the front door goes to."""
        here = self.sessions.get(peer)
        if msg.nonce and here is not None and here.nonce == msg.nonce:
            return self.group.rank  # the same hello again: the session it opened is here
        own, capacity = len(self.by_id), self.limits.max_sessions
        sid = msg.resume.get("session") if isinstance(msg.resume, dict) else None
        if isinstance(sid, str):
            return self.group.rank if sid in self.by_id else self.group.route(sid, own, capacity)
        return self.group.place(own, capacity)

    def resumable(self) -> None:
        """Ranks share one checkpoint folder: a session not here may live on another rank."""
        return None

    def bind(self, peer: bytes, session: CloudSession) -> None:
        super().bind(peer, session)
        self.group.claim(session.id)

    def forget(self, session: CloudSession, text: str, discard: bool = True) -> None:
        mine = self.group.owns(session.id)
        ended = self.ended
        super().forget(session, text, discard and mine)
        if not mine:
            self.ended = ended  # another rank holds it now and will count it
            return
        self.group.release(session.id)
        if self.ended > ended:
            total = self.group.add_ended(self.ended - ended)
            if total is not None:
                self.ended = total


__all__ = ["RankServer"]
