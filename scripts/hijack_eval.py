"""Does the edge catch a hijacking cloud, and never an honest one? The hijack probe, measured.

Trains the digits CNN split U-shape (edge: block1-2, cloud: block3, edge: head) against

* a malicious cloud running feature-space hijacking (``tests/fsha.py``), without the edge's probe
  (the attacker's SSIM on the test images at every step: how fast the attack works) and with it
  at each ``--rates`` over ``--draws`` draws of the probed steps (the step at which the probe
  stops training, and the attacker's SSIM then);
* honest clouds for every codec of the ablation grid (``scripts/ablate.py``), with the probe on:
  every alarm there is a false one; with ``--bbc``, MiniLM on BBC News too.

The attacker's SSIM is the higher of two views of the held-out digits: the edge's activations
as inference sends them (BatchNorm's running statistics) and as training sends them (batch
statistics). The cloud runs on a thread of this process (the real cloud code path, over an
in-process transport), so that the attacker's decoder can be read. Writes hijack.csv,
hijack_curves.csv, hijack_bbc.csv, hijack.md and hijack.png into --out.

    python scripts/hijack_eval.py --out docs/privacy --seeds 3 --epochs 10 --fsha-epochs 10 \
        --rates 0.1,0.3,0.5 --honest-rates 0.3,0.5 --draws 10
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the malicious cloud lives in tests/, never in the product

HONEST = "splitft.app.models:digits_cnn"
BINARY = "splitft.app.models:digits_bsl"  # the binary codec's model (B-SL), as in the ablation grid
HIJACK = "tests.fsha:fsha_digits"
FIELDS = ["cloud", "codec", "seed", "probe", "probe_seed", "steps", "detected_step", "ssim_at_detection",
          "ssim_final", "first_step_over_half", "accuracy", "probes", "failed_probes", "min_honest_ratio"]
CURVE = ["seed", "probe", "probe_seed", "step", "ssim_inference", "ssim_training"]
TEXT = ["task", "codec", "seed", "probe", "epochs", "batch_size", "limit", "alarm", "accuracy", "steps", "probes",
        "failed_probes", "lowest_ratio", "seconds"]


def run(cloud: str, codec: str, *, seed: int, epochs: int, rate: float | None, probe_seed: int,
        measure_every: int = 1) -> tuple[dict[str, Any], list[tuple[int, float, float]]]:
    """One training run, probed at ``rate`` (None: no probe); with the malicious cloud, the
    attacker's SSIM on the test images every ``measure_every`` steps (``(step, from inference-time
    activations, from training-time activations)``) and at the step the probe stops training."""
    import torch
    from torch import nn

    import splitft
    import transports
    from compressors.binary import keep_latent_weights_clipped
    from splitft.app.data import batches
    from splitft.cloud import CloudServer, load_factory, serve_in_thread
    from splitft.errors import CloudMisbehaving
    from splitft.privacy import Defences, Probe, protect
    from tests import fsha

    train, _, test = data()
    listener = transports.InprocListener()
    server = CloudServer(listener, [HONEST, BINARY, HIJACK])
    thread = serve_in_thread(server)
    ratios: list[float] = []
    row: dict[str, Any] = {"cloud": "fsha" if cloud == HIJACK else "honest", "codec": codec, "seed": seed,
                           "probe_seed": probe_seed, "detected_step": "", "ssim_at_detection": "",
                           "first_step_over_half": "", "accuracy": ""}
    curve: list[tuple[int, float, float]] = []
    try:
        before = len(fsha.ATTACKERS)
        if cloud == HONEST and codec.split(":")[0] == "binary":
            cloud = BINARY
        model = splitft.split(load_factory(HONEST if cloud == HIJACK else cloud)(seed=seed), "block3", "head",
                              factory=splitft.Factory(cloud, kwargs={"seed": seed}), connect=listener.connect(),
                              codecs=splitft.Codecs(codec, ret="identity" if cloud == BINARY else None, seed=seed),
                              faults=splitft.Faults(timeout=120))
        with model:
            protection = protect(model, Defences(probe=None if rate is None else Probe(rate=rate), seed=probe_seed))
            attacker = None
            if cloud == HIJACK:
                (attacker,) = fsha.ATTACKERS[before:]  # the one this run's cloud built and trains
            optimizer = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
            keep_latent_weights_clipped(optimizer, model)
            criterion = nn.CrossEntropyLoss()
            step = 0
            try:
                for epoch in range(epochs):
                    model.train()
                    for x, y, ids in batches(train, 64, shuffle=True, seed=seed, epoch=epoch):
                        loss = criterion(model(x, sample_ids=ids), y)
                        loss.backward()
                        optimizer.step()
                        optimizer.zero_grad()
                        step += 1
                        if protection.detector is not None and protection.detector.last_ratio is not None \
                                and cloud != HIJACK:
                            ratios.append(protection.detector.last_ratio)
                        if attacker is not None and step % measure_every == 0:
                            curve.append((step, *attacker_ssim(model.model, attacker, test)))
            except CloudMisbehaving:
                row["detected_step"] = step + 1
                if attacker is not None:  # the edge has not stepped on the refused answer
                    row["ssim_at_detection"] = max(attacker_ssim(model.model, attacker, test))
            if not row["detected_step"]:  # a tripped probe refuses every further forward
                model.eval()
                with torch.no_grad():
                    row["accuracy"] = float((model(test.x, sample_ids=test.ids).argmax(1) == test.y).double().mean())
            snap = protection.detector.snapshot() if protection.detector is not None else {}
    finally:
        server.stop()
        thread.join(timeout=10)
    over = [s for s, *v in curve if max(v) > 0.5]
    row.update(steps=step, ssim_final=max(curve[-1][1:]) if curve else "",
               first_step_over_half=over[0] if over else "", probes=snap.get("probes", 0),
               failed_probes=snap.get("failed_probes", 0), min_honest_ratio=min(ratios) if ratios else "")
    return row, curve


def attacker_ssim(net: Any, attacker: Any, test: Any) -> tuple[float, float]:
    """SSIM of the attacker's reconstructions of the test images from the edge's activations as
    inference sends them (BatchNorm's running statistics) and as training sends them (batch
    statistics, on a copy so the running ones are left alone). The edge's own modules are used:
    the split refuses to run once the probe has tripped."""
    import copy

    import torch

    from splitft.privacy.attacks import ssim

    edge = torch.nn.Sequential(net.block1, net.block2)
    was_training = edge.training
    scores = []
    with torch.no_grad():
        for mode, module in (("eval", edge), ("train", copy.deepcopy(edge))):
            module.train(mode == "train")
            scores.append(float(ssim(attacker.reconstruct(module(test.x)), test.tensor().float())))
    edge.train(was_training)
    return scores[0], scores[1]


def honest_text(codec: str, *, seed: int, epochs: int, limit: int | None, rate: float, batch_size: int = 8,
                test: int = 88) -> dict[str, Any]:
    """MiniLM on BBC News (U-shape, the task's cut, optimizer and learning rate; batches of
    ``batch_size`` articles to keep steps short on one core) against an honest cloud with the probe
    on at ``rate``: every alarm is a false one. Accuracy on ``test`` test articles spread over the
    test set."""
    import torch

    import transports
    from splitft.app.data import Split, take
    from splitft.app.runner import TaskRun, prepare, train
    from splitft.app.tasks import get_task
    from splitft.cloud import CloudServer, serve_in_thread
    from splitft.errors import CloudMisbehaving
    from splitft.options import Codecs, Factory, Faults, Link
    from splitft.privacy import Defences, Probe, protect

    task = get_task("bbc")
    factory = Factory(task.model, kwargs={"seed": seed}, weights=task.weights)  # type: ignore[arg-type]
    listener = transports.InprocListener()
    server = CloudServer(listener, [factory.name])
    thread = serve_in_thread(server)
    row: dict[str, Any] = {"task": "bbc", "codec": codec, "seed": seed, "probe": rate, "epochs": epochs,
                           "batch_size": batch_size, "limit": limit or "", "alarm": False, "accuracy": ""}
    try:
        with torch.random.fork_rng(devices=[]):
            prepared = prepare(TaskRun(task="bbc", factory=factory, epochs=epochs, seed=seed, limit=limit,
                                       batch_size=batch_size, codecs=Codecs(codec, seed=seed),
                                       faults=Faults(timeout=300)), Link(listener.connect()))
            spread = torch.linspace(0, len(prepared.test) - 1, test).long()  # the test set is in class order
            prepared.test = Split(take(prepared.test.x, spread), prepared.test.y[spread], torch.arange(test))
            protection = protect(prepared.model, Defences(probe=Probe(rate=rate), seed=20_000 + seed))
            try:
                row.update(accuracy=train(prepared).accuracy)
            except CloudMisbehaving:
                row.update(alarm=True)
        snap = protection.detector.snapshot()
        row.update(steps=snap["checked_steps"], probes=snap["probes"], failed_probes=snap["failed_probes"],
                   lowest_ratio=snap["lowest_probe_ratio"] if snap["lowest_probe_ratio"] is not None else "")
    finally:
        server.stop()
        thread.join(timeout=10)
    return row


def data() -> Any:
    from splitft.privacy.evaluate import data as digits

    return digits()


def main(argv: list[str] | None = None) -> int:
    """Run the attacked and the honest runs, append them to hijack.csv (the attacker's SSIM over
    steps to hijack_curves.csv), write hijack.md and hijack.png."""
    import torch

    torch.set_num_threads(1)  # the machine is shared
    sys.path.insert(0, str(ROOT / "scripts"))
    from ablate import CODECS

    from splitft.privacy.report import append_row, read_rows

    parser = argparse.ArgumentParser(prog="hijack_eval.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="privacy", help="folder for the results (default: privacy)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per run (default: 3)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per honest run (default: 10)")
    parser.add_argument("--fsha-epochs", type=int, default=10, help="epochs per run against FSHA (default: 10)")
    parser.add_argument("--rates", default="0.1", help="probe rates to measure, comma-separated (default: 0.1, "
                                                       "Probe()'s)")
    parser.add_argument("--honest-rates", default=None, help="probe rates of the honest runs (default: --rates)")
    parser.add_argument("--draws", type=int, default=1, help="probed runs against FSHA per seed and rate, each "
                                                             "with its own draw of probed steps (default: 1)")
    parser.add_argument("--codecs", default=",".join(CODECS), help="codecs of the honest runs (default: the "
                                                                   "ablation grid's)")
    parser.add_argument("--bbc", default="", help="codecs of honest MiniLM/BBC News runs with the probe, comma-"
                                                  "separated (default: none; minutes each on one core)")
    parser.add_argument("--bbc-epochs", type=int, default=2, help="epochs per BBC run (default: 2)")
    parser.add_argument("--bbc-limit", type=int, default=160, help="BBC training articles (default: 160)")
    parser.add_argument("--bbc-rate", type=float, default=0.5, help="probe rate of the BBC runs (default: 0.5)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hijack.csv"
    done = {(r["cloud"], r["codec"], r["seed"], r["probe"], r["probe_seed"]) for r in read_rows(path)}
    rates = args.rates.split(",")
    cells = [(HIJACK, "identity", s, "off", 0) for s in range(args.seeds)]  # the attack's course, undisturbed
    cells += [(HIJACK, "identity", s, r, d) for r in rates for s in range(args.seeds) for d in range(args.draws)]
    honest_rates = args.honest_rates.split(",") if args.honest_rates else rates
    cells += [(HONEST, c, s, r, 0) for r in honest_rates for c in args.codecs.split(",") for s in range(args.seeds)]
    for cloud, codec, seed, rate, draw in cells:
        probe_seed = 20_000 + seed + 1_000 * draw
        key = ("fsha" if cloud == HIJACK else "honest", codec, str(seed), rate, str(probe_seed))
        if key in done:
            continue
        print(f"{key}", file=sys.stderr, flush=True)
        row, curve = run(cloud, codec, seed=seed, epochs=args.fsha_epochs if cloud == HIJACK else args.epochs,
                         rate=None if rate == "off" else float(rate), probe_seed=probe_seed)
        row.update(probe=rate)
        append_row(path, row, FIELDS)
        for step, inference, training in curve:
            append_row(out / "hijack_curves.csv", {"seed": seed, "probe": rate, "probe_seed": probe_seed, "step": step,
                                                "ssim_inference": inference, "ssim_training": training}, CURVE)
    text_done = {r["codec"] for r in read_rows(out / "hijack_bbc.csv")}
    for codec in (c for c in args.bbc.split(",") if c and c not in text_done):
        print(("honest", "bbc", codec), file=sys.stderr, flush=True)
        start = time.perf_counter()
        row = honest_text(codec, seed=0, epochs=args.bbc_epochs, limit=args.bbc_limit, rate=args.bbc_rate)
        append_row(out / "hijack_bbc.csv", {**row, "seconds": round(time.perf_counter() - start)}, TEXT)
    rows = read_rows(path)
    table = summary(rows, args) + text_summary(read_rows(out / "hijack_bbc.csv"))
    (out / "hijack.md").write_text(table)
    plot(read_rows(out / "hijack_curves.csv"), rows, out / "hijack.png")
    print(table)
    return 0




def summary(rows: list[dict[str, str]], args: argparse.Namespace) -> str:
    """The markdown tables: the attack's course, detection against it, and alarms over honest runs."""
    command = (f"python scripts/hijack_eval.py --out {args.out} --seeds {args.seeds} --epochs {args.epochs} "
               f"--fsha-epochs {args.fsha_epochs} --rates {args.rates} --draws {args.draws}"
               + (f" --honest-rates {args.honest_rates}" if args.honest_rates else "")
               + (f" --bbc {args.bbc} --bbc-epochs {args.bbc_epochs} --bbc-limit {args.bbc_limit} "
                  f"--bbc-rate {args.bbc_rate:g}" if args.bbc else ""))
    fsha = [r for r in rows if r["cloud"] == "fsha"]
    lines = [f"<!-- made by: {command} -->", "", "| FSHA, no probe: seed | first step attacker SSIM > 0.5 "
             "| attacker SSIM at the end | steps | edge accuracy |", "|---|---|---|---|---|"]
    for r in (r for r in fsha if r["probe"] == "off"):
        lines.append(f"| {r['seed']} | {r['first_step_over_half'] or '—'} | {float(r['ssim_final']):.3f} | "
                     f"{r['steps']} | {float(r['accuracy']):.3f} |")
    lines += ["", "| FSHA, probe rate | runs | detected | step detected | attacker SSIM then "
              "| stopped before attacker SSIM > 0.5 | probes failed |", "|---|---|---|---|---|---|---|"]
    for rate in dict.fromkeys(r["probe"] for r in fsha if r["probe"] != "off"):
        cell = [r for r in fsha if r["probe"] == rate]
        detected = [r for r in cell if r["detected_step"]]
        early = [r for r in detected if not r["first_step_over_half"] and float(r["ssim_at_detection"]) <= 0.5]
        lines.append(f"| {rate} | {len(cell)} | {len(detected)}/{len(cell)} | {_values(detected, 'detected_step', 0)} "
                     f"| {_values(detected, 'ssim_at_detection', 3)} | {len(early)}/{len(cell)} | "
                     f"{sum(int(r['failed_probes']) for r in cell)}/{sum(int(r['probes']) for r in cell)} |")
    lines += ["", "| honest cloud, codec | probe rate | runs | false alarms | probes | lowest probe gain ratio "
              "| accuracy |", "|---|---|---|---|---|---|---|"]
    honest = [r for r in rows if r["cloud"] == "honest"]
    for rate, codec in dict.fromkeys((r["probe"], r["codec"]) for r in honest):
        cell = [r for r in honest if r["codec"] == codec and r["probe"] == rate]
        alarms = sum(1 for r in cell if r["detected_step"])
        lines.append(f"| {codec} | {rate} | {len(cell)} | {alarms} | {sum(int(r['probes']) for r in cell)} | "
                     f"{_values(cell, 'min_honest_ratio', 2, low=True)} | {_values(cell, 'accuracy', 3)} |")
    return "\n".join(lines) + "\n"


def text_summary(rows: list[dict[str, str]]) -> str:
    """The honest MiniLM runs' table (empty without them)."""
    if not rows:
        return ""
    lines = ["", "| MiniLM/BBC, honest cloud, codec | probe rate | steps | false alarm | probes "
             "| lowest probe gain ratio | accuracy (88 test articles) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['probe']} | {r['steps']} | "
                     f"{'yes' if r['alarm'] == 'True' else 'no'} | {r['probes']} | "
                     f"{_values([r], 'lowest_ratio', 2)} | {_values([r], 'accuracy', 3)} |")
    return "\n".join(lines) + "\n"


def plot(curves: list[dict[str, str]], rows: list[dict[str, str]], path: Path) -> None:
    """The attacker's SSIM over steps without the probe, one line per seed and view, and the steps
    at which the probe stopped the attack."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for seed in dict.fromkeys(c["seed"] for c in curves if c["probe"] == "off"):
        run_ = [c for c in curves if c["probe"] == "off" and c["seed"] == seed]
        steps = [int(c["step"]) for c in run_]
        line, = ax.plot(steps, [float(c["ssim_training"]) for c in run_], label=f"seed {seed}, training-time")
        ax.plot(steps, [float(c["ssim_inference"]) for c in run_], "--", color=line.get_color(),
                label=f"seed {seed}, inference-time")
    probed = [r for r in rows if r["cloud"] == "fsha" and r["detected_step"]]
    for rate in dict.fromkeys(r["probe"] for r in probed):
        stops = [int(r["detected_step"]) for r in probed if r["probe"] == rate]
        ax.hist(stops, bins=range(0, max(stops) + 2), weights=[1 / len(stops)] * len(stops), histtype="step",
                lw=1.5, label=f"probe at rate {rate} stopped training here (share of its runs)")
    ax.axhline(0.5, color="black", lw=0.5)
    ax.set_xlim(0, 60)
    ax.set_xlabel("training step")
    ax.set_ylabel("attacker's SSIM on held-out digits")
    ax.set_ylim(0, 1.05)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _values(rows: list[dict[str, str]], key: str, digits: int, low: bool = False) -> str:
    values = [float(r[key]) for r in rows if r.get(key) not in ("", None) and float(r[key]) == float(r[key])]
    if not values:
        return "—"
    if low:
        return f"{min(values):.{digits}f}"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} (min {min(values):.{digits}f}, max {max(values):.{digits}f})"


if __name__ == "__main__":
    sys.exit(main())
