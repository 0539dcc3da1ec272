"""Who gets a place in a full cloud: admission, eviction, and what counts as a session's work.

First come is not first served. A cloud has room for ``--max-open-sessions`` sessions,
``--sessions-per-peer`` per origin (an address, or an edge key) and ``--memory-mb`` of holdings;
when a new session, or a session's next request, needs room that others hold, the cloud frees
sessions in this order until it fits, and refuses with ``capacity`` only when none is left:

1. **Idle sessions**: no hello and no training request for ``--evictable-after`` seconds. A
   training request is a forward, backward or operations that succeeded; a ping or a request that
   failed trains nothing, so it neither keeps a place nor makes a session count as trained. The
   untrained go first, then those of the origin holding most, then the longest idle.
2. **Sessions of an origin holding more** than the asking origin would after the request (more
   sessions, or more memory), the longest idle of the largest origin first: max-min fairness, so
   one origin's sessions, however busy, cannot keep another origin out.

A session never evicts one of its own origin that is still training, so within one origin first
come is first served. An origin is what the transport can vouch for: a network address, or an
allowed CurveZMQ key; many addresses (or, without an allow-list, many keys) look like many origins.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import CapacityError
from .budget import MemoryBook
from .limits import Limits


@dataclass
class Seat:
    """One session's place in the cloud, as admission sees it: who opened it, when its edge was
    last heard, whether it trained, and the memory book its holdings are checked against (the
    server's, once the session is bound)."""

    trained: bool = False  # restored from a checkpoint, or a forward arrived: the session did work
    origin: str = ""  # who opened it (address or key), for the per-origin caps
    last_seen: float = field(default_factory=time.monotonic)
    book: MemoryBook | None = None

    def bind(self, origin: str, book: MemoryBook) -> None:
        """The session is bound to a peer of ``origin`` and counted in ``book``."""
        self.origin, self.book = origin, book
        self.heard()

    def heard(self) -> None:
        """Its edge was heard (a message, or an answered job) just now."""
        self.last_seen = time.monotonic()

    def working(self) -> None:
        """A forward arrived: the session does work."""
        self.trained = True

    def fits(self, session_id: str, held: int, extra: int, what: str) -> None:
        """Refuse work that would take the session (or the cloud) over its memory budget."""
        if self.book is not None:
            self.book.check(session_id, held, extra, what)


class Host(Protocol):
    """What admission needs of the server it decides for."""

    @property
    def limits(self) -> Limits: ...

    @property
    def book(self) -> MemoryBook: ...

    @property
    def by_id(self) -> Mapping[str, Any]: ...

    def evict(self, session_id: str, text: str) -> None: ...


@dataclass
class Activity:
    """When a session opened and last trained, and the origins it counts against."""

    origins: tuple[str, ...]
    opened: float
    worked: float | None = None  # the last training request that succeeded; None: it never trained

    @property
    def since(self) -> float:
        return self.opened if self.worked is None else max(self.opened, self.worked)


class Admission:
    """A cloud server's places: who holds them, and whom to evict when a newcomer needs one."""

    def __init__(self, server: Host, clock: Callable[[], float] = time.monotonic) -> None:
        self.server = server
        self.clock = clock
        self.activity: dict[str, Activity] = {}  # by session id

    # ------------------------------------------------------------ what sessions do

    def opened(self, session_id: str, origins: tuple[str, ...], trained: bool = False) -> None:
        """A session is bound (new, restored, or reconnected from another peer)."""
        now = self.clock()
        known = self.activity.get(session_id)
        if known is not None:
            known.origins = origins
            return
        self.activity[session_id] = Activity(origins, now, now if trained else None)

    def worked(self, session_id: str) -> None:
        """A training request of this session succeeded."""
        known = self.activity.get(session_id)
        if known is not None:
            known.worked = self.clock()

    def trained(self, session_id: str) -> bool:
        known = self.activity.get(session_id)
        return known is not None and known.worked is not None

    def forget(self, session_id: str) -> None:
        self.activity.pop(session_id, None)

    def idle(self, activity: Activity, now: float) -> bool:
        return now - activity.since > self.server.limits.evictable_after

    # ------------------------------------------------------------ room for a session

    def room_for_session(self, origins: tuple[str, ...]) -> None:
        """Make room for one more session from ``origins``, or refuse it with ``capacity``."""
        limits = self.server.limits
        for origin in origins:
            while self._count(origin) >= limits.sessions_per_peer:
                # Its own quota: only its own idle sessions may go.
                victim = self._victim(origin, None, self._counts(), within=origin)
                if victim is None:
                    raise CapacityError(
                        f"{origin or 'this peer'} already has {self._count(origin)} open sessions, the most one "
                        "origin may have (--sessions-per-peer), and none was idle for --evictable-after seconds; "
                        "end one first")
                self._evict(victim, "to make room for a new session of its own origin")
        while len(self.server.by_id) >= limits.max_sessions:
            counts = self._counts()
            victim = self._victim(origins[0], counts.get(origins[0], 0) + 1, counts)
            if victim is None:
                raise CapacityError(
                    "this cloud has no place for another session now: none was idle for --evictable-after "
                    "seconds, and no origin holds more places than yours would; try again later")
            self._evict(victim, "to make room for a new session")

    def _live(self) -> list[tuple[str, Activity]]:
        """The sessions the server holds now, with what they did."""
        return [(sid, a) for sid, a in self.activity.items() if sid in self.server.by_id]

    def _count(self, origin: str) -> int:
        return sum(1 for _, a in self._live() if origin in a.origins)

    def _counts(self) -> Counter[str]:
        return Counter(a.origins[0] for _, a in self._live())

    # ------------------------------------------------------------ room in memory

    def reclaim(self, session_id: str, origin: str | None, wanted: int, over: int) -> None:
        """Evict sessions until ``over`` bytes are free for ``session_id`` (to hold ``wanted``), if
        the rules allow; the book refuses the request if they do not."""
        asking = self.activity.get(session_id)
        if origin is None:
            if asking is None:
                return  # the cloud's own buffers (a round's): nothing may be evicted for them
            origin = asking.origins[0]
        book = self.server.book
        while over > 0:
            held = self._bytes(book.held)
            after = held.get(origin, 0) - book.held.get(session_id, 0) + wanted
            victim = self._victim(origin, after, held, keep=session_id, weights=book.held)
            if victim is None:
                return
            freed = book.held.get(victim, 0)
            self._evict(victim, "to make room in the cloud's memory for another session")
            over -= freed

    def _bytes(self, held: dict[str, int]) -> Counter[str]:
        out: Counter[str] = Counter()
        for sid, activity in self._live():
            out[activity.origins[0]] += held.get(sid, 0)
        return out

    # ------------------------------------------------------------ whom to evict

    def _victim(self, origin: str, after: int | None, holdings: Counter[str], keep: str | None = None,
                within: str | None = None, weights: dict[str, int] | None = None) -> str | None:
        """The session to evict for ``origin`` (which would hold ``after`` once served), or None.

        ``within``: only sessions counted against that origin (its own quota), idle ones only.
        ``weights``: only sessions that hold something by this measure (bytes: one that holds
        none would be evicted for nothing).
        """
        now = self.clock()
        best, best_key = None, None
        for sid, activity in self._live():
            if sid == keep or (within is not None and within not in activity.origins) \
                    or (weights is not None and weights.get(sid, 0) <= 0):
                continue
            idle = self.idle(activity, now)
            mine = activity.origins[0]
            larger = within is None and after is not None and mine != origin and holdings.get(mine, 0) > after
            if not (idle or larger):
                continue
            key = (idle, idle and activity.worked is None, holdings.get(mine, 0), now - activity.since)
            if best_key is None or key > best_key:
                best, best_key = sid, key
        return best

    def _evict(self, session_id: str, why: str) -> None:
        activity = self.activity[session_id]
        now = self.clock()
        state = "never trained" if activity.worked is None else f"last trained {now - activity.since:.0f} s ago"
        self.server.evict(session_id, f"evicted {why} ({state}; origin {activity.origins[0] or 'unknown'})")


__all__ = ["Activity", "Admission", "Host", "Seat"]
