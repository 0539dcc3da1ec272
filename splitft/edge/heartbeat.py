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
from typing import TYPE_CHECKING

from ..wire import protocol
from ..errors import SessionLost, SplitFTError, TransportError, translated
from ..wire.protocol import Error, Ping, Pong

if TYPE_CHECKING:
    from .requests import EdgeSession

log = logging.getLogger(__name__)


class Heartbeat:
    """Pings ``session``'s cloud every ``interval`` seconds of idleness (0: never)."""

    def __init__(self, session: EdgeSession, interval: float) -> None:
        self.session = session
        self.interval = interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval > 0 and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="splitft-heartbeat", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        session = self.session
        while not self._stop.wait(self.interval / 2):
            if time.monotonic() - session._last_io < self.interval or not session.lock.acquire(blocking=False):
                continue
            try:
                if session.closed:
                    return
                with translated():
                    session.connection.send(protocol.encode(Ping()))
                    while True:  # anything but a pong here is stale
                        reply = protocol.decode(session.connection.recv(min(session.timeout, 3 * self.interval)))
                        if isinstance(reply, Pong):
                            break
                        if isinstance(reply, Error) and reply.code == "session":
                            raise SessionLost(reply.message)
            except (TransportError, SplitFTError) as exc:
                log.warning("heartbeat: the cloud did not answer (%s); the next request reconnects", exc)
                session._suspect = exc
            finally:
                session._last_io = time.monotonic()
                session.lock.release()
