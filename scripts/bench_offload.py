"""The step cost of ``splitft cloud --offload-optimizer`` against a half whose state stays in memory.

A cloud half (an MLP of ``--layers`` square layers of ``--width``, AdamW) trains ``--steps``
steps of a ``--batch`` batch on ``--device``, once with its optimizer state kept where the half
is and once offloaded to the host between steps (:mod:`splitft.cloud.offload`), interleaved so
both see the same machine. Prints each one's median step (forward, backward, optimizer step) and
the ratio. On a CPU-only machine the host is the device, so the ratio is the cost of the copies
alone; on a GPU it adds the PCIe transfers of the state, twice per step.

    python scripts/bench_offload.py                       # CPU
    python scripts/bench_offload.py --device cuda --width 4096 --layers 8
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from splitft.cloud import offload


def half(width: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]).to(device)


def step_seconds(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, moved: bool) -> float:
    start = time.perf_counter()
    opt.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    with offload.stepping(opt, x.device, moved):
        opt.step()
    if x.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    device = torch.device(args.device)
    runs = {}
    for moved in (False, True):
        model = half(args.width, args.layers, device)
        runs[moved] = (model, torch.optim.AdamW(model.parameters(), lr=1e-4))
    x = torch.randn(args.batch, args.width, device=device)
    times: dict[bool, list[float]] = {False: [], True: []}
    for i in range(args.steps + 2):
        for moved in (False, True) if i % 2 else (True, False):
            seconds = step_seconds(*runs[moved], x, moved)
            if i >= 2:  # the first steps build the state
                times[moved].append(seconds)
    params = sum(p.numel() for p in runs[False][0].parameters())
    state = sum(v.nbytes for s in runs[True][1].state.values() for v in s.values())
    plain, moved = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.device}: half of {params / 1e6:.1f} M parameters, AdamW state {state / 2**20:.0f} MiB on the host "
          f"between steps; batch {args.batch}, {args.steps} steps each, interleaved")
    print(f"median step in memory {plain * 1e3:.1f} ms, offloaded {moved * 1e3:.1f} ms, ratio {moved / plain:.3f}")


if __name__ == "__main__":
    main()
