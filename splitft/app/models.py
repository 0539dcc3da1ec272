"""Built-in model factories that edge and cloud can both name (``splitft.app.models:digits_cnn``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import nn


def tiny_mlp(seed: int = 0, width: int = 32) -> nn.Sequential:
    """16 features → 4 classes in three linear layers; cut at ``2``. For load tests: the cloud's
    work per step is negligible, so what is measured is the runtime, not the model."""
    return _seeded(lambda: nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                                         nn.Linear(width, 4)), seed)


def digits_cnn(seed: int | None = 0) -> nn.Sequential:
    """A 38k-parameter CNN for 8x8 digits. Cut after ``block2`` (activation 32x8x8 per sample).

    Convolutions that feed BatchNorm have no bias: BatchNorm removes it, so its gradient is
    zero and an adaptive optimizer would only amplify rounding noise into it.

    ``seed`` makes the initial weights reproducible without touching the global RNG.
    """
    def build() -> nn.Sequential:
        return nn.Sequential(OrderedDict(
            block1=nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU()),
            block2=nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU()),
            block3=nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            head=nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 10)),
        ))

    return _seeded(build, seed)


def digits_bsl(seed: int | None = 0) -> nn.Sequential:
    """B-SL variant of :func:`digits_cnn`: binarized edge layers, so the cut activation is ±1.

    The edge convolutions use the sign of latent fp32 weights and end in a sign activation with a
    straight-through gradient; the first layer's input (the image) stays real. The cloud part is
    the same as in ``digits_cnn``. Train with the ``binary`` codec (1 bit per element on the wire)
    and keep the latent weights clipped (``compressors.binary.keep_latent_weights_clipped``).
    """
    from compressors.binary import BinaryActivation, BinaryConv2d

    def build() -> nn.Sequential:
        return nn.Sequential(OrderedDict(
            block1=nn.Sequential(BinaryConv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                                 BinaryActivation()),
            block2=nn.Sequential(BinaryConv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32),
                                 BinaryActivation()),
            block3=nn.Sequential(nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            head=nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 10)),
        ))

    return _seeded(build, seed)


def digits_deep(seed: int | None = 0) -> nn.Sequential:
    """:func:`digits_cnn`'s edge (cut after ``block2``, 32x8x8 per sample) before a cloud half of
    four convolutions (0.28 M parameters), to test claims made for deep receivers: C3-SL binds R
    samples into one vector, and reports 16x at a negligible drop on CIFAR-class CNNs whose cloud
    half has depth to spare to read each sample back out of the noise the others leave. (Measured
    here, depth alone does not do it: docs/seeds.md.)"""
    def conv(c_in: int, c_out: int) -> list[nn.Module]:
        return [nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out), nn.ReLU()]

    def build() -> nn.Sequential:
        return nn.Sequential(OrderedDict(
            block1=nn.Sequential(*conv(1, 32)),
            block2=nn.Sequential(*conv(32, 32)),
            block3=nn.Sequential(*conv(32, 64), *conv(64, 64)),
            block4=nn.Sequential(*conv(64, 128), nn.MaxPool2d(2)),
            block5=nn.Sequential(*conv(128, 128), nn.AdaptiveAvgPool2d(1)),
            head=nn.Sequential(nn.Flatten(), nn.Linear(128, 10)),
        ))

    return _seeded(build, seed)


M = TypeVar("M", bound=nn.Module)


def _seeded(build: Callable[[], M], seed: int | None) -> M:
    """``build()`` with its own RNG stream when ``seed`` is given; the global RNG is left as it was."""
    if seed is None:
        return build()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build()
