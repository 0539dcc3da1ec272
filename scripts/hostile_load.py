"""A good edge trains while hostile clients attack the same cloud: admission time, step latency, memory.

Each scenario starts a cloud process serving a tiny MLP (``splitft.app.models:tiny_mlp``) on
127.0.0.1 with tight budgets. A good edge connects from 127.0.0.9 (the loopback network has many
addresses, and ZeroMQ connects from a chosen one: ``tcp://SRC:0;HOST:PORT``), first alone, then
while one attack runs from addresses of its own:

- ``mixed``: ``--hostile`` client threads send, in a bounded loop, the well-formed worst cases a
  trust boundary must refuse (decode bombs, floods of operations, sample ids far beyond any
  buffer, codec options naming files or asking for huge ranks, silent hellos, forged resume
  tokens, deeply nested values, forward calls whose backward never comes).
- ``booked``: one address opens sessions with the largest AC-SGD buffers the policy allows and
  sends one 1-row forward each, until the memory budget is booked to the byte; the buffers are
  allocated lazily, so they cost the attacker about 100 bytes each. It pings them every 10 s.
- ``hellos``: four addresses take every session place with hellos they ping every 10 s.
- ``failing``: the same, each session with one forward that fails in the model; then the
  attacker leaves, and the time until an edge from one of its addresses gets in is measured.
- ``inbound``: raw ZMTP peers send frames of a message they never end, kept alive by a 1-byte
  frame every 3 s: the cloud's resident memory against what they sent, and after they go silent.
- ``refused-key``: a CurveZMQ cloud with an allow-list; a stranger's key sends the same amount.
- ``checkpoint``: a session with the largest AC-SGD buffer its budget allows steps (the cloud
  checkpoints every step), pins that checkpoint and says goodbye, again and again.
- ``pins``: sessions pin their state and leave, to fill the checkpoint folder.
- ``compute``: the largest low-rank gradient codec the policy allows (``iters=16,rank=64``) on a
  batch whose graph fits the session's budget, forward and backward.
- ``header-parse``: ``--hostile`` connections send headers whose parse the cloud must bound: one
  over the header limit and the worst shapes under it (256 KiB of empty lists, lists claiming their
  longest length nested as deep as msgpack goes).
- ``parked-rounds``: against a shared half trained in rounds (``--shared-model --sync-rounds 2``),
  the other edge of each round steps, then sends forwards of 54 MiB to wait for the round, far more
  than ``--memory-mb``.

For each it prints the good edge's admission time (its hello, retried while refused), its step
latency (p50 / p95 / worst), the cloud's resident memory, and what the attackers got back.

    python scripts/hostile_load.py                              # every scenario
    python scripts/hostile_load.py --scenario booked hellos --steps 300 --json result.json
    python scripts/hostile_load.py --scenario parked-rounds
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import compressors  # noqa: E402
import splitft  # noqa: E402
import transports  # noqa: E402
from splitft.wire import protocol  # noqa: E402
from splitft.app.cli import main as cli  # noqa: E402
from splitft.app.launch import CloudStartError, start_cloud  # noqa: E402
from splitft.cut import extract, fingerprint, parse_cut  # noqa: E402
from splitft.app.models import tiny_mlp  # noqa: E402
from splitft.wire.protocol import Backward, Bye, Forward, Ping, Sync, payload_to_wire  # noqa: E402

FACTORY = "splitft.app.models:tiny_mlp"
CUT = 2
GOOD = "127.0.0.9"
BUDGETS = {"--session-memory-mb": "64", "--memory-mb": "512", "--max-decoded-mb": "32", "--max-ops": "256",
           "--max-open-sessions": "64"}
#: AC-SGD rows of the checkpoint attack: 29 MB of buffer (72 bytes a row), within --max-decoded-mb.
CHECKPOINT_ROWS = 400_000
#: AC-SGD rows of each pin of the pins attack: 7 MB.
PIN_ROWS = 100_000
#: A shared half trained in synchronous rounds of two edges, its optimizer the cloud's.
SHARED = ["--shared-model", "--sync-rounds", "2", "--round-timeout", "30", "--shared-optimizer", 'SGD:{"lr": 0.1}']


def _start_cloud(folder: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    flags = [*extra, *(part for flag, value in BUDGETS.items() for part in (flag, value))]
    try:
        return start_cloud([FACTORY], folder / f"address-{time.monotonic_ns()}", flags=flags, sessions=0,
                           quiet=True, env=os.environ | {"OMP_NUM_THREADS": "1"})
    except CloudStartError as exc:
        raise SystemExit(str(exc)) from None


def _memory(pid: int, field: str = "VmRSS") -> int:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def via(src: str, address: str) -> str:
    """``address`` reached from the loopback address ``src``: another origin to the cloud."""
    return f"tcp://{src}:0;{address[len('tcp://'):]}"


# ---------------------------------------------------------------- the good edge


def good_edge(address: str, steps: int, seed: int, src: str = GOOD, keys: dict | None = None,
              patience: float = 60.0, shared: bool = False) -> tuple[float | None, list[float]]:
    """Ask in (again while refused, for up to ``patience`` s), then train ``steps`` steps; returns
    the seconds until admitted (None: never) and each step's wall time."""
    g = torch.Generator().manual_seed(seed)
    start = time.monotonic()
    while True:
        try:
            model = splitft.split(tiny_mlp(), CUT, factory=FACTORY, faults=splitft.Faults(timeout=30, heartbeat=1.0),
                                  connect=lambda: transports.connect(via(src, address), **(keys or {})))
            break
        except splitft.CapacityError:
            if time.monotonic() - start > patience:
                return None, []
            time.sleep(0.5)
    admitted = time.monotonic() - start
    times = []
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1) if shared  # the shared half's, as the cloud set it
                           else torch.optim.Adam(model.parameters(), lr=0.01))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for _ in range(steps):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            begin = time.perf_counter()
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - begin)
    return admitted, times


# ---------------------------------------------------------------- hostile messages


def _hello(fwd: str = "identity", slots: tuple[str, ...] = ("fwd", "ret"), **changes: Any) -> Any:
    model = tiny_mlp()
    codecs = {s: compressors.canonical_spec(fwd if s in slots else "identity") for s in ("fwd", "bwd", "ret", "ret_bwd")}
    base = dict(protocol=protocol.PROTOCOL_VERSION, factory=FACTORY, cut=str(CUT), rejoin=None,
                fingerprint=fingerprint(extract(model, parse_cut(model, CUT, None))), codecs=codecs, seed=0,
                client="hostile")
    return protocol.Hello(**(base | changes))


def _forward(entry: dict, call: int = 1, **fields: Any) -> Any:
    return Forward(call=call, train=True, grad=fields.pop("grad", False), args=[entry], kwargs=fields.pop("kwargs", {}),
                   **fields)


def _ask(conn: Any, msg: Any, timeout: float = 10.0) -> Any:
    conn.send(protocol.encode(msg))
    return protocol.decode(conn.recv(timeout))


def _mixed_attacks() -> list[tuple[str, list]]:
    """(name, [message, ...]) pairs: each list is sent on one fresh connection, in order."""
    ctx = compressors.CodecContext()
    identity = compressors.make_codec("identity")
    x = payload_to_wire(identity.encode(torch.randn(4, 32), ctx), False)
    low = compressors.make_codec("lowrank:rank=1").encode(torch.randn(4, 32), ctx)
    bomb = compressors.Payload(low.codec, low.version,
                               {k: np.zeros((32768,) + a.shape[1:], a.dtype) for k, a in low.arrays.items()},
                               {**low.meta, "shape": [32768, 32768]})
    one = payload_to_wire(identity.encode(torch.ones(1, 1, dtype=torch.float64), ctx), False)
    expand = {"$expand": [one, [1 << 14, 1 << 14]]}
    deep: list = []
    for _ in range(1000):
        deep = [deep]
    graph = payload_to_wire(identity.encode(torch.randn(4096, 32), ctx), True)
    ids = np.array([399_999_999], dtype=np.int64)
    acsgd = payload_to_wire(compressors.make_codec("acsgd").encode(
        torch.randn(1, 32), compressors.CodecContext(sample_ids=np.array([0]))), False)
    return [
        ("lowrank decode bomb", [_hello("lowrank:rank=1"), _forward(payload_to_wire(bomb, False))]),
        ("repeated side tensors", [_hello(), _forward(x, kwargs={"a": expand, "b": expand, "c": expand})]),
        ("operation flood", [_hello(), Sync(ops=[{"op": "zero_grad"}] * 100_000, seq=1)]),
        ("sample id 4e8", [_hello("acsgd"), _forward(acsgd, sample_ids=ids)]),
        ("file path option", [_hello("acsgd:capacity=2000,path=/tmp/splitft-hostile.npy")]),
        ("huge capacity", [_hello("acsgd:capacity=300000000")]),
        ("iteration bomb", [_hello("lowrank:rank=1,iters=400000")]),
        ("silent hello", [_hello()]),
        ("forged resume", [_hello(resume={"session": "0" * 16, "token": "x" * 32, "step": 0, "seq": 0,
                                          "log_from": 1})]),
        ("deep list", [_hello(factory_kwargs={"width": deep})]),
        ("graphs never backpropagated", [_hello()] + [_forward(graph, call=i, grad=True) for i in range(1, 40)]),
    ]


# ---------------------------------------------------------------- attacks: each runs on a thread until stopped


class Attack:
    """One attack on a thread: ``setup`` until ``ready``, then ``hold`` until ``stop``, then it closes."""
    shared = False  # the cloud serves a shared half in rounds (the good edge steps with its optimizer)
    def __init__(self, address: str, args: argparse.Namespace, pid: int) -> None:
        self.address, self.args, self.pid = address, args, pid
        self.ready, self.stop = threading.Event(), threading.Event()
        self.codes: collections.Counter = collections.Counter()
        self.figures: dict[str, Any] = {}
        self.conns: list[Any] = []
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.setup()
            self.ready.set()
            self.hold()
        finally:
            self.ready.set()
            for conn in self.conns:
                conn.close()

    @staticmethod
    def cloud(folder: Path, args: argparse.Namespace) -> tuple[list[str], dict | None]:
        """Extra flags for the cloud, and the good edge's CurveZMQ keys (None: a plain link)."""
        return [], None

    def setup(self) -> None:
        pass

    def after(self, result: dict[str, Any]) -> None:
        """Figures to take once the attack stopped."""

    def hold(self) -> None:
        """Ping every session every 10 s: activity that trains nothing."""
        while not self.stop.wait(10.0):
            for conn in self.conns:
                self._tally(conn, Ping())

    def connect(self, src: str) -> Any:
        conn = transports.connect(via(src, self.address))
        self.conns.append(conn)
        return conn

    def _tally(self, conn: Any, msg: Any, name: str | None = None) -> Any:
        try:
            reply = _ask(conn, msg)
        except Exception as exc:  # noqa: BLE001 — an attacker's tally, not a bug report
            self.codes[f"{name or msg.TYPE}: {type(exc).__name__}"] += 1
            return None
        self.codes[f"{name or msg.TYPE}: {getattr(reply, 'code', reply.TYPE)}"] += 1
        return reply


class Mixed(Attack):
    """``--hostile`` clients repeat a list of attacks, each on a fresh connection, in a bounded loop."""
    folder_mb = 64  # --checkpoint-max-mb

    @classmethod
    def cloud(cls, folder: Path, args: argparse.Namespace) -> tuple[list[str], dict | None]:
        # Silent hellos are freed after 2 s; the other attacks meet the default (30 s), as a probe would.
        return ["--handshake-timeout", "2", "--checkpoint-max-mb", str(cls.folder_mb), "--no-fsync",
                "--checkpoint-dir", str(folder / "ck")], None

    def after(self, result: dict[str, Any]) -> None:
        folder = Path(self.args.tmp) / "ck"
        self.figures[f"checkpoint folder (MiB, cap {self.folder_mb})"] = sum(
            f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20

    @staticmethod
    def attacks() -> list[tuple[str, list]]:
        return _mixed_attacks()

    def hold(self) -> None:
        attacks = self.attacks()

        def client() -> None:
            for _ in range(self.args.rounds):
                for name, messages in attacks:
                    if self.stop.is_set():
                        return
                    conn = transports.connect(via("127.0.0.1", self.address))
                    try:
                        for msg in messages:
                            self._tally(conn, msg, name)
                    finally:
                        conn.close()

        threads = [threading.Thread(target=client, daemon=True) for _ in range(self.args.hostile)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _stateful(rows: int, *extra: Any) -> list:
    """A session whose AC-SGD buffer has ``rows`` rows (of 72 bytes), with an optimizer, then ``extra``."""
    spec = f"acsgd:capacity={rows}"
    ids = np.array([rows - 1], dtype=np.int64)
    x = compressors.make_codec(spec).encode(torch.randn(1, 32), compressors.CodecContext(sample_ids=ids))
    attach = [{"op": "optimizer", "name": "SGD", "settings": {"lr": 0.1}, "id": 1}]
    forward = Forward(call=1, train=True, grad=False, args=[payload_to_wire(x, False)], kwargs={}, sample_ids=ids,
                      seq=1, ops=attach)
    return [_hello(spec, slots=("fwd",)), forward, *extra, Bye(seq=2 + len(extra))]


class Checkpoint(Mixed):
    """A step whose checkpoint writes the largest state the session budget allows, and its pin."""
    folder_mb = 256

    @classmethod
    def cloud(cls, folder: Path, args: argparse.Namespace) -> tuple[list[str], dict | None]:
        extra, keys = super().cloud(folder, args)
        return [*extra, "--pin-quota-mb", "64"], keys

    @staticmethod
    def attacks() -> list[tuple[str, list]]:
        return [("checkpoint a large state", _stateful(CHECKPOINT_ROWS, Sync(ops=[{"op": "step", "id": 1}], seq=2),
                                                       Sync(checkpoint=True, pin=True, seq=3)))]


class Pins(Checkpoint):
    """Sessions that pin their state and leave, to fill the checkpoint folder."""
    @staticmethod
    def attacks() -> list[tuple[str, list]]:
        return [("pin and leave", _stateful(PIN_ROWS, Sync(checkpoint=True, pin=True, seq=2)))]


class Compute(Mixed):
    """The costliest gradient codec the policy allows, on the largest batch a message may decode to."""
    @staticmethod
    def attacks() -> list[tuple[str, list]]:
        identity, ctx = compressors.make_codec("identity"), compressors.CodecContext()
        rows = 512  # 16 MiB: its graph (about three times that) fits --session-memory-mb
        x = payload_to_wire(identity.encode(torch.randn(rows, 256, 32), ctx), True)
        g = payload_to_wire(identity.encode(torch.ones(rows, 256, 4), ctx), False)
        return [("lowrank:iters=16,rank=64 gradient", [
            _hello("lowrank:iters=16,rank=64", slots=("bwd",)),
            Forward(call=1, train=True, grad=True, args=[x], kwargs={}, seq=1),
            Backward(call=1, grads=[g], seq=2), Bye(seq=3)])]


class Booked(Attack):
    """Book the memory budget to the byte with AC-SGD buffers that are never filled."""
    def setup(self) -> None:
        capacity, sessions, conn = 1 << 22, 0, None
        while capacity and len(self.conns) < 60:
            spec = f"acsgd:capacity={capacity}"
            row = compressors.make_codec(spec).encode(torch.randn(1, 32), compressors.CodecContext(sample_ids=np.array([0])))
            conn = conn or self.connect("127.0.0.2")  # after a refusal, the next hello replaces that session
            reply = self._tally(conn, _hello(spec, slots=("fwd",)), "hello")
            if reply is not None and reply.TYPE == "welcome":
                reply = self._tally(conn, _forward(payload_to_wire(row, False), sample_ids=np.array([0], dtype=np.int64)),
                                    "1-row forward")
            if reply is not None and reply.TYPE != "error":
                sessions, conn = sessions + 1, None
            elif reply is None or "model" in reply.message:
                break
            else:
                self.figures["last refusal"] = reply.message
                capacity //= 2
        self.figures["sessions"] = sessions


class Hellos(Attack):
    """Four addresses take every place; with ``failing``, each session's one forward fails in the model."""
    failing = False

    def setup(self) -> None:
        per = int(BUDGETS["--max-open-sessions"]) // 4
        for host in range(4):
            for _ in range(per):
                self._open(f"127.0.0.{10 + host}")

    def _open(self, src: str) -> None:
        conn = self.connect(src)
        if getattr(self._tally(conn, _hello(), "hello"), "TYPE", "") == "welcome" and self.failing:
            wrong = compressors.make_codec("identity").encode(torch.randn(1, 7), compressors.CodecContext())
            self._tally(conn, _forward(payload_to_wire(wrong), grad=True), "failing forward")


class Failing(Hellos):
    failing = True

    def hold(self) -> None:
        super().hold()
        self._open("127.0.0.10")  # take back the place the good edge left, then leave

    def after(self, result: dict[str, Any]) -> None:
        """How long until an edge from one of the attacker's addresses gets in again?"""
        result["after_leaving_admitted_s"] = good_edge(self.address, 1, seed=2, src="127.0.0.10",
                                                       patience=self.args.patience)[0]


def _zmtp_peer(address: str, src: str) -> socket.socket:
    """A raw ZMTP 3.0 peer (NULL mechanism) that says it is a DEALER: it can send frames that no
    ZeroMQ library would, such as a message that never ends."""
    host, port = address[len("tcp://"):].rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), source_address=(src, 0))
    sock.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
    got = b""
    while len(got) < 64:
        got += sock.recv(64 - len(got))
    body = b"".join(bytes([len(n)]) + n + struct.pack(">I", len(v)) + v
                    for n, v in ((b"Socket-Type", b"DEALER"), (b"Identity", b"")))
    ready = b"\x05READY" + body
    sock.sendall(bytes([0x04, len(ready)]) + ready)
    return sock


def _more(payload: bytes) -> bytes:
    """One frame with the MORE flag: the message goes on."""
    head = bytes([0x01, len(payload)]) if len(payload) < 256 else b"\x03" + struct.pack(">Q", len(payload))
    return head + payload


class Inbound(Attack):
    """Raw peers send ``--inbound-mb`` each in frames of one message they never end."""
    def setup(self) -> None:
        before, chunk = _memory(self.pid), bytes(8 << 20)
        for i in range(self.args.inbound_peers):
            sock = _zmtp_peer(self.address, f"127.0.0.{30 + i}")
            self.conns.append(sock)
            for _ in range(self.args.inbound_mb // 8):
                sock.sendall(_more(chunk))
        time.sleep(1.0)
        sent = self.args.inbound_peers * (self.args.inbound_mb // 8) * 8
        self.figures |= {"sent_mb": sent, "rss_growth_mb": (_memory(self.pid) - before) / 2**20,
                         "rss_before_mb": before / 2**20}

    def hold(self) -> None:
        while not self.stop.wait(3.0):
            for sock in self.conns:
                sock.sendall(_more(b"x"))

    def after(self, result: dict[str, Any]) -> None:
        time.sleep(10.0)  # the peers are silent: ZeroMQ's heartbeat drops them after 6 s
        result["rss_10s_after_silence_mb"] = _memory(self.pid) / 2**20


class RefusedKey(Attack):
    """A stranger's key sends ``--inbound-mb`` in one message to a cloud with an allow-list."""
    @staticmethod
    def cloud(folder: Path, args: argparse.Namespace) -> tuple[list[str], dict | None]:
        keys = args.keys = folder / "keys"
        with contextlib.redirect_stdout(io.StringIO()):
            cli(["keys", "--dir", str(keys), "cloud", "good", "stranger"])
        public, secret = transports.load_secret_key(keys / "good.key_secret")
        return (["--secret-key", str(keys / "cloud.key_secret"), "--allow-edge-keys", str(keys / "good.key")],
                {"public_key": public, "secret_key": secret, "server_key": transports.load_public_key(keys / "cloud.key")})

    def setup(self) -> None:
        keys = self.args.keys
        public, secret = transports.load_secret_key(keys / "stranger.key_secret")
        before = _memory(self.pid)
        conn = transports.connect(via("127.0.0.40", self.address), public_key=public, secret_key=secret,
                                  server_key=transports.load_public_key(keys / "cloud.key"))
        self.conns.append(conn)
        try:
            conn.send([bytes(8 << 20)] * (self.args.inbound_mb // 8))
            conn.recv(5.0)
        except transports.TransportError as exc:
            self.codes[type(exc).__name__] += 1
        time.sleep(1.0)
        self.figures |= {"sent_mb": self.args.inbound_mb // 8 * 8, "rss_growth_mb": (_memory(self.pid) - before) / 2**20}

    def hold(self) -> None:
        self.stop.wait()


def _header_attacks() -> list[tuple[str, list]]:
    """Headers whose parse a cloud must bound, as raw frames."""
    version, cap = protocol.PROTOCOL_VERSION, protocol.MAX_CONTAINER_LEN
    claims = b"\x93" + msgpack.packb(version) + msgpack.packb("hello") + (b"\xdd" + struct.pack(">I", cap)) * 2000
    return [
        ("header of 4 MiB of empty maps", [msgpack.packb([version, "hello", [{}] * (4 << 20)])]),
        ("header of 256 KiB of empty lists", [msgpack.packb([version, "hello", [[[]] * cap] * 31])]),
        ("header of nested length claims", [claims]),
    ]


class HeaderParse(Attack):
    """``--hostile`` connections, each sending the header attacks in turn, each after the last one's reply."""
    def hold(self) -> None:
        attacks = _header_attacks()

        def client(i: int) -> None:
            conn = self.connect(f"127.0.0.{50 + i}")
            while not self.stop.is_set():
                for name, frames in attacks:
                    conn.send(frames)
                    try:
                        reply = protocol.decode(conn.recv(30.0))
                    except Exception as exc:  # noqa: BLE001 — an attacker's tally, not a bug report
                        self.codes[f"{name}: {type(exc).__name__}"] += 1
                    else:
                        self.codes[f"{name}: {getattr(reply, 'code', reply.TYPE)}"] += 1

        threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(self.args.hostile)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


class ParkedRounds(Attack):
    """The other edge of each round steps, then sends up to ``--parked`` forwards of 54 MiB each,
    which wait for the round to close, until one is refused; again every round."""
    shared = True

    @staticmethod
    def cloud(folder: Path, args: argparse.Namespace) -> tuple[list[str], dict | None]:
        # The attacker waits for its rounds without training: it is not reaped as a silent hello.
        return [*SHARED, "--handshake-timeout", "60"], None

    def setup(self) -> None:
        self.first = threading.Event()
        self.parker = threading.Thread(target=self._park, daemon=True)
        self.parker.start()
        self.first.wait(60)  # its first round's requests are in before the good edge joins

    def _park(self) -> None:
        rows = (54 << 20) // (32 * 4)
        big = protocol.encode(Forward(call=1, train=False, grad=False, kwargs={}, args=[payload_to_wire(
            compressors.make_codec("identity").encode(torch.ones(rows, 32), compressors.CodecContext()), False)]))
        conn = self.connect("127.0.0.60")

        def reply(timeout: float) -> str | None:
            try:
                got = protocol.decode(conn.recv(timeout))
            except transports.TransportTimeout:
                return None
            code = getattr(got, "code", got.TYPE)
            self.codes[f"parked rounds: {code}"] += 1
            return code

        def until_ack() -> None:
            while not self.stop.is_set() and reply(1.0) not in ("ack", "welcome"):
                pass

        try:
            conn.send(protocol.encode(_hello()))
            until_ack()
            settings = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).defaults  # as a real edge sends them
            conn.send(protocol.encode(Sync(ops=[{"op": "optimizer", "name": "SGD", "settings": settings}])))
            until_ack()
            while not self.stop.is_set():
                conn.send(protocol.encode(Sync(ops=[{"op": "step", "lr": 0.1}])))  # answered once the round closed
                until_ack()
                for _ in range(self.args.parked):  # one at a time: what ZeroMQ buffers unread is another matter
                    conn.send(big)
                    if reply(0.3) == "capacity":  # a kept request is answered only when the round closes
                        break
                self.first.set()
        finally:
            self.first.set()

    def hold(self) -> None:
        self.stop.wait()
        self.parker.join(timeout=60)


# ---------------------------------------------------------------- main


def _pct(times: list[float], q: int) -> float:
    return statistics.quantiles(times, n=100)[q - 1] if len(times) >= 2 else times[0]


def _latency(admitted: float | None, times: list[float]) -> dict[str, Any]:
    if admitted is None:
        return {"admitted_s": None}
    return {"admitted_s": admitted, "p50_ms": 1e3 * statistics.median(times), "p95_ms": 1e3 * _pct(times, 95),
            "max_ms": 1e3 * max(times)}


ATTACKS = {"mixed": Mixed, "booked": Booked, "hellos": Hellos, "failing": Failing, "inbound": Inbound,
           "refused-key": RefusedKey, "checkpoint": Checkpoint, "pins": Pins, "compute": Compute,
           "header-parse": HeaderParse, "parked-rounds": ParkedRounds}


def scenario(name: str, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Start a cloud, run the good edge under one attack, and return the figures."""
    kind = ATTACKS[name]
    extra, keys = kind.cloud(folder, args)
    proc, address = _start_cloud(folder, *extra)
    attack = kind(address, args, proc.pid)
    try:
        attack.thread.start()
        attack.ready.wait(120)
        admitted, times = good_edge(address, args.round_steps if kind.shared else args.steps, seed=1, keys=keys,
                                    patience=args.patience, shared=kind.shared)
        result = _latency(admitted, times) | {"cloud_rss_mb": _memory(proc.pid) / 2**20}
        attack.stop.set()
        attack.thread.join(timeout=60)
        attack.after(result)
        result |= {"attack": attack.figures, "replies": dict(sorted(attack.codes.items())),
                   "cloud_peak_rss_mb": _memory(proc.pid, "VmHWM") / 2**20, "cloud_alive": proc.poll() is None}
    finally:
        proc.kill()
        proc.wait(timeout=10)
    return result


def _report(name: str, r: dict[str, Any], alone: dict[str, Any]) -> None:
    if r["admitted_s"] is None:
        print(f"{name:12s} the good edge was refused for {alone['patience']:.0f} s")
    else:
        print(f"{name:12s} admitted in {r['admitted_s']:.2f} s; steps p50 {r['p50_ms']:.1f} ms, p95 {r['p95_ms']:.1f} ms "
              f"({r['p95_ms'] / alone['p95_ms']:.2f}x alone), worst {r['max_ms']:.0f} ms; cloud RSS "
              f"{r['cloud_rss_mb']:.0f} MiB (peak {r['cloud_peak_rss_mb']:.0f})")
    for key, value in r.get("attack", {}).items():
        print(f"{'':12s}   {key}: {value:.1f}" if isinstance(value, float) else f"{'':12s}   {key}: {value}")
    for key in ("after_leaving_admitted_s", "rss_10s_after_silence_mb"):
        if key in r:
            value = r[key]
            print(f"{'':12s}   {key}: " + ("refused throughout" if value is None else f"{value:.1f}"))
    for key, count in r.get("replies", {}).items():
        print(f"{'':12s}   {count:6d}  {key}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenario", nargs="+", choices=list(ATTACKS), default=list(ATTACKS))
    parser.add_argument("--hostile", type=int, default=4, help="mixed: hostile client threads (default: 4)")
    parser.add_argument("--rounds", type=int, default=50,
                        help="mixed: at most this many passes over the attack list per client (default: 50)")
    parser.add_argument("--steps", type=int, default=150, help="good-edge steps per scenario (default: 150)")
    parser.add_argument("--inbound-peers", type=int, default=4, help="inbound: raw peers (default: 4)")
    parser.add_argument("--inbound-mb", type=int, default=256, help="inbound: MiB each peer sends (default: 256)")
    parser.add_argument("--round-steps", type=int, default=20,
                        help="parked-rounds: good-edge steps, each waiting for its round (default: 20)")
    parser.add_argument("--parked", type=int, default=16,
                        help="parked-rounds: 54 MiB forwards the attacker sends per round (default: 16)")
    parser.add_argument("--patience", type=float, default=60.0,
                        help="seconds the good edge keeps asking in while refused (default: 60)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    results: dict[str, Any] = {"budgets": BUDGETS, "steps": args.steps}
    with tempfile.TemporaryDirectory(prefix="splitft-hostile-") as tmp:
        args.tmp = tmp
        proc, address = _start_cloud(Path(tmp))
        try:
            admitted, times = good_edge(address, args.steps, seed=0)
            results["alone"] = _latency(admitted, times) | {"patience": args.patience}
        finally:
            proc.kill()
            proc.wait(timeout=10)
        alone = results["alone"]
        print(f"{'alone':12s} admitted in {alone['admitted_s']:.2f} s; steps p50 {alone['p50_ms']:.1f} ms, "
              f"p95 {alone['p95_ms']:.1f} ms, worst {alone['max_ms']:.0f} ms")
        for name in args.scenario:
            results[name] = scenario(name, Path(tmp), args)
            _report(name, results[name], alone)
    results["file_path_attack_wrote_file"] = Path("/tmp/splitft-hostile.npy").exists()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
