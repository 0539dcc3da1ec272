"""SmolLM2-135M LoRA fine-tuning on BBC News text, split, through each codec: perplexity against bytes.

Every run fine-tunes the same pre-trained model (splitft.app.tasks.smollm: LoRA on both halves,
U-shape, the cloud runs decoder layers 2-27 in a real `splitft cloud` process on 127.0.0.1) on the
same training windows, and reports the held-out perplexity it reached, the wire bytes per
training step each way and the time per step. What crosses the cut is the decoder's hidden
states, tokens x hidden (128 x 576 per window), going to the cloud and coming back: the codec
given is used for both (slots fwd and ret), each with its usual gradient partner (bwd, ret_bwd).
The rotary position embeddings and position ids cross with every call too, uncompressed (side
tensors always go through identity); they are counted in the bytes.

A run is named by its codec spec ('identity', 'fp16', 'fixpoint:bits=8,channel_dim=2',
'lowrank:rank=4', 'acsgd:bits=4,channel_dim=2', ...), or 'local' for one-process training. Each
training window is seen `--epochs` times (default 2), so AC-SGD sends the first epoch in full
(its warm-up) and 4-bit deltas after it.

    python scripts/bench_smollm.py                          # the default codecs, seeds 0 and 1
    python scripts/bench_smollm.py identity lowrank:rank=1 --seeds 0 --limit 16   # a quick look
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # edge and cloud share the cores (see splitft.app.cli)

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

# Per hidden channel scales for the quantizers (dim 2 of batch x tokens x hidden): the few hidden
# channels of an LLM that carry large values get scales of their own, as in AC-SGD.
DEFAULT_RUNS = ["local", "identity", "fp16", "fixpoint:bits=8,channel_dim=2", "fixpoint:bits=4,channel_dim=2",
                "lowrank:rank=1", "lowrank:rank=4", "lowrank:rank=16", "acsgd:bits=4,channel_dim=2"]


@dataclass
class Result:
    run: str
    seed: int
    perplexity: float  # held-out, after training
    token_accuracy: float
    steps: int
    step_seconds: float  # training only, mean per step
    up_per_step: float  # wire bytes edge -> cloud per training step (evaluation excluded)
    down_per_step: float
    ratio_up: float  # raw / wire bytes of the activation message to the cloud (hidden states, rotary tables)
    ratio_down: float  # the same for the trunk's output coming back
    first_loss: float
    last_loss: float


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def run_one(name: str, seed: int, train, test, args, address: str | None) -> Result:
    import splitft
    from splitft.app.tasks.smollm import FACTORY, evaluate, smollm_lora, train_epochs

    torch.manual_seed(seed)
    model = smollm_lora(seed=seed)
    if name == "local":
        optimizer = torch.optim.AdamW(_trainable(model), lr=args.lr)
        fit = train_epochs(model, optimizer, train, epochs=args.epochs, batch_size=args.batch_size, seed=seed,
                           progress=not args.quiet)
        up = down = ratio_up = ratio_down = 0.0
        after = evaluate(model, test, args.batch_size, progress=not args.quiet)
    else:
        factory = splitft.Factory(FACTORY, kwargs={"seed": seed}, weights="factory")
        with splitft.split(model, args.cut, factory=factory, connect=address,
                           codecs=splitft.Codecs(name, seed=seed), faults=splitft.Faults(timeout=300)) as model:
            optimizer = model.attach(torch.optim.AdamW(_trainable(model), lr=args.lr))
            fit = train_epochs(model, optimizer, train, epochs=args.epochs, batch_size=args.batch_size, seed=seed,
                               pass_ids=True, progress=not args.quiet)
            model.sync()  # the last step's operations cross now, counted with training
            up, down = model.metrics.direction("up").wire, model.metrics.direction("down").wire
            ratio_up = model.metrics.bytes[("up", "activation")].ratio
            ratio_down = model.metrics.bytes[("down", "activation")].ratio
            after = evaluate(model, test, args.batch_size, progress=not args.quiet)
    return Result(name, seed, after.perplexity, after.accuracy, fit.steps, fit.train_seconds / fit.steps,
                  up / fit.steps, down / fit.steps, ratio_up, ratio_down, fit.losses[0], fit.losses[-1])


def _size(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def table(results: list[Result]) -> str:
    """Markdown, one row per run, means over its seeds."""
    runs = list(dict.fromkeys(r.run for r in results))
    base = [r for r in results if r.run == "identity"]
    base_up = statistics.mean(r.up_per_step for r in base) if base else None
    lines = ["| codec | bytes up / step | bytes down / step | less than identity | activation raw / wire, "
             "up / down | held-out perplexity | step time |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        rs = [r for r in results if r.run == run]
        ppl = [r.perplexity for r in rs]
        spread = f" ± {statistics.stdev(ppl):.2f}" if len(ppl) > 1 else ""
        up, down = statistics.mean(r.up_per_step for r in rs), statistics.mean(r.down_per_step for r in rs)
        total = up + down
        ratio = (f"{(base_up + statistics.mean(r.down_per_step for r in base)) / total:.1f}x"
                 if base_up is not None and total > 0 else "-")
        hidden = (f"{statistics.mean(r.ratio_up for r in rs):.1f}x / {statistics.mean(r.ratio_down for r in rs):.1f}x"
                  if total else "-")
        cells = [run, _size(up) if total else "-", _size(down) if total else "-", ratio, hidden,
                 f"{statistics.mean(ppl):.2f}{spread}", f"{statistics.mean(r.step_seconds for r in rs):.2f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", default=None, help=f"runs, in order (default: {' '.join(DEFAULT_RUNS)})")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1],
                        help="seeds: adapter initialisation, data order, codec randomness (default: 0 1)")
    parser.add_argument("--limit", type=int, default=32, help="training windows (default: 32)")
    parser.add_argument("--epochs", type=int, default=2, help="passes over them (default: 2)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per step (default: 4)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per window (default: 128)")
    parser.add_argument("--eval-windows", type=int, default=32, help="held-out windows (default: 32)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate of the adapters (default: 1e-3)")
    parser.add_argument("--cut", default=None, help="U-shape trunk (default: the task's, layers 2-27 in the cloud)")
    parser.add_argument("--out", type=Path, default=None, help="append one JSON line per run to this file")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)

    import compressors
    from splitft.app.data import first
    from splitft.app.launch import local_cloud
    from splitft.app.tasks.smollm import CUT, FACTORY, evaluate, load_news, smollm_lora

    args.cut = args.cut or CUT
    runs = args.runs or DEFAULT_RUNS
    for name in runs:
        if name != "local" and compressors.parse_spec(name)[0] not in compressors.names():
            parser.error(f"run {name!r}: no codec {compressors.parse_spec(name)[0]!r} "
                         f"(codecs: {', '.join(compressors.names())})")
    train, test = load_news(max_length=args.max_length, eval_windows=args.eval_windows)
    train = first(train, args.limit)
    print(f"SmolLM2-135M + LoRA on BBC News text: {len(train)} training windows x {args.epochs} epochs, "
          f"{len(test)} held-out windows of {args.max_length} tokens, batch {args.batch_size}, AdamW lr {args.lr:g}, "
          f"cut {args.cut}, seeds {args.seeds}, torch threads {torch.get_num_threads()}", flush=True)
    start = time.perf_counter()
    pretrained = evaluate(smollm_lora(), test, args.batch_size, progress=not args.quiet)
    print(f"pre-trained model, held-out perplexity {pretrained.perplexity:.2f} "
          f"(next-token accuracy {pretrained.accuracy:.4f})", flush=True)
    results: list[Result] = []
    with local_cloud([FACTORY], sessions=0, quiet=True) as address:
        for name in runs:
            for seed in args.seeds:
                result = run_one(name, seed, train, test, args, address)
                results.append(result)
                print(f"{name} seed {seed}: perplexity {result.perplexity:.2f}, {result.steps} steps of "
                      f"{result.step_seconds:.2f} s, up {_size(result.up_per_step)} / down "
                      f"{_size(result.down_per_step)} per step, loss {result.first_loss:.3f} -> "
                      f"{result.last_loss:.3f}", flush=True)
                if args.out:
                    with args.out.open("a", encoding="utf-8") as f:
                        f.write(json.dumps(asdict(result) | {"pretrained_perplexity": pretrained.perplexity,
                                                             "settings": {k: str(v) for k, v in vars(args).items()}})
                                + "\n")
    print(f"\n{len(results)} runs in {time.perf_counter() - start:.0f} s; pre-trained perplexity "
          f"{pretrained.perplexity:.2f}\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
