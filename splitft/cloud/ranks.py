"""A cloud of several processes: this rank's place in a torch.distributed job, and where sessions go.

A cloud launched by torchrun (or ``splitft cloud --workers N``, which uses torch's own launcher)
joins one process group (gloo on CPU, NCCL as well when CUDA is there) and uses the job's
key-value store, the TCPStore torchrun hosts, as its only shared state:

* ``addr/R``: where rank R listens for its edges, published once it is bound;
* ``beat/R``: rank R's heartbeat, rewritten every :data:`BEAT_EVERY` seconds with a counter that
  grows, its open sessions and the hellos it answered. The front door decides liveness by its own
  clock (a counter that stopped moving for ``rank_timeout`` seconds is a dead rank), so the
  machines' clocks need not agree;
* ``where/SESSION``: the rank that holds a session, so that an edge coming back to the front door
  is sent to the rank that still has it, or, when that rank is dead, placed on a live one that
  restores it from the shared checkpoint folder;
* run-wide (surviving a restart of the group): ``front`` (the front door's address, so that a
  restarted rank 0 binds the same one) and ``ended/R`` (sessions rank R ended, for ``--sessions``).

Per-attempt keys live under the launcher's restart count, so a group restarted by torchrun's agent
starts with a clean table. Serving never waits on a collective: a dead rank cannot block a live one.
Every value is signed with the job's secret and only signed values are read (:mod:`.job_store`):
whoever else reaches the store cannot steer placement, redirect edges or end the job.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from ..errors import ConfigError
from .job_store import SignedStore, job_secret

log = logging.getLogger(__name__)

BEAT_EVERY = 0.5  # seconds between heartbeats
_PENDING_FOR = 10.0  # seconds a placement counts against its rank before the edge's hello arrives there
_SESSION_ID = re.compile(r"[0-9a-f]{16}")
_WILDCARDS = ("0.0.0.0", "*", "::", "[::]")


def launched(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process was started as a rank of a job (torchrun or anything setting RANK)."""
    return "RANK" in environ and "WORLD_SIZE" in environ


@dataclass(frozen=True)
class RankEnv:
    """What the launcher tells this process about the job, from the variables torchrun sets."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    attempt: int  # the agent's restart count: keys of a restarted group do not mix with the last one's

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> RankEnv | None:
        """This rank's environment; None outside a job of more than one process."""
        if not launched(environ):
            return None
        try:
            rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
            env = cls(rank=rank, world_size=world, local_rank=int(environ.get("LOCAL_RANK", rank)),
                      local_world_size=int(environ.get("LOCAL_WORLD_SIZE", world)),
                      master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
                      master_port=int(environ.get("MASTER_PORT", "29500")),
                      attempt=int(environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
        except ValueError as exc:
            raise ConfigError(f"RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT must be integers ({exc}); start the "
                              "cloud with torchrun or 'splitft cloud --workers N'") from None
        if not 0 <= env.rank < env.world_size:
            raise ConfigError(f"RANK {env.rank} is not below WORLD_SIZE {env.world_size}")
        return env if env.world_size > 1 else None


@dataclass
class _View:
    """What the front door last saw of a rank's heartbeat: when (by its own clock) it first saw the
    current beat, and when it last looked."""

    beat: int = -1
    boot: str = ""  # the beating process: a rank restarted by hand counts from its own start
    moved_at: float = float("-inf")
    seen_at: float = float("-inf")
    sessions: int = 0
    hellos: int = 0
    stopped: bool = False


class RankGroup:
    """This process as one rank of a cloud: its addresses, heartbeat and the placement table.

    Args:
        env: the job, from :meth:`RankEnv.from_environ`.
        store: the job's key-value store (a ``torch.distributed.Store``).
        rank_timeout: seconds without a heartbeat after which the front door counts a rank dead.
        secret: what the ranks sign their values with (default: ``SPLITFT_JOB_SECRET``).
    """

    def __init__(self, env: RankEnv, store: dist.Store, *, rank_timeout: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, secret: bytes | None = None) -> None:
        if rank_timeout <= 2 * BEAT_EVERY:
            raise ConfigError(f"--rank-timeout must be above {2 * BEAT_EVERY:g} s (two heartbeats), got {rank_timeout:g}")
        self.env, self.rank, self.world_size = env, env.rank, env.world_size
        self.rank_timeout = rank_timeout
        secret = job_secret() if secret is None else secret
        self._run = SignedStore(store, "splitft", secret)
        self._now = SignedStore(store, f"splitft/attempt{env.attempt}", secret)
        self._boot = secrets.token_hex(8)
        self._lock = threading.Lock()  # one store request at a time from this process
        self._clock = clock
        self.addresses: dict[int, str] = {}
        self._views = {r: _View() for r in range(self.world_size) if r != self.rank}
        self._sent: dict[int, deque[float]] = {r: deque() for r in range(self.world_size)}
        self.hellos = 0  # hellos this rank answered: the front door subtracts them from its placements
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        self._warned = 0.0

    # ------------------------------------------------------------ joining

    @classmethod
    def join(cls, env: RankEnv, *, rank_timeout: float = 5.0, store_timeout: float = 30.0) -> RankGroup:
        """Join the job's process group and its store (gloo on CPU; NCCL too when CUDA is there)."""
        if torch.cuda.is_available():
            torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
            backend = "cpu:gloo,cuda:nccl"
        else:
            backend = "gloo"
        # torchrun's agent hosts the store and keeps it across restarts of the group; without an
        # agent, rank 0 hosts it. The group's own keys go under this attempt's prefix: gloo must not
        # find the addresses of the ranks a restart replaced.
        agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        secret = job_secret()  # before anything is joined: a rank without it must not start
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=env.rank == 0 and not agent,
                              timeout=timedelta(seconds=store_timeout), wait_for_workers=False)
        dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                                store=dist.PrefixStore(f"splitft/attempt{env.attempt}/group", store),
                                timeout=timedelta(seconds=max(60.0, store_timeout)))
        log.info("rank %d/%d joined the group (%s, attempt %d)", env.rank, env.world_size, backend, env.attempt)
        return cls(env, store, rank_timeout=rank_timeout, secret=secret)

    def bind_address(self, front: str, rank_port: int | None = None) -> str:
        """What this rank listens on: rank 0 the front door (the same one after a restart), others their own."""
        if self.rank == 0:
            if front.startswith("tcp://") and front.endswith(":0"):
                kept = self._get(self._run, "front")
                return kept if kept is not None else front
            return front
        if front.startswith("ipc://"):
            return f"{front}.rank{self.rank}"
        host = front[len("tcp://"):].rsplit(":", 1)[0]
        port = 0 if rank_port is None else rank_port + self.env.local_rank
        return f"tcp://{host}:{port}"

    def publish(self, address: str, rank_host: str | None = None) -> str:
        """Tell the group where this rank is (``rank_host`` replaces the host edges cannot use)."""
        if address.startswith("tcp://"):
            host, port = address[len("tcp://"):].rsplit(":", 1)
            if rank_host:
                host = rank_host
            elif host in _WILDCARDS and self.rank != 0:
                host = socket.getfqdn()
                log.warning("rank %d listens on every interface; edges will be sent to %s (set --rank-host)",
                            self.rank, host)
            address = f"tcp://{host}:{port}"
        with self._lock:
            if self.rank == 0:
                self._run.set("front", address)
            self._now.set(f"addr/{self.rank}", address)
        self.addresses[self.rank] = address
        return address

    def wait_for_ranks(self, timeout: float) -> list[int]:
        """Wait until every rank published its address; the ranks still missing after ``timeout``."""
        deadline = self._clock() + timeout
        while True:
            self.observe()
            missing = [r for r in range(self.world_size) if r not in self.addresses]
            if not missing or self._clock() >= deadline:
                return missing
            time.sleep(0.05)

    # ------------------------------------------------------------ heartbeat

    def start_heartbeat(self, sessions: Callable[[], int]) -> None:
        """Publish this rank's beat every :data:`BEAT_EVERY` seconds on a thread of its own."""
        self.beat(sessions())

        def run() -> None:
            while not self._stop.wait(BEAT_EVERY):
                self.beat(sessions())

        self._beats = threading.Thread(target=run, name="splitft-rank-beat", daemon=True)
        self._beats.start()

    def beat(self, sessions: int, stopped: bool = False) -> None:
        """Publish this rank's heartbeat now (the heartbeat thread does it every beat)."""
        value = json.dumps({"n": time.monotonic_ns(), "boot": self._boot, "sessions": sessions,
                            "hellos": self.hellos, "stopped": stopped})
        self._set(self._now, f"beat/{self.rank}", value)

    def observe(self) -> None:
        """Read every other rank's address and beat (the front door, at most once per beat)."""
        for r, view in self._views.items():
            if r not in self.addresses:
                address = self._get(self._now, f"addr/{r}")
                if address is None:
                    continue
                self.addresses[r] = address
            raw = self._get(self._now, f"beat/{r}")
            if raw is None:
                continue
            try:
                beat = json.loads(raw)
                n, boot, sessions, hellos, stopped = (int(beat["n"]), str(beat["boot"]), int(beat["sessions"]),
                                                      int(beat["hellos"]), bool(beat["stopped"]))
            except (ValueError, KeyError, TypeError):
                continue
            if boot == view.boot and n < view.beat:
                continue  # an older beat of this process, written again: not news
            view.seen_at = self._clock()
            if n != view.beat or boot != view.boot:
                view.beat, view.boot, view.moved_at = n, boot, view.seen_at
            sent = self._sent[r]
            for _ in range(max(0, hellos - view.hellos)):  # placements that have arrived there
                if sent:
                    sent.popleft()
            view.sessions, view.hellos, view.stopped = sessions, hellos, stopped

    def live(self, rank: int) -> bool:
        """Whether ``rank`` is serving: itself, or a beat that did not stand still for ``rank_timeout``.

        Judged between the front door's own looks at the beat, so a front door that was busy for a
        while does not take a rank for dead; :meth:`fresh` looks again first.
        """
        if rank == self.rank:
            return True
        view = self._views.get(rank)
        return (view is not None and rank in self.addresses and not view.stopped
                and view.seen_at - view.moved_at <= self.rank_timeout)

    def fresh(self) -> None:
        """Look at the beats again unless that was done within the last beat."""
        if any(self._clock() - v.seen_at > BEAT_EVERY for v in self._views.values()):
            self.observe()

    # ------------------------------------------------------------ placement (the front door)

    def load(self, rank: int, own: int) -> int:
        """Sessions on ``rank``, counting those sent there whose hello has not arrived yet."""
        now = self._clock()
        sent = self._sent[rank]
        while sent and now - sent[0] > _PENDING_FOR:
            sent.popleft()
        return (own if rank == self.rank else self._views[rank].sessions) + len(sent)

    def place(self, own: int, capacity: int) -> int:
        """The least-loaded live rank with room (ties: the lowest), this one when none has."""
        self.fresh()
        loads = {r: self.load(r, own) for r in range(self.world_size) if self.live(r)}
        roomy = [r for r, n in loads.items() if n < capacity] or [self.rank]
        target = min(roomy, key=lambda r: (loads.get(r, 0), r))
        if target != self.rank:
            self._sent[target].append(self._clock())
        return target

    def route(self, session: str, own: int, capacity: int) -> int:
        """Where a resuming edge goes: the live rank that holds ``session``, else a placement."""
        owner = self.owner(session)
        self.fresh()
        if owner is not None and self.live(owner):
            return owner
        return self.place(own, capacity)

    def owner(self, session: str) -> int | None:
        """The rank that holds ``session`` now, if one says it does."""
        if not _SESSION_ID.fullmatch(session):
            return None
        raw = self._get(self._now, f"where/{session}")
        try:
            rank = int(raw) if raw else None
        except ValueError:
            return None
        return rank if rank is not None and 0 <= rank < self.world_size else None

    def owns(self, session: str) -> bool:
        """Whether this rank may end ``session`` for good (delete its checkpoints, count it)."""
        owner = self.owner(session)
        return owner is None or owner == self.rank

    def claim(self, session: str) -> None:
        self._set(self._now, f"where/{session}", str(self.rank))

    def release(self, session: str) -> None:
        with self._lock:
            try:
                self._now.compare_set(f"where/{session}", str(self.rank), "")
            except RuntimeError as exc:
                self._store_failed(exc)

    def add_ended(self, n: int) -> int | None:
        """Add ``n`` ended sessions to the job's count; the count (None: the store did not answer).

        Each rank keeps its own count (``ended/R``, signed: a shared counter anyone could add to
        would end the job); the job's is their sum.
        """
        with self._lock:
            try:
                counts = [_count(self._run.get(f"ended/{r}")) for r in range(self.world_size)]
                if n:
                    counts[self.rank] += n
                    self._run.set(f"ended/{self.rank}", str(counts[self.rank]))
                return sum(counts)
            except RuntimeError as exc:
                self._store_failed(exc)
                return None

    # ------------------------------------------------------------ leaving

    def close(self) -> None:
        """Say this rank stopped (the front door places nothing more here) and leave the group."""
        self._stop.set()
        if self._beats is not None:
            self._beats.join(timeout=5)
        self.beat(0, stopped=True)
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------ the store, failures logged

    def _get(self, store: SignedStore, key: str) -> str | None:
        with self._lock:
            try:
                return store.get(key) or None
            except RuntimeError as exc:
                self._store_failed(exc)
                return None

    def _set(self, store: SignedStore, key: str, value: str) -> None:
        with self._lock:
            try:
                store.set(key, value)
            except RuntimeError as exc:
                self._store_failed(exc)

    def _store_failed(self, exc: BaseException) -> None:
        now = time.monotonic()
        if now - self._warned > 30:
            self._warned = now
            log.warning("rank %d: the job's store did not answer (%s); serving on with what this rank has",
                        self.rank, exc)


def _count(value: str | None) -> int:
    try:
        return max(0, int(value)) if value else 0
    except ValueError:
        return 0


__all__ = ["BEAT_EVERY", "RankEnv", "RankGroup", "launched"]
