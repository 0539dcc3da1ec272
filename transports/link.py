"""A slow network link emulated in user space: bandwidth and one-way delay, per direction.

The kernel on our machines has no netem, so ablations such as "100 Mbit/s with 20 ms latency" are
emulated here, on the edge's side of a connection. The model is the textbook one for a single
bottleneck link: each direction serialises one message at a time at its bandwidth, in order, and
every message then propagates for the one-way delay. A message may start serialising while the
previous one is still propagating, so pipelined requests overlap as they would on a real wire.

The link's description and its text form are :mod:`transports.link_spec`. Two layers here, kept
apart so the arithmetic can be tested without threads or clocks:

* :class:`LinkSchedule` — pure bookkeeping for one direction: given a message's size and the time
  it was handed to the link, when it starts, finishes serialising, and arrives.
* :class:`EmulatedConnection` — wraps a real :class:`~transports.base.Connection` (ZeroMQ or
  in-process) and holds each message until the schedule says it has arrived, in both directions.
  The cloud answers over loopback at once, so the edge side can account for the downlink too: a
  reply's "sent at" is the moment it came out of the inner connection.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .base import Connection, Frame, message_nbytes
from .errors import LinkSpecError, TransportClosed, TransportDisconnected, TransportError, TransportTimeout
from .link_spec import LinkDirection, LinkSpec

log = logging.getLogger(__name__)

# Times within this much of a deadline count as reached: float sums of delays and serialisation
# times are not exact, and a fake clock must not be asked to sleep for less than its resolution.
_EPS = 1e-9


# ----------------------------------------------------------------------------------- schedule


@dataclass(frozen=True)
class Transit:
    """When one message crossed one direction of the link (all times on the link's clock)."""

    nbytes: int  # what was scheduled: the message plus any per-message overhead
    sent: float  # handed to the link
    start: float  # first bit leaves (later than ``sent`` if the link was still busy)
    done: float  # last bit leaves; the link is free again
    arrival: float  # last bit reaches the other end

    @property
    def queued_s(self) -> float:
        return self.start - self.sent


def plan(direction: LinkDirection, nbytes: int, sent_at: float, free_at: float) -> Transit:
    """The pure rule: start when both the message and the link are ready, serialise, propagate."""
    start = max(sent_at, free_at)
    done = start + direction.serialise_s(nbytes)
    return Transit(nbytes, sent_at, start, done, done + direction.delay_s)


class LinkSchedule:
    """The state of one direction: when the link is next free, and what it has carried.

    Not thread-safe by itself; :class:`EmulatedConnection` calls it under its lock.
    """

    def __init__(self, direction: LinkDirection, *, overhead_bytes: int = 0) -> None:
        if overhead_bytes < 0:
            raise LinkSpecError(f"overhead_bytes must be >= 0, got {overhead_bytes}")
        self.direction = direction
        self.overhead_bytes = int(overhead_bytes)
        self.free_at = -math.inf
        self.messages = 0
        self.bytes = 0  # message bytes, without the overhead
        self.busy_s = 0.0  # total serialisation time, overhead included
        self.last: Transit | None = None

    def schedule(self, nbytes: int, sent_at: float) -> Transit:
        """Book a message of ``nbytes`` handed over at ``sent_at``; messages must come in send order."""
        if nbytes < 0:
            raise ValueError(f"a message cannot have {nbytes} bytes")
        transit = plan(self.direction, nbytes + self.overhead_bytes, sent_at, self.free_at)
        self.free_at = transit.done
        self.messages += 1
        self.bytes += nbytes
        self.busy_s += self.direction.serialise_s(transit.nbytes)
        self.last = transit
        return transit

    def stats(self) -> dict[str, float | int]:
        return {"messages": self.messages, "bytes": self.bytes, "busy_s": self.busy_s}


# --------------------------------------------------------------------------------- connection


@dataclass(frozen=True)
class LinkEvent:
    """A message leaving the emulated link: ``at`` is when it was really handed on.

    For ``"up"`` that is the moment it went into the inner connection; for ``"down"`` the moment
    :meth:`EmulatedConnection.recv` returned it. ``at - transit.arrival`` is the emulator's lateness.
    """

    direction: str
    transit: Transit
    at: float


class EmulatedConnection(Connection):
    """The edge end of a connection, slowed to a :class:`LinkSpec` in both directions.

    ``send`` returns at once, as a socket with room in its buffer does; a background thread (the
    pump) hands each message to ``inner`` when the uplink schedule says it arrives. The pump is
    the only thread that touches ``inner`` (ZeroMQ sockets are not thread-safe): it also drains
    replies as soon as they come out, stamps them with the downlink schedule, and ``recv``
    releases each at its arrival time. A reply that has come out of ``inner`` but not yet
    "arrived" is not visible: ``recv`` times out as it would on the real link, and the reply is
    still delivered later.

    On real time the emulator is driven by timers, not by looking: when ``inner`` can be woken
    (:attr:`~transports.base.Connection.supports_wake`, as the ZeroMQ and in-process connections
    can), the pump sleeps in ``inner.wait_readable`` until a reply comes, the next uplink message
    is due, or ``send``/``close`` wakes it; ``recv`` sleeps on a condition until the head reply's
    arrival or its own deadline. An idle link costs no CPU, and a busy one a few wake-ups per
    message. Uplink deliveries are late by at most the 1 ms granularity of the wait plus the
    scheduler's latency, never early.

    ``clock`` and ``sleep`` make time injectable. With the default (``sleep=None``) the link runs
    on real time. With a fake clock, pass a ``sleep`` that advances it: the link's time then
    moves only through that ``sleep``, always after the pump has drained ``inner``, so a test
    that replies before calling ``recv`` gets exact, repeatable times.

    ``copy`` snapshots the frames in ``send`` (like a kernel socket buffer), so a caller may
    reuse its arrays while the message is still "on the wire". ``overhead_bytes`` adds a fixed
    per-message cost to the schedule (framing, headers); byte counts returned by ``send`` stay
    exactly what the inner transport carries. ``poll_interval`` matters only on real time with
    an ``inner`` that cannot be woken: the pump then blocks in ``inner.recv`` for at most that
    long, so a message sent meanwhile is seen within the interval; the default is the uplink
    delay clamped to [1 ms, 50 ms]. ``history`` is how many :class:`LinkEvent` records
    :attr:`events` keeps.
    """

    def __init__(self, inner: Connection, spec: LinkSpec | str, *,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] | None = None,
                 overhead_bytes: int = 0, copy: bool = True,
                 poll_interval: float | None = None, history: int = 256) -> None:
        self.spec = LinkSpec.coerce(spec)
        if poll_interval is None:
            poll_interval = min(max(self.spec.up.delay_s, 1e-3), 0.05)
        if not poll_interval > 0:
            raise ValueError(f"poll_interval must be > 0 s, got {poll_interval!r}")
        self.inner = inner
        self.address = getattr(inner, "address", "?")
        self.clock = clock
        self.up = LinkSchedule(self.spec.up, overhead_bytes=overhead_bytes)
        self.down = LinkSchedule(self.spec.down, overhead_bytes=overhead_bytes)
        self._events: deque[LinkEvent] = deque(maxlen=history)
        self._sleep = sleep
        self._copy = copy
        self._poll = float(poll_interval)
        self._timers = sleep is None and getattr(inner, "supports_wake", False)
        self._cond = threading.Condition()
        self._outbound: deque[tuple[Transit, list[Frame]]] = deque()
        self._inbound: deque[tuple[Transit, list[memoryview]]] = deque()
        self._deadlines: list[float] = []
        self._receivers = 0
        self._generation = 0  # bumped on every change the pump may need to see
        self._closed = False
        self._error: BaseException | None = None
        self._rounds = 0  # times the pump went round its loop: timers keep this near the message count
        log.info("emulating %s on %s", self.spec, self.address)
        self._pump = threading.Thread(target=self._run, name=f"link-pump {self.address}", daemon=True)
        self._pump.start()

    # ------------------------------------------------------------------ Connection

    def send(self, frames: Sequence[Frame]) -> int:
        nbytes = message_nbytes(frames)
        held = [memoryview(f).tobytes() for f in frames] if self._copy else list(frames)
        with self._cond:
            self._raise_if_unusable()
            was_idle = not self._outbound
            self._outbound.append((self.up.schedule(nbytes, self.clock()), held))
            self._changed()
        if was_idle and self._timers:
            # Arrivals come in send order, so only a message that becomes the head changes when
            # the pump must wake; a later one is covered by the timer already set for the head.
            self.inner.wake()
        return nbytes

    def recv(self, timeout: float | None) -> list[memoryview]:
        with self._cond:
            self._raise_if_closed()
            deadline = None if timeout is None else self.clock() + max(float(timeout), 0.0)
            self._receivers += 1
            if deadline is not None:
                self._deadlines.append(deadline)
            self._changed()
            try:
                while True:
                    # What came in before the link failed is still delivered, in order (at once:
                    # with the pump gone, a fake clock would never reach its arrival): a reply
                    # sent just before the peer went away counts, as on a real link.
                    if self._inbound:
                        self._raise_if_closed()
                    else:
                        self._raise_if_unusable()
                    now = self.clock()
                    head = self._inbound[0][0].arrival if self._inbound else None
                    if head is not None and (head <= now + _EPS or self._error is not None):
                        transit, frames = self._inbound.popleft()
                        self._events.append(LinkEvent("down", transit, now))
                        return frames
                    if deadline is not None and now >= deadline - _EPS:
                        raise TransportTimeout(self._timeout_message(timeout, head, now))
                    wake = min((t for t in (head, deadline) if t is not None), default=None)
                    self._cond.wait(None if wake is None else wake - now)
            finally:
                self._receivers -= 1
                if deadline is not None:
                    self._deadlines.remove(deadline)
                self._changed()

    def close(self) -> None:
        """Drop whatever is still on the emulated wire, stop the pump, and close ``inner``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            if self._outbound:
                log.debug("dropping %d message(s) still on the emulated uplink", len(self._outbound))
            self._outbound.clear()
            self._inbound.clear()
            self._changed()
        if self._timers:
            self.inner.wake()  # the pump may be asleep until a far-off timer
        if threading.current_thread() is not self._pump:
            self._pump.join(timeout=10)
            if self._pump.is_alive():
                log.warning("the link pump for %s did not stop within 10 s; it closes the connection when it does",
                            self.address)

    # ------------------------------------------------------------------ inspection

    def stats(self) -> dict[str, object]:
        """Bytes, messages and busy (serialisation) time per direction, for reports."""
        with self._cond:
            return {"link": self.spec.to_text(), "up": self.up.stats(), "down": self.down.stats()}

    @property
    def events(self) -> list[LinkEvent]:
        """The last ``history`` messages that left the link, both directions, oldest first."""
        with self._cond:
            return list(self._events)

    @property
    def in_flight(self) -> tuple[int, int]:
        """Messages held by the emulator: (not yet delivered up, not yet taken by ``recv``)."""
        with self._cond:
            return len(self._outbound), len(self._inbound)

    # ------------------------------------------------------------------ internals

    def _changed(self) -> None:
        self._generation += 1
        self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed:
            raise TransportClosed(f"connection to {self.address} is closed")

    def _raise_if_unusable(self) -> None:
        self._raise_if_closed()
        if self._error is not None:
            cls = TransportClosed if isinstance(self._error, TransportClosed) else TransportError
            raise cls(f"the emulated link to {self.address} failed in the background: {self._error}") from self._error

    def _timeout_message(self, timeout: float | None, head: float | None, now: float) -> str:
        text = f"no message from {self.address} within {timeout:g} s (emulated link: {self.spec})"
        if head is not None:
            text += f"; one is on the way and arrives in {head - now:.3g} s"
        return text

    def _run(self) -> None:
        try:
            step = self._timed_step if self._timers else self._step
            while step():
                self._rounds += 1
        except Exception as exc:  # surfaced to the caller on its next send/recv
            # a peer that went away (a cloud that exits after its last session) is the caller's to judge
            log.log(logging.INFO if isinstance(exc, (TransportClosed, TransportDisconnected)) else logging.WARNING,
                    "emulated link to %s failed: %s", self.address, exc)
            with self._cond:
                self._error = exc
                self._changed()
        finally:
            self.inner.close()  # the pump owns inner: no other thread may touch it while it runs

    def _timed_step(self) -> bool:
        """One round of the real-time pump: deliver what is due, take in replies, then sleep until
        the next uplink arrival, a reply, or a wake-up from ``send``/``close``."""
        with self._cond:
            if self._closed:
                return False
            now = self.clock()
            due = []
            while self._outbound and self._outbound[0][0].arrival <= now + _EPS:
                due.append(self._outbound.popleft())
            until = self._outbound[0][0].arrival if self._outbound else None
            if due:
                self._events.extend(LinkEvent("up", transit, now) for transit, _ in due)
        for _, frames in due:
            self.inner.send(frames)
        wait = None if until is None else max(until - self.clock(), 0.0)
        if wait != 0.0 and self.inner.wait_readable(wait):
            self._take_replies(0.0)
        return True

    def _step(self) -> bool:
        """One round of the pump: deliver what is due, else take in replies, else let time pass."""
        with self._cond:
            if self._closed:
                return False
            self._cond.notify_all()  # time has moved: receivers re-check their deadlines
            now = self.clock()
            due = []
            while self._outbound and self._outbound[0][0].arrival <= now + _EPS:
                due.append(self._outbound.popleft())
            until, hold = self._next_wake(now)
            generation = self._generation
        if due:
            for transit, frames in due:
                with self._cond:
                    self._events.append(LinkEvent("up", transit, self.clock()))
                self.inner.send(frames)
            return True
        if self._take_replies(0.0):
            return True  # something new is in flight: plan again before time moves
        self._let_time_pass(until, hold, generation)
        return True

    def _next_wake(self, now: float) -> tuple[float | None, bool]:
        """The next moment something is due, and whether a receiver has something to do *now*.

        Receivers' deadlines and replies count only while someone is receiving: with a fake
        clock, time must not run ahead to a reply nobody is waiting for.
        """
        hold = False
        times = [self._outbound[0][0].arrival] if self._outbound else []
        if self._receivers:
            pending = [self._inbound[0][0].arrival] if self._inbound else []
            for t in pending + self._deadlines:
                if t <= now + _EPS:
                    hold = True
                else:
                    times.append(t)
        return (min(times) if times else None), hold

    def _take_replies(self, wait: float) -> bool:
        """Move every reply out of ``inner`` (waiting up to ``wait`` for the first), stamped now."""
        got = False
        while True:
            try:
                frames = self.inner.recv(wait)
            except TransportTimeout:
                return got
            with self._cond:
                self._inbound.append((self.down.schedule(message_nbytes(frames), self.clock()), frames))
                self._changed()
            got, wait = True, 0.0

    def _let_time_pass(self, until: float | None, hold: bool, generation: int) -> None:
        if self._sleep is None:
            # Real time passes by itself; wait inside inner so replies are stamped on arrival.
            wait = self._poll if until is None else min(max(until - self.clock(), 0.0), self._poll)
            self._take_replies(wait)
        elif hold or until is None:
            # Fake time: nothing is due, or a receiver must act first; wait for a change.
            with self._cond:
                self._cond.wait_for(lambda: self._generation != generation or self._closed)
        else:
            self._sleep(max(until - self.clock(), 0.0))


def emulate(connection: Connection, link: LinkSpec | str | None, **options) -> Connection:
    """Wrap ``connection`` in an emulated link, or return it unchanged for none/loopback.

    ``options`` go to :class:`EmulatedConnection` (``overhead_bytes``, ``clock``, ``sleep``, ...).
    """
    if link is None:
        return connection
    spec = LinkSpec.coerce(link)
    if spec.is_loopback:
        return connection
    return EmulatedConnection(connection, spec, **options)
