"""Stronger inversion attacks, so that a defence cannot pass by fooling one weak decoder.

The grid's :func:`~splitft.privacy.attacks.inversion_attack` trains a small decoder for 600
steps. A defence trained against a decoder (adversarial training) or one that makes the
activation awkward for a small local decoder can beat that decoder without hiding the input.
These attacks use the same public data (the attacker's auxiliary images, which it can also
label: public digits come labelled) and are retrained from scratch after training, against the
final edge:

* :func:`learned_decoder_attack` — a wider decoder that sees the whole activation (a dense
  layer before the convolutions), trained longer, with weight decay and early stopping on a
  held-out part of the public data;
* :func:`class_mean_attack` — a classifier from what crossed to the label, answering with the
  public mean image of the predicted class. It needs nothing but the class to be readable from
  what crossed, which any split that classifies well must allow (see docs/privacy.md): its
  score is a floor that no defence keeping accuracy can push the attack under.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .attacks import InversionResult, ssim


def _scores(recon: torch.Tensor, aux_x: torch.Tensor, target_x: torch.Tensor) -> InversionResult:
    """MSE and SSIM of ``recon`` against the targets, beside the public mean image's."""
    with torch.no_grad():
        baseline = aux_x.mean(0, keepdim=True).expand_as(target_x).contiguous()
        span = float(target_x.max() - target_x.min()) or 1.0
        low = float(target_x.min())
        image = target_x.dim() == 4
        score = float(ssim(recon.clamp(low, low + span), target_x, data_range=span)) if image else None
        base = float(ssim(baseline, target_x, data_range=span)) if image else None
        return InversionResult(float(F.mse_loss(recon, target_x)), score, float(F.mse_loss(baseline, target_x)),
                               base, recon)


class _WideDecoder(nn.Module):
    """Dense layer over the whole activation to a coarse image, then convolutions that refine it."""

    def __init__(self, z_shape: tuple[int, ...], x_shape: tuple[int, ...], width: int = 16):
        super().__init__()
        self.x_shape = x_shape
        self.dense = nn.Sequential(nn.Flatten(), nn.Linear(math.prod(z_shape), 256), nn.ReLU(),
                                   nn.Linear(256, width * math.prod(x_shape[1:])), nn.ReLU())
        self.width = width
        self.refine = nn.Sequential(nn.Conv2d(width, 32, 3, padding=1), nn.ReLU(),
                                    nn.Conv2d(32, x_shape[0], 3, padding=1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.dense(z).reshape(z.shape[0], self.width, *self.x_shape[1:])
        return self.refine(h)


def _fit(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor, loss_fn, *, steps: int, seed: int,
         batch_size: int = 64, lr: float = 1e-3, weight_decay: float = 1e-4, holdout: float = 0.15) -> nn.Module:
    """Adam on ``loss_fn``; keeps the weights that scored best on a held-out part of the public data."""
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(inputs.shape[0], generator=generator)
    n_val = max(1, int(holdout * inputs.shape[0]))
    val, fit = order[:n_val], order[n_val:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    best, best_state = math.inf, None
    for step in range(steps):
        model.train()
        idx = fit[torch.randint(0, fit.shape[0], (min(batch_size, fit.shape[0]),), generator=generator)]
        loss = loss_fn(model(inputs[idx]), targets[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 50 == 49 or step == steps - 1:
            model.eval()
            with torch.no_grad():
                score = float(loss_fn(model(inputs[val]), targets[val]))
            if score < best:
                best, best_state = score, {k: v.clone() for k, v in model.state_dict().items()}
    if best_state is not None:
        model.load_state_dict(best_state)
    return model.eval()


def learned_decoder_attack(aux_z: torch.Tensor, aux_x: torch.Tensor, target_z: torch.Tensor,
                           target_x: torch.Tensor, *, steps: int = 1500, seed: int = 0) -> InversionResult:
    """A wide decoder trained on the public pairs (aux_z → aux_x) reconstructs the targets."""
    aux_z, aux_x = aux_z.detach().float(), aux_x.detach().float()
    target_z, target_x = target_z.detach().float(), target_x.detach().float()
    scale = aux_z.reshape(aux_z.shape[0], -1).std(0).clamp(min=1e-6).reshape(aux_z.shape[1:])
    centre = aux_z.mean(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _WideDecoder(tuple(aux_z.shape[1:]), tuple(aux_x.shape[1:]))
        _fit(model, (aux_z - centre) / scale, aux_x, F.mse_loss, steps=steps, seed=seed)
    with torch.no_grad():
        recon = model((target_z - centre) / scale)
    return _scores(recon, aux_x, target_x)


def class_mean_attack(aux_z: torch.Tensor, aux_x: torch.Tensor, aux_y: torch.Tensor, target_z: torch.Tensor,
                      target_x: torch.Tensor, target_y: torch.Tensor | None = None, *, steps: int = 1000,
                      seed: int = 0) -> tuple[InversionResult, float]:
    """Read the class from what crossed, answer with the public mean image of that class.

    Returns the scores and the attacker's accuracy on the targets' classes ``target_y`` (NaN
    without them), to set beside the task's own accuracy.
    """
    aux_z, aux_x = aux_z.detach().float(), aux_x.detach().float()
    target_z, target_x = target_z.detach().float(), target_x.detach().float()
    classes = int(aux_y.max()) + 1
    centre = aux_z.mean(0)
    scale = aux_z.reshape(aux_z.shape[0], -1).std(0).clamp(min=1e-6).reshape(aux_z.shape[1:])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Flatten(), nn.Dropout(0.2), nn.Linear(math.prod(aux_z.shape[1:]), 256), nn.ReLU(),
                              nn.Linear(256, classes))
        _fit(model, (aux_z - centre) / scale, aux_y.long(), F.cross_entropy, steps=steps, seed=seed,
             weight_decay=1e-3)
    with torch.no_grad():
        guess = model((target_z - centre) / scale).argmax(1)
    means = torch.stack([aux_x[aux_y == c].mean(0) if (aux_y == c).any() else aux_x.mean(0)
                         for c in range(classes)])
    accuracy = float((guess == target_y.reshape(-1)).double().mean()) if target_y is not None else float("nan")
    return _scores(means[guess], aux_x, target_x), accuracy


def class_mean_floor(aux_x: torch.Tensor, aux_y: torch.Tensor, target_x: torch.Tensor,
                     target_y: torch.Tensor) -> InversionResult:
    """What the class-mean attack scores when it reads every class right: the public mean image
    of each target's true class. A split accurate enough to use gives the attacker about this."""
    classes = int(max(int(aux_y.max()), int(target_y.max()))) + 1
    means = torch.stack([aux_x[aux_y == c].mean(0) if (aux_y == c).any() else aux_x.mean(0)
                         for c in range(classes)])
    return _scores(means[target_y.long()], aux_x.float(), target_x.float())
