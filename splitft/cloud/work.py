"""A session request's work: its mirrored operations, the checkpoint they call for, then its own.

This is what may run on a worker thread (:mod:`.jobs`): it touches the session it serves and the
checkpoint folder (whose store is thread-safe), never the server's tables or its socket.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from ..wire.protocol import Ack, Backward, Bye, Forward, Message, Sync
from . import compute, optimizer_state, prices, selection, snapshots
from .checkpoint_folder import CheckpointStore
from .cut_average import HeldGrads, averages_cut, held_backward
from .jobs import Job
from .session import CloudSession

#: The requests that carry a session's work (and its mirrored operations).
Request = Forward | Backward | Sync | Bye


@dataclass(frozen=True)
class Checkpointing:
    """Where a session's checkpoints go (None: nowhere) and at which optimizer steps."""

    store: CheckpointStore | None
    every: int = 1

    def due(self, session: CloudSession, msg: Message) -> bool:
        """Whether ``msg`` may make the cloud write a checkpoint of ``session`` (a step boundary, or asked)."""
        if self.store is None or session.half.shared is not None or isinstance(msg, Bye):
            return False
        steps = session.mirrored.steps
        return (isinstance(msg, Sync) and msg.checkpoint) or \
            steps // self.every != (steps + prices.new_steps(getattr(msg, "ops", None))) // self.every


def job(checkpointing: Checkpointing, session: CloudSession, msg: Request, seq: int,
        then: Callable[[Any], Any] | None = None) -> Job:
    """``msg``'s work for ``session`` as a job, priced; ``then`` (on the serving thread) turns its
    reply into the one sent (default: as it is)."""
    return Job(session.id, session.seat.origin, prices.guess(session, msg, checkpointing.due(session, msg)),
               work=lambda: run(checkpointing, session, msg, seq), then=then or (lambda reply: reply),
               pace=session.pricing.pace, off_thread=session.off_thread and session.half.shared is None,
               generator=isinstance(msg, Forward) and session.random.may_draw(msg.train))


def run(checkpointing: Checkpointing, session: CloudSession, msg: Request, seq: int) -> Message | HeldGrads:
    """Apply ``msg``'s operations, checkpoint if they crossed a boundary (or the edge asked), then
    do what ``msg`` asks. A goodbye writes no checkpoint: the session's go when it ends."""
    before = session.mirrored.steps
    refused = None
    try:
        session.apply_ops(msg.ops)
    finally:
        # Right after the step, before the request's own work: replaying this request
        # re-applies its operations, which their ids make harmless, then does that work.
        force = isinstance(msg, Sync) and msg.checkpoint
        every = checkpointing.every
        if not isinstance(msg, Bye) and (force or before // every != session.mirrored.steps // every):
            pin = isinstance(msg, Sync) and force and msg.pin
            refused = snapshots.save(checkpointing.store, session, (seq or session.replies.last_seq + 1) - 1,
                                     pinned=pin)
    if refused is not None:
        raise refused  # a pin the edge asked for and cannot have: it must know
    if isinstance(msg, Forward):
        return session.forward(msg)
    if isinstance(msg, Backward):
        if not msg.params and (averages_cut(session) or session.half.shared is not None):
            raise ConfigError("a backward into the inputs alone (backward(inputs=...), autograd.grad on the edge) is "
                              "not served by a shared half")
        if averages_cut(session):
            return held_backward(session, msg)
        return selection.skipped(session, msg) or session.backward(msg)
    if isinstance(msg, Sync):
        return Ack(state=session.state() if msg.want_state else None,
                   grad_norms=session.grad_norms(msg.grad_norm, msg.grad_names) if msg.grad_norm is not None else None,
                   optimizer_state=optimizer_state.read(session) if msg.want_optimizer_state else None,
                   values=compute.evaluate(session, msg.evaluate) if msg.evaluate is not None else None,
                   grads=session.grads() if msg.want_grads else None)
    return Ack()


__all__ = ["Checkpointing", "Request", "job", "run"]
