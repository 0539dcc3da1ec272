"""AdaSplit on digits: local-loss edges and a selective server, scored under a resource budget.

Each variant trains the digits CNN (cut at ``block3``) with a fresh real ``splitft cloud`` process
on loopback, and is measured by test accuracy, the bytes both ways on the wire, and the cloud
process's CPU seconds (what the server spent: ``/proc``, Linux). The variants:

- ``split``: plain split learning, the cut gradient back to a trainable edge;
- ``local``: a local-loss edge (AdaSplit's client): ``freeze_edge=True`` towards the cloud, its
  half trained through a small head of its own, nothing crossing back but an empty answer;
- ``local, F``: the same with a selective server, ``splitft cloud --train-fraction F``.

The score is the accuracy under a budget (:func:`splitft.app.experiment.budgeted_score`); the
default budget is half the traffic and half the cloud CPU of the ``split`` run.

    nice -n 10 python scripts/bench_adasplit.py
    nice -n 10 python scripts/bench_adasplit.py --epochs 3 --fractions 0.5,0.25 --budget-mb 40 --budget-cpu 20
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

import splitft
from splitft import Faults, Schedule
from splitft.app.data import batches, load_digits
from splitft.app.experiment import budgeted_score
from splitft.app.launch import CloudStartError, start_cloud
from splitft.app.models import digits_cnn

ROOT = Path(__file__).resolve().parent.parent
FACTORY, CUT = "splitft.app.models:digits_cnn", "block3"


def cloud(extra: list[str]) -> tuple[subprocess.Popen, str]:
    ready = Path(tempfile.mkdtemp(prefix="splitft-adasplit-")) / "address"
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        return start_cloud([FACTORY], ready, flags=extra, sessions=0, start_timeout=120, quiet=True, env=env)
    except CloudStartError as exc:
        raise SystemExit(str(exc)) from None


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def train(address: str, local: bool, args: argparse.Namespace) -> tuple[float, float]:
    """One run; returns (test accuracy, MB on the wire both ways)."""
    train_split, test = load_digits()
    torch.manual_seed(0)
    head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 8 * 8, 10))  # the local loss's head, on the edge
    model = splitft.split(digits_cnn(), CUT, factory=FACTORY, connect=address, freeze_edge=local,
                          schedule=Schedule(eager_backward=not local), faults=Faults(timeout=60))
    seen: dict[str, torch.Tensor] = {}
    model.model.block2.register_forward_hook(lambda mod, inputs, out: seen.__setitem__("act", out))
    with model:
        params = [*model.parameters(), *(head.parameters() if local else [])]
        opt = model.attach(torch.optim.Adam(params, lr=args.lr))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for epoch in range(args.epochs):
            for x, y, _ in batches(train_split, args.batch, shuffle=True, seed=1, epoch=epoch):
                loss = crit(model(x), y)
                if local:
                    torch.autograd.backward([loss, nn.functional.cross_entropy(head(seen["act"]), y)])
                else:
                    loss.backward()
                opt.step()
                opt.zero_grad()
        model.eval()
        with torch.no_grad():
            accuracy = float((model.predict(test.tensor()).argmax(dim=1) == test.y).float().mean())
        metrics = model.session.metrics
        mbytes = (metrics.direction("up").wire + metrics.direction("down").wire) / 1e6
    return accuracy, mbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fractions", default="0.5,0.25", help="the selective server's train fractions")
    parser.add_argument("--budget-mb", type=float, default=None, help="default: half the split run's traffic")
    parser.add_argument("--budget-cpu", type=float, default=None, help="default: half the split run's cloud CPU s")
    args = parser.parse_args()
    torch.set_num_threads(1)
    variants = [("split", False, 1.0), ("local", True, 1.0)]
    variants += [(f"local, F={f}", True, float(f)) for f in args.fractions.split(",") if f.strip()]
    rows = []
    for name, local, fraction in variants:
        proc, address = cloud(["--train-fraction", str(fraction)] if fraction < 1 else [])
        try:
            before = cpu_seconds(proc.pid)
            start = time.monotonic()
            accuracy, mbytes = train(address, local, args)
            rows.append((name, accuracy, mbytes, cpu_seconds(proc.pid) - before, time.monotonic() - start))
        finally:
            proc.terminate()
            proc.wait(timeout=10)
        print(f"{name}: done in {rows[-1][4]:.0f} s", flush=True)
    budget = {"MB": args.budget_mb if args.budget_mb is not None else rows[0][2] / 2,
              "cloud_cpu_s": args.budget_cpu if args.budget_cpu is not None else rows[0][3] / 2}
    print(f"\ndigits CNN, {args.epochs} epochs, batch {args.batch}, Adam {args.lr:g}; budget {budget['MB']:.1f} MB "
          f"and {budget['cloud_cpu_s']:.1f} cloud CPU s")
    print(f"{'variant':<16}{'accuracy':>10}{'MB moved':>10}{'cloud CPU s':>13}{'wall s':>8}{'score':>8}")
    for name, accuracy, mbytes, cpu, wall in rows:
        score = budgeted_score(accuracy, {"MB": mbytes, "cloud_cpu_s": cpu}, budget)
        print(f"{name:<16}{accuracy:>10.4f}{mbytes:>10.1f}{cpu:>13.1f}{wall:>8.0f}{score:>8.4f}")


if __name__ == "__main__":
    main()
