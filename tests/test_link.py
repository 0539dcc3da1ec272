"""The link emulator: exact schedules, readable specs, and a connection that keeps them.

Schedules are checked with hand-computed numbers; the connection runs on a virtual clock whose
time moves only when the emulator sleeps, so every delivery time is exact and no test waits for
real time except one smoke test. Times below are sums of powers of two, so floats are exact.
"""

from __future__ import annotations

import ast
import contextlib
import math
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import transports
from transports import (EmulatedConnection, InprocListener, LinkDirection, LinkSchedule, LinkSpec, LinkSpecError,
                        TransportClosed, TransportDisconnected, TransportError, TransportTimeout, ZmqConnection,
                        ZmqListener, emulate)
from transports.link import plan

MIB_PER_S = 8 * 2**20  # bit/s that carry one MiB per second


class VirtualClock:
    """A clock that moves only when the emulator sleeps; :meth:`hold` freezes it while a test acts."""

    def __init__(self) -> None:
        self.now = 0.0
        self._running = threading.Event()
        self._running.set()

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        if not self._running.wait(timeout=10):
            raise RuntimeError("the virtual clock was held for 10 s")
        self.now += seconds

    @contextlib.contextmanager
    def hold(self):
        self._running.clear()
        try:
            yield
        finally:
            self._running.set()


# up: 1 MiB/s + 1/8 s; down: 1/2 MiB/s + 1/4 s. A 64 KiB message serialises in 1/16 s up, 1/8 s down.
ASYM = LinkSpec(LinkDirection(MIB_PER_S, 0.125), LinkDirection(MIB_PER_S / 2, 0.25))
K64 = 2**16


@pytest.fixture
def virtual():
    clock = VirtualClock()
    listener = InprocListener()
    conn = EmulatedConnection(listener.connect(), ASYM, clock=clock, sleep=clock.sleep)
    yield clock, listener, conn
    conn.close()
    listener.close()


# ------------------------------------------------------------------------------- schedule


def test_a_single_message_serialises_then_propagates():
    link = LinkSchedule(LinkDirection(100e6, 0.020))
    t = link.schedule(125_000, sent_at=5.0)  # 1 Mbit at 100 Mbit/s: 10 ms
    assert (t.start, t.done, t.arrival) == (5.0, pytest.approx(5.010, abs=1e-12), pytest.approx(5.030, abs=1e-12))
    assert t.queued_s == 0 and link.free_at == t.done


def test_back_to_back_messages_queue_and_overlap_propagation():
    link = LinkSchedule(ASYM.up)
    a = link.schedule(K64, 0.0)
    b = link.schedule(2 * K64, 0.0)
    c = link.schedule(K64, 0.0625)  # handed over exactly when a finished, b is on the wire
    assert (a.start, a.done, a.arrival) == (0.0, 0.0625, 0.1875)
    assert (b.start, b.done, b.arrival) == (0.0625, 0.1875, 0.3125)  # starts while a still propagates
    assert (c.start, c.done, c.arrival) == (0.1875, 0.25, 0.375) and c.queued_s == 0.125
    assert link.stats() == {"messages": 3, "bytes": 4 * K64, "busy_s": 0.25}


def test_a_message_sent_after_the_link_went_idle_starts_at_once():
    link = LinkSchedule(ASYM.up)
    link.schedule(K64, 0.0)  # busy until 1/16
    t = link.schedule(K64, 1.0)
    assert (t.start, t.done, t.arrival) == (1.0, 1.0625, 1.1875)
    assert link.busy_s == 0.125


def test_directions_are_independent_and_asymmetric():
    up, down = LinkSchedule(ASYM.up), LinkSchedule(ASYM.down)
    request = up.schedule(K64, 0.0)
    reply = down.schedule(K64, request.arrival)
    assert request.arrival == 0.1875
    assert (reply.start, reply.done, reply.arrival) == (0.1875, 0.3125, 0.5625)
    assert reply.arrival == ASYM.round_trip_s(K64, K64)


def test_infinite_bandwidth_never_queues():
    link = LinkSchedule(LinkDirection(math.inf, 0.03))
    for _ in range(3):
        t = link.schedule(10**9, 2.0)
        assert (t.start, t.done, t.arrival) == (2.0, 2.0, 2.03)
    assert link.busy_s == 0


def test_zero_delay_arrives_when_serialised():
    t = plan(LinkDirection(MIB_PER_S, 0.0), K64, sent_at=1.0, free_at=-math.inf)
    assert t.arrival == t.done == 1.0625


def test_per_message_overhead_is_scheduled_but_not_counted_as_payload():
    link = LinkSchedule(ASYM.up, overhead_bytes=K64)
    t = link.schedule(K64, 0.0)
    assert (t.nbytes, t.done) == (2 * K64, 0.125)
    assert link.bytes == K64
    with pytest.raises(LinkSpecError):
        LinkSchedule(ASYM.up, overhead_bytes=-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 2), st.integers(0, 10**6)), min_size=1, max_size=20),
       st.floats(1e3, 1e10), st.floats(0, 1))
def test_schedule_matches_the_closed_form(messages, bandwidth, delay):
    """The last byte leaves at max_k(sent_k + all serialisation from k on): a FIFO, work-conserving link."""
    link, sent, transits = LinkSchedule(LinkDirection(bandwidth, delay)), 0.0, []
    for gap, nbytes in messages:
        sent += gap
        transits.append(link.schedule(nbytes, sent))
    ser = [8 * n / bandwidth for _, n in messages]
    closed = max(t.sent + sum(ser[k:]) for k, t in enumerate(transits))
    assert transits[-1].done == pytest.approx(closed, rel=1e-9, abs=1e-9)
    for prev, cur in zip(transits, transits[1:]):
        assert cur.start >= prev.done and cur.arrival >= prev.arrival  # one at a time, in order
    assert all(t.arrival - t.done == pytest.approx(delay) and t.start >= t.sent for t in transits)


# -------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("text, up, down", [
    ("100mbit,20ms", (100e6, 0.02), (100e6, 0.02)),
    ("10mbit,50ms", (10e6, 0.05), (10e6, 0.05)),
    ("1gbit,0ms", (1e9, 0.0), (1e9, 0.0)),
    (" 1.5 Gbit , 250us ", (1.5e9, 250e-6), (1.5e9, 250e-6)),
    ("64000,1s", (64e3, 1.0), (64e3, 1.0)),
    ("56kbit/s,0", (56e3, 0.0), (56e3, 0.0)),
    ("inf,5ms", (math.inf, 0.005), (math.inf, 0.005)),
    ("up=100mbit,20ms;down=10mbit,50ms", (100e6, 0.02), (10e6, 0.05)),
    ("down=10mbit,50ms; up=100mbit,20ms", (100e6, 0.02), (10e6, 0.05)),
])
def test_parse_good_specs(text, up, down):
    spec = LinkSpec.parse(text)
    assert (spec.up.bandwidth_bps, spec.up.delay_s) == up
    assert (spec.down.bandwidth_bps, spec.down.delay_s) == down
    assert LinkSpec.parse(spec.to_text()) == spec


@pytest.mark.parametrize("text", ["loopback", "none", " NONE "])
def test_loopback_means_no_emulation(text):
    spec = LinkSpec.parse(text)
    assert spec.is_loopback and spec == LinkSpec.loopback() and str(spec) == "loopback (no emulation)"


@pytest.mark.parametrize("text, why", [
    ("", "BANDWIDTH,DELAY"),
    ("100mbit", "BANDWIDTH,DELAY"),
    ("100mbit,20", "needs a unit"),
    ("100mbps,20ms", "ambiguous"),
    ("100furlongs,20ms", "unit bit, kbit, mbit or gbit"),
    ("100mbit,20min", "use s, ms or us"),
    ("0mbit,20ms", "more than 0"),
    ("100mbit,-20ms", "delay"),
    ("up=100mbit,20ms", "down is missing"),
    ("up=1mbit,1ms;up=1mbit,2ms", "given twice"),
    ("sideways=1mbit,1ms;down=1mbit,1ms", "'up=' or 'down='"),
])
def test_parse_bad_specs_explain_and_show_examples(text, why):
    with pytest.raises(LinkSpecError, match="Examples: '100mbit,20ms'") as info:
        LinkSpec.parse(text)
    assert why in str(info.value)
    assert isinstance(info.value, ValueError)


def test_bad_values_and_types_are_refused():
    with pytest.raises(LinkSpecError):
        LinkDirection(bandwidth_bps=float("nan"))
    with pytest.raises(LinkSpecError):
        LinkDirection(delay_s=math.inf)
    with pytest.raises(LinkSpecError, match="LinkSpec or a string"):
        LinkSpec.coerce(100)


def test_str_is_readable_for_reports():
    assert str(LinkSpec.parse("100mbit,20ms")) == "100 Mbit/s, 20 ms one-way (each direction)"
    assert str(LinkSpec.parse("up=1gbit,0ms;down=10mbit,250us")) == \
        "up 1 Gbit/s, no delay; down 10 Mbit/s, 250 µs one-way"


@settings(max_examples=80, deadline=None)
@given(st.one_of(st.just(math.inf), st.floats(1, 1e12)), st.floats(0, 100), st.floats(1, 1e12), st.floats(0, 100))
def test_to_text_round_trips_exactly(up_bw, up_delay, down_bw, down_delay):
    spec = LinkSpec(LinkDirection(up_bw, up_delay), LinkDirection(down_bw, down_delay))
    assert LinkSpec.parse(spec.to_text()) == spec


# -------------------------------------------------------------------- emulated connection


def test_messages_reach_the_cloud_in_order_at_their_arrival_times(virtual):
    clock, listener, conn = virtual
    sizes = [[K64], [K64 // 2, K64 // 2], [2 * K64]]
    with clock.hold():  # all three are handed over at t=0
        for i, frames in enumerate(sizes):
            assert conn.send([bytes([i]) * n for n in frames]) == sum(frames)
    for i, frames in enumerate(sizes):
        _, got = listener.recv(timeout=5)
        assert [bytes(f) for f in got] == [bytes([i]) * n for n in frames]
    ups = [e for e in conn.events if e.direction == "up"]
    assert [e.transit.arrival for e in ups] == [0.1875, 0.25, 0.375]  # 1/16 each, queued, then 1/8 delay
    assert [e.at for e in ups] == [0.1875, 0.25, 0.375]  # handed on exactly then
    assert conn.stats()["up"] == {"messages": 3, "bytes": 4 * K64, "busy_s": 0.25}


def test_a_reply_is_released_at_its_downlink_arrival(virtual):
    clock, listener, conn = virtual
    conn.send([bytes(K64)])
    peer, _ = listener.recv(timeout=5)
    assert clock() == 0.1875
    listener.send(peer, [bytes(K64)])  # the cloud answers at once
    assert bytes(conn.recv(timeout=10)[0]) == bytes(K64)
    assert clock() == 0.1875 + 0.125 + 0.25
    (down,) = [e for e in conn.events if e.direction == "down"]
    assert down.transit.sent == 0.1875 and down.at == down.transit.arrival == 0.5625


def test_recv_times_out_while_the_reply_is_still_on_the_wire(virtual):
    clock, listener, conn = virtual
    conn.send([b"request"])
    peer, _ = listener.recv(timeout=5)
    start = clock()
    listener.send(peer, [bytes(K64)])  # arrives start + 3/8
    with pytest.raises(TransportTimeout, match="on the way"):
        conn.recv(timeout=0.125)
    assert clock() == start + 0.125
    assert conn.in_flight == (0, 1)  # not lost: still travelling
    assert len(conn.recv(timeout=1.0)[0]) == K64
    assert clock() == start + 0.375


def test_recv_times_out_on_virtual_time_when_nothing_comes(virtual):
    clock, _, conn = virtual
    real = time.monotonic()
    with pytest.raises(TransportTimeout):
        conn.recv(timeout=0)
    assert clock() == 0.0
    with pytest.raises(TimeoutError):
        conn.recv(timeout=30)
    assert clock() == 30.0
    assert time.monotonic() - real < 5  # virtual seconds cost no real ones


def test_recv_without_timeout_waits_for_the_arrival(virtual):
    clock, listener, conn = virtual
    conn.send([b"x" * K64])
    peer, _ = listener.recv(timeout=5)
    listener.send(peer, [b"y" * K64])
    assert bytes(conn.recv(timeout=None)[0]) == b"y" * K64
    assert clock() == 0.5625


def test_pipelined_replies_come_back_in_order(virtual):
    clock, listener, conn = virtual
    with clock.hold():
        for i in range(3):
            conn.send([bytes([i])])
    for i in range(3):
        peer, frames = listener.recv(timeout=5)
        listener.send(peer, [bytes(frames[0]) * 2])
    assert [bytes(conn.recv(timeout=10)[0]) for _ in range(3)] == [b"\x00\x00", b"\x01\x01", b"\x02\x02"]
    downs = [e for e in conn.events if e.direction == "down"]
    assert all(e.at >= e.transit.arrival for e in downs)


def test_send_snapshots_frames_like_a_socket_buffer(virtual):
    clock, listener, conn = virtual
    arr = np.zeros(1000, np.uint8)
    with clock.hold():
        assert conn.send([b"head", arr]) == 4 + 1000
        arr[:] = 7  # the caller reuses its buffer while the message is on the wire
    _, frames = listener.recv(timeout=5)
    assert not np.frombuffer(frames[1], np.uint8).any()


def test_a_delivery_error_is_raised_on_the_next_call(virtual):
    clock, listener, conn = virtual
    listener.close()  # the inner connection now refuses to deliver
    conn.send([b"doomed"])
    with pytest.raises(TransportClosed, match="failed in the background"):
        conn.recv(timeout=10)
    with pytest.raises(TransportClosed):
        conn.send([b"again"])


def test_a_reply_taken_in_before_the_link_failed_is_delivered_then_the_failure(virtual):
    """On a fake clock too: the pump is gone with the failure, so nothing moves time to the
    reply's arrival any more; it is handed over at once instead of never."""
    clock, listener, conn = virtual
    conn.send([b"request"])
    peer, _ = listener.recv(timeout=5)
    listener.send(peer, [b"reply"])
    listener.close()
    conn.send([b"doomed"])  # the pump takes the reply in, then fails to deliver this one
    assert [bytes(f) for f in conn.recv(timeout=10)] == [b"reply"]
    with pytest.raises(TransportClosed, match="failed in the background"):
        conn.recv(timeout=10)


def test_close_drops_what_is_in_flight_and_stops_the_pump():
    clock = VirtualClock()
    listener = InprocListener()
    inner = listener.connect()
    conn = EmulatedConnection(inner, ASYM, clock=clock, sleep=clock.sleep)
    with clock.hold():
        conn.send([b"never delivered"])
        conn.close()
    conn.close()  # idempotent
    assert not any(t.name.startswith("link-pump") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(TransportClosed):
        inner.send([b"x"])  # the pump closed the inner connection on its way out
    with pytest.raises(TransportClosed):
        conn.send([b"x"])
    with pytest.raises(TransportClosed):
        conn.recv(timeout=1)
    with pytest.raises(TransportTimeout):
        listener.recv(timeout=0.05)
    listener.close()


def test_emulate_and_connect_opt_in_with_a_string_or_spec():
    listener = InprocListener()
    plain = listener.connect()
    assert emulate(plain, None) is plain and emulate(plain, "loopback") is plain
    wrapped = emulate(plain, "10mbit,5ms", overhead_bytes=40)
    assert isinstance(wrapped, EmulatedConnection) and wrapped.up.overhead_bytes == 40
    assert wrapped.address == plain.address
    wrapped.close()
    listener.close()
    with pytest.raises(LinkSpecError):
        transports.connect("tcp://127.0.0.1:1", link="fast")
    conn = transports.connect("tcp://127.0.0.1:1", link=LinkSpec.parse("1gbit,1ms"))
    assert isinstance(conn, EmulatedConnection) and isinstance(conn.inner, transports.ZmqConnection)
    conn.close()
    plain_zmq = transports.connect("tcp://127.0.0.1:1", link="none")
    assert isinstance(plain_zmq, transports.ZmqConnection)
    plain_zmq.close()


def test_real_clock_round_trip_over_zeromq_takes_at_least_both_delays():
    listener = ZmqListener("tcp://127.0.0.1:0")
    conn = transports.connect(listener.address, link="1gbit,20ms")
    try:
        start = time.monotonic()
        conn.send([b"ping"])
        peer, _ = listener.recv(timeout=5)
        one_way = time.monotonic() - start
        listener.send(peer, [b"pong"])
        assert [bytes(f) for f in conn.recv(timeout=5)] == [b"pong"]
        round_trip = time.monotonic() - start
        assert one_way >= 0.020 and round_trip >= 0.040
        with pytest.raises(TransportTimeout):
            conn.recv(timeout=0.05)
    finally:
        conn.close()
        listener.close()


def test_split_training_over_an_emulated_link_counts_every_byte(inproc_cloud):
    import torch
    from torch import nn

    import splitft
    from splitft.app.data import batches, load_digits
    from splitft.app.models import digits_cnn
    from tests.conftest import DIGITS

    conn = EmulatedConnection(inproc_cloud.connect(), "1gbit,1ms")
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=conn)
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    for (x, y, _), _ in zip(batches(load_digits()[0], 64, shuffle=True), range(2)):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.sync()
    stats = conn.stats()
    for direction in ("up", "down"):
        counted = model.metrics.direction(direction)
        assert (counted.wire, counted.messages) == (stats[direction]["bytes"], stats[direction]["messages"])
    model.close()


def test_link_module_imports_only_stdlib_and_its_own_package():
    allowed = {"transports", "zmq", "msgpack", "numpy"} | set(sys.stdlib_module_names)
    path = Path(transports.__file__).parent / "link.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            assert all(a.name.split(".")[0] in allowed for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            assert (node.module or "").split(".")[0] in allowed


class _CannotWake:
    """A real connection that does not offer wake-ups: the emulator must fall back to polling."""

    supports_wake = False

    def __init__(self, inner) -> None:
        self.inner, self.address = inner, inner.address

    def send(self, frames):
        return self.inner.send(frames)

    def recv(self, timeout):
        return self.inner.recv(timeout)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("kind", ["zmq", "inproc"])
def test_on_real_time_an_idle_link_sleeps_instead_of_polling(kind):
    """Timers, not looking: an idle pump and a waiting recv go round a handful of times, not once
    a millisecond, and a message sent while the pump sleeps wakes it."""
    listener = ZmqListener("tcp://127.0.0.1:0") if kind == "zmq" else InprocListener()
    inner = ZmqConnection(listener.address) if kind == "zmq" else listener.connect()
    conn = EmulatedConnection(inner, "1gbit,1ms")
    try:
        with pytest.raises(TransportTimeout):
            conn.recv(timeout=0.3)
        idle_rounds = conn._rounds
        assert idle_rounds <= 5
        conn.send([b"ping"])
        peer, frames = listener.recv(timeout=5)
        assert [bytes(f) for f in frames] == [b"ping"]
        listener.send(peer, [b"pong"])
        assert [bytes(f) for f in conn.recv(timeout=5)] == [b"pong"]
        assert conn._rounds - idle_rounds <= 10
    finally:
        conn.close()
        listener.close()
    assert not any(t.name.startswith("link-pump") and t.is_alive() for t in threading.enumerate())


def _reply_then_go_away(conn, listener: ZmqListener) -> None:
    """The cloud answers ``conn``'s request and closes once the answer has reached the edge's
    socket; returns when the edge's side has seen the connection drop."""
    conn.send([b"bye"])
    peer, _ = listener.recv(timeout=5)
    listener.send(peer, [b"ack"])
    time.sleep(0.1)  # loopback: the ack is in the edge's socket long before this
    listener.close()
    time.sleep(0.3)


@pytest.mark.parametrize("link", ["1gbit,1ms", "1gbit,200ms"])
def test_a_reply_sent_just_before_the_cloud_went_away_is_still_delivered(link):
    """A real link delivers what arrived before the connection dropped, then reports the drop;
    so does the emulator, whether the reply had arrived (1 ms) or was still on the emulated
    downlink (200 ms) when the drop came. A cloud that exits right after answering a goodbye
    must not look, to the edge, like a cloud that never answered."""
    listener = ZmqListener("tcp://127.0.0.1:0")
    conn = transports.connect(listener.address, link=link)
    try:
        _reply_then_go_away(conn, listener)
        assert [bytes(f) for f in conn.recv(timeout=5)] == [b"ack"]
        with pytest.raises(TransportError, match="dropped"):
            conn.recv(timeout=5)
    finally:
        conn.close()


def test_waiting_for_data_reports_the_reply_before_the_drop_that_followed_it():
    """What the emulator's pump waits with: data that came before a drop is readable first, and
    the wait after it raises the drop."""
    listener = ZmqListener("tcp://127.0.0.1:0")
    conn = ZmqConnection(listener.address)
    try:
        _reply_then_go_away(conn, listener)
        assert conn.wait_readable(5)
        assert [bytes(f) for f in conn.recv(timeout=5)] == [b"ack"]
        with pytest.raises(TransportDisconnected, match="dropped"):
            conn.wait_readable(5)
    finally:
        conn.close()


def test_a_connection_that_cannot_be_woken_still_works_by_polling():
    listener = ZmqListener("tcp://127.0.0.1:0")
    conn = EmulatedConnection(_CannotWake(ZmqConnection(listener.address)), "1gbit,5ms")
    try:
        start = time.monotonic()
        conn.send([b"ping"])
        peer, _ = listener.recv(timeout=5)
        listener.send(peer, [b"pong"])
        assert [bytes(f) for f in conn.recv(timeout=5)] == [b"pong"]
        assert time.monotonic() - start >= 0.010
    finally:
        conn.close()
        listener.close()


def test_closing_a_real_time_link_wakes_a_pump_asleep_on_a_far_timer():
    listener = ZmqListener("tcp://127.0.0.1:0")
    conn = EmulatedConnection(ZmqConnection(listener.address), "1kbit,30s")  # the message is due in 30 s
    conn.send([bytes(100)])
    start = time.monotonic()
    conn.close()
    assert time.monotonic() - start < 10  # not the pump's 10 s join timeout, nor the 30 s timer
    assert not any(t.name.startswith("link-pump") and t.is_alive() for t in threading.enumerate())
    with pytest.raises(TransportTimeout):
        listener.recv(timeout=0.05)  # dropped with the emulated wire
    listener.close()
