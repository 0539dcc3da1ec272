"""The edge's reliable request layer: what makes a lost reply or a restarted cloud cost time, never a step.

Every request the edge sends gets the next sequence number and goes into a replay log
(:mod:`.replay`) as the exact bytes that were sent. When the link fails (no reply in time, the
connection drops, the cloud lost the session), the edge reconnects with a backoff between
attempts, tells the cloud in its ``hello`` which numbers it can still re-send, learns from the
``welcome`` where the cloud's state stands, and re-sends the requests after that point, byte for
byte (:mod:`.recovery`). The cloud applies each number once, so a re-sent request that had
already been applied is answered, not redone. While the user's loop is busy elsewhere, a heartbeat
keeps the cloud's session alive.

How much the log holds is set by the cloud's checkpoint policy, announced in the handshake: the
cloud writes a checkpoint right after applying every N-th optimizer step, so once the reply to
the request that carried step k·N is in, nothing before that request is ever needed again. An
edge whose log outgrows its budget without stepping (a long evaluation, say) asks the cloud for a
checkpoint, which trims it the same way. With no checkpoints (N = 0) only the request in flight
is kept: a cloud that survives keeps its state in memory, and one that does not cannot be resumed.

Nothing here knows tensors or autograd: it moves protocol messages. What rides on them belongs to
other rooms: the operations waiting for the next request to the outbox (:mod:`.outbox`), the codecs
and the optimizer step count to the stage (:mod:`.stage`), which this layer asks for the step only
when it resumes a session (:class:`Steps`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Union

import numpy as np

import transports

from ..wire import protocol
from ..wire.coding import Traffic
from ..errors import (AuthError, ConfigError, HandshakeError, PeerGone, ProtocolError, SessionLost, SplitFTError,
                      TooLarge, TransportError, TransportTimeout, UnfinishedForwardError, from_code, translated)
from ..metrics import Metrics
from ..options import Codecs, Faults
from ..wire.operations import Step
from ..wire.protocol import Ack, Bye, Error, Hello, Pong, Redirect, Sync, Welcome
from .heartbeat import Heartbeat
from .outbox import CLOSED, Outbox
from .recovery import NoSteps, Recovery, Reply, Steps
from .resume import ResumePoint
from .route import Follow, Route
from .replay import ReplayLog

log = logging.getLogger(__name__)

Expect = Union[type[protocol.Message], tuple[type[protocol.Message], ...]]  # the reply types a request awaits


class _LinkFault(Exception):
    """The link failed in a way a reconnection may cure."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def _numbered(msg: protocol.Message) -> bool:
    """Whether ``msg`` is a request the cloud applies once, by number (and the edge may replay)."""
    return msg.NUMBERED


class EdgeSession(Recovery):
    """One session with a cloud: the handshake, numbered requests and their replies, and recovery.

    It holds what the handshake settled for the session's life (its id and resume token, the
    cloud's limits and checkpoint policy, the codecs it named) and, in :attr:`outbox`, the
    operations waiting to ride on the next request.

    Args:
        connection: the open link to the cloud.
        codecs: the codecs of each direction the hello names (the stage holds their instances).
        faults: reply timeout, reconnection time and heartbeat.
        reconnect: opens a fresh link to the same cloud; None disables recovery (a fault raises).
        max_log_bytes: when the requests kept for a replay exceed this, the edge asks the cloud
            for a checkpoint, after which they are no longer needed.
        follow: opens a link to another rank of the cloud, for a front door's redirect (None:
            a redirect is refused; :mod:`.route`).
    """

    def __init__(self, connection: transports.Connection, *, codecs: Codecs, faults: Faults = Faults(),
                 metrics: Metrics | None = None, reconnect: Callable[[], transports.Connection] | None = None,
                 max_log_bytes: int = 256 * 2**20, follow: Follow | None = None) -> None:
        self.connection = connection
        self.codecs = codecs
        self.timeout = faults.timeout
        self.reconnect_timeout = faults.reconnect_timeout
        self.metrics = metrics or Metrics()
        self.max_log_bytes = int(max_log_bytes)
        self.session_id: str | None = None
        self.token = ""
        self.checkpoint_every = 0
        self.limits: dict[str, int] = {}
        self.shared = False  # the cloud half is shared with other edges
        self.recoveries = 0  # times the session was recovered after a fault
        self.closed = False
        self.outbox = Outbox(self.sync)
        self._seq = 0
        self._log = ReplayLog()
        self._outstanding: set[int] = set()  # numbers of requests whose reply has not been read
        self._early: dict[int, Reply] = {}  # replies that overtook the one awaited
        self._lock = threading.RLock()  # autograd may run backward on another thread
        self._pid = os.getpid()  # the process whose connection this is (a fork inherits a copy of it)
        self._trimming = False
        self._hello: Hello | None = None
        self._reconnect = reconnect
        self.route = Route(follow)
        self._steps: Steps = NoSteps()
        self._suspect: BaseException | None = None  # the link failed where no reply was awaited
        self._heartbeat = Heartbeat(self, faults.heartbeat)
        #: Called before each request but a goodbye: a refusal there leaves the request unsent. Held
        #: weakly (a ``weakref.WeakMethod``): it is the split model's, which this session must not keep
        #: alive once the script dropped it (a sweep's forgotten trials: see ``api.split``).
        self.before_request: weakref.ref[Callable[[], None]] | None = None

    @property
    def lock(self) -> threading.RLock:
        """Held while a request and its reply are under way (the heartbeat waits for it)."""
        return self._lock

    @property
    def hello(self) -> Hello | None:
        """The hello that opened this session (None before :meth:`open`)."""
        return self._hello

    @property
    def last_seq(self) -> int:
        """The number of the last request sent (0: none yet)."""
        return self._seq

    # ------------------------------------------------------------ requests and replies

    def send(self, msg: protocol.Message, kind: str, traffic: Traffic | None = None) -> int:
        """Number, log and send a request without waiting; returns its number (0: not numbered).

        Several requests may be in flight (micro-batches); :meth:`await_reply` collects their
        replies. ``kind`` and ``traffic`` (raw and payload bytes) are what the metrics count.
        """
        if self.closed:
            raise PeerGone(CLOSED)
        if os.getpid() != self._pid:
            raise ConfigError(f"this split model's session belongs to process {self._pid}; this one ({os.getpid()}) "
                              "was forked from it (a DataLoader worker with num_workers > 0) and shares its "
                              "connection, which would hang or mix up its replies. Use the model in the main "
                              "process (compute pseudo-labels there), or load the data with num_workers=0")
        before = self.before_request() if self.before_request is not None else None
        if before is not None and not isinstance(msg, Bye):
            try:
                before()
            except UnfinishedForwardError:  # refused before it left: its operations go with the next message
                self.outbox.requeue(getattr(msg, "ops", []))
                raise
        if not isinstance(msg, Sync):
            self.outbox.version += 1  # a forward or a backward changes the cloud half's tensors
        numbered = _numbered(msg)
        if numbered:
            self._seq += 1
            msg.seq = self._seq  # type: ignore[attr-defined]
        try:
            frames = protocol.encode(msg)
            self._check_limits(frames, msg)
        except Exception:  # nothing left: the number is the next request's
            if numbered:
                self._seq -= 1
            raise
        seq = self._seq if numbered else 0
        if seq:
            steps = [op.id for op in getattr(msg, "ops", ()) if isinstance(op, Step) and isinstance(op.id, int)]
            self._log.add(seq, frames, steps, checkpoint=bool(getattr(msg, "checkpoint", False)))
        try:
            with translated():
                wire = self.connection.send(frames)
            self.metrics.count("up", kind, raw=traffic.raw if traffic else 0,
                               payload=traffic.payload if traffic else 0, wire=wire)
        except AuthError:
            raise
        except TransportError as exc:  # a dead link: the await that follows recovers and re-sends
            if not seq or self._reconnect is None:
                raise
            self._suspect = exc
        finally:
            self._heartbeat.touch()
        self._outstanding.add(seq)
        return seq

    def await_reply(self, seq: int, expect: Expect, timer: str = "wait") -> Reply:
        """The reply to request ``seq``; errors from the cloud are raised as typed errors.

        The time blocked is added to ``timer``: "wait" for training traffic, which the report
        splits into wire and cloud time, "handshake" for the hello (the cloud builds its model).
        A link fault is repaired by :meth:`_recover` when a reconnect function is known; the
        caller only sees it take longer.
        """
        try:
            reply, wire_in = self._early.pop(seq) if seq in self._early else self._reply_to(seq, timer)
        finally:
            self._outstanding.discard(seq)
            self._heartbeat.touch()
        if isinstance(reply, Error):
            self.metrics.count("down", "control", wire=wire_in)
            if seq and reply.seq == 0 and seq == self._seq and not self._outstanding:
                self._log.drop(seq)  # the cloud could not even read the request: nothing was applied
                self._seq -= 1
            raise from_code(reply.code, f"cloud: {reply.message}", reply.raised, reply.rng)
        if isinstance(reply, Bye):
            self.metrics.count("down", "control", wire=wire_in)
            self.drop()
            raise PeerGone(f"the cloud ended the session: {reply.reason or 'no reason given'}")
        if not isinstance(reply, expect):
            wanted = " or ".join(t.TYPE for t in (expect if isinstance(expect, tuple) else (expect,)))
            raise ProtocolError(f"expected a {wanted} reply, got {reply.TYPE}")
        if seq:
            self._applied(seq)
        timings = getattr(reply, "timings", None) or {}
        for name in ("compute", "codec"):
            if isinstance(timings.get(name), (int, float)):
                self.metrics.add_time(f"cloud_{name}", float(timings[name]))
        return reply, wire_in

    def exchange(self, msg: protocol.Message, kind: str, expect: Expect, traffic: Traffic | None = None,
                 timer: str = "wait") -> Reply:
        """Send ``msg`` and wait for its reply."""
        with self.borrowing():
            return self.await_reply(self.send(msg, kind, traffic), expect, timer)

    def borrowing(self) -> AbstractContextManager[None]:
        """A scope whose requests all have their replies read before it ends, with no script code
        run in between: they are logged for a replay without a copy of their frames
        (:meth:`ReplayLog.borrowing <splitft.edge.replay.ReplayLog.borrowing>`)."""
        return self._log.borrowing()

    def _reply_to(self, seq: int, timer: str) -> Reply:
        with self.metrics.timed(timer):  # blocked on the other side: wire plus cloud work
            if self._suspect is not None and seq and self._reconnect is not None:
                fault, self._suspect = self._suspect, None
                return self._recover(seq, fault)
            try:
                return self._receive_guarded(seq)
            except _LinkFault as fault:
                if not seq or self._reconnect is None:
                    raise fault.cause from None
                return self._recover(seq, fault.cause)

    def _check_limits(self, frames: list, msg: protocol.Message) -> None:
        most = self.limits.get("max_message_bytes")
        size = transports.message_nbytes(frames)
        if isinstance(most, int) and size > most:
            raise TooLarge(f"this {msg.TYPE} message is {size} bytes; the cloud accepts at most {most}. Send "
                           "less (a compressing codec, smaller batches) or ask for a larger --max-message-mb")
        frames_most = self.limits.get("max_frames")
        if isinstance(frames_most, int) and len(frames) > frames_most:
            raise TooLarge(f"this {msg.TYPE} message has {len(frames)} frames; the cloud accepts at most {frames_most}")

    def _applied(self, seq: int) -> None:
        """The cloud answered request ``seq``: forget what can no longer be needed for a replay."""
        if self.checkpoint_every <= 0:
            self._log.trim_before(seq + 1)  # no checkpoints: only the request in flight matters
        elif self._log.checkpointed(seq) or any(s % self.checkpoint_every == 0 for s in self._log.steps_of(seq)):
            self._log.trim_before(seq)  # the cloud checkpointed right after this request's operations
        if self._log.nbytes > self.max_log_bytes and self.checkpoint_every > 0 and not self._trimming:
            self._trimming = True  # no step for a long while: a checkpoint lets the log go
            try:
                self.sync(checkpoint=True)
            finally:
                self._trimming = False

    def _receive_guarded(self, seq: int) -> Reply:
        """Wait for the reply to ``seq``; link faults come out as :class:`_LinkFault`."""
        try:
            with translated():
                return self._receive(seq, self.timeout)
        except AuthError as exc:
            if self.session_id is None:
                raise  # the first handshake: these keys are refused
            raise _LinkFault(exc) from exc  # ZeroMQ reconnected underneath to something else on that port
        except TransportTimeout as exc:
            raise _LinkFault(TransportTimeout(
                f"no reply from the cloud at {getattr(self.connection, 'address', '?')} within "
                f"{self.timeout:g} s (is `splitft cloud` running there? a slow model may need a larger timeout)"
            )) from exc
        except (TransportError, SessionLost) as exc:
            raise _LinkFault(exc) from exc

    def _receive(self, seq: int, timeout: float) -> Reply:
        """Read replies until the one to request ``seq``; replies to other requests still in
        flight are kept for their own awaits, stale ones dropped."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(f"no reply within {timeout:g} s")
            reply_frames = self.connection.recv(left)
            reply = protocol.decode(reply_frames)
            wire_in = transports.message_nbytes(reply_frames)
            if isinstance(reply, Pong) or (seq and isinstance(reply, (Welcome, Redirect))):
                continue  # a late answer to a heartbeat, or to a repeated hello
            reply_seq = getattr(reply, "seq", 0)
            if seq and reply_seq and reply_seq != seq:
                if reply_seq in self._outstanding and reply_seq not in self._early:
                    self._early[reply_seq] = (reply, wire_in)
                else:
                    log.info("dropping a stale reply to request %s (waiting for %s)", reply_seq, seq)
                continue
            if isinstance(reply, Error) and reply.code == "session":
                raise SessionLost(reply.message)
            return reply, wire_in

    def _welcomed(self, welcome: Welcome) -> None:
        self.session_id = welcome.session
        self.token = welcome.token
        self.checkpoint_every = int(welcome.checkpoint_every)
        self.limits = dict(welcome.limits or {})
        self.shared = bool(welcome.shared)
        most = self.limits.get("max_ops")
        self.outbox.most = most if isinstance(most, int) else None

    # ------------------------------------------------------------ opening and closing

    def open(self, hello: Hello, *, steps: Steps | None = None, resume: ResumePoint | None = None) -> Welcome:
        """Open the session (or, with ``resume`` from an edge checkpoint, continue one); ``steps``
        counts the optimizer steps a resuming hello reports."""
        with self._lock:
            self._hello = hello
            if steps is not None:
                self._steps = steps
            if resume is not None:
                self.session_id, self.token, self._seq = resume.session, resume.token, resume.seq
                with translated():
                    welcome = self._resume_handshake(self.timeout)
                if welcome.seq != self._seq or welcome.steps != resume.step:
                    raise HandshakeError(f"the cloud resumed session {welcome.session} at request {welcome.seq} "
                                         f"(step {welcome.steps}), but this edge checkpoint is at request "
                                         f"{self._seq} (step {resume.step})")
            else:
                def ask() -> protocol.Message:
                    reply, wire_in = self.exchange(hello, "control", (Welcome, Redirect), timer="handshake")
                    self.metrics.count("down", "control", wire=wire_in)
                    return reply

                placed = self._placed(ask)
                assert isinstance(placed, Welcome)
                self._welcomed(placed)
                welcome = placed
            self._heartbeat.start()
            return welcome

    def moved(self, connection: transports.Connection, welcome: Welcome, reconnect: Callable[[], transports.Connection] | None) -> None:
        """The session goes on at another cloud (:mod:`.move`): its link, how to reopen it, its welcome."""
        self.connection, self._reconnect, self.route = connection, reconnect, Route(self.route.follow)
        self._welcomed(welcome)

    def sync(self, want_state: bool = False, checkpoint: bool = False,
             pin: bool = False) -> dict[str, np.ndarray] | None:
        """Apply pending operations in the cloud now; the cloud part's weights if ``want_state``."""
        return self.sync_reply(want_state=want_state, checkpoint=checkpoint, pin=pin).state

    def optimizer_state(self) -> dict[str, dict[str, np.ndarray]]:
        """The cloud optimizer's state, parameter name → {key → array}, once pending operations are applied."""
        return self.sync_reply(want_optimizer_state=True).optimizer_state or {}

    def sync_reply(self, want_state: bool = False, checkpoint: bool = False, pin: bool = False,
                   grad_norm: float | None = None, grad_names: list[str] | None = None,
                   want_optimizer_state: bool = False, evaluate: list | None = None, want_grads: bool = False) -> Ack:
        """Apply pending operations in the cloud now; its reply carries the cloud part's weights
        (``want_state``), the ``grad_norm``-type norm of each of its gradients (of the
        ``grad_names``d parameters' only, when given), its optimizer's state (``want_optimizer_state``),
        the values of expressions over its tensors (``evaluate``) and its gradients (``want_grads``).

        ``checkpoint`` makes the cloud write a checkpoint right after these operations (``pin``:
        one it keeps until the next pinned one, to match an edge checkpoint).
        """
        with self._lock:
            msg = Sync(ops=self.outbox.take(), want_state=want_state, checkpoint=checkpoint or pin, pin=pin,
                       grad_norm=grad_norm, grad_names=grad_names, want_optimizer_state=want_optimizer_state,
                       evaluate=evaluate, want_grads=want_grads)
            reply, wire_in = self.exchange(msg, "control", Ack)
            self.metrics.count("down", "control", wire=wire_in)
            assert isinstance(reply, Ack)
            return reply

    def close(self, reason: str = "done") -> None:
        """Say goodbye (flushing pending operations) and release the connection. Idempotent.

        A normal goodbye ("done") on a link that can reconnect is a request like any other: if the
        cloud restarted meanwhile, the edge gets the session back and ends it there, so the steps
        riding on it are applied, the cloud counts the session as ended and drops its checkpoints.
        After an error or Ctrl-C the goodbye gets one try of a few seconds.
        """
        with self._lock:
            if self.closed:
                return
            try:
                if self._reconnect is not None and reason == "done":
                    _, wire_in = self.exchange(Bye(reason=reason, ops=self.outbox.take()), "control", Ack)
                    self.metrics.count("down", "control", wire=wire_in)
                    return
                self._seq += 1
                frames = protocol.encode(Bye(reason=reason, ops=self.outbox.take(), seq=self._seq))
                self.metrics.count("up", "control", wire=self.connection.send(frames))
                deadline = time.monotonic() + min(self.timeout, 5.0)
                while (left := deadline - time.monotonic()) > 0:
                    reply = protocol.decode(self.connection.recv(left))
                    if isinstance(reply, (Ack, Bye, Error)):
                        break
            except (transports.TransportError, SplitFTError) as exc:
                log.info("cloud did not confirm the goodbye: %s", exc)
            finally:
                self.outbox.closed = True
                self.drop()

    def drop(self) -> None:
        """Release the connection without a goodbye (the cloud frees the session at its timeout)."""
        self.closed = True
        self._heartbeat.stop()
        self.connection.close()

    def suspect(self, fault: BaseException) -> None:
        """The link failed while no request was under way: the next request reconnects first."""
        self._suspect = fault


__all__ = ["EdgeSession", "Expect", "Reply", "Steps"]
