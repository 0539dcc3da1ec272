"""Which codec wins on a given link? Accuracy, bytes and time-to-accuracy for every codec setting.

Runs the digits task (and MiniLM on BBC News with ``--bbc``) split at its cut, through every codec
setting, on emulated links, several seeds each. The cloud is a real ``splitft cloud`` process on
loopback; the link emulator sits on the edge's connection. Each finished cell is appended to the
CSV at once, so a re-run (after a crash, or with a larger grid) skips the cells already done.

Writes, into ``--out``:
  results.csv    one row per (task, codec, link, micro-batches, seed)
  results.md     accuracy mean ± std, forward/backward ratio, bytes, time to the target
                 accuracy, and speedup against identity on the same link
  accuracy_vs_bytes.png, time_to_accuracy.png   (needs matplotlib: pip install -e '.[plots]')

    python scripts/ablate.py --out docs/ablation                      # the full grid
    python scripts/ablate.py --codecs identity,c3sl:r=16 --links loopback --seeds 1 --epochs 2
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # edge and cloud share this machine's cores

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from collections import defaultdict  # noqa: E402
from pathlib import Path  # noqa: E402

CODECS = ["identity", "fp16", "fixpoint:bits=8", "fixpoint:bits=4", "lowrank:rank=1", "lowrank:rank=2",
          "lowrank:rank=4", "c3sl:r=2", "c3sl:r=4", "c3sl:r=8", "c3sl:r=16", "binary", "acsgd:bits=4",
          "acsgd:bits=2"]
LINKS = ["loopback", "100mbit,20ms", "10mbit,50ms"]
FIELDS = ["task", "codec", "bwd", "link", "micro_batches", "seed", "epochs", "accuracy", "train_seconds",
          "time_to_target", "fwd_ratio", "bwd_ratio", "bytes_up", "bytes_down", "steps", "history"]
DIGITS_FACTORIES = ["splitft.app.models:digits_cnn", "splitft.app.models:digits_bsl"]


def cell_key(task: str, codec: str, link: str, micro_batches: int, seed: int, epochs: int) -> tuple:
    return task, codec, link, int(micro_batches), int(seed), int(epochs)


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def append_row(path: Path, row: dict) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)
        f.flush()
        os.fsync(f.fileno())


def run_cell(task: str, codec: str, link: str, micro_batches: int, seed: int, epochs: int, target: float,
             address: str, bbc_limit: int | None = None) -> dict:
    from splitft.app.experiment import run_digits, time_to_accuracy

    if task != "digits":
        from splitft.app.experiment import run_bbc  # the transformer task, only with --bbc

        result = run_bbc(codec, seed=seed, epochs=epochs, address=address, limit=bbc_limit,
                         link=None if link == "loopback" else link, micro_batches=micro_batches)
    else:
        result = run_digits(codec, seed=seed, epochs=epochs, address=address,
                            link=None if link == "loopback" else link, micro_batches=micro_batches)
    reached = time_to_accuracy(result.history, target)
    return {
        "task": task, "codec": codec, "bwd": result.bwd, "link": link, "micro_batches": micro_batches,
        "seed": seed, "epochs": epochs, "accuracy": f"{result.accuracy:.4f}",
        "train_seconds": f"{result.history[-1]['train_seconds']:.2f}",
        "time_to_target": "" if reached is None else f"{reached:.2f}",
        "fwd_ratio": f"{result.fwd_ratio:.2f}", "bwd_ratio": f"{result.bwd_ratio:.2f}",
        "bytes_up": result.bytes_up, "bytes_down": result.bytes_down, "steps": result.steps,
        "history": json.dumps(result.history),
    }


def _mean_std(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def summarise(rows: list[dict[str, str]], target: float,
              budget: dict[str, float] | None = None) -> tuple[list[dict], str]:
    """Aggregate seeds per (task, link, micro-batches, codec); markdown table per task and link
    (with ``budget``, a column of each cell's accuracy under it: :func:`budgeted_score`)."""
    from splitft.app.experiment import budgeted_score

    groups: dict[tuple, list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        groups[(row["task"], row["link"], int(row["micro_batches"]), row["codec"])].append(row)
    summary = []
    for (task, link, mb, codec), cell in groups.items():
        reached = [float(r["time_to_target"]) for r in cell if r["time_to_target"]]
        summary.append({
            "task": task, "link": link, "micro_batches": mb, "codec": codec, "bwd": cell[0]["bwd"],
            "seeds": len(cell), "accuracy": [float(r["accuracy"]) for r in cell],
            "fwd_ratio": statistics.mean(float(r["fwd_ratio"]) for r in cell),
            "bwd_ratio": statistics.mean(float(r["bwd_ratio"]) for r in cell),
            "mbytes": statistics.mean((int(r["bytes_up"]) + int(r["bytes_down"])) / 1e6 for r in cell),
            "step_ms": statistics.mean(1e3 * float(r["train_seconds"]) / int(r["steps"]) for r in cell),
            "time_to_target": statistics.median(reached) if len(reached) == len(cell) else None,
            "reached": f"{len(reached)}/{len(cell)}",
            "seconds": statistics.mean(float(r["train_seconds"]) for r in cell),
        })
        if budget:
            s = summary[-1]
            s["score"] = budgeted_score(statistics.mean(s["accuracy"]), {"MB": s["mbytes"], "seconds": s["seconds"]},
                                        budget)
    baseline = {(s["task"], s["link"], s["micro_batches"]): s["time_to_target"]
                for s in summary if s["codec"] == "identity"}
    order = {c: i for i, c in enumerate(CODECS)}
    summary.sort(key=lambda s: (s["task"], LINKS.index(s["link"]) if s["link"] in LINKS else 99,
                                s["micro_batches"], order.get(s["codec"], 99), s["codec"]))
    lines = []
    current = None
    for s in summary:
        head = (s["task"], s["link"], s["micro_batches"])
        if head != current:
            current = head
            mb = "" if s["micro_batches"] == 1 else f", {s['micro_batches']} micro-batches"
            lines += ["", f"### {s['task']} — link {s['link']}{mb}", "",
                      f"| codec | gradient codec | seeds | test accuracy | fwd ratio | bwd ratio | MB moved "
                      f"| ms/step | time to {target:.0%} (s) | speedup vs identity |"
                      + (f" score within {_budget_text(budget)} |" if budget else ""),
                      "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if budget else "")]
        base = baseline.get(head)
        t2t = s["time_to_target"]
        speedup = f"{base / t2t:.2f}x" if base and t2t else "—"
        lines.append(
            f"| {s['codec']} | {s['bwd']} | {s['seeds']} | {_mean_std(s['accuracy'])} | {s['fwd_ratio']:.1f}x | "
            f"{s['bwd_ratio']:.1f}x | {s['mbytes']:.1f} | {s['step_ms']:.1f} | "
            f"{'—' if t2t is None else f'{t2t:.2f}'} ({s['reached']}) | {speedup} |"
            + (f" {s['score']:.4f} |" if budget else ""))
    return summary, "\n".join(lines).lstrip("\n") + "\n"


def parse_budget(text: str | None) -> dict[str, float]:
    """``--budget MB,SECONDS``: the traffic (both directions) and training seconds a run may spend."""
    if not text:
        return {}
    try:
        mb, seconds = (float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"--budget takes MB,SECONDS (e.g. 50,30), got {text!r}") from None
    return {"MB": mb, "seconds": seconds}


def _budget_text(budget: dict[str, float]) -> str:
    return f"{budget['MB']:g} MB, {budget['seconds']:g} s"


def plot(summary: list[dict], out: Path, target: float) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plots (pip install -e '.[plots]')", file=sys.stderr)
        return []
    paths = []
    tasks = sorted({s["task"] for s in summary})
    links = [link for link in LINKS if any(s["link"] == link for s in summary)] or sorted({s["link"] for s in summary})
    fig, axes = plt.subplots(1, len(tasks), figsize=(7 * len(tasks), 5), squeeze=False)
    for ax, task in zip(axes[0], tasks):
        rows = [s for s in summary if s["task"] == task and s["link"] == links[0] and s["micro_batches"] == 1]
        for s in rows:
            ax.errorbar(s["mbytes"], statistics.mean(s["accuracy"]),
                        yerr=statistics.stdev(s["accuracy"]) if len(s["accuracy"]) > 1 else 0, fmt="o")
            ax.annotate(s["codec"], (s["mbytes"], statistics.mean(s["accuracy"])), fontsize=7,
                        xytext=(3, 3), textcoords="offset points")
        ax.set_xscale("log")
        ax.set_xlabel("MB moved per run (both directions, log scale)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{task}: accuracy vs traffic")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(out / "accuracy_vs_bytes.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)

    fig, axes = plt.subplots(1, len(links), figsize=(6 * len(links), 5), squeeze=False)
    for ax, link in zip(axes[0], links):
        rows = [s for s in summary if s["link"] == link and s["task"] == tasks[0]]
        labels = [s["codec"] + ("" if s["micro_batches"] == 1 else f" mb{s['micro_batches']}") for s in rows]
        values = [s["time_to_target"] if s["time_to_target"] is not None else 0.0 for s in rows]
        bars = ax.barh(labels, values, color=["#999" if v == 0 else "#3a7" for v in values])
        for bar, s in zip(bars, rows):
            if s["time_to_target"] is None:
                ax.text(0, bar.get_y() + bar.get_height() / 2, " not reached", va="center", fontsize=7)
        ax.invert_yaxis()
        ax.set_xlabel(f"training seconds to {target:.0%} test accuracy (median over seeds)")
        ax.set_title(f"{tasks[0]} on {link}")
        ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    paths.append(out / "time_to_accuracy.png")
    fig.savefig(paths[-1], dpi=120)
    plt.close(fig)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default="ablation", help="folder for results.csv/.md and plots (default: ablation)")
    parser.add_argument("--codecs", default=",".join(CODECS), help="comma-separated codec specs (default: all)")
    parser.add_argument("--links", default=";".join(LINKS),
                        help="semicolon-separated link specs, 'loopback' for none (default: %(default)s)")
    parser.add_argument("--micro-batches", default="1", help="comma-separated micro-batch counts (default: 1)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per cell for digits (default: 3)")
    parser.add_argument("--epochs", type=int, default=8, help="epochs per digits run (default: 8)")
    parser.add_argument("--target", type=float, default=0.95, help="accuracy for time-to-accuracy (default: 0.95)")
    parser.add_argument("--bbc", action="store_true", help="also run MiniLM on BBC News (1 seed; slow)")
    parser.add_argument("--bbc-epochs", type=int, default=1, help="epochs per BBC run (default: 1)")
    parser.add_argument("--bbc-limit", type=int, default=None,
                        help="train BBC on its first N articles only (MiniLM takes ~1.2 s a step on 2 cores)")
    parser.add_argument("--summary-only", action="store_true", help="rebuild table and plots from the CSV")
    parser.add_argument("--budget", default=None, metavar="MB,SECONDS",
                        help="add each cell's accuracy under this budget of traffic and training time (AdaSplit's "
                             "budgeted score: a run over a budget is discounted by the share it covers)")
    parser.add_argument("--privacy", action="store_true",
                        help="instead, per codec and defence: accuracy, bytes, distance correlation, inversion error, "
                             "label leak and epsilon (privacy.csv/.md/.png in --out; see scripts/privacy_eval.py)")
    args = parser.parse_args(argv)
    if args.privacy:
        return _privacy(args)

    from tqdm import tqdm

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "results.csv"
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    links = [link.strip() for link in args.links.split(";") if link.strip()]
    micro = [int(m) for m in args.micro_batches.split(",")]
    cells = [("digits", c, link, m, s, args.epochs) for link in links for m in micro for c in codecs
             for s in range(args.seeds)]
    factories = list(DIGITS_FACTORIES)
    if args.bbc:
        cells += [("bbc", c, link, m, 0, args.bbc_epochs) for link in links for m in micro for c in codecs
                  if c.split(":")[0] != "binary"]
        factories.append("splitft.app.tasks.bbc:minilm_classifier")
    done = {cell_key(r["task"], r["codec"], r["link"], r["micro_batches"], r["seed"], r["epochs"])
            for r in read_rows(csv_path)}
    todo = [c for c in cells if cell_key(*c) not in done]
    if todo and not args.summary_only:
        print(f"{len(cells) - len(todo)} of {len(cells)} cells already in {csv_path}; running {len(todo)}",
              file=sys.stderr)
        from splitft.app.launch import local_cloud

        with local_cloud(factories, sessions=0, start_timeout=120, exit_timeout=0, quiet=True) as address:
            bar = tqdm(todo, unit="cell", dynamic_ncols=True)
            for task, codec, link, mb, seed, epochs in bar:
                bar.set_description(f"{task} {codec} @ {link} mb={mb} seed={seed}")
                append_row(csv_path, run_cell(task, codec, link, mb, seed, epochs, args.target, address,
                                              args.bbc_limit))
    summary, table = summarise(read_rows(csv_path), args.target, parse_budget(args.budget))
    command = "python scripts/ablate.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "results.md").write_text(f"<!-- made by: {command} -->\n\n{table}")
    print(table)
    for path in plot(summary, out, args.target):
        print(f"wrote {path}", file=sys.stderr)
    return 0


def _privacy(args: argparse.Namespace) -> int:
    """The privacy grid of :mod:`splitft.privacy.report` over these codecs plus every defence preset."""
    from splitft.privacy.evaluate import PRESETS, supported
    from splitft.privacy.report import run_grid

    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    skipped = [c for c in codecs if not supported(c)]
    if skipped:
        print(f"--privacy skips codecs with per-sample state: {', '.join(skipped)}", file=sys.stderr)
    defences = [name for name, s in PRESETS.items() if s.name != s.codec]
    settings = list(dict.fromkeys([c for c in codecs if c not in skipped] + defences))
    print(run_grid(Path(args.out), settings, seeds=args.seeds, epochs=args.epochs, summary_only=args.summary_only,
                   progress=lambda line: print(line, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
