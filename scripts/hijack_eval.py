"""Does the edge catch a hijacking cloud, and never an honest one? The hijack probe, measured.

Trains the digits CNN split U-shape (edge: block1-2, cloud: block3, edge: head) against

* a malicious cloud running feature-space hijacking (``tests/fsha.py``), with and without the
  edge's probe (``Defences(probe=Probe())``): the step at which the probe stops training, and the
  SSIM of the attacker's reconstructions of the test images at that step and over the run;
* honest clouds for every codec of the ablation grid (``scripts/ablate.py``), with the probe on:
  every alarm there is a false one.

The cloud runs on a thread of this process (the real cloud code path, over an in-process
transport), so that the attacker's decoder can be read. Writes hijack.csv and hijack.md into --out.

    python scripts/hijack_eval.py --out docs/privacy --seeds 3 --epochs 10 --fsha-epochs 30
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import csv  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the malicious cloud lives in tests/, never in the product

HONEST = "splitft.app.models:digits_cnn"
BINARY = "splitft.app.models:digits_bsl"  # the binary codec's model (B-SL), as in the ablation grid
HIJACK = "tests.fsha:fsha_digits"
FIELDS = ["cloud", "codec", "seed", "probe", "steps", "detected_step", "ssim_at_detection", "ssim_final",
          "first_step_over_half", "accuracy", "probes", "failed_probes", "min_honest_ratio"]


def run(cloud: str, codec: str, *, seed: int, epochs: int, probe: bool, measure_every: int = 10) -> dict[str, Any]:
    """One training run; the attacker's SSIM on the test images every ``measure_every`` steps."""
    import torch
    from torch import nn

    import splitft
    import transports
    from compressors.binary import keep_latent_weights_clipped
    from splitft.app.data import batches
    from splitft.cloud import CloudServer, load_factory, serve_in_thread
    from splitft.errors import CloudMisbehaving
    from splitft.privacy import Defences, Probe, protect
    from splitft.privacy.attacks import ssim
    from splitft.privacy.evaluate import data
    from tests import fsha

    train, _, test = data()
    listener = transports.InprocListener()
    server = CloudServer(listener, [HONEST, BINARY, HIJACK])
    thread = serve_in_thread(server)
    ratios: list[float] = []
    row: dict[str, Any] = {"cloud": "fsha" if cloud == HIJACK else "honest", "codec": codec, "seed": seed,
                           "probe": probe, "detected_step": "", "ssim_at_detection": "", "first_step_over_half": "",
                           "accuracy": ""}
    curve: list[tuple[int, float]] = []
    try:
        before = len(fsha.ATTACKERS)
        if cloud == HONEST and codec.split(":")[0] == "binary":
            cloud = BINARY
        model = splitft.split(load_factory(HONEST if cloud == HIJACK else cloud)(seed=seed), "block3", "head",
                              factory=splitft.Factory(cloud, kwargs={"seed": seed}), connect=listener.connect(),
                              codecs=splitft.Codecs(codec, ret="identity" if cloud == BINARY else None, seed=seed),
                              faults=splitft.Faults(timeout=120))
        with model:
            protection = protect(model, Defences(probe=Probe() if probe else None, seed=20_000 + seed))
            attacker = fsha.ATTACKERS[before] if cloud == HIJACK and len(fsha.ATTACKERS) > before else None
            optimizer = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
            keep_latent_weights_clipped(optimizer, model)
            criterion = nn.CrossEntropyLoss()

            def attacker_ssim() -> float:
                """The attacker's decoder on the edge's activations of the test images (computed on
                the edge's own modules: the split refuses to run once the probe has tripped)."""
                net = model.model
                net.eval()
                with torch.no_grad():
                    z = net.block2(net.block1(test.x))
                net.train()
                return float(ssim(attacker.reconstruct(z), test.tensor().float()))

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
                            curve.append((step, attacker_ssim()))
            except CloudMisbehaving:
                row["detected_step"] = step + 1
                if attacker is not None:
                    row["ssim_at_detection"] = attacker_ssim()
            if not row["detected_step"]:  # a tripped probe refuses every further forward
                model.eval()
                with torch.no_grad():
                    row["accuracy"] = float((model(test.x, sample_ids=test.ids).argmax(1) == test.y).double().mean())
            snap = protection.detector.snapshot() if protection.detector is not None else {}
    finally:
        server.stop()
        thread.join(timeout=10)
    over = [s for s, v in curve if v > 0.5]
    row.update(steps=step, ssim_final=curve[-1][1] if curve else "", first_step_over_half=over[0] if over else "",
               probes=snap.get("probes", 0), failed_probes=snap.get("failed_probes", 0),
               min_honest_ratio=min(ratios) if ratios else "")
    return row


def main(argv: list[str] | None = None) -> int:
    """Run the attacked and the honest runs, append them to hijack.csv, write hijack.md."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from ablate import CODECS

    parser = argparse.ArgumentParser(prog="hijack_eval.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="privacy", help="folder for hijack.csv and hijack.md (default: privacy)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per run (default: 3)")
    parser.add_argument("--epochs", type=int, default=10, help="epochs per honest run (default: 10)")
    parser.add_argument("--fsha-epochs", type=int, default=30, help="epochs per run against FSHA (default: 30)")
    parser.add_argument("--codecs", default=",".join(CODECS), help="codecs of the honest runs (default: the "
                                                                   "ablation grid's)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "hijack.csv"
    done = {(r["cloud"], r["codec"], r["seed"], r["probe"]) for r in _read(path)}
    cells = [(HIJACK, "identity", s, True) for s in range(args.seeds)]
    cells += [(HONEST, c, s, True) for c in args.codecs.split(",") for s in range(args.seeds)]
    cells += [(HIJACK, "identity", s, False) for s in range(args.seeds)]  # the attack's course, undisturbed
    for cloud, codec, seed, probe in cells:
        key = ("fsha" if cloud == HIJACK else "honest", codec, str(seed), str(probe))
        if key in done:
            continue
        print(f"{key}", file=sys.stderr, flush=True)
        row = run(cloud, codec, seed=seed, epochs=args.fsha_epochs if cloud == HIJACK else args.epochs, probe=probe,
                  measure_every=20)
        _append(path, row)
    table = summary(_read(path), args)
    (out / "hijack.md").write_text(table)
    print(table)
    return 0


def _read(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open())) if path.exists() else []


def _append(path: Path, row: dict[str, Any]) -> None:
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow(row)


def summary(rows: list[dict[str, str]], args: argparse.Namespace) -> str:
    """The markdown tables: detection against FSHA, and alarms over honest runs."""
    command = (f"python scripts/hijack_eval.py --out {args.out} --seeds {args.seeds} --epochs {args.epochs} "
               f"--fsha-epochs {args.fsha_epochs}")
    lines = [f"<!-- made by: {command} -->", "", "| cloud | probe | runs | detected | step detected "
             "| attacker SSIM then | attacker SSIM at the end | first step attacker SSIM > 0.5 | edge accuracy |",
             "|---|---|---|---|---|---|---|---|---|"]
    fsha = [r for r in rows if r["cloud"] == "fsha"]
    for probe in ("False", "True"):
        cell = [r for r in fsha if r["probe"] == probe]
        if not cell:
            continue
        detected = [r for r in cell if r["detected_step"]]
        lines.append(f"| FSHA | {'on' if probe == 'True' else 'off'} | {len(cell)} | {len(detected)}/{len(cell)} | "
                     f"{_values(detected, 'detected_step', 0)} | {_values(detected, 'ssim_at_detection', 3)} | "
                     f"{_values(cell, 'ssim_final', 3)} | {_values(cell, 'first_step_over_half', 0)} | "
                     f"{_values(cell, 'accuracy', 3)} |")
    lines += ["", "| honest cloud, codec | runs | false alarms | probes | lowest probe gain ratio | accuracy |",
              "|---|---|---|---|---|---|"]
    for codec in dict.fromkeys(r["codec"] for r in rows if r["cloud"] == "honest"):
        cell = [r for r in rows if r["cloud"] == "honest" and r["codec"] == codec]
        alarms = sum(1 for r in cell if r["detected_step"])
        lines.append(f"| {codec} | {len(cell)} | {alarms} | {sum(int(r['probes']) for r in cell)} | "
                     f"{_values(cell, 'min_honest_ratio', 2, low=True)} | {_values(cell, 'accuracy', 3)} |")
    return "\n".join(lines) + "\n"


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
