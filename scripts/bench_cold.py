"""What an operation costs where a split step runs it: right after the reply, between computations.

A training step's own work (encode, decode, checks, bookkeeping) runs between two halves of
computation, after a wait: the edge waits for the cloud, the cloud for the edge. Its first run of
each kind of operation then costs many times what the same operation costs again, warm, in a loop
of its own, which is why a step's overhead is counted in the kinds of code it runs more than in
its calls. This shows it on the digits CNN (cut at block3, Adam, the loss in the cloud) in two
edges: the raw pyzmq floor's (``scripts/bench_peers.py``'s "raw") and splitft's. Right after each
reply arrives, it times a few probes once each:

  empty      ``torch.empty(())``: a kind of operation both steps run anyway
  equal      ``torch.equal`` on two small tensors: a kind neither step runs
  equal 2nd  the same, right after: now warm
  python     a small pure-Python function neither step calls

and prints each probe's median over the steps (us), its median in a loop of its own (warm), and
the ratio. The probes add their own cost to the step; the step itself is not timed here.

    python scripts/bench_cold.py                 # batch 64, 300 steps each
    python scripts/bench_cold.py --batch 8 --steps 500
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def _python_probe(n: int = 8) -> int:
    total = 0
    for i in range(n):
        total += i * i
    return total


def probes() -> list[tuple[str, Callable[[], Any]]]:
    import torch

    a, b = torch.zeros(4), torch.zeros(4)
    return [("empty", lambda: torch.empty(())), ("equal", lambda: torch.equal(a, b)),
            ("equal 2nd", lambda: torch.equal(a, b)), ("python", _python_probe)]


class Timer:
    """Each probe once, timed, at every call (after a reply)."""

    def __init__(self) -> None:
        self.probes = probes()
        self.times: dict[str, list[float]] = {name: [] for name, _ in self.probes}
        self.on = False

    def __call__(self) -> None:
        if not self.on:
            return
        for name, probe in self.probes:
            start = time.perf_counter_ns()
            probe()
            self.times[name].append((time.perf_counter_ns() - start) / 1e3)

    def medians(self) -> dict[str, float]:
        return {name: statistics.median(values) for name, values in self.times.items()}


def warm() -> dict[str, float]:
    """Each probe's median in a loop of its own."""
    found = {}
    for name, probe in probes():
        for _ in range(200):
            probe()
        values = []
        for _ in range(2000):
            start = time.perf_counter_ns()
            probe()
            values.append((time.perf_counter_ns() - start) / 1e3)
        found[name] = statistics.median(values)
    return found


def raw_edge(w: dict[str, Any], steps: int) -> dict[str, float]:
    """The floor's edge step, the probes right after its reply."""
    import torch
    from peer_variants import RawRun, batch_of, raw_peer

    mine, theirs = mp.Pipe()
    peer = mp.get_context("spawn").Process(target=raw_peer, args=(theirs, 1), daemon=True)
    peer.start()
    try:
        if not mine.poll(120):
            raise TimeoutError("the raw peer did not start")
        run, timer = RawRun(w, {"address": mine.recv()}), Timer()
        x, y = batch_of(w)

        def step() -> None:
            act = run.edge(x)
            run.sock.send_multipart([act.detach().numpy(), y.numpy()], copy=False)
            grad = torch.frombuffer(run.sock.recv(copy=False).buffer, dtype=torch.float32).view(act.shape)
            timer()
            act.backward(grad)
            run.opt.step()
            run.opt.zero_grad()

        for _ in range(20):
            step()
        timer.on = True
        for _ in range(steps):
            step()
        run.close()
        return timer.medians()
    finally:
        peer.terminate()


def splitft_edge(w: dict[str, Any], steps: int) -> dict[str, float]:
    """splitft's edge step, the probes right after its reply (when the request's await returns)."""
    from peer_variants import CNN, SplitftRun, batch_of

    from splitft.app.launch import local_cloud
    from splitft.edge.requests import EdgeSession

    timer = Timer()
    original = EdgeSession.await_reply

    def await_reply(self: EdgeSession, *args: Any, **kwargs: Any) -> Any:
        reply = original(self, *args, **kwargs)
        timer()
        return reply

    EdgeSession.await_reply = await_reply  # type: ignore[method-assign]
    try:
        with local_cloud([CNN], sessions=1, quiet=True, threads=1) as address:
            run = SplitftRun(w, {"address": address})
            x, y = batch_of(w)
            for _ in range(20):
                run.step(x, y)
            timer.on = True
            for _ in range(steps):
                run.step(x, y)
            run.close()
    finally:
        EdgeSession.await_reply = original  # type: ignore[method-assign]
    return timer.medians()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64, help="batch size of the digits CNN (default: 64)")
    parser.add_argument("--steps", type=int, default=300, help="timed steps per edge (default: 300)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.batch < 1 or args.steps < 1:
        raise SystemExit("--batch and --steps must be at least 1")
    os.environ.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(filter(None, [str(HERE),
                                                                                    os.environ.get("PYTHONPATH")])))
    import torch

    from splitft.app import allocator

    torch.set_num_threads(1)
    allocator.tune()
    from peer_variants import CNN

    w = {"label": f"cnn b{args.batch}", "factory": CNN, "kwargs": {}, "cut": "block3", "batch": args.batch,
         "device": "cpu"}
    print(f"digits CNN, batch {args.batch}, {args.steps} steps per edge; probes timed once right after each reply",
          flush=True)
    loop = warm()
    rows = {"raw edge": raw_edge(w, args.steps), "splitft edge": splitft_edge(w, args.steps)}
    print(f"\n{'probe':10s} {'warm us':>8s}" + "".join(f" {k + ' us':>16s} {'x warm':>7s}" for k in rows))
    for name in loop:
        line = f"{name:10s} {loop[name]:8.2f}"
        for medians in rows.values():
            line += f" {medians[name]:16.2f} {medians[name] / loop[name]:7.1f}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
