"""SmolLM2-135M LoRA fine-tuning on BBC News text, split, through each codec: perplexity against bytes.

Every run fine-tunes the same pre-trained model (splitft.app.tasks.smollm: LoRA on both halves,
U-shape, the cloud runs decoder layers 2-27 in a real `splitft cloud` process on 127.0.0.1) on the
same training windows, and reports the held-out perplexity it reached, the wire bytes per
training step each way and the time per step. What crosses the cut is the decoder's hidden
states, tokens x hidden (128 x 576 per window), going to the cloud and coming back: the codec
given is used for both (slots fwd and ret), each with its usual gradient partner (bwd, ret_bwd).
The position ids cross with every call too, uncompressed (side tensors always go through
identity); they are counted in the bytes. The rotary tables do not cross: the task's decoder
layers rebuild them from the position ids (splitft.app.tasks.rotary).

A run is named by its codec spec ('identity', 'fp16', 'fixpoint:bits=8,channel_dim=2',
'lowrank:rank=4', 'acsgd:bits=4,channel_dim=2', a chain such as
'outliers>hadamard>delta>quant:bits=2', ...), or 'local' for one-process training. The spec is
the forward codec of both directions; 'SPEC;grad=GSPEC' names the gradient codec of both
directions too, and 'SPEC;bwd=...;ret=...;ret_bwd=...' any slot. Each training window is seen
`--epochs` times (default 2), so AC-SGD sends the first epoch in full (its warm-up) and 4-bit
deltas after it.

The side tensors are measured once (a forward of the unsplit model, the tensors the cloud's
first layer gets besides the hidden states: the position ids, 1 KiB at 128 tokens), and each run
also reports its bytes with them left out.

    python scripts/bench_smollm.py                          # the default codecs, seeds 0 and 1
    python scripts/bench_smollm.py identity lowrank:rank=1 --seeds 0 --limit 16   # a quick look
    python scripts/bench_smollm.py --from runs.jsonl --plot docs/smollm_frontier.png   # table and plot of saved runs
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
    ratio_up: float  # raw / wire bytes of the activation message to the cloud (hidden states, position ids)
    ratio_down: float  # the same for the trunk's output coming back
    first_loss: float
    last_loss: float
    side_per_step: float = 0.0  # bytes of the side tensors (position ids) in up_per_step


SLOTS = ("fwd", "bwd", "ret", "ret_bwd")


def run_codecs(name: str, seed: int):
    """The Codecs of a run name: 'SPEC' (forward codec of both directions), then ';grad=SPEC'
    (gradient codec of both) or ';slot=SPEC' for any of fwd, bwd, ret, ret_bwd."""
    import splitft

    first, *rest = name.split(";")
    slots: dict[str, str] = {"fwd": first.strip()}
    for item in rest:
        slot, eq, spec = item.partition("=")
        slot = slot.strip()
        if not eq or slot not in (*SLOTS, "grad"):
            raise ValueError(f"run {name!r}: {item!r} is not slot=SPEC (slots: {', '.join(SLOTS)}, grad)")
        for target in (("bwd", "ret_bwd") if slot == "grad" else (slot,)):
            slots[target] = spec.strip()
    return splitft.Codecs(**slots, seed=seed)


def side_bytes(model: torch.nn.Module, train, cut: str, batch_size: int) -> int:
    """Bytes of the tensors the cloud's first layer gets besides the hidden states, per forward
    call: they cross uncompressed (identity) with every call."""
    from splitft.app.data import batches, call

    first_layer = model.get_submodule(cut.partition(":")[0])
    seen: list[int] = []

    def hook(module, args, kwargs):
        tensors = [t for t in list(args[1:]) + [v for k, v in kwargs.items() if k != "hidden_states"]
                   for t in (t if isinstance(t, (tuple, list)) else (t,)) if isinstance(t, torch.Tensor)]
        seen.append(sum(t.numel() * t.element_size() for t in tensors))

    handle = first_layer.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            x, _, _ = next(iter(batches(train, batch_size, shuffle=False)))
            call(model, x)
    finally:
        handle.remove()
    return seen[0]


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def run_one(name: str, seed: int, train, test, args, address: str | None, side: int = 0) -> Result:
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
                           codecs=run_codecs(name, seed), faults=splitft.Faults(timeout=300)) as model:
            optimizer = model.attach(torch.optim.AdamW(_trainable(model), lr=args.lr))
            fit = train_epochs(model, optimizer, train, epochs=args.epochs, batch_size=args.batch_size, seed=seed,
                               pass_ids=True, progress=not args.quiet)
            model.sync()  # the last step's operations cross now, counted with training
            up, down = model.metrics.direction("up").wire, model.metrics.direction("down").wire
            ratio_up = model.metrics.bytes[("up", "activation")].ratio
            ratio_down = model.metrics.bytes[("down", "activation")].ratio
            after = evaluate(model, test, args.batch_size, progress=not args.quiet)
    return Result(name, seed, after.perplexity, after.accuracy, fit.steps, fit.train_seconds / fit.steps,
                  up / fit.steps, down / fit.steps, ratio_up, ratio_down, fit.losses[0], fit.losses[-1],
                  side if name != "local" else 0.0)


def _size(n: float) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _mean(rs: list[Result], field: str) -> float:
    return statistics.mean(getattr(r, field) for r in rs)


def table(results: list[Result]) -> str:
    """Markdown, one row per run, means over its seeds. "Less than identity" compares all bytes
    both ways; "without side tensors" leaves the position ids out of both."""
    runs = list(dict.fromkeys(r.run for r in results))
    base = [r for r in results if r.run == "identity"]
    base_total = _mean(base, "up_per_step") + _mean(base, "down_per_step") if base else None
    base_side = _mean(base, "side_per_step") if base else 0.0
    lines = ["| codec | bytes up / step | bytes down / step | less than identity | without side tensors | "
             "activation raw / wire, up / down | held-out perplexity | step time |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in runs:
        rs = [r for r in results if r.run == run]
        ppl = [r.perplexity for r in rs]
        spread = f" ± {statistics.stdev(ppl):.2f}" if len(ppl) > 1 else ""
        up, down = _mean(rs, "up_per_step"), _mean(rs, "down_per_step")
        total, side = up + down, _mean(rs, "side_per_step")
        ratio = f"{base_total / total:.1f}x" if base_total is not None and total > 0 else "-"
        bare = (f"{(base_total - base_side) / (total - side):.1f}x"
                if base_total is not None and total > side > 0 and base_side > 0 else "-")
        hidden = f"{_mean(rs, 'ratio_up'):.1f}x / {_mean(rs, 'ratio_down'):.1f}x" if total else "-"
        cells = [f"`{run}`" if total else run, _size(up) if total else "-", _size(down) if total else "-", ratio, bare,
                 hidden, f"{statistics.mean(ppl):.2f}{spread}", f"{_mean(rs, 'step_seconds'):.2f} s"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[Result], path: Path) -> None:
    """Bytes per training step (both ways, everything counted) against held-out perplexity, one
    point per run (mean over seeds, the bars their spread), identity's perplexity + 0.5 and + 1.0
    and 10x / 16x fewer bytes than identity drawn as guides."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [run for run in dict.fromkeys(r.run for r in results) if run != "local"]
    base = [r for r in results if r.run == "identity"]
    # chain specs run to a few hundred characters: each point gets a number, keyed under the axes
    key = []
    for number, run in enumerate(runs, 1):
        text = f"{number}: {run} (seeds {', '.join(str(r.seed) for r in results if r.run == run)})"
        key += [("    " if i else "") + text[i:i + 150] for i in range(0, len(text), 150)]
    fig, ax = plt.subplots(figsize=(9, 5.5 + 0.1 * len(key)))
    for number, run in enumerate(runs, 1):
        rs = [r for r in results if r.run == run]
        total = statistics.mean(r.up_per_step + r.down_per_step for r in rs) / 2**10
        ppl = [r.perplexity for r in rs]
        err = statistics.stdev(ppl) if len(ppl) > 1 else 0.0
        ax.errorbar(total, statistics.mean(ppl), yerr=err, fmt="o", ms=4, capsize=2)
        ax.annotate(str(number), (total, statistics.mean(ppl)), fontsize=7, xytext=(3, 2), textcoords="offset points")
    fig.text(0.01, 0.01, "\n".join(key), fontsize=5.5, family="monospace", va="bottom")
    if base:
        ref = statistics.mean(r.perplexity for r in base)
        ref_bytes = statistics.mean(r.up_per_step + r.down_per_step for r in base) / 2**10
        for dy, style in ((0.5, "--"), (1.0, ":")):
            ax.axhline(ref + dy, color="grey", ls=style, lw=0.8, label=f"identity + {dy:g} perplexity")
        for times, style in ((10, "--"), (16, ":")):
            ax.axvline(ref_bytes / times, color="tab:red", ls=style, lw=0.8, label=f"{times}x fewer bytes than identity")
        lowest = min(min(r.perplexity for r in results if r.run == run) for run in runs)
        ax.set_ylim(min(ref - 0.5, lowest - 0.2), ref + 3.0)
    ax.set_xscale("log")
    ax.set_xlabel("KiB per training step, both ways, everything counted")
    ax.set_ylabel("held-out perplexity")
    ax.set_title("SmolLM2-135M LoRA fine-tune through each codec (points off the top are cut)", fontsize=9)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout(rect=(0, 0.1 * len(key) / (5.5 + 0.1 * len(key)) + 0.01, 1, 1))
    fig.savefig(path, dpi=130)


def load_results(paths: list[Path]) -> list[Result]:
    """Results saved with --out (later lines win for the same run and seed)."""
    fields = set(Result.__dataclass_fields__)
    found: dict[tuple[str, int], Result] = {}
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                row = json.loads(line)
                result = Result(**{k: v for k, v in row.items() if k in fields})
                found[(result.run, result.seed)] = result
    return list(found.values())


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
    parser.add_argument("--from", dest="saved", type=Path, nargs="+", default=None,
                        help="print the table of runs saved with --out instead of running any")
    parser.add_argument("--plot", type=Path, default=None, help="draw bytes against perplexity to this image")
    args = parser.parse_args(argv)
    if args.saved:
        results = load_results(args.saved)
        order = args.runs or list(dict.fromkeys(r.run for r in results))
        results = sorted((r for r in results if r.run in order), key=lambda r: (order.index(r.run), r.seed))
        print(table(results))
        if args.plot:
            plot(results, args.plot)
        return 0

    from splitft.app.data import first
    from splitft.app.launch import local_cloud
    from splitft.app.tasks.smollm import CUT, FACTORY, evaluate, load_news, smollm_lora

    args.cut = args.cut or CUT
    runs = args.runs or DEFAULT_RUNS
    for name in runs:
        try:
            if name != "local":
                run_codecs(name, 0)
        except Exception as exc:  # noqa: BLE001 - any refusal of the spec is the user's to read
            parser.error(f"run {name!r}: {exc}")
    train, test = load_news(max_length=args.max_length, eval_windows=args.eval_windows)
    train = first(train, args.limit)
    print(f"SmolLM2-135M + LoRA on BBC News text: {len(train)} training windows x {args.epochs} epochs, "
          f"{len(test)} held-out windows of {args.max_length} tokens, batch {args.batch_size}, AdamW lr {args.lr:g}, "
          f"cut {args.cut}, seeds {args.seeds}, torch threads {torch.get_num_threads()}", flush=True)
    start = time.perf_counter()
    reference = smollm_lora()
    pretrained = evaluate(reference, test, args.batch_size, progress=not args.quiet)
    side = side_bytes(reference, train, args.cut, args.batch_size)
    del reference
    print(f"pre-trained model, held-out perplexity {pretrained.perplexity:.2f} "
          f"(next-token accuracy {pretrained.accuracy:.4f}); side tensors {_size(side)} per call", flush=True)
    results: list[Result] = []
    with local_cloud([FACTORY], sessions=0, quiet=True) as address:
        for name in runs:
            for seed in args.seeds:
                result = run_one(name, seed, train, test, args, address, side)
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
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
