"""The privacy table: every setting's accuracy and bytes beside what the attacks recover.

``python scripts/privacy_eval.py`` (and ``scripts/ablate.py --privacy``) run :func:`run_grid`. Each
finished cell (setting, seed) is appended to the CSV at once, so a re-run skips what is done.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .evaluate import FACTORIES, PRESETS, run_setting, setting

log = logging.getLogger(__name__)

#: Steps the model-inversion decoder trains for, unless a run says otherwise.
INVERSION_STEPS = 600

FIELDS = ["name", "codec", "leak_loss", "epsilon", "noise_multiplier", "noise_activations", "noise_labels", "clip",
          "label_clip", "seed", "epochs", "accuracy", "bytes_up", "bytes_down", "activation_bytes", "fwd_ratio",
          "train_seconds", "dcor", "inversion_mse", "inversion_ssim", "baseline_mse", "baseline_ssim", "label_leak",
          "label_chance", "epsilon_spent", "noise_multipliers", "adversarial", "deep", "strong_mse", "strong_ssim",
          "class_mean_ssim", "attacker_class_accuracy", "class_floor_ssim", "best_ssim"]
NUMBERS = ["accuracy", "dcor", "inversion_mse", "inversion_ssim", "label_leak", "epsilon_spent", "activation_bytes",
           "baseline_mse", "baseline_ssim", "fwd_ratio", "strong_ssim", "class_mean_ssim", "attacker_class_accuracy",
           "class_floor_ssim", "best_ssim"]


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def append_row(path: Path, row: dict[str, Any], fields: list[str] = FIELDS) -> None:
    """Append ``row`` to the CSV at ``path`` (a header of ``fields`` first), synced to disk, so a
    long measurement killed midway keeps every row it finished."""
    new = not path.exists()
    if not new:  # a CSV written before the stronger attacks keeps its columns
        with path.open(newline="") as f:
            fields = next(csv.reader(f), fields)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        if new:
            writer.writeheader()
        writer.writerow({k: json.dumps(v) if isinstance(v, dict) else v for k, v in row.items()})
        f.flush()
        os.fsync(f.fileno())


def _mean_std(values: list[float], digits: int = 3) -> str:
    values = [v for v in values if not math.isnan(v)]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def _epsilon(values: list[float]) -> str:
    value = statistics.mean(values)
    if value == 0:
        return "—"
    return f"{value:.3g}" if value < 1e4 else f"{value:.1e}"


def summarise(rows: list[dict[str, str]], order: list[str] | None = None) -> tuple[list[dict[str, Any]], str]:
    """Mean over seeds per setting, and the markdown table."""
    groups: dict[str, list[dict[str, str]]] = defaultdict(list)
    for row in rows:
        groups[row["name"]].append(row)
    position = {name: i for i, name in enumerate(order or list(PRESETS))}
    summary = []
    for name in sorted(groups, key=lambda n: (position.get(n, len(position)), n)):
        cell = groups[name]
        entry: dict[str, Any] = {"name": name, "codec": cell[0]["codec"], "seeds": len(cell),
                                 "noise_multipliers": cell[0]["noise_multipliers"]}
        for key in NUMBERS:
            entry[key] = [float(r[key]) if r.get(key) not in ("", "None", None) else float("nan") for r in cell]
        summary.append(entry)
    baseline = summary[0] if summary else None
    strong = any(not math.isnan(v) for s in summary for v in s["best_ssim"])
    if strong:
        return summary, _strong_table(summary)
    lines = [
        "| setting | codec | seeds | test accuracy | inversion MSE | inversion SSIM | distance corr. "
        "| label leak | activation MB | epsilon spent | noise multiplier |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        sigmas = json.loads(s["noise_multipliers"] or "{}")
        sigma = ", ".join(f"{k.split('_')[0]} {v:.3g}" for k, v in sigmas.items()) or "—"
        lines.append(
            f"| {s['name']} | {s['codec']} | {s['seeds']} | {_mean_std(s['accuracy'])} | "
            f"{_mean_std(s['inversion_mse'], 4)} | {_mean_std(s['inversion_ssim'])} | {_mean_std(s['dcor'])} | "
            f"{_mean_std(s['label_leak'])} | {statistics.mean(s['activation_bytes']) / 1e6:.1f} | "
            f"{_epsilon(s['epsilon_spent'])} | {sigma} |")
    if baseline is not None:
        lines += ["", f"An attack that learned nothing (the auxiliary mean image) scores MSE "
                      f"{statistics.mean(baseline['baseline_mse']):.4f} and SSIM "
                      f"{statistics.mean(baseline['baseline_ssim']):.3f}; label-leak chance is 0.100."]
    return summary, "\n".join(lines) + "\n"


def _strong_table(summary: list[dict[str, Any]]) -> str:
    """The table with every inversion attack, the last column the strongest (the frontier's x)."""
    lines = ["| setting | codec | seeds | test accuracy | inversion SSIM (grid decoder) | learned decoder SSIM "
             "| class-mean attack SSIM | attacker's class accuracy | strongest attack SSIM | distance corr. "
             "| label leak | activation MB | epsilon spent |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(
            f"| {s['name']} | {s['codec']} | {s['seeds']} | {_mean_std(s['accuracy'])} | "
            f"{_mean_std(s['inversion_ssim'])} | {_mean_std(s['strong_ssim'])} | {_mean_std(s['class_mean_ssim'])} | "
            f"{_mean_std(s['attacker_class_accuracy'])} | {_mean_std(s['best_ssim'])} | {_mean_std(s['dcor'])} | "
            f"{_mean_std(s['label_leak'])} | {statistics.mean(s['activation_bytes']) / 1e6:.1f} | "
            f"{_epsilon(s['epsilon_spent'])} |")
    first = summary[0]
    lines += ["", f"An attack that learned nothing (the public mean image) scores SSIM "
                  f"{statistics.mean(first['baseline_ssim']):.3f}; the public mean image of each test image's true "
                  f"class scores {statistics.mean(first['class_floor_ssim']):.3f} (the class-mean attack when it reads "
                  "every class right); label-leak chance is 0.100."]
    return "\n".join(lines) + "\n"


def plot(summary: list[dict[str, Any]], path: Path) -> Path | None:
    """Accuracy against three leakage measures, one point per setting (mean over seeds)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot (pip install -e '.[plots]')")
        return None
    panels = [("inversion_ssim", "inversion SSIM on test images (higher leaks more)", None),
              ("inversion_ssim", "the same, high-accuracy settings only", (0.9, 1.0)),
              ("dcor", "distance correlation, inputs vs what crossed", None),
              ("label_leak", "label-leak attack accuracy (chance 0.1)", None)]
    fig, axes = plt.subplots(2, 2, figsize=(14, 10))
    colours = {s["name"]: plt.get_cmap("tab20")(i % 20) for i, s in enumerate(summary)}
    for ax, (key, label, zoom) in zip(axes.flat, panels):
        shown = [s for s in summary if zoom is None or statistics.mean(s["accuracy"]) >= zoom[0]]
        for i, s in enumerate(shown):
            xs = [v for v in s[key] if not math.isnan(v)]
            if not xs:
                continue
            x, y = statistics.mean(xs), statistics.mean(s["accuracy"])
            ax.errorbar(x, y, xerr=statistics.stdev(xs) if len(xs) > 1 else 0,
                        yerr=statistics.stdev(s["accuracy"]) if len(s["accuracy"]) > 1 else 0, fmt="o", ms=5,
                        color=colours[s["name"]])
            ax.annotate(s["name"], (x, y), fontsize=8, xytext=(5, 8 if i % 2 else -11), textcoords="offset points")
        if key == "inversion_ssim" and zoom is None and summary:
            ax.axvline(statistics.mean(summary[0]["baseline_ssim"]), ls="--", c="grey", lw=1)
            ax.text(statistics.mean(summary[0]["baseline_ssim"]), 0.05, " mean image", fontsize=8, color="grey")
        ax.set_xlabel(label)
        ax.set_ylabel("test accuracy")
        ax.set_ylim(*(zoom or (0, 1.02)))
        if zoom is not None:
            ax.set_ylim(zoom[0], zoom[1] + 0.005)
        ax.grid(alpha=0.3)
    fig.suptitle("digits, U-shape split: accuracy vs leakage (each point: one setting, mean over seeds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def token_table(out: Path, command: str) -> str:
    """Token recovery from MiniLM's hidden states at the BBC cut, written to ``out``/tokens.md
    (headed by ``command``, what made it); returns the table."""
    from .evaluate import token_recovery

    rows = token_recovery()
    lines = ["| setting | token recovery (nearest neighbour) |", "|---|---|"]
    lines += [f"| {r['setting']} | {r['token_recovery']:.3f} |" for r in rows]
    out.mkdir(parents=True, exist_ok=True)
    table = "\n".join(lines) + "\n"
    (out / "tokens.md").write_text(f"<!-- made by: {command} -->\n\n{table}")
    return table


def run_grid(out: Path, names: list[str], *, seeds: int, epochs: int, inversion_steps: int = INVERSION_STEPS,
             strong_steps: int = 0, inproc: bool = False, summary_only: bool = False,
             progress: Callable[[str], None] = lambda line: None) -> str:
    """Run the cells of the grid (settings ``names`` x ``seeds``) that ``out``/privacy.csv does not
    hold yet, each appended as it finishes, then write privacy.md and privacy.png from the CSV and
    return the table. ``progress`` gets a line per cell started; ``inproc`` runs the cloud on a
    thread of this process instead of a ``splitft cloud`` process; ``strong_steps`` > 0 adds the
    attacks of :mod:`splitft.privacy.strong`, trained that many steps."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "privacy.csv"
    settings = [setting(n) for n in names]
    done = {(r["name"], int(r["seed"]), int(r["epochs"])) for r in read_rows(csv_path)}
    todo = [(s, seed) for s in settings for seed in range(seeds) if (s.name, seed, epochs) not in done]
    if todo and not summary_only:
        progress(f"running {len(todo)} cells ({len(settings) * seeds - len(todo)} already in {csv_path})")

        def run_all(address: str | None) -> None:
            for i, (s, seed) in enumerate(todo, 1):
                progress(f"[{i}/{len(todo)}] {s.name} seed {seed}")
                append_row(csv_path, run_setting(s, seed=seed, epochs=epochs, address=address,
                                                 inversion_steps=inversion_steps, strong_steps=strong_steps))

        if inproc:
            run_all(None)
        else:
            from ..app.launch import local_cloud

            with local_cloud(FACTORIES, sessions=0, start_timeout=120, exit_timeout=0, quiet=True) as address:
                run_all(address)
    rows = [r for r in read_rows(csv_path) if int(r["epochs"]) == epochs and r["name"] in names]
    summary, table = summarise(rows, names)
    command = (f"python scripts/privacy_eval.py --out {out} --settings {','.join(names)} --seeds {seeds} "
               f"--epochs {epochs}" + (f" --inversion-steps {inversion_steps}"
                                       if inversion_steps != INVERSION_STEPS else "")
               + (f" --strong-steps {strong_steps}" if strong_steps else "") + (" --inproc" if inproc else ""))
    (out / "privacy.md").write_text(f"<!-- made by: {command} -->\n\n{table}")
    path = plot(summary, out / "privacy.png")
    if any(not math.isnan(v) for s in summary for v in s["best_ssim"]):
        from .frontier import plot_frontier

        plot_frontier(summary, out / "frontier.png")
    if path is not None:
        progress(f"wrote {path}")
    return table
