"""A good edge trains while hostile clients attack the same cloud: step latency and cloud memory.

A cloud process serves a tiny MLP (``splitft.models:tiny_mlp``) on 127.0.0.1 with tight budgets.
A good edge first trains alone, then again while ``--hostile`` clients (threads of this process,
talking raw protocol over ZeroMQ) send, in a bounded loop, the well-formed worst cases a trust
boundary must refuse: low-rank and repeated-side-tensor decode bombs, floods of operations,
sample ids far beyond any buffer, codec options naming files or asking for huge ranks and
iteration counts, silent hellos, forged resume tokens, deeply nested values, and forward calls
whose backward never comes. It prints the good edge's step latency (p50 / p95) alone and under
attack, their ratio, what the attackers got back (reply codes), and the cloud's peak resident
memory against its configured total.

Then one attack at a time, each against a fresh cloud, with a good edge's admission time (its
hello to its welcome) and step latency under it, and the cloud's peak memory:

* **header parse**: ``--hostile`` clients sending headers of empty containers, one over the header
  limit and the worst shapes under it (256 KiB of empty lists, lists claiming their longest length
  nested as deep as msgpack goes), each client on one connection;
* **parked rounds**: against a shared half trained in rounds (``--shared-model --sync-rounds 2``,
  the attacker being the other edge of each round), an edge that steps and then sends forwards of
  54 MiB to wait for the round, far more than ``--memory-mb``.

    python scripts/hostile_load.py                    # 4 hostile clients, 150 good steps
    python scripts/hostile_load.py --hostile 8 --steps 300 --json result.json
    python scripts/hostile_load.py --only "parked rounds"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

FACTORY = "splitft.models:tiny_mlp"
CUT = 2
BUDGETS = {"--session-memory-mb": "64", "--memory-mb": "512", "--max-decoded-mb": "32",
           "--handshake-timeout": "2", "--max-ops": "256", "--max-open-sessions": "64", "--checkpoint-max-mb": "64"}


SHARED = ["--shared-model", "--sync-rounds", "2", "--round-timeout", "30", "--shared-optimizer", 'SGD:{"lr": 0.1}']


def _start_cloud(folder: Path, shared: bool = False) -> tuple[subprocess.Popen, str]:
    ready = folder / f"address-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--sessions", "0",
           "--model", FACTORY, "--ready-file", str(ready)]
    cmd += SHARED if shared else ["--checkpoint-dir", str(folder / "ck"), "--no-fsync"]
    # A shared half's attacker waits for its rounds without training: it is not reaped as a silent hello.
    budgets = BUDGETS | {"--handshake-timeout": "60"} if shared else BUDGETS
    for flag, value in budgets.items():
        if not (shared and flag == "--checkpoint-max-mb"):
            cmd += [flag, value]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=os.environ | {"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the cloud process did not start")
        time.sleep(0.05)
    return proc, ready.read_text()


def _memory(pid: int, field: str) -> int:
    """``VmHWM`` (peak) or ``VmRSS`` (now) of a process, in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------- the good edge


def good_edge(address: str, steps: int, seed: int, shared: bool = False) -> tuple[float, list[float]]:
    """Train ``steps`` steps; return how long its hello took to be welcomed and each step's wall time."""
    import torch
    from torch import nn

    import splitft
    from splitft.models import tiny_mlp

    g = torch.Generator().manual_seed(seed)
    start = time.perf_counter()
    model = splitft.split(tiny_mlp(), CUT, factory=FACTORY, connect=address,
                          faults=splitft.Faults(timeout=60, heartbeat=1.0))
    admitted = time.perf_counter() - start
    times = []
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1) if shared
                           else torch.optim.Adam(model.parameters(), lr=0.01))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for _ in range(steps):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            start = time.perf_counter()
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
    return admitted, times


# ---------------------------------------------------------------- hostile clients


def _hello(fwd: str = "identity", **changes):
    """A hostile edge's hello for the served model (its fingerprint right, nothing pushed)."""
    import compressors
    from splitft import protocol
    from splitft.cut import extract, fingerprint, parse_cut
    from splitft.models import tiny_mlp

    model = tiny_mlp()
    chain = extract(model, parse_cut(model, CUT, None))
    codecs = {s: compressors.canonical_spec(fwd if s in ("fwd", "ret") else "identity")
              for s in ("fwd", "bwd", "ret", "ret_bwd")}
    base = dict(protocol=protocol.PROTOCOL_VERSION, factory=FACTORY, cut=str(CUT), rejoin=None,
                fingerprint=fingerprint(chain), codecs=codecs, seed=0, client="hostile")
    return protocol.Hello(**(base | changes))


def _attacks() -> list[tuple[str, list]]:
    """(name, [message, ...]) pairs: each list is sent on one fresh connection, in order."""
    import numpy as np
    import torch

    import compressors
    from splitft.protocol import Forward, Sync, payload_to_wire

    hello = _hello
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

    def fwd(entry, call=1, **fields):
        return Forward(call=call, train=True, grad=fields.pop("grad", False), args=[entry],
                       kwargs=fields.pop("kwargs", {}), **fields)

    ids = np.array([399_999_999], dtype=np.int64)
    acsgd = payload_to_wire(compressors.make_codec("acsgd").encode(
        torch.randn(1, 32), compressors.CodecContext(sample_ids=np.array([0]))), False)
    return [
        ("lowrank decode bomb", [hello("lowrank:rank=1"), fwd(payload_to_wire(bomb, False))]),
        ("repeated side tensors", [hello(), fwd(x, kwargs={"a": expand, "b": expand, "c": expand})]),
        ("operation flood", [hello(), Sync(ops=[{"op": "zero_grad"}] * 100_000, seq=1)]),
        ("sample id 4e8", [hello("acsgd"), fwd(acsgd, sample_ids=ids)]),
        ("file path option", [hello("acsgd:capacity=2000,path=/tmp/splitft-hostile.npy")]),
        ("huge capacity", [hello("acsgd:capacity=300000000")]),
        ("iteration bomb", [hello("lowrank:rank=1,iters=400000")]),
        ("silent hello", [hello()]),
        ("forged resume", [hello(resume={"session": "0" * 16, "token": "x" * 32, "step": 0, "seq": 0,
                                         "log_from": 1})]),
        ("deep list", [hello(factory_kwargs={"width": deep})]),
        ("graphs never backpropagated", [hello()] + [fwd(graph, call=i, grad=True) for i in range(1, 40)]),
    ]


def _header_attacks() -> list[tuple[str, list]]:
    """Headers whose parse a cloud must bound, as raw frames."""
    import struct

    import msgpack

    from splitft import protocol

    version = protocol.PROTOCOL_VERSION
    cap = protocol.MAX_CONTAINER_LEN
    claims = b"\x93" + msgpack.packb(version) + msgpack.packb("hello") + (b"\xdd" + struct.pack(">I", cap)) * 2000
    return [
        ("header of 4 MiB of empty maps", [msgpack.packb([version, "hello", [{}] * (4 << 20)])]),
        ("header of 256 KiB of empty lists", [msgpack.packb([version, "hello", [[[]] * cap] * 31])]),
        ("header of nested length claims", [claims]),
    ]


def header_client(address: str, stop: threading.Event, codes: collections.Counter, lock: threading.Lock) -> None:
    """Send the header attacks in turn on one connection, each after the last one's reply."""
    import transports
    from splitft import protocol

    attacks = _header_attacks()
    conn = transports.connect(address)
    try:
        while not stop.is_set():
            for name, frames in attacks:
                conn.send(frames)
                try:
                    reply = protocol.decode(conn.recv(30.0))
                except Exception as exc:  # noqa: BLE001 — an attacker's tally, not a bug report
                    key = f"{name}: {type(exc).__name__}"
                else:
                    key = f"{name}: {getattr(reply, 'code', reply.TYPE)}"
                with lock:
                    codes[key] += 1
    finally:
        conn.close()


def parked_client(address: str, stop: threading.Event, codes: collections.Counter, lock: threading.Lock,
                  parked: int, mib: int, first: threading.Event) -> None:
    """The other edge of a shared half's rounds: it steps, then sends up to ``parked`` forwards of
    ``mib`` MiB each, which wait for the round to close, until one is refused; again every round.
    ``first`` is set once its first round's requests are in (the good edge has not joined yet)."""
    import torch

    import compressors
    import transports
    from splitft import protocol
    from splitft.protocol import Forward, Sync, payload_to_wire

    rows = (mib << 20) // (32 * 4)
    big = protocol.encode(Forward(call=1, train=False, grad=False, kwargs={}, args=[payload_to_wire(
        compressors.make_codec("identity").encode(torch.ones(rows, 32), compressors.CodecContext()), False)]))
    step = protocol.encode(Sync(ops=[{"op": "step", "lr": 0.1}]))
    conn = transports.connect(address)

    def reply(timeout: float) -> str | None:
        try:
            got = protocol.decode(conn.recv(timeout))
        except transports.TransportTimeout:
            return None
        code = getattr(got, "code", got.TYPE)
        with lock:
            codes[f"parked rounds: {code}"] += 1
        return code

    def until_ack() -> None:
        while not stop.is_set() and reply(1.0) not in ("ack", "welcome"):
            pass

    try:
        conn.send(protocol.encode(_hello()))
        until_ack()
        settings = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1).defaults  # as a real edge sends them
        conn.send(protocol.encode(Sync(ops=[{"op": "optimizer", "name": "SGD", "settings": settings}])))
        until_ack()
        while not stop.is_set():
            conn.send(step)  # its first is answered at once; later ones once the round has closed
            until_ack()
            for _ in range(parked):  # one at a time: what ZeroMQ buffers before the cloud reads is another matter
                conn.send(big)
                if reply(0.3) == "capacity":  # a kept request is answered only when the round closes
                    break
            first.set()
    finally:
        first.set()
        conn.close()


def hostile_client(address: str, attacks: list, stop: threading.Event, codes: collections.Counter,
                   lock: threading.Lock, max_rounds: int) -> None:
    import transports
    from splitft import protocol

    for _ in range(max_rounds):
        for name, messages in attacks:
            if stop.is_set():
                return
            conn = transports.connect(address)
            try:
                for msg in messages:
                    conn.send(protocol.encode(msg))
                    try:
                        reply = protocol.decode(conn.recv(10.0))
                    except Exception as exc:  # noqa: BLE001 — an attacker's tally, not a bug report
                        key = f"{name}: {type(exc).__name__}"
                    else:
                        key = f"{name}: {getattr(reply, 'code', reply.TYPE)}"
                    with lock:
                        codes[key] += 1
            finally:
                conn.close()


# ---------------------------------------------------------------- main


def _pct(times: list[float], q: float) -> float:
    return statistics.quantiles(times, n=100)[q - 1] if len(times) >= 2 else times[0]


def _stopped(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(timeout=10)


def mixed(args: argparse.Namespace, tmp: Path) -> dict:
    """The good edge alone, then under ``--hostile`` clients sending the whole attack list."""
    proc, address = _start_cloud(tmp)
    try:
        _, alone = good_edge(address, args.steps, seed=0)
        baseline = _memory(proc.pid, "VmHWM")  # the process with torch loaded and one session served
        attacks = _attacks()
        stop, lock, codes = threading.Event(), threading.Lock(), collections.Counter()
        threads = [threading.Thread(target=hostile_client, args=(address, attacks, stop, codes, lock, args.rounds),
                                    daemon=True) for _ in range(args.hostile)]
        for t in threads:
            t.start()
        time.sleep(0.5)  # let the attack get going
        admitted, attacked = good_edge(address, args.steps, seed=1)
        stop.set()
        for t in threads:
            t.join(timeout=30)
        peak = _memory(proc.pid, "VmHWM")
        alive = proc.poll() is None
        folder = tmp / "ck"
        checkpoint_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
    finally:
        _stopped(proc)
    return {
        "hostile_clients": args.hostile, "steps": args.steps,
        "alone_p50_ms": 1e3 * statistics.median(alone), "alone_p95_ms": 1e3 * _pct(alone, 95),
        "attacked_admission_s": admitted,
        "attacked_p50_ms": 1e3 * statistics.median(attacked), "attacked_p95_ms": 1e3 * _pct(attacked, 95),
        "attacked_max_ms": 1e3 * max(attacked),
        "cloud_baseline_rss_mb": baseline / 2**20, "cloud_peak_rss_mb": peak / 2**20,
        "cloud_memory_budget_mb": float(BUDGETS["--memory-mb"]), "cloud_alive": alive,
        "replies": dict(sorted(codes.items())),
        "file_path_attack_wrote_file": Path("/tmp/splitft-hostile.npy").exists(),
        "checkpoint_folder_mb": checkpoint_bytes / 2**20,
    }


def one_attack(name: str, args: argparse.Namespace, tmp: Path) -> dict:
    """A fresh cloud, one attack (``header parse`` or ``parked rounds``) and a good edge under it."""
    shared = name == "parked rounds"
    proc, address = _start_cloud(tmp, shared=shared)
    stop, lock, codes = threading.Event(), threading.Lock(), collections.Counter()
    first = threading.Event()
    if shared:
        threads = [threading.Thread(target=parked_client, args=(address, stop, codes, lock, args.parked, 54, first),
                                    daemon=True)]
    else:
        threads = [threading.Thread(target=header_client, args=(address, stop, codes, lock), daemon=True)
                   for _ in range(args.hostile)]
    try:
        baseline = _memory(proc.pid, "VmHWM")
        for t in threads:
            t.start()
        first.wait(60) if shared else time.sleep(1.0)  # the attack is under way
        admitted, times = good_edge(address, args.round_steps if shared else args.steps, seed=2, shared=shared)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        peak, alive = _memory(proc.pid, "VmHWM"), proc.poll() is None
    finally:
        _stopped(proc)
    return {"attack": name, "steps": len(times), "admission_s": admitted,
            "p50_ms": 1e3 * statistics.median(times), "p95_ms": 1e3 * _pct(times, 95), "max_ms": 1e3 * max(times),
            "cloud_rss_growth_mb": (peak - baseline) / 2**20, "cloud_memory_budget_mb": float(BUDGETS["--memory-mb"]),
            "cloud_alive": alive, "replies": dict(sorted(codes.items()))}


def report(result: dict | None, phases: list[dict]) -> None:
    if result is not None:
        print(f"good edge, {result['steps']} steps: alone p50 {result['alone_p50_ms']:.1f} ms, "
              f"p95 {result['alone_p95_ms']:.1f} ms")
        print(f"under {result['hostile_clients']} hostile clients: admitted in {result['attacked_admission_s']:.2f} s, "
              f"p50 {result['attacked_p50_ms']:.1f} ms ({result['attacked_p50_ms'] / result['alone_p50_ms']:.2f}x), "
              f"p95 {result['attacked_p95_ms']:.1f} ms ({result['attacked_p95_ms'] / result['alone_p95_ms']:.2f}x), "
              f"worst {result['attacked_max_ms']:.0f} ms")
        growth = result["cloud_peak_rss_mb"] - result["cloud_baseline_rss_mb"]
        print(f"cloud resident memory: {result['cloud_baseline_rss_mb']:.0f} MiB before the attack, peak "
              f"{result['cloud_peak_rss_mb']:.0f} MiB during it (+{growth:.0f} MiB; the sessions' budget is "
              f"{result['cloud_memory_budget_mb']:.0f} MiB); still serving: {result['cloud_alive']}")
        print(f"file written by the path attack: {result['file_path_attack_wrote_file']}; checkpoint folder "
              f"{result['checkpoint_folder_mb']:.1f} MiB (cap {BUDGETS['--checkpoint-max-mb']} MiB)")
        print("what the attackers got back:")
        for key, count in result["replies"].items():
            print(f"  {count:6d}  {key}")
    for phase in phases:
        print(f"attack '{phase['attack']}': good edge admitted in {phase['admission_s']:.2f} s, {phase['steps']} steps "
              f"p50 {phase['p50_ms']:.1f} ms, p95 {phase['p95_ms']:.1f} ms, worst {phase['max_ms']:.0f} ms; cloud peak "
              f"+{phase['cloud_rss_growth_mb']:.0f} MiB (budget {phase['cloud_memory_budget_mb']:.0f} MiB); still "
              f"serving: {phase['cloud_alive']}")
        for key, count in phase["replies"].items():
            print(f"  {count:6d}  {key}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hostile", type=int, default=4, help="hostile client threads (default: 4)")
    parser.add_argument("--steps", type=int, default=150, help="good-edge steps per phase (default: 150)")
    parser.add_argument("--rounds", type=int, default=50,
                        help="at most this many passes over the attack list per client (default: 50)")
    parser.add_argument("--round-steps", type=int, default=20,
                        help="good-edge steps under the parked-rounds attack (default: 20)")
    parser.add_argument("--parked", type=int, default=16,
                        help="54 MiB forwards the parked-rounds attacker sends per round (default: 16)")
    parser.add_argument("--only", choices=("mixed", "header parse", "parked rounds"), default=None,
                        help="run this phase alone (default: all)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="splitft-hostile-") as tmp:
        result = mixed(args, Path(tmp)) if args.only in (None, "mixed") else None
        phases = [one_attack(name, args, Path(tmp)) for name in ("header parse", "parked rounds")
                  if args.only in (None, name)]
    report(result, phases)
    if args.json:
        Path(args.json).write_text(json.dumps({"mixed": result, "attacks": phases}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
