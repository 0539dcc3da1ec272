"""The attacks work (they recover what is there) and measure the defences (they recover less)."""

from __future__ import annotations

import pytest
import torch

from splitft.app.data import load_digits
from splitft.app.models import digits_bsl, digits_cnn
from splitft.privacy import clip_and_noise, distance_correlation
from splitft.privacy.attacks import (auc, dcor_score, direction_attack_accuracy, direction_attack_auc,
                                     inversion_attack, label_leak, norm_attack_auc, ssim, through_codec,
                                     token_recovery_accuracy)


def test_distance_correlation_separates_dependence_from_independence():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 5, generator=g)
    assert float(distance_correlation(x, 3 * x + 1)) == pytest.approx(1.0, abs=1e-6)
    independent = float(distance_correlation(x, torch.randn(200, 7, generator=g)))
    nonlinear = float(distance_correlation(x, x.pow(2)))
    assert independent < 0.35 < nonlinear  # 0 in the limit; sample dcor is biased up at n=200
    z = torch.cat([x, x[:1]]).requires_grad_()  # a duplicate row: zero distance, still a finite gradient
    distance_correlation(torch.cat([x, x[:1]]), z).backward()
    assert torch.isfinite(z.grad).all()


def test_ssim_is_one_for_the_same_image_and_drops_with_noise():
    x = load_digits()[1].x[:32]
    assert float(ssim(x, x)) == pytest.approx(1.0, abs=1e-6)
    g = torch.Generator().manual_seed(0)
    assert float(ssim(x, x + 0.05 * torch.randn(x.shape, generator=g))) > float(
        ssim(x, x + 0.3 * torch.randn(x.shape, generator=g)))


@pytest.fixture(scope="module")
def images():
    train, test = load_digits()
    return train.x[:300], test.x[:120]


def _edge(net):
    return torch.nn.Sequential(net.block1, net.block2).eval()


@pytest.mark.slow
def test_inversion_recovers_identity_activations_and_less_through_binary_and_dp(images):
    """The attack works (identity: near-perfect), and the defences work (binary, DP: measurably worse)."""
    aux_x, target_x = images
    with torch.no_grad():
        cnn, bsl = _edge(digits_cnn(0)), _edge(digits_bsl(0))
        z_aux, z_target = cnn(aux_x), cnn(target_x)
        b_aux = through_codec(bsl(aux_x), "binary:flip_eps=1", seed=1)
        b_target = through_codec(bsl(target_x), "binary:flip_eps=1", seed=2)
    g = torch.Generator().manual_seed(0)
    d_aux, d_target = clip_and_noise(z_aux, 1.0, 0.5, g), clip_and_noise(z_target, 1.0, 0.5, g)
    steps = 250
    identity = inversion_attack(z_aux, aux_x, z_target, target_x, steps=steps)
    binary = inversion_attack(b_aux, aux_x, b_target, target_x, steps=steps)
    dp = inversion_attack(d_aux, aux_x, d_target, target_x, steps=steps)
    assert identity.ssim > 0.9 and identity.mse < 0.2 * identity.baseline_mse
    assert binary.mse > 2 * identity.mse and binary.ssim < identity.ssim - 0.02
    assert dp.ssim < 0.5 * identity.ssim and dp.mse > 10 * identity.mse
    assert dcor_score(target_x, z_target) > dcor_score(target_x, d_target)


def test_auc_counts_ties_half_and_orders_scores():
    assert auc([0.1, 0.2, 0.3, 0.4], [0, 0, 1, 1]) == 1.0
    assert auc([0.4, 0.3, 0.2, 0.1], [0, 0, 1, 1]) == 0.0
    assert auc([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1]) == 0.5


def _softmax_head_gradients(n: int, classes: int, seed: int, positive_rate: float | None = None):
    """Per-sample gradients of cross-entropy w.r.t. a hidden layer under a linear head: W^T (p - onehot(y))."""
    g = torch.Generator().manual_seed(seed)
    if positive_rate is None:
        labels = torch.randint(0, classes, (n,), generator=g)
    else:
        labels = (torch.rand(n, generator=g) < positive_rate).long()
    weight = torch.randn(classes, 64, generator=g)
    logits = torch.randn(n, classes, generator=g) + 2.0 * torch.nn.functional.one_hot(labels, classes)
    if positive_rate is not None:
        logits[:, 1] -= 2.0  # a rare class the model is less sure of: larger gradients
    p = logits.softmax(1)
    return (p - torch.nn.functional.one_hot(labels, classes)) @ weight, labels


def test_label_leak_attacks_read_labels_from_clean_gradients_and_not_from_noised_ones():
    grads, labels = _softmax_head_gradients(600, 10, seed=0)
    assert direction_attack_accuracy(grads, labels) > 0.9
    g = torch.Generator().manual_seed(1)
    noisy = clip_and_noise(grads, 1.0, 5.0, g)
    assert direction_attack_accuracy(noisy, labels) < 0.3
    assert label_leak(grads, labels)["chance"] == pytest.approx(0.1)

    grads, labels = _softmax_head_gradients(600, 2, seed=2, positive_rate=0.1)
    assert norm_attack_auc(grads, labels) > 0.8
    reference = int((labels == 1).nonzero()[0])
    assert direction_attack_auc(grads, labels, reference) > 0.95
    noisy = clip_and_noise(grads, 0.1, 5.0, g)
    assert abs(direction_attack_auc(noisy, labels, reference) - 0.5) < 0.15
    assert set(label_leak(grads, labels)) == {"norm_auc", "direction_auc"}


def test_token_recovery_reads_tokens_from_states_that_carry_them():
    g = torch.Generator().manual_seed(0)
    table = torch.randn(50, 16, generator=g)
    ids = torch.randint(0, 50, (40, 12), generator=g)
    hidden = table[ids] + 0.1 * torch.randn(40, 12, 16, generator=g)
    mask = torch.ones(40, 12)
    mask[:, -3:] = 0  # padding is not scored
    assert token_recovery_accuracy(hidden[:30], ids[:30], hidden[30:], ids[30:], aux_mask=mask[:30],
                                   target_mask=mask[30:]) > 0.9
    unrelated = torch.randn(40, 12, 16, generator=g)
    assert token_recovery_accuracy(unrelated[:30], ids[:30], unrelated[30:], ids[30:]) < 0.2
