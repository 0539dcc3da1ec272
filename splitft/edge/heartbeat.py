"""Keeping an idle session alive: the cloud frees a session that is silent for its timeout.

While the user's loop is busy elsewhere (evaluation, data loading, a long local step), a thread
pings the cloud once the session has been idle for an interval, but never while a request is
under way (it would read that request's reply). A ping that goes unanswered marks the link as
suspect: the session's next request reconnects first.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Protocol

import transports

from ..errors import SessionLost, SplitFTError, TransportError, translated
from ..wire import protocol
from ..wire.protocol import Error, Ping, Pong

log = logging.getLogger(__name__)


class Pinged(Protocol):
    """The session a heartbeat keeps alive (:class:`~splitft.edge.requests.EdgeSession`)."""

    connection: transports.Connection
    timeout: float  # the longest wait for a reply

    @property
    def lock(self) -> threading.RLock: ...  # held while a request and its reply are under way
    @property
    def closed(self) -> bool: ...
    def suspect(self, fault: BaseException) -> None: ...  # the next request reconnects first


class Heartbeat:
    """Pings ``session``'s cloud every ``interval`` seconds of idleness (0: never).

    The session :meth:`touch`-es it whenever it sends or receives, so idleness is measured here.
    """

    def __init__(self, session: Pinged, interval: float) -> None:
        self.session = session
        self.interval = interval
        self.last_io = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def touch(self) -> None:
        """The session sent or received just now."""
        self.last_io = time.monotonic()

    def start(self) -> None:
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="splitft-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        session = self.session
        while not self._stop.wait(self.interval / 2):
            if time.monotonic() - self.last_io < self.interval or not session.lock.acquire(blocking=False):
                continue
            try:
                if session.closed:
                    return
                self._ping()
            except (TransportError, SplitFTError) as exc:
                log.warning("heartbeat: the cloud did not answer (%s); the next request reconnects", exc)
                session.suspect(exc)
            finally:
                self.touch()
                session.lock.release()

    def _ping(self) -> None:
        """One ping and its pong; anything else that arrives meanwhile is stale."""
        connection = self.session.connection
        with translated():
            connection.send(protocol.encode(Ping()))
            while True:
                reply = protocol.decode(connection.recv(min(self.session.timeout, 3 * self.interval)))
                if isinstance(reply, Pong):
                    return
                if isinstance(reply, Error) and reply.code == "session":
                    raise SessionLost(reply.message)


__all__ = ["Heartbeat", "Pinged"]
