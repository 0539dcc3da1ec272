r"""Time to accuracy on slow links, MiniLM and SmolLM2: synchronous codecs against a streaming edge.

The task is ``bbc-plain`` (all-MiniLM-L6-v2 cut plain after its second encoder layer: the cloud
runs layers 2-5, the pooling, the head and the loss; batch 32 of 128-token windows, AdamW 3e-4).
Each row of the table is a way to train it:

  identity, fp16, lowrank:rank=1, acsgd:bits=4 (8-bit gradients)   synchronous: one round trip a step
  frozen+CODEC        the edge's layers frozen, ``window`` steps in flight (streaming): no round trip
  delayed+CODEC       a trainable edge streaming with its cut gradients applied one step late
  progressive+CODEC   the edge's layers frozen as they converge (--freeze-window, --freeze-threshold),
                      synchronous until the last one froze, then streaming ``window`` steps

Two phases, each run against a ``splitft cloud`` process of its own on tcp loopback:

1. **Steps to the target**, on loopback: each row trains with a test evaluation every
   ``--eval-every`` steps until test accuracy reaches ``--target``. Training is deterministic (the
   codecs are seeded, the cloud half's dropout draws from the session's own seeded generator, the
   link changes only time), so the same steps reach it on any link.
2. **Time on each link**: the same row trains exactly that many steps again through the link
   emulator, and the training time (the last streamed step's reply included) is its time to the
   target. Its losses are checked against phase 1's, step by step. From the same run come the
   step's *physical limit* — max(edge compute, cloud compute, wire time) per step, plus one round
   trip when the step is synchronous — and the measured step time's ratio to it. Wire time is the
   busier direction's bytes at the link's rate (the link is full duplex).

The target is the task's metric: test accuracy for a classifier; for ``smollm-plain`` (SmolLM2-135M
with LoRA, cut plain after its second decoder layer) held-out perplexity, to get down to, measured
through the remote loss (only a scalar comes back, never the logits).

Each finished cell is appended to ``--out``/tta.csv at once; a re-run skips what is there.

    python scripts/time_to_accuracy.py                                   # the table in docs/time_to_accuracy.md
    python scripts/time_to_accuracy.py --rows identity,frozen+fp16 --links "10mbit,50ms" --target 0.8
    python scripts/time_to_accuracy.py --task smollm-plain --max-length 64 --target 47 --max-steps 32 \
        --rows identity,fp16,lowrank:rank=1,acsgd:bits=4,frozen+fp16,delayed+fp16 --out docs/time_to_accuracy/smollm
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # edge and cloud share this machine's cores

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402

TASK = "bbc-plain"
ROWS = ["identity", "fp16", "lowrank:rank=1", "acsgd:bits=4", "frozen+fp16", "frozen+lowrank:rank=1", "delayed+fp16"]
LINKS = ["10mbit,50ms", "100mbit,20ms"]
GRADIENT_CODEC = {"acsgd": "fixpoint:bits=8"}  # AC-SGD's paper pairs 4-bit activations with 8-bit gradients
FIELDS = ["row", "link", "steps", "target", "seconds", "step_s", "edge_s", "cloud_s", "wire_s", "round_trip_s",
          "limit_s", "losses_equal", "bytes_up", "bytes_down", "history"]


@dataclass(frozen=True)
class Row:
    """One way to train: a codec, and whether the edge is frozen or streams with delayed gradients."""

    name: str
    codec: str
    frozen: bool
    delayed: bool
    window: int
    freezing: tuple[int, float] | None = None  # progressive: (window, threshold) of the rule
    bwd: str | None = None  # the gradient codec, when the row names one (``CODEC;bwd=SPEC``)

    @classmethod
    def parse(cls, name: str, window: int, freezing: tuple[int, float] = (4, 0.3)) -> "Row":
        mode, _, codecs = name.rpartition("+")
        if mode not in ("", "frozen", "delayed", "progressive"):
            raise SystemExit(f"unknown row {name!r}: CODEC, frozen+CODEC, delayed+CODEC or progressive+CODEC")
        codec, _, bwd = codecs.partition(";bwd=")
        return cls(name, codec, mode == "frozen", mode == "delayed", window if mode else 1,
                   freezing if mode == "progressive" else None, bwd or None)

    @property
    def streams(self) -> bool:
        """Whether every step streams (a progressive row's first steps wait a round trip: its limit
        counts one for every step, an upper bound)."""
        return self.window > 1 and self.freezing is None

    def task_run(self, task: str, seed: int, max_length: int | None = None) -> object:
        from splitft.options import Codecs, Faults, Schedule
        from splitft.app.runner import TaskRun

        bwd = self.bwd or GRADIENT_CODEC.get(self.codec.split(":")[0], self.codec)
        return TaskRun(task=task, seed=seed, max_length=max_length, codecs=Codecs(self.codec, bwd, seed=seed),
                       freeze_edge=self.frozen, schedule=Schedule(window=self.window, delayed_gradients=self.delayed),
                       freeze_progressively=self.freezing,
                       faults=Faults(timeout=600.0))


def endless(prepared: object, seed: int) -> Iterator[tuple]:
    """The task's training batches, epoch after epoch, in the order every run sees them."""
    from splitft.app.data import batches

    epoch = 0
    while True:
        yield from batches(prepared.train, prepared.batch_size, shuffle=True, seed=seed, epoch=epoch)
        epoch += 1


class Metric:
    """What phase 1 measures on the test data, and when it has reached the target."""

    def __init__(self, task: str) -> None:
        from splitft.app.tasks import get_task

        self.perplexity = get_task(task).metric == "perplexity"
        self.name = "held-out perplexity" if self.perplexity else "test accuracy"

    def measure(self, prepared: object) -> float:
        model = prepared.model
        model.eval()
        try:
            if self.perplexity:
                from splitft.app.tasks.smollm_chain import perplexity

                return perplexity(prepared.criterion, model, prepared.test)
            from splitft.app.train import accuracy

            return accuracy(model.predict, prepared.test)
        finally:
            model.train()

    def reached(self, value: float, target: float) -> bool:
        return value <= target if self.perplexity else value >= target

    def label(self, target: float) -> str:
        return f"perplexity {target:g}" if self.perplexity else f"{target:.0%}"


def train(row: Row, address: str, link: str | None, *, task: str, seed: int, steps: int | None, target: float,
          eval_every: int, max_steps: int, max_length: int | None = None) -> dict:
    """Train ``row`` through ``link``: until the target (``steps`` None: evaluating every
    ``eval_every`` steps, at most ``max_steps``) or exactly ``steps`` steps, timed."""
    from splitft.app.data import call
    from splitft.options import Link
    from splitft.app.runner import prepare

    metric = Metric(task)
    with torch.random.fork_rng(devices=[]):
        prepared = prepare(row.task_run(task, seed, max_length), Link(address, emulate=link))
        model, optimizer, criterion = prepared.model, prepared.optimizer, prepared.criterion
        losses, history, seconds = [], [], 0.0
        model.train()  # a pre-trained model loads in eval mode: fine-tune it with its dropout on
        with model:
            for done, (x, y, ids) in enumerate(endless(prepared, seed), start=1):
                start = time.perf_counter()
                loss = criterion(call(model, x, sample_ids=ids), y)  # per-sample codec state (acsgd)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                losses.append(loss.detach())
                if done == (steps or max_steps):
                    model.sync()  # the last streamed step's reply, and its optimizer step, belong to the time
                seconds += time.perf_counter() - start
                if steps is None and done % eval_every == 0:
                    history.append((done, metric.measure(prepared)))
                    print(f"  step {done}: {metric.name} {history[-1][1]:.4f}", file=sys.stderr)
                    if metric.reached(history[-1][1], target):
                        break
                if done == (steps or max_steps):
                    break
            breakdown = model.metrics.breakdown(seconds)
            up, down = model.metrics.direction("up").wire, model.metrics.direction("down").wire
            freezing = model.metrics.notes.get("freezing")
    return {"steps": done, "seconds": seconds, "losses": [float(v) for v in losses], "history": history,
            "freezing": freezing,
            "breakdown": breakdown, "bytes_up": up, "bytes_down": down}


def cell(row: Row, link: str, result: dict, target: float, reference: list[float] | None) -> dict:
    """A CSV row: the run's time, where a step's time could go at best, and the losses check."""
    import transports

    steps, spec = result["steps"], transports.LinkSpec.coerce(link)
    b = result["breakdown"]
    edge, cloud = (b["edge_compute"] + b["edge_codec"]) / steps, (b["cloud_compute"] + b["cloud_codec"]) / steps
    wire = max(spec.up.serialise_s(result["bytes_up"] / steps), spec.down.serialise_s(result["bytes_down"] / steps))
    round_trip = 0.0 if row.streams else spec.up.delay_s + spec.down.delay_s
    equal = "" if reference is None else str(reference == result["losses"] or all(
        abs(a - b) <= 1e-5 * max(1.0, abs(b)) for a, b in zip(result["losses"], reference, strict=True)))
    return {"row": row.name, "link": link, "steps": steps, "target": target, "seconds": f"{result['seconds']:.3f}",
            "step_s": f"{result['seconds'] / steps:.4f}", "edge_s": f"{edge:.4f}", "cloud_s": f"{cloud:.4f}",
            "wire_s": f"{wire:.4f}", "round_trip_s": f"{round_trip:.4f}",
            "limit_s": f"{max(edge, cloud, wire) + round_trip:.4f}", "losses_equal": equal,
            "bytes_up": result["bytes_up"], "bytes_down": result["bytes_down"],
            # "accuracy": the metric's (step, value) pairs, test accuracy or perplexity
            "history": json.dumps({"accuracy": result["history"], "losses": result["losses"]}
                                  | ({"freezing": result["freezing"]} if result.get("freezing") else {}))}


def same_losses(timed: dict, first: dict | None) -> bool:
    """Whether a link's run lost what phase 1's run (as the CSV holds it now) lost, step by step."""
    if first is None:
        return False
    a, b = (json.loads(c["history"])["losses"] for c in (timed, first))
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * max(1.0, abs(y)) for x, y in zip(a, b))


def read_cells(path: Path) -> dict[tuple[str, str], dict]:
    if not path.exists():
        return {}
    with path.open(newline="") as f:
        return {(r["row"], r["link"]): r for r in csv.DictReader(f)}


def append_cell(path: Path, values: dict) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(values)


def table(cells: dict[tuple[str, str], dict], rows: list[str], links: list[str], metric: Metric,
          target: float) -> str:
    """Markdown: per link, each row's time to the target, its speedup and its step against the limit;
    a row that did not reach the target on loopback says so."""
    label = metric.label(target)
    lines = []
    for link in links:
        base = cells.get(("identity", link))
        lines += ["", f"#### {link}", "",
                  f"| row | steps to {label} | time to {label} (s) | speedup vs identity | s/step "
                  "| edge s | cloud s | wire s | round trip s | limit s | step / limit | MB up / down per step "
                  "| losses as on loopback |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for name in rows:
            c = cells.get((name, link))
            first = cells.get((name, "loopback"))
            evaluated = json.loads(first["history"])["accuracy"] if first is not None else []
            if c is None and evaluated and not metric.reached(evaluated[-1][1], target):
                lines.append(f"| {name} | not reached in {first['steps']} steps ({evaluated[-1][1]:.4g} at the last "
                             "evaluation) |" + " |" * 11)
            if c is None:
                continue
            speedup = f"{float(base['seconds']) / float(c['seconds']):.2f}x" if base else "—"
            per_step = [int(c[k]) / int(c["steps"]) / 1e6 for k in ("bytes_up", "bytes_down")]
            lines.append(
                f"| {name} | {c['steps']} | {float(c['seconds']):.1f} | {speedup} | {float(c['step_s']):.3f} | "
                f"{float(c['edge_s']):.3f} | {float(c['cloud_s']):.3f} | {float(c['wire_s']):.3f} | "
                f"{float(c['round_trip_s']):.3f} | {float(c['limit_s']):.3f} | "
                f"{float(c['step_s']) / float(c['limit_s']):.2f} | {per_step[0]:.2f} / {per_step[1]:.2f} | "
                f"{'yes' if same_losses(c, cells.get((name, 'loopback'))) else 'NO'} |")
    return "\n".join(lines).lstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--out", default="docs/time_to_accuracy", help="folder for tta.csv and tta.md (default: %(default)s)")
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows (default: %(default)s)")
    parser.add_argument("--row", action="append", default=[], metavar="ROW",
                        help="one more row, after --rows, which may hold commas: a chained codec, and its gradient "
                             "codec after ';bwd=' (e.g. 'outliers:k=4>hadamard>delta>quant:bits=2,eval_bits=8;"
                             "bwd=hadamard>quant:bits=2,stochastic=true')")
    parser.add_argument("--links", default=";".join(LINKS), help="semicolon-separated links (default: %(default)s)")
    parser.add_argument("--target", type=float, default=None,
                        help="test accuracy to reach (default: 0.95), or for smollm-plain the held-out perplexity to "
                             "get down to (default: 47)")
    parser.add_argument("--eval-every", type=int, default=4, help="steps between evaluations in phase 1 (default: 4)")
    parser.add_argument("--max-steps", type=int, default=112, help="give up on a row after this many steps (2 epochs)")
    parser.add_argument("--window", type=int, default=4, help="steps in flight of a streaming row (default: 4)")
    parser.add_argument("--freeze-window", type=int, default=4,
                        help="progressive rows: steps per mean of a layer's gradient norms (default: 4)")
    parser.add_argument("--freeze-threshold", type=float, default=0.3,
                        help="progressive rows: a layer freezes once its last mean differs from the one before by at "
                             "most this fraction (default: 0.3)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--task", default=TASK, help="a task cut plain (default: %(default)s; digits for a quick look, "
                                                     "smollm-plain for the language model)")
    parser.add_argument("--max-length", type=int, default=None, help="tokens per window (default: the task's)")
    parser.add_argument("--summary-only", action="store_true", help="rebuild tta.md from the CSV")
    args = parser.parse_args(argv)
    metric = Metric(args.task)
    if args.target is None:
        args.target = 47.0 if metric.perplexity else 0.95
    rows = [Row.parse(name.strip(), args.window, (args.freeze_window, args.freeze_threshold))
            for name in [*args.rows.split(","), *args.row] if name.strip()]
    links = [link.strip() for link in args.links.split(";") if link.strip()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tta.csv"
    if not args.summary_only:
        run_cells(rows, links, path, args)
    text = table(read_cells(path), [r.name for r in rows], links, metric, args.target)
    command = "python scripts/time_to_accuracy.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (out / "tta.md").write_text(f"<!-- made by: {command} -->\n\n{text}")
    print(text)
    return 0


def run_cells(rows: list[Row], links: list[str], path: Path, args: argparse.Namespace) -> None:
    """Phase 1 on loopback for every row, then phase 2 link by link, skipping the cells already in
    ``path``. Each run gets a cloud process of its own, so nothing one run leaves in the cloud
    (memory, a slow teardown) touches the next one's timing."""
    common = {"task": args.task, "seed": args.seed, "target": args.target, "eval_every": args.eval_every,
              "max_steps": args.max_steps, "max_length": args.max_length}
    metric = Metric(args.task)
    for link in ["loopback", *links]:
        for row in rows:
            cells = read_cells(path)  # the newest line per (row, link) counts
            first = cells.get((row.name, "loopback"))
            if (row.name, link) in cells and (first is None or cells[(row.name, link)]["steps"] == first["steps"]):
                continue  # done (a link's cell timed with another step count than phase 1 found is redone)
            if link == "loopback":
                print(f"{row.name}: steps to {metric.label(args.target)} on loopback", file=sys.stderr)
                append_cell(path, cell(row, link, fresh_cloud(row, None, steps=None, **common), args.target, None))
                continue
            history = json.loads(cells[(row.name, "loopback")]["history"])
            if not history["accuracy"] or not metric.reached(history["accuracy"][-1][1], args.target):
                print(f"{row.name}: did not reach {metric.label(args.target)} in {args.max_steps} steps",
                      file=sys.stderr)
                continue
            steps = int(cells[(row.name, "loopback")]["steps"])
            print(f"{row.name}: {steps} steps over {link}", file=sys.stderr)
            result = fresh_cloud(row, link, steps=steps, **common)
            append_cell(path, cell(row, link, result, args.target, history["losses"]))


def fresh_cloud(row: Row, link: str | None, *, task: str, **options: object) -> dict:
    """:func:`train` against a ``splitft cloud`` process started for this run alone."""
    from splitft.app.launch import local_cloud
    from splitft.app.tasks import get_task

    with local_cloud([get_task(task).model], sessions=1, start_timeout=120, quiet=True) as address:
        return train(row, address, link, task=task, **options)


if __name__ == "__main__":
    sys.exit(main())
