"""Attacks as metrics: how much of the inputs and labels an honest-but-curious cloud can recover.

These run on held-back data after (or beside) training and never take part in it. Each takes
what the cloud received as plain tensors, so they measure any codec and any defence alike:

* :func:`dcor_score` — distance correlation between inputs and what crossed (0: independent);
* :func:`inversion_attack` — the cloud trains a decoder from smashed data back to inputs on
  auxiliary data it holds, then reconstructs the targets; MSE and SSIM, next to the score of
  guessing the auxiliary mean (an attack that learned nothing);
* :func:`norm_attack_auc`, :func:`direction_attack_auc`, :func:`direction_attack_accuracy` —
  label leakage from the gradients a U-shape edge returns (Li et al., "Label leakage and
  protection in two-party split learning"): AUC for two classes, accuracy for more;
* :func:`token_recovery_accuracy` — which token sits at each position, read from hidden states
  by a nearest-neighbour lookup among auxiliary text's states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from scipy.stats import rankdata  # scipy comes with scikit-learn
from torch import nn

from .dcor import distance_correlation


def through_codec(z: torch.Tensor, spec: str, seed: int = 0) -> torch.Tensor:
    """What the cloud decodes when ``z`` is sent through the codec ``spec`` (its randomness included).

    Stateless codecs only (a codec that keeps per-sample state needs the run's state).
    """
    import compressors

    codec = compressors.make_codec(spec, seed=seed)
    if codec.needs_sample_ids:
        raise ValueError(f"codec {spec!r} keeps per-sample state; measure what crosses inside the run instead")
    ctx = compressors.CodecContext("activation", train=False)
    return codec.decode(codec.encode(z.detach(), ctx), ctx)


def dcor_score(inputs: torch.Tensor, crossed: torch.Tensor, max_samples: int = 512) -> float:
    """Distance correlation between the first ``max_samples`` inputs and what crossed for them."""
    n = min(max_samples, inputs.shape[0])
    with torch.no_grad():
        return float(distance_correlation(inputs[:n].float(), crossed[:n].float()))


# ---------------------------------------------------------------- model inversion


def ssim(a: torch.Tensor, b: torch.Tensor, data_range: float = 1.0, window: int = 5, sigma: float = 1.0) -> torch.Tensor:
    """Mean structural similarity of two (N, C, H, W) image batches (1: identical).

    Gaussian window (size ``window``, clipped to the image, standard deviation ``sigma``), the
    usual constants K1 = 0.01, K2 = 0.03, valid positions only; small windows suit 8x8 images.
    """
    if a.shape != b.shape or a.dim() != 4:
        raise ValueError(f"ssim compares two (N, C, H, W) batches of one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    size = min(window, a.shape[-1], a.shape[-2])
    coords = torch.arange(size, dtype=torch.float64) - (size - 1) / 2
    g = torch.exp(-coords ** 2 / (2 * sigma ** 2))
    kernel = (g[:, None] * g[None, :]) / g.sum() ** 2
    channels = a.shape[1]
    kernel = kernel.expand(channels, 1, size, size).contiguous()
    a, b = a.double(), b.double()

    def blur(t: torch.Tensor) -> torch.Tensor:
        return F.conv2d(t, kernel, groups=channels)

    mu_a, mu_b = blur(a), blur(b)
    var_a = blur(a * a) - mu_a ** 2
    var_b = blur(b * b) - mu_b ** 2
    cov = blur(a * b) - mu_a * mu_b
    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    index = ((2 * mu_a * mu_b + c1) * (2 * cov + c2)) / ((mu_a ** 2 + mu_b ** 2 + c1) * (var_a + var_b + c2))
    return index.mean().float()


def default_decoder(z_shape: tuple[int, ...], x_shape: tuple[int, ...]) -> nn.Module:
    """A decoder from one sample's smashed data to its input.

    Convolutional when both are images of the same height and width (the cut of a CNN keeps
    the layout, so a small local decoder suffices and learns from few samples); otherwise an
    MLP on the flattened values.
    """
    if len(z_shape) == 3 and len(x_shape) == 3 and z_shape[1:] == x_shape[1:]:
        return nn.Sequential(nn.Conv2d(z_shape[0], 32, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
                             nn.Conv2d(32, x_shape[0], 3, padding=1))
    d_z, d_x = math.prod(z_shape), math.prod(x_shape)
    return nn.Sequential(nn.Flatten(), nn.Linear(d_z, 512), nn.ReLU(), nn.Linear(512, d_x),
                         nn.Unflatten(1, tuple(x_shape)))


@dataclass
class InversionResult:
    """How well a decoder trained on auxiliary pairs reconstructs the target inputs."""

    mse: float
    ssim: float | None  # images only
    baseline_mse: float  # of the auxiliary mean image: what an attack that learned nothing scores
    baseline_ssim: float | None
    reconstructions: torch.Tensor


def inversion_attack(aux_z: torch.Tensor, aux_x: torch.Tensor, target_z: torch.Tensor, target_x: torch.Tensor, *,
                     steps: int = 1500, batch_size: int = 64, lr: float = 1e-3, seed: int = 0,
                     decoder: nn.Module | None = None, data_range: float | None = None) -> InversionResult:
    """Train a decoder on (aux_z → aux_x), reconstruct ``target_x`` from ``target_z``; MSE and SSIM.

    The cloud holds auxiliary data from the same distribution and sees its smashed data (it
    queried the edge model, or the data once crossed with known inputs). ``steps`` Adam steps on
    the mean squared error; the decoder's initial weights and batches come from ``seed``.
    """
    aux_z, aux_x = aux_z.detach().float(), aux_x.detach().float()
    target_z, target_x = target_z.detach().float(), target_x.detach().float()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = decoder if decoder is not None else default_decoder(tuple(aux_z.shape[1:]), tuple(aux_x.shape[1:]))
        optimizer = torch.optim.Adam(model.parameters(), lr=lr)
        generator = torch.Generator().manual_seed(seed)
        model.train()
        for _ in range(steps):
            idx = torch.randint(0, aux_z.shape[0], (min(batch_size, aux_z.shape[0]),), generator=generator)
            loss = F.mse_loss(model(aux_z[idx]), aux_x[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        recon = model(target_z)
        baseline = aux_x.mean(0, keepdim=True).expand_as(target_x)
        mse = float(F.mse_loss(recon, target_x))
        baseline_mse = float(F.mse_loss(baseline, target_x))
        image = target_x.dim() == 4
        span = data_range if data_range is not None else float(target_x.max() - target_x.min()) or 1.0
        low, high = float(target_x.min()), float(target_x.min()) + span
        score = float(ssim(recon.clamp(low, high), target_x, data_range=span)) if image else None
        baseline_score = float(ssim(baseline.contiguous(), target_x, data_range=span)) if image else None
    return InversionResult(mse, score, baseline_mse, baseline_score, recon)


# ---------------------------------------------------------------- label leakage


def auc(scores: torch.Tensor | np.ndarray, positive: torch.Tensor | np.ndarray) -> float:
    """Area under the ROC curve of ``scores`` for the boolean ``positive`` (ties count half)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(positive, dtype=bool).reshape(-1)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError("AUC needs both positive and negative examples")
    ranks = rankdata(s)  # ties get their average rank
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _rows(grads: torch.Tensor) -> torch.Tensor:
    return grads.detach().reshape(grads.shape[0], -1).double()


def norm_attack_auc(grads: torch.Tensor, labels: torch.Tensor, positive: int = 1) -> float:
    """Two classes: AUC of the per-sample gradient norm as a score for the ``positive`` class.

    With imbalanced classes the rare class gets larger gradients; 0.5 is chance.
    """
    return auc(_rows(grads).norm(dim=1), labels.reshape(-1) == positive)


def direction_attack_auc(grads: torch.Tensor, labels: torch.Tensor, reference: int, positive: int = 1) -> float:
    """Two classes: AUC of the cosine with the gradient of one example known to be ``positive``.

    Gradients of a softmax head point one way for each class, so the cosine separates them;
    the reference example itself is left out. 0.5 is chance.
    """
    rows = F.normalize(_rows(grads), dim=1)
    cos = rows @ rows[reference]
    keep = torch.ones(rows.shape[0], dtype=torch.bool)
    keep[reference] = False
    return auc(cos[keep], (labels.reshape(-1) == positive)[keep])


def direction_attack_accuracy(grads: torch.Tensor, labels: torch.Tensor, known_per_class: int = 1) -> float:
    """Any number of classes: the cloud knows the labels of ``known_per_class`` examples per class
    (the first ones) and gives every other example the class whose known gradients its own is
    most aligned with (cosine to their mean direction). Accuracy on the others; chance is 1/classes."""
    rows = F.normalize(_rows(grads), dim=1)
    labels = labels.reshape(-1)
    classes = torch.unique(labels)
    known = torch.zeros(rows.shape[0], dtype=torch.bool)
    centres = []
    for c in classes:
        members = (labels == c).nonzero().reshape(-1)[:known_per_class]
        known[members] = True
        centres.append(F.normalize(rows[members].mean(0), dim=0))
    guess = classes[(rows[~known] @ torch.stack(centres).T).argmax(1)]
    return float((guess == labels[~known]).double().mean()) if (~known).any() else float("nan")


def label_leak(grads: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """The label-leak scores that fit the number of classes: norm and direction AUC for two,
    direction accuracy (and chance) for more."""
    classes = torch.unique(labels)
    if len(classes) == 2:
        positive = int(classes[1])
        reference = int((labels.reshape(-1) == positive).nonzero()[0])
        return {"norm_auc": norm_attack_auc(grads, labels, positive),
                "direction_auc": direction_attack_auc(grads, labels, reference, positive)}
    return {"direction_accuracy": direction_attack_accuracy(grads, labels), "chance": 1.0 / len(classes)}


# ---------------------------------------------------------------- token recovery


def token_recovery_accuracy(aux_hidden: torch.Tensor, aux_ids: torch.Tensor, target_hidden: torch.Tensor,
                            target_ids: torch.Tensor, *, aux_mask: torch.Tensor | None = None,
                            target_mask: torch.Tensor | None = None, chunk: int = 2048) -> float:
    """Share of target positions whose token the cloud reads from the hidden state.

    The attack is a nearest-neighbour lookup: each target position (…, L, H) gets the token of
    the auxiliary position whose standardised hidden state is most aligned with its own (cosine).
    It needs no training, and the auxiliary text can be any public text passed through the edge
    (a public pre-trained edge can be run by the cloud itself). Masks (1: a real token) drop
    padding; a target token absent from the auxiliary text counts as missed.
    """
    def positions(hidden: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        h = hidden.detach().reshape(-1, hidden.shape[-1]).float()
        t = ids.reshape(-1)
        if mask is not None:
            keep = mask.reshape(-1).bool()
            h, t = h[keep], t[keep]
        return h, t

    h_aux, t_aux = positions(aux_hidden, aux_ids, aux_mask)
    h_tgt, t_tgt = positions(target_hidden, target_ids, target_mask)
    mean, std = h_aux.mean(0), h_aux.std(0).clamp(min=1e-6)
    keys = F.normalize((h_aux - mean) / std, dim=1)
    hits = 0
    with torch.no_grad():
        for start in range(0, h_tgt.shape[0], chunk):
            queries = F.normalize((h_tgt[start:start + chunk] - mean) / std, dim=1)
            hits += int((t_aux[(queries @ keys.T).argmax(1)] == t_tgt[start:start + chunk]).sum())
    return hits / max(1, h_tgt.shape[0])
