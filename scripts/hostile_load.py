"""A good edge trains while hostile clients attack the same cloud: admission, step latency, memory.

A cloud process serves a tiny MLP (``splitft.models:tiny_mlp``) on 127.0.0.1 with tight budgets.
A good edge first trains alone, then again under each attack in turn, while ``--hostile``
clients (threads of this process, talking raw protocol over ZeroMQ) repeat it in a bounded loop:

- ``storm``: the well-formed worst cases a trust boundary must refuse: low-rank and
  repeated-side-tensor decode bombs, floods of operations, sample ids far beyond any buffer,
  codec options naming files or asking for huge ranks and iteration counts, silent hellos,
  forged resume tokens, deeply nested values, forward calls whose backward never comes;
- ``checkpoint``: a session with the largest AC-SGD buffer its budget allows steps (the cloud
  checkpoints every step), pins that checkpoint and says goodbye;
- ``pins``: sessions pin their state and leave, to fill the checkpoint folder;
- ``compute``: the largest low-rank gradient codec the policy allows (``iters=16,rank=64``) on a
  batch whose graph fits the session's budget, forward and backward.

Each attack runs against a fresh cloud. For each it prints the good edge's admission time (hello
to welcome, the worst of a few), its step latency (p50 / p95 / worst), what the attackers got
back (reply codes), the cloud's peak resident memory against its configured total and what the
checkpoint folder holds.

    python scripts/hostile_load.py                    # every attack, 4 hostile clients, 150 good steps each
    python scripts/hostile_load.py --attack compute --attack checkpoint --steps 300 --json result.json
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
           "--handshake-timeout": "2", "--max-ops": "256", "--max-open-sessions": "64", "--checkpoint-max-mb": "256",
           "--pin-quota-mb": "64"}
#: AC-SGD rows of the checkpoint attack: 29 MB of buffer (72 bytes a row), within --max-decoded-mb.
CHECKPOINT_ROWS = 400_000
#: AC-SGD rows of each pin of the pins attack: 7 MB.
PIN_ROWS = 100_000


def _start_cloud(folder: Path) -> tuple[subprocess.Popen, str]:
    ready = folder / "address"
    cmd = [sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--sessions", "0",
           "--model", FACTORY, "--ready-file", str(ready), "--checkpoint-dir", str(folder / "ck"), "--no-fsync"]
    for flag, value in BUDGETS.items():
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


def admission(address: str) -> float | str:
    """Seconds from a good edge's hello to its welcome (its session is ended right after), or the
    refusal it got."""
    import transports
    from splitft import protocol

    hello, _ = _hello_for()
    conn = transports.connect(address)
    try:
        start = time.perf_counter()
        conn.send(protocol.encode(hello()))
        reply = protocol.decode(conn.recv(120.0))
        seconds = time.perf_counter() - start
        if reply.TYPE != "welcome":
            return f"{getattr(reply, 'code', reply.TYPE)}: {getattr(reply, 'message', '')[:200]}"
        conn.send(protocol.encode(protocol.Bye(seq=1)))
        conn.recv(120.0)
        return seconds
    finally:
        conn.close()


def good_edge(address: str, steps: int, seed: int) -> list[float]:
    """Train ``steps`` steps; return each step's wall time in seconds."""
    import torch
    from torch import nn

    import splitft
    from splitft.models import tiny_mlp

    g = torch.Generator().manual_seed(seed)
    model = splitft.split(tiny_mlp(), CUT, factory=FACTORY, connect=address,
                          faults=splitft.Faults(timeout=30, heartbeat=1.0))
    times = []
    with model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for _ in range(steps):
            x, y = torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)
            start = time.perf_counter()
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
    return times


# ---------------------------------------------------------------- hostile clients


def _hello_for():
    """A hello builder for the served model (codecs per direction) and the identity codec's context."""
    import compressors
    from splitft import protocol
    from splitft.cut import extract, fingerprint, parse_cut
    from splitft.models import tiny_mlp
    from splitft.protocol import Hello

    model = tiny_mlp()
    chain = extract(model, parse_cut(model, CUT, None))

    def hello(fwd: str = "identity", bwd: str = "identity", **changes) -> Hello:
        codecs = {s: compressors.canonical_spec(fwd if s in ("fwd", "ret") else bwd)
                  for s in ("fwd", "bwd", "ret", "ret_bwd")}
        base = dict(protocol=protocol.PROTOCOL_VERSION, factory=FACTORY, cut=str(CUT), rejoin=None,
                    fingerprint=fingerprint(chain), codecs=codecs, seed=0, client="hostile")
        return Hello(**(base | changes))

    return hello, compressors.CodecContext()


def _attacks() -> list[tuple[str, list]]:
    """(name, [message, ...]) pairs: each list is sent on one fresh connection, in order."""
    import numpy as np
    import torch

    import compressors
    from splitft.protocol import Forward, Sync, payload_to_wire

    hello, ctx = _hello_for()
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


def _stateful(rows: int, *extra: object) -> list:
    """A session whose AC-SGD buffer has ``rows`` rows (of 72 bytes), with an optimizer, then ``extra``."""
    import numpy as np
    import torch

    import compressors
    from splitft.protocol import Bye, Forward, payload_to_wire

    hello, _ = _hello_for()
    ids = np.array([rows - 1], dtype=np.int64)
    x = compressors.make_codec(f"acsgd:capacity={rows}").encode(torch.randn(1, 32),
                                                                 compressors.CodecContext(sample_ids=ids))
    attach = [{"op": "optimizer", "name": "SGD", "settings": {"lr": 0.1}, "id": 1}]
    forward = Forward(call=1, train=True, grad=False, args=[payload_to_wire(x, False)], kwargs={}, sample_ids=ids,
                      seq=1, ops=attach)
    return [hello(f"acsgd:capacity={rows}"), forward, *extra, Bye(seq=2 + len(extra))]


def _checkpoint_attacks() -> list[tuple[str, list]]:
    """A step whose checkpoint writes the largest state the session budget allows, and its pin."""
    from splitft.protocol import Sync

    return [("checkpoint a large state", _stateful(CHECKPOINT_ROWS, Sync(ops=[{"op": "step", "id": 1}], seq=2),
                                                   Sync(checkpoint=True, pin=True, seq=3)))]


def _pin_attacks() -> list[tuple[str, list]]:
    """Sessions that pin their state and leave, to fill the checkpoint folder."""
    from splitft.protocol import Sync

    return [("pin and leave", _stateful(PIN_ROWS, Sync(checkpoint=True, pin=True, seq=2)))]


def _compute_attacks() -> list[tuple[str, list]]:
    """The costliest gradient codec the policy allows, on the largest batch a message may decode to."""
    import torch

    import compressors
    from splitft.protocol import Backward, Bye, Forward, payload_to_wire

    hello, ctx = _hello_for()
    identity = compressors.make_codec("identity")
    rows = 512  # 16 MiB: its graph (about three times that) fits --session-memory-mb
    x = payload_to_wire(identity.encode(torch.randn(rows, 256, 32), ctx), True)
    g = payload_to_wire(identity.encode(torch.ones(rows, 256, 4), ctx), False)
    return [("lowrank:iters=16,rank=64 gradient", [
        hello(bwd="lowrank:iters=16,rank=64"), Forward(call=1, train=True, grad=True, args=[x], kwargs={}, seq=1),
        Backward(call=1, grads=[g], seq=2), Bye(seq=3)])]


ATTACKS = {"storm": _attacks, "checkpoint": _checkpoint_attacks, "pins": _pin_attacks, "compute": _compute_attacks}


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
                        reply = protocol.decode(conn.recv(60.0))
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


class _Peak:
    """The largest resident memory of a process seen while it runs (sampled every 10 ms)."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, _memory(self.pid, "VmRSS"))
            except OSError:  # the process is gone
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def _folder_mb(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20 if folder.exists() else 0.0


def _phase(name: str, address: str, proc: subprocess.Popen, folder: Path, args: argparse.Namespace,
           seed: int) -> dict:
    """The good edge's admission and steps while ``name``'s hostile clients attack (alone: none)."""
    stop, lock, codes = threading.Event(), threading.Lock(), collections.Counter()
    attacks = ATTACKS[name]() if name in ATTACKS else []
    threads = [threading.Thread(target=hostile_client, args=(address, attacks, stop, codes, lock, args.rounds),
                                daemon=True) for _ in range(args.hostile if attacks else 0)]
    peak = _Peak(proc.pid)
    for t in threads:
        t.start()
    if threads:
        time.sleep(2.0)  # let the attack get going (a heavy request under way, a folder filling)
    admitted = [admission(address) for _ in range(3)]
    try:
        times, failure = good_edge(address, args.steps, seed=seed), None
    except Exception as exc:  # noqa: BLE001 — the figure to report: the good edge could not train
        times, failure = [], f"{type(exc).__name__}: {exc}"[:300]
    stop.set()
    for t in threads:
        t.join(timeout=120)
    seconds = [a for a in admitted if isinstance(a, float)]
    return {"attack": name, "admission_max_ms": 1e3 * max(seconds) if seconds else None,
            "refusals": [a for a in admitted if isinstance(a, str)], "training_failed": failure,
            "p50_ms": 1e3 * statistics.median(times) if times else None,
            "p95_ms": 1e3 * _pct(times, 95) if times else None, "max_ms": 1e3 * max(times) if times else None,
            "peak_rss_mb": peak.stop() / 2**20, "checkpoint_folder_mb": _folder_mb(folder),
            "cloud_alive": proc.poll() is None, "replies": dict(sorted(codes.items()))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hostile", type=int, default=4, help="hostile client threads (default: 4)")
    parser.add_argument("--steps", type=int, default=150, help="good-edge steps per phase (default: 150)")
    parser.add_argument("--rounds", type=int, default=50,
                        help="at most this many passes over the attack list per client (default: 50)")
    parser.add_argument("--attack", action="append", choices=sorted(ATTACKS), default=None,
                        help="run this attack; repeat for several (default: all of them, in turn)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    phases = []
    for seed, name in enumerate(["alone", *(args.attack or ATTACKS)]):
        with tempfile.TemporaryDirectory(prefix="splitft-hostile-") as tmp:  # a fresh cloud for each
            proc, address = _start_cloud(Path(tmp))
            try:
                phases.append(_phase(name, address, proc, Path(tmp) / "ck", args, seed))
            finally:
                proc.kill()
                proc.wait(timeout=10)
        _report(phases[-1], phases[0], args)
    result = {"hostile_clients": args.hostile, "steps": args.steps,
              "cloud_memory_budget_mb": float(BUDGETS["--memory-mb"]),
              "checkpoint_cap_mb": float(BUDGETS["--checkpoint-max-mb"]), "phases": phases,
              "file_path_attack_wrote_file": Path("/tmp/splitft-hostile.npy").exists()}
    print(f"file written by the path attack: {result['file_path_attack_wrote_file']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def _report(phase: dict, alone: dict, args: argparse.Namespace) -> None:
    under = "alone" if phase["attack"] == "alone" else f"under {args.hostile} clients of '{phase['attack']}'"
    admitted = "never admitted" if phase["admission_max_ms"] is None else \
        f"admitted in {phase['admission_max_ms']:.0f} ms (worst of 3)"
    refused = f", refused {len(phase['refusals'])} of 3 times ({phase['refusals'][0]})" if phase["refusals"] else ""
    if phase["p95_ms"] is None:
        print(f"good edge {under}: {admitted}{refused}; could not train: {phase['training_failed']}")
    else:
        print(f"good edge {under}: {admitted}{refused}; {args.steps} steps p50 {phase['p50_ms']:.1f} ms, "
              f"p95 {phase['p95_ms']:.1f} ms ({phase['p95_ms'] / alone['p95_ms']:.2f}x alone), "
              f"worst {phase['max_ms']:.0f} ms")
    print(f"  cloud: peak resident {phase['peak_rss_mb']:.0f} MiB (sessions' budget {BUDGETS['--memory-mb']} MiB), "
          f"checkpoint folder {phase['checkpoint_folder_mb']:.1f} MiB (cap {BUDGETS['--checkpoint-max-mb']} MiB), "
          f"still serving: {phase['cloud_alive']}")
    for key, count in phase["replies"].items():
        print(f"  {count:6d}  {key}")


if __name__ == "__main__":
    sys.exit(main())
