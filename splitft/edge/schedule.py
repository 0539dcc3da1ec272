"""The schedule of a remote call: micro-batches, and when the backward runs.

A call of the cloud part is one forward and (when training) one backward. With ``micro_batches`` = k
the batch is cut into k parts, and every part's message is sent before any reply is awaited, so the
wire and the cloud work at the same time; the parts' outputs are joined back into the batch's
(concatenated, or a loss averaged) and the gradients split the same way. With eager backward (plain
split) the cloud runs the backward right after the loss and its reply carries the cut's gradient.

Nothing here touches a socket or a codec: the messages of one part are a :class:`Stage`'s job
(:mod:`splitft.edge.stage`), so the order below can be tested with a stage that records calls.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from contextlib import AbstractContextManager
from typing import Any, Protocol, cast

import numpy as np
import torch

from ..wire.coding import Coded, stream_index
from ..wire.tree import Leaf
from ..wire.operations import ApplyEager, Operation
from ..errors import ConfigError, GraphFreedError, ProtocolError
from ..numerics import NumericsGuard
from ..options import Schedule
from .streaming import Inflight, Window, pending_like

log = logging.getLogger(__name__)


@dataclass
class Part:
    """One message pair of a call: the whole batch, or one micro-batch of it."""

    id: int
    rows: slice
    sample_ids: np.ndarray | None
    sent: list[Coded] = field(default_factory=list)
    received: list[Coded] = field(default_factory=list)
    out_grad: list[bool] = field(default_factory=list)
    eager_grads: tuple | None = None  # parsed input gradients that came with the output (eager backward)
    seq: int = 0  # request number of its forward, then of its backward
    rng_sent: bool = False  # its forward carried the edge's generator state
    share: float = 1.0  # its weight in the call's mean loss (its rows' share of the batch, or its targets')


@dataclass
class Call:
    """One remote call of the cloud part, from its forward to its backward."""

    skeleton: Any  # of (args, kwargs, target): see splitft.wire.tree
    n_leaves: int
    train: bool
    grad: bool
    sample_ids: np.ndarray | None
    in_grad: list[bool] = field(default_factory=list)
    in_split: list[bool] = field(default_factory=list)  # which inputs are cut into micro-batches
    parts: list[Part] = field(default_factory=list)
    batch: int = 0
    eager: bool = False  # the cloud runs the backward with the forward
    autocast: str | None = None  # the autocast dtype the user's forward ran under (the cloud's runs under it too)
    out_skeleton: Any = None
    out_join: list[str] = field(default_factory=list)  # per output: "cat", "mean" or "sum" over parts
    streamed: bool = False  # sent without waiting for its reply (splitft.edge.streaming)
    stash: list | None = None  # delayed gradients: (edge parameter, the copy this call's forward ran with)
    # delayed gradients: the cut's inputs with the edge's graph (the call itself got detached copies,
    # so that the loss's backward does not free that graph before the gradient for it arrives)
    leaves: list[torch.Tensor] = field(default_factory=list)
    inflight: Inflight | None = None
    weights: int = 0  # the cloud half's weights' version at the forward (:attr:`.outbox.Outbox.weights_version`)
    backpropagated: bool = False  # its backward went to the cloud, which then freed the call's graph
    released: bool = False  # an eager backward without retain_graph: the cloud gave the gradients it kept away
    cloud_half: Any = None  # the edge's record of the cloud's gradients (splitft.edge.cloud_half), told of the backward
    trainable: frozenset[str] = frozenset()  # the cloud parameters that required a gradient at the forward
    modes: tuple[str, ...] = ()  # the cloud modules whose mode differed from the call's (by name)
    #: A second loss of one activation: the generator state the first call started from (the
    #: cloud repeats that forward without side effects); None for any other call.
    again: torch.Tensor | None = None
    #: A plain split's loss after the script drew random numbers since its ``model(x)``: the
    #: generator state at that ``model(x)``, where the unsplit cloud half's draws started.
    drawn_since: torch.Tensor | None = None
    #: A plain split's loss after the script set the generator since its ``model(x)`` (``fork_rng``
    #: around it puts it back): the state at that ``model(x)``, where the cloud half draws from;
    #: the edge's generator stays as the script set it rather than going on from the half's draws.
    generator_kept: torch.Tensor | None = None
    #: Those of them the cloud said its graph did not reach (across the parts' replies); None: no word yet.
    unreached: set[str] | None = None

    def reported_unreached(self, names: list[str] | None) -> None:
        """A reply's word on the parameters its part's graph did not reach: reached by any part is reached."""
        found = set(names or ())
        self.unreached = found if self.unreached is None else self.unreached & found

    @property
    def has_target(self) -> bool:
        return self.skeleton[2] is not None


class Stage(Protocol):
    """One part's messages: encoding, sending, receiving and decoding what crosses."""

    def check(self, call: Call) -> None: ...
    def can_eager(self) -> bool: ...
    def send_forward(self, call: Call, part: Part, leaves: list[torch.Tensor], ops: list[Operation]) -> None: ...
    def receive_output(self, call: Call, part: Part, leaves: list[torch.Tensor]) -> list[torch.Tensor]: ...
    def send_backward(self, call: Call, part: Part, grads: list[torch.Tensor | None], ops: list[Operation],
                      params: bool = True) -> None: ...
    def receive_input_grads(self, call: Call, part: Part) -> list[torch.Tensor | None]: ...
    def eager_input_grads(self, call: Call, part: Part, scale: torch.Tensor) -> list[torch.Tensor | None]: ...
    def borrowing(self) -> AbstractContextManager[None]: ...


class Ops(Protocol):
    """The operations waiting to ride on the next message (:class:`splitft.edge.outbox.Outbox`)."""

    weights_version: int
    def queue(self, op: Operation) -> None: ...
    def take(self) -> list[Operation]: ...
    def requeue(self, ops: list[Operation]) -> None: ...


class Scheduler:
    """Runs remote calls through a stage: all parts sent before any reply is awaited."""

    def __init__(self, stage: Stage, ops: Ops, lock: threading.RLock, options: Schedule, *, ushape: bool) -> None:
        self.stage, self.ops, self.lock, self.options, self.ushape = stage, ops, lock, options, ushape
        self.loss_reduction = "mean"  # of the mirrored loss: how a loss's parts add up to the batch's
        #: What the mirrored loss's mean divides by, from a part's target, where not its rows (see
        #: :func:`splitft.edge.remote_loss.mean_denominator`).
        self.loss_denominator: Callable[[torch.Tensor], float] | None = None
        self._ids = itertools.count(1)
        self.window = Window()
        self._template: _Template | None = None  # the last synchronous call a streamed one may copy
        self._delayed: tuple[Call, torch.Tensor] | None = None  # a streamed call whose cut gradient is due
        self._said_why_synchronous = False
        #: The process-wide numeric settings as at split(), which the cloud's backward computes with too.
        self.numerics = NumericsGuard()
        #: Called before a backward takes the queued operations (the frozen parameters, told anew).
        self.before_backward: Callable[[], None] = lambda: None

    def forward(self, call: Call, leaves: list[torch.Tensor], needs_grad: list[bool]) -> list[torch.Tensor]:
        """Run the cloud part on ``leaves``; the outputs of the whole batch."""
        with self.lock:
            self.stage.check(call)
            call.in_grad = [bool(g) and call.grad for g in needs_grad]
            refuse_other_layouts(leaves, call.in_grad)
            # The cloud's backward can only come with the forward in a plain split with a loss.
            # Not under float16 autocast: eager backward runs the cloud's half for an incoming gradient of 1
            # and scales after, so a loss scaler's overflow (which must skip the step) would not happen.
            call.eager = (self.options.eager_backward and call.grad and call.has_target and not self.ushape
                          and call.autocast != "float16" and self.stage.can_eager())
            if self._streamable(call):
                return self._stream(call, leaves)
            self._say_why_synchronous(call)
            self.window.drain()
            rows = partition(call, leaves, self.options.micro_batches)
            call.weights = self.ops.weights_version  # what the forward runs with: the queued changes go first
            ops = self.ops.take()
            inputs = []
            with self.stage.borrowing():  # every reply is read before the script runs again
                for j, part_rows in enumerate(rows):
                    ids = call.sample_ids[part_rows] if call.sample_ids is not None and call.batch else call.sample_ids
                    part = Part(next(self._ids), part_rows, ids)
                    inputs.append(part_inputs(call, leaves, part))
                    try:
                        self.stage.send_forward(call, part, inputs[-1], ops if j == 0 else [])
                    except (ConfigError, ProtocolError):  # refused before it left (too large): nothing was sent
                        if j == 0:
                            self.ops.requeue(ops)
                        raise
                    call.parts.append(part)
                outputs = [self.stage.receive_output(call, part, x) for part, x in zip(call.parts, inputs)]
            joined = join_outputs(call, outputs, self.loss_reduction, self._denominators(call, inputs))
            self._remember(call, joined)
            return joined

    def loss_is(self, reduction: str, denominator: Callable[[torch.Tensor], float] | None) -> None:
        """The mirrored loss's reduction and mean denominator, as it was last sent."""
        self.loss_reduction, self.loss_denominator = reduction, denominator

    def _denominators(self, call: Call, inputs: list[list[torch.Tensor]]) -> list[float] | None:
        """What each part's mean loss divides by, from its target, where its rows are not it."""
        target = call.skeleton[2]
        if self.loss_denominator is None or len(inputs) < 2 or not isinstance(target, Leaf):
            return None
        return [self.loss_denominator(part[target.index]) for part in inputs]

    # ------------------------------------------------------------ streaming

    def _streamable(self, call: Call) -> bool:
        """A step that needs nothing back (frozen edge, loss and backward in the cloud), shaped
        like the last synchronous one, may go without waiting for its reply."""
        t = self._template
        needs_nothing_back = not any(call.in_grad) or (self.options.delayed_gradients and call.stash is not None)
        return (self.options.window > 1 and self.options.micro_batches == 1 and call.eager and call.train
                and needs_nothing_back and call.again is None and t is not None and _same(t.skeleton, call.skeleton))

    def _say_why_synchronous(self, call: Call) -> None:
        """Once: why training steps wait a round trip each although a window was asked for, so a
        window that cannot apply is not silently ignored."""
        if self.options.window < 2 or self._said_why_synchronous or not (call.train and call.grad):
            return
        if self.options.micro_batches > 1:
            why = f"micro-batches run synchronously (micro_batches={self.options.micro_batches})"
        elif not call.eager:
            why = ("only a step whose backward the cloud runs with its forward can stream: a plain split whose "
                   "loss the cloud computes, eager_backward on, no float16 autocast, a cloud that does not "
                   "checkpoint sessions")
        elif any(call.in_grad) and not self.options.delayed_gradients:
            why = ("the edge trains, so each step needs its cut gradient back first: freeze the edge, or "
                   "stream asynchronously with delayed_gradients=True (--delayed-gradients)")
        else:
            return  # streamable in kind: the first step of a shape goes synchronously to learn its reply
        self._said_why_synchronous = True
        log.warning("window=%d has no effect here; each training step waits for its reply: %s",
                    self.options.window, why)

    def _remember(self, call: Call, outputs: list[torch.Tensor]) -> None:
        """Keep a synchronous call's shape of reply: later calls like it may be streamed."""
        if (self.options.window > 1 and call.eager and len(call.parts) == 1 and call.parts[0].eager_grads is not None
                and all(t.dim() == 0 for t in outputs)):
            self._template = _Template(call.skeleton, call.out_skeleton, list(call.out_join),
                                       list(call.parts[0].out_grad), [(t.dtype, t.device) for t in outputs])

    def _stream(self, call: Call, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        t = self._template
        assert t is not None
        self.window.make_room(self.options.window)
        (rows,) = partition(call, leaves, 1)
        part = Part(next(self._ids), rows, call.sample_ids)
        self.stage.send_forward(call, part, leaves, self.ops.take())
        call.parts.append(part)
        call.streamed, call.out_skeleton, call.out_join = True, t.out_skeleton, list(t.out_join)
        part.out_grad = list(t.out_grad)
        outputs = [pending_like((), dtype, device) for dtype, device in t.outputs]

        def settle() -> list[torch.Tensor]:
            with self.lock:
                values = self.stage.receive_output(call, part, leaves)
            if part.eager_grads is None:
                raise ProtocolError("the cloud did not backpropagate a streamed step with its forward, so its "
                                    "gradients would be lost; use Schedule(window=1) with this cloud")
            return values

        call.inflight = Inflight(settle, outputs)
        self.window.push(call.inflight)
        return cast(list[torch.Tensor], outputs)

    def drain(self) -> None:
        """Settle every streamed step still in flight (raises a cloud error one of them met).

        A delayed cut gradient still due is dropped: no optimizer step is coming for it.
        """
        with self.lock:
            self._delayed = None
            self.window.drain()

    def _apply_delayed(self) -> None:
        """Delayed gradients: backpropagate the previous streamed call's cut gradient through the
        edge weights that call ran with, and add the result to the edge's gradients."""
        if self._delayed is None:
            return
        call, scale = self._delayed
        self._delayed = None
        assert call.inflight is not None and call.stash is not None
        self.window.settle_through(call.inflight)
        (part,) = call.parts
        self._backprop_edge(call, self.stage.eager_input_grads(call, part, scale))

    def backward(self, call: Call, grads: tuple[torch.Tensor | None, ...],
                 params: bool = True) -> list[torch.Tensor | None]:
        """Gradients of the call's inputs, given those of its outputs (``params``: the cloud half's
        parameters accumulate theirs too)."""
        self.numerics.check()  # a setting changed around backward() alone would reach the edge's layers only
        with self.lock:
            exact = _scales_exactly(call, grads)
            if call.released:
                raise GraphFreedError("a second backward through the same forward, the first without "
                                      "retain_graph=True: torch frees a graph at its backward unless told to keep it, "
                                      "and so did the cloud; pass retain_graph=True to the first backward, or add the "
                                      "losses and call backward once")
            if call.backpropagated and call.trainable and params and self.ops.weights_version != call.weights:
                raise GraphFreedError("a second backward through a forward after an optimizer step changed the cloud "
                                      "half's weights: torch refuses it too (a variable needed for gradient computation "
                                      "was modified by an inplace operation); run the forward again after the step")
            if call.backpropagated and not call.streamed and (
                    not exact or any(part.eager_grads is None for part in call.parts)):
                raise GraphFreedError(
                    "a second backward through the same forward (a recurrent state carried to the next batch without "
                    ".detach(), or backward(retain_graph=True) or torch.autograd.grad(..., retain_graph=True) through "
                    "the cloud half, then another): the cloud frees its graph after the first (with retain_graph, "
                    "only a loss unscaled or scaled by a power of two is answered again, from the gradients it kept), "
                    "so it cannot be repeated there; detach what is carried over (truncated backpropagation through "
                    "time), run the forward again, or add the losses and call backward once")
            call.backpropagated = True
            if not exact:  # the cloud backpropagates the graph it kept, for the gradient the loss got
                for part in call.parts:
                    part.eager_grads = None
            self.before_backward()
            ops = self.ops.take()
            sent_ops = False
            with self.stage.borrowing():  # every reply is read before the script runs again
                for part in call.parts:
                    if part.eager_grads is None and not call.streamed:
                        self.stage.send_backward(call, part, part_output_grads(call, part, grads),
                                                 [] if sent_ops else ops, params=params)
                        sent_ops = True
                if not sent_ops:
                    self.ops.requeue(ops)  # nothing was sent: the operations wait for the next message
                if call.stash is not None and not call.streamed:  # delayed-gradient mode, a synchronous step
                    input_grads = self._input_grads(call, grads)
                else:
                    return self._input_grads(call, grads, params)
            return self._backprop_edge(call, input_grads)  # runs the script's hooks: out of the scope

    def _backprop_edge(self, call: Call, grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Backpropagate the cut's gradients through the edge's graph (kept apart from the call's)."""
        pairs = [(leaf, g) for leaf, g, need in zip(call.leaves, grads, call.in_grad) if need and g is not None]
        if pairs:  # the stashed copies pass their gradients on to the weights (streaming.stash_weights)
            torch.autograd.backward([leaf for leaf, _ in pairs], [g for _, g in pairs])
        return [None] * len(grads)

    def _input_grads(self, call: Call, grads: tuple[torch.Tensor | None, ...],
                     params: bool = True) -> list[torch.Tensor | None]:
        """The call's input gradients from its parts' replies (or from what came with the outputs)."""
        per_part = []
        for part in call.parts:
            if part.eager_grads is None and not call.streamed:
                per_part.append(self.stage.receive_input_grads(call, part))
                continue
            # the loss's incoming gradient (a streamed call has one part and one output, the loss)
            (scale,) = (grads[0],) if call.streamed else part_output_grads(call, part, grads)
            assert scale is not None  # the loss needs a gradient: autograd gives it one
            if params:  # the parameters' part of an eager backward, held in the cloud until now
                last = not call.streamed and not keeps_graph()
                call.released = call.released or last
                self.ops.queue(ApplyEager(call=part.id, scale=float(scale), pass_id=backward_pass(), last=last))
            if call.streamed and any(call.in_grad):  # delayed gradients: the previous call's is due now
                self._apply_delayed()
                self._delayed = (call, scale)
            per_part.append([None] * len(part.sent) if call.streamed  # nothing crosses back now
                            else self.stage.eager_input_grads(call, part, scale))
        return join_input_grads(call, per_part)


@dataclass
class _Template:
    """What a streamed call copies from the last synchronous call of its shape."""

    skeleton: Any
    out_skeleton: Any
    out_join: list[str]
    out_grad: list[bool]
    outputs: list[tuple[torch.dtype, torch.device]]


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 — skeletons that cannot be compared are not the same
        return False


def refuse_sparse(tensor: torch.Tensor) -> None:
    """Refuse a sparse tensor at the cut: tensors cross as dense arrays."""
    if tensor.layout != torch.strided:
        raise ConfigError(f"a {str(tensor.layout).removeprefix('torch.')} tensor crosses the cut (a sparse adjacency "
                          "or mask): tensors cross as dense arrays; pass t.to_dense(), or keep the layers that use "
                          "it on one side of the cut")


def refuse_other_layouts(leaves: list[torch.Tensor], in_grad: list[bool]) -> None:
    """Refuse what crosses the cut in a form the cloud would not compute with as the unsplit model:
    a sparse tensor (arrays travel dense); a complex one whose gradient the edge needs (the cloud
    differentiates real inputs). A tensor in a memory format of its own (``channels_last``, a
    transpose) crosses as its bytes lie, and arrives with the same strides."""
    for leaf, grad in zip(leaves, in_grad):
        refuse_sparse(leaf)
        if grad and leaf.is_complex():
            raise ConfigError("a complex tensor that needs a gradient crosses the cut (torch.fft's output): the "
                              "cloud differentiates real tensors only; pass torch.view_as_real(t) and take "
                              "torch.view_as_complex(...) of it on the other side, in the unsplit model too")


def partition(call: Call, leaves: list[torch.Tensor], micro_batches: int) -> list[slice]:
    """Micro-batch row ranges; inputs with the stream's batch size are cut, others repeated."""
    stream = stream_index(call.skeleton[0])
    batch = leaves[stream].shape[0] if stream is not None and leaves[stream].dim() else 0
    call.batch = batch
    call.in_split = [t.dim() > 0 and t.shape[0] == batch for t in leaves]
    k = min(micro_batches, batch) if batch else 1
    bounds = [batch * j // k for j in range(k + 1)] if k > 1 else [0, batch]
    return [slice(bounds[j], bounds[j + 1]) for j in range(k)]


def part_inputs(call: Call, leaves: list[torch.Tensor], part: Part) -> list[torch.Tensor]:
    """A part's share of the call's inputs: its rows of those cut into micro-batches, the rest whole."""
    if part.rows == slice(0, call.batch):
        return leaves
    return [t[part.rows] if cut else t for t, cut in zip(leaves, call.in_split)]


def join_outputs(call: Call, outputs: list[list[torch.Tensor]], loss_reduction: str = "mean",
                 denominators: list[float] | None = None) -> list[torch.Tensor]:
    """The batch's outputs from its parts': rows concatenated; a scalar loss averaged (or summed),
    each part's mean weighed by its rows, or by its ``denominators`` (a part with none adds nothing)."""
    if len(outputs) == 1:
        call.out_join = ["cat"] * len(outputs[0])
        return outputs[0]
    joined = []
    sizes = [p.rows.stop - p.rows.start for p in call.parts]
    for i, pieces in enumerate(zip(*outputs)):
        if all(t.dim() > 0 and t.shape[0] == n for t, n in zip(pieces, sizes)):
            call.out_join.append("cat")
            joined.append(torch.cat(pieces))
        elif all(t.dim() == 0 for t in pieces):  # a loss: the batch's mean (or sum) over parts
            join = "sum" if loss_reduction == "sum" else "mean"
            call.out_join.append(join)
            weights = [1.0 if join == "sum" else n / call.batch for n in sizes]
            if join == "mean" and denominators is not None and sum(denominators) > 0:
                weights = [d / sum(denominators) for d in denominators]
            for part, w in zip(call.parts, weights if join == "mean" else ()):
                part.share = w
            counted = [(w, t) for w, t in zip(weights, pieces) if w] or list(zip(weights, pieces))  # 0/0 as unsplit
            joined.append(sum(w * t for w, t in counted))
        else:
            raise ConfigError(
                f"output {i} of the cloud part has no batch dimension, so micro-batches cannot be "
                "joined; use micro_batches=1"
            )
    return joined


def keeps_graph() -> bool:
    """Whether the backward running now keeps its graph (``retain_graph=True``): another backward
    may run through the same calls (True where this torch cannot say)."""
    read = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if read is None else bool(read())


def backward_pass() -> int | None:
    """The number of the autograd backward pass running now (None outside one): the cloud sums what one
    pass brings its parameters before adding it to their gradients, as torch's engine does."""
    task = torch._C._current_graph_task_id()
    return task if task >= 0 else None


def _scales_exactly(call: Call, grads: tuple) -> bool:
    """Whether an eager call's gradients, computed in the cloud for a loss gradient of 1, become the unsplit
    model's when scaled by the loss's own: exactly when that is ±2^k (a scaling that commutes with every
    rounding of the backward). A loss divided by 3 or weighted 0.3 would give gradients an ulp away, and
    the cloud backpropagates again instead. Micro-batches and streamed steps keep the scaling."""
    if call.streamed or len(call.parts) != 1 or call.parts[0].eager_grads is None:
        return True
    (scale,) = part_output_grads(call, call.parts[0], grads)
    value = float(scale) if scale is not None else 1.0
    return math.isfinite(value) and abs(math.frexp(value)[0]) == 0.5


def part_output_grads(call: Call, part: Part, grads: tuple) -> list[torch.Tensor | None]:
    """The slice (or share) of the outputs' gradients that belongs to one part."""
    result: list[torch.Tensor | None] = []
    for coded, grad, needed, join in zip(part.received, grads, part.out_grad, call.out_join):
        if not needed:
            result.append(None)
        elif grad is None:  # an output the loss does not use: the cloud's backward leaves its producers out
            result.append(None)
        elif len(call.parts) == 1 or join == "sum":
            result.append(grad)
        else:
            result.append(grad[part.rows] if join == "cat" else grad * part.share)
    return result


def join_input_grads(call: Call, per_part: list[list[torch.Tensor | None]]) -> list[torch.Tensor | None]:
    """The call's input gradients from its parts': rows concatenated, repeated inputs summed; None
    where no part's backward reached the input, zeros for the parts that did not beside one that did."""
    if len(per_part) == 1:
        return per_part[0]
    result: list[torch.Tensor | None] = []
    for i, pieces in enumerate(zip(*per_part)):
        if not call.in_grad[i] or all(piece is None for piece in pieces):
            result.append(None)
            continue
        pieces = tuple(piece if piece is not None else
                       torch.zeros(part.sent[i].shape, dtype=part.sent[i].dtype, device=part.sent[i].device)
                       for piece, part in zip(pieces, call.parts))
        result.append(torch.cat(pieces) if call.in_split[i] else torch.stack(pieces).sum(0))
    return result


__all__ = ["Call", "Part", "Scheduler", "Stage", "join_input_grads", "join_outputs", "part_inputs",
           "part_output_grads", "partition"]
