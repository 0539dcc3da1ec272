"""The command line as a user meets it: help, the demo, and two terminals with Ctrl-C."""

from __future__ import annotations

import re
import signal
import subprocess

import pytest

from tests.conftest import PipeReader, splitft_process, start_cloud, stop


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    proc = splitft_process(*args)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        stop(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_help_explains_every_command():
    result = _run("--help")
    assert result.returncode == 0
    for command in ("demo", "cloud", "edge", "codecs"):
        assert command in result.stdout
    for command, options in {"cloud": ["--bind", "--model", "--sessions"],
                             "edge": ["--connect", "--fwd", "--bwd", "--topology", "--cut", "--epochs", "--task",
                                      "--freeze-edge"],
                             "demo": ["--fwd", "--epochs", "--metrics", "--task", "--freeze-edge", "--max-length"]}.items():
        result = _run(command, "--help")
        assert result.returncode == 0
        for option in options:
            assert option in result.stdout, (command, option)


def test_codecs_lists_the_registry():
    result = _run("codecs")
    assert result.returncode == 0 and "identity" in result.stdout and "fp16" in result.stdout


def test_an_option_the_task_does_not_take_is_a_one_line_error():
    result = _run("edge", "--connect", "tcp://127.0.0.1:9", "--task", "digits", "--max-length", "64", timeout=60)
    assert result.returncode == 2
    assert "task 'digits' takes no option max_length" in result.stderr and "Traceback" not in result.stderr


def test_bad_codec_is_a_one_line_error_not_a_traceback(tmp_path):
    cloud, address, _ = start_cloud(tmp_path)
    try:
        result = _run("edge", "--connect", address, "--fwd", "zip", timeout=60)
    finally:
        stop(cloud)
    assert result.returncode == 2
    assert "valid names" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("bad, says", [
    (["--window", "0"], "window (steps in flight) must be a positive integer"),
    (["--delayed-gradients"], "give it window=2 or more"),
    (["--link", "fast"], "cannot read link 'fast'"),
    (["--fwd", "zip"], "unknown codec 'zip'"),
    (["--dp-epsilon", "-1"], "must be a number > 0"),
])
def test_a_bad_demo_setting_is_one_line_before_any_cloud_starts(bad, says):
    result = _run("demo", "--epochs", "1", *bad, timeout=60)
    assert result.returncode == 2
    assert says in result.stderr and "Traceback" not in result.stderr
    assert "cloud:" not in result.stderr  # no cloud was started (and told nothing) for a run that cannot start


@pytest.mark.slow
def test_demo_trains_digits_to_95_percent():
    result = _run("demo", timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    accuracy = float(re.search(r"test accuracy (\d\.\d+)", result.stdout).group(1))
    assert accuracy >= 0.95
    for needle in ("edge -> cloud", "cloud -> edge", "edge compute", "wire", "cloud compute"):
        assert needle in result.stdout
    assert "epoch 15/15" in result.stderr  # a progress bar per epoch


def test_the_demo_gives_each_side_half_the_cores_unless_told_otherwise(monkeypatch):
    import argparse

    import torch

    from splitft.app.cli import _shared_cores

    on_cpu = argparse.Namespace(device="cpu", cloud_device="cpu")
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        assert _shared_cores(on_cpu, 1) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(before)
        monkeypatch.setenv("OMP_NUM_THREADS", str(before))
        assert _shared_cores(on_cpu, 1) is None and torch.get_num_threads() == before  # the user's word stands
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("environment, expected", [(None, "1"), ("3", "3")])
def test_a_cloud_started_here_takes_the_threads_it_is_given_unless_the_environment_names_them(
        tmp_path, monkeypatch, environment, expected):
    from pathlib import Path

    from splitft.app.launch import start_cloud as launch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    if environment is not None:
        monkeypatch.setenv("OMP_NUM_THREADS", environment)
    proc, _ = launch(["splitft.app.models:digits_cnn"], tmp_path / "address", threads=1, quiet=True)
    try:
        variables = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
    finally:
        stop(proc)
    assert f"OMP_NUM_THREADS={expected}".encode() in variables


def _two_terminals(tmp_path):
    cloud, address, cloud_err = start_cloud(tmp_path, "--sessions", "1")
    edge = splitft_process("edge", "--connect", address, "--epochs", "500")
    edge_err = PipeReader(edge.stderr)
    PipeReader(edge.stdout)
    assert edge_err.wait_for("epoch  2/500", 90), edge_err.text
    return cloud, cloud_err, edge, edge_err


def _assert_exit(proc, *readers, timeout: float = 60, expected: int) -> None:
    said = "; the processes said:\n" + "\n---\n".join(r.text[-3000:] for r in readers)
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail("process did not exit" + said)
    assert code == expected, f"exit code {code}, expected {expected}" + said


def test_ctrl_c_on_the_edge_ends_both_cleanly(tmp_path):
    cloud, cloud_err, edge, edge_err = _two_terminals(tmp_path)
    try:
        edge.send_signal(signal.SIGINT)
        _assert_exit(edge, edge_err, cloud_err, expected=130)
        _assert_exit(cloud, edge_err, cloud_err, expected=0)
    finally:
        stop(edge)
        stop(cloud)
    assert "interrupted" in edge_err.text and "Traceback" not in edge_err.text
    assert "ended" in cloud_err.text and "interrupted" in cloud_err.text and "Traceback" not in cloud_err.text


def test_ctrl_c_on_the_cloud_ends_both_cleanly(tmp_path):
    cloud, cloud_err, edge, edge_err = _two_terminals(tmp_path)
    try:
        cloud.send_signal(signal.SIGINT)
        _assert_exit(cloud, edge_err, cloud_err, expected=130)
        _assert_exit(edge, edge_err, cloud_err, expected=1)
    finally:
        stop(edge)
        stop(cloud)
    assert "cloud ended the session" in edge_err.text and "interrupted" in edge_err.text
    assert "Traceback" not in edge_err.text and "Traceback" not in cloud_err.text
