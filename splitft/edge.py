"""The edge runtime: the cut as an autograd function, and the model the user trains.

The user's loop stays ordinary PyTorch. The cut's forward encodes and sends what crosses and
returns what the cloud sent back; its backward sends the incoming gradient and returns the
gradient at the cut. Optimizer steps and ``zero_grad`` calls are mirrored to the cloud as
operations that ride on the next message, so gradient accumulation behaves exactly as locally
and a step costs no extra round trip.
"""

from __future__ import annotations

import inspect
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import transports
from compressors import CodecContext

from . import protocol
from .coding import (Coded, SlotCodecs, Traffic, flatten, from_wire, raw_nbytes, resolve_codecs,
                     sample_ids_array, stream_index, to_wire, unflatten)
from .errors import (ConfigError, DesyncError, PeerGone, ProtocolError, SplitFTError, TransportTimeout,
                     from_code, translated)
from .metrics import JsonlWriter, Metrics
from .protocol import Ack, Backward, Bye, Error, Forward, Hello, InputGrads, Output, Sync, Welcome
from .cut import CutReached, CutSpec, extract, fingerprint, install, parse_cut, cut_text, value_hash

log = logging.getLogger(__name__)



@dataclass
class _Part:
    """One message pair of a call: the whole batch, or one micro-batch of it."""

    id: int
    rows: slice
    sample_ids: np.ndarray | None
    sent: list[Coded] = field(default_factory=list)
    received: list[Coded] = field(default_factory=list)
    out_grad: list[bool] = field(default_factory=list)
    eager_grads: list | None = None  # input gradients that came with the output (eager backward)


@dataclass
class _Call:
    """One remote call of the cloud part, from its forward to its backward."""

    skeleton: Any
    n_leaves: int
    train: bool
    grad: bool
    sample_ids: np.ndarray | None
    in_grad: list[bool] = field(default_factory=list)
    in_split: list[bool] = field(default_factory=list)  # which inputs are cut into micro-batches
    parts: list[_Part] = field(default_factory=list)
    batch: int = 0
    out_skeleton: Any = None
    out_join: list[str] = field(default_factory=list)  # per output: "cat", "mean" or "sum" over parts


class EdgeSession:
    """One session with a cloud: handshake, remote calls, and the operations to mirror."""

    def __init__(self, connection: transports.Connection, *, codecs: dict[str, str], seed: int,
                 ushape: bool, timeout: float = 60.0, metrics: Metrics | None = None,
                 micro_batches: int = 1, eager_backward: bool = True) -> None:
        if not isinstance(micro_batches, int) or micro_batches < 1:
            raise ConfigError(f"micro_batches must be a positive integer, got {micro_batches!r}")
        self.connection = connection
        self.codecs = SlotCodecs(codecs, seed)
        self.ushape = ushape
        self.timeout = float(timeout)
        self.metrics = metrics or Metrics()
        self.micro_batches = micro_batches
        self.eager_backward = bool(eager_backward)
        self.loss_reduction = "mean"
        self.step = 0
        self.session_id: str | None = None
        self._ops: list[dict] = []
        self._calls = itertools.count(1)
        self._outstanding: set[int] = set()  # ids of requests whose reply has not been read
        self._early: dict[int, tuple[protocol.Message, int]] = {}  # replies that overtook the one awaited
        self._lock = threading.RLock()  # autograd may run backward on another thread
        self.closed = False

    # ------------------------------------------------------------ messaging

    def _send(self, msg: protocol.Message, kind: str, traffic: Traffic | None = None) -> None:
        if self.closed:
            raise PeerGone("this split session is closed; create a new one to keep training")
        frames = protocol.encode(msg)
        with translated():
            wire = self.connection.send(frames)
        self.metrics.count("up", kind, raw=traffic.raw if traffic else 0,
                           payload=traffic.payload if traffic else 0, wire=wire)
        self._outstanding.add(getattr(msg, "call", 0))

    def _await(self, call: int, expect: type) -> tuple[protocol.Message, int]:
        """The reply to request ``call``; errors from the cloud are raised as typed errors."""
        try:
            if call in self._early:
                reply, wire_in = self._early.pop(call)
            else:
                with self.metrics.timed("wait"):  # blocked on the other side: wire plus cloud work
                    reply, wire_in = self._receive_for(call)
        finally:
            self._outstanding.discard(call)
        if isinstance(reply, Error):
            self.metrics.count("down", "control", wire=wire_in)
            raise from_code(reply.code, f"cloud: {reply.message}")
        if isinstance(reply, Bye):
            self.metrics.count("down", "control", wire=wire_in)
            self._drop()
            raise PeerGone(f"the cloud ended the session: {reply.reason or 'no reason given'}")
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected a {expect.TYPE} reply, got {reply.TYPE}")
        timings = getattr(reply, "timings", None) or {}
        for name in ("compute", "codec"):
            if isinstance(timings.get(name), (int, float)):
                self.metrics.add_time(f"cloud_{name}", float(timings[name]))
        return reply, wire_in

    def _receive_for(self, call: int) -> tuple[protocol.Message, int]:
        with translated():
            while True:
                try:
                    frames = self.connection.recv(self.timeout)
                except transports.TransportTimeout:
                    raise TransportTimeout(
                        f"no reply from the cloud at {getattr(self.connection, 'address', '?')} within "
                        f"{self.timeout:g} s (is `splitft cloud` running there? a slow model may need a larger timeout)"
                    ) from None
                reply = protocol.decode(frames)
                wire_in = transports.message_nbytes(frames)
                got = getattr(reply, "call", 0)
                if got == call or isinstance(reply, Bye) or (isinstance(reply, Error) and got == 0):
                    return reply, wire_in
                if got in self._outstanding:
                    self._early[got] = (reply, wire_in)
                else:
                    log.warning("dropping a stale reply to call %s (waiting for %s)", got, call)

    def _exchange(self, msg: protocol.Message, kind: str, expect: type) -> tuple[protocol.Message, int]:
        self._send(msg, kind)
        return self._await(getattr(msg, "call", 0), expect)

    def open(self, hello: Hello) -> Welcome:
        with self._lock:
            welcome, wire_in = self._exchange(hello, "control", Welcome)
            self.metrics.count("down", "control", wire=wire_in)
            self.session_id = welcome.session
            return welcome

    def queue(self, op: dict) -> None:
        """An operation for the cloud to apply before the next message it handles."""
        self._ops.append(op)

    def _take_ops(self) -> list[dict]:
        ops, self._ops = self._ops, []
        return ops

    # ------------------------------------------------------------ remote calls

    def _partition(self, leaves: list[torch.Tensor], stream: int | None, call: _Call) -> list[slice]:
        """Micro-batch row ranges; inputs with the stream's batch size are cut, others repeated."""
        batch = leaves[stream].shape[0] if stream is not None and leaves[stream].dim() else 0
        call.batch = batch
        call.in_split = [t.dim() > 0 and t.shape[0] == batch for t in leaves]
        k = min(self.micro_batches, batch) if batch else 1
        bounds = [batch * j // k for j in range(k + 1)] if k > 1 else [0, batch]
        return [slice(bounds[j], bounds[j + 1]) for j in range(k)]

    def _forward_message(self, call: _Call, part: _Part, leaves: list[torch.Tensor], ops: list,
                         resync: bool) -> tuple[Forward, Traffic, CodecContext]:
        args_skel, kwargs_skel, target_skel = call.skeleton
        ctx = CodecContext("activation", train=call.train, step=self.step, sample_ids=part.sample_ids, resync=resync)
        traffic = Traffic()
        with self.metrics.timed("encode"):
            entries, part.sent = self.codecs.encode(leaves, stream_index(args_skel), "fwd", ctx, call.in_grad, traffic)
        eager = self.eager_backward and call.grad and target_skel is not None and not self.ushape
        msg = Forward(call=part.id, train=call.train, grad=call.grad, args=to_wire(args_skel, entries),
                      kwargs=to_wire(kwargs_skel, entries), target=to_wire(target_skel, entries), ops=ops,
                      step=self.step, sample_ids=part.sample_ids, eager=eager)
        return msg, traffic, ctx

    def run_forward(self, call: _Call, leaves: list[torch.Tensor], needs_grad: list[bool]) -> list[torch.Tensor]:
        with self._lock:
            if call.train and call.sample_ids is None:
                for slot in ("fwd", "ret") if self.ushape else ("fwd",):
                    codec = self.codecs.slots[slot]
                    if codec.needs_sample_ids:
                        raise ConfigError(
                            f"codec {codec.name!r} keeps state per training sample: pass a stable id for "
                            "each sample, model(x, sample_ids=ids) (ids in 0..N-1, the same every epoch)"
                        )
            call.in_grad = [bool(g) and call.grad for g in needs_grad]
            rows = self._partition(leaves, stream_index(call.skeleton[0]), call)
            ops = self._take_ops()
            pending = []
            for j, part_rows in enumerate(rows):  # every part is sent before any reply is awaited
                ids = call.sample_ids[part_rows] if call.sample_ids is not None and call.batch else call.sample_ids
                part = _Part(next(self._calls), part_rows, ids)
                part_leaves = [t[part_rows] if cut and len(rows) > 1 else t for t, cut in zip(leaves, call.in_split)]
                msg, traffic, ctx = self._forward_message(call, part, part_leaves, ops if j == 0 else [], False)
                self._send(msg, "activation", traffic)
                call.parts.append(part)
                pending.append((part, part_leaves, ctx))
            outputs = []
            for part, part_leaves, ctx in pending:
                try:
                    reply, wire_in = self._await(part.id, Output)
                except DesyncError as exc:
                    # A desync of stateful codecs (a lost or repeated message) is repaired once, by
                    # sending the same rows again at full precision, which resets both ends' state.
                    log.warning("codec state out of step with the cloud (%s); resending at full precision", exc)
                    msg, traffic, ctx = self._forward_message(call, part, part_leaves, [], True)
                    reply, wire_in = self._exchange_sent(msg, traffic)
                out_entries, skeleton = from_wire(reply.value)
                if call.out_skeleton is None:
                    call.out_skeleton = skeleton
                elif skeleton != call.out_skeleton:
                    raise ProtocolError("micro-batches of one call came back with different output structures")
                stream = stream_index(skeleton) if self.ushape else None
                with self.metrics.timed("decode"):
                    tensors, part.received = self.codecs.decode(out_entries, stream, "ret", ctx)
                part.out_grad = [g and call.grad for _, g in out_entries]
                grad_bytes = 0
                if reply.grads is not None:  # eager backward: the cut's gradient came along
                    part.eager_grads = reply.grads
                    grad_bytes = sum(p.nbytes for p, _ in from_wire(reply.grads)[0])
                    self.metrics.count("down", "gradient", raw=sum(
                        raw_nbytes(c.shape, c.dtype) for c, g in zip(part.sent, call.in_grad) if g),
                        payload=grad_bytes, wire=grad_bytes, messages=0)
                self.metrics.count("down", "activation", raw=sum(t.numel() * t.element_size() for t in tensors),
                                   payload=sum(c.payload.nbytes for c in part.received), wire=wire_in - grad_bytes)
                outputs.append(tensors)
            return self._join_outputs(call, outputs)

    def _exchange_sent(self, msg: Forward, traffic: Traffic) -> tuple[protocol.Message, int]:
        self._send(msg, "activation", traffic)
        return self._await(msg.call, Output)

    def _join_outputs(self, call: _Call, outputs: list[list[torch.Tensor]]) -> list[torch.Tensor]:
        if len(outputs) == 1:
            call.out_join = ["cat"] * len(outputs[0])
            return outputs[0]
        joined = []
        for i, pieces in enumerate(zip(*outputs)):
            sizes = [p.rows.stop - p.rows.start for p in call.parts]
            if all(t.dim() > 0 and t.shape[0] == n for t, n in zip(pieces, sizes)):
                call.out_join.append("cat")
                joined.append(torch.cat(pieces))
            elif all(t.dim() == 0 for t in pieces):  # a loss: the batch's mean (or sum) over parts
                join = "sum" if self.loss_reduction == "sum" else "mean"
                call.out_join.append(join)
                weights = [1.0 if join == "sum" else n / call.batch for n in sizes]
                joined.append(sum(w * t for w, t in zip(weights, pieces)))
            else:
                raise ConfigError(
                    f"output {i} of the cloud part has no batch dimension, so micro-batches cannot be "
                    "joined; use micro_batches=1"
                )
        return joined

    def _part_output_grads(self, call: _Call, part: _Part, grads: tuple) -> list[torch.Tensor | None]:
        """The slice (or share) of the outputs' gradients that belongs to one part."""
        result = []
        for coded, grad, needed, join in zip(part.received, grads, part.out_grad, call.out_join):
            if not needed:
                result.append(None)
            elif grad is None:
                result.append(torch.zeros(coded.shape, dtype=coded.dtype))
            elif len(call.parts) == 1 or join == "sum":
                result.append(grad)
            else:
                result.append(grad[part.rows] if join == "cat" else
                              grad * ((part.rows.stop - part.rows.start) / call.batch))
        return result

    def run_backward(self, call: _Call, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        with self._lock:
            ops = self._take_ops()
            sent_ops = False
            for part in call.parts:  # every part is sent before any reply is awaited
                if part.eager_grads is not None:
                    continue
                ctx = CodecContext("gradient", train=True, step=self.step, sample_ids=part.sample_ids)
                traffic = Traffic()
                entries: list[dict | None] = []
                with self.metrics.timed("encode"):
                    for coded, grad in zip(part.received, self._part_output_grads(call, part, grads)):
                        if grad is None:
                            entries.append(None)
                            continue
                        grad = self.codecs.grad_for_sender(grad, coded, "ret", ctx)
                        (entry,), _ = self.codecs.encode([grad], 0 if coded.stream else None, "ret_bwd", ctx,
                                                         [False], traffic, raw=[raw_nbytes(coded.shape, coded.dtype)])
                        entries.append(entry)
                self._send(Backward(call=part.id, grads=entries, ops=[] if sent_ops else ops), "gradient", traffic)
                sent_ops = True
            if not sent_ops:
                self._ops[:0] = ops  # nothing was sent: the operations wait for the next message
            per_part = []
            for part in call.parts:
                if part.eager_grads is None:
                    per_part.append(self._input_grads(call, part))
                    continue
                (scale,) = self._part_output_grads(call, part, grads)  # the loss's incoming gradient
                self.queue({"op": "apply", "call": part.id, "scale": float(scale)})
                per_part.append(self._decode_input_grads(call, part, part.eager_grads, scale=scale))
            if len(per_part) == 1:
                return per_part[0]
            result: list[torch.Tensor | None] = []
            for i, pieces in enumerate(zip(*per_part)):
                if not call.in_grad[i]:
                    result.append(None)
                elif call.in_split[i]:
                    result.append(torch.cat(pieces))
                else:
                    result.append(torch.stack(pieces).sum(0))
            return result

    def _input_grads(self, call: _Call, part: _Part) -> list[torch.Tensor | None]:
        reply, wire_in = self._await(part.id, InputGrads)
        result = self._decode_input_grads(call, part, reply.grads)
        got, _ = from_wire(reply.grads)
        self.metrics.count("down", "gradient", raw=sum(raw_nbytes(c.shape, c.dtype)
                                                       for c, g in zip(part.sent, call.in_grad) if g),
                           payload=sum(p.nbytes for p, _ in got), wire=wire_in)
        return result

    def _decode_input_grads(self, call: _Call, part: _Part, wire: Any,
                            scale: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """Gradients of a part's inputs from wire entries (times ``scale`` for an eager call)."""
        ctx = CodecContext("gradient", train=True, step=self.step, sample_ids=part.sample_ids)
        got, skeleton = from_wire(wire)
        if not isinstance(skeleton, list) or len(skeleton) != len(part.sent):
            raise ProtocolError(f"cloud sent {len(skeleton) if isinstance(skeleton, list) else '?'} input "
                                f"gradients for a call with {len(part.sent)} inputs")
        result: list[torch.Tensor | None] = []
        with self.metrics.timed("decode"):
            for coded, slot, needed in zip(part.sent, skeleton, call.in_grad):
                if not needed:
                    result.append(None)
                    continue
                if slot is None:
                    result.append(torch.zeros(coded.shape, dtype=coded.dtype))
                    continue
                (grad,), _ = self.codecs.decode([got[slot.index]], 0 if coded.stream else None, "bwd", ctx)
                grad = self.codecs.grad_at_input(grad, coded, "fwd", ctx)
                result.append(grad if scale is None else grad * scale)
        return result

    # ------------------------------------------------------------ control

    def sync(self, want_state: bool = False) -> dict[str, np.ndarray] | None:
        """Apply pending operations in the cloud now; optionally fetch the cloud part's weights."""
        with self._lock:
            reply, wire_in = self._exchange(Sync(ops=self._take_ops(), want_state=want_state), "control", Ack)
            self.metrics.count("down", "control", wire=wire_in)
            return reply.state

    def close(self, reason: str = "done") -> None:
        """Say goodbye (flushing pending operations) and release the connection. Idempotent."""
        with self._lock:
            if self.closed:
                return
            try:
                frames = protocol.encode(Bye(reason=reason, ops=self._take_ops()))
                self.metrics.count("up", "control", wire=self.connection.send(frames))
                deadline = time.monotonic() + min(self.timeout, 5.0)
                while (left := deadline - time.monotonic()) > 0:
                    reply = protocol.decode(self.connection.recv(left))
                    if isinstance(reply, (Ack, Bye, Error)):
                        break
            except (transports.TransportError, SplitFTError) as exc:
                log.info("cloud did not confirm the goodbye: %s", exc)
            finally:
                self._drop()

    def _drop(self) -> None:
        self.closed = True
        self.connection.close()


class _RemoteCall(torch.autograd.Function):
    """The cut. Inputs: the call's tensors (and an anchor that keeps the cloud part trainable)."""

    @staticmethod
    def forward(ctx: Any, session: EdgeSession, call: _Call, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(inputs[: call.n_leaves])
        outputs = session.run_forward(call, leaves, list(ctx.needs_input_grad[2: 2 + call.n_leaves]))
        ctx.session, ctx.call = session, call
        ctx.mark_non_differentiable(*[t for t, g in zip(outputs, call.parts[0].out_grad) if not g])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        call: _Call = ctx.call
        input_grads = ctx.session.run_backward(call, grads)
        extra = len(ctx.needs_input_grad) - 2 - call.n_leaves
        return (None, None, *input_grads, *([None] * extra))


class SplitModel(nn.Module):
    """The user's model with its cloud part cut out. Train it like the original.

    Its parameters are the edge's only; attach the optimizer with :meth:`attach` so the cloud
    part steps with it. Plain splits return the activation at the cut from ``forward``; the loss
    comes from :meth:`remote_loss` and predictions from :meth:`predict`.
    """

    def __init__(self, model: nn.Module, spec: CutSpec, session: EdgeSession,
                 metrics_path: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.session = session
        self._anchor = torch.zeros((), requires_grad=True)
        self._sample_ids: np.ndarray | None = None
        self._writer = JsonlWriter(metrics_path) if metrics_path else None
        self._last_record = time.perf_counter()

    @property
    def metrics(self) -> Metrics:
        return self.session.metrics

    # ------------------------------------------------------------ forward

    def forward(self, *args: Any, sample_ids: Any = None, **kwargs: Any) -> Any:
        """Run the model's own forward; the cloud part runs remotely.

        ``sample_ids`` (one int per sample, stable across epochs) is for codecs that keep
        per-sample state, such as ``acsgd``.
        """
        self._sample_ids = sample_ids_array(sample_ids)
        if self.spec.ushape:
            return self.model(*args, **kwargs)
        try:
            self.model(*args, **kwargs)
        except CutReached as cut:
            if len(cut.call_args) == 1 and not cut.call_kwargs:
                return cut.call_args[0]
            return CutActivation(cut.call_args, cut.call_kwargs)
        raise SplitFTError("the model's forward returned without reaching the cut; check the cut name")

    def _remote(self, args: tuple, kwargs: dict, target: Any = None) -> Any:
        grad = torch.is_grad_enabled()
        leaves, skeleton = flatten((list(args), kwargs, target))
        call = _Call(skeleton, len(leaves), train=self.training, grad=grad, sample_ids=self._sample_ids)
        inputs = [*leaves, self._anchor] if grad else leaves
        outputs = _RemoteCall.apply(self.session, call, *inputs)
        return unflatten(call.out_skeleton, list(outputs))

    def _trunk(self, *args: Any, **kwargs: Any) -> Any:
        return self._remote(args, kwargs)

    def predict(self, *args: Any, sample_ids: Any = None, **kwargs: Any) -> Any:
        """The whole model's output. In U-shape this is ``forward``; plain splits ask the cloud."""
        if self.spec.ushape:
            return self(*args, sample_ids=sample_ids, **kwargs)
        cut = self(*args, sample_ids=sample_ids, **kwargs)
        return self._remote(*_call_parts(cut))

    # ------------------------------------------------------------ training

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Mirror ``optimizer`` in the cloud: same class and settings, stepping when it steps.

        Returns the same optimizer, so ``opt = model.attach(torch.optim.Adam(...))`` reads well.
        """
        cls = type(optimizer)
        if not cls.__module__.startswith("torch.optim") or getattr(torch.optim, cls.__name__, None) is not cls:
            raise ConfigError(
                f"the cloud mirrors torch.optim optimizers by name; {cls.__qualname__} is not one of them"
            )
        settings = {k: _plain(v) for k, v in optimizer.defaults.items() if _plain(v) is not _NOT_PLAIN}
        self.session.queue({"op": "optimizer", "name": cls.__name__, "settings": settings})
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._stepped(opt))
        original = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            original(set_to_none)
            self.session.queue({"op": "zero_grad", "set_to_none": bool(set_to_none)})

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        return optimizer

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        lr = optimizer.param_groups[0].get("lr")
        self.session.queue({"op": "step", "lr": float(lr) if isinstance(lr, (int, float)) else None})
        self.session.step += 1
        self.metrics.steps += 1
        if self._writer is not None:
            now = time.perf_counter()
            self._writer.write({"step": self.session.step, "seconds": now - self._last_record}
                               | self.metrics.snapshot())
            self._last_record = now

    def remote_loss(self, criterion: nn.Module) -> "RemoteLoss":
        """Plain split: compute ``criterion`` in the cloud. Returns a callable ``crit(out, target)``."""
        if self.spec.ushape:
            raise ConfigError("in a U-shape split the loss stays on the edge: call your criterion directly")
        cls = type(criterion)
        if getattr(nn, cls.__name__, None) is not cls or not issubclass(cls, nn.modules.loss._Loss):
            raise ConfigError(f"the cloud computes torch.nn losses by name; {cls.__qualname__} is not one")
        settings = {}
        for name in inspect.signature(cls).parameters:
            value = getattr(criterion, name, None)
            if isinstance(value, torch.Tensor):
                raise ConfigError(f"{cls.__name__}({name}=<tensor>) cannot be mirrored to the cloud")
            if _plain(value) is not _NOT_PLAIN and value is not None:
                settings[name] = value
        self.session.queue({"op": "loss", "name": cls.__name__, "settings": settings})
        self.session.loss_reduction = str(settings.get("reduction", "mean"))
        return RemoteLoss(self)

    # ------------------------------------------------------------ cloud state

    def sync(self) -> None:
        """Make the cloud apply every pending step now (they otherwise ride on the next message)."""
        self.session.sync()

    def cloud_state_dict(self) -> dict[str, torch.Tensor]:
        """The cloud part's current weights, named as in the original model."""
        state = self.session.sync(want_state=True) or {}
        return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}

    def close(self, reason: str = "done") -> None:
        if self._writer is not None:
            self._writer.close()
        self.session.close(reason)

    def __enter__(self) -> "SplitModel":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close("interrupted" if exc_type is KeyboardInterrupt else "done" if exc_type is None else "error")


@dataclass
class CutActivation:
    """What reaches a plain cut when more than one value crosses (e.g. hidden states and a mask)."""

    args: tuple
    kwargs: dict


def _call_parts(cut: Any) -> tuple[tuple, dict]:
    if isinstance(cut, CutActivation):
        return cut.args, cut.kwargs
    return (cut,), {}


class RemoteLoss:
    """``crit(out, target)`` for a plain split: the cloud runs its part and the loss."""

    def __init__(self, split: SplitModel) -> None:
        self.split = split

    def __call__(self, out: Any, target: torch.Tensor) -> torch.Tensor:
        args, kwargs = _call_parts(out)
        return self.split._remote(args, kwargs, target)


_NOT_PLAIN = object()


def _plain(value: Any) -> Any:
    """``value`` if msgpack can carry it as a setting, else a marker."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)) and all(isinstance(v, (bool, int, float)) for v in value):
        return list(value)
    return _NOT_PLAIN


def split(model: nn.Module, cut: str | int, rejoin: str | int | None = None, *,
          factory: str, factory_kwargs: dict | None = None,
          connect: str | None = None, connection: transports.Connection | None = None,
          fwd: str = "identity", bwd: str | None = None, ret: str | None = None, ret_bwd: str | None = None,
          seed: int = 0, weights: str = "push", timeout: float = 60.0, micro_batches: int = 1,
          link: str | None = None, eager_backward: bool = True, metrics_path: str | None = None) -> SplitModel:
    """Cut ``model`` and connect its cloud part; returns the edge's model to train.

    Args:
        model: the full model, built on the edge. Its cloud modules are replaced by stand-ins.
        cut: the first module that runs in the cloud (dotted name or Sequential index), or a
            slice ``"parent.i:j"`` of a container's children (U-shape).
        rejoin: for U-shape, the sibling of ``cut`` where the edge takes over again.
        factory: ``"package.module:function"`` that builds the same model in the cloud; the
            cloud must list it as allowed.
        connect / connection: the cloud's address (``tcp://host:port``, ``ipc://path``), or an
            open transport connection.
        fwd, bwd, ret, ret_bwd: codec specs per direction (see :mod:`splitft.coding`).
        seed: shared seed for codec randomness (keys, projections).
        weights: ``"push"`` sends the cloud part's initial weights in the handshake;
            ``"factory"`` has the cloud use its own and checks that they are equal.
        micro_batches: cut each call into this many micro-batches, all sent before any reply
            is awaited, so the wire and the cloud work at the same time (forward and backward).
            The gradient is the full batch's, unless the cloud part has batch-statistics layers
            (BatchNorm), which then see micro-batches instead of the batch: keep 1 for those.
        link: emulate a slower network on this connection, e.g. ``"100mbit,20ms"`` (bandwidth
            and one-way delay; ``"up=...;down=..."`` for asymmetric links). None: as it is.
        eager_backward: plain split only. The cloud runs the backward right after the loss and
            sends the cut's gradient with it: one round trip per training step instead of two.
            The edge scales it by the loss's incoming gradient (gradient accumulation, loss
            scaling) and tells the cloud to scale its own parameter gradients the same way.
    """
    if weights not in ("push", "factory"):
        raise ConfigError(f"weights must be 'push' or 'factory', got {weights!r}")
    if (connect is None) == (connection is None):
        raise ConfigError("give exactly one of connect='tcp://host:port' or connection=<transport>")
    spec = parse_cut(model, cut, rejoin)
    cut_name, rejoin_name = cut_text(spec, model)
    chain = extract(model, spec)
    codecs = resolve_codecs(fwd, bwd, ret, ret_bwd)
    hello = Hello(
        protocol=protocol.PROTOCOL_VERSION, factory=factory, factory_kwargs=dict(factory_kwargs or {}),
        cut=cut_name, rejoin=rejoin_name, fingerprint=fingerprint(chain), codecs=codecs, seed=int(seed),
        value_hash=value_hash(chain) if weights == "factory" else None,
        weights={k: v.detach().cpu().numpy() for k, v in chain.qualified_state_dict().items()}
        if weights == "push" else None,
        client="splitft",
    )
    if connection is None:
        with translated():
            connection = transports.connect(connect)
    if link is not None:
        try:
            connection = transports.emulate(connection, link)
        except transports.LinkSpecError as exc:
            connection.close()
            raise ConfigError(str(exc)) from exc
    session = EdgeSession(connection, codecs=codecs, seed=seed, ushape=spec.ushape, timeout=timeout,
                          micro_batches=micro_batches, eager_backward=eager_backward)
    try:
        session.open(hello)
    except BaseException:
        session._drop()
        raise
    split_model = SplitModel(model, spec, session, metrics_path=metrics_path)
    install(model, spec, remote=split_model._trunk if spec.ushape else None)
    return split_model
