"""Outlier channels split off and sent in half precision; the rest goes to the next codec.

LLM.int8's decomposition: a few hidden channels of a pre-trained LLM carry values a hundred
times the others' (SmolLM2 after layer 27: one channel holds 91% of the energy, up to 2.4e4),
and they matter: rounding them to a few bits breaks the model. This stage takes the ``k``
channels of the last dim with the most energy in the message, sends them as float16 (float32
when they exceed its range) with their indices, zeroes them in what the next codec codes, and
puts them back after its decode. The next codec's scales then fit the other channels. At k
channels of a (rows, d) message it costs 2 k bytes per row: 4 KiB for 4 channels of 512 tokens.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import _wire
from ._device import download
from .base import CodecContext, Payload, tensor_meta
from .chain import Stage
from .errors import CompressionError
from .quant import FP16_MAX
from .registry import register
from .scaled import rows_of

MAX_K = 1 << 16


@register
class Outliers(Stage):
    """The ``k`` channels of the last dim with the most energy go in float16; the rest to the next codec.

    Options: ``k`` (4): channels split off per message (at most the last dim); 0 passes the tensor
    through. Chosen per message by the sum of squares over all its rows, so the channels may
    change from one message to the next; their indices travel (4 bytes each). The gradient
    passes through to the next codec's adjoint.
    """

    name = "outliers"
    negotiable_options = frozenset({"k"})

    def __init__(self, *, k: int = 4, seed: int = 0) -> None:
        super().__init__(seed=seed)
        if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_K:
            raise CompressionError(f"outliers option k must be an int in 0..{MAX_K}, got {k!r}")
        self.k = k

    def forward(self, x: torch.Tensor, ctx: CodecContext) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
        _wire.require_float(self.name, x)
        n, d = rows_of(tuple(x.shape))
        rows = x.detach().reshape(n, d)
        k = min(self.k, d) if n else 0
        if k:
            energy = rows.to(torch.float32).square().sum(0)
            if not torch.isfinite(energy).all():
                energy = rows.to(torch.float64).square().sum(0)  # float32 overflow, not inf values
            idx = torch.sort(torch.topk(energy, k).indices).values
        else:
            idx = torch.zeros(0, dtype=torch.int64, device=x.device)
        values = rows[:, idx]
        wide = values.to(torch.float32)
        v = wide.to(torch.float16) if (wide.abs().amax() <= FP16_MAX if wide.numel() else True) else wide
        rest = rows.clone()
        rest[:, idx] = 0
        arrays = {"idx": download(idx.to(torch.int32)), "v": download(v)}
        return rest.reshape(x.shape), arrays, tensor_meta(x)

    def _own(self, arrays: dict[str, Any], meta: dict[str, Any]) -> tuple[tuple[int, ...], torch.dtype, np.ndarray, np.ndarray]:
        own = Payload(self.name, self.version, arrays, meta)
        shape, dtype = _wire.meta_shape(own), _wire.meta_float_dtype(own)
        n, d = rows_of(shape)
        idx = _wire.array(own, "idx", np.int32)
        if idx.ndim != 1 or idx.size > min(d, MAX_K) or (idx.size and (idx.min() < 0 or idx.max() >= d)):
            raise CompressionError(f"outliers payload: 'idx' must list at most {min(d, MAX_K)} channels in [0, {d})")
        v = _wire.array(own, "v")
        if v.dtype not in (np.float16, np.float32) or v.shape != (n, idx.size):
            raise CompressionError(f"outliers payload: 'v' must be float16 or float32 of shape {(n, idx.size)}, "
                                   f"got {v.dtype} {v.shape}")
        if set(arrays) != {"idx", "v"}:
            raise CompressionError(f"outliers payload carries arrays {sorted(arrays)}, expected idx and v")
        return shape, dtype, idx, v

    def backward(self, y: torch.Tensor, arrays: dict[str, Any], meta: dict[str, Any], ctx: CodecContext) -> torch.Tensor:
        shape, dtype, idx, v = self._own(arrays, meta)
        if tuple(y.shape) != shape:
            raise CompressionError(f"outliers payload: the next codec decoded shape {tuple(y.shape)}, expected {shape}")
        n, d = rows_of(shape)
        rows = y.reshape(n, d).to(dtype)  # a copy unless the next codec made this dtype (then its own tensor)
        if idx.size:
            at = torch.from_numpy(idx.astype(np.int64)).to(rows.device)
            rows[:, at] = _wire.tensor(v, rows.device).to(dtype)
        return rows.reshape(shape)

    def own_decode_cost(self, arrays: dict[str, Any], meta: dict[str, Any], inner: Payload, ctx: CodecContext) -> int:
        """The decoded tensor converted to its dtype, the received values copied and converted, the indices."""
        shape, dtype, idx, v = self._own(arrays, meta)
        return math.prod(shape) * dtype.itemsize + v.size * (4 + dtype.itemsize) + idx.size * 8

    def own_encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Squares and sums per value, a copy, and the top k of the channels."""
        d = shape[-1] if shape else 1
        return 4 * math.prod(shape) + 4 * d * max(1, int(math.log2(max(d, 2))))
