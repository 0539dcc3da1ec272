"""Which device and dtype a half computes in, checked when a process starts.

A cloud exists to use hardware the edge lacks, so it picks the first GPU when there is one. A
device string is validated against what this machine has before anything else happens, so a
typo or a missing GPU is one clear line at start-up, not a traceback in the middle of a run.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import torch

from .errors import ConfigError, ProtocolError
from .wire.protocol import _short

_DEVICE = re.compile(r"^(cpu|mps|cuda)(?::(\d+))?$")
#: The dtypes a cloud half may be kept in (``--dtype``); the edge's tensors keep their own.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def default_device() -> torch.device:
    """The first GPU when there is one (CUDA, then Apple's MPS), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    if _mps_available():
        return torch.device("mps")
    return torch.device("cpu")


def _mps_available() -> bool:
    backend = getattr(torch.backends, "mps", None)
    return bool(backend is not None and backend.is_available())


def resolve_device(spec: str | torch.device | None) -> torch.device:
    """``spec`` ("cpu", "cuda", "cuda:1", "mps"; None: :func:`default_device`) as a device this
    machine has, or a :class:`ConfigError` saying what it has instead."""
    if spec is None or spec == "auto":
        return default_device()
    text = str(spec).strip().lower()
    match = _DEVICE.match(text)
    if match is None:
        raise ConfigError(f"device must be cpu, cuda, cuda:N or mps, got {str(spec)!r}")
    kind, index = match.group(1), match.group(2)
    if kind == "cpu":
        if index not in (None, "0"):
            raise ConfigError(f"device {text!r}: the CPU has no index; use 'cpu'")
        return torch.device("cpu")
    if kind == "mps":
        if not _mps_available():
            raise ConfigError("device 'mps' asked for, but this machine has no Apple GPU (MPS) that torch can use")
        return torch.device("mps")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        raise ConfigError(f"device {text!r} asked for, but torch sees no CUDA GPU on this machine "
                          f"(torch {torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); "
                          "use --device cpu, or install a CUDA build of torch")
    n = int(index or 0)
    if n >= count:
        raise ConfigError(f"device {text!r} asked for, but this machine has {count} CUDA GPU(s): "
                          f"cuda:0 .. cuda:{count - 1}")
    return torch.device("cuda", n)


def resolve_dtype(spec: str | torch.dtype | None) -> torch.dtype | None:
    """A cloud half's dtype (None: keep the model's own)."""
    if spec is None or isinstance(spec, torch.dtype) and spec in DTYPES.values():
        return spec
    text = str(spec).removeprefix("torch.")
    if text not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {str(spec)!r}")
    return DTYPES[text]


def autocast_dtype(device_type: str) -> str | None:
    """The dtype of the autocast region the caller is in for ``device_type`` (None outside one):
    the edge's forward ran under it, and the cloud computes its half under the same autocast."""
    try:
        if not torch.is_autocast_enabled(device_type):
            return None
        return str(torch.get_autocast_dtype(device_type)).removeprefix("torch.")
    except (RuntimeError, TypeError):  # a device type this torch has no autocast for
        return None




_AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def autocast_region(dtype: str | None, device: torch.device) -> Any:
    """The autocast region an edge's forward ran in (its dtype, as the edge named it), for the
    cloud's half of it on ``device``; a dtype other than bfloat16 or float16 is refused."""
    if dtype is None:
        return contextlib.nullcontext()
    if dtype not in _AUTOCAST:
        raise ProtocolError(f"autocast dtype must be one of {sorted(_AUTOCAST)}, got {_short(dtype)}")
    return torch.autocast(device.type, dtype=_AUTOCAST[dtype])


class Placement:
    """Where a cloud half lives and computes: a device, and optionally a dtype it is kept in.

    With a ``dtype`` (``--dtype bfloat16``) the half's parameters and buffers are cast once;
    the edge's tensors are cast to it on the way in and back to their own dtype on the way out,
    inside the autograd graph, so the gradients that cross keep the edge's dtype too.
    """

    def __init__(self, device: str | torch.device | None = "cpu", dtype: str | torch.dtype | None = None, *,
                 offload: bool = False) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype)
        #: keep the half's optimizer state in host memory between steps (``--offload-optimizer``)
        self.offload = bool(offload)

    def place(self, module: torch.nn.Module) -> None:
        """Move (and cast) ``module`` here; a no-op for one already placed."""
        module.to(device=self.device)
        if self.dtype is not None:
            module.to(dtype=self.dtype)

    def cast_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """An incoming floating tensor in the half's dtype (others as they are)."""
        if self.dtype is None or not tensor.is_floating_point() or tensor.dtype == self.dtype:
            return tensor
        return tensor.to(self.dtype)

    def __repr__(self) -> str:
        return f"Placement({self.device}{', ' + str(self.dtype).removeprefix('torch.') if self.dtype else ''})"


__all__ = ["DTYPES", "Placement", "autocast_dtype", "autocast_region", "default_device", "resolve_device", "resolve_dtype"]
