"""TensorBoard event files for a split run: `splitft edge --tensorboard`, `splitft.TensorBoard` in a
script, and a transformers Trainer's own `report_to="tensorboard"` on a split model, each read back
with TensorBoard's own reader against a real cloud process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

import splitft  # noqa: E402
from splitft import Faults  # noqa: E402
from splitft.app.cli import main  # noqa: E402
from splitft.app.data import batches, load_digits  # noqa: E402
from splitft.app.models import digits_cnn  # noqa: E402
from tests.conftest import DIGITS, start_cloud, stop  # noqa: E402

TIMES = ("time/edge_compute", "time/edge_codec", "time/wire", "time/cloud_compute", "time/cloud_codec")


def events(folder: Path) -> EventAccumulator:
    """The scalars of the one run written under ``folder`` (TensorBoard's reader)."""
    (run,) = {f.parent for f in folder.rglob("events.out.tfevents.*")}
    return EventAccumulator(str(run)).Reload()


def series(acc: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in acc.Scalars(tag)]


@pytest.fixture(scope="module")
def digits_cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", DIGITS)
    yield address
    stop(proc)


def test_splitft_edge_writes_loss_accuracy_traffic_time_and_privacy(digits_cloud, tmp_path, capsys):
    board = tmp_path / "tb"
    status = main(["edge", "--connect", digits_cloud, "--epochs", "2", "--limit", "128", "--fwd", "fp16",
                   "--dp-epsilon", "50", "--tensorboard", str(board)])
    assert status == 0, capsys.readouterr().err
    acc = events(board)
    steps = 2 * 2  # 128 samples in batches of 64, two epochs
    assert [s for s, _ in series(acc, "train/loss")] == [2, 4]
    assert [s for s, _ in series(acc, "test/accuracy")] == [2, 4]
    assert all(0 <= a <= 1 for _, a in series(acc, "test/accuracy"))
    for tag in ("traffic/up_bytes", "traffic/down_bytes"):
        values = series(acc, tag)
        assert [s for s, _ in values] == list(range(1, steps + 1))
        assert all(v > 64 * 32 * 8 * 8 * 2 for _, v in values)  # an fp16 activation or gradient each step
    assert 1.9 < series(acc, "traffic/up_ratio")[-1][1] < 2.0
    for tag in TIMES:
        assert len(series(acc, tag)) == steps and all(v >= 0 for _, v in series(acc, tag))
    assert sum(v for tag in ("time/wire", "time/cloud_compute") for _, v in series(acc, tag)) > 0
    spent = [v for _, v in series(acc, "privacy/epsilon")]
    assert len(spent) == steps and 0 < spent[0] < spent[-1] <= 50


def test_a_script_writes_a_split_models_figures_through_splitft_tensorboard(digits_cloud, tmp_path):
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=digits_cloud,
                          faults=Faults(timeout=30, heartbeat=0))
    with model, splitft.TensorBoard(tmp_path / "tb") as board:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        up, down = model.metrics.direction("up").wire, model.metrics.direction("down").wire
        board.watch(model, opt)
        for (x, y, _), _ in zip(batches(load_digits()[0], 32, shuffle=True), range(3)):
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            board.log(loss=loss.item())
        up = model.metrics.direction("up").wire - up
        down = model.metrics.direction("down").wire - down
    acc = events(tmp_path / "tb")
    assert [s for s, _ in series(acc, "loss")] == [1, 2, 3]
    assert sum(v for _, v in series(acc, "traffic/up_bytes")) == up  # every byte of the steps, once
    assert sum(v for _, v in series(acc, "traffic/down_bytes")) == down
    assert "privacy/epsilon" not in acc.Tags()["scalars"]  # no budget, no figure


def test_tensorboard_without_the_package_says_which_extra(monkeypatch, tmp_path, capsys):
    import sys

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(splitft.ConfigError, match=r"splitft\[tensorboard\]"):
        splitft.TensorBoard(tmp_path / "tb")

    def no_cloud(*_, **__):
        raise AssertionError("a cloud was started for a run that cannot write its events")

    monkeypatch.setattr("splitft.app.launch.local_cloud", no_cloud)
    assert main(["demo", "--tensorboard", str(tmp_path / "tb")]) == 2  # said before a cloud starts
    assert "splitft[tensorboard]" in capsys.readouterr().err


def test_a_trainer_on_a_split_model_reports_to_tensorboard(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from tests.models import tiny_hf
    from tests.test_trainer_split import CUTS, FACTORY, _examples

    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", FACTORY)
    try:
        model = splitft.split(tiny_hf("bert"), CUTS["bert"], factory=splitft.Factory(FACTORY, {"kind": "bert"}),
                              connect=address)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_train_epochs=1,
            learning_rate=5e-3, seed=0, use_cpu=True, report_to="tensorboard", logging_strategy="steps",
            logging_steps=1, save_strategy="no", disable_tqdm=True)
        with model:
            transformers.Trainer(model=model, args=args, train_dataset=_examples("bert", n=12)).train()
    finally:
        stop(proc)
    acc = events(tmp_path / "out")
    losses = series(acc, "train/loss")
    assert [s for s, _ in losses] == [1, 2, 3] and all(v > 0 for _, v in losses), err.text
