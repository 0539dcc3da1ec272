"""The cloud command as a torch.distributed job: ``splitft cloud --workers N``, or under torchrun.

``--workers N`` starts the same job torchrun would, with torch's own launcher: the ranks are
``python -m splitft cloud ...`` processes under torch.distributed's elastic agent (the engine
behind torchrun), with a c10d rendezvous on a free port of this machine, as
``torchrun --standalone`` does. When a rank dies the agent stops the others and starts the group
again, up to ``--max-restarts`` times; the edges of every rank then come back to the front door
(the restarted rank 0 binds the same address) and resume from the shared checkpoint folder.

The other functions are the command's hooks: with one process and no torchrun environment each
of them leaves the command as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import uuid
from collections.abc import Callable
from typing import Any

from ..errors import ConfigError, SplitFTError
from .limits import Limits
from .job_store import ensure_job_secret
from .ranks import RankEnv, RankGroup, launched


class RanksFailed(SplitFTError):
    """The group of ranks kept failing: the launcher gave up after its restarts."""


def launch(workers: int, argv: list[str], *, max_restarts: int = 3, monitor_interval: float = 0.2) -> None:
    """Run ``splitft <argv>`` as ``workers`` ranks on this machine, until the job ends."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    # Each rank computes on its share of the cores (torchrun sets 1 when it launches several).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    ensure_job_secret()  # the ranks inherit it: what they write in the job's store is signed with it
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=workers, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=max_restarts,
                          monitor_interval=monitor_interval, start_method="spawn")
    try:
        elastic_launch(config, sys.executable)("-m", "splitft", *argv)
    except ChildFailedError as exc:
        raise RanksFailed(f"the group of {workers} ranks failed after {max_restarts} restart(s): {exc}") from None


def launch_for(args: argparse.Namespace) -> None:
    """``--workers N``: the job; a shared half takes its own ranks, so it is refused."""
    if args.shared_model:
        raise ConfigError("--workers places per-edge sessions on ranks; a shared half (--shared-model "
                          "--sync-rounds) runs one listener per rank: start those ranks with torchrun")
    launch(args.workers, args.argv, max_restarts=args.max_restarts)


def join(args: argparse.Namespace) -> RankGroup | None:
    """This process's rank in the job, its group joined (None: one process, nothing changes).

    A shared half (``--shared-model``) joins its ranks itself, for its data-parallel rounds, and
    places no session: every rank serves the edges that connect to it. ``--split-batch`` joins
    them too: rank 0 serves one edge and the others compute its batch's shares.
    """
    env = RankEnv.from_environ()
    if env is None or args.shared_model or getattr(args, "split_batch", False):
        return None
    return RankGroup.join(env, rank_timeout=args.rank_timeout)


def device(group: RankGroup | None, spec: str | None) -> str | None:
    """The device of this rank's halves: with several ranks on a GPU machine, the local rank's GPU
    unless ``--device`` names one."""
    import torch

    if group is None or spec not in (None, "auto", "cuda") or not torch.cuda.is_available():
        return spec
    return f"cuda:{group.env.local_rank % torch.cuda.device_count()}"


def tag(group: RankGroup | None) -> str:
    """`` rank R/N (pid P)`` for the command's messages ("" for one process)."""
    return "" if group is None else f" rank {group.rank}/{group.world_size} (pid {os.getpid()})"


def bind_address(group: RankGroup | None, args: argparse.Namespace) -> str:
    return args.bind if group is None else group.bind_address(args.bind, args.rank_port)


def server_class(group: RankGroup | None, default: type, listener: Any, args: argparse.Namespace,
                 limits: Limits) -> tuple[Callable[..., Any], Limits]:
    """The server to build and its limits; a rank publishes its address and takes its share of memory."""
    if group is None:
        return default, limits
    from .rank_server import RankServer

    group.publish(listener.address, args.rank_host)
    if not any(a.split("=")[0] == "--memory-mb" for a in args.argv):
        # --memory-mb's default is half the machine: ranks sharing one machine share it.
        limits = dataclasses.replace(limits, memory_bytes=limits.memory_bytes // group.env.local_world_size)
    return functools.partial(RankServer, group=group), limits


def ready(group: RankGroup | None, say: Callable[[str], None], timeout: float = 60.0) -> bool:
    """Whether this process announces the cloud (rank 0, once every rank published its address)."""
    if group is None:
        return True
    if group.rank != 0:
        return False
    missing = group.wait_for_ranks(timeout)
    if missing:
        say(f"ranks {missing} did not publish an address within {timeout:g} s; serving with the others")
    return True


def leave(group: RankGroup | None) -> None:
    if group is not None:
        group.close()


__all__ = ["RanksFailed", "bind_address", "device", "join", "launch", "launch_for", "launched", "leave", "ready", "server_class",
           "tag"]
