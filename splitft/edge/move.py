"""Moving a live session to another cloud, mid-training (FedFly): ``model.move_to(address)``.

At a step boundary the edge applies its pending operations, asks its cloud for the session's
state (``leave``: the cloud answers with a ``handoff`` and ends the session there), opens a link
to the other cloud with the same link settings (emulation, CurveZMQ keys) and continues the
session there (``arrive``): the same session id, token, request numbers and step, and the cloud
half's weights, gradients, optimizer, codec and generator state as they were, so training goes on
as if it had not moved. The edge's own half and codecs do not change. Later faults reconnect to
the new cloud. No folder is shared: the state travels through the edge, which holds the token
that authenticates it (:mod:`splitft.cloud.moves`).

The first cloud keeps the session, unchanged, until the other has taken it; then the edge says
goodbye there. So a handoff lost on the way is asked for again on a new link (as any lost reply),
and if the other cloud refuses the session (its policy, its size, no room) the error is raised
and the session goes on where it was. A goodbye that does not arrive leaves the first cloud a
session nobody uses, which it frees when it has been idle too long.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

import transports

from ..metrics import Metrics
from ..errors import ConfigError, HandshakeError, SplitFTError, from_code, translated
from ..wire import protocol
from ..wire.coding import Traffic
from ..wire.protocol import Ack, Arrive, Bye, Error, Handoff, Hello, Leave, Welcome

log = logging.getLogger(__name__)

#: The reply types a request may expect (as :meth:`EdgeSession.exchange` takes them).
Expect = type[protocol.Message] | tuple[type[protocol.Message], ...]


class Moving(Protocol):
    """The session that moves (:class:`~splitft.edge.requests.EdgeSession`)."""

    session_id: str | None
    token: str
    timeout: float
    connection: transports.Connection
    metrics: Metrics

    @property
    def hello(self) -> Hello | None: ...
    @property
    def last_seq(self) -> int: ...
    def sync(self, want_state: bool = False, checkpoint: bool = False, pin: bool = False) -> object: ...
    def exchange(self, msg: protocol.Message, kind: str, expect: Expect, traffic: Traffic | None = None,
                 timer: str = "wait") -> tuple[protocol.Message, int]: ...
    def moved(self, connection: transports.Connection, welcome: Welcome,
              reconnect: Callable[[], transports.Connection] | None) -> None: ...


def move(session: Moving, step: int, address: str,
         follow: Callable[[str], transports.Connection] | None) -> Welcome:
    """Move ``session`` (at optimizer step ``step``) to the cloud at ``address``; ``follow`` opens a
    link there with this edge's link settings. Returns the new cloud's welcome."""
    if follow is None:
        raise ConfigError("this edge was given an open connection (or a function that opens one), which cannot "
                          "reach another cloud; give split() the cloud's address to move it")
    session.sync()  # pending operations first: the state that leaves is the one they leave
    reply, wire_in = session.exchange(Leave(), "control", Handoff)
    session.metrics.count("down", "control", wire=wire_in)
    assert isinstance(reply, Handoff)
    arrive = Arrive(hello=vars(_resume_hello(session, step)), state=reply.state)
    started = time.monotonic()
    try:
        with translated():
            connection = follow(address)
        welcome = _arrive(connection, arrive, session.timeout, session.metrics)
    except (SplitFTError, transports.TransportError) as exc:
        log.warning("the cloud at %s did not take session %s (%s); it goes on where it was", address,
                    session.session_id, exc)
        raise
    old, seq = session.connection, session.last_seq
    session.moved(connection, welcome, lambda: follow(address))
    _goodbye(old, seq + 1, min(session.timeout, 5.0), session.metrics)
    old.close()
    log.info("session %s moved to %s at request %d (step %d) in %.3f s", session.session_id, address, welcome.seq,
             welcome.steps, time.monotonic() - started)
    return welcome


def _resume_hello(session: Moving, step: int) -> Hello:
    hello = session.hello
    assert hello is not None
    seq = session.last_seq
    return Hello(**{**vars(hello), "weights": None, "value_hash": None,
                    "resume": {"session": session.session_id, "token": session.token, "step": step, "seq": seq,
                               "log_from": seq + 1}})


def _goodbye(connection: transports.Connection, seq: int, timeout: float, metrics: Metrics) -> None:
    """End the session at the cloud it left, which kept it until now; one try (if it is lost, that
    cloud frees the idle session in its own time)."""
    deadline = time.monotonic() + timeout
    try:
        with translated():
            metrics.count("up", "control", wire=connection.send(protocol.encode(
                Bye(reason="moved to another cloud", seq=seq))))
            reply = None
            while not isinstance(reply, (Ack, Error)):  # a heartbeat's pong may come first
                reply = protocol.decode(connection.recv(max(0.0, deadline - time.monotonic())))
        if isinstance(reply, Error):
            log.info("the cloud the session left answered its goodbye with %s: %s", reply.code, reply.message)
    except (SplitFTError, transports.TransportError) as exc:
        log.info("the cloud the session left did not confirm its goodbye (%s); it frees the session when idle", exc)


def _arrive(connection: transports.Connection, arrive: Arrive, timeout: float, metrics: Metrics) -> Welcome:
    """Send the arriving session on ``connection``; the welcome, or the cloud's refusal raised."""
    with translated():
        metrics.count("up", "control", wire=connection.send(protocol.encode(arrive)))
        frames = connection.recv(timeout)
        metrics.count("down", "control", wire=transports.message_nbytes(frames))
        reply = protocol.decode(frames)
    if isinstance(reply, Error):
        raise from_code(reply.code, f"cloud: {reply.message}")
    if not isinstance(reply, Welcome) or reply.session != arrive.hello["resume"]["session"]:
        raise HandshakeError(f"expected a welcome to the moved session, got {reply.TYPE}")
    if reply.seq != arrive.hello["resume"]["seq"]:
        raise HandshakeError(f"the cloud took the session at request {reply.seq}, the edge is at "
                             f"{arrive.hello['resume']['seq']}")
    return reply


__all__ = ["move"]
