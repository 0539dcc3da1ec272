"""The privacy frontier: test accuracy against what the strongest attack rebuilds, one point per setting.

The goal region (accuracy >= 0.95, SSIM <= 0.5) is shaded; the vertical lines are the public
mean image (an attack that learned nothing) and the public mean image of each target's true class
(what any attack that reads the class gets, which a split accurate enough to use lets it read).
"""

from __future__ import annotations

import logging
import math
import statistics
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def _mean(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.mean(kept) if kept else math.nan


def plot_frontier(summary: list[dict[str, Any]], path: Path, goal: tuple[float, float] = (0.95, 0.5)) -> Path | None:
    """Two panels: the strongest attack's SSIM, and the grid decoder's alone (the weak attacker)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no frontier plot (pip install -e '.[plots]')")
        return None
    fig, axes = plt.subplots(1, 2, figsize=(15, 6.5), sharey=True)
    panels = [("best_ssim", "SSIM of the strongest attack (max of the three)"),
              ("inversion_ssim", "SSIM of the grid's decoder alone (the weak attacker)")]
    for ax, (key, label) in zip(axes, panels):
        ax.axvspan(0, goal[1], ymin=0, ymax=1, color="none")
        ax.fill_between([0, goal[1]], goal[0], 1.02, color="tab:green", alpha=0.12, label="goal region")
        for i, s in enumerate(summary):
            x, y = _mean(s[key]), _mean(s["accuracy"])
            if math.isnan(x):
                continue
            xs = [v for v in s[key] if not math.isnan(v)]
            ax.errorbar(x, y, xerr=statistics.stdev(xs) if len(xs) > 1 else 0,
                        yerr=statistics.stdev(s["accuracy"]) if len(s["accuracy"]) > 1 else 0, fmt="o", ms=5,
                        color=plt.get_cmap("tab20")(i % 20))
            ax.annotate(s["name"], (x, y), fontsize=7, xytext=(4, 6 if i % 2 else -10), textcoords="offset points")
        mean_image = _mean([v for s in summary for v in s["baseline_ssim"]])
        class_floor = _mean([v for s in summary for v in s["class_floor_ssim"]])
        for value, text, style in ((mean_image, "mean image", "--"), (class_floor, "class-mean image", ":")):
            if not math.isnan(value):
                ax.axvline(value, ls=style, c="grey", lw=1)
                ax.text(value, 0.51, " " + text, fontsize=8, color="grey", rotation=90, va="bottom")
        ax.set_xlabel(label)
        ax.set_xlim(0, 1.02)
        ax.set_ylim(0.5, 1.02)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("test accuracy")
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle("digits, U-shape split: accuracy against inversion (one point per setting, mean over seeds)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
