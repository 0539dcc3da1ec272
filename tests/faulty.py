"""Links that misbehave on purpose: drop, duplicate or delay messages, for the fault tests."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import msgpack

from splitft.wire import protocol
from transports import Connection, TransportTimeout


def message_type(frames: Sequence) -> str:
    """The type of a splitft header frame (``[version, type, fields...]``), without the rest of
    the protocol."""
    try:
        return msgpack.unpackb(bytes(memoryview(frames[0])), raw=False, ext_hook=lambda c, d: None)[1]
    except Exception:  # noqa: BLE001 — only a test helper
        return "?"


def carries_step(frames: Sequence) -> bool:
    try:
        message = protocol.decode(list(frames))
        return any(isinstance(op, dict) and op.get("op") == "step" for op in getattr(message, "ops", []))
    except Exception:  # noqa: BLE001
        return False


class FaultyConnection(Connection):
    """Wraps a connection; ``on_send`` / ``on_recv`` decide per message what happens to it.

    ``on_send(frames) -> int``: how many copies to send (0 drops it, 2 duplicates it).
    ``on_recv(frames) -> bool``: False drops the received message (the reply is "lost").
    """

    def __init__(self, inner: Connection, on_send: Callable[[list], int] | None = None,
                 on_recv: Callable[[list], bool] | None = None) -> None:
        self.inner = inner
        self.address = getattr(inner, "address", "faulty")
        self.on_send = on_send or (lambda frames: 1)
        self.on_recv = on_recv or (lambda frames: True)

    def send(self, frames):
        frames = list(frames)
        wire = 0
        for _ in range(self.on_send(frames)):
            wire = self.inner.send(frames)
        return wire

    def recv(self, timeout):
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TransportTimeout("no message (faulty link)")
            frames = self.inner.recv(left)
            if self.on_recv(frames):
                return frames

    def close(self):
        self.inner.close()
