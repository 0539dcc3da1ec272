"""The cloud half on a GPU against the same half on the CPU, and how many edges one GPU serves.

For each task (MiniLM on BBC News, the SmolLM2 LoRA task), one short training run against a
real `splitft cloud` process with ``--device cpu`` and one with ``--device cuda``; the edge runs
on the CPU in this process, as it would on a device. Each run makes two passes over its samples
and times the second: the first pays for CUDA's context, cuDNN's first choices and the cloud's
first session, which would otherwise swamp a short run. Printed per run: seconds per step (the
second pass), the cloud's compute and the codecs' time per step (the edge's counters, both
passes), bytes each way (both passes and the evaluations), and the CPU/GPU ratio of step times.
Then, with the cloud on the GPU, 1, 2, 4, ... edge processes (one torch thread each) connect,
wait until all have, and train at once, until the median step time is twice the single edge's:
how many concurrent edges one GPU serves before its step time doubles.

Without a CUDA GPU it says so and exits with status 0. A task whose extras or data are missing
is skipped with a note.

    python scripts/bench_gpu.py                          # both tasks, 64 samples, lowrank:rank=6
    python scripts/bench_gpu.py --tasks bbc --limit 256 --codec identity --max-edges 32
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Row:
    task: str
    device: str
    step_seconds: float
    cloud_seconds: float  # per step, as the edge saw it (the cloud's compute)
    codec_seconds: float  # per step, encode + decode on the edge
    bytes_up: int
    bytes_down: int


def _task_run(task: str, args: argparse.Namespace, limit: int | None = None):
    """Two passes over the data: the first warms up (CUDA's context, cuDNN's and the allocator's
    first calls, the cloud's first session), the second is timed (see :func:`_steady_step`)."""
    from splitft.options import Codecs
    from splitft.app.runner import TaskRun

    return TaskRun(task=task, epochs=2, limit=limit or args.limit, batch_size=args.batch_size,
                   codecs=Codecs(args.codec, seed=0), seed=0)


def _train_seconds(result: Any) -> float:
    return result.history[-1].get("train_seconds", result.seconds) if result.history else result.seconds


def _steady_step(result: Any) -> float:
    """Seconds per step of the last pass. A task whose trainer keeps no per-pass times is timed
    over the whole run, first steps included."""
    history = result.history
    if len(history) >= 2 and "train_seconds" in history[-2]:
        return (history[-1]["train_seconds"] - history[-2]["train_seconds"]) / (result.steps / len(history))
    return _train_seconds(result) / max(result.steps, 1)


def _one(task: str, device: str, args: argparse.Namespace) -> Row:
    from splitft.app.launch import local_cloud
    from splitft.app.runner import run
    from splitft.app.tasks import get_task

    with local_cloud([get_task(task).model], device=device, quiet=True) as address:
        result = run(_task_run(task, args), address)
    steps = max(result.steps, 1)
    parts = result.metrics.breakdown(_train_seconds(result))  # the whole run's counters, both passes
    return Row(task, device, _steady_step(result), parts["cloud_compute"] / steps,
               (parts["edge_codec"] + parts["cloud_codec"]) / steps, result.bytes_up, result.bytes_down)


def _edge_process(task: str, args: argparse.Namespace, address: str, out: mp.Queue, start: Any) -> None:
    """One edge: load and connect, wait until every edge has, then train; reports its timed
    pass's seconds per step."""
    from splitft.app.runner import prepare, train

    torch.set_num_threads(1)
    prepared = prepare(_task_run(task, args, limit=args.edge_steps * (args.batch_size or 8)), address)
    start.wait(timeout=600)
    out.put(_steady_step(train(prepared)))


def _concurrent(task: str, edges: int, args: argparse.Namespace) -> float:
    """Median step time of ``edges`` edge processes training at once against one GPU cloud."""
    from splitft.app.launch import local_cloud
    from splitft.app.tasks import get_task

    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start = ctx.Barrier(edges)
    with local_cloud([get_task(task).model], device=args.device, sessions=edges, quiet=True) as address:
        procs = [ctx.Process(target=_edge_process, args=(task, args, address, out, start)) for _ in range(edges)]
        for p in procs:
            p.start()
        times = [out.get(timeout=1800) for _ in procs]
        for p in procs:
            p.join(timeout=60)
    return statistics.median(times)


def _available(task: str) -> str | None:
    """Why ``task`` cannot run here (None: it can)."""
    try:
        from splitft.app.tasks import get_task

        get_task(task).load()
    except Exception as exc:  # noqa: BLE001 — any missing extra or data set is reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=["bbc", "smollm"], help="tasks to run (default: bbc smollm)")
    parser.add_argument("--codec", default="lowrank:rank=6", help="codec both ways (default: lowrank:rank=6)")
    parser.add_argument("--limit", type=int, default=64, help="training samples per run (default: 64)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per step (default: the task's)")
    parser.add_argument("--max-edges", type=int, default=16, help="most concurrent edges to try (default: 16)")
    parser.add_argument("--edge-steps", type=int, default=8, help="steps per concurrent edge (default: 8)")
    parser.add_argument("--device", default="cuda",
                        help="the accelerator compared with the CPU (default: cuda; 'cpu' runs every step of the "
                             "benchmark without one, as a check of the script)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("bench_gpu: torch sees no CUDA GPU on this machine; nothing to compare (the cloud half on a GPU "
              "against the CPU). Run it where `python -c 'import torch; print(torch.cuda.is_available())'` "
              "prints True.")
        return 0
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else args.device
    print(f"accelerator: {name}; torch {torch.__version__}; codec {args.codec}")
    for task in args.tasks:
        why = _available(task)
        if why is not None:
            print(f"{task}: skipped ({why})")
            continue
        rows = [_one(task, device, args) for device in ("cpu", args.device)]
        print(f"\n{task}: {'cloud':6s} {'s/step':>8s} {'cloud s/step':>13s} {'codec s/step':>13s} "
              f"{'MB up':>8s} {'MB down':>8s}")
        for r in rows:
            print(f"{'':{len(task)}s}  {r.device:6s} {r.step_seconds:8.3f} {r.cloud_seconds:13.3f} "
                  f"{r.codec_seconds:13.4f} {r.bytes_up / 1e6:8.2f} {r.bytes_down / 1e6:8.2f}")
        print(f"{'':{len(task)}s}  step time cpu / {args.device}: {rows[0].step_seconds / rows[1].step_seconds:.2f}x")
        base, edges, served = None, 1, 1
        while edges <= args.max_edges:
            median = _concurrent(task, edges, args)
            base = base or median
            print(f"{'':{len(task)}s}  {edges:3d} concurrent edge(s): median {median:.3f} s/step "
                  f"({median / base:.2f}x one edge)")
            if median > 2 * base:
                break
            served, edges = edges, edges * 2
        print(f"{'':{len(task)}s}  a cloud on {name} serves {served} concurrent edge(s) before its step time "
              f"doubles{'' if median > 2 * base else ' (or more: --max-edges reached)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
