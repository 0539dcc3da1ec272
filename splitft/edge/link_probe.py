"""Measuring the link before the hello (``--codecs auto``): its round trip and each direction's rate.

A few probes, timed on the edge's own connection, so an emulated link (``Link(emulate=...)``) is
measured as the training will see it: empty probes give the round trip (their minimum), a padded
probe the uplink (its extra time over the round trip), the same pad echoed back the downlink.
A pad grows until its extra time stands clear of timer noise (:data:`MIN_EXTRA_SECONDS`) or
reaches the cloud's cap, so a slow link costs a few small messages and a fast one a few larger.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

import transports

from ..errors import ProtocolError, from_code, translated
from ..wire import protocol
from ..wire.protocol import Error, Probe, Probed

#: Empty probes whose fastest round trip is the link's latency.
PINGS = 3
#: Tries of each padded probe; the fastest counts (queues and the scheduler only add time).
TRIES = 3
#: The first pad, and the largest (the cloud's cap, ``splitft.cloud.probes.PROBE_MAX_BYTES``).
FIRST_PAD = 64 << 10
MOST_PAD = 1 << 20
#: A pad's extra time must reach this before it is read as a rate, not noise.
MIN_EXTRA_SECONDS = 0.02


@dataclass(frozen=True)
class LinkEstimate:
    """What the probes measured: seconds and bytes per second (inf: faster than measurable)."""

    rtt: float
    up: float
    down: float
    #: per direction, the codec names the cloud's policy allows (a direction absent: every one)
    allowed: dict[str, frozenset[str]] = field(default_factory=dict)

    def summary(self) -> dict[str, float | None]:
        """Plain numbers for a log line or a metrics record (None for an unmeasurably fast rate)."""
        def rate(r: float) -> float | None:
            return None if math.isinf(r) else round(r / 1e6, 3)
        return {"rtt_ms": round(self.rtt * 1e3, 2), "up_MBps": rate(self.up), "down_MBps": rate(self.down)}


def _ask(connection: transports.Connection, msg: Probe, timeout: float) -> tuple[float, Probed]:
    start = time.perf_counter()
    with translated():
        connection.send(protocol.encode(msg))
        frames = connection.recv(timeout)
    seconds = time.perf_counter() - start
    reply = protocol.decode(frames)
    if isinstance(reply, Error):
        raise from_code(reply.code, f"the cloud refused a link probe: {reply.message}")
    if not isinstance(reply, Probed):
        raise ProtocolError(f"expected a probed reply to a link probe, got a {reply.TYPE}")
    return seconds, reply


def _rate(connection: transports.Connection, timeout: float, base: Callable[[int], float], *, echo: bool) -> float:
    """Bytes per second of the direction a pad adds time to, beyond ``base(pad bytes)`` seconds."""
    size = FIRST_PAD
    while True:
        pad = np.zeros(size, dtype=np.uint8)
        seconds = min(_ask(connection, Probe(pad=pad, echo=echo), timeout)[0] for _ in range(TRIES))
        extra = seconds - base(size)
        if extra >= MIN_EXTRA_SECONDS or size >= MOST_PAD:
            return size / extra if extra > 0 else math.inf
        size = min(size * 4, MOST_PAD)


def measure(connection: transports.Connection, timeout: float) -> LinkEstimate:
    """Probe the cloud at the other end of ``connection`` (no session needed) and estimate the link."""
    rtt, allowed = math.inf, dict[str, object]()
    for _ in range(PINGS):
        seconds, reply = _ask(connection, Probe(), timeout)
        rtt, allowed = min(rtt, seconds), reply.allowed
    up = _rate(connection, timeout, lambda size: rtt, echo=False)
    down = _rate(connection, timeout, lambda size: rtt + size / up, echo=True)
    names = {str(slot): frozenset(map(str, codecs)) for slot, codecs in allowed.items()
             if isinstance(codecs, list)}
    return LinkEstimate(rtt=rtt, up=up, down=down, allowed=names)


__all__ = ["LinkEstimate", "measure"]
