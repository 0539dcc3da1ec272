"""The noise is what the budget calls for, the epsilon reported is opacus's, and a spent budget
stops training before anything is sent."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

import splitft
from splitft.app.data import batches, load_digits
from splitft.app.models import digits_bsl, digits_cnn
from splitft.privacy import (Budget, Defences, Noise, PrivacyAccountant, PrivacyBudgetExceeded, calibrate, protect,
                             randomized_response_rdp)
from tests.conftest import DIGITS, InprocCloud

opacus = pytest.importorskip("opacus")
from opacus.accountants import RDPAccountant  # noqa: E402
from opacus.accountants.analysis import rdp as analysis  # noqa: E402
from opacus.accountants.utils import get_noise_multiplier  # noqa: E402

RATE = 64 / 1437
BSL = "splitft.app.models:digits_bsl"
pytestmark = pytest.mark.filterwarnings("ignore:Optimal order is the")


def _split(inproc_cloud, defences: Defences, rejoin: str | None = None):
    model = splitft.split(digits_cnn(), "block3", rejoin, factory=DIGITS, connect=inproc_cloud.connect(),
                          faults=splitft.Faults(timeout=30))
    protect(model, defences)
    return model


def test_noise_has_the_calibrated_standard_deviation(inproc_cloud):
    """Seeded: what crosses minus the activation is N(0, (sigma * clip)²) with sigma from the budget."""
    budget = Budget(epsilon=3.0, delta=1e-5, sample_rate=RATE, steps=200)
    clip = 1e3  # above every activation's norm: nothing is clipped, the difference is the noise alone
    model = _split(inproc_cloud, Defences(activations=Noise(clip=clip), budget=budget, seed=5))
    crossed, activation = [], []
    model.model.block2.register_forward_hook(lambda m, a, out: activation.append(out.detach()))
    model.privacy.watch(lambda kind, t: crossed.append(t))
    with model:
        x = load_digits()[0].x[:64]
        model(x)
    sigma = get_noise_multiplier(target_epsilon=3.0, target_delta=1e-5, sample_rate=RATE, steps=200, accountant="rdp")
    assert model.privacy.noise_multipliers["activations"] == pytest.approx(sigma, rel=1e-12)
    noise = (crossed[0] - activation[0]).double().reshape(-1)
    assert noise.numel() == 64 * 2048
    # 131072 draws: the sample std is within 0.6 % of the true one with overwhelming probability
    assert noise.std().item() == pytest.approx(sigma * clip, rel=6e-3)
    assert abs(noise.mean().item()) < 4 * sigma * clip / math.sqrt(noise.numel())
    # the same seed gives the same noise; the cloud's codec seed plays no part in it
    assert crossed[0].shape == activation[0].shape


def test_clipping_bounds_each_sample_norm(inproc_cloud):
    model = _split(inproc_cloud, Defences(activations=Noise(clip=2.0, noise_multiplier=1e-9), seed=0,
                                          budget=Budget(epsilon=math.inf, delta=1e-5, sample_rate=RATE)))
    crossed = []
    model.privacy.watch(lambda kind, t: crossed.append(t))
    with model:
        model(load_digits()[0].x[:16])
    norms = crossed[0].reshape(16, -1).norm(dim=1)
    torch.testing.assert_close(norms, torch.full((16,), 2.0), rtol=1e-4, atol=1e-4)


def test_epsilon_reported_is_the_accountants_for_the_same_sigma_rate_and_steps(inproc_cloud):
    budget = Budget(epsilon=8.0, delta=1e-5, sample_rate=RATE, epochs=1)
    model = _split(inproc_cloud, Defences(activations=Noise(clip=1.0), budget=budget, seed=1))
    train = load_digits()[0]
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.01))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for (x, y, _), _ in zip(batches(train, 64, shuffle=True), range(5)):
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(train.x[:64])  # evaluation forwards are not training steps
    sigma = model.privacy.noise_multipliers["activations"]
    reference = RDPAccountant()
    reference.history = [(sigma, RATE, 5)]
    assert model.privacy.steps == 5
    assert model.privacy.spent() == reference.get_epsilon(1e-5)
    assert 0 < model.privacy.spent() < 8.0


def test_activation_and_label_noise_share_one_step_and_one_budget():
    """Both releases of a step are one Gaussian mechanism: 1/s² = 1/s_a² + 1/s_g² meets the budget."""
    target = calibrate(epsilon=3.0, delta=1e-5, sample_rate=RATE, steps=100)
    a = PrivacyAccountant(1e-5)
    for _ in range(100):
        a.step(noise_multiplier=target, sample_rate=RATE)
    assert a.epsilon() == pytest.approx(3.0, abs=0.011)  # opacus's bisection stops within 0.01
    assert a.epsilon() <= 3.0


def test_randomized_response_rdp_is_the_renyi_divergence_of_flipped_bits():
    """Checked against the definition: D_a(P||Q) = log(sum P^a Q^(1-a)) / (a-1), P = (p, q), Q = (q, p)."""
    eps = 0.7
    p = math.exp(eps) / (1 + math.exp(eps))
    q = 1 - p
    orders = [1.5, 2.0, 8.0, 40.0]
    direct = [math.log(p ** a * q ** (1 - a) + q ** a * p ** (1 - a)) / (a - 1) for a in orders]
    np.testing.assert_allclose(randomized_response_rdp(eps, 1, orders), direct, rtol=1e-12)
    np.testing.assert_allclose(randomized_response_rdp(eps, 10, orders), 10 * np.array(direct), rtol=1e-12)
    assert np.all(randomized_response_rdp(eps, 1, [1e4]) <= eps)


def test_randomized_response_composes_once_per_epoch_with_the_gaussian_part():
    """The documented rule: ceil(steps * rate) releases of D bits, added to opacus's Gaussian RDP."""
    acc = PrivacyAccountant(1e-5)
    for _ in range(30):  # 30 steps at rate 0.1: 3 epochs, so 3 releases of each sample
        acc.step(noise_multiplier=2.0, sample_rate=0.1)
        acc.randomized_response_step(eps_bit=0.01, bits=100, sample_rate=0.1)
    from splitft.privacy.accountant import ORDERS

    rdp = analysis.compute_rdp(q=0.1, noise_multiplier=2.0, steps=30, orders=ORDERS) + \
        3 * randomized_response_rdp(0.01, 100)
    expected, _ = analysis.get_privacy_spent(orders=ORDERS, rdp=rdp, delta=1e-5)
    assert acc.epsilon() == pytest.approx(expected, rel=1e-12)
    gaussian_only = RDPAccountant()
    gaussian_only.history = [(2.0, 0.1, 30)]
    assert acc.epsilon() > gaussian_only.get_epsilon(1e-5)


def test_binary_codec_randomized_response_is_accounted():
    cloud = InprocCloud([BSL])
    try:
        model = splitft.split(digits_bsl(), "block3", factory=BSL, connect=cloud.connect(),
                              codecs="binary:flip_eps=0.01", faults=splitft.Faults(timeout=30))
        protect(model, Defences(budget=Budget(epsilon=math.inf, delta=1e-5, sample_rate=0.5)))
        x, y = load_digits()[0].x[:8], load_digits()[0].y[:8]
        with model:
            crit = model.remote_loss(nn.CrossEntropyLoss())
            for _ in range(4):
                crit(model(x), y).backward()
    finally:
        cloud.close()
    assert model.privacy.rr == (0.01, 2048)
    acc = PrivacyAccountant(1e-5)
    acc.rr_steps = {(0.01, 2048, 0.5): 4}
    assert model.privacy.spent() == acc.epsilon() > 0


def test_training_stops_before_sending_once_the_budget_is_spent(inproc_cloud):
    budget = Budget(epsilon=2.0, delta=1e-5, sample_rate=RATE, steps=3)
    model = _split(inproc_cloud, Defences(activations=Noise(clip=1.0), budget=budget, seed=2), rejoin="head")
    train = load_digits()[0]
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.01))
        data = [(x, y) for (x, y, _), _ in zip(batches(train, 64, shuffle=True), range(4))]
        for x, y in data[:3]:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        sent = model.metrics.bytes[("up", "activation")].messages
        spent = model.privacy.spent()
        with pytest.raises(PrivacyBudgetExceeded, match="Nothing was sent"):
            model(data[3][0])
        assert model.metrics.bytes[("up", "activation")].messages == sent
        assert model.privacy.spent() == spent <= 2.0
        model.eval()
        with torch.no_grad():
            model(data[3][0])  # evaluation still runs (noised, not a training step)
    assert isinstance(PrivacyBudgetExceeded("x"), splitft.SplitFTError)


def test_the_epsilon_spent_is_in_every_step_record(inproc_cloud, tmp_path):
    import json

    path = tmp_path / "steps.jsonl"
    model = splitft.split(digits_cnn(), "block3", "head", factory=DIGITS, connect=inproc_cloud.connect(),
                          faults=splitft.Faults(timeout=30), metrics_path=str(path))
    protect(model, Defences(activations=Noise(clip=1.0), budget=Budget(epsilon=8, delta=1e-5, sample_rate=RATE,
                                                                       steps=10)))
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        x, y = load_digits()[0].x[:16], load_digits()[0].y[:16]
        for _ in range(2):
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        spent = model.privacy.spent()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(records) == 2 and 0 < records[0]["privacy"]["epsilon"] < records[1]["privacy"]["epsilon"] == spent
