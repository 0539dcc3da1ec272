"""Where an edge's session lives when the cloud runs as several ranks, and the one hop that gets there.

A cloud launched as a torch.distributed job has one public address, rank 0's (the front door).
The front door answers a ``hello`` with a ``redirect`` when it places the session on another rank;
the edge then opens a link to that rank and sends the same hello again. Every reconnection starts
at the front door again, so a rank that died is never retried for ever: the front door places the
session on a live rank, which resumes it from the shared checkpoint folder.

What the edge accepts is narrow on purpose: a redirect only in answer to a hello sent to the
address it was given (never from a rank it was sent to), one hop per handshake, and only a
``tcp://HOST:PORT`` or ``ipc://PATH`` address, opened with the same link settings (emulation,
CurveZMQ keys: the rank must hold the same server key) as the front door.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import transports

from ..errors import RedirectError, translated
from ..wire.protocol import Redirect

_ADDRESS = re.compile(r"tcp://[A-Za-z0-9._\-\[\]:]+:[0-9]{1,5}|ipc://[^\s\x00]{1,200}")
MAX_ADDRESS = 256

Follow = Callable[[str], transports.Connection]


class Route:
    """The rank this edge's session lives on (0 and no address: the front door itself).

    Args:
        follow: opens a link to a rank's address with the front door's link settings; None when
            the edge was given an open connection or a function that opens one, which can only
            reach where they lead.
    """

    def __init__(self, follow: Follow | None = None) -> None:
        self.follow = follow
        self.rank = 0
        self.address: str | None = None
        self.hops = 0  # redirects followed over the session's life (one per handshake at most)

    @property
    def at_front_door(self) -> bool:
        return self.address is None

    def back_to_front_door(self) -> None:
        """A fresh link to the address the edge was given: the next redirect may be followed."""
        self.rank, self.address = 0, None

    def go(self, redirect: Redirect, current: transports.Connection) -> transports.Connection:
        """Close ``current`` and open a link to the rank ``redirect`` names; refuse what must not be followed."""
        here = getattr(current, "address", "?")
        if not self.at_front_door:
            raise RedirectError(
                f"the cloud's rank {self.rank} at {here} redirected this edge again, to {redirect.address!r}; "
                "an edge follows one redirect, and only from the address it was given")
        if len(redirect.address) > MAX_ADDRESS or not _ADDRESS.fullmatch(redirect.address) or redirect.rank < 1:
            raise RedirectError(f"the cloud at {here} redirected this edge to {redirect.address[:MAX_ADDRESS]!r} "
                                f"(rank {redirect.rank}); expected tcp://HOST:PORT or ipc://PATH of a rank >= 1")
        if self.follow is None:
            raise RedirectError(
                f"the cloud at {here} placed this session on its rank {redirect.rank} at {redirect.address}, but "
                "this edge was given an open connection (or a function that opens one), which cannot reach "
                "another address; give split() the cloud's address instead")
        current.close()
        with translated():
            connection = self.follow(redirect.address)
        self.rank, self.address = redirect.rank, redirect.address
        self.hops += 1
        return connection


__all__ = ["Follow", "Route"]
