"""The pause of a live session moving between two independent clouds (FedFly), and its cost.

Two real ``splitft cloud`` processes on loopback (no shared folder). The digits CNN trains with
Adam on cloud A; every ``--every`` steps the edge moves its session to the other cloud
(``model.move_to``), back and forth. Printed: the state that travels, the median and worst time
of the move itself (leave to welcome) and of the pause (leaving one cloud to the end of the first
step on the other), against the median step that did not move; and whether the final weights
equal, bitwise, those of the same run that never moved.

    nice -n 10 python scripts/bench_move.py
    nice -n 10 python scripts/bench_move.py --steps 60 --every 10 --link 100mbit,20ms
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

import splitft
from splitft import Faults, Link
from splitft.app.data import load_digits
from splitft.app.models import digits_cnn

ROOT = Path(__file__).resolve().parent.parent
FACTORY, CUT = "splitft.app.models:digits_cnn", "block3"


@contextlib.contextmanager
def clouds(n: int) -> Iterator[list[str]]:
    """``n`` independent cloud processes, each with its own (no) storage; their addresses."""
    tmp = Path(tempfile.mkdtemp(prefix="splitft-move-"))
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs, readies = [], []
    for i in range(n):
        ready = tmp / f"address-{i}"
        procs.append(subprocess.Popen([sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0",
                                       "--ready-file", str(ready), "--sessions", "0", "--model", FACTORY],
                                      cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        readies.append(ready)
    try:
        deadline = time.monotonic() + 120
        while not all(r.exists() and r.read_text() for r in readies):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise SystemExit("a cloud process did not start")
            time.sleep(0.05)
        yield [r.read_text() for r in readies]
    finally:
        for p in procs:
            p.terminate()
            p.wait(timeout=10)


def run(addresses: list[str], args: argparse.Namespace, move: bool) -> dict:
    """Train ``args.steps`` steps; with ``move``, hop to the other cloud every ``args.every`` steps."""
    train, _ = load_digits()
    x_all, y_all = train.tensor(), train.y
    g = torch.Generator().manual_seed(0)
    connect = Link(addresses[0], emulate=args.link) if args.link else addresses[0]
    model = splitft.split(digits_cnn(), CUT, factory=FACTORY, connect=connect, faults=Faults(timeout=60))
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    steps, moves, pauses = [], [], []
    sent = 0
    here, left_at = 0, None
    try:
        for step in range(1, args.steps + 1):
            idx = torch.randint(len(y_all), (args.batch,), generator=g)
            start = time.perf_counter()
            crit(model(x_all[idx]), y_all[idx]).backward()
            opt.step()
            opt.zero_grad()
            done = time.perf_counter()
            if left_at is not None:
                pauses.append(done - left_at)
                left_at = None
            else:
                steps.append(done - start)
            if move and step % args.every == 0 and step < args.steps:
                here = 1 - here
                up = model.session.metrics.direction("up").wire
                left_at = time.perf_counter()
                model.move_to(addresses[here])
                moves.append(time.perf_counter() - left_at)
                sent = model.session.metrics.direction("up").wire - up  # the sync, the leave and the arrive
        cloud = model.cloud_state_dict()
        return {"edge": model.edge_state_dict(), "cloud": cloud, "steps": steps, "moves": moves, "pauses": pauses,
                "weights": sum(t.numel() * t.element_size() for t in cloud.values()), "sent": sent}
    finally:
        model.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--link", default=None, metavar="RATE,DELAY",
                        help="emulate the edge's link to both clouds, e.g. 100mbit,20ms (default: loopback)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with clouds(2) as addresses:
        still = run(addresses, args, move=False)
        moved = run(addresses, args, move=True)
    same = all(torch.equal(moved[k][n], still[k][n]) for k in ("edge", "cloud") for n in still[k])
    ms = lambda xs, f: f"{f(xs) * 1e3:.1f} ms"  # noqa: E731
    print(f"digits CNN, Adam, batch {args.batch}, {args.steps} steps, a move every {args.every} "
          f"({len(moved['moves'])} moves between two cloud processes, link {args.link or 'loopback'})")
    print(f"cloud half's weights {still['weights'] / 1e3:.0f} kB; a move sends {moved['sent'] / 1e3:.0f} kB up "
          "(weights, Adam's moments, gradients, codec and generator state, the hello)")
    print(f"{'':<34}{'median':>12}{'worst':>12}")
    for name, xs in (("a step (not moving)", moved["steps"]), ("the move (leave to welcome)", moved["moves"]),
                     ("the pause (leave to first step)", moved["pauses"])):
        print(f"{name:<34}{ms(xs, statistics.median):>12}{ms(xs, max):>12}")
    print(f"final weights equal the unmoved run's, bitwise: {same}")


if __name__ == "__main__":
    main()
