"""Averaging a shared half's gradient across the ranks of a data-parallel cloud.

Each rank serves its own edges and closes its own rounds (:mod:`.rounds`). Once a round is closed
on a rank, the ranks all-reduce two things, asynchronously, so the server loop keeps serving:

1. a few float64 numbers: how many edges contributed, a fingerprint of the weights (the ranks'
   copies must be equal: a difference is an error, never trained through) and which parameters
   have a gradient;
2. the sum of the rank's edges' gradients, as one flat bucket, through a DDP communication hook
   from ``torch.distributed.algorithms.ddp_comm_hooks``: plain all-reduce, fp16 compression or
   PowerSGD (with its warm-up, error feedback and warm start).

The hooks average over ranks; the global mean is that times the world size over the total count,
so a rank that served two edges weighs twice one that served one. The bucket is a real DDP
``GradBucket`` made by torch's ``Reducer`` over stand-in tensors of the half's shapes, never the
half's own parameters, so an edge's backward can never trigger it.
"""

from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from ..errors import ConfigError

log = logging.getLogger(__name__)

KINDS = ("none", "fp16", "powersgd")
_POWERSGD_OPTIONS = {"rank": int, "start": int, "min_rate": float}


@dataclass(frozen=True)
class GradCompression:
    """How the ranks' gradient all-reduce is compressed (``--grad-compression``).

    ``powersgd`` options: ``rank`` (of the low-rank approximation), ``start`` (rounds of plain
    all-reduce before compressing; at least 2, as PowerSGD's error feedback needs), ``min_rate``
    (a matrix is compressed only when that saves this factor).
    """

    kind: str = "none"
    rank: int = 1
    start: int = 10
    min_rate: float = 2.0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"gradient compression must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.rank < 1 or self.start < 2 or not (math.isfinite(self.min_rate) and self.min_rate > 0):
            raise ConfigError(f"powersgd needs rank >= 1, start >= 2 and a positive min_rate, got rank={self.rank}, "
                              f"start={self.start}, min_rate={self.min_rate}")

    @classmethod
    def parse(cls, spec: str) -> GradCompression:
        """``none``, ``fp16`` or ``powersgd:rank=R[,start=S][,min_rate=M]``."""
        kind, _, rest = spec.strip().partition(":")
        if kind != "powersgd":
            if rest:
                raise ConfigError(f"gradient compression {kind!r} takes no options, got {spec!r}")
            return cls(kind)
        options: dict[str, Any] = {}
        for item in filter(None, rest.split(",")):
            name, eq, value = item.partition("=")
            if not eq or name not in _POWERSGD_OPTIONS:
                raise ConfigError(f"powersgd options are {', '.join(_POWERSGD_OPTIONS)} (name=value), got {item!r}")
            try:
                options[name] = _POWERSGD_OPTIONS[name](value)
            except ValueError:
                raise ConfigError(f"powersgd option {name} must be a number, got {value!r}") from None
        return cls("powersgd", **options)

    def __str__(self) -> str:
        if self.kind != "powersgd":
            return self.kind
        return f"powersgd:rank={self.rank},start={self.start},min_rate={self.min_rate:g}"


def group_from_env(backend: str = "gloo", timeout: timedelta | None = None) -> bool:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).

    Returns whether this process is one rank of several. A group created by the launcher beforehand
    is used as it is. ``timeout``: how long a collective may wait (default: torch's).
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size() > 1
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing:
        raise ConfigError(f"WORLD_SIZE is set but {', '.join(missing)} is not: launch the ranks with torchrun")
    dist.init_process_group(backend, timeout=timeout)
    log.info("rank %d of %d joined the %s group", dist.get_rank(), dist.get_world_size(), backend)
    return True


@dataclass
class Reduced:
    """What a finished reduction gives: the global mean gradient (flat), edges and ranks' agreement."""

    mean: torch.Tensor | None  # None when no edge of any rank contributed
    total: int
    has_grad: list[bool]
    nbytes: int  # the gradient payload this rank put into the all-reduce
    seconds: float


class Reduction:
    """One round's all-reduce in flight."""

    def __init__(self, meta: torch.Tensor, work: Any, future: Any, world: int, expected: torch.Tensor,
                 nbytes: int) -> None:
        self.meta, self.work, self.future, self.world = meta, work, future, world
        self.expected, self.nbytes = expected, nbytes
        self.started = time.perf_counter()

    def done(self) -> bool:
        return bool(self.work.is_completed()) and bool(self.future.done())

    def result(self) -> Reduced:
        """The reduced gradient; raises ConfigError when the ranks' weights differ."""
        self.work.wait()
        grads = self.future.value()
        grads = grads[0] if isinstance(grads, list) else grads
        meta = self.meta.cpu()
        fingerprint, ours = meta[1:3], self.expected * self.world
        if not torch.allclose(fingerprint, ours, rtol=1e-9, atol=1e-12):
            raise ConfigError("the ranks' copies of the shared half differ (every rank's edges must start from the "
                              f"same weights: a deterministic factory or the same pushed weights); fingerprints sum to "
                              f"{fingerprint.tolist()}, {ours.tolist()} expected")
        total = int(round(float(meta[0])))
        has_grad = [bool(v > 0) for v in meta[3:]]
        mean = grads * (self.world / total) if total else None
        return Reduced(mean, total, has_grad, self.nbytes, time.perf_counter() - self.started)


class RankReducer:
    """A shared half's gradient bucket and communication hook, for one process group.

    Args:
        shapes: the half's parameter shapes, in ``parameters()`` order.
        dtype, device: of the flat gradient buffer.
        compression: which DDP communication hook reduces it.
        group: the process group (default: the world).
    """

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype, device: torch.device,
                 compression: GradCompression, group: Any = None) -> None:
        chosen = group if group is not None else dist.group.WORLD
        if chosen is None:
            raise ConfigError("the ranks' gradient sum needs torch.distributed initialized (launch the ranks with "
                              "torchrun)")
        self.group: dist.ProcessGroup = chosen
        self.world = dist.get_world_size(self.group)
        self.compression = compression
        stand_ins = [torch.zeros(shape, dtype=dtype, device=device, requires_grad=True) for shape in shapes]
        cap = max(1, sum(t.numel() for t in stand_ins) * t_size(dtype))
        self._reducer = dist.Reducer(stand_ins, [list(range(len(stand_ins)))], [cap], self.group)
        self.bucket = self._reducer._get_zeros_like_grad_buckets()[0]
        self.state = None
        if compression.kind == "powersgd":
            self.state = powerSGD_hook.PowerSGDState(
                self.group, matrix_approximation_rank=compression.rank, start_powerSGD_iter=compression.start,
                min_compression_rate=compression.min_rate, random_seed=0)

    @property
    def flat(self) -> torch.Tensor:
        """The bucket's buffer: the rank's edges' gradients are summed into it."""
        return self.bucket.buffer()

    def views(self) -> list[torch.Tensor]:
        """One view of the buffer per parameter."""
        return self.bucket.gradients()

    def start(self, count: int, fingerprint: torch.Tensor, has_grad: list[bool]) -> Reduction:
        """All-reduce the count, fingerprint and gradient-present flags, and the bucket, without waiting."""
        meta = torch.tensor([float(count), *fingerprint.tolist(), *map(float, has_grad)], dtype=torch.float64,
                            device=self.flat.device)
        work = dist.all_reduce(meta, group=self.group, async_op=True)
        numel, size = self.flat.numel(), t_size(self.flat.dtype)
        if self.state is not None:
            before, warm = self.state.total_numel_after_compression, self.state.iter < self.state.start_powerSGD_iter
            future = powerSGD_hook.powerSGD_hook(self.state, self.bucket)
            nbytes = numel * size if warm else (self.state.total_numel_after_compression - before) * size
        elif self.compression.kind == "fp16":
            future, nbytes = default_hooks.fp16_compress_hook(self.group, self.bucket), numel * 2
        else:
            future, nbytes = default_hooks.allreduce_hook(self.group, self.bucket), numel * size
        return Reduction(meta, work, future, self.world, fingerprint, int(nbytes))


def t_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def fingerprint(params: list[torch.Tensor]) -> torch.Tensor:
    """Two float64 numbers that differ between two copies of a half whose weights differ."""
    with torch.no_grad():
        flat = [p.detach().double().flatten() for p in params]
        total = sum((f.sum() for f in flat), torch.zeros((), dtype=torch.float64))
        squares = sum(((f * f).sum() for f in flat), torch.zeros((), dtype=torch.float64))
    return torch.stack([total, squares]).cpu()


__all__ = ["GradCompression", "RankReducer", "Reduced", "Reduction", "fingerprint", "group_from_env"]
