"""The cloud part as one stage of a pipeline: what crosses the cut is encoded, sent, received and decoded here.

The :class:`~splitft.edge.schedule.Scheduler` decides which part goes when; this stage turns one
part's tensors into a ``forward`` or ``backward`` message through its codecs, and the cloud's
replies back into tensors, counting every byte. It owns what coding needs for the session's life:
the codec instances (whose state both ends keep in step) and the optimizer step count their
contexts carry; the request layer below only moves the messages (:class:`Requests`).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np
import torch

from compressors import CodecContext

from ..errors import ConfigError, DesyncError, ModelError, ProtocolError
from ..generator_state import checked_host_state, host_state
from ..metrics import Metrics
from ..wire.coding import SlotCodecs, Traffic, from_wire, raw_nbytes, stream_index, to_wire
from ..wire.operations import Operation
from ..wire.protocol import Backward, Forward, InputGrads, Message, Output
from . import generator_sets
from .requests import Expect, Reply
from .schedule import Call, Part, backward_pass

log = logging.getLogger(__name__)


class Requests(Protocol):
    """The reliable request layer (:class:`~splitft.edge.requests.EdgeSession`)."""

    metrics: Metrics
    checkpoint_every: int  # the cloud checkpoints sessions (> 0): backward as a request of its own

    def send(self, msg: Message, kind: str, traffic: Traffic | None = None) -> int: ...
    def await_reply(self, seq: int, expect: Expect, timer: str = "wait") -> Reply: ...
    def exchange(self, msg: Message, kind: str, expect: Expect, traffic: Traffic | None = None,
                 timer: str = "wait") -> Reply: ...
    def borrowing(self) -> AbstractContextManager[None]: ...


class CloudStage:
    """One part's messages to the cloud and back, through ``codecs``.

    Args:
        requests: sends the messages and awaits their replies.
        codecs: this end's codec instances (built from the specs the hello names).
        ushape: the trunk's output comes back to the edge (``ret`` codecs), and its gradient goes up.
        step: the optimizer steps taken so far (a resumed session's).
    """

    def __init__(self, requests: Requests, codecs: SlotCodecs, *, ushape: bool, step: int = 0) -> None:
        self.requests = requests
        self.codecs = codecs
        self.metrics = requests.metrics
        self.ushape = ushape
        #: Optimizer steps taken: the id of the latest step (the cloud applies each once), in every codec context.
        self.step = step
        #: The host generator state the cloud half's stream is at, as far as this edge knows (None: not known).
        self._rng_synced: torch.Tensor | None = None
        #: Whether the half's forward draws random numbers, learnt per (training?, modules in the other mode).
        self._cloud_draws: dict[tuple[bool, tuple[str, ...]], bool] = {}
        #: :func:`.generator_sets.count` when the half ran out of memory mid-forward: the draws it
        #: made before are lost to the edge's generator, until the script sets it (None: none lost).
        self._draws_lost: int | None = None

    def check(self, call: Call) -> None:
        """Refuse a training call without sample ids when a codec keeps state per sample."""
        if not call.train or call.sample_ids is not None:
            return
        for slot in ("fwd", "ret") if self.ushape else ("fwd",):
            codec = self.codecs.slots[slot]
            if codec.needs_sample_ids:
                raise ConfigError(
                    f"codec {codec.name!r} keeps state per training sample: pass a stable id for "
                    "each sample, model(x, sample_ids=ids) (ids in 0..N-1, the same every epoch)"
                )

    def can_eager(self) -> bool:
        # A cloud that checkpoints sessions gets the backward as a request of its own: after a
        # restart, a replayed request can rebuild a graph, but not eager gradients lost in memory.
        return self.requests.checkpoint_every <= 0

    # ------------------------------------------------------------ forward

    def borrowing(self) -> AbstractContextManager[None]:
        """A scope whose requests have their replies read before the script runs again: their
        frames are logged for a replay without a copy (:meth:`EdgeSession.borrowing`)."""
        return self.requests.borrowing()

    def _context(self, call: Call, part: Part, resync: bool = False) -> CodecContext:
        """The activation context; what comes back is decoded where the call's tensors live."""
        device = next((c.device for c in part.sent if c.dtype.is_floating_point), None) if part.sent else None
        return CodecContext("activation", train=call.train, step=self.step, sample_ids=part.sample_ids,
                            resync=resync, device=device)

    def _forward_message(self, call: Call, part: Part, leaves: list[torch.Tensor], ops: list[Operation],
                         ctx: CodecContext) -> tuple[Forward, Traffic]:
        args_skel, kwargs_skel, target_skel = call.skeleton
        traffic = Traffic()
        with self.metrics.timed("encode"):
            entries, part.sent = self.codecs.encode(leaves, stream_index(args_skel), "fwd", ctx, call.in_grad, traffic)
        sent: set[int] = set()  # a tensor in several places crosses once
        msg = Forward(call=part.id, train=call.train, grad=call.grad, args=to_wire(args_skel, entries, sent),
                      kwargs=to_wire(kwargs_skel, entries, sent), target=to_wire(target_skel, entries, sent), ops=ops,
                      step=self.step, sample_ids=part.sample_ids, eager=call.eager, autocast=call.autocast,
                      rng=self._rng_to_send(call), again=call.again is not None)
        part.rng_sent = msg.rng is not None
        return msg, traffic

    def _rng_to_send(self, call: Call) -> np.ndarray | None:
        """The host generator's state, when it changed since the cloud half's stream was at it (the
        edge drew, the script seeded): if the half draws, its dropout then draws on from where the
        edge's left off, as in the unsplit model (:mod:`splitft.cloud.randomness`). Also where its
        forwards in these modes drew nothing so far: whether a layer draws can depend on the data
        (noise added to the rows a mask selects, a label dropped only when labels are given)."""
        draws = self._cloud_draws.get((call.train, call.modes))
        if draws and self._draws_lost is not None and generator_sets.count() == self._draws_lost:
            raise ConfigError(DRAWS_LOST)  # before the half runs; not known yet whether it draws: at its reply
        if call.again is not None:  # the first loss's start, whatever the stream is at now (it stays there)
            return call.again.numpy()
        start = call.drawn_since if call.drawn_since is not None else call.generator_kept
        if start is not None:  # unsplit, the half drew from there (see _follow_cloud_rng)
            self._rng_synced = None
            return start.numpy()
        state = host_state()
        if self._rng_synced is not None and torch.equal(state, self._rng_synced):
            return None
        self._rng_synced = state
        return state.numpy()

    def flags_changed(self) -> None:
        """A setting a cloud module's code reads changed (a dropout's ``p`` set to 0, or back): what
        the half draws is learnt again (the modes a forward runs in are part of what it is learnt by)."""
        self._cloud_draws.clear()

    def draws(self, train: bool, modes: tuple[str, ...]) -> bool | None:
        """Whether the cloud half's forward draws random numbers in these modes (None: not known yet)."""
        return self._cloud_draws.get((train, modes))

    def draws_in_training(self) -> bool | None:
        """Whether the cloud half drew random numbers in its training-mode forwards (None: none yet)."""
        seen = [drew for (train, _), drew in self._cloud_draws.items() if train]
        return any(seen) if seen else None

    def _finish_interrupted(self, call: Call, part: Part) -> None:
        """Ctrl-C while the cloud ran the half: unsplit, it would have landed after the half's
        draws and statistics, which the cloud has made, so the edge reads the reply (its
        generator's state) before it stops. A second Ctrl-C stops at once."""
        try:
            reply, _ = self.requests.await_reply(part.seq, Output)
        except Exception:  # noqa: BLE001 — the interrupt is what the script sees
            return
        if isinstance(reply, Output):
            self._follow_cloud_rng(call, part, reply)

    def _follow_cloud_rng(self, call: Call, part: Part, reply: Output) -> None:
        """Learn whether the half draws in these modes; when it drew, the edge's generator goes on
        from the state it left, as the unsplit model's next draw would (not for a streamed step,
        whose reply comes after the script ran on)."""
        if self._draws_lost is not None:
            if reply.rng is not None and generator_sets.count() == self._draws_lost:
                raise ConfigError(DRAWS_LOST)
            self._draws_lost = None
        if call.again is not None:
            return  # a repeated forward: the half's stream and the edge's stay where the first left them
        key = (call.train, call.modes)
        if reply.rng is not None or part.rng_sent:  # it drew, or had the chance to
            self._cloud_draws[key] = reply.rng is not None or self._cloud_draws.get(key, False)
        if reply.rng is not None and call.drawn_since is not None:
            raise ConfigError(DRAWN_BETWEEN)
        if reply.rng is None or call.streamed:
            return
        state = checked_host_state(reply.rng, "output.rng")
        if call.generator_kept is None:
            torch.default_generator.set_state(state)  # not torch.set_rng_state: the script's own sets are counted
        self._rng_synced = state  # the half's stream; the edge's state is sent again when it differs

    def _follow_failed(self, call: Call, rng: Any) -> None:
        """A forward that failed in the cloud (out of memory, an error the script catches) after its
        half drew: unsplit, those draws moved the generator, and it goes on from where they left it.
        Where the script's generator is not the stream's to follow (it drew or set it since the
        call's ``model(x)``, or a stream ran on, or other micro-batches of the call ran after this
        one), those draws are lost: the next forward that draws is refused until the script sets
        the generator."""
        state = checked_host_state(rng, "error.rng")
        if call.again is not None or call.drawn_since is not None or call.streamed or len(call.parts) > 1:
            self._draws_lost = generator_sets.count()
            return
        if call.generator_kept is None:
            torch.default_generator.set_state(state)
        self._rng_synced = state

    def send_forward(self, call: Call, part: Part, leaves: list[torch.Tensor], ops: list[Operation]) -> None:
        msg, traffic = self._forward_message(call, part, leaves, ops, self._context(call, part))
        part.seq = self.requests.send(msg, "activation", traffic)

    def receive_output(self, call: Call, part: Part, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
        """The part's outputs, decoded; the cut's gradient too, when it came along (eager backward)."""
        ctx = self._context(call, part)
        try:
            try:
                reply, wire_in = self.requests.await_reply(part.seq, Output)
            except KeyboardInterrupt:
                self._finish_interrupted(call, part)
                raise
            except DesyncError as exc:
                # A desync of stateful codecs (a lost or repeated message) is repaired once, by
                # sending the same rows again at full precision, which resets both ends' state.
                log.warning("codec state out of step with the cloud (%s); resending at full precision", exc)
                ctx = self._context(call, part, resync=True)
                self._rng_synced = None  # refused before the half ran: the state goes again
                msg, traffic = self._forward_message(call, part, leaves, [], ctx)
                reply, wire_in = self.requests.exchange(msg, "activation", Output, traffic)
        except BaseException as exc:
            self._rng_synced = None  # whether the cloud's stream took the state sent is not known
            if isinstance(exc, ModelError) and exc.rng is not None:
                self._follow_failed(call, exc.rng)
            raise
        assert isinstance(reply, Output)
        self._follow_cloud_rng(call, part, reply)
        out_entries, skeleton = from_wire(reply.value)
        if call.out_skeleton is None:
            call.out_skeleton = skeleton
        elif skeleton != call.out_skeleton:
            raise ProtocolError("micro-batches of one call came back with different output structures")
        with self.metrics.timed("decode"):
            tensors, part.received = self.codecs.decode(out_entries, stream_index(skeleton) if self.ushape else None,
                                                        "ret", ctx)
        part.out_grad = [g and call.grad for _, g in out_entries]
        grad_bytes = 0
        if reply.grads is not None:  # eager backward: the cut's gradient came along
            call.reported_unreached(reply.unreached)
            part.eager_grads = from_wire(reply.grads)
            grad_bytes = sum(p.nbytes for p, _ in part.eager_grads[0])
            self.metrics.count("down", "gradient", raw=self._input_grad_nbytes(call, part), payload=grad_bytes,
                               wire=grad_bytes, messages=0)
        self.metrics.count("down", "activation", raw=sum(t.numel() * t.element_size() for t in tensors),
                           payload=sum(c.payload.nbytes for c in part.received), wire=wire_in - grad_bytes)
        return tensors

    # ------------------------------------------------------------ backward

    def send_backward(self, call: Call, part: Part, grads: list[torch.Tensor | None],
                      ops: list[Operation], params: bool = True) -> None:
        ctx = CodecContext("gradient", train=True, step=self.step, sample_ids=part.sample_ids)
        traffic = Traffic()
        entries: list[dict | None] = []
        with self.metrics.timed("encode"):
            for coded, grad in zip(part.received, grads):
                if grad is None:
                    entries.append(None)
                    continue
                grad = self.codecs.grad_for_sender(grad, coded, "ret", ctx)
                (entry,), _ = self.codecs.encode([grad], 0 if coded.stream else None, "ret_bwd", ctx, [False],
                                                 traffic, raw=[raw_nbytes(coded.shape, coded.dtype)])
                entries.append(entry)
        part.seq = self.requests.send(Backward(call=part.id, grads=entries, ops=ops, params=params,
                                               pass_id=backward_pass()), "gradient", traffic)

    def receive_input_grads(self, call: Call, part: Part) -> list[torch.Tensor | None]:
        reply, wire_in = self.requests.await_reply(part.seq, InputGrads)
        assert isinstance(reply, InputGrads)
        call.reported_unreached(reply.unreached)
        got, skeleton = from_wire(reply.grads)
        result = self._decode_input_grads(call, part, (got, skeleton))
        self.metrics.count("down", "gradient", raw=self._input_grad_nbytes(call, part),
                           payload=sum(p.nbytes for p, _ in got), wire=wire_in)
        return result

    def eager_input_grads(self, call: Call, part: Part, scale: torch.Tensor) -> list[torch.Tensor | None]:
        assert part.eager_grads is not None
        return self._decode_input_grads(call, part, part.eager_grads, scale=scale)

    @staticmethod
    def _input_grad_nbytes(call: Call, part: Part) -> int:
        return sum(raw_nbytes(c.shape, c.dtype) for c, g in zip(part.sent, call.in_grad) if g)

    def _decode_input_grads(self, call: Call, part: Part, parsed: tuple[list, Any],
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
                if slot is None:  # the cloud's backward did not reach it: no gradient, as unsplit
                    result.append(None)
                    continue
                (grad,), _ = self.codecs.decode([got[slot.index]], 0 if coded.stream else None, "bwd",
                                                dataclasses.replace(ctx, device=coded.device))
                grad = self.codecs.grad_at_input(grad, coded, "fwd", ctx)
                result.append(grad if scale is None or _is_one(scale) else grad * scale)
        return result


def _is_one(scale: torch.Tensor) -> bool:
    """Whether multiplying by ``scale`` changes nothing (a loss's own gradient is 1 unless a
    scaler or a weight multiplied it): a pass over the gradient saved, bit for bit the same."""
    return scale.device.type == "cpu" and scale.numel() == 1 and scale.item() == 1


#: A plain split's loss whose model(x) was followed by draws of the script, before the cloud half drew.
DRAWN_BETWEEN = (
    "the script drew random numbers between model(x) and its remote loss (another model's forward in between, a "
    "second split model's included, draws from the same generator), and the cloud half draws too (dropout): "
    "unsplit, the cloud half drew its masks at model(x), before the script's draws, which then came from further on "
    "in the generator; split, the cloud half runs at the loss, so the two would draw different numbers and training "
    "would silently differ from the unsplit model. Draw before model(x) (or after the loss), or cut a U-shape "
    "(rejoin=), whose model(x) runs the whole model")

DRAWS_LOST = (
    "the cloud half draws random numbers (dropout), and failed in a forward before this one whose draws the edge's "
    "generator cannot follow (the script drew or set the generator between its model(x) and the loss, or the call "
    "ran in micro-batches): unsplit, the draws the half made before failing moved the generator, so this forward's "
    "masks would differ from the unsplit model's. Set the generator before it (torch.manual_seed(...)), as the "
    "same script then draws the same unsplit")


__all__ = ["CloudStage", "DRAWN_BETWEEN", "DRAWS_LOST"]

