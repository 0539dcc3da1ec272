"""Fairness: no edge can keep another out of a real `splitft cloud` process.

Each test is an attack of a hostile probe, from addresses of the loopback network other than the
good edge's (ZeroMQ connects from a chosen source address: ``tcp://SRC:0;HOST:PORT``): sessions
that book the memory budget with lazily allocated buffers, hellos kept alive by pings, forwards
that fail and so train nothing, an open listener on a public address, one CurveZMQ key from many
addresses. The good edge must be admitted and train while the attack runs.
"""

from __future__ import annotations

import re
import time

import numpy as np
import pytest
import torch
from torch import nn

import compressors
import splitft
import transports
from splitft.wire import protocol
from splitft.cloud import CloudServer, serve_in_thread
from splitft.wire.coding import SLOTS
from splitft.cut import extract, fingerprint, parse_cut
from splitft.cloud.limits import Limits
from splitft.options import Faults
from splitft.wire.protocol import Forward, Hello, Ping, payload_to_wire
from tests.conftest import splitft_process, start_cloud, stop
from tests.models import mlp
from tests.test_faults import MLP, _data

_CHAIN = extract(mlp(), parse_cut(mlp(), 2, None))
_IDENTITY = compressors.make_codec("identity")


def hello(fwd: str = "identity") -> Hello:
    codecs = {slot: compressors.canonical_spec(fwd if slot == "fwd" else "identity") for slot in SLOTS}
    return Hello(protocol=protocol.PROTOCOL_VERSION, factory=MLP, cut="2", rejoin=None,
                 fingerprint=fingerprint(_CHAIN), codecs=codecs, seed=0, client="hostile")


def ask(conn, msg) -> protocol.Message:
    conn.send(protocol.encode(msg))
    return protocol.decode(conn.recv(timeout=30))


def source(src: str, address: str) -> str:
    """``address`` reached from the loopback address ``src`` (another origin to the cloud)."""
    return f"tcp://{src}:0;{address[len('tcp://'):]}"


def from_(src: str, address: str, **options):
    return transports.connect(source(src, address), **options)


def train(address: str, src: str, steps: int = 3) -> float:
    """A good edge from ``src`` trains ``steps`` steps; returns the seconds its hello took."""
    start = time.monotonic()
    model = splitft.split(mlp(), 2, factory=MLP, connect=lambda: from_(src, address),
                          faults=Faults(timeout=30, heartbeat=0))
    admitted = time.monotonic() - start
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for x, y in _data(steps):
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return admitted


def one_row(spec: str) -> Forward:
    """A 1-row training forward (sample id 0) through ``spec``: 96 bytes of activation."""
    payload = compressors.make_codec(spec).encode(torch.randn(1, 16),
                                                  compressors.CodecContext(sample_ids=np.array([0])))
    return Forward(call=1, train=True, grad=False, args=[payload_to_wire(payload, False)], kwargs={},
                   sample_ids=np.array([0], dtype=np.int64))


# ---------------------------------------------------------------- finding 1: booked is not used


def book_everything(address: str, src: str, conns: list) -> list[str]:
    """Sessions from ``src`` book the cloud's memory to the byte with AC-SGD buffers that one 1-row
    forward each allocates (lazily: it costs 96 bytes); returns the refusals they met."""
    refusals, kept, capacity = [], 0, 1 << 22
    while capacity:  # as much as fits, then half of that, ...
        spec = f"acsgd:capacity={capacity}"
        conn = from_(src, address)
        conns.append(conn)
        reply = ask(conn, hello(spec))
        if reply.TYPE == "welcome":
            reply = ask(conn, one_row(spec))
        if reply.TYPE == "error":
            assert reply.code == "capacity", reply
            refusals.append(reply.message)
            if "model" in reply.message:
                break  # not even a model fits any more
            capacity //= 2
        else:
            kept += 1
    assert kept >= 3 and refusals
    return refusals


def test_buffers_booked_but_never_used_cannot_lock_out_an_edge_from_another_address(tmp_path):
    """One address books the whole budget with AC-SGD buffers it never fills (allocated lazily,
    they cost it 96 bytes each); a good edge from another address still trains, and no refusal
    tells the attacker how much the cloud has left."""
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--memory-mb", "256")
    conns: list = []
    try:
        refusals = book_everything(address, "127.0.0.2", conns)
        assert train(address, "127.0.0.3") < 20
        assert "evicted" in err.text
        for text in refusals:  # what the attacker may hold, never what the cloud has left
            assert not re.search(r"MiB of [\d.]+ MiB", text) and "--memory-mb" not in text, text
        assert proc.poll() is None
    finally:
        for conn in conns:
            conn.close()
        stop(proc)


def test_an_edge_that_trains_takes_back_memory_another_address_booked_after_it_came_in(tmp_path):
    """The good edge is in first; then another address books every byte. The good edge's next
    forward needs memory for its graph: it evicts a session of the address holding more."""
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--memory-mb", "256")
    conns: list = []
    try:
        model = splitft.split(mlp(), 2, factory=MLP, connect=lambda: from_("127.0.0.3", address),
                              faults=Faults(timeout=30, heartbeat=0))
        with model:
            opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
            crit = model.remote_loss(nn.CrossEntropyLoss())
            book_everything(address, "127.0.0.2", conns)  # leaves less than a model's 5 KiB
            for _ in range(3):  # each graph holds about 1 MiB
                x, y = torch.randn(4096, 12), torch.randint(0, 3, (4096,))
                crit(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        assert "evicted to make room in the cloud's memory" in err.text
    finally:
        for conn in conns:
            conn.close()
        stop(proc)


# ---------------------------------------------------------------- finding 2: kept-alive hellos


def test_hellos_kept_alive_by_pings_cannot_lock_out_an_edge_from_another_address(tmp_path):
    """Four addresses take every place with hellos they keep alive; a fifth address still trains,
    and only the one place it needed was taken back."""
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--max-open-sessions", "8",
                                     "--sessions-per-peer", "2")
    conns = []
    try:
        for host in range(4):
            for _ in range(2):
                conn = from_(f"127.0.0.{10 + host}", address)
                conns.append(conn)
                assert ask(conn, hello()).TYPE == "welcome"
                assert ask(conn, Ping()).TYPE == "pong"
        assert train(address, "127.0.0.20") < 20
        still = [ask(conn, Ping()).TYPE for conn in conns]
        assert still.count("pong") == 7, still
    finally:
        for conn in conns:
            conn.close()
        stop(proc)


def test_forwards_that_fail_do_not_make_a_session_outlast_its_attacker(tmp_path):
    """Every place taken by a session whose only forward failed in the model, pinged: they trained
    nothing, so once the attacker is silent they go after --handshake-timeout, not after
    --session-timeout (300 s), even for an edge from the attacker's own address."""
    # 5 s, well under the session timeout: a loaded machine may take 2 s between a forward and the
    # ping after it, which must not already count as the attacker's silence
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--max-open-sessions", "4",
                                     "--handshake-timeout", "5")
    conns = []
    try:
        wrong = payload_to_wire(_IDENTITY.encode(torch.randn(1, 7), compressors.CodecContext()), False)
        for _ in range(4):
            conn = transports.connect(address)
            conns.append(conn)
            assert ask(conn, hello()).TYPE == "welcome"
            reply = ask(conn, Forward(call=1, train=True, grad=True, args=[wrong], kwargs={}))
            assert reply.TYPE == "error" and reply.code == "model", reply
            assert ask(conn, Ping()).TYPE == "pong"
        for conn in conns:
            conn.close()
        deadline, reply = time.monotonic() + 20, None
        probe = transports.connect(address)
        conns.append(probe)
        while time.monotonic() < deadline:
            reply = ask(probe, hello())
            if reply.TYPE == "welcome":
                break
            assert reply.code == "capacity" and "try again later" in reply.message, reply
            time.sleep(0.5)
        assert reply is not None and reply.TYPE == "welcome", (reply, err.text)
    finally:
        for conn in conns:
            conn.close()
        stop(proc)


def test_an_untrained_session_kept_alive_by_pings_makes_room_for_a_new_one(tmp_path):
    """Pings keep a session that trains nothing from expiring, but not from being evicted when a
    new edge (here from the same address, so fairness between origins cannot help) needs its place."""
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--max-open-sessions", "2",
                                     "--evictable-after", "1")
    conns = []
    try:
        for _ in range(2):
            conn = transports.connect(address)
            conns.append(conn)
            assert ask(conn, hello()).TYPE == "welcome"
        time.sleep(1.5)
        assert [ask(conn, Ping()).TYPE for conn in conns] == ["pong", "pong"]
        assert train(address, "127.0.0.1") < 20
        assert "evicted" in err.text and "never trained" in err.text
        replies = [ask(conn, Ping()) for conn in conns]
        lost = [r for r in replies if r.TYPE == "error"]
        assert len(lost) == 1 and lost[0].code == "session" and "evicted" in lost[0].message
    finally:
        for conn in conns:
            conn.close()
        stop(proc)


# ---------------------------------------------------------------- finding 11: the inbound buffer


def test_an_open_listener_on_a_public_address_needs_keys_or_an_explicit_flag(tmp_path):
    """Without an allow-list, anyone who reaches the port can make the process buffer what they
    send: the cloud refuses to serve a public address that way unless told to."""
    proc = splitft_process("cloud", "--bind", "tcp://0.0.0.0:0", "--sessions", "0", "--model", MLP)
    try:
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2, err
        assert "--allow-edge-keys" in err and "--allow-any-edge" in err and "Traceback" not in err
    finally:
        stop(proc)
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--allow-any-edge")
    stop(proc)  # start_cloud binds 127.0.0.1: the flag is accepted there too
    ready = tmp_path / "public-address"
    proc = splitft_process("cloud", "--bind", "tcp://0.0.0.0:0", "--sessions", "0", "--model", MLP,
                           "--allow-any-edge", "--ready-file", str(ready))
    try:
        deadline = time.monotonic() + 60
        while not (ready.exists() and ready.read_text()) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert ready.exists() and ready.read_text().startswith("tcp://0.0.0.0:"), proc.poll()
    finally:
        stop(proc)


@pytest.fixture
def keys(tmp_path):
    from splitft.app.cli import main as cli
    assert cli(["keys", "--dir", str(tmp_path), "cloud", "one", "two", "three"]) == 0
    return tmp_path


def test_without_an_allow_list_sessions_are_capped_per_key_and_per_address(keys):
    """On a CurveZMQ link that lets any key in, one key from many addresses and many keys from one
    address both meet --sessions-per-peer."""
    _, secret = transports.load_secret_key(keys / "cloud.key_secret")
    listener = transports.listen("tcp://127.0.0.1:0", secret_key=secret)
    server = CloudServer(listener, [MLP], limits=Limits(sessions_per_peer=2))
    thread = serve_in_thread(server)
    conns = []

    def open_as(name: str, src: str) -> protocol.Message:
        public, secret_key = transports.load_secret_key(keys / f"{name}.key_secret")
        conn = from_(src, listener.address, server_key=transports.load_public_key(keys / "cloud.key"),
                     public_key=public, secret_key=secret_key)
        conns.append(conn)
        return ask(conn, hello())

    try:
        assert open_as("one", "127.0.0.2").TYPE == "welcome"
        assert open_as("one", "127.0.0.3").TYPE == "welcome"
        reply = open_as("one", "127.0.0.4")  # a third address, the same key
        assert reply.TYPE == "error" and reply.code == "capacity" and "user-id:" in reply.message, reply
        assert open_as("two", "127.0.0.2").TYPE == "welcome"
        reply = open_as("three", "127.0.0.2")  # a third key, the same address
        assert reply.TYPE == "error" and reply.code == "capacity" and "127.0.0.2" in reply.message, reply
    finally:
        for conn in conns:
            conn.close()
        server.stop()
        thread.join(timeout=10)
