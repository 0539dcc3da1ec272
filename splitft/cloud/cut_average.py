"""SGLR's averaged cut-layer gradient: every edge of a round gets the round's mean gradient of the cut.

With ``--sync-rounds N --average-cut-grads`` the gradient a backward request returns (the gradient
of the loss with respect to what the edge sent) is not the edge's own: the cloud computes each
edge's backward as usual (the shared half's own gradients are the edge's, averaged when the round
closes, :mod:`.rounds`), keeps the cut's gradient unencoded, and answers every edge of the round
with the mean of the round's cut gradients, once every edge still in the round has sent its
backward. That is the server-side local gradient averaging of SGLR: the edges' halves move
together, as if federated-averaged, without a message more.

- **Bounded.** A kept gradient is booked in the memory book until the round's are answered (one
  that does not fit is refused at once), and an edge has at most one backward waiting: a round
  averages one batch per edge (no micro-batches, no gradient accumulation across calls).
- **Same shapes.** The mean is taken position by position, so every edge of a round must send
  tensors of the same shapes (the same batch size); a different one is refused with a
  :class:`~splitft.errors.ConfigError`, nothing of it kept.
- **A silent edge.** The round's answers wait at most the round timeout from the first kept
  gradient; then the edges that sent theirs get the mean of those.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from compressors import CodecContext, CompressionError

from ..errors import ConfigError, ModelError, ProtocolError, SplitFTError, code_of
from ..wire.protocol import Backward, Error, InputGrads, Message
from . import prices
from .blame import Stopwatch, blame
from .budget import MemoryBook, tensors_nbytes
from .calls import decode_backward, encode_input_grads
from .graphs import Pending

if TYPE_CHECKING:
    from .session import CloudSession

log = logging.getLogger(__name__)


@dataclass
class HeldGrads:
    """A backward's answer before its cut gradient is averaged: what encoding it later needs."""

    session: CloudSession
    call: int
    pending: Pending
    ctx: CodecContext
    grads: list[torch.Tensor | None]
    timings: dict
    unreached: list | None

    def shapes(self) -> list[tuple[int, ...] | None]:
        return input_shapes(self.pending)

    def answer(self, mean: list[torch.Tensor | None]) -> InputGrads:
        """The reply, with ``mean`` through this session's gradient codecs."""
        watch = Stopwatch()
        with watch("codec"):
            entries = encode_input_grads(self.session.codecs, self.pending.inputs, self.pending.in_coded,
                                         self.pending.in_grad, mean, self.ctx)
        return InputGrads(call=self.call, grads=entries, timings={**self.timings, **watch.seconds},
                          unreached=self.unreached)


def input_shapes(pending: Pending) -> list[tuple[int, ...] | None]:
    """The shapes of a call's inputs that take a gradient (None for the others)."""
    return [tuple(leaf.shape) if need else None for leaf, need in zip(pending.inputs, pending.in_grad)]


def averages_cut(session: CloudSession) -> bool:
    """Whether ``session``'s backward answers wait for its round's mean cut gradient."""
    shared = session.half.shared
    return shared is not None and getattr(shared.rounds, "averages_cut", False) is True


def held_backward(session: CloudSession, msg: Backward) -> HeldGrads:
    """A session's backward as :meth:`CloudSession.backward` computes it, its answer not yet encoded."""
    pending = session.graphs.pending.get(msg.call)  # taken once the request is checked: a refusal loses nothing
    if pending is None:
        raise ProtocolError(f"no forward call {msg.call} awaits a backward (already backpropagated, run without "
                            "grad, or freed by an optimizer step)")
    cuts = getattr(session.half.shared.rounds if session.half.shared is not None else None, "cuts", None)
    if isinstance(cuts, CutAverage):  # refused before any of it is computed: a refusal loses nothing
        cuts.check(session.id, input_shapes(pending))
    session.fits(sum(leaf.numel() * leaf.element_size() for leaf, need in zip(pending.inputs, pending.in_grad)
                     if need), "keeping this backward's cut gradient until its round's are averaged")
    prices.backward(session, msg, pending)
    watch = Stopwatch()
    ctx = session.context("gradient", True, session.mirrored.steps, pending.sample_ids)
    with watch("codec"):
        outputs, grads = decode_backward(msg, pending, session.codecs, ctx, session.half.shared,
                                         session.check_decode)
    session.graphs.take(msg.call)
    with watch("compute"):
        if outputs:
            session.backpropagate(msg.call, outputs, grads)
    leaf_grads = [leaf.grad if need else None for leaf, need in zip(pending.inputs, pending.in_grad)]
    return HeldGrads(session, msg.call, pending, ctx, leaf_grads, watch.seconds, session.half.unreached())


#: A kept answer: the peer, the held gradients, the request's number and whether it is numbered.
Kept = tuple[bytes, HeldGrads, int, bool]


def cut_key(session_id: str) -> str:
    """The memory book's entry for a session's cut gradient kept until its round's are averaged."""
    return f"{session_id}/cut"


class CutAverage:
    """One shared half's kept backward answers for the current round, and their mean."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.kept: dict[str, Kept] = {}
        self.since: float | None = None
        self.answered = 0  # rounds of cut gradients answered

    def check(self, session_id: str, shapes: list[tuple[int, ...] | None]) -> None:
        """Refuse a backward that could not be averaged with the round's kept ones."""
        if session_id in self.kept:
            raise ProtocolError(f"session {session_id} sent a second backward before its round's cut gradients "
                                "were averaged: with --average-cut-grads a round averages one batch per edge")
        if self.kept:
            first = next(iter(self.kept.values()))[1].shapes()
            if first != shapes:
                raise ConfigError(f"--average-cut-grads averages the cut gradients of a round position by "
                                  f"position: this round's have shapes {first}, this edge's {shapes} (every edge "
                                  "must send batches of the same size)")

    def keep(self, peer: bytes, held: HeldGrads, seq: int, numbered: bool, book: MemoryBook) -> None:
        """Keep ``held`` until the round's are in (checked again: another edge's may have come meanwhile)."""
        sid = held.session.id
        self.check(sid, held.shapes())
        nbytes = tensors_nbytes([g for g in held.grads if g is not None])
        book.check(cut_key(sid), 0, nbytes, "keeping this backward's cut gradient until its round's are averaged")
        book.set(cut_key(sid), nbytes)
        self.kept[sid] = (peer, held, seq, numbered)
        self.since = self.since if self.since is not None else time.monotonic()

    def due(self, expected: set[str] | None, now: float) -> bool:
        """Whether to answer now: every edge ``expected`` has sent its backward (None: the first
        round's seats are not all taken yet), or the wait is over."""
        if not self.kept:
            return False
        return (expected is not None and expected <= set(self.kept)) or (self.since is not None and now - self.since >= self.timeout)

    def deadline(self) -> float | None:
        return None if self.since is None else self.since + self.timeout

    def answer(self, book: MemoryBook, alive: Callable[[str], bool], send: Callable[..., Any]) -> None:
        """Answer every kept backward with the mean of the kept cut gradients (in the order they came)."""
        kept, self.kept, self.since = list(self.kept.values()), {}, None
        for _, held, _, _ in kept:
            book.drop(cut_key(held.session.id))
        mean = self._mean([held for _, held, _, _ in kept])
        self.answered += 1
        for peer, held, seq, numbered in kept:
            if not alive(held.session.id):
                continue  # ended while it waited: nobody to answer
            reply: Message
            try:
                with blame(ModelError, "encoding the round's mean cut gradient failed"):
                    reply = held.answer(mean)
            except (SplitFTError, CompressionError) as exc:  # this edge's answer alone fails
                reply = Error(code=code_of(exc), message=f"{type(exc).__name__}: {exc}"[:2000], seq=seq,
                              call=held.call)
            send(peer, held.session, reply, seq, numbered)
        log.info("round's cut gradients averaged over %d edge(s)", len(kept))

    @staticmethod
    def _mean(kept: list[HeldGrads]) -> list[torch.Tensor | None]:
        mean: list[torch.Tensor | None] = []
        for i, need in enumerate(kept[0].pending.in_grad):
            if not need:
                mean.append(None)
                continue
            per_edge = [h.grads[i] if h.grads[i] is not None else torch.zeros_like(h.pending.inputs[i])
                        for h in kept]
            mean.append(torch.stack([g for g in per_edge if g is not None]).mean(dim=0))
        return mean

    def forget(self, session_id: str, book: MemoryBook) -> None:
        """A session ended: its kept answer goes (the others no longer wait for it)."""
        if self.kept.pop(session_id, None) is not None:
            book.drop(cut_key(session_id))


__all__ = ["CutAverage", "HeldGrads", "averages_cut", "cut_key", "held_backward"]
