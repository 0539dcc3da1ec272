"""scripts/time_to_accuracy.py end to end on the digits task: both phases, the losses check, resuming."""

from __future__ import annotations

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("time_to_accuracy", ROOT / "scripts" / "time_to_accuracy.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_steps_on_loopback_then_the_same_steps_timed_on_a_link(tmp_path: Path):
    tta = _script()
    args = ["--task", "digits", "--out", str(tmp_path), "--rows", "identity,frozen+fp16", "--links", "1gbit,5ms",
            "--target", "0.3", "--eval-every", "2", "--max-steps", "8", "--window", "3"]
    assert tta.main(args) == 0
    cells = {(r["row"], r["link"]): r for r in csv.DictReader((tmp_path / "tta.csv").open())}
    assert set(cells) == {(r, link) for r in ("identity", "frozen+fp16") for link in ("loopback", "1gbit,5ms")}
    for row in ("identity", "frozen+fp16"):
        first, timed = cells[(row, "loopback")], cells[(row, "1gbit,5ms")]
        reached = json.loads(first["history"])["accuracy"]
        assert reached[-1][0] == int(first["steps"]) and reached[-1][1] >= 0.3
        assert timed["steps"] == first["steps"] and timed["losses_equal"] == "True"
    sync, stream = cells[("identity", "1gbit,5ms")], cells[("frozen+fp16", "1gbit,5ms")]
    # a synchronous step waits a round trip (10 ms): the emulator's floor, and part of the limit
    assert float(sync["seconds"]) >= int(sync["steps"]) * 0.010
    assert float(sync["round_trip_s"]) == pytest.approx(0.010) and float(stream["round_trip_s"]) == 0
    limit = max(float(sync[k]) for k in ("edge_s", "cloud_s", "wire_s")) + float(sync["round_trip_s"])
    assert float(sync["limit_s"]) == pytest.approx(limit, abs=1e-4)
    assert int(stream["bytes_down"]) < int(sync["bytes_down"]) / 10  # a frozen edge gets no gradient back
    table = (tmp_path / "tta.md").read_text()
    assert "#### 1gbit,5ms" in table and "| frozen+fp16 |" in table and "| NO |" not in table
    assert tta.main(args) == 0  # every cell is done: nothing runs again
    assert len(list(csv.DictReader((tmp_path / "tta.csv").open()))) == 4


def test_a_language_model_gets_down_to_a_perplexity_and_a_row_that_never_did_says_so():
    tta = _script()
    metric = tta.Metric("smollm-plain")
    assert metric.reached(46.9, 47) and not metric.reached(47.1, 47) and metric.label(47.0) == "perplexity 47"
    accuracy = tta.Metric("bbc-plain")
    assert accuracy.reached(0.95, 0.95) and not accuracy.reached(0.94, 0.95) and accuracy.label(0.95) == "95%"
    history = json.dumps({"accuracy": [[4, 900.0], [8, 812.5]], "losses": [7.0] * 8})
    cells = {("lowrank:rank=1", "loopback"): {"row": "lowrank:rank=1", "link": "loopback", "steps": "8",
                                              "history": history}}
    table = tta.table(cells, ["lowrank:rank=1"], ["10mbit,50ms"], metric, 47.0)
    assert "steps to perplexity 47" in table
    assert "| lowrank:rank=1 | not reached in 8 steps (812.5 at the last evaluation) |" in table
