"""Split training step vs local training step: what does the split cost?

The cloud runs as a real ``splitft cloud`` process on tcp loopback; the edge and the local
baseline run in this process. Windows of local and split steps alternate, so noise on this shared
machine hits both alike; medians per step and their ratio are printed for each batch size. Also
prints the round-trip time of an empty request (the per-message overhead of the full path:
protocol encode, ZeroMQ, cloud dispatch, decode).

    python scripts/bench_step.py                       # batch 64 and 256, identity codec
    python scripts/bench_step.py --batch 256 --fwd fp16
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does: the two processes share cores

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

import splitft  # noqa: E402
from splitft.app.models import digits_cnn  # noqa: E402

FACTORY = "splitft.app.models:digits_cnn"


def step_fn(model: nn.Module, opt: torch.optim.Optimizer, crit, x: torch.Tensor, y: torch.Tensor):
    def step() -> None:
        loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def timed(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="batch sizes (default: 64 256)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating windows per side (default: 9)")
    parser.add_argument("--steps", type=int, default=20, help="steps per window (default: 20)")
    parser.add_argument("--fwd", default="identity", help="activation codec (default: identity)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch threads in each process (default: this machine's default)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    from splitft.app.launch import local_cloud

    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the cloud process inherits it
    with local_cloud([FACTORY], sessions=0, exit_timeout=0, quiet=True) as address:
        print(f"cloud at {address}; {args.threads} torch thread(s) per process; codec {args.fwd}")
        print(f"{'batch':>5s} {'local ms':>9s} {'split ms':>9s} {'ratio':>6s}")
        for batch in args.batch:
            x = torch.randn(batch, 1, 8, 8)
            y = torch.randint(0, 10, (batch,))
            local = digits_cnn()
            local_step = step_fn(local, torch.optim.Adam(local.parameters(), 1e-3), nn.CrossEntropyLoss(), x, y)
            split = splitft.split(digits_cnn(), "block3", factory=FACTORY, connect=address, codecs=args.fwd)
            opt = split.attach(torch.optim.Adam(split.parameters(), 1e-3))
            split_step = step_fn(split, opt, split.remote_loss(nn.CrossEntropyLoss()), x, y)
            timed(local_step, 5)
            timed(split_step, 5)
            times: dict[str, list[float]] = {"local": [], "split": []}
            for _ in range(args.rounds):
                times["local"].append(timed(local_step, args.steps))
                times["split"].append(timed(split_step, args.steps))
            med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
            print(f"{batch:5d} {med['local']:9.2f} {med['split']:9.2f} {med['split'] / med['local']:6.2f}x", flush=True)
            rtts = []
            for _ in range(200):
                start = time.perf_counter()
                split.sync()
                rtts.append(time.perf_counter() - start)
            split.close()
        print(f"empty request round trip (full protocol path): median {statistics.median(rtts) * 1e6:.0f} us; "
              "a plain-split step makes one round trip (eager backward), two with eager_backward=False")


if __name__ == "__main__":
    main()
