"""The one runner behind `splitft edge`, `splitft demo`, the experiments and the ablations."""

from __future__ import annotations

import pytest
import torch

from splitft import Codecs, Factory, Faults, Schedule
from splitft.app.cli import _build_parser, _task_run
from splitft.errors import ConfigError
from splitft.app.experiment import run_task
from splitft.app.runner import TaskRun


def test_the_command_line_builds_the_run_the_library_would():
    args = _build_parser().parse_args(["edge", "--fwd", "fp16", "--micro-batches", "2", "--timeout", "5",
                                       "--seed", "3", "--heartbeat", "0", "--topology", "ushape"])
    assert _task_run(args) == TaskRun(codecs=Codecs("fp16", seed=3), schedule=Schedule(2),
                                      faults=Faults(timeout=5, heartbeat=0), seed=3, topology="ushape", progress=True)
    named = _build_parser().parse_args(["demo", "--model", "splitft.app.models:digits_bsl"])
    assert _task_run(named).factory == Factory("splitft.app.models:digits_bsl")
    same = _build_parser().parse_args(["demo", "--model", "splitft.app.models:digits_cnn"])
    assert _task_run(same).factory is None  # the task's own model: its weights as the task says


def test_a_run_checks_its_task_and_topology():
    with pytest.raises(ConfigError, match="unknown task 'mnist'"):
        TaskRun(task="mnist")
    with pytest.raises(ConfigError, match="'plain' or 'ushape'"):
        TaskRun(topology="u")  # type: ignore[arg-type]


def test_a_run_trains_counts_its_bytes_and_leaves_the_callers_generator_alone():
    torch.manual_seed(123)
    before = torch.get_rng_state()
    result = run_task("digits", "fp16", epochs=1, limit=128, batch_size=64, timeout=60)
    assert torch.equal(torch.get_rng_state(), before)
    assert result.steps == 2 and len(result.history) == 1 and 0 <= result.accuracy <= 1
    assert result.fwd == "fp16" and result.fwd_ratio == pytest.approx(2.0, rel=0.05)
    assert result.bytes_up == result.metrics.direction("up").wire > 0


def test_privacy_options_on_the_command_line_reach_the_run():
    from splitft.app.runner import PrivacyRun

    args = _build_parser().parse_args(["demo", "--dp-epsilon", "3", "--dp-on", "labels", "--leak-loss", "0.5"])
    privacy = _task_run(args).privacy
    assert privacy == PrivacyRun(leak_loss=0.5, epsilon=3.0, on="labels")
    defences = privacy.defences(sample_rate=0.1, epochs=2)
    assert defences.activations is None and defences.label_gradients.clip == 1.0 and defences.leak_loss == 0.5
    assert defences.budget.epsilon == 3.0 and defences.budget.sample_rate == 0.1
    assert _task_run(_build_parser().parse_args(["demo"])).privacy is None


def test_a_private_run_spends_its_budget_and_no_more():
    import transports
    from splitft.cloud import CloudServer, serve_in_thread
    from splitft.app.runner import PrivacyRun, run

    listener = transports.InprocListener()
    server = CloudServer(listener, ["splitft.app.models:digits_cnn"])
    thread = serve_in_thread(server)
    try:
        result = run(TaskRun(epochs=1, limit=128, batch_size=64, topology="ushape",
                             privacy=PrivacyRun(epsilon=4.0, on="both")), listener.connect)
    finally:
        server.stop()
        thread.join(timeout=10)
    assert result.steps == 2 and 0 < result.epsilon <= 4.0 + 1e-6
