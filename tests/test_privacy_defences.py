"""Defences installed from outside: each one computes exactly what a local model with the defence
written into its own loop computes, and with every defence off split training still equals local."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import nn

import splitft
from splitft.app.data import batches, load_digits
from splitft.app.models import digits_cnn
from splitft.privacy import Budget, Defences, Noise, clip_and_noise, distance_correlation, protect
from splitft.privacy.attacks import dcor_score
from tests.conftest import DIGITS

pytest.importorskip("opacus")

STEPS = 6
# The leak loss reaches the edge's gradient as a sum of two terms that autograd adds in another
# order locally; Adam turns that rounding into ~1e-5 differences on near-zero gradients.
REASSOCIATED = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(scope="module")
def data():
    train, _ = load_digits()
    return [(x, y) for (x, y, _), _ in zip(batches(train, 32, shuffle=True, seed=3), range(STEPS))]


def _local(data, *, rejoin: bool, cut: Callable | None = None, trunk_grad: Callable | None = None,
           penalty: Callable | None = None) -> dict[str, torch.Tensor]:
    """The digits CNN trained in one process with the defence written into its forward and loss."""
    model = digits_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for x, y in data:
        z = model.block2(model.block1(x))
        h = model.block3(cut(z) if cut else z)
        if trunk_grad is not None:
            h.register_hook(trunk_grad)
        loss = nn.functional.cross_entropy(model.head(h), y)
        if penalty is not None:
            loss = loss + penalty(x, z)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _split(data, inproc_cloud, defences: Defences, *, rejoin: bool) -> tuple[dict[str, torch.Tensor], object]:
    model = splitft.split(digits_cnn(), "block3", "head" if rejoin else None, factory=DIGITS,
                          connect=inproc_cloud.connect(), faults=splitft.Faults(timeout=30))
    with model:
        protection = protect(model, defences)
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        for x, y in data:
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        state = {**model.edge_state_dict(), **model.cloud_state_dict()}
    return state, protection


def _assert_same(split_state, local_state, **tolerance) -> None:
    assert set(split_state) == set(local_state)
    for name, value in local_state.items():
        torch.testing.assert_close(split_state[name], value, msg=lambda m: f"{name}: {m}", **tolerance)


@pytest.mark.parametrize("rejoin", [False, True], ids=["plain", "ushape"])
def test_every_defence_off_keeps_split_equal_to_local(inproc_cloud, data, rejoin):
    state, protection = _split(data, inproc_cloud, Defences(), rejoin=rejoin)
    _assert_same(state, _local(data, rejoin=rejoin))
    assert protection.steps == STEPS and protection.spent() == 0.0


@pytest.mark.parametrize("rejoin", [False, True], ids=["plain", "ushape"])
def test_leak_loss_trains_the_edge_on_loss_plus_lambda_dcor(inproc_cloud, data, rejoin):
    """The gradient hook gives exactly the gradient of loss + lambda * dcor(x, z), and only that."""
    weight = 0.7
    state, protection = _split(data, inproc_cloud, Defences(leak_loss=weight), rejoin=rejoin)
    local = _local(data, rejoin=rejoin, penalty=lambda x, z: weight * distance_correlation(x, z))
    _assert_same(state, local, **REASSOCIATED)
    assert 0 < protection.last_leak < 1
    # and the penalty mattered: without it the edge ends elsewhere
    plain = _local(data, rejoin=rejoin)
    assert not torch.allclose(plain["block1.0.weight"], local["block1.0.weight"], atol=1e-4)


def test_activation_noise_is_what_the_cloud_computes_on(inproc_cloud, data):
    """Clipping and seeded noise on the edge give the same training as a local model that clips
    and adds the same noise at the cut: the defence sits between the edge and the codec."""
    defences = Defences(activations=Noise(clip=4.0, noise_multiplier=0.05), seed=7,
                        budget=Budget(epsilon=math.inf, delta=1e-5, sample_rate=32 / 1437))
    state, protection = _split(data, inproc_cloud, defences, rejoin=False)
    generator = torch.Generator().manual_seed(7)
    _assert_same(state, _local(data, rejoin=False, cut=lambda z: clip_and_noise(z, 4.0, 0.05, generator)))
    assert protection.noise_multipliers == {"activations": 0.05} and protection.spent() > 0


def test_label_gradient_noise_is_what_the_cloud_trains_on(inproc_cloud, data):
    """U-shape: the gradient returned for the trunk's output is clipped and noised per sample."""
    defences = Defences(label_gradients=Noise(clip=1e-3, noise_multiplier=0.5), seed=11,
                        budget=Budget(epsilon=math.inf, delta=1e-5, sample_rate=32 / 1437))
    seen: list[torch.Tensor] = []
    model = splitft.split(digits_cnn(), "block3", "head", factory=DIGITS, connect=inproc_cloud.connect(),
                          faults=splitft.Faults(timeout=30))
    with model:
        protection = protect(model, defences)
        protection.watch(lambda kind, t: seen.append(t) if kind == "label_gradient" else None)
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
        for x, y in data:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        state = {**model.edge_state_dict(), **model.cloud_state_dict()}
    generator = torch.Generator().manual_seed(11)
    _assert_same(state, _local(data, rejoin=True, trunk_grad=lambda g: clip_and_noise(g, 1e-3, 0.5, generator)))
    assert len(seen) == STEPS and seen[0].shape == (32, 64, 4, 4)


def test_protect_refuses_what_cannot_work(inproc_cloud):
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=inproc_cloud.connect(),
                          faults=splitft.Faults(timeout=30))
    with model:
        budget = Budget(epsilon=3, delta=1e-5, sample_rate=0.05, steps=10)
        with pytest.raises(splitft.ConfigError, match="U-shape"):
            protect(model, Defences(label_gradients=Noise(clip=1.0), budget=budget))
        protect(model, Defences(leak_loss=1.0))
        with pytest.raises(splitft.ConfigError, match="already protected"):
            protect(model, Defences())
        model.privacy.remove()
        assert model.privacy is None
    with pytest.raises(splitft.ConfigError, match="budget"):
        Defences(activations=Noise(clip=1.0))
    with pytest.raises(splitft.ConfigError, match="steps"):
        Defences(activations=Noise(clip=1.0), budget=Budget(epsilon=3, delta=1e-5, sample_rate=0.05))
    with pytest.raises(splitft.ConfigError, match="sample_rate"):
        Budget(epsilon=3, delta=1e-5, sample_rate=64)


@pytest.mark.slow
def test_leak_loss_lowers_distance_correlation_on_digits(inproc_cloud):
    """Three epochs with and without a strong leak loss; the one trained with it leaks less."""
    train, test = load_digits()
    scores = {}
    for weight in (0.0, 10.0):
        model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=inproc_cloud.connect(),
                          faults=splitft.Faults(timeout=30))
        with model:
            protect(model, Defences(leak_loss=weight))
            opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
            crit = model.remote_loss(nn.CrossEntropyLoss())
            for epoch in range(3):
                model.train()
                for x, y, _ in batches(train, 64, shuffle=True, seed=0, epoch=epoch):
                    crit(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
            model.eval()
            with torch.no_grad():
                scores[weight] = dcor_score(test.x, model(test.x).activation)
    assert scores[10.0] < scores[0.0] - 0.1, scores
