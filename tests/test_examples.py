"""The example pair and the BBC benchmark script: the promises the README makes about them."""

from __future__ import annotations

import difflib
import importlib.util
import subprocess
import sys

import pytest

from tests.conftest import ROOT


def test_the_split_example_is_the_local_one_with_at_most_five_lines_changed():
    local = (ROOT / "examples" / "finetune_local.py").read_text().splitlines()
    split = (ROOT / "examples" / "finetune_split.py").read_text().splitlines()
    changed = removed_only = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=local, b=split, autojunk=False).get_opcodes():
        if tag in ("replace", "insert"):
            changed += max(i2 - i1, j2 - j1)
        elif tag == "delete":
            removed_only += i2 - i1
    assert changed + removed_only <= 5


def test_the_split_example_explains_its_options():
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "finetune_split.py"), "--help"],
                            capture_output=True, text=True, timeout=60, env={"PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    assert "--connect" in result.stdout and "--fwd" in result.stdout


def _bench():
    spec = importlib.util.spec_from_file_location("bench_bbc", ROOT / "scripts" / "bench_bbc.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_bbc"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_has_help_and_tabulates_traffic_per_epoch(capsys):
    bench = _bench()
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0 and "frozen+SPEC" in capsys.readouterr().out
    rows = [bench.Result("local", 0.97, 100.0, 5.0, 0.2),
            bench.Result("lowrank:rank=1", 0.96, 110.0, 6.0, 0.3, {
                "up_activation": {"raw": 4 * 2**20, "wire": 2**20, "messages": 2},
                "down_activation": {"raw": 2 * 2**20, "wire": 2**20, "messages": 2},
                "down_gradient": {"raw": 0, "wire": 0, "messages": 2}})]
    text = bench.table(rows, epochs=2)
    assert "| local | 0.9700 | 100 | - |" in text
    assert "| lowrank:rank=1 | 0.9600 | 110 | 0.50 | 0.50 | 4.0x / 2.0x | 0.00 / 0.00 |" in text
