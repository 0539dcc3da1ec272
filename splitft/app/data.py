"""Real data that ships offline: scikit-learn's 8x8 digits (1797 images, 10 classes).

A :class:`Split` holds the inputs either as one tensor (images: ``model(x)``) or as a dict of
tensors passed as keyword arguments (text: ``model(input_ids=..., attention_mask=...)``), so one
training loop serves both (see :mod:`splitft.app.tasks`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


Inputs = torch.Tensor | dict[str, torch.Tensor]


@dataclass
class Split:
    x: Inputs  # (N, ...) tensor, or a dict of (N, ...) tensors given to the model as keywords
    y: torch.Tensor  # (N,) int64
    ids: torch.Tensor  # (N,) int64, stable per sample: what per-sample codec state is keyed by

    def __len__(self) -> int:
        return len(self.y)

    def tensor(self) -> torch.Tensor:
        """The inputs of an image split, one tensor."""
        if isinstance(self.x, dict):
            raise TypeError(f"this split's inputs are keyword inputs ({', '.join(self.x)}), not one tensor")
        return self.x

    def field(self, name: str) -> torch.Tensor:
        """One keyword input of a text split (``split.field("input_ids")``)."""
        if not isinstance(self.x, dict):
            raise TypeError(f"this split's inputs are one tensor, not keyword inputs: it has no {name!r}")
        return self.x[name]


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[Split, Split]:
    """Train and test splits of the digits, shuffled with ``seed`` (same seed, same split)."""
    from sklearn.datasets import load_digits as sk_digits

    data = sk_digits()
    x = torch.from_numpy((data.images / 16.0).astype(np.float32)).unsqueeze(1)
    y = torch.from_numpy(data.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    n_test = int(round(len(y) * test_fraction))
    test, train = order[:n_test], order[n_test:]
    return (Split(x[train], y[train], torch.arange(len(train))),
            Split(x[test], y[test], torch.arange(len(test))))


def batches(split: Split, batch_size: int, *, shuffle: bool, seed: int = 0, epoch: int = 0
            ) -> Iterator[tuple[Inputs, torch.Tensor, torch.Tensor]]:
    """(x, y, ids) batches; the order depends only on (seed, epoch), never on global RNG."""
    n = len(split)
    if shuffle:
        order = torch.from_numpy(np.random.default_rng([seed, epoch]).permutation(n))
    else:
        order = torch.arange(n)
    for start in range(0, n, batch_size):
        idx = order[start:start + batch_size]
        yield take(split.x, idx), split.y[idx], split.ids[idx]


def first(split: Split, n: int) -> Split:
    """The first ``n`` samples of ``split`` (for short runs)."""
    idx = torch.arange(min(n, len(split)))
    return Split(take(split.x, idx), split.y[idx], split.ids[idx])


def moved(split: Split, device: torch.device | str) -> Split:
    """``split`` with every tensor on ``device`` (once, rather than batch by batch)."""
    x = {k: v.to(device) for k, v in split.x.items()} if isinstance(split.x, dict) else split.x.to(device)
    return Split(x, split.y.to(device), split.ids.to(device))


def take(x: Inputs, idx: torch.Tensor) -> Inputs:
    """Rows ``idx`` of a tensor, or of every tensor in a dict of them."""
    return {k: v[idx] for k, v in x.items()} if isinstance(x, dict) else x[idx]


def call(model: Any, x: Inputs, **extra: Any) -> Any:
    """``model(x)``, or ``model(**x)`` when the inputs are a dict of named tensors."""
    return model(**x, **extra) if isinstance(x, dict) else model(x, **extra)
