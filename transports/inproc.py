"""Queues inside one process: the same interface as ZeroMQ, for tests and simulation.

Frames are copied on send, as a real wire would, so neither side can alias the other's tensors.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import deque
from collections.abc import Sequence

from .base import Connection, Frame, Listener, PeerId, message_nbytes
from .errors import TransportClosed, TransportTimeout

_CLOSED = object()
_WAKE = object()  # wake(): ends a waiting recv


def _copy(frames: Sequence[Frame]) -> list[memoryview]:
    return [memoryview(bytearray(memoryview(f).tobytes())) for f in frames]


class _Mailbox:
    """An edge's inbox: a queue that a waiter can also be woken from without taking anything."""

    def __init__(self) -> None:
        self._items: deque = deque()
        self._cond = threading.Condition()
        self._woken = False

    def put(self, item: object) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify_all()

    def get(self, timeout: float | None) -> object:
        with self._cond:
            if not self._cond.wait_for(lambda: self._items, timeout):
                raise queue.Empty
            return self._items.popleft()

    def wait(self, timeout: float | None) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._items or self._woken, timeout)
            self._woken = False
            return bool(self._items)

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()


class InprocListener(Listener):
    """The cloud side. Edges get their end from :meth:`connect`."""

    supports_wake = True

    _ids = itertools.count(1)

    def __init__(self, name: str = "inproc") -> None:
        self.address = f"inproc://{name}"
        self._inbox: queue.Queue = queue.Queue()
        self._peers: dict[PeerId, _Mailbox] = {}
        self._lock = threading.Lock()
        self._closed = False

    def connect(self) -> "InprocConnection":
        peer = next(self._ids).to_bytes(4, "big")
        outbox = _Mailbox()
        with self._lock:
            self._peers[peer] = outbox
        return InprocConnection(self, peer, outbox)

    def send(self, peer: PeerId, frames: Sequence[Frame]) -> int:
        if self._closed:
            raise TransportClosed("listener is closed")
        with self._lock:
            outbox = self._peers.get(peer)
        if outbox is not None:  # like ZeroMQ: a message to a vanished peer is dropped
            outbox.put(_copy(frames))
        return message_nbytes(frames)

    def recv(self, timeout: float | None) -> tuple[PeerId, list[memoryview]]:
        if self._closed:
            raise TransportClosed("listener is closed")
        try:
            item = self._inbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no message on {self.address} within {timeout:.1f} s") from None
        if item is _CLOSED:
            raise TransportClosed("listener is closed")
        if item is _WAKE:
            raise TransportTimeout(f"woken on {self.address}")
        return item

    def wake(self) -> None:
        self._inbox.put(_WAKE)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._inbox.put(_CLOSED)

    def _deliver(self, peer: PeerId, frames: Sequence[Frame]) -> int:
        if self._closed:
            raise TransportClosed("the listener this connection points to is closed")
        self._inbox.put((peer, _copy(frames)))
        return message_nbytes(frames)

    def _forget(self, peer: PeerId) -> None:
        with self._lock:
            self._peers.pop(peer, None)


class InprocConnection(Connection):
    """The edge side of an in-process link."""

    def __init__(self, listener: InprocListener, peer: PeerId, outbox: _Mailbox) -> None:
        self.address = listener.address
        self._listener = listener
        self._peer = peer
        self._outbox = outbox
        self._closed = False

    def send(self, frames: Sequence[Frame]) -> int:
        if self._closed:
            raise TransportClosed("connection is closed")
        return self._listener._deliver(self._peer, frames)

    def recv(self, timeout: float | None) -> list[memoryview]:
        if self._closed:
            raise TransportClosed("connection is closed")
        try:
            return self._outbox.get(timeout=timeout)
        except queue.Empty:
            raise TransportTimeout(f"no message from {self.address} within {timeout:.1f} s") from None

    supports_wake = True

    def wait_readable(self, timeout: float | None) -> bool:
        if self._closed:
            raise TransportClosed("connection is closed")
        return self._outbox.wait(timeout)

    def wake(self) -> None:
        self._outbox.wake()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._listener._forget(self._peer)
