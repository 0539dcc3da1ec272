"""The cloud runtime: one session per connected edge, serving its part of the model.

A session owns the cloud part (built from an allowed factory), its codecs, its optimizer and
the graphs of forward calls awaiting their backward. The server loop never lets one edge's bad
message stop it: every failure becomes a typed Error reply and the loop goes on.

Faults. Requests carry a sequence number; a session applies each number once, keeps its last
few replies and answers a repeated request from them (a retry after a lost reply is therefore
harmless). Operations that change state carry ids of their own (``step`` n, ``optimizer`` n), so
they are idempotent too. With a checkpoint folder, a session writes a checkpoint when it opens and
at every ``checkpoint_every``-th optimizer step, right after the step is applied: an edge that
reconnects (its ``hello`` carries a resume token, its last sequence number and the first one it
can still re-send) gets the newest state it can continue from, in memory or on disk, and re-sends
the requests after it. Sessions that hear nothing for ``Limits.session_timeout`` are freed.

Many edges. By default each session has its own copy of the cloud part. With ``shared_model``
every session that asks for the same model and cut trains one shared cloud part, in the order
requests arrive (sequential split learning, SplitNN-style): each session still has its own codec
state, sequence numbers, loss and gradient buffers, so one edge's accumulated gradients never leak
into another's step.
"""

from __future__ import annotations

import hmac
import json
import logging
import math
import re
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import compressors
import transports
from compressors import CodecContext

from . import protocol
from .checkpoint import CheckpointStore
from .coding import (SLOTS, Coded, SlotCodecs, Traffic, _Leaf, flatten, from_wire, stream_index, to_wire,
                     unflatten)
from .errors import (CapacityError, CheckpointError, ConfigError, HandshakeError, ModelError, PeerGone,
                     ProtocolError, ResumeError, SessionLost, SplitFTError, code_of)
from .factories import load_factory  # moved: the edge builds models too, and must not import the cloud
from .limits import Limits
from .metrics import Metrics
from .protocol import (Ack, Backward, Bye, Error, Forward, Hello, InputGrads, Output, Ping, Pong, Sync,
                       Welcome)
from .cut import Chain, extract, fingerprint, parse_cut, value_hash

log = logging.getLogger(__name__)

MAX_PENDING_CALLS = Limits.max_pending_calls
_KIND = {"forward": "activation", "output": "activation", "backward": "gradient", "input_grads": "gradient"}
_SEQUENCED = (Forward, Backward, Sync, Bye)
_SESSION_ID = re.compile(r"[0-9a-f]{16}")


@contextmanager
def _blame(kind: type[SplitFTError], what: str) -> Iterator[None]:
    """Turn an unexpected exception raised by edge-supplied input into a typed error.

    Our own typed errors pass through; anything else (a KeyError in a codec fed a malformed
    payload, a RuntimeError from a layer fed the wrong shape) is the edge's input, not our bug.
    """
    try:
        yield
    except (SplitFTError, compressors.CompressionError):
        raise
    except Exception as exc:
        raise kind(f"{what}: {type(exc).__name__}: {str(exc)[:500]}") from exc


def _hello_identity(hello: Hello) -> dict[str, Any]:
    """What a resumed session must agree on with the one it resumes."""
    return {"factory": hello.factory, "factory_kwargs": hello.factory_kwargs, "cut": hello.cut,
            "rejoin": hello.rejoin, "fingerprint": hello.fingerprint, "codecs": hello.codecs, "seed": hello.seed}


def _count_params(factory: Callable[..., nn.Module], kwargs: dict) -> int | None:
    """Parameters and buffers of the model ``factory`` builds, counted on the meta device.

    The meta device allocates nothing, so a request for a huge model is refused before its
    memory is taken. Factories that cannot build on it (they load files, say) return None.
    """
    try:
        with torch.device("meta"):
            probe = factory(**kwargs)
        return sum(t.numel() for t in (*probe.parameters(), *probe.buffers()))
    except Exception:  # noqa: BLE001 — only a probe; the real build reports errors properly
        return None


def _build_chain(hello: Hello, factories: dict[str, Callable[..., nn.Module]], limits: Limits) -> tuple[Chain, bool]:
    if hello.factory not in factories:
        raise HandshakeError(
            f"model factory {hello.factory!r} is not served here; this cloud serves: "
            f"{', '.join(sorted(factories)) or '(none)'} (start it with --model {hello.factory})"
        )
    factory = factories[hello.factory]
    count = _count_params(factory, hello.factory_kwargs)
    if count is not None and count > limits.max_model_params:
        raise CapacityError(f"{hello.factory}({hello.factory_kwargs}) has {count} parameters; this cloud builds "
                            f"models of at most {limits.max_model_params}")
    try:
        model = factory(**hello.factory_kwargs)
    except TypeError as exc:
        raise HandshakeError(f"factory {hello.factory!r} rejected its arguments: {exc}") from exc
    spec = parse_cut(model, hello.cut, hello.rejoin)
    chain = extract(model, spec)
    mine = fingerprint(chain)
    if mine != hello.fingerprint:
        raise HandshakeError(
            f"the cloud part of {hello.factory!r} cut at {hello.cut!r} differs between edge and cloud "
            f"(parameter names/shapes fingerprint {hello.fingerprint} vs {mine}); "
            "both sides must build the same architecture (same factory arguments, same code version)"
        )
    return chain, spec.ushape


def _check_codecs(codecs: Any) -> None:
    if not isinstance(codecs, dict) or set(codecs) != set(SLOTS) \
            or not all(isinstance(v, str) for v in codecs.values()):
        raise HandshakeError(f"codecs must name a spec for each of {SLOTS}, got {codecs!r}")
    try:
        canonical = {slot: compressors.canonical_spec(spec) for slot, spec in codecs.items()}
    except compressors.CompressionError as exc:
        raise HandshakeError(f"edge asked for a codec this cloud cannot run: {exc}") from exc
    if canonical != codecs:
        raise HandshakeError(f"codec specs are not in canonical form: {codecs} (expected {canonical})")


@dataclass
class _Pending:
    """A forward call's graph, kept until its backward arrives."""

    inputs: list[torch.Tensor]
    in_coded: list[Coded]
    in_grad: list[bool]
    outputs: list[torch.Tensor]
    out_coded: list[Coded]
    sample_ids: np.ndarray | None
    # What it takes to build the graph again (shared model: another edge stepped in between).
    rerun: Callable[[], tuple[list[torch.Tensor], list[torch.Tensor]]] | None = None
    version: int = 0


@dataclass
class SharedPart:
    """A cloud part that several sessions train together (``shared_model``), and its optimizer."""

    chain: Chain
    ushape: bool
    optimizer: torch.optim.Optimizer | None = None
    optimizer_spec: tuple[str, str] | None = None
    updates: int = 0  # optimizer steps taken by any session; a graph older than this is stale
    sessions: int = 0
    initialized: bool = False  # the first edge's weights are in; later edges' pushed weights are ignored


@dataclass
class _Optimizer:
    name: str
    settings: dict = field(default_factory=dict)


class CloudSession:
    """Everything the cloud keeps for one edge.

    Args:
        hello: the edge's handshake.
        factories: the model factories this cloud serves.
        limits: what the session may keep (pending graphs, replies).
        shared: a cloud part shared with other sessions (``shared_model``), or None for a copy
            of its own.
    """

    def __init__(self, hello: Hello, factories: dict[str, Callable[..., nn.Module]],
                 limits: Limits | None = None, shared: SharedPart | None = None,
                 restoring: bool = False) -> None:
        if hello.protocol != protocol.PROTOCOL_VERSION:
            raise HandshakeError(f"edge speaks protocol {hello.protocol}, cloud speaks {protocol.PROTOCOL_VERSION}")
        self.limits = limits or Limits()
        self.id = secrets.token_hex(8)
        self.token = secrets.token_hex(16)
        self.identity = _hello_identity(hello)
        self.nonce = hello.nonce
        _check_codecs(hello.codecs)
        self.shared = shared
        if shared is not None:
            self.chain, self.ushape = shared.chain, shared.ushape
        else:
            self.chain, self.ushape = _build_chain(hello, factories, self.limits)
        with _blame(HandshakeError, "the weights the edge pushed cannot be loaded"):
            if restoring or (shared is not None and shared.initialized):
                pass  # weights come from a checkpoint, or the shared part is already training
            elif hello.weights is not None:
                weights = _tensors(hello.weights, "weights")
                if not all(torch.isfinite(w).all() for w in weights.values() if w.is_floating_point()):
                    raise ProtocolError("the pushed weights contain NaN or Inf")
                self.chain.load_qualified_state_dict(weights)
            elif hello.value_hash is not None and hello.value_hash != value_hash(self.chain):
                raise HandshakeError(
                    "the cloud part's initial weights differ between edge and cloud; make the factory "
                    "deterministic (load the same checkpoint, seed it) or let the edge push them (weights='push')"
                )
        self.codecs = SlotCodecs(hello.codecs, hello.seed)
        self._optimizer: torch.optim.Optimizer | None = None
        self.optimizer_spec: _Optimizer | None = None
        self.optimizer_id = 0
        self.loss_fn: nn.Module | None = None
        self.loss_spec: dict | None = None
        self.pending: OrderedDict[int, _Pending] = OrderedDict()
        # eager calls' parameter gradients, for an incoming gradient of 1, until the edge says how to scale them
        self.deferred: OrderedDict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = OrderedDict()
        self.steps = 0
        self.metrics = Metrics()
        self.last_seen = time.monotonic()
        # Request sequence numbers: the last one applied, and the replies to the last few.
        self.last_seq = 0
        self.replies: OrderedDict[int, tuple[str, list]] = OrderedDict()
        self.duplicates = 0  # repeated requests answered from the cache, repeated steps skipped
        self._grads: list[torch.Tensor | None] | None = None  # shared model: this session's gradients
        if shared is not None:
            shared.initialized = True
            shared.sessions += 1

    # ------------------------------------------------------------ the optimizer (own or shared)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.shared.optimizer if self.shared is not None else self._optimizer

    @contextmanager
    def _own_grads(self) -> Iterator[None]:
        """Shared model: put this session's gradient buffers in place for the duration."""
        if self.shared is None:
            yield
            return
        params = list(self.chain.parameters())
        for p, g in zip(params, self._grads or [None] * len(params)):
            p.grad = g
        try:
            yield
        finally:
            self._grads = [p.grad for p in params]
            for p in params:
                p.grad = None

    # ------------------------------------------------------------ operations mirrored from the edge

    def apply_ops(self, ops: list) -> int:
        """Apply mirrored operations in order; returns how many optimizer steps were new."""
        stepped = 0
        for op in ops:
            if not isinstance(op, dict) or not isinstance(op.get("op"), str):
                raise ProtocolError(f"an operation must be a map with an 'op' name, got {protocol._short(op)}")
            handler = getattr(self, f"_op_{op['op']}", None)
            if handler is None:
                raise ProtocolError(f"unknown operation {protocol._short(op['op'])}")
            stepped += bool(handler(op))
        return stepped

    @staticmethod
    def _op_id(op: dict) -> int | None:
        value = op.get("id")
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ProtocolError(f"operation id must be a positive int, got {protocol._short(value)}")
        return value

    def _op_optimizer(self, op: dict) -> None:
        op_id = self._op_id(op)
        if op_id is not None and op_id <= self.optimizer_id and self.optimizer is not None:
            return  # a replayed attach: the optimizer (and its state) is already there
        name, settings = op.get("name"), op.get("settings") or {}
        cls = getattr(torch.optim, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            raise ConfigError(f"{protocol._short(name)} is not a torch.optim optimizer")
        if not isinstance(settings, dict):
            raise ProtocolError("optimizer settings must be a map")
        if self.shared is not None:
            spec = (cls.__name__, json.dumps(settings, sort_keys=True, default=str))
            if self.shared.optimizer is not None:
                if self.shared.optimizer_spec != spec:
                    raise ConfigError(
                        f"this cloud part is shared and trains with {self.shared.optimizer_spec[0]}"
                        f"({self.shared.optimizer_spec[1]}); every edge must attach the same optimizer, got "
                        f"{cls.__name__}({spec[1]})"
                    )
            else:
                self.shared.optimizer = self._make_optimizer(cls, settings)
                self.shared.optimizer_spec = spec
        else:
            self._optimizer = self._make_optimizer(cls, settings)
        self.optimizer_spec = _Optimizer(cls.__name__, dict(settings))
        self.optimizer_id = op_id if op_id is not None else self.optimizer_id + 1

    def _make_optimizer(self, cls: type, settings: dict) -> torch.optim.Optimizer:
        try:
            return cls(self.chain.parameters(), **settings)
        except Exception as exc:  # optimizers raise TypeError, ValueError, RuntimeError for bad settings
            raise ConfigError(f"cannot build {cls.__name__} with {protocol._short(settings)}: {exc}") from exc

    def _op_loss(self, op: dict) -> None:
        cls = getattr(nn, str(op.get("name")), None)
        if not (isinstance(cls, type) and issubclass(cls, nn.modules.loss._Loss)):
            raise ConfigError(f"{protocol._short(op.get('name'))} is not a torch.nn loss")
        settings = op.get("settings") or {}
        if not isinstance(settings, dict):
            raise ProtocolError("loss settings must be a map")
        try:
            self.loss_fn = cls(**settings)
        except Exception as exc:
            raise ConfigError(f"cannot build {cls.__name__} with {protocol._short(settings)}: {exc}") from exc
        self.loss_spec = {"op": "loss", "name": cls.__name__, "settings": settings}

    def _op_step(self, op: dict) -> bool:
        step_id = self._op_id(op)
        if step_id is not None:
            if step_id <= self.steps:
                self.duplicates += 1
                log.info("session %s: optimizer step %d was applied already; skipped", self.id, step_id)
                return False
            if step_id != self.steps + 1:
                raise ProtocolError(f"optimizer step {step_id} arrived but this session is at step {self.steps}; "
                                    "steps in between were lost (resume the session to replay them)")
        if self.optimizer is None:
            raise ConfigError("the edge stepped its optimizer, but none was attached: call model.attach(optimizer)")
        lr = op.get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            if not math.isfinite(lr):
                raise ProtocolError(f"learning rate {lr} is not finite")
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        with self._own_grads(), _blame(ModelError, "the optimizer step failed"):
            self.optimizer.step()
        self.steps += 1
        if self.shared is not None:
            self.shared.updates += 1
        else:
            self.pending.clear()  # graphs from before a step can no longer be backpropagated correctly
        self.deferred.clear()
        return True

    def _op_apply(self, op: dict) -> None:
        """The edge backpropagated through an eager call: add its parameter gradients, scaled."""
        call, scale = op.get("call"), op.get("scale")
        if not isinstance(call, int) or isinstance(call, bool) or not isinstance(scale, (int, float)) \
                or isinstance(scale, bool) or not math.isfinite(scale):
            raise ProtocolError(f"apply needs an int call and a finite number scale, got {protocol._short(op)}")
        deferred = self.deferred.get(call)
        if deferred is None:
            raise ProtocolError(f"no eager call {call} to apply (freed by an optimizer step, or never sent)")
        with torch.no_grad(), self._own_grads():
            for param, grad in deferred:
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad * scale
                else:
                    param.grad.add_(grad, alpha=scale)

    def _op_zero_grad(self, op: dict) -> None:
        set_to_none = bool(op.get("set_to_none", True))
        with self._own_grads():
            if self.optimizer is not None and self.shared is None:
                self.optimizer.zero_grad(set_to_none=set_to_none)
            else:
                self.chain.zero_grad(set_to_none=set_to_none)

    # ------------------------------------------------------------ requests

    def _run(self, tensors: list[torch.Tensor], grads: list[bool], skeletons: tuple, counts: tuple[int, int],
             train: bool, grad: bool) -> tuple[list[torch.Tensor], Any]:
        """Run the cloud part (and the loss) on decoded inputs; returns (input leaves, value)."""
        args_skel, kw_skel, target_skel = skeletons
        n_args, n_kw = counts
        leaves = [t.detach().requires_grad_() if g and t.is_floating_point() else t for t, g in zip(tensors, grads)]
        args = unflatten(args_skel, leaves[:n_args])
        kwargs = unflatten(kw_skel, leaves[n_args:n_args + n_kw])
        target = unflatten(target_skel, leaves[n_args + n_kw:])
        self.chain.train(train)
        with torch.set_grad_enabled(grad), _blame(ModelError, "the cloud part failed on the inputs the edge sent"):
            value = self.chain(*args, **kwargs)
            if target is not None:
                if self.loss_fn is None:
                    raise ConfigError("a target arrived but no loss was configured: use model.remote_loss(criterion)")
                value = self.loss_fn(value, target)
        return leaves, value

    def forward(self, msg: Forward) -> Output:
        compute = codec = 0.0
        if msg.sample_ids is not None and (msg.sample_ids.ndim != 1 or msg.sample_ids.dtype != np.int64):
            raise ProtocolError("sample_ids must be a 1-D int64 array")
        ctx = CodecContext("activation", train=msg.train, step=msg.step, sample_ids=msg.sample_ids)
        args_entries, args_skel = from_wire(msg.args)
        kw_entries, kw_skel = from_wire(msg.kwargs)
        target_entries, target_skel = from_wire(msg.target)
        if not isinstance(args_skel, list) or not isinstance(kw_skel, dict):
            raise ProtocolError("forward args must be a list and kwargs a map")
        if msg.target is not None and self.ushape:
            raise ProtocolError("a U-shape session computes no loss in the cloud; send no target")
        start = time.perf_counter()
        tensors, in_coded = [], []
        with _blame(ProtocolError, "a tensor in the forward request cannot be decoded"):
            for entries, stream in ((args_entries, stream_index(args_skel)), (kw_entries, None),
                                    (target_entries, None)):
                decoded, coded = self.codecs.decode(entries, stream, "fwd", ctx)
                tensors += decoded
                in_coded += coded
        for tensor, coded in zip(tensors, in_coded):
            if coded.stream and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ProtocolError("the activation contains NaN or Inf; the edge part diverged or the data is bad")
        grads = [g and msg.grad for _, g in (*args_entries, *kw_entries, *target_entries)]
        codec += time.perf_counter() - start

        start = time.perf_counter()
        skeletons, counts = (args_skel, kw_skel, target_skel), (len(args_entries), len(kw_entries))
        leaves, value = self._run(tensors, grads, skeletons, counts, msg.train, msg.grad)
        compute += time.perf_counter() - start

        start = time.perf_counter()
        outs, out_skel = flatten(value)
        stream = stream_index(out_skel) if self.ushape else None
        out_grads = [t.requires_grad for t in outs]
        traffic = Traffic()
        entries, out_coded = self.codecs.encode(outs, stream, "ret", ctx, out_grads, traffic)
        codec += time.perf_counter() - start
        eager_grads = None
        if (msg.grad and msg.eager and msg.target is not None and self.shared is None
                and isinstance(value, torch.Tensor) and value.dim() == 0 and value.requires_grad):
            # One round trip per step: backpropagate now for an incoming gradient of 1; the edge
            # scales the cut's gradient itself and tells us (op "apply") how to scale ours.
            # (Not for a shared cloud half: another edge's step would make these gradients stale.)
            start = time.perf_counter()
            needed = [leaf for leaf, g in zip(leaves, grads) if g]
            params = [p for p in self.chain.parameters() if p.requires_grad]
            with _blame(ModelError, "the cloud part's backward failed"):
                found = torch.autograd.grad(value, needed + params, allow_unused=True)
            compute += time.perf_counter() - start
            self.deferred[msg.call] = list(zip(params, found[len(needed):]))
            while len(self.deferred) > self.limits.max_pending_calls:
                self.deferred.popitem(last=False)
            by_leaf = iter(found[:len(needed)])
            leaf_grads = [next(by_leaf) if g else None for g in grads]
            start = time.perf_counter()
            eager_grads = self._encode_input_grads(leaves, in_coded, grads, leaf_grads, CodecContext(
                "gradient", train=True, step=self.steps, sample_ids=msg.sample_ids))
            codec += time.perf_counter() - start
        elif msg.grad:
            rerun = None
            if self.shared is not None:
                def rerun() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
                    again, value = self._run(tensors, grads, skeletons, counts, msg.train, True)
                    return again, flatten(value)[0]
            self.pending[msg.call] = _Pending(leaves, in_coded, grads, outs, out_coded, msg.sample_ids, rerun,
                                              self.shared.updates if self.shared is not None else 0)
            while len(self.pending) > self.limits.max_pending_calls:
                dropped, _ = self.pending.popitem(last=False)
                log.warning("session %s: dropping the graph of call %s, never backpropagated", self.id, dropped)
        return Output(call=msg.call, value=to_wire(out_skel, entries), timings={"compute": compute, "codec": codec},
                      grads=eager_grads)

    def _encode_input_grads(self, leaves: list[torch.Tensor], coded: list[Coded], needed: list[bool],
                            leaf_grads: list[torch.Tensor | None], ctx: CodecContext) -> list[dict | None]:
        """Gradients of a call's inputs, through the gradient codecs, as wire entries."""
        traffic = Traffic()
        entries: list[dict | None] = []
        for leaf, c, need, grad in zip(leaves, coded, needed, leaf_grads):
            if not need:
                entries.append(None)
                continue
            grad = grad if grad is not None else torch.zeros_like(leaf)
            grad = self.codecs.grad_for_sender(grad, c, "fwd", ctx)
            (entry,), _ = self.codecs.encode([grad], 0 if c.stream else None, "bwd", ctx, [False], traffic)
            entries.append(entry)
        return entries

    def backward(self, msg: Backward) -> InputGrads:
        pending = self.pending.pop(msg.call, None)
        if pending is None:
            raise ProtocolError(
                f"no forward call {msg.call} awaits a backward (already backpropagated, run without "
                "grad, or freed by an optimizer step)"
            )
        compute = codec = 0.0
        ctx = CodecContext("gradient", train=True, step=self.steps, sample_ids=pending.sample_ids)
        start = time.perf_counter()
        got, skeleton = from_wire(msg.grads)
        if not isinstance(skeleton, list) or len(skeleton) != len(pending.outputs):
            raise ProtocolError(f"backward carries {len(skeleton) if isinstance(skeleton, list) else '?'} "
                                f"gradients for {len(pending.outputs)} outputs")
        if self.shared is not None and pending.rerun is not None and pending.version != self.shared.updates:
            # Another edge stepped the shared part since this graph was built: build it again on the
            # current weights, so the gradient is that of the model being trained now.
            pending.inputs, pending.outputs = pending.rerun()
        outputs, grads = [], []
        for out, coded, slot in zip(pending.outputs, pending.out_coded, skeleton):
            if slot is None or not out.requires_grad:
                continue
            if not isinstance(slot, _Leaf):
                raise ProtocolError(f"a backward gradient slot holds {protocol._short(slot)}, expected a tensor or nil")
            with _blame(ProtocolError, "a gradient in the backward request cannot be decoded"):
                (grad,), _ = self.codecs.decode([got[slot.index]], 0 if coded.stream else None, "ret_bwd", ctx)
                grad = self.codecs.grad_at_input(grad, coded, "ret", ctx)
            if grad.shape != out.shape:
                raise ProtocolError(f"gradient of shape {tuple(grad.shape)} for an output of shape {tuple(out.shape)}")
            if grad.is_floating_point() and not torch.isfinite(grad).all():
                raise ProtocolError("gradient contains NaN or Inf")
            outputs.append(out)
            grads.append(grad)
        codec += time.perf_counter() - start

        start = time.perf_counter()
        if outputs:
            with self._own_grads(), _blame(ModelError, "backpropagating the edge's gradient failed"):
                torch.autograd.backward(outputs, grads)
        compute += time.perf_counter() - start

        start = time.perf_counter()
        entries = self._encode_input_grads(pending.inputs, pending.in_coded, pending.in_grad,
                                           [leaf.grad for leaf in pending.inputs], ctx)
        codec += time.perf_counter() - start
        return InputGrads(call=msg.call, grads=entries, timings={"compute": compute, "codec": codec})

    def state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy() for k, v in self.chain.qualified_state_dict().items()}

    # ------------------------------------------------------------ checkpoints

    def snapshot(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """``(tree, meta)`` for a checkpoint: everything needed to continue from here exactly."""
        if self.shared is not None:
            raise CheckpointError("sessions of a shared cloud part are not checkpointed")
        with torch.no_grad():
            tree = {
                "weights": self.chain.qualified_state_dict(),
                "grads": {n: p.grad for n, p in self.chain.named_parameters() if p.grad is not None},
                "optimizer": self._optimizer.state_dict() if self._optimizer is not None else None,
                "codecs": self.codecs.state_dict(),
                "rng": torch.get_rng_state(),
            }
        meta = {
            "kind": "cloud", "session": self.id, "token": self.token, "seq": self.last_seq, "steps": self.steps,
            "optimizer_id": self.optimizer_id,
            "optimizer": vars(self.optimizer_spec) if self.optimizer_spec is not None else None,
            "loss": self.loss_spec, "hello": self.identity,
        }
        return tree, meta

    @classmethod
    def restore(cls, hello: Hello, tree: dict[str, Any], meta: dict[str, Any],
                factories: dict[str, Callable[..., nn.Module]], limits: Limits | None = None) -> "CloudSession":
        """The session a checkpoint describes, rebuilt from the factory and the stored state."""
        session = cls(hello, factories, limits, restoring=True)
        session.id, session.token = meta["session"], meta["token"]
        session.last_seq, session.steps = int(meta["seq"]), int(meta["steps"])
        with _blame(CheckpointError, f"checkpoint of session {session.id} does not fit its model"):
            session.chain.load_qualified_state_dict(tree["weights"])
            params = dict(session.chain.named_parameters())
            for name, grad in tree["grads"].items():
                params[name].grad = grad.clone()
            if meta.get("loss"):
                session._op_loss(meta["loss"])
            if meta.get("optimizer"):
                spec = meta["optimizer"]
                session._op_optimizer({"op": "optimizer", "name": spec["name"], "settings": spec["settings"]})
                session._optimizer.load_state_dict(tree["optimizer"])
            session.optimizer_id = int(meta.get("optimizer_id", 0))
            session.codecs.load_state_dict(tree["codecs"])
            torch.set_rng_state(tree["rng"])
        return session


def _tensors(arrays: Any, what: str) -> dict[str, torch.Tensor]:
    if not isinstance(arrays, dict) or not all(isinstance(v, np.ndarray) for v in arrays.values()):
        raise ProtocolError(f"{what} must map names to arrays")
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


class CloudServer:
    """Serves cloud parts to edges over a :class:`transports.Listener`.

    Args:
        listener: where edges connect (``transports.listen("tcp://0.0.0.0:5555")``).
        factories: the model factories edges may ask for (``"package.module:function"``).
        max_sessions: stop after this many sessions have ended (0: serve until stopped).
        limits: bounds on messages, sessions and what each keeps (:class:`Limits`).
        checkpoint_dir: write checkpoints of every session there, so edges can resume after the
            cloud restarts (None: sessions survive only in memory).
        checkpoint_every: checkpoint at every N-th optimizer step (1: at every step, so a
            restart loses nothing; larger is cheaper and makes edges keep N steps to replay).
        keep_checkpoints: checkpoints kept per session.
        fsync: flush each checkpoint to disk (survives power loss, not only process death).
        shared_model: sessions asking for the same model and cut train one shared cloud part.
    """

    def __init__(self, listener: transports.Listener, factories: Iterable[str], *, max_sessions: int = 0,
                 on_event: Callable[[str], None] | None = None, limits: Limits | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 1, keep_checkpoints: int = 2,
                 fsync: bool = True, shared_model: bool = False) -> None:
        self.listener = listener
        names = list(factories)
        self.factories = {name: load_factory(name) for name in names}
        self.max_sessions = max_sessions
        self.limits = limits or Limits()
        if checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        if shared_model and checkpoint_dir is not None:
            raise ConfigError("checkpoints restore one edge's session exactly; with a shared cloud part they "
                              "cannot (other edges move it on). Use one of shared_model / checkpoint_dir")
        self.checkpoints = CheckpointStore(checkpoint_dir, keep=keep_checkpoints, fsync=fsync) \
            if checkpoint_dir is not None else None
        self.checkpoint_every = checkpoint_every
        self.shared_model = shared_model
        self.shared: dict[str, SharedPart] = {}
        self.sessions: dict[bytes, CloudSession] = {}  # by the peer that speaks for it now
        self.by_id: dict[str, CloudSession] = {}
        self.ended = 0
        #: One summary per ended session (id, steps, requests, repeats answered from the cache,
        #: reason), newest last: what operators and load tests check for lost or repeated steps.
        self.finished: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.stop_event = threading.Event()
        self._on_event = on_event or (lambda text: log.info("%s", text))
        self._last_sweep = time.monotonic()

    def _event(self, text: str) -> None:
        self._on_event(text)

    def serve(self, poll: float = 0.2) -> None:
        """Handle messages until stopped, or until ``max_sessions`` sessions have ended."""
        try:
            while not self.stop_event.is_set():
                if self.max_sessions and self.ended >= self.max_sessions and not self.sessions:
                    break
                self.expire()
                try:
                    peer, frames = self.listener.recv(poll)
                except transports.TransportTimeout:
                    continue
                except transports.TransportClosed:
                    break
                self.handle(peer, frames)
        except KeyboardInterrupt:
            self.shutdown("the cloud was interrupted (Ctrl-C)")
            raise
        self.shutdown("the cloud stopped")

    # ------------------------------------------------------------ one message

    def handle(self, peer: bytes, frames: list) -> None:
        """Answer one message. Never raises for anything the peer sent."""
        reply: protocol.Message | None
        msg: protocol.Message | None = None
        session = self.sessions.get(peer)
        seq, sequenced = 0, False
        try:
            self.limits.check_frames(frames)
            msg = protocol.decode(frames)
            if session is not None:
                session.last_seen = time.monotonic()
                session.metrics.count("up", _KIND.get(msg.TYPE, "control"), wire=transports.message_nbytes(frames))
            seq = getattr(msg, "seq", 0)
            if seq < 0:
                raise ProtocolError(f"request seq must be >= 0, got {seq}")
            if seq and session is not None and isinstance(msg, _SEQUENCED):
                if seq <= session.last_seq:
                    self._repeat(peer, session, seq)
                    return
                if seq != session.last_seq + 1:
                    raise SessionLost(f"request {seq} arrived but request {session.last_seq + 1} was expected "
                                      "(requests were lost); resume the session to re-send them")
                sequenced = True
            reply = self._dispatch(peer, msg, seq)
            if session is None and isinstance(msg, Hello) and peer in self.sessions:
                self.sessions[peer].metrics.count("up", "control", wire=transports.message_nbytes(frames))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 — a bad request must never stop the server
            if not isinstance(exc, (SplitFTError, compressors.CompressionError)):
                log.exception("internal error while serving peer %s", peer.hex())
            if isinstance(exc, SessionLost):
                sequenced = False  # nothing was applied: the number stays free for the re-sent request
            text = f"{type(exc).__name__}: {exc}"
            call = getattr(msg, "call", 0)
            reply = Error(code=code_of(exc), message=text[: self.limits.max_error_chars], seq=seq,
                          call=call if isinstance(call, int) and not isinstance(call, bool) else 0)
        if reply is None:
            return
        if seq and hasattr(reply, "seq"):
            reply.seq = seq
        try:
            out = protocol.encode(reply)
        except SplitFTError as exc:  # the cloud part returned something that cannot cross the wire
            reply = Error(code=code_of(exc), message=str(exc)[: self.limits.max_error_chars], seq=seq)
            out = protocol.encode(reply)
        if sequenced and session is not None:
            session.last_seq = seq
            session.replies[seq] = (reply.TYPE, out)
            while len(session.replies) > self.limits.reply_cache:
                session.replies.popitem(last=False)
        self._send(peer, out, reply.TYPE)

    def _repeat(self, peer: bytes, session: CloudSession, seq: int) -> None:
        """A request that was applied already: answer it again from the cache, never re-apply it."""
        session.duplicates += 1
        cached = session.replies.get(seq)
        if cached is None:
            text = (f"request {seq} was applied already and its reply is no longer kept (the session is at "
                    f"request {session.last_seq}); it is not applied again")
            self._send(peer, protocol.encode(Error(code="protocol", message=text, seq=seq)), "error")
            return
        log.info("session %s: request %d repeated; answering from the reply cache", session.id, seq)
        self._send(peer, cached[1], cached[0])

    def _send(self, peer: bytes, frames: list, kind: str) -> None:
        session = self.sessions.get(peer)
        try:
            wire = self.listener.send(peer, frames)
        except transports.TransportError as exc:
            log.warning("cannot reply to peer %s: %s", peer.hex(), exc)
            return
        if session is not None:
            session.metrics.count("down", _KIND.get(kind, "control"), wire=wire)

    def _dispatch(self, peer: bytes, msg: protocol.Message, seq: int) -> protocol.Message | None:
        if isinstance(msg, Hello):
            return self._hello(peer, msg)
        session = self.sessions.get(peer)
        if session is None:
            if isinstance(msg, Bye):
                return Ack()  # nothing to end; answered so that every message gets a reply
            raise SessionLost(f"no session for this connection (got {msg.TYPE}): send a hello first, or a "
                              "hello with a resume token if the cloud restarted")
        if isinstance(msg, Ping):
            return Pong()
        if isinstance(msg, (Forward, Backward, Sync, Bye)):
            before = session.steps
            try:
                session.apply_ops(msg.ops)
            finally:
                # Right after the step, before the request's own work: replaying this request
                # re-applies its operations, which their ids make harmless, then does that work.
                force = isinstance(msg, Sync) and msg.checkpoint
                if force or before // self.checkpoint_every != session.steps // self.checkpoint_every:
                    self._checkpoint(session, (seq or session.last_seq + 1) - 1, pinned=force and msg.pin)
        if isinstance(msg, Forward):
            return session.forward(msg)
        if isinstance(msg, Backward):
            return session.backward(msg)
        if isinstance(msg, Sync):
            return Ack(state=session.state() if msg.want_state else None)
        if isinstance(msg, Bye):
            self._checkpoint(session, (seq or session.last_seq + 1) - 1)
            self._end(peer, msg.reason or "edge said goodbye")
            return Ack()
        raise ProtocolError(f"a {msg.TYPE} message is not a request the cloud answers")

    # ------------------------------------------------------------ sessions: open, resume, end

    def _hello(self, peer: bytes, msg: Hello) -> Welcome:
        if msg.resume is not None:
            session = self._resume(peer, msg)
            verb = "resumed"
        elif msg.nonce and peer in self.sessions and self.sessions[peer].nonce == msg.nonce:
            session = self.sessions[peer]  # the same hello again: a duplicate, not a new session
            verb = "greeted again"
        else:
            if peer in self.sessions:
                self._end(peer, "replaced by a new hello")
            if len(self.by_id) >= self.limits.max_sessions:
                raise CapacityError(f"this cloud serves {len(self.by_id)} sessions, its limit; try again later "
                                    "(the operator can raise --max-open-sessions)")
            session = CloudSession(msg, self.factories, self.limits, shared=self._shared_part(msg))
            self._bind(peer, session)
            if self.checkpoints is not None:
                self._checkpoint(session, 0)
            verb = "opened"
        self._event(f"session {session.id} {verb}: {msg.factory} cut at {msg.cut}"
                    f"{' rejoin ' + str(msg.rejoin) if msg.rejoin else ''}, codecs "
                    f"{msg.codecs.get('fwd')} / {msg.codecs.get('bwd')}"
                    + (f", at step {session.steps} (request {session.last_seq})" if verb == "resumed" else ""))
        return Welcome(session=session.id, server=f"splitft {protocol.PROTOCOL_VERSION}", token=session.token,
                       seq=session.last_seq, steps=session.steps,
                       checkpoint_every=self.checkpoint_every if self.checkpoints is not None else 0,
                       limits=self.limits.for_edge(), shared=session.shared is not None)

    def _shared_part(self, msg: Hello) -> SharedPart | None:
        if not self.shared_model:
            return None
        key = json.dumps(_hello_identity(msg) | {"codecs": None, "seed": None}, sort_keys=True, default=str)
        part = self.shared.get(key)
        if part is None:
            if len(self.shared) >= 16:
                raise CapacityError("this cloud already trains 16 different shared cloud parts, its limit")
            chain, ushape = _build_chain(msg, self.factories, self.limits)
            part = self.shared[key] = SharedPart(chain, ushape)
        return part

    def _resume(self, peer: bytes, msg: Hello) -> CloudSession:
        r = msg.resume
        if not isinstance(r, dict):
            raise ProtocolError("hello.resume must be a map")
        sid, token = r.get("session"), r.get("token")
        numbers = [r.get(k) for k in ("step", "seq", "log_from")]
        if not (isinstance(sid, str) and _SESSION_ID.fullmatch(sid) and isinstance(token, str)
                and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in numbers)):
            raise ProtocolError("hello.resume needs session (16 hex digits), token, and step, seq, log_from "
                                f"(ints >= 0); got {protocol._short(r)}")
        step, seq, log_from = numbers
        identity = _hello_identity(msg)
        live = self.by_id.get(sid)
        if live is not None:
            if not hmac.compare_digest(live.token, token):
                raise ResumeError(f"wrong resume token for session {sid}")
            if live.identity != identity:
                raise ResumeError(f"session {sid} serves a different model, cut or codecs than this hello asks for")
            # The edge can re-send every request after ``live.last_seq`` and is not behind it.
            if log_from - 1 <= live.last_seq <= seq:
                self._bind(peer, live)
                return live
        # Newest checkpoint the edge can continue from.
        stored = self.checkpoints.seqs(sid) if self.checkpoints is not None else []
        usable = [s for s in stored if log_from - 1 <= s <= seq]
        if not usable:
            have = [f"in memory at request {live.last_seq}"] if live is not None else []
            have += [f"a checkpoint at request {s}" for s in stored]
            raise ResumeError(
                f"cannot resume session {sid}: the edge is at request {seq} (step {step}) and can re-send from "
                f"request {log_from}, but this cloud has {', '.join(have) or 'nothing of it'}"
                + ("" if self.checkpoints is not None else " (start the cloud with --checkpoint-dir)")
                + "; start a new session, or restart the edge from a checkpoint the cloud also has"
            )
        tree, meta = self.checkpoints.load(sid, usable[-1])
        if not hmac.compare_digest(str(meta.get("token", "")), token):
            raise ResumeError(f"wrong resume token for session {sid}")
        if meta.get("hello") != json.loads(json.dumps(identity)):
            raise ResumeError(f"session {sid} serves a different model, cut or codecs than this hello asks for")
        session = CloudSession.restore(msg, tree, meta, self.factories, self.limits)
        if live is not None:
            self._unbind(live)
        elif len(self.by_id) >= self.limits.max_sessions:
            raise CapacityError(f"this cloud serves {len(self.by_id)} sessions, its limit; try again later")
        self._bind(peer, session)
        self._event(f"session {sid} restored from its checkpoint at request {session.last_seq} "
                    f"(step {session.steps})")
        return session

    def _bind(self, peer: bytes, session: CloudSession) -> None:
        self._unbind(session)
        old = self.sessions.get(peer)
        if old is not None and old is not session:
            self._end(peer, "replaced by a new hello")
        self.sessions[peer] = session
        self.by_id[session.id] = session
        session.last_seen = time.monotonic()

    def _unbind(self, session: CloudSession) -> None:
        for peer, s in list(self.sessions.items()):
            if s is session:
                del self.sessions[peer]
        self.by_id.pop(session.id, None)

    def _checkpoint(self, session: CloudSession, seq: int, pinned: bool = False) -> None:
        if self.checkpoints is None:
            return
        tree, meta = session.snapshot()
        meta["seq"] = seq
        try:
            self.checkpoints.save(session.id, seq, tree, meta, pinned=pinned)
        except CheckpointError as exc:
            # Training goes on; an edge that later needs this checkpoint is told exactly what is missing.
            log.error("session %s: checkpoint at request %d failed: %s", session.id, seq, exc)

    def _end(self, peer: bytes, reason: str) -> None:
        session = self.sessions.pop(peer, None)
        if session is not None:
            self._forget(session, f"ended after {session.steps} steps: {reason}")

    def _forget(self, session: CloudSession, text: str) -> None:
        self.finished.append({"session": session.id, "steps": session.steps, "requests": session.last_seq,
                              "repeats": session.duplicates, "reason": text})
        self._unbind(session)
        if session.shared is not None:
            session.shared.sessions -= 1
        self.ended += 1
        self._event(f"session {session.id} {text}")

    def expire(self, now: float | None = None) -> None:
        """Free sessions that heard nothing for ``limits.session_timeout`` (checked once a second)."""
        now = time.monotonic() if now is None else now
        if now - self._last_sweep < 1.0 and now >= self._last_sweep:
            return
        self._last_sweep = now
        for session in list(self.by_id.values()):
            idle = now - session.last_seen
            if idle > self.limits.session_timeout:
                kept = " (its checkpoints stay)" if self.checkpoints is not None else ""
                self._forget(session, f"expired after {idle:.0f} s without a message{kept}")

    def shutdown(self, reason: str) -> None:
        """Tell every connected edge the cloud is going away, then close the listener."""
        for peer in list(self.sessions):
            try:
                self.listener.send(peer, protocol.encode(Bye(reason=reason)))
            except transports.TransportError:
                pass
            self._end(peer, reason)
        self.listener.close()

    def stop(self) -> None:
        """Ask :meth:`serve` to return (thread-safe)."""
        self.stop_event.set()


def serve_in_thread(server: CloudServer) -> threading.Thread:
    """Run ``server.serve()`` on a daemon thread (in-process tests and simulations)."""
    thread = threading.Thread(target=server.serve, name="splitft-cloud", daemon=True)
    thread.start()
    return thread


__all__ = ["CloudServer", "CloudSession", "Limits", "SharedPart", "load_factory", "serve_in_thread", "PeerGone"]
