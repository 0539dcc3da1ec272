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

    python scripts/hostile_load.py                    # 4 hostile clients, 150 good steps
    python scripts/hostile_load.py --hostile 8 --steps 300 --json result.json
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


def _attacks() -> list[tuple[str, list]]:
    """(name, [message, ...]) pairs: each list is sent on one fresh connection, in order."""
    import numpy as np
    import torch

    import compressors
    from splitft import protocol
    from splitft.cut import extract, fingerprint, parse_cut
    from splitft.models import tiny_mlp
    from splitft.protocol import Forward, Hello, Sync, payload_to_wire

    model = tiny_mlp()
    chain = extract(model, parse_cut(model, CUT, None))

    def hello(fwd: str = "identity", **changes) -> Hello:
        codecs = {s: compressors.canonical_spec(fwd if s in ("fwd", "ret") else "identity")
                  for s in ("fwd", "bwd", "ret", "ret_bwd")}
        base = dict(protocol=protocol.PROTOCOL_VERSION, factory=FACTORY, cut=str(CUT), rejoin=None,
                    fingerprint=fingerprint(chain), codecs=codecs, seed=0, client="hostile")
        return Hello(**(base | changes))

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hostile", type=int, default=4, help="hostile client threads (default: 4)")
    parser.add_argument("--steps", type=int, default=150, help="good-edge steps per phase (default: 150)")
    parser.add_argument("--rounds", type=int, default=50,
                        help="at most this many passes over the attack list per client (default: 50)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="splitft-hostile-") as tmp:
        proc, address = _start_cloud(Path(tmp))
        try:
            alone = good_edge(address, args.steps, seed=0)
            baseline = _memory(proc.pid, "VmHWM")  # the process with torch loaded and one session served
            attacks = _attacks()
            stop, lock, codes = threading.Event(), threading.Lock(), collections.Counter()
            threads = [threading.Thread(target=hostile_client, args=(address, attacks, stop, codes, lock, args.rounds),
                                        daemon=True) for _ in range(args.hostile)]
            for t in threads:
                t.start()
            time.sleep(0.5)  # let the attack get going
            attacked = good_edge(address, args.steps, seed=1)
            stop.set()
            for t in threads:
                t.join(timeout=30)
            peak = _memory(proc.pid, "VmHWM")
            alive = proc.poll() is None
            folder = Path(tmp) / "ck"
            checkpoint_bytes = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) if folder.exists() else 0
        finally:
            proc.kill()
            proc.wait(timeout=10)

    total_mb = float(BUDGETS["--memory-mb"])
    result = {
        "hostile_clients": args.hostile,
        "steps": args.steps,
        "alone_p50_ms": 1e3 * statistics.median(alone), "alone_p95_ms": 1e3 * _pct(alone, 95),
        "attacked_p50_ms": 1e3 * statistics.median(attacked), "attacked_p95_ms": 1e3 * _pct(attacked, 95),
        "attacked_max_ms": 1e3 * max(attacked),
        "cloud_baseline_rss_mb": baseline / 2**20, "cloud_peak_rss_mb": peak / 2**20,
        "cloud_memory_budget_mb": total_mb, "cloud_alive": alive, "replies": dict(sorted(codes.items())),
        "file_path_attack_wrote_file": Path("/tmp/splitft-hostile.npy").exists(),
        "checkpoint_folder_mb": checkpoint_bytes / 2**20,
    }
    print(f"good edge, {args.steps} steps: alone p50 {result['alone_p50_ms']:.1f} ms, p95 {result['alone_p95_ms']:.1f} ms")
    print(f"under {args.hostile} hostile clients: p50 {result['attacked_p50_ms']:.1f} ms "
          f"({result['attacked_p50_ms'] / result['alone_p50_ms']:.2f}x), p95 {result['attacked_p95_ms']:.1f} ms "
          f"({result['attacked_p95_ms'] / result['alone_p95_ms']:.2f}x), worst {result['attacked_max_ms']:.0f} ms")
    print(f"cloud resident memory: {result['cloud_baseline_rss_mb']:.0f} MiB before the attack, peak "
          f"{result['cloud_peak_rss_mb']:.0f} MiB during it (+{(peak - baseline) / 2**20:.0f} MiB; the sessions' "
          f"budget is {total_mb:.0f} MiB); still serving: {alive}")
    print(f"file written by the path attack: {result['file_path_attack_wrote_file']}; checkpoint folder "
          f"{result['checkpoint_folder_mb']:.1f} MiB (cap {BUDGETS['--checkpoint-max-mb']} MiB)")
    print("what the attackers got back:")
    for key, count in result["replies"].items():
        print(f"  {count:6d}  {key}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
