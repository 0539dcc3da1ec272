"""Transports: frames arrive intact, bytes are counted, receives time out instead of hanging."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import transports
from transports import InprocListener, TransportError, TransportTimeout, ZmqConnection, ZmqListener


@pytest.fixture(params=["zmq-tcp", "zmq-ipc", "inproc"])
def pair(request, tmp_path):
    if request.param == "inproc":
        listener = InprocListener()
        conn = listener.connect()
    else:
        address = "tcp://127.0.0.1:0" if request.param == "zmq-tcp" else f"ipc://{tmp_path}/sock"
        listener = ZmqListener(address)
        conn = ZmqConnection(listener.address)
    yield listener, conn
    conn.close()
    listener.close()


def test_round_trip_counts_bytes(pair):
    listener, conn = pair
    arr = np.random.default_rng(0).standard_normal((64, 33)).astype(np.float32)
    sent = conn.send([b"header", arr])
    assert sent == len(b"header") + arr.nbytes
    peer, frames = listener.recv(timeout=5)
    assert bytes(frames[0]) == b"header"
    np.testing.assert_array_equal(np.frombuffer(frames[1], dtype=np.float32).reshape(64, 33), arr)
    assert listener.send(peer, [b"reply"]) == 5
    assert [bytes(f) for f in conn.recv(timeout=5)] == [b"reply"]


def test_receive_times_out(pair):
    listener, conn = pair
    start = time.monotonic()
    with pytest.raises(TransportTimeout):
        conn.recv(timeout=0.2)
    with pytest.raises(TimeoutError):  # also a builtin TimeoutError
        listener.recv(timeout=0.2)
    assert time.monotonic() - start < 3


def test_received_frames_are_writable(pair):
    """Decoded tensors may be views of the frames after the header; in-place ops on them must be
    legal, in a peer's first message and in every later one."""
    listener, conn = pair
    for _ in range(2):
        conn.send([b"header", np.zeros(1024, np.float32)])
        _, frames = listener.recv(timeout=5)
        assert bytes(frames[0]) == b"header"
        view = np.frombuffer(frames[1], dtype=np.float32)
        view[:] = 1.0
        assert view.sum() == 1024


def test_bind_conflict_is_a_clear_error():
    first = ZmqListener("tcp://127.0.0.1:0")
    try:
        with pytest.raises(TransportError, match="cannot bind"):
            ZmqListener(first.address)
    finally:
        first.close()


def test_bad_address_is_a_clear_error():
    with pytest.raises(TransportError, match="tcp://"):
        transports.connect("not-an-address")


def test_oversize_messages_are_dropped_by_the_listener():
    listener = ZmqListener("tcp://127.0.0.1:0", max_message_bytes=1024)
    conn = ZmqConnection(listener.address)
    try:
        conn.send([np.zeros(4096, np.uint8)])
        with pytest.raises(TransportTimeout):
            listener.recv(timeout=0.5)
    finally:
        conn.close()
        listener.close()


def test_closed_transports_refuse_use():
    listener = InprocListener()
    conn = listener.connect()
    conn.close()
    conn.close()  # idempotent
    with pytest.raises(transports.TransportClosed):
        conn.send([b"x"])
    listener.close()


def test_multipart_messages_keep_every_frame_in_order(pair):
    """Frames go out one by one and come back whole: empty and large frames included, both ways,
    and messages queued before the receive are read without waiting."""
    listener, conn = pair
    big = np.arange(1 << 16, dtype=np.float32)  # above pyzmq's copy threshold: sent without a copy
    for i in range(3):
        conn.send([bytes([i]), b"", big, b"tail"])
    for i in range(3):
        peer, frames = listener.recv(timeout=5)
        assert [bytes(f) for f in (frames[0], frames[1], frames[3])] == [bytes([i]), b"", b"tail"]
        np.testing.assert_array_equal(np.frombuffer(frames[2], np.float32), big)
        listener.send(peer, [b"", bytes([i]), big])
    for i in range(3):
        frames = conn.recv(timeout=5)
        assert [bytes(f) for f in frames[:2]] == [b"", bytes([i])]
        np.testing.assert_array_equal(np.frombuffer(frames[2], np.float32), big)


def test_an_empty_message_is_refused_on_both_ends():
    listener = ZmqListener("tcp://127.0.0.1:0")
    conn = ZmqConnection(listener.address)
    try:
        conn.send([b"hello"])
        peer, _ = listener.recv(timeout=5)
        with pytest.raises(TransportError, match="at least one frame"):
            conn.send([])
        with pytest.raises(TransportError, match="at least one frame"):
            listener.send(peer, [])
        listener.send(peer, [b"still fine"])  # a refused send leaves no half-sent message behind
        assert [bytes(f) for f in conn.recv(timeout=5)] == [b"still fine"]
    finally:
        conn.close()
        listener.close()


@pytest.fixture(params=["zmq-tcp", "inproc"])
def wakeable(request):
    if request.param == "inproc":
        listener = InprocListener()
        conn = listener.connect()
    else:
        listener = ZmqListener("tcp://127.0.0.1:0")
        conn = ZmqConnection(listener.address)
    yield listener, conn
    conn.close()
    listener.close()


def test_wait_readable_sees_a_message_and_leaves_it_to_recv(wakeable):
    listener, conn = wakeable
    assert conn.supports_wake
    conn.send([b"hello"])
    peer, _ = listener.recv(timeout=5)
    listener.send(peer, [b"reply"])
    assert conn.wait_readable(5)
    assert [bytes(f) for f in conn.recv(timeout=0)] == [b"reply"]


def test_wait_readable_never_returns_before_its_timeout(wakeable):
    _, conn = wakeable
    for timeout in (0.0004, 0.002):
        start = time.monotonic()
        assert not conn.wait_readable(timeout)
        assert time.monotonic() - start >= timeout


def test_a_wake_ends_a_wait_even_one_that_starts_later(wakeable):
    _, conn = wakeable
    conn.wake()  # before the wait: the wait must not miss it
    start = time.monotonic()
    assert not conn.wait_readable(30)
    waker = threading.Timer(0.05, conn.wake)
    waker.start()
    assert not conn.wait_readable(30)
    waker.join()
    assert time.monotonic() - start < 20  # woken, not timed out
    assert not conn.wait_readable(0)  # each wake is used once


def test_wake_after_close_is_harmless_and_waiting_is_refused(wakeable):
    _, conn = wakeable
    conn.close()
    conn.wake()
    with pytest.raises(transports.TransportClosed):
        conn.wait_readable(0)


def test_a_listener_woken_from_another_thread_ends_its_receive_even_one_that_starts_later(wakeable):
    # A cloud's workers wake its serving thread when a job ends, so that thread can sleep in recv.
    listener, conn = wakeable
    assert listener.supports_wake
    listener.wake()  # before the receive: it must not be missed
    start = time.monotonic()
    with pytest.raises(TransportTimeout, match="woken"):
        listener.recv(timeout=30)
    waker = threading.Timer(0.05, listener.wake)
    waker.start()
    with pytest.raises(TransportTimeout, match="woken"):
        listener.recv(timeout=30)
    waker.join()
    assert time.monotonic() - start < 20  # woken, not timed out
    conn.send([b"after"])  # and it still receives
    _, frames = listener.recv(timeout=5)
    assert [bytes(f) for f in frames] == [b"after"]
