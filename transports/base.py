"""The transport interface: move lists of frames between an edge and the cloud.

A message is a list of frames (anything exposing the buffer protocol). Transports count the bytes
they really send, so the metrics above them report what crossed, not an estimate.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

Frame = Any  # bytes, bytearray, memoryview, numpy array: anything with the buffer protocol
PeerId = bytes


def frame_nbytes(frame: Frame) -> int:
    """Bytes a frame occupies on the wire."""
    return memoryview(frame).nbytes


def message_nbytes(frames: Sequence[Frame]) -> int:
    return sum(frame_nbytes(f) for f in frames)


class Connection(ABC):
    """The edge's end: one peer, ordered delivery."""

    @abstractmethod
    def send(self, frames: Sequence[Frame]) -> int:
        """Queue one message; return the bytes it puts on the wire."""

    @abstractmethod
    def recv(self, timeout: float | None) -> list[Frame]:
        """Next message, or :class:`TransportTimeout` after ``timeout`` seconds (None: wait forever)."""

    @abstractmethod
    def close(self) -> None:
        """Drop anything unsent and release the socket. Safe to call twice."""

    #: Whether :meth:`wait_readable` and :meth:`wake` work. A thread that owns the connection
    #: (the link emulator's pump) then sleeps until a message comes, a timer runs out, or
    #: another thread wakes it, instead of waking at intervals to look.
    supports_wake = False

    def wait_readable(self, timeout: float | None) -> bool:
        """Block until a message may be received, :meth:`wake` is called, or ``timeout`` seconds
        pass (never less: a timer that fired early would make its caller spin). True when a
        message is waiting. A wake that came before the call makes it return at once."""
        raise NotImplementedError(f"{type(self).__name__} cannot be woken")

    def wake(self) -> None:
        """Make a :meth:`wait_readable` in another thread return now (or the next one, if none
        is waiting). Thread-safe; harmless after :meth:`close`."""
        raise NotImplementedError(f"{type(self).__name__} cannot be woken")

    def __enter__(self) -> "Connection":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Listener(ABC):
    """The cloud's end: many peers, each told apart by an opaque id."""

    address: str
    #: Whether :meth:`wake` ends a waiting :meth:`recv` (else a receive waits out its timeout).
    supports_wake: bool = False

    @abstractmethod
    def send(self, peer: PeerId, frames: Sequence[Frame]) -> int:
        """Queue one message to ``peer``; return the bytes it puts on the wire."""

    @abstractmethod
    def recv(self, timeout: float | None) -> tuple[PeerId, list[Frame]]:
        """Next message from any peer, or :class:`TransportTimeout`."""

    @abstractmethod
    def close(self) -> None:
        """Release the socket. Safe to call twice."""

    def wake(self) -> None:
        """End a :meth:`recv` that waits in another thread now, with :class:`TransportTimeout`
        (the next one, if none waits). Thread-safe. For a server whose worker threads finish work
        the receiving thread must answer: it can sleep in :meth:`recv` instead of polling, which
        on a small machine steals the cores those workers compute on. Here it does nothing: see
        :attr:`supports_wake`."""

    def origin(self, peer: PeerId) -> str:
        """Who stands behind ``peer``: its authenticated key, else its network address, else ""
        (the server caps sessions per origin, so one host cannot take every place)."""
        return self.origins(peer)[0]

    def origins(self, peer: PeerId) -> tuple[str, ...]:
        """Every origin ``peer``'s sessions count against, :meth:`origin` first: an address and,
        where the link has one that no allow-list vouches for, a key as well."""
        return ("",)

    def __enter__(self) -> "Listener":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
