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
from .coding import (Coded, SlotCodecs, Traffic, flatten, from_wire, raw_nbytes, resolve_codecs,
                     sample_ids_array, stream_index, to_wire, unflatten)
from .errors import (AuthError, CapacityError, CheckpointError, ConfigError, DesyncError, HandshakeError,
                     PeerGone, ProtocolError, SessionLost, SplitFTError, TooLarge, TransportError,
                     TransportTimeout, from_code, translated)
from .metrics import JsonlWriter, Metrics
from .protocol import Ack, Backward, Bye, Error, Forward, Hello, InputGrads, Output, Ping, Pong, Sync, Welcome
from .resilience import Backoff, ReplayLog
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
    eager_grads: tuple | None = None  # parsed input gradients that came with the output (eager backward)
    seq: int = 0  # request number of its forward, then of its backward


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
                 micro_batches: int = 1, eager_backward: bool = True,
                 reconnect: Callable[[], transports.Connection] | None = None,
                 reconnect_timeout: float = 60.0, heartbeat: float = 10.0,
                 max_log_bytes: int = 256 * 2**20) -> None:
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
        self.token = ""
        self.checkpoint_every = 0
        self.limits: dict[str, int] = {}
        self.optimizer_id = 0
        self.shared = False  # the cloud half is shared with other edges
        self.recoveries = 0  # times the session was recovered after a fault
        self._ops: list[dict] = []
        self._calls = itertools.count(1)
        self._outstanding: set[int] = set()  # ids of requests whose reply has not been read
        self._early: dict[int, tuple[protocol.Message, int]] = {}  # replies that overtook the one awaited
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

    def _send(self, msg: protocol.Message, kind: str, traffic: Traffic | None = None) -> int:
        """Number, log and send a request without waiting; returns its number (0: not numbered).

        Several requests may be in flight (micro-batches); :meth:`_await` collects their replies.
        """
        if self.closed:
            raise PeerGone("this split session is closed; create a new one to keep training")
        sequenced = msg.NUMBERED
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
        try:
            with translated():
                wire = self.connection.send(frames)
            self.metrics.count("up", kind, raw=traffic.raw if traffic else 0,
                               payload=traffic.payload if traffic else 0, wire=wire)
        except AuthError:
            raise
        except TransportError as exc:  # a dead link: the await that follows recovers and re-sends
            if not seq or self._reconnect is None:
                raise
            self._suspect = exc
        finally:
            self._last_io = time.monotonic()
        self._outstanding.add(seq)
        return seq

    def _await(self, seq: int, expect: type, timer: str = "wait") -> tuple[protocol.Message, int]:
        """The reply to request ``seq``; errors from the cloud are raised as typed errors.

        The time blocked is added to ``timer``: "wait" for training traffic, which the report
        splits into wire and cloud time, "handshake" for the hello (the cloud builds its model).

        A link fault (timeout, dropped connection, lost session) is repaired by :meth:`_recover`
        when a reconnect function is known; the caller only sees it take longer.
        """
        try:
            if seq in self._early:
                reply, wire_in = self._early.pop(seq)
            else:
                with self.metrics.timed(timer):  # blocked on the other side: wire plus cloud work
                    if self._suspect is not None and seq and self._reconnect is not None:
                        fault, self._suspect = self._suspect, None
                        reply, wire_in = self._recover(seq, fault)
                    else:
                        try:
                            reply, wire_in = self._receive_guarded(seq)
                        except _LinkFault as fault:
                            if not seq or self._reconnect is None:
                                raise fault.cause from None
                            reply, wire_in = self._recover(seq, fault.cause)
        finally:
            self._outstanding.discard(seq)
            self._last_io = time.monotonic()
        if isinstance(reply, Error):
            self.metrics.count("down", "control", wire=wire_in)
            if seq and reply.seq == 0 and seq == self._seq and not self._outstanding:
                self._log.drop(seq)  # the cloud could not even read the request: nothing was applied
                self._seq -= 1
            raise from_code(reply.code, f"cloud: {reply.message}")
        if isinstance(reply, Bye):
            self.metrics.count("down", "control", wire=wire_in)
            self._drop()
            raise PeerGone(f"the cloud ended the session: {reply.reason or 'no reason given'}")
        if not isinstance(reply, expect):
            raise ProtocolError(f"expected a {expect.TYPE} reply, got {reply.TYPE}")
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

    def _exchange(self, msg: protocol.Message, kind: str, expect: type,
                  traffic: Traffic | None = None, timer: str = "wait") -> tuple[protocol.Message, int]:
        """Send ``msg`` and wait for its reply."""
        return self._await(self._send(msg, kind, traffic), expect, timer)

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

    def _receive_guarded(self, seq: int) -> tuple[protocol.Message, int]:
        """Wait for the reply to ``seq``; link faults come out as :class:`_LinkFault`."""
        try:
            with translated():
                return self._receive(seq, self.timeout)
        except AuthError:
            raise
        except TransportTimeout as exc:
            raise _LinkFault(TransportTimeout(
                f"no reply from the cloud at {getattr(self.connection, 'address', '?')} within "
                f"{self.timeout:g} s (is `splitft cloud` running there? a slow model may need a larger timeout)"
            )) from exc
        except (TransportError, SessionLost) as exc:
            raise _LinkFault(exc) from exc

    def _receive(self, seq: int, timeout: float) -> tuple[protocol.Message, int]:
        """Read replies until the one to request ``seq``; replies to other requests still in
        flight are kept for their own awaits, stale ones dropped."""
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
                if reply_seq in self._outstanding and reply_seq not in self._early:
                    self._early[reply_seq] = (reply, wire_in)
                else:
                    log.info("dropping a stale reply to request %s (waiting for %s)", reply_seq, seq)
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
        reply, wire_in = self._receive(0, timeout)
        self.metrics.count("down", "control", wire=wire_in)
        if isinstance(reply, Error):
            raise from_code(reply.code, f"cloud: {reply.message}")
        if not isinstance(reply, Welcome) or reply.session != self.session_id:
            raise HandshakeError(f"expected a welcome back to session {self.session_id}, got {reply.TYPE}")
        self._welcomed(reply)
        return reply

    def _replay(self, cloud_seq: int, seq: int) -> tuple[protocol.Message, int]:
        """Re-send what the cloud lost, and what is still awaited; the reply to ``seq`` is the result.

        Requests after ``cloud_seq`` are applied again in order; awaited ones the cloud already
        applied (only their replies were lost) are answered from its reply cache. Replies to the
        other requests in flight are kept for their own awaits.
        """
        awaited = sorted(self._outstanding | {seq})
        top = max(awaited)
        resend = [(s, f) for s, f in self._log.after(cloud_seq) if s <= top]
        if cloud_seq < top and (not resend or resend[0][0] != cloud_seq + 1):
            raise HandshakeError(f"cannot replay: the cloud is at request {cloud_seq} but this edge kept requests "
                                 f"from {self._log.first} on")
        cached = [(s, self._log.get(s)) for s in awaited if s <= cloud_seq]
        for s, frames in cached + resend:
            if frames is None:
                raise HandshakeError(f"cannot replay request {s}: this edge no longer keeps it")
            self.metrics.count("up", "control", wire=self.connection.send(frames))
        self._early.clear()
        result = None
        for s in awaited:
            reply = self._receive(s, self.timeout)
            if s == seq:
                result = reply
            else:
                self._early[s] = reply
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
                welcome, wire_in = self._exchange(hello, "control", Welcome, timer="handshake")
                self.metrics.count("down", "control", wire=wire_in)
                self._welcomed(welcome)
            self._start_heartbeat()
            return welcome

    def queue(self, op: dict) -> None:
        """An operation for the cloud to apply before the next message it handles."""
        self._ops.append(op)
        most = self.limits.get("max_ops")
        if isinstance(most, int) and len(self._ops) >= most:
            self.sync()  # the cloud applies at most that many per message: send them now

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
        # A cloud that checkpoints sessions gets the backward as a request of its own: after a
        # restart, a replayed request can rebuild a graph, but not eager gradients lost in memory.
        eager = (self.eager_backward and self.checkpoint_every <= 0 and call.grad and target_skel is not None
                 and not self.ushape)
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
                part.seq = self._send(msg, "activation", traffic)
                call.parts.append(part)
                pending.append((part, part_leaves, ctx))
            outputs = []
            for part, part_leaves, ctx in pending:
                try:
                    reply, wire_in = self._await(part.seq, Output)
                except DesyncError as exc:
                    # A desync of stateful codecs (a lost or repeated message) is repaired once, by
                    # sending the same rows again at full precision, which resets both ends' state.
                    log.warning("codec state out of step with the cloud (%s); resending at full precision", exc)
                    msg, traffic, ctx = self._forward_message(call, part, part_leaves, [], True)
                    reply, wire_in = self._exchange(msg, "activation", Output, traffic)
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
                    part.eager_grads = from_wire(reply.grads)
                    grad_bytes = sum(p.nbytes for p, _ in part.eager_grads[0])
                    self.metrics.count("down", "gradient", raw=sum(
                        raw_nbytes(c.shape, c.dtype) for c, g in zip(part.sent, call.in_grad) if g),
                        payload=grad_bytes, wire=grad_bytes, messages=0)
                self.metrics.count("down", "activation", raw=sum(t.numel() * t.element_size() for t in tensors),
                                   payload=sum(c.payload.nbytes for c in part.received), wire=wire_in - grad_bytes)
                outputs.append(tensors)
            return self._join_outputs(call, outputs)

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
                part.seq = self._send(Backward(call=part.id, grads=entries, ops=[] if sent_ops else ops),
                                      "gradient", traffic)
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
        reply, wire_in = self._await(part.seq, InputGrads)
        got, skeleton = from_wire(reply.grads)
        result = self._decode_input_grads(call, part, (got, skeleton))
        self.metrics.count("down", "gradient", raw=sum(raw_nbytes(c.shape, c.dtype)
                                                       for c, g in zip(part.sent, call.in_grad) if g),
                           payload=sum(p.nbytes for p, _ in got), wire=wire_in)
        return result

    def _decode_input_grads(self, call: _Call, part: _Part, parsed: tuple[list, Any],
                            scale: torch.Tensor | None = None) -> list[torch.Tensor | None]:
        """Gradients of a part's inputs from parsed wire entries (times ``scale`` for an eager call)."""
        ctx = CodecContext("gradient", train=True, step=self.step, sample_ids=part.sample_ids)
        got, skeleton = parsed
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
                 metrics_path: str | None = None, freeze_edge: bool = False) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.session = session
        self.freeze_edge = bool(freeze_edge)
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
        if self.freeze_edge:  # no input needs a gradient, so none crosses back
            leaves = [t.detach() for t in leaves]
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
        # Only what the constructor takes: AdamW keeps a 'decoupled_weight_decay' default that its
        # __init__ does not accept, so mirroring every default would fail in the cloud.
        accepted = inspect.signature(cls).parameters
        takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
        settings = {k: _plain(v) for k, v in optimizer.defaults.items()
                    if (takes_any or k in accepted) and _plain(v) is not _NOT_PLAIN}
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
          seed: int = 0, weights: str = "push", timeout: float = 60.0, micro_batches: int = 1,
          link: str | None = None, eager_backward: bool = True, metrics_path: str | None = None,
          cloud_key: str | os.PathLike | bytes | None = None,
          key: str | os.PathLike | bytes | None = None, reconnect_timeout: float = 60.0,
          heartbeat: float = 10.0, resume_from: str | os.PathLike | None = None,
          freeze_edge: bool = False, check_cut: bool = True) -> SplitModel:
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
            Not used when the cloud checkpoints sessions (``--checkpoint-dir``) or shares its
            half between edges.
        cloud_key, key: CurveZMQ: the cloud's public key and this edge's secret key (key files
            from ``splitft keys``, or Z85 bytes). The link is then encrypted and the cloud admits
            the edge only if its public key is on the cloud's allow-list.
        timeout: seconds to wait for any one reply before treating the link as failed.
        reconnect_timeout: seconds to keep trying to get the session back after a fault.
        heartbeat: seconds of idleness after which the edge pings the cloud, keeping its session
            alive (0: never).
        resume_from: an edge checkpoint written by :meth:`SplitModel.save_checkpoint`: load the
            edge's half from it and continue the session where both halves were saved.
        freeze_edge: SFT's eliminated link: the edge's modules before the cut get no gradient,
            so no gradient crosses from the cloud at all (a U-shape head still trains).
        check_cut: U-shape: at the first call, run the trunk once on the edge to make sure it
            reads nothing that does not cross the cut (see :mod:`splitft.audit`).
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
    try:
        link_spec = None if link is None else transports.LinkSpec.coerce(link)
    except transports.LinkSpecError as exc:
        raise ConfigError(str(exc)) from exc
    reconnect: Callable[[], transports.Connection] | None
    if connect is not None:
        options = _curve_options(cloud_key, key)
        address = connect

        def reconnect() -> transports.Connection:
            return transports.connect(address, link=link_spec, **options)
        with translated():
            connection = reconnect()
    elif callable(connection) and not isinstance(connection, transports.Connection):
        opener = connection

        def reconnect() -> transports.Connection:
            return transports.emulate(opener(), link_spec)
        connection = reconnect()
    else:
        reconnect = None
        connection = transports.emulate(connection, link_spec)
    session = EdgeSession(connection, codecs=codecs, seed=seed, ushape=spec.ushape, timeout=timeout,
                          micro_batches=micro_batches, eager_backward=eager_backward,
                          reconnect=reconnect, reconnect_timeout=reconnect_timeout, heartbeat=heartbeat)
    try:
        if resume is not None:
            session.codecs.load_state_dict(resume[0]["codecs"])
        session.open(hello, resume=resume[1] if resume is not None else None)
    except BaseException:
        session._drop()
        raise
    split_model = SplitModel(model, spec, session, metrics_path=metrics_path, freeze_edge=freeze_edge)
    install(model, spec, remote=split_model._trunk if spec.ushape else None, check=check_cut)
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
