"""One edge's heavy half on 1 cloud process vs its batch split over N ranks (``--split-batch``).

Starts a plain 1-process cloud and an N-rank ``--split-batch`` cloud (real processes, a gloo
group on this machine, one compute thread each), then trains the same edge against each in
turn, interleaved so machine noise hits both alike: an MLP whose cloud half is two ``width`` x
``width`` layers, plain split with the loss in the cloud, identity codec. Prints the median
seconds per training step (forward, backward, optimizer step) of each and the speed-up of the
split cloud against the single process in the same run, and checks both trained the same weights.

    python scripts/bench_split_batch.py                   # 2 ranks, width 2048, batch 512
    python scripts/bench_split_batch.py --ranks 2 --width 1024 --batch 256 --steps 20
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import splitft
from splitft import Factory, Faults

ROOT = Path(__file__).resolve().parent.parent
FACTORY = "tests.models:mlp"


def start_cloud(ranks: int, folder: Path) -> tuple[list[subprocess.Popen], str]:
    """``ranks`` cloud processes (``--split-batch`` when more than one); rank 0's address."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ready = folder / f"ready-{ranks}"
    procs = []
    for rank in range(ranks):
        env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        if ranks > 1:
            env |= {"RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready),
             "--sessions", "0", "--model", FACTORY, *(["--split-batch"] if ranks > 1 else [])],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + 120
    while not (ready.exists() and ready.read_text()):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("a cloud did not start")
        time.sleep(0.05)
    return procs, ready.read_text()


def train(address: str, args: argparse.Namespace) -> tuple[list[float], dict]:
    """Seconds per step, and the cloud half's trained weights."""
    from tests.models import mlp

    model = splitft.split(mlp(width=args.width), 2, factory=Factory(FACTORY, kwargs={"width": args.width}),
                          connect=address, faults=Faults(timeout=300))
    g = torch.Generator().manual_seed(0)
    times = []
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.01))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for _ in range(args.steps):
            x = torch.randn(args.batch, 12, generator=g)
            start = time.perf_counter()
            crit(model(x), x[:, :3].argmax(dim=1)).backward()
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - start)
        return times[1:], model.cloud_state_dict()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2, help="runs of each cloud, interleaved")
    args = parser.parse_args()
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        clouds = {n: start_cloud(n, Path(tmp)) for n in (1, args.ranks)}
        try:
            times: dict[int, list[float]] = {1: [], args.ranks: []}
            weights = {}
            for _ in range(args.repeats):
                for n, (_, address) in clouds.items():
                    run, weights[n] = train(address, args)
                    times[n] += run
        finally:
            for procs, _ in clouds.values():
                for p in procs:
                    p.kill()
                    p.wait(timeout=10)
    same = all(torch.allclose(weights[1][k], weights[args.ranks][k], rtol=1e-4, atol=1e-6) for k in weights[1])
    one, split = statistics.median(times[1]), statistics.median(times[args.ranks])
    print(f"cloud half 2 x {args.width}x{args.width} (+ head), batch {args.batch}, {len(times[1])} steps each")
    print(f"1 process:             {one * 1e3:8.1f} ms/step")
    print(f"{args.ranks} ranks --split-batch: {split * 1e3:8.1f} ms/step   {one / split:.2f}x faster")
    print(f"same trained weights: {same}")


if __name__ == "__main__":
    main()
