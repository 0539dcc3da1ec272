"""Getting a session back after its link failed: reconnect with a backoff between attempts,
resume the session with a ``hello`` that says which requests the edge can still re-send, and
re-send, byte for byte, what the cloud lost (see :mod:`.requests`, whose session this is a part of).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import transports

from ..errors import (CapacityError, HandshakeError, PeerGone, SessionLost, TransportError, TransportTimeout,
                      from_code, translated)
from ..metrics import Metrics
from ..wire import protocol
from ..wire.protocol import Error, Hello, Redirect, Welcome
from .replay import Backoff, ReplayLog
from .route import Route

log = logging.getLogger(__name__)

Reply = tuple[protocol.Message, int]  # a reply and its size on the wire


class Steps(Protocol):
    """Whoever counts the optimizer steps the edge took (:class:`~splitft.edge.stage.CloudStage`):
    a resuming hello tells the cloud where the edge is."""

    @property
    def step(self) -> int: ...


class NoSteps:
    """No optimizer has stepped (a session without one)."""

    step = 0


class Recovery:
    """The part of :class:`~.requests.EdgeSession` that brings a session back after a fault: what
    it reads and writes of the session is declared here, and set by the session."""

    connection: transports.Connection
    route: Route
    metrics: Metrics
    timeout: float
    reconnect_timeout: float
    recoveries: int
    session_id: str | None
    token: str
    _reconnect: Callable[[], transports.Connection] | None
    _hello: Hello | None
    _steps: Steps
    _seq: int
    _log: ReplayLog
    _outstanding: set[int]
    _early: dict[int, Reply]

    def _receive(self, seq: int, timeout: float) -> Reply:
        raise NotImplementedError

    def _welcomed(self, welcome: Welcome) -> None:
        raise NotImplementedError

    def _recover(self, seq: int, fault: BaseException) -> Reply:
        """Reconnect, resume the session and re-send what the cloud lost; return request ``seq``'s reply."""
        assert self._reconnect is not None
        address = getattr(self.connection, "address", "?")
        deadline = time.monotonic() + self.reconnect_timeout
        backoff = Backoff()
        attempt = 0
        while True:
            attempt += 1
            log.warning("link to the cloud at %s failed (%s); reconnecting, attempt %d", address, fault, attempt)
            self.connection.close()
            try:
                with translated():
                    self.connection = self._reconnect()
                    self.route.back_to_front_door()
                    welcome = self._resume_handshake(max(0.1, min(self.timeout, deadline - time.monotonic())))
                    result = self._replay(welcome.seq, seq)
                self.recoveries += 1
                log.warning("session %s resumed at request %d (step %d); replayed %d request(s)",
                            self.session_id, welcome.seq, welcome.steps, seq - min(seq, welcome.seq))
                return result
            except (HandshakeError, PeerGone):
                raise  # the session cannot be resumed: retrying will not change that
            except (TransportError, SessionLost, CapacityError) as exc:  # a refusal too: the keys opened
                fault = exc  # the session, so a port is held for a moment by another (restart, reused port)
            delay = backoff.next()
            if time.monotonic() + delay > deadline:
                raise TransportTimeout(
                    f"lost the cloud at {address} and could not get the session back within "
                    f"{self.reconnect_timeout:g} s (last error: {fault}); is the cloud running, and was it "
                    "restarted with the same --checkpoint-dir?"
                ) from None
            time.sleep(delay)

    def _resume_hello(self) -> Hello:
        assert self._hello is not None
        hello = Hello(**{**vars(self._hello), "weights": None, "value_hash": None})
        hello.resume = {"session": self.session_id, "token": self.token, "step": self._steps.step, "seq": self._seq,
                        "log_from": self._log.first or self._seq + 1}
        return hello

    def _resume_handshake(self, timeout: float) -> Welcome:
        frames = protocol.encode(self._resume_hello())

        def ask() -> protocol.Message:
            self.metrics.count("up", "control", wire=self.connection.send(frames))
            reply, wire_in = self._receive(0, timeout)
            self.metrics.count("down", "control", wire=wire_in)
            if isinstance(reply, Error):
                raise from_code(reply.code, f"cloud: {reply.message}")
            return reply

        reply = self._placed(ask)
        if not isinstance(reply, Welcome) or reply.session != self.session_id:
            raise HandshakeError(f"expected a welcome back to session {self.session_id}, got {reply.TYPE}")
        self._welcomed(reply)
        return reply

    def _placed(self, ask: Callable[[], protocol.Message]) -> protocol.Message:
        """The answer to the hello ``ask`` sends, after following the front door's redirect, if any."""
        reply = ask()
        if isinstance(reply, Redirect):
            self.connection = self.route.go(reply, self.connection)
            reply = ask()
            if isinstance(reply, Redirect):
                self.route.go(reply, self.connection)  # raises: a second hop is never taken
        return reply

    def _replay(self, cloud_seq: int, seq: int) -> Reply:
        """Re-send what the cloud lost, and what is still awaited; the reply to ``seq`` is the result.

        Requests after ``cloud_seq`` are applied again in order; awaited ones the cloud already
        applied (only their replies were lost) are answered from its reply cache. Replies to the
        other requests in flight are kept for their own awaits.
        """
        awaited = sorted(self._outstanding | {seq})
        top = max(awaited)
        resend = [(s, f) for s, f in self._log.after(cloud_seq) if s <= top]
        if cloud_seq < top and (not resend or resend[0][0] != cloud_seq + 1):
            raise HandshakeError(f"cannot replay: the cloud is at request {cloud_seq} but this edge kept requests "
                                 f"from {self._log.first} on")
        cached = [(s, self._log.get(s)) for s in awaited if s <= cloud_seq]
        for s, frames in cached + resend:
            if frames is None:
                raise HandshakeError(f"cannot replay request {s}: this edge no longer keeps it")
            self.metrics.count("up", "control", wire=self.connection.send(frames))
        self._early.clear()
        for s in awaited:
            self._early[s] = self._receive(s, self.timeout)
        return self._early.pop(seq)
