"""The privacy evaluation end to end on a tiny grid: CSV, table, plot, resuming, and ablate --privacy."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytest.importorskip("opacus")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Optimal order is the")
def test_tiny_privacy_grid_end_to_end_and_resume(tmp_path: Path):
    evaluate = _script("privacy_eval")
    args = ["--out", str(tmp_path), "--settings", "identity,label-dp-eps3", "--seeds", "1", "--epochs", "1",
            "--inversion-steps", "30", "--inproc"]
    assert evaluate.main(args) == 0
    rows = {r["name"]: r for r in csv.DictReader((tmp_path / "privacy.csv").open())}
    assert set(rows) == {"identity", "label-dp-eps3"}
    assert float(rows["identity"]["epsilon_spent"]) == 0
    assert 0 < float(rows["label-dp-eps3"]["epsilon_spent"]) <= 3.0
    # the label-leak attack reads labels from clean gradients, and not from protected ones
    assert float(rows["identity"]["label_leak"]) > 0.8 > 0.3 > float(rows["label-dp-eps3"]["label_leak"])
    assert 0 < float(rows["identity"]["dcor"]) <= 1
    table = (tmp_path / "privacy.md").read_text()
    assert "| label-dp-eps3 | identity | 1 |" in table and "inversion SSIM" in table
    assert (tmp_path / "privacy.png").stat().st_size > 10_000
    assert evaluate.main(args) == 0  # every cell is done: nothing runs again
    assert len(list(csv.DictReader((tmp_path / "privacy.csv").open()))) == 2


def test_ablate_privacy_delegates_with_its_codecs_and_the_defences(tmp_path: Path, monkeypatch):
    ablate = _script("ablate")
    import splitft.privacy.report as report

    calls = []
    monkeypatch.setattr(report, "run_grid", lambda out, names, **options: calls.append((out, names, options)) or "")
    assert ablate.main(["--privacy", "--out", str(tmp_path), "--codecs", "identity,acsgd:bits=4,fp16",
                        "--seeds", "2", "--epochs", "3"]) == 0
    ((out, settings, options),) = calls
    assert out == tmp_path
    assert settings[:2] == ["identity", "fp16"] and "acsgd:bits=4" not in settings
    assert {"bsl", "leak", "dp-eps1", "dp-eps3", "dp-eps8", "label-dp-eps3"} <= set(settings)
    assert options["seeds"] == 2 and options["epochs"] == 3 and not options["summary_only"]
