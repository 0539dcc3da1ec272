"""Every unit of work is priced before it is spent, and one edge's heavy request stalls no one else.

Each test is a finding of a hostile run against a real ``splitft cloud`` process: a step whose
checkpoint (a large AC-SGD buffer) held the serving thread and copied the state four times over,
a low-rank gradient codec at its largest allowed settings that stalled every session, pinned
checkpoints that outlived their sessions and filled the folder for good. Each must now be priced
(refused with ``capacity`` over its price) and, when it is allowed, run while the cloud answers
everyone else.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

import compressors
import transports
from splitft.wire import protocol
from splitft.cut import extract, fingerprint, parse_cut
from splitft.app.models import tiny_mlp
from splitft.wire.protocol import Backward, Bye, Forward, Hello, Ping, Sync, payload_to_wire
from tests.conftest import start_cloud, stop

FACTORY = "splitft.app.models:tiny_mlp"
MiB = 1 << 20
IDENTITY = compressors.make_codec("identity")
CTX = compressors.CodecContext()


def hello(width: int = 32, fwd: str = "identity", bwd: str = "identity") -> Hello:
    model = tiny_mlp(width=width)
    chain = extract(model, parse_cut(model, 2, None))
    codecs = {slot: compressors.canonical_spec(fwd if slot in ("fwd", "ret") else bwd)
              for slot in ("fwd", "bwd", "ret", "ret_bwd")}
    return Hello(protocol=protocol.PROTOCOL_VERSION, factory=FACTORY, cut="2", rejoin=None,
                 fingerprint=fingerprint(chain), codecs=codecs, seed=0, factory_kwargs={"width": width})


def ask(conn, msg, timeout: float = 60) -> protocol.Message:
    conn.send(protocol.encode(msg))
    return protocol.decode(conn.recv(timeout))


def tensor(x: torch.Tensor, grad: bool = False) -> dict:
    return payload_to_wire(IDENTITY.encode(x, CTX), grad)


def memory(pid: int, field: str) -> int:
    """``VmRSS`` (now) or ``VmHWM`` (peak) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no {field} for process {pid}")


def pinger(address: str):
    """A second edge's session, trained once (so it is kept), that only pings from now on."""
    conn = transports.connect(address)
    assert isinstance(ask(conn, hello()), protocol.Welcome)
    assert isinstance(ask(conn, Forward(call=1, train=True, grad=False, args=[tensor(torch.randn(2, 32))],
                                        kwargs={})), protocol.Output)
    return conn


def ping_during(heavy, light, request, delay: float = 0.1, timeout: float = 120) -> float:
    """Send ``request`` on ``heavy``, then after ``delay`` a ping on ``light``; returns how long
    before ``request``'s reply the pong came (0 when that reply was there first). Both replies are
    checked."""
    heavy.send(protocol.encode(request))
    time.sleep(delay)
    light.send(protocol.encode(Ping()))
    assert isinstance(protocol.decode(light.recv(timeout)), protocol.Pong)
    ponged = time.monotonic()
    try:
        reply, margin = protocol.decode(heavy.recv(0)), 0.0  # it came first
    except transports.TransportTimeout:
        reply = protocol.decode(heavy.recv(timeout))
        margin = time.monotonic() - ponged
    assert reply.TYPE != "error", reply
    return margin


# ---------------------------------------------------------------- checkpoints (finding 3)


def test_a_checkpoint_of_a_large_state_neither_stalls_other_sessions_nor_copies_it_over(tmp_path):
    """A 264 MB AC-SGD buffer, one step, and the step's checkpoint: today the serving thread wrote it
    (another session's ping waited for all of it) through four copies of the state."""
    capacity, width = 1_000_000, 128
    buffer = capacity * (2 * width + 8)
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", FACTORY, "--checkpoint-dir",
                                     str(tmp_path / "ck"), "--no-fsync")
    try:
        other = pinger(address)
        conn = transports.connect(address)
        welcome = ask(conn, hello(width, fwd=f"acsgd:capacity={capacity}"))
        assert isinstance(welcome, protocol.Welcome), welcome
        ids = np.array([capacity - 1], dtype=np.int64)
        codec = compressors.make_codec(f"acsgd:capacity={capacity}")
        x = payload_to_wire(codec.encode(torch.randn(1, width), compressors.CodecContext(sample_ids=ids)), True)
        attach = [{"op": "optimizer", "name": "SGD", "settings": {"lr": 0.1}, "id": 1}]
        assert isinstance(ask(conn, Forward(call=1, train=True, grad=True, args=[x], kwargs={}, sample_ids=ids, seq=1,
                                            ops=attach)), protocol.Output)
        assert isinstance(ask(conn, Backward(call=1, grads=[tensor(torch.ones(1, 4))], seq=2)), protocol.InputGrads)
        before = memory(proc.pid, "VmRSS")
        # answered while the step's checkpoint is still being written, not after it
        assert ping_during(conn, other, Sync(ops=[{"op": "step", "id": 1}], seq=3)) > 0.02
        assert memory(proc.pid, "VmHWM") - before < 2 * buffer  # the state once more at most, not four times
        assert isinstance(ask(conn, Bye(seq=4)), protocol.Ack)
        assert not (tmp_path / "ck" / welcome.session).exists()  # its checkpoints went with it
        deadline = time.monotonic() + 10
        while memory(proc.pid, "VmRSS") - before > buffer // 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert memory(proc.pid, "VmRSS") - before <= buffer // 4  # what checkpointing took is given back
    finally:
        stop(proc)


# ---------------------------------------------------------------- compute (finding 6)

HEAVY_BWD = "lowrank:iters=16,rank=64"  # the largest low-rank gradient codec the default policy allows


def _heavy_forward(conn, rows: int, length: int = 256) -> None:
    """A forward of ``rows`` x ``length`` positions whose backward the cloud encodes with HEAVY_BWD."""
    assert isinstance(ask(conn, hello(bwd=HEAVY_BWD)), protocol.Welcome)
    x = tensor(torch.randn(rows, length, 32), grad=True)
    assert isinstance(ask(conn, Forward(call=1, train=True, grad=True, args=[x], kwargs={}, seq=1)), protocol.Output)


def test_the_halfs_forward_is_counted_on_a_meta_twin_that_changes_nothing_of_the_half():
    from torch.utils.flop_counter import FlopCounterMode

    from splitft.cloud.costs import HalfCost, meta_like
    from splitft.app.models import digits_cnn

    model = digits_cnn()
    chain = extract(model, parse_cut(model, "block2", None)).train()
    x = torch.randn(64, 32, 8, 8)
    before = {k: v.clone() for k, v in chain.state_dict().items()}
    counted = HalfCost(chain).forward("64 rows", lambda twin: twin(meta_like(x)), 0)
    assert counted is not None
    for key, value in chain.state_dict().items():  # batch norm's running statistics included
        assert value.device.type == "cpu" and torch.equal(value, before[key]), key
    with FlopCounterMode(display=False) as real:
        chain(x)
    assert real.get_total_flops() <= counted[0] <= 2 * real.get_total_flops()


def test_counting_a_forward_on_one_thread_does_not_reach_a_half_computing_on_another():
    """Torch's FlopCounterMode tracks modules through hooks global to the process: a count on a
    worker reached the real half another session was backpropagating through, and its
    autograd.grad failed."""
    import threading

    from splitft.cloud.costs import HalfCost, meta_like
    from splitft.app.models import digits_cnn

    counted, real = (extract(m, parse_cut(m, "block2", None)) for m in (digits_cnn(), digits_cnn()))
    stop = threading.Event()

    def count() -> None:
        cost, n = HalfCost(counted), 0
        while not stop.is_set():
            n += 1
            cost.forward(n, lambda twin: twin(meta_like(torch.empty(8, 32, 8, 8))), 0)

    counter = threading.Thread(target=count)
    counter.start()
    try:
        for _ in range(100):
            x = torch.randn(16, 32, 8, 8, requires_grad=True)
            torch.autograd.grad(real(x).sum(), [x, *real.parameters()])
    finally:
        stop.set()
        counter.join()


def test_a_request_over_its_price_is_refused_before_any_of_it_is_done(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", FACTORY, "--max-request-gflop", "1")
    try:
        conn = transports.connect(address)
        _heavy_forward(conn, rows=64)  # 2 MiB: its backward's encode is about 17 GFLOP
        start = time.perf_counter()
        reply = ask(conn, Backward(call=1, grads=[tensor(torch.ones(64, 256, 4))], seq=2))
        assert reply.code == "capacity" and "--max-request-gflop" in reply.message, reply
        assert time.perf_counter() - start < 5
        # refused before anything was spent: the graph is still there, and a cheap request is served
        assert isinstance(ask(conn, Forward(call=2, train=True, grad=False, args=[tensor(torch.randn(4, 32))],
                                            kwargs={}, seq=3)), protocol.Output)
    finally:
        stop(proc)


def test_a_heavy_request_within_its_price_does_not_stall_another_sessions_reply(tmp_path):
    """The same codec on a 16 MiB batch: seconds of arithmetic on one core, within the default price."""
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", FACTORY)
    try:
        other = pinger(address)
        conn = transports.connect(address)
        _heavy_forward(conn, rows=512)
        assert ping_during(conn, other, Backward(call=1, grads=[tensor(torch.ones(512, 256, 4))], seq=2)) > 0.02
    finally:
        stop(proc)


# ---------------------------------------------------------------- pinned checkpoints (finding 4)


def _stateful(address: str, capacity: int):
    """A session holding an AC-SGD buffer of ``capacity`` rows of 72 bytes, with an optimizer."""
    conn = transports.connect(address)
    welcome = ask(conn, hello(fwd=f"acsgd:capacity={capacity}"))
    assert isinstance(welcome, protocol.Welcome), welcome
    ids = np.array([capacity - 1], dtype=np.int64)
    codec = compressors.make_codec(f"acsgd:capacity={capacity}")
    x = payload_to_wire(codec.encode(torch.randn(1, 32), compressors.CodecContext(sample_ids=ids)), False)
    attach = [{"op": "optimizer", "name": "SGD", "settings": {"lr": 0.1}, "id": 1}]
    assert isinstance(ask(conn, Forward(call=1, train=True, grad=False, args=[x], kwargs={}, sample_ids=ids, seq=1,
                                        ops=attach)), protocol.Output)
    return conn, welcome.session


def _pin(address: str, capacity: int) -> protocol.Message:
    """A session whose state is pinned, then a goodbye; returns the pin's reply."""
    conn, _ = _stateful(address, capacity)
    try:
        reply = ask(conn, Sync(checkpoint=True, pin=True, seq=2))
        assert isinstance(ask(conn, Bye(seq=3)), protocol.Ack)
        return reply
    finally:
        conn.close()


def _checkpointed(address: str, folder: Path, capacity: int) -> int:
    """A session that steps once (a checkpoint at every step by default); the bytes written for it."""
    conn, session = _stateful(address, capacity)
    try:
        assert isinstance(ask(conn, Sync(ops=[{"op": "step", "id": 1}], seq=2)), protocol.Ack)
        return sum(f.stat().st_size for f in (folder / session).glob("seq-*.safetensors"))
    finally:
        conn.close()


def test_a_pin_counts_against_its_origins_quota(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", FACTORY, "--checkpoint-dir",
                                     str(tmp_path / "ck"), "--no-fsync", "--pin-quota-mb", "2")
    try:
        assert isinstance(_pin(address, 20_000), protocol.Ack)  # 1.4 MB: within the quota, kept
        assert len(list((tmp_path / "ck").glob("*/pin-*.json"))) == 1
        reply = _pin(address, 20_000)  # as much again from the same address: over its quota
        assert reply.code == "capacity" and "--pin-quota-mb" in reply.message, reply
        assert len(list((tmp_path / "ck").glob("*/pin-*.json"))) == 1
    finally:
        stop(proc)


def test_pins_never_crowd_out_the_checkpoints_of_live_sessions_also_after_a_restart(tmp_path):
    """Sessions that pin 1.4 MB each and leave: today five fill --checkpoint-max-mb 6 for good, and
    every later session's checkpoints are refused, also after a restart on the same folder."""
    folder = tmp_path / "ck"
    flags = ["--sessions", "0", "--model", FACTORY, "--checkpoint-dir", str(folder), "--no-fsync",
             "--checkpoint-max-mb", "6"]
    for restart in (False, True):
        proc, address, err = start_cloud(tmp_path, *flags)
        try:
            for _ in range(0 if restart else 5):
                assert isinstance(_pin(address, 20_000), protocol.Ack)
            assert _checkpointed(address, folder, 20_000) > MiB, err.text
        finally:
            stop(proc)


def _pins(folder: Path) -> list[Path]:
    """The pinned checkpoints under ``folder``, listed while the cloud may be removing a session's."""
    while True:
        try:
            return list(folder.glob("*/pin-*"))
        except FileNotFoundError:  # a session's folder went while it was being listed: look again
            continue


def test_pins_expire(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", FACTORY, "--checkpoint-dir",
                                     str(tmp_path / "ck"), "--no-fsync", "--pin-hours", str(2 / 3600))
    try:
        assert isinstance(_pin(address, 20_000), protocol.Ack)
        assert _pins(tmp_path / "ck")
        deadline = time.monotonic() + 20
        # the pin goes first, then its session's folder: wait for both, nothing left that no session can use
        while (_pins(tmp_path / "ck") or list((tmp_path / "ck").iterdir())) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not list((tmp_path / "ck").iterdir())
    finally:
        stop(proc)
