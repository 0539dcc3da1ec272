"""The operations waiting to ride on the edge's next request, in the order the script made them.

What the user's loop does that the cloud must repeat (:mod:`.mirror`, :mod:`.cloud_half`) is
queued here as :mod:`splitft.wire.operations` records; the next message takes them all
(:meth:`Outbox.take`), so a step costs no round trip of its own. Two in a row over different
parameters are folded into one (``zero_grad`` clears parameters one at a time). The cloud applies
at most ``max_ops`` per message: when that many wait, the outbox is flushed at once.
"""

from __future__ import annotations

from collections.abc import Callable

from ..errors import PeerGone
from ..wire.operations import Compute, LoadWeights, Operation, Step, merged, names_of

#: Why an operation queued once the session closed goes nowhere.
CLOSED = ("this split session is closed (after model.unsplit() or close()): what the script did to the split model "
          "now (a backward through a forward made before, a step, a gradient cleared) would reach the cloud half "
          "no more. Go on with the model unsplit() returned (run the forward again on it), or split again")


class Outbox:
    """Operations for the cloud to apply before the next message it handles.

    Args:
        flush: sends what waits now (a ``sync``), when :attr:`most` operations wait.
    """

    def __init__(self, flush: Callable[[], object]) -> None:
        self._ops: list[Operation] = []
        self._names: set[str] = set()  # the names of the last queued operation (a fold grows them)
        self._flush = flush
        #: The most operations the cloud applies per message (its ``max_ops``); None: no bound.
        self.most: int | None = None
        #: Moves with every operation queued and every forward sent: what was computed from the
        #: cloud half's tensors at one version stands for them only while it holds.
        self.version = 0
        #: Moves with every operation that changes the cloud half's weights (a step, a load, an
        #: in-place call on a weight): a plain split's ``model(x)`` ran with those of its moment.
        self.weights_version = 0
        #: Moves with every call of the cloud half that may change its buffers (running statistics):
        #: one in training mode, or with one of its layers in training mode.
        self.runs = 0
        #: Set when the session ends: nothing may wait for a message that will not come.
        self.closed = False

    def __len__(self) -> int:
        return len(self._ops)

    def queue(self, op: Operation) -> None:
        """``op`` rides on the next message, after every operation queued before it."""
        if self.closed:
            raise PeerGone(CLOSED)
        self.version += 1
        if isinstance(op, (Step, LoadWeights)) or (isinstance(op, Compute) and "value" in op.target):
            self.weights_version += 1
        ops = self._ops
        if ops and merged(ops[-1], op, self._names):
            return
        self._names = set(names_of(op))
        ops.append(op)
        if self.most is not None and len(ops) >= self.most:
            self._flush()  # the cloud applies at most that many per message: send them now

    def take(self) -> list[Operation]:
        """Every waiting operation, for the message about to be sent; the outbox is empty after."""
        ops, self._ops = self._ops, []
        self._names = set()
        return ops

    def requeue(self, ops: list[Operation]) -> None:
        """Operations taken for a message that was not sent: they go first into the next one."""
        self._ops[:0] = ops
        self._names = set(names_of(self._ops[-1])) if self._ops else set()


__all__ = ["Outbox"]
