"""One edge's heavy half on 1 cloud process vs its batch split over N ranks (``--split-batch``).

Starts a plain 1-process cloud, an N-rank ``--split-batch`` cloud (a replica per rank) and an
N-rank ``--split-batch --shard`` cloud (1/N of the half per rank) — real processes, a gloo group
on this machine, one compute thread each — then trains the same edge against each in turn,
interleaved so machine noise hits all alike: an MLP whose cloud half is two ``width`` x
``width`` layers, plain split with the loss in the cloud, Adam, identity codec. Prints the median
seconds per training step (forward, backward, optimizer step) of each, the speed-up against the
single process in the same run, what each rank says it holds (parameters and Adam's state), and
how far each one's trained weights are from the single process's.

    python scripts/bench_split_batch.py                   # 2 ranks, width 2048, batch 512
    python scripts/bench_split_batch.py --ranks 2 --width 1024 --batch 256 --steps 20
"""

from __future__ import annotations

import argparse
import os
import re
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
HOLDS = re.compile(r"rank (\d+): holds ([\d,]+) of the half's [\d,]+ parameter values \(([\d.]+) MiB\) "
                   r"and ([\d.]+) MiB of optimizer state")


def start_cloud(ranks: int, folder: Path, *flags: str) -> tuple[list[subprocess.Popen], str]:
    """``ranks`` cloud processes (``--split-batch`` and ``flags`` when more than one); rank 0's address.
    Their messages go to ``folder``/log-..., where :func:`held` reads them."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    name = "-".join([str(ranks), *flags])
    ready = folder / f"ready-{name}"
    procs = []
    for rank in range(ranks):
        env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        if ranks > 1:
            env |= {"RANK": str(rank), "WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready),
             "--sessions", "0", "--model", FACTORY, *(["--split-batch", *flags] if ranks > 1 else [])],
            cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=(folder / f"log-{name}-{rank}").open("w"),
            stdin=subprocess.DEVNULL))
    deadline = time.monotonic() + 120
    while not (ready.exists() and ready.read_text()):
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise SystemExit("a cloud did not start")
        time.sleep(0.05)
    return procs, ready.read_text()


def held(folder: Path, ranks: int, *flags: str) -> dict[int, tuple[float, float]]:
    """Per rank: the MiB of parameters and of optimizer state it said it holds (its last session)."""
    name = "-".join([str(ranks), *flags])
    out = {}
    for rank in range(ranks):
        for r, _, params, state in HOLDS.findall((folder / f"log-{name}-{rank}").read_text()):
            out[int(r)] = (float(params), float(state))
    return out


def train(address: str, args: argparse.Namespace) -> tuple[list[float], dict]:
    """Seconds per step, and the cloud half's trained weights."""
    from tests.models import mlp

    model = splitft.split(mlp(width=args.width), 2, factory=Factory(FACTORY, kwargs={"width": args.width}),
                          connect=address, faults=Faults(timeout=300))
    g = torch.Generator().manual_seed(0)
    times = []
    with model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
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
    kinds = {"1 process": (1,), "replicas": (args.ranks,), "shards": (args.ranks, "--shard")}
    with tempfile.TemporaryDirectory() as tmp:
        clouds = {kind: start_cloud(*spec[:1], Path(tmp), *spec[1:]) for kind, spec in kinds.items()}
        try:
            times: dict[str, list[float]] = {kind: [] for kind in kinds}
            weights = {}
            for _ in range(args.repeats):
                for kind, (_, address) in clouds.items():
                    run, weights[kind] = train(address, args)
                    times[kind] += run
            holds = {kind: held(Path(tmp), *spec) for kind, spec in kinds.items() if kind != "1 process"}
        finally:
            for procs, _ in clouds.values():
                for p in procs:
                    p.kill()
                    p.wait(timeout=10)
    one = weights["1 process"]
    apart = {kind: max(float((w[k] - one[k]).abs().max()) for k in one) for kind, w in weights.items()}
    base = statistics.median(times["1 process"])
    print(f"cloud half 2 x {args.width}x{args.width} (+ head), batch {args.batch}, Adam, "
          f"{len(times['1 process'])} steps each")
    print(f"1 process:                     {base * 1e3:8.1f} ms/step")
    for kind, label in (("replicas", "--split-batch"), ("shards", "--split-batch --shard")):
        t = statistics.median(times[kind])
        print(f"{args.ranks} ranks {label:22s} {t * 1e3:8.1f} ms/step   {base / t:.2f}x faster")
    for kind in ("replicas", "shards"):
        per_rank = ", ".join(f"rank {r}: {p:.1f} + {o:.1f} MiB" for r, (p, o) in sorted(holds[kind].items()))
        print(f"parameters + optimizer state per rank, {kind}: {per_rank}")
    print("largest difference of the trained weights from the 1 process's: "
          f"replicas {apart['replicas']:.1e}, shards {apart['shards']:.1e} "
          f"(float sums in another order, grown by Adam's normalisation over {len(times['1 process'])} steps)")


if __name__ == "__main__":
    main()
