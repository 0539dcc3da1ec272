"""Streaming a frozen edge's steps: a bounded window in flight, weights equal to synchronous training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft import Faults, Schedule
from splitft.data import batches, load_digits
from splitft.edge.streaming import PendingTensor
from splitft.errors import ConfigError, SplitFTError
from splitft.models import digits_cnn
from tests.conftest import DIGITS

STEPS = 12


@pytest.fixture(scope="module")
def digits():
    return load_digits()[0]


def _train(address, digits, window: int, *, freeze: bool = True, read_each_step: bool = False,
           poison_at: int | None = None):
    """STEPS steps written the way users write them; returns the weights, losses and the most
    steps seen in flight."""
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=address, freeze_edge=freeze,
                          schedule=Schedule(window=window), faults=Faults(timeout=30))
    losses, most = [], 0
    with model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        it = batches(digits, 32, shuffle=True, seed=2)
        for step in range(STEPS):
            x, y, _ = next(it)
            if step == poison_at:
                x = torch.full_like(x, float("nan"))  # the cloud refuses NaN activations
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            most = max(most, len(model.scheduler.window))
            losses.append(loss.item() if read_each_step else loss.detach())
        state = {**model.edge_state_dict(), **model.cloud_state_dict()}
    return state, [float(v) for v in losses], most


def test_a_frozen_edge_streams_a_window_of_steps_and_trains_exactly_as_synchronously(cloud_process, digits):
    _, address, _ = cloud_process
    sync_state, sync_losses, sync_most = _train(address, digits, window=1)
    state, losses, most = _train(address, digits, window=4)
    assert sync_most == 0 and most == 4  # the window filled, and never went past its bound
    assert losses == sync_losses
    for name, value in sync_state.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def test_reading_a_streamed_loss_waits_for_its_value(cloud_process, digits):
    _, address, _ = cloud_process
    _, sync_losses, _ = _train(address, digits, window=1)
    _, losses, most = _train(address, digits, window=4, read_each_step=True)
    assert losses == sync_losses
    assert most <= 1  # each read settled the step: nothing else was in flight


def test_a_streamed_loss_is_pending_until_read_and_backward_does_not_wait(cloud_process, digits):
    _, address, _ = cloud_process
    with splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=address, freeze_edge=True,
                       schedule=Schedule(window=3)) as model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        x, y = digits.x[:16], digits.y[:16]
        first = crit(model(x), y)  # synchronous: it shows what a streamed step's reply looks like
        assert not isinstance(first, PendingTensor)
        first.backward()
        opt.step()
        loss = crit(model(x), y)
        assert isinstance(loss, PendingTensor) and loss.shape == () and loss.requires_grad
        loss.backward()
        opt.step()
        assert len(model.scheduler.window) == 1  # backward and step sent nothing and waited for nothing
        detached = loss.detach()
        assert isinstance(detached, PendingTensor) and len(model.scheduler.window) == 1
        value = float(detached)
        assert len(model.scheduler.window) == 0 and value == float(loss) and value > 0


def test_an_edge_that_needs_gradients_back_is_never_streamed(cloud_process, digits):
    _, address, _ = cloud_process
    sync_state, sync_losses, _ = _train(address, digits, window=1, freeze=False)
    state, losses, most = _train(address, digits, window=4, freeze=False)
    assert most == 0 and losses == sync_losses
    for name, value in sync_state.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0)


def test_a_cloud_error_in_a_streamed_step_is_raised_not_lost(cloud_process, digits):
    _, address, _ = cloud_process
    with pytest.raises(SplitFTError, match="NaN"):
        _train(address, digits, window=4, poison_at=5)


def test_window_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="window"):
            Schedule(window=bad)
