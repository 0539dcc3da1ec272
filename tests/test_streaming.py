"""Streaming a frozen edge's steps: a bounded window in flight, weights equal to synchronous training."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft import Faults, Schedule
from splitft.app.data import batches, load_digits
from splitft.edge.streaming import PendingTensor
from splitft.errors import ConfigError, SplitFTError
from splitft.app.models import digits_cnn
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
                y = torch.full_like(y, 99)  # a label past the classes: the cloud's loss raises
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
    with pytest.raises(SplitFTError, match="out of bounds"):
        _train(address, digits, window=4, poison_at=5)


def test_window_must_be_a_positive_integer():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="window"):
            Schedule(window=bad)


def _train_local_loss(address, digits, window: int):
    """An edge trained on its own loss through a small auxiliary head (nothing crosses back), written
    the way such scripts are: a forward hook takes the edge's activation, both losses backpropagate."""
    torch.manual_seed(0)
    aux_head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 8 * 8, 10))
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=address, freeze_edge=True,
                          schedule=Schedule(window=window), faults=Faults(timeout=30))
    seen = {}
    model.model.block2.register_forward_hook(lambda mod, args, out: seen.__setitem__("act", out))
    losses = []
    with model:
        opt = model.attach(torch.optim.Adam([*model.parameters(), *aux_head.parameters()], lr=3e-3))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        it = batches(digits, 32, shuffle=True, seed=4)
        for _ in range(STEPS):
            x, y, _ = next(it)
            loss = crit(model(x), y)
            local = nn.functional.cross_entropy(aux_head(seen["act"]), y)
            torch.autograd.backward([loss, local])
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        most = len(model.scheduler.window)
        state = {**model.edge_state_dict(), **model.cloud_state_dict(),
                 **{f"aux.{k}": v for k, v in aux_head.state_dict().items()}}
    return state, [float(v) for v in losses], most


def test_an_edge_on_a_local_loss_streams_and_trains_exactly_as_synchronously(cloud_process, digits):
    _, address, _ = cloud_process
    sync_state, sync_losses, _ = _train_local_loss(address, digits, window=1)
    state, losses, most = _train_local_loss(address, digits, window=4)
    assert most == 4 and losses == sync_losses
    initial = digits_cnn().state_dict()["block1.0.weight"]
    assert not torch.equal(state["block1.0.weight"], initial)  # the edge really trains, on its local loss
    for name, value in sync_state.items():
        torch.testing.assert_close(state[name], value, rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


def _delayed_reference(digits, steps: int, lr: float, delay: bool = True) -> dict[str, torch.Tensor]:
    """Delayed-gradient SGD in one process: the cloud half steps on its gradient of this step, the
    edge on its gradient of the step before (computed then, at the weights of then). The first
    step is synchronous; the second has no earlier gradient for the edge."""
    model = digits_cnn()
    edge = [p for n, p in model.named_parameters() if n.startswith(("block1", "block2"))]
    cloud = [p for n, p in model.named_parameters() if not n.startswith(("block1", "block2"))]
    it = batches(digits, 32, shuffle=True, seed=2)
    due: list[torch.Tensor] | None = None
    for step in range(steps):
        x, y, _ = next(it)
        loss = nn.functional.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, edge + cloud)
        now_edge, now_cloud = grads[:len(edge)], grads[len(edge):]
        apply_edge = now_edge if step == 0 or not delay else due
        due = None if step == 0 else list(now_edge)
        with torch.no_grad():
            for p, g in zip(cloud, now_cloud):
                p -= lr * g
            for p, g in zip(edge, apply_edge or []):
                p -= lr * g
    return model.state_dict()


def test_delayed_gradients_apply_each_cut_gradient_one_step_late_to_the_weights_it_was_taken_at(
        cloud_process, digits):
    _, address, _ = cloud_process
    lr = 0.05
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=address, faults=Faults(timeout=30),
                          schedule=Schedule(window=2, delayed_gradients=True))
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=lr))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        it = batches(digits, 32, shuffle=True, seed=2)
        for _ in range(STEPS):
            x, y, _ = next(it)
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        streamed = isinstance(loss, PendingTensor)
        state = {**model.edge_state_dict(), **model.cloud_state_dict()}
    assert streamed
    reference = _delayed_reference(digits, STEPS, lr)
    for name, value in reference.items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    synchronous = _delayed_reference(digits, STEPS, lr, delay=False)  # what the delay changes
    assert not torch.allclose(state["block1.0.weight"], synchronous["block1.0.weight"], atol=1e-4)


def test_delayed_gradients_need_a_window():
    with pytest.raises(ConfigError, match="window"):
        Schedule(delayed_gradients=True)


def test_a_window_that_cannot_apply_says_why_once_instead_of_being_ignored(cloud_process, digits, caplog):
    """A trainable edge asks for a window without delayed gradients: its steps go synchronously,
    as they must, and the user is told why (once), not left to find the window did nothing."""
    _, address, _ = cloud_process
    with caplog.at_level("WARNING", logger="splitft.edge.schedule"):
        _, _, most = _train(address, digits, window=4, freeze=False)
    said = [r.getMessage() for r in caplog.records if r.name == "splitft.edge.schedule"]
    assert most == 0
    assert len(said) == 1 and "window=4 has no effect" in said[0] and "freeze the edge" in said[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="splitft.edge.schedule"):
        _, _, most = _train(address, digits, window=4)  # a frozen edge: the window applies, nothing to say
    assert most == 4 and not [r for r in caplog.records if r.name == "splitft.edge.schedule"]
