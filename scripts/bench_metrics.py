"""What `splitft cloud --metrics-port` costs per message the cloud answers.

Two in-process clouds serve the same model, one watched (splitft.cloud.prometheus.Endpoint, as
--metrics-port sets it up), one not; a real edge opens a session on each and trains a step, then
the serving loops stop and this script hands each server the same messages through
``CloudServer.handle`` — the whole per-message path: checks, decode, dispatch, the answer, its
encoding and send — in interleaved blocks, so machine noise hits both alike. A ``ping`` is the
cheapest message there is, so it shows the watch's per-message overhead at its largest share
(the wrapping is the same for every message type). Prints the median nanoseconds per message of
each, and the difference. With ``--steps``, it also trains the digits CNN against two real
``splitft cloud`` processes on loopback, one started with ``--metrics-port``, in alternating
windows, and prints the median step time of each.

    python scripts/bench_metrics.py
    python scripts/bench_metrics.py --blocks 61 --block 4000 --steps 20
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import splitft
from splitft.cloud import CloudServer, serve_in_thread
from splitft.cloud.prometheus import Endpoint
from splitft.options import Faults
from splitft.wire import protocol
from transports import InprocListener

MLP = "tests.models:mlp"


def cloud(watched: bool) -> tuple[CloudServer, bytes, splitft.SplitModel]:
    """A cloud with one trained session, its serving loop stopped (the session kept): the server,
    the session's peer and the edge's model."""
    from tests.models import mlp

    listener = InprocListener()
    server = CloudServer(listener, [MLP])
    if watched:
        Endpoint(0).watch(server)
    thread = serve_in_thread(server)
    model = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect, faults=Faults(heartbeat=0))
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    model.remote_loss(nn.CrossEntropyLoss())(model(torch.randn(16, 12)), torch.randint(0, 3, (16,))).backward()
    opt.step()
    model.sync()
    server.shutdown = lambda reason: None  # type: ignore[method-assign]  # stop serving, keep the session
    server.stop()
    thread.join(10)
    (peer,) = server.sessions
    return server, peer, model


def time_block(server: CloudServer, peer: bytes, frames: list, n: int) -> float:
    handle = server.handle
    start = time.perf_counter_ns()
    for _ in range(n):
        handle(peer, frames)
    return (time.perf_counter_ns() - start) / n


def added_code(n: int) -> tuple[float, float]:
    """The watch's own code per message, alone: a dispatch and a reply through the wrappers
    around handlers that do nothing, against the bare handlers (ns per message, each)."""
    from types import SimpleNamespace

    from splitft.cloud.watch import watch

    def nothing(*_: object) -> None:
        return None

    def bare() -> SimpleNamespace:
        return SimpleNamespace(answers={protocol.Ping: nothing}, send=nothing, _error=nothing, bind=nothing,
                               _forget=nothing, by_id={})

    timed: list[float] = []
    for server in (bare(), bare()):
        if timed:
            watch(server)
        dispatch, send, msg, peer = server.answers[protocol.Ping], server.send, protocol.Ping(), b"peer"
        start = time.perf_counter_ns()
        for _ in range(n):
            dispatch(peer, msg, 0)
            send(peer, [], "pong")
        timed.append((time.perf_counter_ns() - start) / n)
    return timed[0], timed[1]


def cloud_process(folder: str, *extra: str) -> tuple[subprocess.Popen, str]:
    """A real `splitft cloud` on a free loopback port serving the digits CNN, and its address."""
    ready = Path(folder) / f"address-{len(extra)}"
    proc = subprocess.Popen([sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--sessions",
                             "0", "--ready-file", str(ready), *extra], stdin=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=os.environ | {"OMP_NUM_THREADS": "1"})
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("a cloud process did not start")
        time.sleep(0.05)
    return proc, ready.read_text()


def steps(rounds: int, window: int) -> None:
    """Median digits step time against a cloud process without and with --metrics-port."""
    from splitft.app.data import batches, load_digits
    from splitft.app.models import digits_cnn

    data = load_digits()[0]
    with tempfile.TemporaryDirectory() as folder:
        procs = [cloud_process(folder), cloud_process(folder, "--metrics-port", "0")]
        try:
            runs = []
            for _, address in procs:
                model = splitft.split(digits_cnn(), "block3", factory="splitft.app.models:digits_cnn",
                                      connect=address, faults=Faults(heartbeat=0))
                opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))
                runs.append((model, opt, model.remote_loss(nn.CrossEntropyLoss()), []))
            for r in range(rounds + 1):  # the first round warms up, uncounted
                for model, opt, crit, times in runs:
                    for x, y, _ in list(batches(data, 64, shuffle=True, epoch=r))[:window]:
                        start = time.perf_counter()
                        crit(model(x), y).backward()
                        opt.step()
                        opt.zero_grad()
                        if r:
                            times.append(time.perf_counter() - start)
            for model, *_ in runs:
                model.close()
            off, on = (statistics.median(times) * 1e3 for *_, times in runs)
            print(f"digits step (batch 64, identity) against a cloud process, {rounds} alternating windows of "
                  f"{window}: metrics off {off:.2f} ms, on {on:.2f} ms (median; {100 * (on - off) / off:+.1f}%)")
        finally:
            for proc, _ in procs:
                proc.kill()
                proc.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=21, help="interleaved blocks per cloud (default: 21)")
    parser.add_argument("--block", type=int, default=2000, help="messages per block (default: 2000)")
    parser.add_argument("--steps", type=int, default=0, metavar="N",
                        help="also time digits steps against two cloud processes, N per window (default: 0, off)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating step windows per cloud (default: 9)")
    args = parser.parse_args()
    plain, plain_peer, _ = cloud(False)
    watched, watched_peer, _ = cloud(True)
    ping = protocol.encode(protocol.Ping())
    times: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(args.blocks):
        times["off"].append(time_block(plain, plain_peer, ping, args.block))
        times["on"].append(time_block(watched, watched_peer, ping, args.block))
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"ping, {args.blocks} blocks of {args.block} messages each, interleaved (median ns per message):")
    print(f"  metrics off {off:8.0f} ns")
    print(f"  metrics on  {on:8.0f} ns   (+{on - off:.0f} ns, {100 * (on - off) / off:+.1f}%)")
    spread = statistics.quantiles([b - a for a, b in zip(times["off"], times["on"])], n=4)
    print(f"  on - off per block: quartiles {spread[0]:.0f} / {spread[1]:.0f} / {spread[2]:.0f} ns")
    alone = [added_code(args.block * 10) for _ in range(args.blocks)]
    bare, wrapped = statistics.median(a for a, _ in alone), statistics.median(b for _, b in alone)
    print(f"the watch's own code alone (dispatch + reply, median of {args.blocks} runs of {args.block * 10}): "
          f"{bare:.0f} ns bare, {wrapped:.0f} ns watched: +{wrapped - bare:.0f} ns per message")
    if args.steps:
        steps(args.rounds, args.steps)


if __name__ == "__main__":
    main()
