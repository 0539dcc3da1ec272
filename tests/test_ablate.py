"""The ablation script end to end on a tiny grid: CSV, table, plots, and resuming."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

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
