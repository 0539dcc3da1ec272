"""The ablation script end to end on a tiny grid: CSV, table, plots, and resuming."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _ablate():
    spec = importlib.util.spec_from_file_location("ablate", ROOT / "scripts" / "ablate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_grid_end_to_end_and_resume(tmp_path: Path):
    ablate = _ablate()
    args = ["--out", str(tmp_path), "--codecs", "identity,c3sl:r=16", "--links", "loopback;1gbit,5ms",
            "--seeds", "1", "--epochs", "1", "--target", "0.5"]
    assert ablate.main(args) == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").open()))
    assert {(r["codec"], r["link"]) for r in rows} == {
        ("identity", "loopback"), ("c3sl:r=16", "loopback"), ("identity", "1gbit,5ms"), ("c3sl:r=16", "1gbit,5ms")}
    by_cell = {(r["codec"], r["link"]): r for r in rows}
    assert float(by_cell[("c3sl:r=16", "loopback")]["fwd_ratio"]) > 14
    # the emulator guarantees a floor: a step is two round trips of 5 ms each way
    slow = by_cell[("identity", "1gbit,5ms")]
    assert float(slow["train_seconds"]) >= int(slow["steps"]) * 2 * 2 * 0.005
    table = (tmp_path / "results.md").read_text()
    assert "link 1gbit,5ms" in table and "speedup vs identity" in table and "| c3sl:r=16 |" in table
    for name in ("accuracy_vs_bytes.png", "time_to_accuracy.png"):
        assert (tmp_path / name).stat().st_size > 10_000
    assert ablate.main(args) == 0  # every cell is done: nothing runs again
    assert len(list(csv.DictReader((tmp_path / "results.csv").open()))) == 4


def test_a_budget_scores_each_cell_by_its_accuracy_discounted_by_what_it_overspends():
    from splitft.app.experiment import budgeted_score

    assert budgeted_score(0.9, {"MB": 10, "seconds": 5}, {"MB": 20, "seconds": 10}) == 0.9  # within: its accuracy
    assert budgeted_score(0.9, {"MB": 40, "seconds": 5}, {"MB": 20, "seconds": 10}) == pytest.approx(0.45)
    assert budgeted_score(0.8, {"MB": 40, "seconds": 40}, {"MB": 20, "seconds": 10}) == pytest.approx(0.8 / 8)
    row = {"task": "digits", "codec": "fp16", "bwd": "fp16", "link": "loopback", "micro_batches": "1", "seed": "0",
           "epochs": "1", "accuracy": "0.9", "train_seconds": "5", "time_to_target": "", "fwd_ratio": "2",
           "bwd_ratio": "2", "bytes_up": str(30 * 10**6), "bytes_down": str(10 * 10**6), "steps": "10",
           "history": "[]"}
    ablate = _ablate()
    summary, table = ablate.summarise([row], 0.95, ablate.parse_budget("20,10"))
    assert summary[0]["score"] == pytest.approx(0.45) and "score within 20 MB, 10 s" in table and "0.4500" in table
