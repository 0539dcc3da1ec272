"""The comparison benchmarks still run: tiny settings, their tables parse, and every variant computes
what the unsplit model computes (the same weights after training; the same generated tokens)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import ROOT

NUMBER = r"\d+\.\d+"
RATIO = rf"(?:{NUMBER} \[{NUMBER}-{NUMBER}\]|-)"


def _run(script: str, *args: str) -> str:
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / script), *args], env=env, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_four_ways_to_a_split_step_train_the_same_weights(tmp_path):
    out = tmp_path / "peers.json"
    text = _run("bench_peers.py", "cnn:8", "encoder:4", "--encoder-layers", "2", "--encoder-width", "16",
                "--seq", "8", "--rounds", "2", "--steps", "2", "--warmup", "1", "--pings", "5", "--json", str(out))
    row = re.compile(rf"^(local|rpc|splitft|raw) +{NUMBER} +{NUMBER} \({NUMBER}\+{NUMBER}\)"
                     rf"(?: +{RATIO}){{4}} +{NUMBER}  bitwise$", re.MULTILINE)
    assert [m.group(1) for m in row.finditer(text)] == ["local", "rpc", "splitft", "raw"] * 2, text
    trips = re.search(r"empty round trip, median: rpc (\d+) us, splitft (\d+) us, raw (\d+) us", text)
    assert trips and all(float(us) > 0 for us in trips.groups()), text
    results = json.loads(out.read_text())["results"]
    assert [r["workload"]["label"] for r in results] == ["cnn b8", "encoder2 b4"]
    for r in results:
        assert all(w["equal"] and w["max_abs_diff"] == 0 for w in r["weights"].values())
        assert len(r["rounds"]) == 2 and all(m["wall"] > 0 and m["cpu_edge"] > 0 for m in r["rounds"][0].values())
        assert all(r["rounds"][0][v]["cpu_peer"] > 0 for v in ("rpc", "splitft", "raw"))  # the peers' CPU is counted
        assert set(r["summary"]["splitft"]) >= {"wall/raw", "cpu/raw", "wall/local", "cpu/local"}


def test_split_generation_per_token_against_local_gives_the_same_tokens(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "generate.json"
    text = _run("bench_generate.py", "--batch", "1", "3", "--prompt", "6", "--new-tokens", "3", "--rounds", "1",
                "--json", str(out))
    row = re.compile(rf"^ +(\d+) +6 +{NUMBER} +{NUMBER} +{RATIO} +{NUMBER} / {NUMBER}  equal$", re.MULTILINE)
    assert [int(m.group(1)) for m in row.finditer(text)] == [1, 3], text
    cells = json.loads(out.read_text())["cells"]
    assert [(c["batch"], c["prompt"], c["equal"]) for c in cells] == [(1, 6, True), (3, 6, True)]
    assert all(c["local_ms"] > 0 and c["split_ms"] > 0 for c in cells)


def test_the_seeds_script_trains_c3sl_on_the_deep_cloud_half_and_tabulates_it():
    """digits_deep keeps digits_cnn's edge (the task's cut, 32x8x8 per sample) before four
    convolutions; scripts/seeds.py trains through C3-SL on it and prints a table row per codec."""
    import torch

    from splitft.app.models import digits_cnn, digits_deep

    deep, usual = digits_deep(seed=0), digits_cnn(seed=0)
    assert list(deep)[:2] == [deep.block1, deep.block2]
    x = torch.zeros(2, 1, 8, 8)
    assert deep.block2(deep.block1(x)).shape == usual.block2(usual.block1(x)).shape == (2, 32, 8, 8)
    assert sum(isinstance(m, torch.nn.Conv2d) for m in deep[2:].modules()) == 4
    assert deep(x).shape == (2, 10)
    text = _run("seeds.py", "c3sl:r=4", "--seeds", "1", "--epochs", "1")
    assert re.search(rf"^c3sl:r=4 seed 0: test accuracy {NUMBER}, fwd 4\.0x, bwd 4\.0x", text, re.MULTILINE), text
    row = re.search(rf"^\| deep \| `c3sl:r=4` \| `identity` \| 1 \| ({NUMBER}) \| 4\.0x \| 4\.0x \|$", text, re.MULTILINE)
    assert row and 0.0 <= float(row.group(1)) <= 1.0, text


def test_the_offload_benchmark_prints_the_step_ratio():
    text = _run("bench_offload.py", "--width", "64", "--layers", "2", "--batch", "4", "--steps", "4")
    assert re.search(rf"median step in memory {NUMBER} ms, offloaded {NUMBER} ms, ratio {NUMBER}$", text, re.M), text


def test_the_error_bound_benchmark_keeps_every_bound():
    rows = [line.split(" | ") for line in _run("bench_errbound.py").splitlines() if "errbound" in line]
    assert len(rows) == 9 and all(float(error) <= float(bound.rstrip(" |")) for *_, error, bound in rows), rows


def test_the_allocator_benchmark_times_a_step_under_each_setting():
    text = _run("bench_allocator.py", "cnn:256", "--rounds", "1", "--steps", "5")
    row = re.compile(rf"^ +cnn:256 +(defaults|mmap4|splitft) +{NUMBER} +{NUMBER} +(\d+) +{NUMBER}x \[{NUMBER}-{NUMBER}\]$",
                     re.MULTILINE)
    faults = {m.group(1): int(m.group(2)) for m in row.finditer(text)}
    assert set(faults) == {"defaults", "mmap4", "splitft"}, text
    # glibc's defaults return the heap's free top each step and fault it back in; the commands keep it
    assert faults["splitft"] < faults["defaults"] / 4, text


def test_the_cold_probe_benchmark_times_each_probe_in_both_edges():
    text = _run("bench_cold.py", "--batch", "8", "--steps", "20")
    rows = {m.group(1): [float(v) for v in m.groups()[1:]] for m in re.finditer(
        rf"^(empty|equal|equal 2nd|python) +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER}) +({NUMBER})$", text, re.M)}
    assert set(rows) == {"empty", "equal", "equal 2nd", "python"}, text
    assert all(value > 0 for values in rows.values() for value in values), text
