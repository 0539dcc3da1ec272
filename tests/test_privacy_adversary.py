"""Adversarial training against inversion, and the stronger attacks that check it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import splitft
from splitft.app.data import batches, load_digits
from splitft.app.models import digits_cnn
from splitft.privacy import Defences, protect
from splitft.privacy.adversary import AdversarialDecoder
from splitft.privacy.strong import class_mean_attack, class_mean_floor, learned_decoder_attack
from tests.conftest import DIGITS

STEPS = 5


@pytest.fixture(scope="module")
def data():
    train, _ = load_digits()
    return [(x, y) for (x, y, _), _ in zip(batches(train, 32, shuffle=True, seed=3), range(STEPS))]


def test_the_adversarial_gradient_pushes_the_decoders_output_to_the_mean():
    torch.manual_seed(0)
    x, z, upstream = torch.rand(8, 1, 8, 8), torch.rand(8, 32, 8, 8), torch.randn(8, 32, 8, 8)
    adversary = AdversarialDecoder(0.5, seed=1)
    hook = adversary.hook(x, z)  # one decoder step, then the hook
    assert adversary.last_loss is not None
    leaf = z.clone().requires_grad_()
    target = x.mean(0, keepdim=True).expand_as(x)
    (expected,) = torch.autograd.grad(F.mse_loss(adversary.decoder(leaf), target), leaf)
    torch.testing.assert_close(hook(upstream), upstream + 0.5 * expected)


def _local(data, adversarial: float, seed: int) -> dict[str, torch.Tensor]:
    model = digits_cnn()
    adversary = AdversarialDecoder(adversarial, seed=seed) if adversarial else None
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for x, y in data:
        z = model.block2(model.block1(x))
        if adversary is not None:
            z.register_hook(adversary.hook(x, z))
        F.cross_entropy(model.head(model.block3(z)), y).backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def test_adversarial_training_on_the_edge_equals_the_local_minimax(inproc_cloud, data):
    """Split with Defences(adversarial=...) trains as a local model whose edge plays against the
    same decoder; nothing of it reaches the cloud but the gradient it changed."""
    weight, seed = 2.0, 11
    model = splitft.split(digits_cnn(), "block3", "head", factory=DIGITS, connect=inproc_cloud.connect(),
                          faults=splitft.Faults(timeout=30))
    with model:
        protection = protect(model, Defences(adversarial=weight, seed=seed))
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
        for x, y in data:
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        state = {**model.edge_state_dict(), **model.cloud_state_dict()}
    local, plain = _local(data, weight, seed), _local(data, 0.0, seed)
    for name, value in local.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-4, msg=lambda m: f"{name}: {m}")
    assert not torch.allclose(plain["block1.0.weight"], local["block1.0.weight"], atol=1e-4)
    assert protection.adversary.last_loss is not None
    with pytest.raises(splitft.ConfigError, match="adversarial"):
        Defences(adversarial=-1.0)


def test_class_mean_attack_reaches_its_floor_when_the_class_is_readable():
    train, test = load_digits()
    aux_x, aux_y, tx, ty = train.tensor()[:300], train.y[:300], test.tensor(), test.y
    aux_z, target_z = F.one_hot(aux_y, 10).float() * 3, F.one_hot(ty, 10).float() * 3
    result, accuracy = class_mean_attack(aux_z, aux_x, aux_y, target_z, tx, ty, steps=300)
    floor = class_mean_floor(aux_x, aux_y, tx, ty)
    assert accuracy == 1.0 and result.ssim == pytest.approx(floor.ssim)
    assert floor.ssim > floor.baseline_ssim + 0.2  # knowing the class beats knowing nothing by far


def test_learned_decoder_reads_images_and_not_noise():
    train, test = load_digits()
    aux_x, tx = train.tensor()[:300], test.tensor()[:100]
    clear = learned_decoder_attack(aux_x * 2 - 1, aux_x, tx * 2 - 1, tx, steps=300)
    noise = learned_decoder_attack(torch.randn(300, 16), aux_x, torch.randn(100, 16), tx, steps=300)
    assert clear.ssim > 0.8 and noise.ssim < clear.baseline_ssim + 0.1, (clear.ssim, noise.ssim)
