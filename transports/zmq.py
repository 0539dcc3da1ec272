"""ZeroMQ transport: DEALER on the edge, ROUTER on the cloud, tcp:// or ipc://.

Arrays travel as their own frames with ``copy=False``, so a large tensor is never copied into a
Python bytes object on the way out; received frames are exposed as memoryviews of ZeroMQ's own
buffers. Every socket closes with linger=0, so a dead peer never blocks shutdown.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from .base import Connection, Frame, Listener, PeerId, message_nbytes
from .errors import TransportClosed, TransportError, TransportTimeout


def _poll_ms(timeout: float | None) -> int | None:
    return None if timeout is None else max(0, int(timeout * 1000))


class ZmqConnection(Connection):
    """The edge side: a DEALER socket connected to one cloud address."""

    def __init__(self, address: str, *, context: zmq.Context | None = None,
                 max_message_bytes: int = -1) -> None:
        self.address = address
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise TransportError(f"cannot connect to {address!r}: {exc} (expected tcp://HOST:PORT or ipc://PATH)") from exc
        self._closed = False

    def send(self, frames: Sequence[Frame]) -> int:
        if self._closed:
            raise TransportClosed(f"connection to {self.address} is closed")
        try:
            self._sock.send_multipart(list(frames), copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"send to {self.address} failed: {exc}") from exc
        return message_nbytes(frames)

    def recv(self, timeout: float | None) -> list[memoryview]:
        if self._closed:
            raise TransportClosed(f"connection to {self.address} is closed")
        try:
            if not self._sock.poll(_poll_ms(timeout), zmq.POLLIN):
                raise TransportTimeout(f"no message from {self.address} within {timeout:.1f} s")
            parts = self._sock.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"receive from {self.address} failed: {exc}") from exc
        return [p.buffer for p in parts]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)


class ZmqListener(Listener):
    """The cloud side: a ROUTER socket bound to an address; peers are ZeroMQ routing ids.

    ``max_message_bytes`` makes ZeroMQ drop the connection of a peer that sends a bigger message,
    before any of it is buffered whole.
    """

    def __init__(self, address: str, *, context: zmq.Context | None = None,
                 max_message_bytes: int = -1) -> None:
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            if address.startswith("tcp://") and address.endswith(":0"):
                port = self._sock.bind_to_random_port(address[: -len(":0")])
                address = f"{address[: -len(':0')]}:{port}"
            else:
                self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._sock.close(linger=0)
            raise TransportError(
                f"cannot bind {address!r}: {exc} (is another server using it? port 0 picks a free one)"
            ) from exc
        self.address = address
        self._closed = False

    def send(self, peer: PeerId, frames: Sequence[Frame]) -> int:
        if self._closed:
            raise TransportClosed("listener is closed")
        try:
            self._sock.send_multipart([peer, *frames], copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"send to peer {peer.hex()} failed: {exc} (did it disconnect?)") from exc
        return message_nbytes(frames)

    def recv(self, timeout: float | None) -> tuple[PeerId, list[memoryview]]:
        if self._closed:
            raise TransportClosed("listener is closed")
        try:
            if not self._sock.poll(_poll_ms(timeout), zmq.POLLIN):
                raise TransportTimeout(f"no message on {self.address} within {timeout:.1f} s")
            parts = self._sock.recv_multipart(copy=False)
        except zmq.ZMQError as exc:
            raise TransportError(f"receive on {self.address} failed: {exc}") from exc
        return parts[0].bytes, [p.buffer for p in parts[1:]]

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(linger=0)
