"""A training step under three settings of glibc's allocator, side by side: what the thresholds
that the ``splitft`` commands set (``splitft/app/allocator.py``) cost or save.

  defaults  glibc's own: the heap's free top returned past 128 KiB, an mmap threshold that rises
            to the largest buffer freed so far;
  mmap4     an mmap threshold of 4 MiB and a trim threshold of 64 MiB (what the commands set
            before): every buffer of 4 MiB or more mapped, zeroed and faulted in at each use;
  splitft   what the commands set now (``allocator.tune()``).

Each setting runs in a process of its own (thresholds are per process), one after the other in
alternating rounds, each round a few warm-up steps and then timed ones; per round the CPU time,
wall time and minor page faults per step are read, and their medians and each setting's median
ratio to the defaults (per round) are printed. Workloads are MODEL:BATCH: ``encoder`` is four
transformer layers of width 576 over 256 tokens (the size of SmolLM2-135M's), ``cnn`` the digits
CNN (``splitft.app.models:digits_cnn``); Adam; one torch thread per process unless --threads.

    python scripts/bench_allocator.py                        # encoder:4 encoder:16 cnn:256, 5 rounds
    python scripts/bench_allocator.py encoder:16 --rounds 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

SETTINGS = {
    "defaults": None,
    "mmap4": (4 << 20, 64 << 20),
    "splitft": (),
}

_STEPS = r"""
import json, resource, sys, time
import torch
from splitft.app import allocator
setting, model, batch, steps, threads = json.loads(sys.argv[1])
if setting is not None:
    allocator.tune(*setting)
torch.manual_seed(0)
torch.set_num_threads(threads)
if model == "encoder":
    layer = torch.nn.TransformerEncoderLayer(576, 8, 1536, batch_first=True, dropout=0.0)
    net = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
    x, target = torch.randn(batch, 256, 576), None
else:
    from splitft.app.models import digits_cnn
    net = digits_cnn()
    x, target = torch.randn(batch, 1, 8, 8), torch.randint(0, 10, (batch,))
opt = torch.optim.Adam(net.parameters())

def step():
    out = net(x)
    loss = out.square().mean() if target is None else torch.nn.functional.cross_entropy(out, target)
    opt.zero_grad()
    loss.backward()
    opt.step()

for _ in range(3):
    step()
faults, cpu, wall = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.process_time(), time.perf_counter()
for _ in range(steps):
    step()
print(json.dumps({"cpu": (time.process_time() - cpu) / steps, "wall": (time.perf_counter() - wall) / steps,
                  "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults) / steps}))
"""


def _round(setting: tuple | None, model: str, batch: int, steps: int, threads: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}  # each setting its own
    out = subprocess.run([sys.executable, "-c", _STEPS, json.dumps([setting, model, batch, steps, threads])],
                         env=env, capture_output=True, text=True, timeout=1800, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("workloads", nargs="*", default=["encoder:4", "encoder:16", "cnn:256"],
                        help="MODEL:BATCH, MODEL one of encoder, cnn (default: encoder:4 encoder:16 cnn:256)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds per workload (default: 5)")
    parser.add_argument("--steps", type=int, default=0, help="timed steps per round (default: 5 for encoder, 100 for cnn)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process (default: 1)")
    args = parser.parse_args(argv)
    for spec in args.workloads:
        model, _, batch = spec.partition(":")
        if model not in ("encoder", "cnn") or not batch.isdigit():
            parser.error(f"workload {spec!r}: expected encoder:BATCH or cnn:BATCH")
    print(f"{'workload':>11s} {'setting':>9s} {'cpu ms':>9s} {'wall ms':>9s} {'faults':>9s} "
          f"{'cpu / defaults [range]':>24s}   (medians of {args.rounds} rounds)")
    for spec in args.workloads:
        model, _, batch = spec.partition(":")
        steps = args.steps or (5 if model == "encoder" else 100)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in SETTINGS}
        order = list(SETTINGS)
        for i in range(args.rounds):
            for name in order[i % 3:] + order[:i % 3]:  # each goes first in turn
                runs[name].append(_round(SETTINGS[name], model, int(batch), steps, args.threads))
        for name, rounds in runs.items():
            ratios = [r["cpu"] / d["cpu"] for r, d in zip(rounds, runs["defaults"], strict=True)]
            med = {key: statistics.median(r[key] for r in rounds) for key in ("cpu", "wall", "faults")}
            print(f"{spec:>11s} {name:>9s} {med['cpu'] * 1e3:9.1f} {med['wall'] * 1e3:9.1f} {med['faults']:9.0f} "
                  f"{statistics.median(ratios):>10.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]", flush=True)


if __name__ == "__main__":
    main()
