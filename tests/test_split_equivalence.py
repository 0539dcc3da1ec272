"""Invariant 1: with the identity codec, split training equals training in one process."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import splitft
from splitft import Faults, Schedule
import transports
from splitft.app.data import batches, load_digits
from splitft.errors import ConfigError
from splitft.app.models import digits_cnn
from tests.conftest import DIGITS
from tests.models import mlp, residual_net

STEPS = 20
ACCUMULATE = 2


def _train(model, opt, crit, data, sched, ids: bool = False) -> list[float]:
    """STEPS optimizer steps, each accumulating ACCUMULATE backward calls over half-batches."""
    losses = []
    it = batches(data, 32, shuffle=True, seed=1)
    for _ in range(STEPS):
        x, y, sample_ids = next(it)
        for part in torch.chunk(torch.arange(len(y)), ACCUMULATE):
            out = model(x[part], sample_ids=sample_ids[part]) if ids else model(x[part])
            loss = crit(out, y[part]) / ACCUMULATE
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        sched.step()
        opt.zero_grad()
    return losses


def _local_run(data):
    model = digits_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
    losses = _train(model, opt, nn.CrossEntropyLoss(), data, sched)
    return model.state_dict(), losses


def _split_run(data, rejoin, connect, micro_batches=1, eager_backward=True):
    model = splitft.split(digits_cnn(), "block3", rejoin, factory=DIGITS, connect=connect, faults=Faults(timeout=30),
                          schedule=Schedule(micro_batches=micro_batches, eager_backward=eager_backward))
    with model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.5)
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        losses = _train(model, opt, crit, data, sched, ids=True)
        edge_state = model.edge_state_dict()
        cloud_state = model.cloud_state_dict()
        forwards = model.metrics.bytes[("up", "activation")].messages
    assert forwards == STEPS * ACCUMULATE * micro_batches  # each call really went out in parts
    return edge_state, cloud_state, losses


def _assert_same(local, split, **tolerance) -> None:
    local_state, local_losses = local
    edge_state, cloud_state, split_losses = split
    assert set(edge_state) | set(cloud_state) == set(local_state)
    assert set(edge_state).isdisjoint(cloud_state)
    for name, value in {**edge_state, **cloud_state}.items():
        torch.testing.assert_close(value, local_state[name], msg=lambda m: f"{name}: {m}", **tolerance)
    torch.testing.assert_close(torch.tensor(split_losses), torch.tensor(local_losses), **tolerance)


# Micro-batches sum the batch's gradient in another order; Adam then turns rounding on
# near-zero gradients into ~1e-5 differences after 20 steps. A wrong weighting of the parts
# would be off by orders of magnitude more.
REASSOCIATED = {"rtol": 1e-4, "atol": 1e-4}


def _train_both_and_compare(local, split_model, make_opt, xs, ys) -> None:
    """Train a local model and its split twin on the same batches; every parameter must match."""
    for model in (local, split_model):
        opt = make_opt(model.parameters())
        if model is split_model:
            model.attach(opt)
        for x, y in zip(xs, ys):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    state = {**split_model.edge_state_dict(), **split_model.cloud_state_dict()}
    split_model.close()
    assert set(state) == set(local.state_dict())
    for name, value in local.state_dict().items():
        torch.testing.assert_close(state[name], value)


@pytest.fixture(scope="module")
def digits():
    return load_digits()[0]


@pytest.fixture(scope="module")
def local(digits):
    return _local_run(digits)


@pytest.mark.parametrize("rejoin", [None, "head"], ids=["plain", "ushape"])
def test_inproc_split_equals_local(inproc_cloud, digits, local, rejoin):
    _assert_same(local, _split_run(digits, rejoin, connect=inproc_cloud.connect()))


def test_plain_split_with_a_backward_message_per_call_equals_local(inproc_cloud, digits, local):
    """The same, with eager backward off: the loss's gradient travels in its own request."""
    _assert_same(local, _split_run(digits, None, connect=inproc_cloud.connect(), eager_backward=False))


@pytest.mark.parametrize("rejoin", [None, "head"], ids=["plain", "ushape"])
def test_zmq_two_process_split_equals_local(cloud_process, digits, local, rejoin):
    _, address, _ = cloud_process
    _assert_same(local, _split_run(digits, rejoin, connect=address))


@pytest.mark.parametrize("rejoin", [None, "head"], ids=["plain", "ushape"])
def test_micro_batches_keep_split_equal_to_local(inproc_cloud, digits, local, rejoin):
    """Pipelined micro-batches (uneven: 16 rows in 3 parts) still give the full batch's gradient."""
    _assert_same(local, _split_run(digits, rejoin, connect=inproc_cloud.connect(), micro_batches=3),
                 **REASSOCIATED)


def test_zmq_two_process_micro_batches_equal_local(cloud_process, digits, local):
    _, address, _ = cloud_process
    _assert_same(local, _split_run(digits, None, connect=address, micro_batches=4), **REASSOCIATED)


def test_ushape_on_a_non_chain_model_equals_local(inproc_cloud):
    """The model's own forward (functional ops, a skip connection) runs; only stage1..2 move."""
    torch.manual_seed(0)
    xs, ys = torch.randn(10, 8, 12), torch.randint(0, 3, (10, 8))
    local = residual_net()
    split_model = splitft.split(residual_net(), "stage1", "head", factory="tests.models:residual_net",
                                connect=inproc_cloud.connect())
    _train_both_and_compare(local, split_model, lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), xs, ys)


def test_evaluation_matches_and_leaves_weights_alone(inproc_cloud, digits):
    local = digits_cnn()
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=inproc_cloud.connect())
    with model:
        model.eval()
        local.eval()
        x = digits.x[:50]
        with torch.no_grad():
            torch.testing.assert_close(model.predict(x), local(x))
        torch.testing.assert_close(model.cloud_state_dict()["block3.0.weight"], local.state_dict()["block3.0.weight"])


def test_frozen_edge_sends_no_gradient_but_trains_the_cloud(inproc_cloud, digits):
    """SFT's eliminated link: nothing on the edge needs a gradient, so none crosses back."""
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=inproc_cloud.connect())
    with model:
        for p in model.edge_parameters():
            p.requires_grad_(False)
        opt = torch.optim.SGD(model.cloud_parameters(), lr=0.1)
        crit = model.remote_loss(nn.CrossEntropyLoss())
        before = model.cloud_state_dict()["head.1.weight"].clone()
        x, y, _ = next(batches(digits, 32, shuffle=False))
        crit(model(x), y).backward()
        opt.step()
        after = model.cloud_state_dict()["head.1.weight"]
        assert not torch.equal(before, after)
        assert model.metrics.bytes[("down", "gradient")].raw == 0


def test_adamw_settings_are_mirrored(inproc_cloud):
    """AdamW's defaults hold a key its constructor refuses; only constructor settings cross."""
    torch.manual_seed(0)
    xs, ys = torch.randn(4, 8, 12), torch.randint(0, 3, (4, 8))
    local = mlp()
    split_model = splitft.split(mlp(), "2", "4", factory="tests.models:mlp", connect=inproc_cloud.connect())
    _train_both_and_compare(local, split_model, lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1), xs, ys)


@pytest.mark.parametrize("loss", ["class weights", "ignored targets", "a part all ignored"])
def test_micro_batches_of_a_weighted_or_ignoring_cross_entropy_give_the_batchs_loss(inproc_cloud, loss):
    """A class-weighted cross-entropy's mean divides by the weights of the batch's targets, and one
    with ignore_index by the targets it counts: micro-batches weigh their parts' losses by those
    (by rows they were another loss, and a part whose targets were all ignored made it NaN)."""
    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 12, generator=g), torch.randint(0, 3, (8,), generator=g)) for _ in range(4)]
    for i, (_, y) in enumerate(data):
        if loss == "ignored targets":
            y[i % 8] = y[(i + 3) % 8] = -100
        elif loss == "a part all ignored":
            y[:4] = -100
    make_crit = (lambda: nn.CrossEntropyLoss(weight=torch.tensor([1.0, 4.0, 0.25]))) if loss == "class weights" \
        else nn.CrossEntropyLoss

    def train(model, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in data:
            value = crit(model(x), y)
            value.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(value))
        return losses

    local = mlp()
    expected = train(local, make_crit())
    with splitft.split(mlp(), 2, factory="tests.models:mlp", connect=inproc_cloud.connect(),
                       schedule=Schedule(micro_batches=2)) as model:
        got = train(model, model.remote_loss(make_crit()))
        state = model.state_dict()
    assert got == pytest.approx(expected, rel=1e-6)
    for name, value in local.state_dict().items():
        torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6)


def test_micro_batches_through_a_cloud_batchnorm_are_refused_before_anything_diverges(inproc_cloud, digits):
    """BatchNorm in the cloud half, in training mode, would normalize each micro-batch by its own
    statistics: the step would not be the unsplit model's. Refused at the first cloud call, before
    anything is sent; in eval mode it uses running statistics and micro-batches stay exact."""
    x, y = digits.x[:16], digits.y[:16]
    local = digits_cnn()
    local.block1(x)  # what the refused call did: the edge's half ran (its BatchNorm statistics moved), the cloud's not
    local.eval()
    with splitft.split(digits_cnn(), "block2", factory=DIGITS, connect=inproc_cloud.connect(),
                       schedule=Schedule(micro_batches=2)) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        with pytest.raises(ConfigError, match=r"micro_batches=2 would run block2\.1 \(BatchNorm2d\)"):
            crit(model(x), y)
        model.eval()
        with torch.no_grad():
            torch.testing.assert_close(crit(model(x), y), nn.functional.cross_entropy(local(x), y))
