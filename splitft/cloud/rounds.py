"""Synchronous data-parallel rounds for a shared cloud half (SplitFed / parallel split learning).

With ``--shared-model --sync-rounds N`` a shared half is not stepped in the order edges' steps
arrive. Each edge's optimizer step instead adds the gradient it accumulated in its session to the
current round; when every edge of the round has, the cloud takes ONE optimizer step on the mean of
their gradients, and every edge's next forward sees the new weights. One process, N edges: that is
what one process computing the N edges' gradients on the same weights, averaging them and stepping
once per round would give (split ≡ local).

- **Waiting without blocking.** An edge's step is acknowledged at once (its own half steps and its
  next batch runs meanwhile); its next request is held by the cloud, unanswered, until the round
  closes, then handled. The server loop serves every other edge in the meantime. A held request
  is checked first (its size; its bytes against the session's and the cloud's memory budgets,
  where they stay booked until the round closes): one that does not fit is refused at once.
- **Seats.** A half trains in rounds of N edges: at most N sessions may use it (the N+1-th hello
  is refused); the first round closes once N edges have contributed. After that a round closes
  when every session still open has; an edge that ends its session leaves the rounds.
- **A silent edge.** A round lasts at most ``timeout`` seconds (from its first gradient for the
  first round, from the previous round's step for the others). Then it closes with the gradients
  it has; edges that sent none are dropped from that round, with a logged event, and later rounds
  do not wait for them. A dropped edge's next step arrives late (its gradient is of the weights
  of a closed round): it is discarded, with a logged event, and the edge counts again from the
  round after. The edges' reply timeout must exceed the round timeout.
- **Agreement.** Every edge attaches the cloud's optimizer (``--shared-optimizer``, as for any
  shared half: :mod:`.shared_policy`), and every step of one round must carry the same learning
  rates and changed settings (refused otherwise: a scheduler that differs between edges).
- **Across ranks** (:mod:`.allreduce`): each rank serves its own edges and closes its own rounds;
  then the ranks all-reduce the rank's gradient sum (weighted by the edges each rank served)
  through a DDP communication hook, so every rank takes the same step and holds the same weights
  (checked every round). A rank whose edges are all silent or gone joins the round with nothing
  after its timeout (at once, when its edges left and the others are training), so the others
  are not stalled; but every rank must serve an edge of the half in the first round. One shared
  half per cloud across ranks (each half's collectives must run in the same order on every rank).
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

import transports

from ..errors import CapacityError, ConfigError, ModelError, ProtocolError, SplitFTError
from ..wire import operations as o
from .allreduce import GradCompression, RankReducer, Reduced, Reduction, fingerprint
from .blame import blame
from .budget import MemoryBook
from .cut_average import CutAverage, HeldGrads
from .half import Half, SharedPart
from .handlers import check_finite_grads, step_settings
from .limits import Limits, mib


class Member(Protocol):
    """A session of a shared half, as its rounds see it."""

    @property
    def id(self) -> str: ...

    @property
    def half(self) -> Half: ...

    def held_bytes(self) -> int: ...


class Host(Protocol):
    """What rounds need of the server they serve."""

    @property
    def limits(self) -> Limits: ...

    @property
    def book(self) -> MemoryBook: ...

    @property
    def shared_model(self) -> bool: ...

    @property
    def by_id(self) -> Mapping[str, Member]: ...

    def event(self, text: str) -> None: ...

    def answer(self, peer: bytes, session: Any, reply: Any, seq: int, numbered: bool) -> None: ...

    def handle(self, peer: bytes, frames: list) -> None: ...

    def stop(self) -> None: ...

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoundSettings:
    """``edges``: edges per round (``--sync-rounds``); ``timeout``: the longest a round may last
    (``--round-timeout``, seconds); ``compression``: of the ranks' all-reduce; ``max_parked``:
    requests an edge may have waiting for a round; ``average_cut``: ``--average-cut-grads``."""

    edges: int
    timeout: float = 30.0
    compression: GradCompression = field(default_factory=GradCompression)
    max_parked: int = 64
    #: SGLR: every edge's backward is answered with the round's mean cut gradient (:mod:`.cut_average`).
    average_cut: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.edges, bool) or not isinstance(self.edges, int) or self.edges < 1:
            raise ConfigError(f"a round needs at least one edge, got {self.edges!r}")
        if not (isinstance(self.timeout, (int, float)) and math.isfinite(self.timeout) and self.timeout > 0):
            raise ConfigError(f"the round timeout is in seconds and must be above 0, got {self.timeout!r}")


def parked_key(session_id: str) -> str:
    """The memory book's entry for the requests a session keeps waiting for a round (its frames
    stay held until the round closes, even if the session ends meanwhile)."""
    return f"{session_id}/parked"


class _Flat:
    """One process: the flat buffer a round's gradients are summed into, with a view per parameter."""

    def __init__(self, shapes: list[torch.Size], dtype: torch.dtype, device: torch.device) -> None:
        sizes = [math.prod(shape) for shape in shapes]
        self.flat = torch.zeros(sum(sizes), dtype=dtype, device=device)
        self._views = [chunk.view(shape) for chunk, shape in zip(self.flat.split(sizes), shapes)]

    def views(self) -> list[torch.Tensor]:
        return self._views


def _unflatten(flat: torch.Tensor, params: list[torch.Tensor]) -> list[torch.Tensor]:
    sizes = [p.numel() for p in params]
    return [chunk.view(p.shape) for chunk, p in zip(flat.split(sizes), params)]


def _agreed(part: SharedPart, op: o.Step) -> tuple:
    """What every step of a round must agree on: its rates and changed settings; only the changes
    when the cloud sets the half's rate itself (``--server-lr``: the edges' rates are their own)."""
    own_rate = part.policy is not None and part.policy.server_lr is not None
    return (op.changes,) if own_rate else (op.lr, op.lrs, op.changes)


class PartRounds:
    """The rounds of one shared half: who contributed, the summed gradient, the edges' held requests."""

    def __init__(self, part: SharedPart, owner: Rounds) -> None:
        self.part, self.owner = part, owner
        self.settings, self.world, self.group = owner.settings, owner.world, owner.group
        self.index = 0  # rounds completed
        self.contributed: set[str] = set()
        self.dropped: set[str] = set()
        self.parked: dict[str, deque[tuple[bytes, list]]] = {}
        self.opened_at: float | None = None
        self.step: o.Step | None = None  # the settings every step of this round carries
        self.has_grad: list[bool] = []
        self.buffers: _Flat | RankReducer | None = None
        self.reduction: Reduction | None = None
        self.last_total = 0
        self.late = 0  # steps discarded because their round had closed without them
        #: One record per completed round: its number, edges here and in all, dropped sessions,
        #: the gradient bytes this rank all-reduced and the seconds the all-reduce took.
        self.history: deque[dict[str, Any]] = deque(maxlen=10_000)
        #: The backward answers kept for the round's mean cut gradient (``--average-cut-grads``), or None.
        self.cuts = CutAverage(self.settings.timeout) if self.settings.average_cut else None

    @property
    def averages_cut(self) -> bool:
        """Whether its edges' backward answers carry the round's mean cut gradient."""
        return self.cuts is not None

    def params(self) -> list[torch.Tensor]:
        return list(self.part.chain.parameters())

    def waiting(self, session_id: str) -> bool:
        """Whether this session's requests must wait for the round (it contributed, or the ranks reduce)."""
        return self.reduction is not None or session_id in self.contributed

    # ------------------------------------------------------------ contributions

    def contribute(self, session_id: str, half: Half, op: o.Step) -> None:
        """Add the gradient of session ``session_id`` (whose half is ``half``) to the round (its
        optimizer step ``op``)."""
        event, book = self.owner.server.event, self.owner.server.book
        if self.reduction is not None or session_id in self.contributed:
            raise ProtocolError(f"session {session_id} stepped twice in round {self.index}")
        if session_id in self.dropped:
            self.dropped.discard(session_id)
            self.late += 1
            event(f"session {session_id}: a step that arrived after its round closed without it; discarded, "
                  f"the edge counts again from round {self.index}")
            return
        if self.step is not None and _agreed(self.part, op) != _agreed(self.part, self.step):
            raise ConfigError(f"every edge of a round must step with the same settings: round {self.index} steps "
                              f"with lr {self.step.lr or self.step.lrs}, changes {self.step.changes}; this edge's "
                              f"step has lr {op.lr or op.lrs}, changes {op.changes} (are the edges' schedulers the same?)")
        optimizer = self.part.optimizer
        if optimizer is not None:
            step_settings(self.part, optimizer, op)  # validated now; every step of the round agrees with it
        params = self.params()
        with half.own_grads(), torch.no_grad():
            check_finite_grads(params)
            grads = [p.grad for p in params]
            views = self._buffers(book).views()
            for i, (view, grad) in enumerate(zip(views, grads)):
                if grad is not None:
                    view.add_(grad)
                    self.has_grad[i] = True
        self.step = self.step or op
        self.opened_at = self.opened_at if self.opened_at is not None else time.monotonic()
        self.contributed.add(session_id)

    def _buffers(self, book: Any) -> _Flat | RankReducer:
        """The gradient sum's buffer, made at the first contribution (after the half is placed)."""
        if self.buffers is None:
            params = self.params()
            dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
            device = params[0].device if params else torch.device("cpu")
            nbytes = sum(p.numel() for p in params) * torch.empty((), dtype=dtype).element_size()
            book.check("", 0, nbytes, "the shared half's round buffer (one gradient)")
            shapes = [p.shape for p in params]
            self.buffers = (RankReducer(shapes, dtype, device, self.settings.compression, self.group)
                            if self.world > 1 else _Flat(shapes, dtype, device))
            self.has_grad = [False] * len(params)
        return self.buffers

    # ------------------------------------------------------------ closing

    def closable(self, members: set[str], now: float) -> bool:
        if self.reduction is not None:
            return False
        expected = members - self.dropped
        if self.contributed and expected <= self.contributed and (self.index > 0 or len(members) >= self.settings.edges):
            return True
        if self.opened_at is None or (not self.contributed and self.world == 1):
            return False
        if now - self.opened_at >= self.settings.timeout:
            return True
        return self.world > 1 and self.index > 0 and not expected and self.last_total > 0

    def deadline(self) -> float | None:
        return None if self.opened_at is None else self.opened_at + self.settings.timeout

    def close(self, members: set[str], now: float, event: Any, book: Any) -> Reduced | None:
        """Close the round: drop the silent, then reduce (across ranks: started, finished later)."""
        missing = sorted((members - self.dropped) - self.contributed)
        for sid in missing:
            self.dropped.add(sid)
            event(f"round {self.index}: session {sid} sent no gradient within {self.settings.timeout:g} s; dropped "
                  f"from the round ({len(self.contributed)} edge(s) here step without it)")
        count = len(self.contributed)
        buffers = self._buffers(book)
        if isinstance(buffers, RankReducer):
            self.reduction = buffers.start(count, fingerprint(self.params()), self.has_grad)
            return None
        mean = buffers.flat / count if count else None
        return Reduced(mean, count, list(self.has_grad), 0, 0.0)

    def finish(self, reduced: Reduced, now: float, ready: list[tuple[bytes, list]]) -> None:
        """Take the round's one optimizer step, open the next round and release the held requests."""
        optimizer, params = self.part.optimizer, self.params()
        if reduced.mean is not None and optimizer is not None:
            for param, grad, has in zip(params, _unflatten(reduced.mean, params), reduced.has_grad):
                param.grad = grad.to(param.dtype) if has else None
            try:
                with blame(ModelError, "the shared half's optimizer step failed"):
                    optimizer.step()
            finally:
                for param in params:
                    param.grad = None
            self.part.stepped()
        log.info("round %d: %d edge(s) here, %d in all, %d gradient bytes all-reduced in %.1f ms", self.index,
                 len(self.contributed), reduced.total, reduced.nbytes, reduced.seconds * 1e3)
        self.history.append({"round": self.index, "edges": len(self.contributed), "total": reduced.total,
                             "dropped": sorted(self.dropped), "bytes": reduced.nbytes, "seconds": reduced.seconds})
        if self.buffers is not None:
            self.buffers.flat.zero_()
            self.has_grad = [False] * len(self.has_grad)
        self.contributed.clear()
        self.reduction, self.step, self.last_total = None, None, reduced.total
        self.index += 1
        self.opened_at = now
        book = self.owner.server.book
        for session_id, queue in self.parked.items():
            ready.extend(queue)
            book.drop(parked_key(session_id))
        self.parked.clear()


class Rounds:
    """The server's side of synchronous rounds: one :class:`PartRounds` per shared half.

    Args:
        settings: edges per round, timeout, compression.
        group: the process group of the cloud's ranks (default: the world, when torch.distributed
            is initialized with more than one rank; else this process alone).
    """

    def __init__(self, settings: RoundSettings, group: Any = None) -> None:
        self.settings = settings
        self.group = group
        ranked = group is not None or (dist.is_available() and dist.is_initialized())
        self.world = dist.get_world_size(group) if ranked else 1
        self.rank = dist.get_rank(group) if ranked else 0
        self.parts: list[PartRounds] = []
        self.failure: str | None = None
        self._server: Host | None = None
        self._ready: list[tuple[bytes, list]] = []
        if self.world > 1 and settings.average_cut:
            raise ConfigError("--average-cut-grads averages the cut gradients of one process's edges; a cloud of "
                              "several ranks would average each rank's alone: run it as one process")
        if self.world == 1 and settings.compression.kind != "none":
            log.warning("--grad-compression %s has no effect in one process: nothing is all-reduced",
                        settings.compression)

    def bind(self, server: Host) -> None:
        """Called by the server it serves; checks that the server's settings fit rounds."""
        if not server.shared_model:
            raise ConfigError("synchronous rounds train a shared cloud half: add --shared-model")
        if server.limits.session_timeout <= self.settings.timeout:
            raise ConfigError(f"the round timeout ({self.settings.timeout:g} s) must be shorter than the session "
                              f"timeout ({server.limits.session_timeout:g} s): a waiting edge would expire")
        self._server = server

    @property
    def server(self) -> Host:
        if self._server is None:
            raise ConfigError("these rounds serve no server: pass them to CloudServer(rounds=...)")
        return self._server

    def admit(self, part: SharedPart) -> None:
        """A hello for ``part``: give it rounds, and refuse an edge beyond its seats."""
        if part.rounds is None:
            if self.world > 1 and self.parts:
                raise CapacityError("a cloud of several ranks trains one shared half in rounds; this one is taken")
            rounds = PartRounds(part, self)
            part.trains_in(rounds)
            self.parts.append(rounds)
        if part.sessions >= self.settings.edges:
            raise CapacityError(f"this shared half trains in rounds of {self.settings.edges} edges and all seats are "
                                "taken; try again when an edge has ended its session")

    def hold(self, peer: bytes, frames: list, session: Member | None) -> bool:
        """Keep a request of an edge that waits for its round; True when it was kept (not handled now).

        A kept request holds its frames until the round closes: it is checked first, by its size
        and against the memory budgets (booked as the session's until it is released), and one
        that does not fit is refused at once (the :class:`SplitFTError` raised here is the reply).
        """
        rounds = self._of(session.half.shared) if session is not None else None
        if session is None or rounds is None or not rounds.waiting(session.id):
            return False
        queue = rounds.parked.setdefault(session.id, deque())
        self._check_parking(rounds, session, queue, frames)
        queue.append((peer, frames))
        return True

    def defer(self, peer: bytes, session: Member | None, reply: Any, seq: int, numbered: bool) -> bool:
        """Keep a backward's answer until its round's cut gradients are averaged; True when kept.

        Raises (the reply, nothing kept) when it cannot be averaged with the round's or does not fit.
        """
        if not isinstance(reply, HeldGrads) or session is None:
            return False
        rounds = self._of(session.half.shared)
        if rounds is None or rounds.cuts is None:
            raise ConfigError("a backward answer was kept back, but its half does not average cut gradients")
        rounds.cuts.keep(peer, reply, seq, numbered, self.server.book)
        return True

    def _of(self, part: SharedPart | None) -> PartRounds | None:
        """The rounds of a shared half (None: it trains in arrival order, or it is not shared)."""
        return next((rounds for rounds in self.parts if rounds.part is part), None) if part is not None else None

    def _check_parking(self, rounds: PartRounds, session: Member, queue: deque, frames: list) -> None:
        if len(queue) >= self.settings.max_parked:
            raise CapacityError(f"{len(queue)} requests already wait for round {rounds.index}; send fewer before it "
                                "closes")
        limits, book = self.server.limits, self.server.book
        limits.check_frames(frames)
        nbytes = transports.message_nbytes(frames)
        key = parked_key(session.id)
        parked = book.held.get(key, 0)
        what = f"keeping this request until round {rounds.index} closes"
        if session.held_bytes() + parked + nbytes > limits.session_memory_bytes:
            raise CapacityError(f"{what} needs {mib(nbytes)} more; this session holds {mib(session.held_bytes())} and "
                                f"{mib(parked)} of requests waiting for the round, and may hold "
                                f"{mib(limits.session_memory_bytes)} (--session-memory-mb): send fewer before it closes")
        book.check(key, parked, nbytes, what)
        book.set(key, parked + nbytes)

    def tick(self, poll: float) -> float:
        """Close, reduce and finish rounds that can be; returns how long the server may wait for a message."""
        now = time.monotonic()
        wait = poll
        try:
            for rounds in self.parts:
                wait = min(wait, self._advance(rounds, now))
        except SplitFTError as exc:
            self.failure = str(exc)
            self.server.event(f"data-parallel rounds failed, stopping: {exc}")
            self.server.stop()
        ready, self._ready = self._ready, []
        for peer, frames in ready:
            self.server.handle(peer, frames)
        return 0.0 if self._ready else wait

    def _advance(self, rounds: PartRounds, now: float) -> float:
        if rounds.reduction is not None:
            if not rounds.reduction.done():
                return 0.001
            rounds.finish(rounds.reduction.result(), now, self._ready)
        members = {s.id for s in self.server.by_id.values() if s.half.shared is rounds.part}
        cuts = rounds.cuts
        if cuts is not None:
            seated = rounds.index > 0 or len(members) >= self.settings.edges
            expected = members - rounds.dropped - rounds.contributed if seated else None
            if cuts.due(expected, now):
                cuts.answer(self.server.book, lambda sid: sid in self.server.by_id, self.server.answer)
        if rounds.closable(members, now):
            reduced = rounds.close(members, now, self.server.event, self.server.book)
            if reduced is None:
                return 0.001
            rounds.finish(reduced, now, self._ready)
        deadlines = [d for d in (rounds.deadline(), cuts.deadline() if cuts is not None else None) if d is not None]
        return math.inf if not deadlines else max(0.001, min(deadlines) - now)


__all__ = ["PartRounds", "RoundSettings", "Rounds"]
