"""ZeroMQ transport: DEALER on the edge, ROUTER on the cloud, tcp:// or ipc://, plain or CurveZMQ.

Arrays travel as their own frames with ``copy=False``, so a large tensor is never copied into a
Python bytes object on the way out; received frames after the first are exposed as memoryviews of
ZeroMQ's own buffers. A message's first frame (a header: small) is handed on as bytes. Whether
another frame follows is read from each received frame, never asked of the socket: pyzmq builds
an option enum for every ``RCVMORE`` query, which costs about as much as receiving the frame.
Every socket closes with linger=0, so a dead peer never blocks shutdown, and every send and
receive is bounded in time.

Faults a DEALER cannot see in its data (a refused CURVE handshake looks like silence, a dead
cloud like a slow one) are read from the socket monitor: the edge's :meth:`ZmqConnection.recv`
raises :class:`TransportRefused` for a failed handshake and :class:`TransportDisconnected` when
an established connection drops. ZMTP heartbeats on both ends notice a peer that vanished
without closing its TCP connection.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Sequence

import zmq
from zmq.utils.monitor import parse_monitor_message

from .base import Connection, Frame, Listener, PeerId
from .errors import TransportClosed, TransportDisconnected, TransportError, TransportRefused, TransportTimeout

log = logging.getLogger(__name__)

_MONITORED = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
              | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_DISCONNECTED)


def _poll_ms(timeout: float | None) -> int | None:
    """A poll's timeout in whole milliseconds, rounded up: rounded down, the last millisecond of
    every wait would spin through polls of 0 ms."""
    return None if timeout is None else max(0, math.ceil(timeout * 1000))


#: Flags as plain ints: or-ing pyzmq's enum flags costs about a microsecond a message.
_NOBLOCK = int(zmq.NOBLOCK)
_SNDMORE = int(zmq.SNDMORE)

#: pyzmq's ``Socket.send`` adds routing-id and group options (unused here) in Python on top of
#: this one; calling it directly saves that layer on every frame.
_send = zmq.backend.Socket.send
#: ``Socket.get`` without pyzmq's Python layer, and the ints it is asked with and answers in.
_get = zmq.backend.Socket.get
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def _send_frames(sock: zmq.Socket, frames: Sequence[Frame], flags: int) -> int:
    """Send ``frames`` as one message, frame by frame, and return its bytes: no list is built per
    message. pyzmq copies frames under its copy threshold (64 KiB) and hands larger ones to
    ZeroMQ without a copy. ``flags`` is a plain int (0 or ``_NOBLOCK``)."""
    last = len(frames) - 1
    more = flags | _SNDMORE
    nbytes = 0
    for i, frame in enumerate(frames):
        _send(sock, frame, flags if i == last else more, copy=False)
        nbytes += memoryview(frame).nbytes
    return nbytes


def _recv_nowait(sock: zmq.Socket) -> bytes | None:
    try:
        return sock.recv(_NOBLOCK)
    except zmq.Again:
        return None


def _recv_frames(sock: zmq.Socket) -> list[Frame] | None:
    """The next whole message, or None if none is queued: its first frame as bytes, the rest as
    memoryviews of ZeroMQ's buffers."""
    try:
        first = sock.recv(_NOBLOCK, copy=False)
    except zmq.Again:
        return None
    return [first.bytes, *_rest_of_message(sock, first.more)]


def _rest_of_message(sock: zmq.Socket, more: bool) -> list[memoryview]:
    """The frames that follow, as memoryviews of ZeroMQ's buffers (a multipart message arrives
    whole, so they are already here)."""
    frames = []
    while more:
        frame = sock.recv(0, copy=False)
        frames.append(frame.buffer)
        more = frame.more
    return frames


def _drain(fd: int) -> None:
    """Empty a non-blocking wake-up pipe."""
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def _heartbeats(sock: zmq.Socket, heartbeat: float | None) -> None:
    """ZMTP pings every ``heartbeat`` s; a peer silent for three of them is dropped."""
    if heartbeat:
        ivl = max(1, int(heartbeat * 1000))
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl)


class ZmqConnection(Connection):
    """The edge side: a DEALER socket connected to one cloud address.

    Args:
        address: ``tcp://HOST:PORT`` or ``ipc://PATH``.
        server_key: the cloud's CURVE public key (Z85); with ``public_key``/``secret_key`` (this
            edge's pair) it makes the link encrypted and authenticated. All three or none.
        max_message_bytes: receive limit per frame (-1: none).
        heartbeat: seconds between ZMTP pings (None/0: off).
        send_timeout: seconds a send may wait for queue room before failing.
    """

    def __init__(self, address: str, *, context: zmq.Context | None = None, max_message_bytes: int = -1,
                 server_key: bytes | None = None, public_key: bytes | None = None,
                 secret_key: bytes | None = None, heartbeat: float | None = 2.0,
                 send_timeout: float = 30.0) -> None:
        self.address = address
        self.curve = server_key is not None
        if (server_key is None) != (public_key is None) or (public_key is None) != (secret_key is None):
            raise TransportError("a CURVE connection needs server_key, public_key and secret_key together")
        self._ctx = context or zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.SNDTIMEO, max(0, int(send_timeout * 1000)))
        _heartbeats(self._sock, heartbeat)
        if self.curve:
            self._sock.curve_serverkey = server_key
            self._sock.curve_publickey = public_key
            self._sock.curve_secretkey = secret_key
        self._monitor = self._sock.get_monitor_socket(_MONITORED)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._wake_lock = threading.Lock()
        self._wake_pipe: tuple[int, int] | None = None  # made by the first wait_readable or wake
        self._wake_poller: zmq.Poller | None = None
        self.handshakes = 0  # completed handshakes; > 0 means a later disconnect is a dropped link
        self._closed = False
        try:
            self._sock.connect(address)
        except zmq.ZMQError as exc:
            self._release()
            raise TransportError(
                f"cannot connect to {address!r}: {exc} (expected tcp://HOST:PORT or ipc://PATH)") from exc

    def send(self, frames: Sequence[Frame]) -> int:
        if self._closed:
            raise TransportClosed(f"connection to {self.address} is closed")
        if not frames:
            raise TransportError("a message needs at least one frame")
        try:
            return _send_frames(self._sock, frames, 0)
        except zmq.Again:
            self._read_events()  # a refused handshake is why nothing leaves: that is raised instead
            raise TransportTimeout(
                f"send to {self.address} found no room for the message (is the cloud reachable?)") from None
        except zmq.ZMQError as exc:
            raise TransportError(f"send to {self.address} failed: {exc}") from exc

    def recv(self, timeout: float | None) -> list[Frame]:
        if self._closed:
            raise TransportClosed(f"connection to {self.address} is closed")
        try:
            # Data first, without a poll: a reply that made it counts even if the link died after.
            frames = _recv_frames(self._sock)
            if frames is not None:
                return frames
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                ready = dict(self._poller.poll(_poll_ms(left)))
                if self._sock in ready:
                    frames = _recv_frames(self._sock)
                    if frames is not None:
                        return frames
                if self._monitor in ready:
                    self._read_events()
                    continue
                if deadline is None or time.monotonic() >= deadline:
                    raise TransportTimeout(f"no message from {self.address} within {timeout:.1f} s")
        except zmq.ZMQError as exc:
            raise TransportError(f"receive from {self.address} failed: {exc}") from exc

    supports_wake = True

    def wait_readable(self, timeout: float | None) -> bool:
        if self._closed:
            raise TransportClosed(f"connection to {self.address} is closed")
        read_fd = self._wake_fds()[0]
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                left = None if deadline is None else deadline - time.monotonic()
                # Whole milliseconds, rounded up: ZeroMQ's poll cannot wait less, and a wait
                # rounded down to 0 ms would return at once again and again (a busy loop).
                ready = dict(self._wake_poller.poll(_poll_ms(left)))
                if read_fd in ready:
                    _drain(read_fd)
                # Data first, as in recv: a reply that made it counts even if the link died after
                # it (the caller reads it, and its next wait sees the drop).
                if self._sock in ready:
                    return True
                if self._monitor in ready:
                    self._read_events()  # a refused or dropped link raises here, as in recv
                if read_fd in ready:
                    return False
                if deadline is not None and time.monotonic() >= deadline:
                    return False
        except zmq.ZMQError as exc:
            raise TransportError(f"waiting on {self.address} failed: {exc}") from exc

    def wake(self) -> None:
        with self._wake_lock:
            if self._closed:
                return
            if self._wake_pipe is None:
                self._make_wake_pipe()
            try:
                os.write(self._wake_pipe[1], b"!")
            except BlockingIOError:
                pass  # the pipe is full of wake-ups already: the waiter will see them

    def _wake_fds(self) -> tuple[int, int]:
        with self._wake_lock:
            if self._wake_pipe is None:
                self._make_wake_pipe()
            return self._wake_pipe

    def _make_wake_pipe(self) -> None:
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        os.set_blocking(write_fd, False)
        self._wake_pipe = (read_fd, write_fd)
        self._wake_poller = zmq.Poller()
        self._wake_poller.register(self._sock, zmq.POLLIN)
        self._wake_poller.register(self._monitor, zmq.POLLIN)
        self._wake_poller.register(read_fd, zmq.POLLIN)

    def _read_events(self) -> None:
        while self._monitor.poll(0):
            event = parse_monitor_message(self._monitor.recv_multipart())
            kind, value = event["event"], event["value"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.handshakes += 1
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise TransportRefused(
                    f"the cloud at {self.address} refused this edge's key (CURVE handshake refused, "
                    f"ZAP status {value}); ask the cloud's operator to add this edge's public key file "
                    "to its --allow-edge-keys"
                )
            elif kind in (zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL):
                hint = ("is --cloud-key the cloud's public key, and was the cloud started with --secret-key?"
                        if self.curve else
                        "the cloud expects an encrypted link: give this edge --cloud-key and --key")
                raise TransportRefused(f"the handshake with the cloud at {self.address} failed; {hint}")
            elif kind == zmq.EVENT_DISCONNECTED and self.handshakes:
                raise TransportDisconnected(f"the connection to the cloud at {self.address} dropped")

    def _release(self) -> None:
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        with self._wake_lock:  # a wake racing with close must not write to a reused descriptor
            if self._wake_pipe is not None:
                for fd in self._wake_pipe:
                    os.close(fd)
                self._wake_pipe = self._wake_poller = None

    def close(self) -> None:
        if not self._closed:
            with self._wake_lock:
                self._closed = True
            self._release()


_ORIGINS_KEPT = 65536


def _frame_origins(frame: zmq.Frame, curve: bool, allow_list: bool) -> tuple[str, ...]:
    """Who stands behind a connection: the edge's CURVE key that an allow-list vouched for; else
    its address, and on an encrypted link without an allow-list its (self-made) key too."""
    found = {}
    for prop in ("User-Id", "Peer-Address"):
        try:
            value = frame.get(prop)
        except (zmq.ZMQError, KeyError, AttributeError):
            continue
        if value:
            found[prop] = f"{prop.lower()}:{value}"
    if curve and allow_list and "User-Id" in found:
        return (found["User-Id"],)  # vouched for: edges behind one address are told apart by their keys
    return tuple(found[p] for p in ("Peer-Address", "User-Id") if p in found) or ("",)


class ZmqListener(Listener):
    """The cloud side: a ROUTER socket bound to an address; peers are ZeroMQ routing ids.

    Args:
        address: ``tcp://HOST:PORT`` (port 0 picks a free one) or ``ipc://PATH``.
        max_message_bytes: ZeroMQ drops the connection of a peer that sends a bigger frame,
            before any of it is buffered whole (-1: no limit). It bounds each frame only: a
            message's frames, and up to ``RCVHWM`` (1000) messages per connection, are
            buffered before :meth:`recv` returns the first of them, and nothing in ZeroMQ
            bounds the frames of one message or asks a peer to finish it: a peer that keeps
            sending frames of a message it never ends (any traffic satisfies the heartbeat)
            holds as much memory as it sent. Only an allow-list keeps strangers from doing so.
        secret_key: this cloud's CURVE secret key (Z85): the link becomes encrypted.
        allowed_keys: the edge public keys that may connect (a ZAP handler checks each
            handshake, before any message is read). None with a secret key: any key may connect
            (encrypted, not authenticated).
        on_refused: hears about each refused edge key.
        heartbeat: seconds between ZMTP pings (None/0: off).

    Replies never block the server: a peer whose queue is full (it stopped reading) loses the
    reply, and its edge retries.
    """

    supports_wake = True

    def __init__(self, address: str, *, context: zmq.Context | None = None, max_message_bytes: int = -1,
                 secret_key: bytes | None = None, allowed_keys: Collection[bytes] | None = None,
                 on_refused: Callable[[str], None] | None = None, heartbeat: float | None = 2.0) -> None:
        self.curve = secret_key is not None
        if allowed_keys is not None and not self.curve:
            raise TransportError("allowed_keys needs secret_key: keys are only checked on a CURVE link")
        self._auth = None
        # A ZAP handler is per context, so a CURVE listener gets a context of its own.
        self._own_ctx = self.curve and context is None
        self._ctx = zmq.Context() if self._own_ctx else (context or zmq.Context.instance())
        self._allow_list = allowed_keys is not None
        if self.curve:
            from zmq.auth.thread import ThreadAuthenticator

            from .curve import KeyAllowList

            # A ZAP handler even for any key: it makes each connection's key known (``User-Id``),
            # so sessions are counted per key as well as per address.
            self._auth = ThreadAuthenticator(self._ctx, log=logging.getLogger(f"{__name__}.zap"))
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=KeyAllowList(allowed_keys, on_refused))
        if self.curve and not self._allow_list:
            log.warning("CURVE listener without an allow-list: any edge key may connect (encrypted, not "
                        "authenticated); sessions are capped per address and per key")
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        _heartbeats(self._sock, heartbeat)
        if self.curve:
            self._sock.curve_server = True
            self._sock.curve_secretkey = secret_key
        try:
            if address.startswith("tcp://") and address.endswith(":0"):
                port = self._sock.bind_to_random_port(address[: -len(":0")])
                address = f"{address[: -len(':0')]}:{port}"
            else:
                self._sock.bind(address)
        except zmq.ZMQError as exc:
            self._release()
            raise TransportError(
                f"cannot bind {address!r}: {exc} (is another server using it? port 0 picks a free one)"
            ) from exc
        self.address = address
        self._poller = zmq.Poller()  # kept: building one per receive costs more than the poll
        self._poller.register(self._sock, zmq.POLLIN)
        self._wake_read, self._wake_write = os.pipe()  # wake() writes a byte: any thread may
        os.set_blocking(self._wake_write, False)
        self._poller.register(self._wake_read, zmq.POLLIN)
        self._origins: OrderedDict[PeerId, tuple[str, ...]] = OrderedDict()
        self._closed = False

    def send(self, peer: PeerId, frames: Sequence[Frame]) -> int:
        if self._closed:
            raise TransportClosed("listener is closed")
        if not frames:
            raise TransportError("a message needs at least one frame")
        try:
            _send(self._sock, peer, _NOBLOCK | _SNDMORE)
            return _send_frames(self._sock, frames, _NOBLOCK)
        except zmq.Again:
            raise TransportError(f"peer {peer.hex()} is not reading its replies; dropped one") from None
        except zmq.ZMQError as exc:
            raise TransportError(f"send to peer {peer.hex()} failed: {exc} (did it disconnect?)") from exc

    def recv(self, timeout: float | None) -> tuple[PeerId, list[Frame]]:
        if self._closed:
            raise TransportClosed("listener is closed")
        sock = self._sock
        try:
            # Ask the queue first: a busy server finds a message waiting and pays for no poll. Asked
            # through the socket's events, not a receive: an idle one (the edge computing its half,
            # every step) would raise zmq.Again, which costs a step ~10 us of CPU more than the ask.
            peer = _recv_nowait(sock) if _get(sock, _EVENTS) & _POLLIN else None
            if peer is None:
                deadline = None if timeout is None else time.monotonic() + timeout
                while peer is None:
                    left = None if deadline is None else max(0.0, deadline - time.monotonic())
                    ready = dict(self._poller.poll(_poll_ms(left)))
                    if self._wake_read in ready:
                        os.read(self._wake_read, 4096)
                        raise TransportTimeout(f"woken on {self.address}")
                    if ready:
                        peer = _recv_nowait(sock)
                    elif deadline is not None and time.monotonic() >= deadline:
                        raise TransportTimeout(f"no message on {self.address} within {timeout:.1f} s")
            # A ROUTER delivers whole messages, a body after the routing id: it is already here.
            try:
                first = sock.recv(_NOBLOCK, copy=False)
            except zmq.Again:  # a body-less message, which ZeroMQ never delivers
                return peer, []
            parts = [first.bytes, *_rest_of_message(sock, first.more)]
        except zmq.ZMQError as exc:
            raise TransportError(f"receive on {self.address} failed: {exc}") from exc
        if peer not in self._origins:  # a new peer: its first frame carries its origin
            self._origins[peer] = _frame_origins(first, self.curve, self._allow_list)
            while len(self._origins) > _ORIGINS_KEPT:
                self._origins.popitem(last=False)
        return peer, parts

    def origins(self, peer: PeerId) -> tuple[str, ...]:
        return self._origins.get(peer, ("",))

    def wake(self) -> None:
        if self._closed:  # its pipe is closed, and the number may belong to another file now
            return
        try:
            os.write(self._wake_write, b"w")
        except (BlockingIOError, OSError):  # already woken (the pipe is full), or closed
            pass

    def _release(self) -> None:
        self._sock.close(linger=0)
        for fd in (getattr(self, "_wake_read", None), getattr(self, "_wake_write", None)):
            if fd is not None:  # not yet made when the bind failed
                os.close(fd)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self._ctx.term()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._release()
