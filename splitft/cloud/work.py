"""A session request's work: its mirrored operations, the checkpoint they call for, then its own.

This is what may run on a worker thread (:mod:`.jobs`): it touches the session it serves and the
checkpoint folder (whose store is thread-safe), never the server's tables or its socket.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..wire.protocol import Ack, Backward, Bye, Forward, Message, Sync
from . import prices, snapshots
from .jobs import Job
from .session import CloudSession

if TYPE_CHECKING:
    from .server import CloudServer


def job(server: CloudServer, session: CloudSession, msg: Forward | Backward | Sync | Bye, seq: int,
        then: Callable[[Any], Any] | None = None) -> Job:
    """``msg``'s work for ``session`` as a job, priced; ``then`` (on the serving thread) turns its
    reply into the one sent (default: as it is)."""
    return Job(session.id, session.origin, prices.guess(session, msg, _checkpoints(server, session, msg)),
               work=lambda: run(server, session, msg, seq), then=then or (lambda reply: reply), pace=session.pace,
               off_thread=session.off_thread and session.shared is None,
               generator=isinstance(msg, Forward) and session.random.may_draw(msg.train))


def _checkpoints(server: CloudServer, session: CloudSession, msg: Message) -> bool:
    """Whether ``msg`` may make the cloud write a checkpoint of ``session`` (a step boundary, or asked)."""
    if server.checkpoints is None or session.shared is not None or isinstance(msg, Bye):
        return False
    every = server.checkpoint_every
    return (isinstance(msg, Sync) and msg.checkpoint) or \
        session.steps // every != (session.steps + prices.new_steps(msg.ops)) // every


def run(server: CloudServer, session: CloudSession, msg: Forward | Backward | Sync | Bye, seq: int) -> Message:
    """Apply ``msg``'s operations, checkpoint if they crossed a boundary (or the edge asked), then
    do what ``msg`` asks. A goodbye writes no checkpoint: the session's go when it ends."""
    before = session.steps
    refused = None
    try:
        session.apply_ops(msg.ops)
    finally:
        # Right after the step, before the request's own work: replaying this request
        # re-applies its operations, which their ids make harmless, then does that work.
        force = isinstance(msg, Sync) and msg.checkpoint
        every = server.checkpoint_every
        if not isinstance(msg, Bye) and (force or before // every != session.steps // every):
            refused = snapshots.save(server, session, (seq or session.last_seq + 1) - 1, pinned=force and msg.pin)
    if refused is not None:
        raise refused  # a pin the edge asked for and cannot have: it must know
    if isinstance(msg, Forward):
        return session.forward(msg)
    if isinstance(msg, Backward):
        return session.backward(msg)
    if isinstance(msg, Sync):
        return Ack(state=session.state() if msg.want_state else None,
                   grad_norms=session.grad_norms(msg.grad_norm, msg.grad_names) if msg.grad_norm is not None else None)
    return Ack()


__all__ = ["job", "run"]
