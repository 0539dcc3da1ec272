"""A selective server (AdaSplit): the cloud trains its half on a share of the batches it receives.

With ``--train-fraction F`` (below 1) the cloud backpropagates a backward request only when the
batch is among the hardest it has lately seen from that edge: its loss at least the ``1 - F``
quantile of the edge's last :data:`WINDOW` losses (every batch until :data:`WARMUP` were seen).
Any other backward is answered at once with zero input gradients, its graph freed, and none of
the half's backward spent on it; the edge's optimizer step then changes nothing the batch would
have. Meant for local-loss edges (AdaSplit's clients: ``freeze_edge=True``, their edge half
trained through a head of their own, nothing crossing back), which send a backward per step
(``Schedule(eager_backward=False)``): a forward whose backward runs with it (eager) is not
selected among.

Each edge's selection is its own (heterogeneous edges each get about ``F`` of the server's
updates), and it follows the losses the edge's batches have, so easy batches stop costing the
server once it has learned them.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from typing import TYPE_CHECKING
from weakref import WeakKeyDictionary

import torch

from ..wire.protocol import Backward, InputGrads
from . import prices
from .calls import encode_input_grads

if TYPE_CHECKING:
    from .session import CloudSession

log = logging.getLogger(__name__)

WINDOW = 32
WARMUP = 4


class Selector:
    """One edge's recent losses, and whether the next batch is trained on."""

    def __init__(self, fraction: float, window: int = WINDOW, warmup: int = WARMUP) -> None:
        self.fraction, self.warmup = fraction, warmup
        self.losses: deque[float] = deque(maxlen=window)
        self.trained = self.skipped = 0

    def wants(self, loss: float) -> bool:
        """Whether a batch of ``loss`` is trained on (and it joins the recent losses)."""
        recent = sorted(self.losses)
        self.losses.append(loss)
        if len(recent) < self.warmup or not math.isfinite(loss):
            chosen = True
        else:
            chosen = loss >= recent[min(len(recent) - 1, int((1 - self.fraction) * len(recent)))]
        if chosen:
            self.trained += 1
        else:
            self.skipped += 1
        return chosen


_SELECTORS: WeakKeyDictionary[CloudSession, Selector] = WeakKeyDictionary()


def skipped(session: CloudSession, msg: Backward) -> InputGrads | None:
    """The answer to a backward the server does not train on, or None: backpropagate it as usual."""
    fraction = session.limits.train_fraction
    if fraction >= 1:
        return None  # every batch trained: the usual path
    pending = session.graphs.pending.get(msg.call)
    if pending is None or len(pending.outputs) != 1 or pending.outputs[0].dim() != 0:
        return None  # not a loss the cloud computed: the usual path (and its errors)
    selector = _SELECTORS.setdefault(session, Selector(fraction))
    if selector.wants(float(pending.outputs[0].detach())):
        return None
    prices.backward(session, msg, pending)  # as priced as a backward, but no decode, no backward
    session.graphs.take(msg.call)
    ctx = session.context("gradient", True, session.mirrored.steps, pending.sample_ids)
    zeros: list[torch.Tensor | None] = [None] * len(pending.inputs)
    entries = encode_input_grads(session.codecs, pending.inputs, pending.in_coded, pending.in_grad, zeros, ctx)
    log.debug("session %s: backward of call %d not trained on (%d trained, %d skipped)", session.id, msg.call,
              selector.trained, selector.skipped)
    return InputGrads(call=msg.call, grads=entries, timings={"compute": 0.0, "codec": 0.0},
                      unreached=session.half.unreached())


def counts(session: CloudSession) -> tuple[int, int]:
    """(batches trained on, batches skipped) of a session so far."""
    selector = _SELECTORS.get(session)
    return (selector.trained, selector.skipped) if selector is not None else (0, 0)


__all__ = ["Selector", "WARMUP", "WINDOW", "counts", "skipped"]
