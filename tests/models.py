"""Small models for tests, importable by a cloud process as ``tests.models:NAME``."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class ResidualNet(nn.Module):
    """Not a chain: functional ops and a skip connection between children, like a ResNet."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.stage1 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.stage2 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        h = self.stage2(self.stage1(h))
        return self.head(h + 0.5 * torch.flatten(h, 1))


def residual_net(seed: int = 0) -> ResidualNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ResidualNet()


def mlp(seed: int = 0, width: int = 16) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 3))
