"""Checked reads of a payload's arrays and metadata.

A payload may come from an untrusted peer. Decoders read it through these helpers so that a
missing array, a wrong dtype or size, or a malformed header becomes a :class:`CompressionError`
naming what was expected, never an IndexError deep in numpy or an out-of-memory allocation.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ._device import download, host_tensor, upload
from .base import Payload, torch_dtype
from .errors import CompressionError


def array(payload: Payload, key: str, dtype: Any = None, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """``payload.arrays[key]``, checked for dtype and shape when they are given."""
    a = payload.arrays.get(key)
    if not isinstance(a, np.ndarray):
        raise CompressionError(
            f"{payload.codec} payload lacks array {key!r} (has {sorted(payload.arrays)})"
        )
    if dtype is not None and a.dtype != np.dtype(dtype):
        raise CompressionError(f"{payload.codec} payload array {key!r}: expected dtype {np.dtype(dtype)}, got {a.dtype}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise CompressionError(
            f"{payload.codec} payload array {key!r}: expected shape {tuple(shape)}, got {tuple(a.shape)}"
        )
    return a


def arrays_nbytes(payload: Payload) -> int:
    """Bytes of the payload's arrays (anything that is not an array counts 0: decode refuses it)."""
    return sum(int(a.nbytes) for a in payload.arrays.values() if isinstance(a, np.ndarray))


def meta_int(payload: Payload, key: str, lo: int, hi: int) -> int:
    """An integer metadata field within ``[lo, hi]``."""
    v = payload.meta.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise CompressionError(f"{payload.codec} payload meta {key!r}: expected an int in [{lo}, {hi}], got {v!r}")
    return v


def meta_str(payload: Payload, key: str, allowed: tuple[str, ...]) -> str:
    """A string metadata field from a fixed set."""
    v = payload.meta.get(key)
    if v not in allowed:
        raise CompressionError(f"{payload.codec} payload meta {key!r}: expected one of {allowed}, got {v!r}")
    return v


def meta_shape(payload: Payload, max_numel: int = 1 << 40) -> tuple[int, ...]:
    """The encoded tensor's shape: a list of non-negative ints with a sane element count."""
    shape = payload.meta.get("shape")
    if not isinstance(shape, (list, tuple)) or not all(
        isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise CompressionError(f"{payload.codec} payload meta 'shape': expected a list of ints >= 0, got {shape!r}")
    if math.prod(shape) > max_numel:
        raise CompressionError(f"{payload.codec} payload meta 'shape' {shape} has too many elements")
    return tuple(shape)


def meta_float_dtype(payload: Payload) -> torch.dtype:
    """The floating dtype the decoded tensor must have."""
    dtype = torch_dtype(payload.meta.get("dtype", ""))
    if not dtype.is_floating_point:
        raise CompressionError(f"{payload.codec} payload names dtype {dtype}, expected a floating dtype")
    return dtype


def require_float(codec: str, x: torch.Tensor) -> None:
    """Codecs of real-valued traffic refuse integer and complex tensors up front."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        what = x.dtype if isinstance(x, torch.Tensor) else type(x).__name__
        raise CompressionError(f"codec {codec!r} encodes floating tensors, got {what}")


def all_finite(x: torch.Tensor) -> bool:
    """Whether no element of ``x`` is inf or NaN.

    ``torch.isfinite(x).all()`` materialises a bool tensor and costs about 20x a sum on CPU. A
    sum is finite only if every term is (inf and NaN propagate through it), so a finite sum
    settles the common case in one cheap pass; only a non-finite sum, which a huge but finite
    tensor can also produce, pays for the exact test.
    """
    if x.numel() == 0:
        return True
    if x.is_complex():  # finite where both parts are
        x = torch.view_as_real(x.detach().resolve_conj())
    acc = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else None
    if math.isfinite(x.detach().sum(dtype=acc).item()):
        return True
    return bool(torch.isfinite(x.detach()).all())


def tensor(a: np.ndarray, device: torch.device | str | None = None) -> torch.Tensor:
    """A tensor from a received array, on ``device`` (the host when None). Arrays rebuilt from
    wire frames are read-only, and a tensor over read-only memory is undefined behaviour once
    written, so those are copied (see :func:`compressors._device.upload`)."""
    if device is None:  # the host: skip building a device per received tensor
        return host_tensor(a)
    return upload(a, device)


def wire_float(x: torch.Tensor) -> np.ndarray:
    """A float tensor as a numpy array in its own dtype (bfloat16, which numpy lacks, as float32)."""
    x = x.detach()
    if x.dtype == torch.bfloat16:
        x = x.float()
    return download(x)


def wire_float_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy dtype :func:`wire_float` produces for a tensor of ``dtype``."""
    return np.dtype("float32") if dtype == torch.bfloat16 else np.dtype(str(dtype).removeprefix("torch."))
