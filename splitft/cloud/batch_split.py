"""``--split-batch``: one edge's heavy half on all the cloud's ranks, each batch split by rows.

Rank 0 serves the edge with sessions whose batches span the ranks; the other ranks follow its
commands. Each rank holds a replica of the half (:mod:`.replicas`), or with ``--shard`` a shard
of it (:mod:`.shard`, FSDP2); this room picks which, and hands the server its sessions and the
other ranks their worker.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .batch_link import BatchLink
from .replicas import BatchSplitSession, Worker
from .session import CloudSession
from .shard import ShardedSession, ShardedWorker, make_mesh


class BatchSplit:
    """A cloud's ranks splitting each batch: sessions on rank 0, :class:`Worker` on the others.

    Args:
        link: the ranks (default: the world torch.distributed was initialized with).
        shard: hold 1/N of the half on each rank (FSDP2, :mod:`.shard`) instead of a replica.
        device: where the half computes (the device mesh's kind when sharding).
        report: called with a line saying what a rank holds, once its first optimizer step is done.
    """

    def __init__(self, link: BatchLink | None = None, shard: bool = False, device: torch.device | None = None,
                 report: Callable[[str], None] | None = None) -> None:
        self.link = link or BatchLink()
        self.report = report
        self.mesh = make_mesh(device or torch.device("cpu"), self.link) if shard else None

    @property
    def rank(self) -> int:
        return self.link.rank

    @property
    def world(self) -> int:
        return self.link.world

    def make_session(self) -> Callable[..., CloudSession]:
        """What rank 0's server builds its sessions with."""
        if self.mesh is not None:
            return functools.partial(ShardedSession, link=self.link, report=self.report, mesh=self.mesh)
        return functools.partial(BatchSplitSession, link=self.link, report=self.report)

    def serve_worker(self, factories: dict[str, Callable[..., nn.Module]], limits: Any = None,
                     placement: Any = None) -> None:
        """A rank >= 1: follow rank 0's commands until it stops."""
        if self.mesh is not None:
            ShardedWorker(self.link, factories, limits, placement, self.report, mesh=self.mesh).serve()
        else:
            Worker(self.link, factories, limits, placement, self.report).serve()

    def stop(self) -> None:
        """Rank 0: let the workers return."""
        if self.link.rank == 0:
            self.link.broadcast({"op": "stop"})


__all__ = ["BatchSplit"]
