"""Adversarial training against inversion: the edge keeps a decoder of its own and trains away from it.

Each training forward, the edge's decoder takes one step at reconstructing the batch from the
activation (what an attacker would learn), and the gradient coming back from the cloud gets
``weight * d MSE(decoder(z), batch mean image) / dz`` added: the edge trains on
``loss + weight * MSE(decoder(z), mean)``, pushing its activations towards ones the current
decoder can only turn into the mean image. It is the minimax of adversarial representation
learning (Shredder, and the adversarial variant of NoPeek) with a bounded edge objective
(towards the mean, rather than away from the input, which has no floor). Nothing extra
crosses the cut; the decoder lives and dies on the edge.

It fools a decoder the attacker trains *during* training the same way; an attacker who trains
a fresh decoder afterwards on public data is not fooled by construction, which is why the
grid measures it with :mod:`splitft.privacy.strong` too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .attacks import default_decoder


class AdversarialDecoder:
    """The edge's own decoder and its optimizer, built on the first batch (shapes known then)."""

    def __init__(self, weight: float, *, lr: float = 1e-3, seed: int = 0):
        self.weight = weight
        self.lr = lr
        self.seed = seed
        self.decoder: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.last_loss: float | None = None  # the decoder's reconstruction MSE on the last batch

    def _build(self, z: torch.Tensor, x: torch.Tensor) -> nn.Module:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            decoder = default_decoder(tuple(z.shape[1:]), tuple(x.shape[1:])).to(z.device)
        self.optimizer = torch.optim.Adam(decoder.parameters(), lr=self.lr)
        return decoder

    def hook(self, inputs: torch.Tensor, z: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        """Train the decoder one step on (z, inputs); return the tensor hook that adds the
        edge's adversarial gradient to the gradient arriving at the cut."""
        x = inputs.detach().float()
        z = z.detach().float()
        if self.decoder is None:
            self.decoder = self._build(z, x)
        assert self.optimizer is not None
        with torch.enable_grad():
            self.decoder.train()
            loss = F.mse_loss(self.decoder(z), x)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
        self.last_loss = float(loss.detach())
        target = x.mean(0, keepdim=True).expand_as(x)
        decoder, weight = self.decoder, self.weight

        def add_adversarial_gradient(grad: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                leaf = z.detach().requires_grad_()
                (extra,) = torch.autograd.grad(F.mse_loss(decoder(leaf), target), leaf)
            return grad + weight * extra.to(grad.dtype)

        return add_adversarial_gradient
