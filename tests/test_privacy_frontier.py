"""The frontier grid: the stronger attacks in every row, the cut-later model through a real cloud,
the frontier table and plot, and CSVs written before the new columns still appending cleanly."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from splitft.privacy.evaluate import FRONTIER, run_setting, setting
from splitft.privacy.frontier import plot_frontier
from splitft.privacy.report import append_row, summarise

pytest.importorskip("opacus")


def test_append_row_keeps_the_columns_of_an_older_csv(tmp_path: Path):
    path = tmp_path / "privacy.csv"
    path.write_text("name,seed,accuracy\nidentity,0,0.9\n")
    append_row(path, {"name": "deep", "seed": 1, "accuracy": 0.8, "best_ssim": 0.7})
    rows = list(csv.reader(path.open()))
    assert rows == [["name", "seed", "accuracy"], ["identity", "0", "0.9"], ["deep", "1", "0.8"]]


def _row(name: str, accuracy: float, best: float) -> dict[str, str]:
    numbers = {"accuracy": accuracy, "dcor": 0.5, "inversion_mse": 0.01, "inversion_ssim": best, "label_leak": 1.0,
               "epsilon_spent": 0.0, "activation_bytes": 1e6, "baseline_mse": 0.07, "baseline_ssim": 0.33,
               "fwd_ratio": 1.0, "strong_ssim": best - 0.1, "class_mean_ssim": 0.68, "attacker_class_accuracy": 0.9,
               "class_floor_ssim": 0.683, "best_ssim": best}
    return {"name": name, "codec": "identity", "noise_multipliers": "{}", **{k: str(v) for k, v in numbers.items()}}


def test_rows_with_the_stronger_attacks_get_the_frontier_table_and_plot(tmp_path: Path):
    summary, table = summarise([_row("identity", 0.98, 0.99), _row("deep-noise-0.1", 0.97, 0.68)],
                               ["identity", "deep-noise-0.1"])
    assert "strongest attack SSIM" in table and "| deep-noise-0.1 | identity | 1 | 0.970 |" in table
    assert "0.683" in table  # the class-mean image is named beside the mean image
    assert plot_frontier(summary, tmp_path / "frontier.png").stat().st_size > 10_000


def test_the_cut_later_setting_runs_split_and_meets_every_attack():
    s = setting("deep-noise-0.1")
    assert s.deep and s.cut == "block4" and s.factory == "splitft.privacy.models:digits_deep_edge"
    assert set(FRONTIER) >= {"identity", "deep", "deep-noise-0.1", "adversarial-1"}
    row = run_setting(s, epochs=1, inversion_steps=20, strong_steps=20)
    assert row["activation_bytes"] > 0 and row["epsilon_spent"] > 0
    for key in ("inversion_ssim", "strong_ssim", "class_mean_ssim", "class_floor_ssim"):
        assert -1 <= row[key] <= 1, key
    assert row["best_ssim"] == max(row["inversion_ssim"], row["strong_ssim"], row["class_mean_ssim"])
    assert 0 <= row["attacker_class_accuracy"] <= 1
