"""Model factories for the privacy grid that the application's tasks do not need.

``digits_deep_edge`` is :func:`splitft.app.models.digits_cnn` with one more block on the edge: the
edge pools to 4x4 before the cut, so what crosses is a quarter of the image's resolution and
one layer further from the pixels ("cut later"). Edge and cloud both name it, so it lives in
the library.
"""

from __future__ import annotations

from collections import OrderedDict

from torch import nn

from ..app.models import _seeded


def digits_deep_edge(seed: int | None = 0, channels: int = 64) -> nn.Sequential:
    """The digits CNN cut later: edge block1-3 (pooled to ``channels`` x 4 x 4), cloud block4, edge head.

    Split U-shape at ``block4`` with ``rejoin="head"``.
    """
    def build() -> nn.Sequential:
        return nn.Sequential(OrderedDict(
            block1=nn.Sequential(nn.Conv2d(1, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU()),
            block2=nn.Sequential(nn.Conv2d(32, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU()),
            block3=nn.Sequential(nn.Conv2d(32, channels, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)),
            block4=nn.Sequential(nn.Conv2d(channels, 64, 3, padding=1), nn.ReLU()),
            head=nn.Sequential(nn.Flatten(), nn.Linear(64 * 4 * 4, 10)),
        ))

    return _seeded(build, seed)
