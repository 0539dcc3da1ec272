"""``splitft cloud --offload-optimizer``: a half's optimizer state kept in host memory between
steps (STRONGHOLD's and ZeRO-Offload's idea, for the state that is largest: Adam keeps two
tensors per parameter, twice the half's weights).

Between steps the state lives in host tensors (pinned when the half is on a GPU, so the copies
run asynchronously); a step copies it onto the half's device, steps there, and copies it back,
freeing the device's copy. The weights and gradients stay on the device: the forward and backward
need them, and moving them per request would cost every message what this costs every step. The
arithmetic is the optimizer's own on the same device, so a step's result is the one without
offload, bit for bit (tested on the CPU, where the copies are real copies too).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch


def _tensors(optimizer: torch.optim.Optimizer) -> Iterator[tuple[dict, str, torch.Tensor]]:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                yield state, key, value


def to_host(optimizer: torch.optim.Optimizer) -> int:
    """Move every state tensor of ``optimizer`` into a host copy; returns the bytes now on the host."""
    moved = 0
    for state, key, value in _tensors(optimizer):
        host = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=value.is_cuda)
        host.copy_(value, non_blocking=value.is_cuda)
        state[key] = host
        moved += host.nbytes
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # the device copies are freed only once read
    return moved


def to_device(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Copy every host state tensor of ``optimizer`` onto ``device`` for a step. A step counter
    that the optimizer keeps on the host (Adam's ``step`` without ``capturable``) stays there."""
    for state, key, value in _tensors(optimizer):
        if key == "step" and value.dim() == 0 and not _capturable(optimizer):
            continue
        state[key] = value.to(device, non_blocking=value.is_pinned(), copy=True)


def _capturable(optimizer: torch.optim.Optimizer) -> bool:
    return any(group.get("capturable") or group.get("fused") for group in optimizer.param_groups)


def stepping(optimizer: torch.optim.Optimizer, device: torch.device, enabled: bool) -> AbstractContextManager[None]:
    """Around one optimizer step: the state on ``device`` during it, on the host after it (not
    offloading, nothing: no generator built per step for it)."""
    return _offloaded(optimizer, device) if enabled else _NOTHING


_NOTHING = nullcontext()


@contextmanager
def _offloaded(optimizer: torch.optim.Optimizer, device: torch.device) -> Iterator[None]:
    to_device(optimizer, device)
    try:
        yield
    finally:
        to_host(optimizer)


__all__ = ["stepping", "to_device", "to_host"]
