"""The edge runtime: the cut as an autograd function, and the model the user trains.

The user's loop stays ordinary PyTorch. The cut's forward encodes and sends what crosses and
returns what the cloud sent back; its backward sends the incoming gradient and returns the
gradient at the cut. Optimizer steps and ``zero_grad`` calls are mirrored to the cloud as
operations that ride on the next message, so gradient accumulation behaves exactly as locally
and a step costs no extra round trip.

Faults: every request is numbered and logged (:mod:`splitft.resilience`); when the link fails
(no reply in time, the connection drops, the cloud lost the session) the edge reconnects with
backoff, resumes the session with its token and re-sends what the cloud had not applied. While
the user's loop is busy elsewhere, a heartbeat keeps the cloud's session alive.
"""

from __future__ import annotations

import inspect
import itertools
import json
import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import transports
from compressors import CodecContext

from . import protocol
from .checkpoint import read_checkpoint, write_checkpoint
from .coding import (Coded, SlotCodecs, Traffic, flatten, from_wire, resolve_codecs, sample_ids_array,
                     stream_index, to_wire, unflatten)
from .errors import (AuthError, CapacityError, CheckpointError, ConfigError, HandshakeError, PeerGone,
                     ProtocolError, SessionLost, SplitFTError, TooLarge, TransportError, TransportTimeout,
                     from_code, translated)
from .metrics import JsonlWriter, Metrics
from .protocol import Ack, Backward, Bye, Error, Forward, Hello, InputGrads, Output, Ping, Pong, Sync, Welcome
from .resilience import Backoff, ReplayLog
from .split import CutReached, CutSpec, extract, fingerprint, install, parse_cut, cut_text, value_hash

log = logging.getLogger(__name__)



@dataclass
class _Call:
    """One remote call of the cloud part, from its forward to its backward."""

    skeleton: Any
    n_leaves: int
    train: bool
    grad: bool
    sample_ids: np.ndarray | None
    id: int = 0
    sent: list[Coded] = field(default_factory=list)
    in_grad: list[bool] = field(default_factory=list)
    received: list[Coded] = field(default_factory=list)
    out_grad: list[bool] = field(default_factory=list)
    out_skeleton: Any = None


class _LinkFault(Exception):
    """The link failed in a way a reconnection may cure (internal to the edge runtime)."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


class EdgeSession:
    """One session with a cloud: handshake, remote calls, the operations to mirror, and recovery.

    Args:
        connection: the open link to the cloud.
        reconnect: opens a fresh link to the same cloud; None disables recovery (a fault raises).
        timeout: seconds to wait for any one reply.
        reconnect_timeout: seconds to keep trying to get the session back after a fault.
        heartbeat: seconds of idleness after which the edge pings the cloud (0: never).
        max_log_bytes: when the requests kept for a replay exceed this, the edge asks the cloud
            for a checkpoint, after which they are no longer needed.
    """

    def __init__(self, connection: transports.Connection, *, codecs: dict[str, str], seed: int,
                 ushape: bool, timeout: float = 60.0, metrics: Metrics | None = None,
                 reconnect: Callable[[], transports.Connection] | None = None,
                 reconnect_timeout: float = 60.0, heartbeat: float = 10.0,
                 max_log_bytes: int = 256 * 2**20) -> None:
        self.connection = connection
        self.codecs = SlotCodecs(codecs, seed)
        self.ushape = ushape
        self.timeout = float(timeout)
        self.metrics = metrics or Metrics()
        self.step = 0
        self.session_id: str | None = None
        self.token = ""
        self.checkpoint_every = 0
        self.limits: dict[str, int] = {}
        self.optimizer_id = 0
        self.shared = False  # the cloud half is shared with other edges
        self.recoveries = 0  # times the session was recovered after a fault
        self._ops: list[dict] = []
        self._calls = itertools.count(1)
        self._lock = threading.RLock()  # autograd may run backward on another thread
        self._seq = 0
        self._log = ReplayLog()
        self.max_log_bytes = int(max_log_bytes)
        self._trimming = False
        self._hello: Hello | None = None
        self._reconnect = reconnect
        self.reconnect_timeout = float(reconnect_timeout)
        self.heartbeat = float(heartbeat)
        self._last_io = time.monotonic()
        self._suspect: BaseException | None = None  # the heartbeat saw the link fail
        self._stop = threading.Event()
        self._beats: threading.Thread | None = None
        self.closed = False

    # ------------------------------------------------------------ messaging

    def _exchange(self, msg: protocol.Message, kind: str, expect: type, traffic: Traffic | None = None):
        """Send ``msg``, wait for its reply; errors from the cloud are raised as typed errors.

        A link fault (timeout, dropped connection, lost session) is repaired by :meth:`_recover`
        when a reconnect function is known; the caller only sees it take longer.
        """
        if self.closed:
            raise PeerGone("this split session is closed; create a new one to keep training")
        sequenced = hasattr(msg, "seq")
        if sequenced:
            self._seq += 1
            msg.seq = self._seq
        frames = protocol.encode(msg)
        try:
            self._check_limits(frames, msg)
        except TooLarge:
            if sequenced:
                self._seq -= 1
            raise
        seq = msg.seq if sequenced else 0
        if seq:
            self._log.add(seq, frames, [op["id"] for op in getattr(msg, "ops", ())
                                        if op.get("op") == "step" and isinstance(op.get("id"), int)],
                          checkpoint=bool(getattr(msg, "checkpoint", False)))
        start = time.perf_counter()
        try:
            if self._suspect is not None and seq and self._reconnect is not None:
                fault, self._suspect = self._suspect, None
                reply, wire_in = self._recover(seq, fault)
            else:
                try:
                    reply, wire_in = self._round_trip(seq, frames, kind, traffic, getattr(msg, "call", None))
                except _LinkFault as fault:
                    if not seq or self._reconnect is None:
                        raise fault.cause from None
                    reply, wire_in = self._recover(seq, fault.cause)
        finally:
            self._last_io = time.monotonic()
        self.metrics.add_time("wait", time.perf_counter() - start)
        if isinstance(reply, Error):
            self.metrics.count("down", "control", wire=wire_in)
            if seq and reply.seq == 0:  # the cloud could not even read the request: nothing was applied
                self._log.drop(seq)
                self._seq -= 1
            raise from_code(reply.code, f"cloud: {reply.message}")
        if isinstance(reply, Bye):
            self.metrics.count("down", "control", wire=wire_in)
            self._drop()
            raise PeerGone(f"the cloud ended the session: {reply.reason or 'no reason given'}")
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected a {expect.TYPE} reply to {msg.TYPE}, got {reply.TYPE}")
        if seq:
            self._applied(seq)
            if self._log.nbytes > self.max_log_bytes and self.checkpoint_every > 0 and not self._trimming:
                self._trimming = True  # no step for a long while: a checkpoint lets the log go
                try:
                    self.sync(checkpoint=True)
                finally:
                    self._trimming = False
        timings = getattr(reply, "timings", None) or {}
        for name in ("compute", "codec"):
            if isinstance(timings.get(name), (int, float)):
                self.metrics.add_time(f"cloud_{name}", float(timings[name]))
        return reply, wire_in

    def _check_limits(self, frames: list, msg: protocol.Message) -> None:
        most = self.limits.get("max_message_bytes")
        size = transports.message_nbytes(frames)
        if isinstance(most, int) and size > most:
            raise TooLarge(f"this {msg.TYPE} message is {size} bytes; the cloud accepts at most {most}. Send "
                           "less (a compressing codec, smaller batches) or ask for a larger --max-message-mb")
        frames_most = self.limits.get("max_frames")
        if isinstance(frames_most, int) and len(frames) > frames_most:
            raise TooLarge(f"this {msg.TYPE} message has {len(frames)} frames; the cloud accepts at most {frames_most}")

    def _applied(self, seq: int) -> None:
        """The cloud answered request ``seq``: forget what can no longer be needed for a replay."""
        if self.checkpoint_every <= 0:
            self._log.trim_before(seq + 1)  # no checkpoints: only the request in flight matters
        elif self._log.checkpointed(seq) or any(s % self.checkpoint_every == 0 for s in self._log.steps_of(seq)):
            self._log.trim_before(seq)  # the cloud checkpointed right after this request's operations

    def _round_trip(self, seq: int, frames: list, kind: str, traffic: Traffic | None,
                    call: int | None = None) -> tuple[protocol.Message, int]:
        """Send frames and wait for their reply; link faults come out as :class:`_LinkFault`."""
        try:
            with translated():
                wire = self.connection.send(frames)
                self.metrics.count("up", kind, raw=traffic.raw if traffic else 0,
                                   payload=traffic.payload if traffic else 0, wire=wire)
                return self._await(seq, call, self.timeout)
        except AuthError:
            raise
        except TransportTimeout as exc:
            raise _LinkFault(TransportTimeout(
                f"no reply from the cloud at {getattr(self.connection, 'address', '?')} within "
                f"{self.timeout:g} s (is `splitft cloud` running there? a slow model may need a larger timeout)"
            )) from exc
        except (TransportError, SessionLost) as exc:
            raise _LinkFault(exc) from exc

    def _await(self, seq: int, call: int | None, timeout: float) -> tuple[protocol.Message, int]:
        """The reply to request ``seq`` (or to ``call`` for unnumbered ones); stale replies are dropped."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TransportTimeout(f"no reply within {timeout:g} s")
            reply_frames = self.connection.recv(left)
            reply = protocol.decode(reply_frames)
            wire_in = transports.message_nbytes(reply_frames)
            if isinstance(reply, Pong) or (seq and isinstance(reply, Welcome)):
                continue  # a late answer to a heartbeat, or to a repeated hello
            reply_seq = getattr(reply, "seq", 0)
            if seq and reply_seq and reply_seq != seq:
                log.info("dropping a stale reply to request %s (waiting for %s)", reply_seq, seq)
                continue
            if call is not None and getattr(reply, "call", call) != call:
                log.warning("dropping a stale reply to call %s (waiting for %s)", reply.call, call)
                continue
            if isinstance(reply, Error) and reply.code == "session":
                raise SessionLost(reply.message)
            return reply, wire_in

    # ------------------------------------------------------------ recovery

    def _recover(self, seq: int, fault: BaseException) -> tuple[protocol.Message, int]:
        """Reconnect, resume the session and re-send what the cloud lost; return request ``seq``'s reply."""
        address = getattr(self.connection, "address", "?")
        deadline = time.monotonic() + self.reconnect_timeout
        backoff = Backoff()
        attempt = 0
        while True:
            attempt += 1
            log.warning("link to the cloud at %s failed (%s); reconnecting, attempt %d", address, fault, attempt)
            self.connection.close()
            try:
                with translated():
                    self.connection = self._reconnect()
                    welcome = self._resume_handshake(max(0.1, min(self.timeout, deadline - time.monotonic())))
                    result = self._replay(welcome.seq, seq)
                self.recoveries += 1
                log.warning("session %s resumed at request %d (step %d); replayed %d request(s)",
                            self.session_id, welcome.seq, welcome.steps, seq - min(seq, welcome.seq))
                return result
            except (AuthError, HandshakeError, PeerGone):
                raise  # refused, or the session cannot be resumed: retrying will not change that
            except (TransportError, SessionLost, CapacityError) as exc:
                fault = exc
            delay = backoff.next()
            if time.monotonic() + delay > deadline:
                raise TransportTimeout(
                    f"lost the cloud at {address} and could not get the session back within "
                    f"{self.reconnect_timeout:g} s (last error: {fault}); is the cloud running, and was it "
                    "restarted with the same --checkpoint-dir?"
                ) from None
            time.sleep(delay)

    def _resume_hello(self) -> Hello:
        assert self._hello is not None
        hello = Hello(**{**vars(self._hello), "weights": None, "value_hash": None})
        hello.resume = {"session": self.session_id, "token": self.token, "step": self.step, "seq": self._seq,
                        "log_from": self._log.first or self._seq + 1}
        return hello

    def _resume_handshake(self, timeout: float) -> Welcome:
        frames = protocol.encode(self._resume_hello())
        self.metrics.count("up", "control", wire=self.connection.send(frames))
        reply, wire_in = self._await(0, None, timeout)
        self.metrics.count("down", "control", wire=wire_in)
        if isinstance(reply, Error):
            raise from_code(reply.code, f"cloud: {reply.message}")
        if not isinstance(reply, Welcome) or reply.session != self.session_id:
            raise HandshakeError(f"expected a welcome back to session {self.session_id}, got {reply.TYPE}")
        self._welcomed(reply)
        return reply

    def _replay(self, cloud_seq: int, seq: int) -> tuple[protocol.Message, int]:
        """Re-send requests after ``cloud_seq`` up to ``seq``; the reply to ``seq`` is the result."""
        pending = [(s, f) for s, f in self._log.after(cloud_seq) if s <= seq]
        if cloud_seq >= seq:  # applied already (only its reply was lost): the cloud answers from its cache
            frames = self._log.get(seq)
            pending = [(seq, frames)] if frames is not None else []
        if not pending or pending[0][0] != min(seq, cloud_seq + 1):
            raise HandshakeError(f"cannot replay: the cloud is at request {cloud_seq} but this edge kept requests "
                                 f"from {self._log.first} on")
        result = None
        for s, frames in pending:
            self.metrics.count("up", "control", wire=self.connection.send(frames))
            result = self._await(s, None, self.timeout)
        assert result is not None
        return result

    def _welcomed(self, welcome: Welcome) -> None:
        self.session_id = welcome.session
        self.token = welcome.token
        self.checkpoint_every = int(welcome.checkpoint_every)
        self.limits = dict(welcome.limits or {})
        self.shared = bool(welcome.shared)

    # ------------------------------------------------------------ heartbeat

    def _start_heartbeat(self) -> None:
        if self.heartbeat > 0 and self._beats is None:
            self._beats = threading.Thread(target=self._beat, name="splitft-heartbeat", daemon=True)
            self._beats.start()

    def _beat(self) -> None:
        """Ping the cloud when the session has been idle for a heartbeat interval."""
        while not self._stop.wait(self.heartbeat / 2):
            if time.monotonic() - self._last_io < self.heartbeat or not self._lock.acquire(blocking=False):
                continue
            try:
                if self.closed:
                    return
                with translated():
                    self.connection.send(protocol.encode(Ping()))
                    while True:  # anything but a pong here is stale
                        reply = protocol.decode(self.connection.recv(min(self.timeout, 3 * self.heartbeat)))
                        if isinstance(reply, Pong):
                            break
                        if isinstance(reply, Error) and reply.code == "session":
                            raise SessionLost(reply.message)
            except (TransportError, SplitFTError) as exc:
                log.warning("heartbeat: the cloud did not answer (%s); the next request reconnects", exc)
                self._suspect = exc
            finally:
                self._last_io = time.monotonic()
                self._lock.release()

    # ------------------------------------------------------------ opening

    def open(self, hello: Hello, resume: dict | None = None) -> Welcome:
        """Open the session (or, with ``resume`` from an edge checkpoint, continue one)."""
        with self._lock:
            self._hello = hello
            if resume is not None:
                self.session_id, self.token = resume["session"], resume["token"]
                self._seq, self.step, self.optimizer_id = resume["seq"], resume["step"], resume["optimizer_id"]
                with translated():
                    welcome = self._resume_handshake(self.timeout)
                if welcome.seq != self._seq or welcome.steps != self.step:
                    raise HandshakeError(f"the cloud resumed session {welcome.session} at request {welcome.seq} "
                                         f"(step {welcome.steps}), but this edge checkpoint is at request "
                                         f"{self._seq} (step {self.step})")
            else:
                welcome, wire_in = self._exchange(hello, "control", Welcome)
                self.metrics.count("down", "control", wire=wire_in)
                self._welcomed(welcome)
            self._start_heartbeat()
            return welcome

    def queue(self, op: dict) -> None:
        """An operation for the cloud to apply before the next message it handles."""
        self._ops.append(op)

    def _take_ops(self) -> list[dict]:
        ops, self._ops = self._ops, []
        return ops

    # ------------------------------------------------------------ remote calls

    def run_forward(self, call: _Call, leaves: list[torch.Tensor], needs_grad: list[bool]) -> list[torch.Tensor]:
        with self._lock:
            call.id = next(self._calls)
            ctx = CodecContext("activation", train=call.train, step=self.step, sample_ids=call.sample_ids)
            args_skel, kwargs_skel, target_skel = call.skeleton
            traffic = Traffic()
            grads = [bool(g) and call.grad for g in needs_grad]
            with self.metrics.timed("encode"):
                entries, call.sent = self.codecs.encode(leaves, stream_index(args_skel), "fwd", ctx, grads, traffic)
            call.in_grad = grads
            msg = Forward(call=call.id, train=call.train, grad=call.grad, args=to_wire(args_skel, entries),
                          kwargs=to_wire(kwargs_skel, entries), target=to_wire(target_skel, entries),
                          ops=self._take_ops(), step=self.step, sample_ids=call.sample_ids)
            reply, wire_in = self._exchange(msg, "activation", Output, traffic)
            out_entries, call.out_skeleton = from_wire(reply.value)
            stream = stream_index(call.out_skeleton) if self.ushape else None
            with self.metrics.timed("decode"):
                tensors, call.received = self.codecs.decode(out_entries, stream, "ret", ctx)
            call.out_grad = [g and call.grad for _, g in out_entries]
            self.metrics.count("down", "activation", raw=sum(t.numel() * t.element_size() for t in tensors),
                               payload=sum(c.payload.nbytes for c in call.received), wire=wire_in)
            return tensors

    def run_backward(self, call: _Call, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        with self._lock:
            ctx = CodecContext("gradient", train=True, step=self.step, sample_ids=call.sample_ids)
            traffic = Traffic()
            entries: list[dict | None] = []
            with self.metrics.timed("encode"):
                for coded, grad, needed in zip(call.received, grads, call.out_grad):
                    if not needed:
                        entries.append(None)
                        continue
                    if grad is None:
                        grad = torch.zeros(coded.shape, dtype=coded.dtype)
                    grad = self.codecs.grad_for_sender(grad, coded, "ret", ctx)
                    (entry,), _ = self.codecs.encode([grad], 0 if coded.stream else None, "ret_bwd", ctx,
                                                     [False], traffic)
                    entries.append(entry)
            msg = Backward(call=call.id, grads=entries, ops=self._take_ops())
            reply, wire_in = self._exchange(msg, "gradient", InputGrads, traffic)
            got, skeleton = from_wire(reply.grads)
            if not isinstance(skeleton, list) or len(skeleton) != len(call.sent):
                raise ProtocolError(f"cloud sent {len(skeleton) if isinstance(skeleton, list) else '?'} input "
                                    f"gradients for a call with {len(call.sent)} inputs")
            result: list[torch.Tensor | None] = []
            raw = 0
            with self.metrics.timed("decode"):
                for coded, slot, needed in zip(call.sent, skeleton, call.in_grad):
                    if not needed or slot is None:
                        result.append(None)
                        continue
                    entry = got[slot.index]
                    (grad,), _ = self.codecs.decode([entry], 0 if coded.stream else None, "bwd", ctx)
                    raw += grad.numel() * grad.element_size()
                    result.append(self.codecs.grad_at_input(grad, coded, "fwd", ctx))
            self.metrics.count("down", "gradient", raw=raw, payload=sum(p.nbytes for p, _ in got), wire=wire_in)
            return result

    # ------------------------------------------------------------ control

    def sync(self, want_state: bool = False, checkpoint: bool = False,
             pin: bool = False) -> dict[str, np.ndarray] | None:
        """Apply pending operations in the cloud now; optionally fetch the cloud part's weights.

        ``checkpoint`` makes the cloud write a checkpoint right after these operations (``pin``:
        one it keeps until the next pinned one, to match an edge checkpoint).
        """
        with self._lock:
            msg = Sync(ops=self._take_ops(), want_state=want_state, checkpoint=checkpoint or pin, pin=pin)
            reply, wire_in = self._exchange(msg, "control", Ack)
            self.metrics.count("down", "control", wire=wire_in)
            return reply.state

    def close(self, reason: str = "done") -> None:
        """Say goodbye (flushing pending operations) and release the connection. Idempotent."""
        with self._lock:
            if self.closed:
                return
            try:
                if self._ops and self._reconnect is not None and reason == "done":
                    # A step that only rode on the goodbye would not survive a lost goodbye. (After
                    # an error or Ctrl-C, do not spend another reconnect_timeout on it.)
                    self.sync()
                self._seq += 1
                frames = protocol.encode(Bye(reason=reason, ops=self._take_ops(), seq=self._seq))
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
        self._stop.set()
        self.connection.close()


class _RemoteCall(torch.autograd.Function):
    """The cut. Inputs: the call's tensors (and an anchor that keeps the cloud part trainable)."""

    @staticmethod
    def forward(ctx: Any, session: EdgeSession, call: _Call, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(inputs[: call.n_leaves])
        outputs = session.run_forward(call, leaves, list(ctx.needs_input_grad[2: 2 + call.n_leaves]))
        ctx.session, ctx.call = session, call
        ctx.mark_non_differentiable(*[t for t, g in zip(outputs, call.out_grad) if not g])
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
        self._optimizer: torch.optim.Optimizer | None = None
        self._resume_optimizer: dict | None = None  # optimizer state from an edge checkpoint

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
        if self._resume_optimizer is not None:
            optimizer.load_state_dict(self._resume_optimizer)
            self._resume_optimizer = None
            op_id = self.session.optimizer_id  # the cloud restored its optimizer: this attach is a no-op there
        else:
            self.session.optimizer_id += 1
            op_id = self.session.optimizer_id
        self.session.queue({"op": "optimizer", "id": op_id, "name": cls.__name__, "settings": settings})
        self._optimizer = optimizer
        optimizer.register_step_post_hook(lambda opt, args, kwargs: self._stepped(opt))
        original = optimizer.zero_grad

        def zero_grad(set_to_none: bool = True) -> None:
            original(set_to_none)
            self.session.queue({"op": "zero_grad", "set_to_none": bool(set_to_none)})

        optimizer.zero_grad = zero_grad  # type: ignore[method-assign]
        return optimizer

    def _stepped(self, optimizer: torch.optim.Optimizer) -> None:
        lr = optimizer.param_groups[0].get("lr")
        self.session.step += 1  # the step's id: the cloud applies step n once, however often it arrives
        self.session.queue({"op": "step", "id": self.session.step,
                            "lr": float(lr) if isinstance(lr, (int, float)) else None})
        if self.session.shared:
            # Other edges train the same cloud half: apply the step now, not with this edge's next
            # message, so it lands between the other edges' steps where the user's loop put it.
            self.session.sync()
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
        return RemoteLoss(self)

    # ------------------------------------------------------------ cloud state

    def sync(self) -> None:
        """Make the cloud apply every pending step now (they otherwise ride on the next message)."""
        self.session.sync()

    def cloud_state_dict(self) -> dict[str, torch.Tensor]:
        """The cloud part's current weights, named as in the original model."""
        state = self.session.sync(want_state=True) or {}
        return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Checkpoint both halves at this step boundary (call it after ``opt.step()``).

        The cloud writes its half (it must run with ``--checkpoint-dir``) and the edge writes
        ``PATH.json`` + ``PATH-<hash>.safetensors``: the edge part's weights, the attached
        optimizer's state, the codec state, the step id and the session's resume token (keep the
        files private: the token resumes the session). ``split(..., resume_from=PATH)`` continues
        from here.
        """
        session = self.session
        with session._lock:
            if session.checkpoint_every <= 0:
                raise CheckpointError("the cloud keeps no checkpoints, so this one could not be resumed; "
                                      "start the cloud with --checkpoint-dir")
            session.sync(pin=True)
            # The cloud's checkpoint holds the state after that sync's operations, numbered one below
            # it; a resumed edge continues from that number, re-using the sync's.
            tree = {"weights": self.model.state_dict(),
                    "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
                    "codecs": session.codecs.state_dict()}
            meta = {"kind": "edge", "session": session.session_id, "token": session.token, "seq": session._seq - 1,
                    "step": session.step, "optimizer_id": session.optimizer_id,
                    "hello": {k: getattr(session._hello, k) for k in ("factory", "factory_kwargs", "cut", "rejoin",
                                                                      "fingerprint", "codecs", "seed")}}
            write_checkpoint(path, tree, meta)

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
          connect: str | None = None,
          connection: transports.Connection | Callable[[], transports.Connection] | None = None,
          fwd: str = "identity", bwd: str | None = None, ret: str | None = None, ret_bwd: str | None = None,
          seed: int = 0, weights: str = "push", timeout: float = 60.0,
          metrics_path: str | None = None, cloud_key: str | os.PathLike | bytes | None = None,
          key: str | os.PathLike | bytes | None = None, reconnect_timeout: float = 60.0,
          heartbeat: float = 10.0, resume_from: str | os.PathLike | None = None) -> SplitModel:
    """Cut ``model`` and connect its cloud part; returns the edge's model to train.

    Args:
        model: the full model, built on the edge. Its cloud modules are replaced by stand-ins.
        cut: the first module that runs in the cloud (dotted name or Sequential index), or a
            slice ``"parent.i:j"`` of a container's children (U-shape).
        rejoin: for U-shape, the sibling of ``cut`` where the edge takes over again.
        factory: ``"package.module:function"`` that builds the same model in the cloud; the
            cloud must list it as allowed.
        connect / connection: the cloud's address (``tcp://host:port``, ``ipc://path``), or an
            open transport connection, or a function that opens one (then the edge can reconnect
            after a fault; with an open connection it cannot).
        fwd, bwd, ret, ret_bwd: codec specs per direction (see :mod:`splitft.coding`).
        seed: shared seed for codec randomness (keys, projections).
        weights: ``"push"`` sends the cloud part's initial weights in the handshake;
            ``"factory"`` has the cloud use its own and checks that they are equal.
        cloud_key, key: CurveZMQ: the cloud's public key and this edge's secret key (key files
            from ``splitft keys``, or Z85 bytes). The link is then encrypted and the cloud admits
            the edge only if its public key is on the cloud's allow-list.
        timeout: seconds to wait for any one reply before treating the link as failed.
        reconnect_timeout: seconds to keep trying to get the session back after a fault.
        heartbeat: seconds of idleness after which the edge pings the cloud, keeping its session
            alive (0: never).
        resume_from: an edge checkpoint written by :meth:`SplitModel.save_checkpoint`: load the
            edge's half from it and continue the session where both halves were saved.
    """
    if weights not in ("push", "factory"):
        raise ConfigError(f"weights must be 'push' or 'factory', got {weights!r}")
    if (connect is None) == (connection is None):
        raise ConfigError("give exactly one of connect='tcp://host:port' or connection=<transport>")
    if (cloud_key is None) != (key is None):
        raise ConfigError("an encrypted link needs both cloud_key (the cloud's public key) and key (this "
                          "edge's secret key)")
    spec = parse_cut(model, cut, rejoin)
    cut_name, rejoin_name = cut_text(spec, model)
    chain = extract(model, spec)
    codecs = resolve_codecs(fwd, bwd, ret, ret_bwd)
    resume = _read_edge_checkpoint(resume_from) if resume_from is not None else None
    hello = Hello(
        protocol=protocol.PROTOCOL_VERSION, factory=factory, factory_kwargs=dict(factory_kwargs or {}),
        cut=cut_name, rejoin=rejoin_name, fingerprint=fingerprint(chain), codecs=codecs, seed=int(seed),
        value_hash=value_hash(chain) if weights == "factory" and resume is None else None,
        weights={k: v.detach().cpu().numpy() for k, v in chain.qualified_state_dict().items()}
        if weights == "push" and resume is None else None,
        client="splitft", nonce=secrets.token_hex(8),
    )
    if resume is not None:
        identity = {k: getattr(hello, k) for k in resume[1]["hello"]}
        if resume[1]["hello"] != json.loads(json.dumps(identity)):
            raise ConfigError(f"the edge checkpoint {resume_from} was written for a different model, cut, codecs or "
                              "seed than this split() asks for")
    reconnect: Callable[[], transports.Connection] | None
    if connect is not None:
        options = _curve_options(cloud_key, key)
        address = connect

        def reconnect() -> transports.Connection:
            return transports.connect(address, **options)
        with translated():
            connection = reconnect()
    elif callable(connection) and not isinstance(connection, transports.Connection):
        reconnect = connection
        connection = reconnect()
    else:
        reconnect = None
    session = EdgeSession(connection, codecs=codecs, seed=seed, ushape=spec.ushape, timeout=timeout,
                          reconnect=reconnect, reconnect_timeout=reconnect_timeout, heartbeat=heartbeat)
    try:
        if resume is not None:
            session.codecs.load_state_dict(resume[0]["codecs"])
        session.open(hello, resume=resume[1] if resume is not None else None)
    except BaseException:
        session._drop()
        raise
    split_model = SplitModel(model, spec, session, metrics_path=metrics_path)
    install(model, spec, remote=split_model._trunk if spec.ushape else None)
    if resume is not None:
        try:
            model.load_state_dict(resume[0]["weights"])
        except RuntimeError as exc:
            session.close("error")
            raise CheckpointError(f"the edge checkpoint {resume_from} does not fit this model: {exc}") from exc
        split_model._resume_optimizer = resume[0]["optimizer"]
    return split_model


def _curve_options(cloud_key: str | os.PathLike | bytes | None, key: str | os.PathLike | bytes | None) -> dict:
    if cloud_key is None:
        return {}
    with translated():
        public, secret = transports.load_secret_key(key)
        return {"server_key": transports.load_public_key(cloud_key), "public_key": public, "secret_key": secret}


def _read_edge_checkpoint(path: str | os.PathLike) -> tuple[dict, dict]:
    tree, meta = read_checkpoint(path)
    needed = ("session", "token", "seq", "step", "optimizer_id", "hello")
    if meta.get("kind") != "edge" or any(k not in meta for k in needed):
        raise CheckpointError(f"{path} is not an edge checkpoint (write one with model.save_checkpoint(path))")
    return tree, meta
