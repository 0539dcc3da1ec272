"""SGLR against the plain shared half: many edges on non-IID digits shards, accuracy per round.

One real ``splitft cloud --shared-model --sync-rounds N`` process per variant serves N edges
(threads of this process, each with its own socket and its own non-IID shard of the digits: the
training set sorted by label and cut into 2N shards, two per edge, so an edge sees about two
classes). Every round each edge trains one batch; the shared half takes one step on the mean of
the edges' gradients. The variants:

- ``plain``: the shared half in rounds, each edge gets its own cut gradient back;
- ``avg-cut``: ``--average-cut-grads``, each edge gets the round's mean cut gradient;
- ``sglr``: ``--average-cut-grads --server-lr`` (the half at the server's rate, the edges at theirs).

Accuracy is every edge's whole model (its own edge half, the shared cloud half) on the held-out
test digits, averaged over the edges, after the rounds given. The table prints at the end.

    nice -n 10 python scripts/bench_sglr.py                  # 16 edges, 60 rounds
    nice -n 10 python scripts/bench_sglr.py --edges 8 --rounds 30 --server-lr 0.2
"""

from __future__ import annotations

import argparse
import os
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

import splitft
from splitft import Faults
from splitft.app.data import Split, load_digits
from splitft.app.launch import CloudStartError, start_cloud
from splitft.app.models import digits_cnn

ROOT = Path(__file__).resolve().parent.parent
FACTORY, CUT = "splitft.app.models:digits_cnn", "block3"


def shards(train: Split, edges: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Non-IID shards: the training set sorted by label, cut in 2*edges pieces, two random pieces per edge."""
    order = torch.argsort(train.y, stable=True)
    pieces = torch.chunk(order, 2 * edges)
    pick = torch.randperm(2 * edges, generator=torch.Generator().manual_seed(seed))
    out = []
    for e in range(edges):
        idx = torch.cat([pieces[int(pick[2 * e])], pieces[int(pick[2 * e + 1])]])
        out.append((train.tensor()[idx], train.y[idx]))
    return out


def cloud(edges: int, lr: float, extra: list[str], timeout: float) -> tuple[subprocess.Popen, str]:
    """A real cloud process serving the shared half in rounds of ``edges``."""
    ready = Path(tempfile.mkdtemp(prefix="splitft-sglr-")) / "address"
    flags = ["--shared-model", "--sync-rounds", str(edges), "--round-timeout", str(timeout),
             "--shared-optimizer", f'SGD:{{"lr": {lr}, "momentum": 0.9}}', *extra]
    env = os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    try:
        return start_cloud([FACTORY], ready, flags=flags, sessions=0, start_timeout=120, quiet=True, env=env)
    except CloudStartError as exc:
        raise SystemExit(str(exc)) from None


def edge(address: str, data: tuple[torch.Tensor, torch.Tensor], args: argparse.Namespace, seed: int,
         marks: set[int], out: dict, errors: list) -> None:
    """One edge: a batch per round, its edge half (and the shared half, edge 0 only) kept at each mark."""
    try:
        model = splitft.split(digits_cnn(), CUT, factory=FACTORY, connect=address,
                              faults=Faults(timeout=args.round_timeout * 3))
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=args.client_lr, momentum=0.9))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        x, y = data
        g = torch.Generator().manual_seed(seed)
        kept: dict[int, dict] = {}
        for r in range(1, args.rounds + 1):
            idx = torch.randint(len(y), (args.batch,), generator=g)
            crit(model(x[idx]), y[idx]).backward()
            opt.step()
            opt.zero_grad()
            if r in marks:
                kept[r] = {"edge": {k: v.clone() for k, v in model.edge_state_dict().items()},
                           "cloud": model.cloud_state_dict() if seed == 0 else None}
        out[seed] = kept
        model.close()
    except BaseException as exc:  # noqa: BLE001 — reported by the caller
        errors.append(exc)


def accuracy(edge_state: dict, cloud_state: dict, test: Split) -> float:
    net = digits_cnn()
    net.load_state_dict({**edge_state, **cloud_state})
    net.eval()
    with torch.no_grad():
        return float((net(test.tensor()).argmax(dim=1) == test.y).float().mean())


def variant(name: str, extra: list[str], server_lr: float, data: list, test: Split, args: argparse.Namespace,
            marks: set[int]) -> dict[int, float]:
    proc, address = cloud(args.edges, server_lr, extra, args.round_timeout)
    out: dict = {}
    errors: list = []
    start = time.monotonic()
    try:
        threads = [threading.Thread(target=edge, args=(address, data[e], args, e, marks, out, errors), daemon=True)
                   for e in range(args.edges)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=args.rounds * args.round_timeout)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    if errors or len(out) != args.edges:
        raise SystemExit(f"{name}: {errors[0] if errors else 'an edge did not finish'}")
    acc = {r: sum(accuracy(out[e][r]["edge"], out[0][r]["cloud"], test) for e in range(args.edges)) / args.edges
           for r in sorted(marks)}
    print(f"{name}: {args.rounds} rounds of {args.edges} edges in {time.monotonic() - start:.0f} s", flush=True)
    return acc


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--edges", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--client-lr", type=float, default=0.02)
    parser.add_argument("--server-lr", type=float, default=0.08, help="the sglr variant's half rate")
    parser.add_argument("--every", type=int, default=10, help="rounds between accuracy marks")
    parser.add_argument("--round-timeout", type=float, default=60.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    train, test = load_digits()
    data = shards(train, args.edges)
    marks = set(range(args.every, args.rounds + 1, args.every)) | {args.rounds}
    lr = args.client_lr
    runs = {"plain": variant("plain", [], lr, data, test, args, marks),
            "avg-cut": variant("avg-cut", ["--average-cut-grads"], lr, data, test, args, marks),
            f"sglr (server lr {args.server_lr:g})": variant(
                "sglr", ["--average-cut-grads", "--server-lr", str(args.server_lr)], lr, data, test, args, marks)}
    print(f"\nmean test accuracy of the {args.edges} edges' models (non-IID digits, 2 label shards per edge, "
          f"batch {args.batch}, client lr {lr:g})")
    print(f"{'round':>6} " + " ".join(f"{name:>22}" for name in runs))
    for r in sorted(marks):
        print(f"{r:>6} " + " ".join(f"{acc[r]:>22.3f}" for acc in runs.values()))


if __name__ == "__main__":
    main()
