"""One heavy half sharded across the ranks that split its batch (``--split-batch --shard``).

With ``--split-batch`` alone every rank holds a replica of the half; with ``--shard`` each holds
1/N of its parameters, gradients and optimizer state (FSDP2's ``fully_shard``: each child
module of a stage that holds parameters is one unit, the chain the root). Each rank still
computes its own rows of every batch (:mod:`.replicas`); FSDP2 gathers a unit's parameters
for its forward and backward and reduce-scatters its gradients, summed over the ranks' rows (not
averaged: the divide factor is 1), so every shard of the gradient is the whole batch's, as a
replica's is after its all-reduce. The mirrored optimizer steps each rank's shard: elementwise
optimizers (SGD, Adam, AdamW...) step exactly as on a whole half.

Every forward and backward is now collective: every rank must take part in each unit's
all-gather, so a batch needs at least one row per rank, and a rank that failed to build its
half stops the hello. What the edge asks for whole is gathered (weights, gradient norms), and
weights it loads reach each rank whole and are cut there into its shard.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.experimental import implicit_replication

from ..cut import Chain
from ..devices import Placement
from ..errors import ConfigError, SplitFTError
from ..wire import protocol
from .batch_link import BatchLink
from .budget import MODEL_STATE_FACTOR, holdings, tensors_nbytes
from .half import Half, check_norm_type, host_state
from .replicas import BatchSplitSession, Worker
from .session import CloudSession

log = logging.getLogger(__name__)


def make_mesh(device: torch.device, link: BatchLink) -> DeviceMesh:
    """The ranks of ``link`` as a one-dimensional device mesh (every rank calls it, at once)."""
    if link.group is not None:
        return DeviceMesh.from_group(link.group, device.type)
    return init_device_mesh(device.type, (link.world,))


def _holds_parameters(module: nn.Module) -> bool:
    return next(module.parameters(), None) is not None


def shard_half(chain: Chain, mesh: DeviceMesh) -> None:
    """Shard ``chain`` (a :class:`~splitft.cut.Chain`) over ``mesh``: one unit per child of a stage
    that holds parameters (a stage without such children is a unit itself), then the root."""
    owners: dict[int, int] = {}
    for module in chain.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    if any(n > 1 for n in owners.values()):
        raise ConfigError("--shard cannot shard a half whose modules share a parameter (tied weights): "
                          "serve it with --split-batch alone (a replica per rank)")
    units = []
    for stage in chain.stages:
        children = [c for c in stage.children() if _holds_parameters(c)]
        units += children or ([stage] if _holds_parameters(stage) else [])
    for unit in units:
        fully_shard(unit, mesh=mesh)
    fully_shard(chain, mesh=mesh)
    for module in chain.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # the sum over the ranks' rows, as the replicas' all-reduce
            module.set_force_sum_reduction_for_comms(True)


def full_weights(chain: Chain) -> dict[str, torch.Tensor]:
    """The half's whole state under its original names; collective: every rank calls it."""
    return {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in chain.qualified_state_dict().items()}


def full_grads(half: Half) -> dict[str, torch.Tensor]:
    """The half's whole gradients by parameter name, where there is one; collective: every rank calls it."""
    return {name: p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            for name, p in half.named_params.items() if p.grad is not None}


def gradient_norms(params: list[nn.Parameter], norm_type: float) -> list[float | None]:
    """Each gradient's whole norm from the ranks' shards (None: no gradient); collective: every rank calls it."""
    norms: list[float | None] = []
    with torch.no_grad():
        for p in params:
            if p.grad is None:
                norms.append(None)
                continue
            norm = torch.linalg.vector_norm(p.grad, norm_type)
            norms.append(float(norm.full_tensor() if isinstance(norm, DTensor) else norm))
    return norms


def _host(placement: Placement) -> Placement:
    """Build the half on the host: only its shards go to the device."""
    return Placement("cpu", placement.dtype)


def _shard_nbytes(chain: nn.Module) -> int:
    """What this rank's shard of a trained half holds (weights, gradients, optimizer state)."""
    return MODEL_STATE_FACTOR * holdings(chain, None).param_bytes + tensors_nbytes(chain.buffers())


class ShardedSession(BatchSplitSession):
    """Rank 0's session of a half sharded across the ranks."""

    def __init__(self, hello: protocol.Hello, *args: Any, mesh: DeviceMesh, placement: Placement | None = None,
                 **kwargs: Any) -> None:
        target = placement or Placement()
        super().__init__(hello, *args, placement=_host(target), **kwargs)
        error: SplitFTError | None = None
        try:
            shard_half(self.half.chain, mesh)
        except SplitFTError as exc:  # raised once every rank's answer is in
            error = exc
        answers = [(r, self.link.recv_header(r).get("error")) for r in range(1, self.link.world)]
        if error is not None:
            raise error
        failed = [f"rank {r}: {e}" for r, e in answers if e]
        if failed:
            raise ConfigError("--shard: a rank could not hold its shard of the half (" + "; ".join(failed) + ")")
        self.sharded(target, _shard_nbytes(self.half.chain))

    def _split_rows(self, total: int) -> list[int]:
        if total < self.link.world:
            raise ConfigError(f"--shard computes every batch on all {self.link.world} ranks (each holds a shard of "
                              f"every layer); this batch has {total} row(s): send at least {self.link.world}, "
                              "or serve the half without --shard")
        return super()._split_rows(total)

    def _sum_grads(self, params: list[torch.Tensor]) -> None:
        """Nothing left to do: the backward reduce-scattered each gradient's sum into the shards."""

    def apply_ops(self, values: list) -> int:
        with implicit_replication():  # whole weights an edge loads are cut into each rank's shard
            return super().apply_ops(values)

    def grad_norms(self, norm_type: float, names: list | None = None) -> list[float | None]:
        check_norm_type(norm_type)
        params = self.half.parameters_named(names)  # checked before the other ranks are asked
        self.link.broadcast({"op": "norms", "norm_type": norm_type, "names": names})
        return gradient_norms(params, norm_type)

    def grads(self) -> dict[str, np.ndarray]:
        self.link.broadcast({"op": "grads"})
        return host_state(full_grads(self.half))

    def weights(self) -> dict[str, torch.Tensor]:
        self.link.broadcast({"op": "weights"})
        return full_weights(self.half.chain)


class ShardedWorker(Worker):
    """A rank >= 1 holding its shard of the half."""

    def __init__(self, *args: Any, mesh: DeviceMesh, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mesh = mesh

    def handlers(self) -> dict:
        return super().handlers() | {"norms": self._norms, "weights": self._weights, "grads": self._grads}

    def _replica(self, hello: protocol.Hello) -> CloudSession:
        return CloudSession(hello, self.factories, self.limits, restoring=True,
                            placement=_host(self.placement or Placement()), stream=self.link.rank)

    def _open(self, header: dict, frames: list[bytes]) -> None:
        super()._open(header, frames)
        session = self.session
        error = None if session is not None else "its hello failed there (see that rank's log)"
        if session is not None:
            try:
                shard_half(session.half.chain, self.mesh)
                session.sharded(self.placement or Placement(), _shard_nbytes(session.half.chain))
            except SplitFTError as exc:
                error, self.session = str(exc), None
        self.link.send_header({"error": error}, 0)

    def _ops(self, header: dict, frames: list[bytes]) -> None:
        with implicit_replication():
            super()._ops(header, frames)

    def _sum_grads(self, params: list[torch.Tensor]) -> None:
        """The backward reduce-scattered the gradients already."""

    def _norms(self, header: dict, frames: list[bytes]) -> None:
        gradient_norms(self._half().parameters_named(header["names"]), header["norm_type"])

    def _weights(self, header: dict, frames: list[bytes]) -> None:
        full_weights(self._half().chain)

    def _grads(self, header: dict, frames: list[bytes]) -> None:
        full_grads(self._half())

    def _half(self) -> Half:
        """This rank's shard of the half (rank 0 asks for norms and weights only of an open session)."""
        if self.session is None:
            raise ConfigError("this rank holds no shard of the half (its hello failed here)")
        return self.session.half


__all__ = ["ShardedSession", "ShardedWorker", "full_grads", "full_weights", "gradient_norms", "make_mesh", "shard_half"]
