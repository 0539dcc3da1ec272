"""What a running cloud has done, counted for an operator's live view (``--metrics-port``).

Nothing here runs unless the operator asks for metrics: :func:`watch` wraps a server's existing
choke points on that one instance — each handler of its dispatch table (a request of a type),
:meth:`~splitft.cloud.server.CloudServer.send` (the reply), the typed error a refusal becomes, a
session bound and a session forgotten — so a cloud without metrics runs exactly the code it ran
before, and one with them pays a few dict increments and a clock read per message. Everything
else (sessions open, memory booked, bytes, steps, the checkpoint folder, rank liveness) is read
from the server's own state when a scrape asks, on the scraper's thread.

The serving thread is the only writer of these counters; a scrape copies each dict whole (one C
call under the GIL) before reading it.
"""

from __future__ import annotations

import bisect
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

#: Request latency buckets, in seconds: a ping on loopback (~0.1 ms) to a heavy job (tens of s).
BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: Requests dispatched but not answered yet, at most (a peer that never gets its reply is dropped).
MAX_WAITING = 65536
#: The codec slot whose codec carries a (direction, kind) of traffic, as the cloud sees it.
SLOT = {("up", "activation"): "fwd", ("down", "gradient"): "bwd", ("down", "activation"): "ret",
        ("up", "gradient"): "ret_bwd"}

Traffic = tuple[str, str, str]  # direction, kind, codec name


class Latency:
    """A histogram of one request type's seconds from dispatch to reply (counts per bucket)."""

    __slots__ = ("counts", "total")

    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)  # the last: above every bucket
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        self.total += seconds


class Watch:
    """Counts of one cloud: requests, refusals, latencies, sessions; see the module's docstring."""

    def __init__(self, server: Any) -> None:
        self.server = server
        self.requests: defaultdict[str, int] = defaultdict(int)  # by message type
        self.refusals: defaultdict[str, int] = defaultdict(int)  # by error code
        self.latency: defaultdict[str, Latency] = defaultdict(Latency)
        self.opened = 0
        self.ended = 0
        self.ended_steps = 0
        self.ended_bytes: defaultdict[Traffic, int] = defaultdict(int)  # traffic of sessions gone
        #: Each live session by id, with its optimizer steps when this process bound it (a resumed
        #: one brings its own); a plain dict, so that a scrape copies it in one call.
        self._live: dict[str, tuple[Any, int]] = {}
        self._waiting: dict[bytes, tuple[float, str]] = {}  # peer → (dispatched at, request type)

    # ------------------------------------------------------------ on the serving thread

    def refused(self, code: str) -> None:
        self.refusals[code] += 1

    def bound(self, session: Any) -> None:
        known = self._live.get(session.id)
        if known is not None and known[0] is session:
            return  # the same session on a new connection
        if known is None:
            self.opened += 1
        else:  # restored in place of the one this process held: what that one did is kept
            self._keep(*known)
        self._live[session.id] = (session, session.mirrored.steps)

    def forgotten(self, session: Any) -> None:
        known = self._live.get(session.id)
        if known is not None and known[0] is session:
            del self._live[session.id]
            self.ended += 1
            self._keep(*known)

    def _keep(self, session: Any, first_steps: int) -> None:
        self.ended_steps += session.mirrored.steps - first_steps
        for key, wire in session_traffic(session).items():
            self.ended_bytes[key] += wire

    # ------------------------------------------------------------ on the scraper's thread

    def steps(self) -> int:
        """Optimizer steps applied by this process, over ended and live sessions."""
        live = sum(s.mirrored.steps - first for s, first in list(self._live.values()))
        return self.ended_steps + live

    def traffic(self) -> dict[Traffic, int]:
        """Wire bytes by direction, kind and codec, over ended and live sessions."""
        total = dict(self.ended_bytes)
        for session, _ in list(self._live.values()):
            for key, wire in session_traffic(session).items():
                total[key] = total.get(key, 0) + wire
        return total


def session_traffic(session: Any) -> dict[Traffic, int]:
    """One session's wire bytes by direction, kind and the name of the codec that carried them."""
    specs = session.codecs.specs
    out: dict[Traffic, int] = {}
    for (direction, kind), count in list(session.metrics.bytes.items()):
        slot = SLOT.get((direction, kind))
        codec = str(specs.get(slot, "identity")).split(":", 1)[0] if slot else "none"
        out[(direction, kind, codec)] = out.get((direction, kind, codec), 0) + count.wire
    return out


def watch(server: Any) -> Watch:
    """Count what ``server`` does from now on (its own instance only: other servers are untouched)."""
    w = Watch(server)
    for kind, handler in list(server.answers.items()):
        server.answers[kind] = _dispatching(w, handler, kind.TYPE)
    send, error, bind, forget = server.send, server._error, server.bind, server.forget

    waiting, latency, clock = w._waiting, w.latency, time.perf_counter

    def replied(peer: bytes, frames: list, kind: str) -> None:  # once per message: the latency since dispatch
        started = waiting.pop(peer, None)
        if started is not None:
            latency[started[1]].observe(clock() - started[0])
        send(peer, frames, kind)

    def refused(exc: BaseException, seq: int, call: Any) -> Any:
        reply = error(exc, seq, call)
        w.refused(reply.code)
        return reply

    def bound(peer: bytes, session: Any) -> None:
        bind(peer, session)
        w.bound(session)

    def forgotten(session: Any, text: str, discard: bool = True) -> None:
        w.forgotten(session)
        forget(session, text, discard)

    server.send, server._error, server.bind, server.forget = replied, refused, bound, forgotten
    for session in list(server.by_id.values()):
        w.bound(session)
    return w


def _dispatching(w: Watch, handler: Callable[..., Any], kind: str) -> Callable[..., Any]:
    requests, waiting, clock = w.requests, w._waiting, time.perf_counter

    def dispatch(peer: bytes, msg: Any, seq: int) -> Any:  # once per message: counted, and timed until its reply
        requests[kind] += 1
        if len(waiting) >= MAX_WAITING:
            waiting.clear()
        waiting[peer] = (clock(), kind)
        return handler(peer, msg, seq)
    return dispatch


__all__ = ["BUCKETS", "Latency", "Watch", "session_traffic", "watch"]
