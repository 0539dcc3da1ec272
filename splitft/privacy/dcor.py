"""Distance correlation: how much a batch of activations still says about the batch's inputs.

Székely's sample distance correlation is 0 only when the two samples are independent and 1 when
one is a similarity transform of the other, whatever their dimensions. NoPeek and B-SL train the
edge to lower it (the leak loss); the attacks report it as a measurement. It is differentiable,
so the same function serves both.
"""

from __future__ import annotations

import torch

_EPS = 1e-12


def _centred_distances(x: torch.Tensor) -> torch.Tensor:
    """Double-centred matrix of pairwise Euclidean distances between the rows of ``x``."""
    x = x.reshape(x.shape[0], -1).to(torch.float64)  # |a|² + |b|² - 2ab cancels badly in float32
    squared = x.pow(2).sum(1)
    gram = x @ x.T
    # clamped so that the zero distances (the diagonal, duplicate rows) get a zero gradient, not NaN
    distances = (squared[:, None] + squared[None, :] - 2 * gram).clamp(min=_EPS).sqrt()
    distances = distances - torch.diag_embed(torch.diagonal(distances))  # exactly 0 on the diagonal
    return distances - distances.mean(0, keepdim=True) - distances.mean(1, keepdim=True) + distances.mean()


def distance_correlation(x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """Sample distance correlation between the rows of ``x`` and ``z`` (one row per sample), in [0, 1].

    Both are flattened per sample, so an image batch and an activation batch of any shape can be
    compared. Needs at least two samples; differentiable in both arguments.
    """
    if x.shape[0] != z.shape[0]:
        raise ValueError(f"distance correlation needs the same number of samples, got {x.shape[0]} and {z.shape[0]}")
    if x.shape[0] < 2:
        raise ValueError("distance correlation needs at least two samples")
    a, b = _centred_distances(x), _centred_distances(z)
    dcov_xz = (a * b).mean()
    dvar_x, dvar_z = (a * a).mean(), (b * b).mean()
    ratio = dcov_xz.clamp(min=0) / (dvar_x * dvar_z).clamp(min=_EPS).sqrt()
    return ratio.clamp(min=_EPS).sqrt().to(z.dtype if z.is_floating_point() else torch.float32)
