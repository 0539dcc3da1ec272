"""What a request costs the cloud, known before any of it is spent.

A request's price is the arithmetic it makes the cloud do and the bytes of the checkpoint it
makes the cloud write. Each part is read from metadata and shapes alone:

- decoding its tensors: each codec's ``decode_flops`` (from the payload's metadata);
- the half's forward: a twin of the half on the ``meta`` device (shapes and dtypes, no data, no
  memory; whatever its forward caches stays on the twin) runs for the request's own input
  shapes, once per input signature and session, and each operation is counted with torch's
  FLOP formulas (``torch.utils.flop_counter.flop_registry``: matrix products, convolutions,
  attention), every other one as one per element it outputs. A backward costs twice its forward;
- encoding what goes back: each codec's ``encode_flops`` (a low-rank gradient codec's power
  iterations are most of a request's work at large ranks);
- an optimizer step: a few operations per parameter; a checkpoint: its bytes.

Arithmetic over ``Limits.max_request_flops`` is refused with ``capacity`` before it starts.
The price also says where the work runs (:mod:`.jobs`): a :class:`Pace` per session, measured on
its own requests, turns a price into seconds.
"""

from __future__ import annotations

import atexit
import copy
import hashlib
import logging
import math
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from ..errors import CapacityError
from .limits import Limits

log = logging.getLogger(__name__)

#: A backward pass costs about twice its forward (gradients of inputs and of weights).
BACKWARD_FACTOR = 2
#: An optimizer step's operations per parameter (Adam: about a dozen), at most.
STEP_FLOPS_PER_PARAM = 16
#: Work units per checkpoint byte: the copy off the device, the write, the hash of what was written.
CHECKPOINT_UNITS_PER_BYTE = 4
#: Input signatures whose forward cost a session keeps.
SIGNATURES = 16
#: The longest key text kept to spare the next identical key its hash (a step's is ~200 characters).
_LAST_KEPT = 4096


@dataclass
class Price:
    """What a request will cost: ``flops`` of arithmetic and ``checkpoint_bytes`` to write."""

    flops: int = 0
    checkpoint_bytes: int = 0

    @property
    def units(self) -> int:
        """One number for scheduling: operations, and each checkpoint byte as a few."""
        return self.flops + CHECKPOINT_UNITS_PER_BYTE * self.checkpoint_bytes


def check(flops: int, limits: Limits, what: str) -> None:
    """Refuse arithmetic over the cloud's per-request bound, before any of it is done."""
    if flops > limits.max_request_flops:
        raise CapacityError(
            f"{what} costs about {flops / 1e9:,.1f} GFLOP of work; this cloud does at most "
            f"{limits.max_request_flops / 1e9:,.1f} GFLOP per request (--max-request-gflop). Send smaller "
            "batches, or ask for cheaper codec settings (a lower rank, fewer iterations)")


class Pace:
    """Seconds per unit of work for one session, learnt from its own requests.

    It starts slow (a unit per nanosecond: a slow core), so a new session's large requests go
    to a worker until their pace is measured; only requests large enough to time teach it.
    """

    START = 1e-9
    FLOOR, CEILING = 1e-14, 1e-6
    MIN_UNITS = 10_000_000

    def __init__(self, seconds_per_unit: float = START) -> None:
        self.seconds_per_unit = seconds_per_unit

    def predict(self, price: Price) -> float:
        return price.units * self.seconds_per_unit

    def observe(self, price: Price, seconds: float) -> None:
        if price.units >= self.MIN_UNITS and seconds > 0:
            measured = min(max(seconds / price.units, self.FLOOR), self.CEILING)
            # Slower news counts at once; faster news halves the distance (a few requests to learn).
            self.seconds_per_unit = max(measured, 0.5 * (self.seconds_per_unit + measured))


class _Counter(TorchDispatchMode):
    """Counts the arithmetic of every operation run under it, on this thread only.

    Torch's formulas where it has one, else one per element the operation outputs. (Torch's own
    FlopCounterMode also tracks modules through hooks that are global to the process: they would
    reach the halves other threads are running.)
    """

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        formula = flop_registry.get(func.overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        else:
            self.flops += sum(t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor))
        return out


def meta_like(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor of the same shape and dtype on the ``meta`` device: no data, no memory."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device: its forward gives
    the shapes and the operations of the real one, holds no data, and changes nothing of it."""
    memo: dict[int, Any] = {}
    for param in module.parameters():
        memo[id(param)] = nn.Parameter(meta_like(param), requires_grad=param.requires_grad)
    for buffer in module.buffers():
        memo[id(buffer)] = meta_like(buffer)
    return copy.deepcopy(module, memo)


class HalfCost:
    """The arithmetic of a half's forward, counted on a meta twin of it per input signature."""

    def __init__(self, chain: nn.Module) -> None:
        self.chain = chain
        self.params = sum(p.numel() for p in chain.parameters())
        self._twin: nn.Module | None = None
        self._seen: OrderedDict[str, tuple[int, Any] | None] = OrderedDict()
        self._last = ("", "")  # the last key's text and its digest
        #: Forward operations per unit of decode work, from the last count (a guess before any).
        self.per_decode_flop = 2.0 * max(self.params, 1) / 4

    def guess(self, decode_flops: int) -> int:
        """A forward's cost before its inputs are decoded, from the last ratio counted."""
        return int(decode_flops * self.per_decode_flop)

    def forward(self, key: Any, run: Callable[[nn.Module], Any], decode_flops: int) -> tuple[int, Any] | None:
        """(operations, what ``run`` returned) for ``run(twin)``, a forward of the half's meta
        twin; None when the half cannot run there (data-dependent code, a module that cannot be
        copied). Counted once per ``key``."""
        text = repr(key)
        if text == self._last[0]:  # the same call as the last one (every training step): hashed already
            digest = self._last[1]
        else:
            digest = hashlib.sha256(text.encode()).hexdigest()
            self._last = (text, digest) if len(text) <= _LAST_KEPT else ("", "")
        if digest in self._seen:
            self._seen.move_to_end(digest)
            found = self._seen[digest]
        else:
            found = self._count(run)
            self._seen[digest] = found
            while len(self._seen) > SIGNATURES:
                self._seen.popitem(last=False)
        if found is not None and decode_flops > 0:
            self.per_decode_flop = max(found[0] / decode_flops, 1e-3)
        return found

    def _count(self, run: Callable[[nn.Module], Any]) -> tuple[int, Any] | None:
        try:
            if self._twin is None:
                self._twin = meta_twin(self.chain)
            with torch.no_grad(), _Counter() as counter:
                extra = run(self._twin)
        except Exception as exc:  # noqa: BLE001 — any failure means "not countable"; the guess stands
            log.debug("the half cannot be priced on the meta device: %s", exc)
            return None
        return counter.flops, extra

    def forget(self) -> None:
        """Count anew from the next forward: the half's settings changed (its modules' flags)."""
        self._twin = None
        self._seen.clear()

    def fallback(self, numel: int, last_dim: int) -> int:
        """A forward that could not be counted: every parameter once per row of its last dim."""
        return 2 * max(self.params, 1) * math.ceil(numel / max(last_dim, 1))


class Pricing:
    """One session's pricing state: what its half's forward costs per input signature, and the
    pace its requests run at (both learnt from its own requests)."""

    def __init__(self, chain: nn.Module) -> None:
        self.cost = HalfCost(chain)
        self.pace = Pace()


def warm_up() -> None:
    """Count a tiny forward once, so that the first session's first count does not pay for the
    import behind torch's dispatch modes (about a second, once per process)."""
    # On the meta device: it runs on a thread of its own, and building a layer on the host would
    # draw its initial weights from the process's generator, under whatever else runs meanwhile.
    HalfCost(nn.Linear(2, 2, device="meta")).forward("warm-up", lambda twin: twin(meta_like(torch.ones(1, 2))), 0)


_WARMING: threading.Thread | None = None
#: The most the process's exit waits for the warm-up, in seconds.
WARM_UP_EXIT_WAIT = 30.0


def start_warm_up() -> None:
    """Run :func:`warm_up` on a thread, once per process. A process that ends while that import
    runs on a daemon thread aborts (std::terminate), so its exit waits for the thread, up to
    :data:`WARM_UP_EXIT_WAIT` seconds (a daemon still: a warm-up that never ends cannot hold the
    process forever)."""
    global _WARMING
    if _WARMING is None:
        _WARMING = threading.Thread(target=warm_up, name="splitft-warm-up", daemon=True)
        _WARMING.start()
        atexit.register(_WARMING.join, WARM_UP_EXIT_WAIT)


__all__ = ["BACKWARD_FACTOR", "HalfCost", "Pace", "Price", "Pricing", "check", "meta_like", "meta_twin", "start_warm_up", "warm_up"]
