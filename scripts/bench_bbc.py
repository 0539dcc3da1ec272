"""MiniLM fine-tuned on BBC News: local training against split training through several codecs.

Every run trains the same pre-trained all-MiniLM-L6-v2 + linear head (splitft.app.tasks.bbc) on the
same data in the same order, and reports test accuracy, seconds per training epoch and the bytes
that crossed each way. Split runs talk to a real `splitft cloud` process over tcp on 127.0.0.1,
U-shape by default: the cloud runs encoder layers 2-5, the head and the labels stay on the edge.

A run is named on the command line:

  local                  plain PyTorch in this process, the baseline
  SPEC                   split training with codec SPEC both ways ('identity', 'lowrank:rank=4', ...)
  frozen+SPEC            the same with freeze_edge=True: no gradient crosses back to the edge

Codecs this checkout does not have are skipped with a note, so the script runs on any branch.

    python scripts/bench_bbc.py                        # the default set of runs, 1 epoch, 128 tokens
    python scripts/bench_bbc.py local identity --limit 256 --max-length 64     # a quick look
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import nn

DEFAULT_RUNS = ["local", "identity", "frozen+identity", "lowrank:rank=6", "lowrank:rank=1",
                "frozen+lowrank:rank=1"]


@dataclass
class Result:
    run: str
    accuracy: float
    epoch_seconds: float  # training only, mean over epochs (evaluation excluded)
    eval_seconds: float
    final_loss: float
    bytes: dict = field(default_factory=dict)  # training traffic, from the edge's counters


def _train(model, optimizer, train, test, args, *, split_model=None) -> Result:
    from tqdm.auto import tqdm

    from splitft.app.data import batches, call
    from splitft.app.train import accuracy

    criterion = nn.CrossEntropyLoss()
    epoch_times, loss_sum, seen = [], 0.0, 0
    for epoch in range(args.epochs):
        model.train()
        start = time.perf_counter()
        loss_sum, seen = 0.0, 0
        steps = -(-len(train) // args.batch_size)
        bar = tqdm(batches(train, args.batch_size, shuffle=True, seed=args.seed, epoch=epoch), total=steps,
                   desc=f"  epoch {epoch + 1}/{args.epochs}", unit="step", leave=False, dynamic_ncols=True)
        for x, y, _ in bar:
            loss = criterion(call(model, x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loss_sum += float(loss.detach()) * len(y)
            seen += len(y)
            bar.set_postfix(loss=f"{loss_sum / seen:.4f}")
        bar.close()
        epoch_times.append(time.perf_counter() - start)
    traffic = _traffic(split_model.metrics) if split_model is not None else {}
    model.eval()
    start = time.perf_counter()
    acc = accuracy(model, test, batch_size=args.batch_size)
    return Result("", acc, sum(epoch_times) / len(epoch_times), time.perf_counter() - start,
                  loss_sum / max(1, seen), traffic)


def _traffic(metrics) -> dict:
    """Wire and raw bytes per direction and kind, as plain numbers."""
    out = {}
    for (direction, kind), count in sorted(metrics.bytes.items()):
        out[f"{direction}_{kind}"] = {"raw": count.raw, "wire": count.wire, "messages": count.messages}
    return out


def run_local(train, test, args) -> Result:
    from splitft.app.tasks.bbc import minilm_classifier

    torch.manual_seed(args.seed)
    model = minilm_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    return _train(model, optimizer, train, test, args)


def run_split(train, test, args, spec: str, frozen: bool) -> Result:
    import splitft
    from splitft.app.launch import local_cloud
    from splitft.app.tasks.bbc import FACTORY, minilm_classifier

    torch.manual_seed(args.seed)
    with local_cloud([FACTORY]) as address:
        model = splitft.split(minilm_classifier(), args.cut, factory=splitft.Factory(FACTORY, weights="factory"),
                              connect=address, codecs=splitft.Codecs(spec, seed=args.seed), freeze_edge=frozen,
                              faults=splitft.Faults(timeout=300))
        with model:
            optimizer = model.attach(torch.optim.AdamW(model.parameters(), lr=args.lr))
            return _train(model, optimizer, train, test, args, split_model=model)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def table(results: list[Result], epochs: int) -> str:
    """Markdown: accuracy, time, and per-epoch training traffic each way."""
    lines = ["| run | test acc | train s/epoch | up MiB/epoch | down MiB/epoch | activation ratio up / down |"
             " gradient MiB up / down |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        b = r.bytes
        if not b:
            lines.append(f"| {r.run} | {r.accuracy:.4f} | {r.epoch_seconds:.0f} | - | - | - | - |")
            continue

        def get(key: str, what: str) -> float:
            return b.get(key, {}).get(what, 0) / epochs

        up = sum(v["wire"] for k, v in b.items() if k.startswith("up_")) / epochs
        down = sum(v["wire"] for k, v in b.items() if k.startswith("down_")) / epochs
        ratio_up = get("up_activation", "raw") / max(1.0, get("up_activation", "wire"))
        ratio_down = get("down_activation", "raw") / max(1.0, get("down_activation", "wire"))
        lines.append(f"| {r.run} | {r.accuracy:.4f} | {r.epoch_seconds:.0f} | {_mib(up)} | {_mib(down)} | "
                     f"{ratio_up:.1f}x / {ratio_down:.1f}x | {_mib(get('up_gradient', 'wire'))} / "
                     f"{_mib(get('down_gradient', 'wire'))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", default=None,
                        help=f"runs to do, in order (default: {' '.join(DEFAULT_RUNS)})")
    parser.add_argument("--epochs", type=int, default=1, help="training epochs per run (default: 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="articles per step (default: 32)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per article (default: 128)")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: 3e-4)")
    parser.add_argument("--limit", type=int, default=None, help="train on the first N training articles only")
    parser.add_argument("--seed", type=int, default=0, help="data order, head init and codec seed (default: 0)")
    parser.add_argument("--cut", default=None, help="U-shape trunk (default: bert.encoder.layer.2:6)")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per run to this file")
    args = parser.parse_args(argv)

    import compressors
    from splitft.app.data import first
    from splitft.app.tasks.bbc import CUT, load_bbc

    args.cut = args.cut or CUT
    runs = args.runs or DEFAULT_RUNS
    train, test = load_bbc(max_length=args.max_length, seed=0)
    if args.limit:
        train = first(train, args.limit)
    print(f"BBC News: {len(train)} train / {len(test)} test articles, {args.max_length} tokens, batch "
          f"{args.batch_size}, {args.epochs} epoch(s), AdamW lr {args.lr:g}, cut {args.cut}, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    results: list[Result] = []
    for name in runs:
        frozen, _, spec = name.rpartition("+")
        if frozen not in ("", "frozen"):
            parser.error(f"run {name!r}: the only prefix is 'frozen+'")
        if name != "local" and compressors.parse_spec(spec)[0] not in compressors.names():
            print(f"{name}: skipped, this checkout has no codec {compressors.parse_spec(spec)[0]!r} "
                  f"(has: {', '.join(compressors.names())})", flush=True)
            continue
        print(f"{name} ...", flush=True)
        result = run_local(train, test, args) if name == "local" else run_split(train, test, args, spec, bool(frozen))
        result.run = name
        results.append(result)
        print(f"{name}: accuracy {result.accuracy:.4f}, {result.epoch_seconds:.0f} s/epoch, final train loss "
              f"{result.final_loss:.4f}", flush=True)
        if args.out:
            with args.out.open("a", encoding="utf-8") as f:
                f.write(json.dumps(asdict(result) | {"settings": {k: str(v) for k, v in vars(args).items()}}) + "\n")
    print()
    print(table(results, args.epochs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
