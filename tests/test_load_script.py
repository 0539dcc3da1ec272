"""scripts/load_cloud.py still runs: a small load with lost replies loses and repeats no step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import ROOT


def test_load_script_with_lost_replies_loses_no_step(tmp_path):
    out = tmp_path / "load.json"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "load_cloud.py"), "--edges", "3", "--steps", "12",
                             "--procs", "1", "--drop", "0.05", "--timeout", "0.3", "--json", str(out)],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    assert figures["steps_lost"] == 0 and figures["steps_repeated"] == 0
    assert figures["steps_applied_by_cloud"] == 36 and figures["weights_equal_to_local"] == "3/3"
    assert figures["recoveries"] == figures["requests_repeated_and_answered_from_cache"]


def test_load_script_against_two_ranks_loses_no_step_and_compares_with_one(tmp_path):
    out = tmp_path / "load.json"
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "load_cloud.py"), "--edges", "4", "--steps", "6",
                             "--procs", "1", "--ranks", "2", "--json", str(out)],
                            env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    assert figures["ranks"] == 2 and sum(figures["sessions_per_rank"]) == 4
    assert figures["steps_lost"] == figures["steps_repeated"] == figures["one_rank_steps_lost"] == 0
    assert figures["weights_equal_to_local"] == figures["one_rank_weights_equal_to_local"] == "4/4"
    assert figures["throughput_vs_one_rank"] > 0
