"""Where a codec computes: on the tensor's own device, so only the payload crosses to the host.

A codec encodes a tensor where it lives (a GPU activation is quantized, factored or bound on
the GPU) and copies only the payload's arrays to the host; it decodes a payload by copying
those small arrays to the device the receiver names (``CodecContext.device``) and expanding
them there. Numpy kernels (bit packing, sign tables) stay the fast path for CPU tensors; the
torch kernels that replace them elsewhere produce the same bytes, which
:func:`portable_kernels` lets a CPU-only machine check.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import numpy as np
import torch

#: Payload arrays at least this large go to a CUDA device through pinned host memory.
PINNED_FROM = 1 << 16

_PORTABLE = contextvars.ContextVar("compressors_portable_kernels", default=False)


@contextlib.contextmanager
def portable_kernels(enabled: bool = True) -> Iterator[None]:
    """Within the block, codecs use their torch kernels (the ones accelerators run) on CPU
    tensors too, instead of their numpy fast paths: for tests and benchmarks of the device path
    on machines without an accelerator."""
    token = _PORTABLE.set(enabled)
    try:
        yield
    finally:
        _PORTABLE.reset(token)


def use_torch(device: torch.device | str | None) -> bool:
    """Whether work on ``device`` takes the torch kernels (an accelerator, or forced)."""
    return _PORTABLE.get() or (device is not None and torch.device(device).type != "cpu")


def target(device: torch.device | str | None) -> torch.device:
    """The device a decode produces its tensor on (the host when none is named)."""
    return torch.device("cpu") if device is None else torch.device(device)


def upload(a: np.ndarray, device: torch.device | str | None) -> torch.Tensor:
    """A received array as a tensor on ``device``, safe to write to.

    Arrays rebuilt from wire frames are read-only: on the host they are copied (a tensor over
    read-only memory is undefined behaviour once written); to an accelerator the transfer is
    the copy.
    """
    dev = target(device)
    if dev.type != "cuda" or a.nbytes < PINNED_FROM:
        host = host_tensor(a)
        return host if dev.type == "cpu" else host.to(dev)
    # one copy into page-locked memory, from which the transfer runs asynchronously (torch's
    # host allocator keeps the buffer until the copy is done)
    pinned = torch.empty(a.shape, dtype=torch_dtype(a.dtype), pin_memory=True)
    pinned.numpy()[...] = a
    return pinned.to(dev, non_blocking=True)


#: Where torch's own allocator puts a tensor's first byte. A received frame can start anywhere (ZeroMQ
#: hands over slices of its receive buffer), and math libraries pick their kernels, and so the order of
#: their sums, by alignment: the same values at another address can give results an ulp apart.
ALIGNMENT = 64

#: Received frames smaller than this may lie in a buffer ZeroMQ shares between the messages of one
#: read (its receive batch, 8 KiB), so what is decoded from them gets memory of its own.
SHARED_BELOW = 8192


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """A received array as a host tensor, safe to write to and aligned as torch aligns its own
    tensors, so what is computed from it is bitwise what the sender would compute. Zero-copy when
    the array already is both; else one copy (a read-only frame needed one anyway).

    Integers and booleans (their sums are exact in any order) and single values (no order of sums
    at all) compute alike wherever they lie, aligned by their element: those skip torch's
    allocator, whose tensor operations would run cold for a few bytes of labels or a loss. Under
    :data:`SHARED_BELOW` those are copied even so: their frame may lie in a receive buffer ZeroMQ
    shares between messages, which a tensor kept (a loss in a list) would keep whole.
    """
    if a.dtype.kind in "biu" or a.size <= 1:
        if a.nbytes < SHARED_BELOW or not (a.flags.writeable and a.flags.c_contiguous
                                           and a.ctypes.data % a.itemsize == 0):
            a = a.copy()  # numpy aligns its own arrays by their element
        return torch.from_numpy(a)
    if a.flags.writeable and a.flags.c_contiguous and a.ctypes.data % ALIGNMENT == 0:
        return torch.from_numpy(a)
    out = torch.empty(a.shape, dtype=torch_dtype(a.dtype))
    out.numpy()[...] = a
    return out


_TORCH_DTYPES: dict[np.dtype, torch.dtype] = {}


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """torch's dtype for a numpy one. Looked up once per dtype: asking torch builds a tensor, a
    path of its own that a received message would take cold each time."""
    found = _TORCH_DTYPES.get(dtype)
    if found is None:
        found = _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
    return found


def download(x: torch.Tensor) -> np.ndarray:
    """A tensor's values as a host numpy array (one copy when it lives on an accelerator)."""
    x = x.detach()
    if x.device.type != "cpu":
        x = x.to("cpu")
    return x.contiguous().numpy()


__all__ = ["ALIGNMENT", "download", "host_tensor", "portable_kernels", "target", "torch_dtype", "upload", "use_torch"]
