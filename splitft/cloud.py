"""The cloud runtime: one session per connected edge, serving its part of the model.

A session owns the cloud part (built from an allowed factory), its codecs, its optimizer and
the graphs of forward calls awaiting their backward. The server loop never lets one edge's bad
message stop it: every failure becomes a typed Error reply and the loop goes on.
"""

from __future__ import annotations

import importlib
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

import compressors
import transports
from compressors import CodecContext

from . import protocol
from .coding import SLOTS, Coded, SlotCodecs, Traffic, flatten, from_wire, stream_index, to_wire, unflatten
from .errors import (ConfigError, HandshakeError, PeerGone, ProtocolError, SplitFTError, code_of,
                     translated)
from .metrics import Metrics
from .protocol import Ack, Backward, Bye, Error, Forward, Hello, InputGrads, Output, Sync, Welcome
from .cut import Chain, extract, fingerprint, parse_cut, value_hash

log = logging.getLogger(__name__)

MAX_PENDING_CALLS = 64
_KIND = {"forward": "activation", "output": "activation", "backward": "gradient", "input_grads": "gradient"}


def load_factory(name: str) -> Callable[..., nn.Module]:
    """Import ``"package.module:function"``. Only called for names the operator allowed."""
    module_name, sep, attr = name.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(f"a model factory is written 'package.module:function', got {name!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for factory {name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{module_name!r} has no callable {attr!r}")
    return factory


@dataclass
class _Pending:
    """A forward call's graph, kept until its backward arrives."""

    inputs: list[torch.Tensor]
    in_coded: list[Coded]
    in_grad: list[bool]
    outputs: list[torch.Tensor]
    out_coded: list[Coded]
    sample_ids: np.ndarray | None


class CloudSession:
    """Everything the cloud keeps for one edge."""

    def __init__(self, hello: Hello, factories: dict[str, Callable[..., nn.Module]]) -> None:
        if hello.protocol != protocol.PROTOCOL_VERSION:
            raise HandshakeError(f"edge speaks protocol {hello.protocol}, cloud speaks {protocol.PROTOCOL_VERSION}")
        if hello.factory not in factories:
            raise HandshakeError(
                f"model factory {hello.factory!r} is not served here; this cloud serves: "
                f"{', '.join(sorted(factories)) or '(none)'} (start it with --model {hello.factory})"
            )
        self.id = secrets.token_hex(4)
        try:
            model = factories[hello.factory](**hello.factory_kwargs)
        except TypeError as exc:
            raise HandshakeError(f"factory {hello.factory!r} rejected its arguments: {exc}") from exc
        spec = parse_cut(model, hello.cut, hello.rejoin)
        self.ushape = spec.ushape
        self.chain: Chain = extract(model, spec)
        del model  # keep only the cloud part alive
        mine = fingerprint(self.chain)
        if mine != hello.fingerprint:
            raise HandshakeError(
                f"the cloud part of {hello.factory!r} cut at {hello.cut!r} differs between edge and cloud "
                f"(parameter names/shapes fingerprint {hello.fingerprint} vs {mine}); "
                "both sides must build the same architecture (same factory arguments, same code version)"
            )
        if hello.weights is not None:
            self.chain.load_qualified_state_dict(_tensors(hello.weights, "weights"))
        elif hello.value_hash is not None and hello.value_hash != value_hash(self.chain):
            raise HandshakeError(
                "the cloud part's initial weights differ between edge and cloud; make the factory "
                "deterministic (load the same checkpoint, seed it) or let the edge push them (weights='push')"
            )
        if not isinstance(hello.codecs, dict) or set(hello.codecs) != set(SLOTS) \
                or not all(isinstance(v, str) for v in hello.codecs.values()):
            raise HandshakeError(f"codecs must name a spec for each of {SLOTS}, got {hello.codecs!r}")
        try:
            canonical = {slot: compressors.canonical_spec(spec) for slot, spec in hello.codecs.items()}
        except compressors.CompressionError as exc:
            raise HandshakeError(f"edge asked for a codec this cloud cannot run: {exc}") from exc
        if canonical != hello.codecs:
            raise HandshakeError(f"codec specs are not in canonical form: {hello.codecs} (expected {canonical})")
        self.codecs = SlotCodecs(hello.codecs, hello.seed)
        self.optimizer: torch.optim.Optimizer | None = None
        self.loss_fn: nn.Module | None = None
        self.pending: OrderedDict[int, _Pending] = OrderedDict()
        # eager calls' parameter gradients, for an incoming gradient of 1, until the edge says how to scale them
        self.deferred: OrderedDict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = OrderedDict()
        self.steps = 0
        self.metrics = Metrics()
        self.last_seen = time.monotonic()

    # ------------------------------------------------------------ operations mirrored from the edge

    def apply_ops(self, ops: list) -> None:
        for op in ops:
            if not isinstance(op, dict) or not isinstance(op.get("op"), str):
                raise ProtocolError(f"an operation must be a map with an 'op' name, got {op!r}")
            handler = getattr(self, f"_op_{op['op']}", None)
            if handler is None:
                raise ProtocolError(f"unknown operation {op['op']!r}")
            handler(op)

    def _op_optimizer(self, op: dict) -> None:
        cls = getattr(torch.optim, str(op.get("name")), None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise ConfigError(f"{op.get('name')!r} is not a torch.optim optimizer")
        settings = op.get("settings") or {}
        if not isinstance(settings, dict):
            raise ProtocolError("optimizer settings must be a map")
        try:
            self.optimizer = cls(self.chain.parameters(), **settings)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot build {cls.__name__} with {settings}: {exc}") from exc

    def _op_loss(self, op: dict) -> None:
        cls = getattr(nn, str(op.get("name")), None)
        if not (isinstance(cls, type) and issubclass(cls, nn.modules.loss._Loss)):
            raise ConfigError(f"{op.get('name')!r} is not a torch.nn loss")
        settings = op.get("settings") or {}
        try:
            self.loss_fn = cls(**settings)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"cannot build {cls.__name__} with {settings}: {exc}") from exc

    def _op_step(self, op: dict) -> None:
        if self.optimizer is None:
            raise ConfigError("the edge stepped its optimizer, but none was attached: call model.attach(optimizer)")
        lr = op.get("lr")
        if isinstance(lr, (int, float)) and not isinstance(lr, bool):
            for group in self.optimizer.param_groups:
                group["lr"] = lr
        self.optimizer.step()
        self.steps += 1
        self.pending.clear()  # graphs from before a step can no longer be backpropagated correctly
        self.deferred.clear()

    def _op_apply(self, op: dict) -> None:
        """The edge backpropagated through an eager call: add its parameter gradients, scaled."""
        call, scale = op.get("call"), op.get("scale")
        if not isinstance(call, int) or not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ProtocolError(f"apply needs an int call and a number scale, got {op!r}")
        deferred = self.deferred.get(call)
        if deferred is None:
            raise ProtocolError(f"no eager call {call} to apply (freed by an optimizer step, or never sent)")
        with torch.no_grad():
            for param, grad in deferred:
                if grad is None:
                    continue
                if param.grad is None:
                    param.grad = grad * scale
                else:
                    param.grad.add_(grad, alpha=scale)

    def _op_zero_grad(self, op: dict) -> None:
        set_to_none = op.get("set_to_none", True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=bool(set_to_none))
        else:
            self.chain.zero_grad(set_to_none=bool(set_to_none))

    # ------------------------------------------------------------ requests

    def forward(self, msg: Forward) -> Output:
        compute = codec = 0.0
        ctx = CodecContext("activation", train=msg.train, step=msg.step, sample_ids=msg.sample_ids)
        if msg.sample_ids is not None and (msg.sample_ids.ndim != 1 or msg.sample_ids.dtype != np.int64):
            raise ProtocolError("sample_ids must be a 1-D int64 array")
        args_entries, args_skel = from_wire(msg.args)
        kw_entries, kw_skel = from_wire(msg.kwargs)
        target_entries, target_skel = from_wire(msg.target)
        if not isinstance(args_skel, list) or not isinstance(kw_skel, dict):
            raise ProtocolError("forward args must be a list and kwargs a map")
        if msg.target is not None and self.ushape:
            raise ProtocolError("a U-shape session computes no loss in the cloud; send no target")
        start = time.perf_counter()
        tensors, in_coded = [], []
        for entries, stream in ((args_entries, stream_index(args_skel)), (kw_entries, None), (target_entries, None)):
            decoded, coded = self.codecs.decode(entries, stream, "fwd", ctx)
            tensors += decoded
            in_coded += coded
        grads = [g and msg.grad for _, g in (*args_entries, *kw_entries, *target_entries)]
        leaves = [t.detach().requires_grad_() if g and t.is_floating_point() else t for t, g in zip(tensors, grads)]
        codec += time.perf_counter() - start
        n_args, n_kw = len(args_entries), len(kw_entries)
        args = unflatten(args_skel, leaves[:n_args])
        kwargs = unflatten(kw_skel, leaves[n_args:n_args + n_kw])
        target = unflatten(target_skel, leaves[n_args + n_kw:])

        start = time.perf_counter()
        self.chain.train(msg.train)
        with torch.set_grad_enabled(msg.grad):
            value = self.chain(*args, **kwargs)
            if target is not None:
                if self.loss_fn is None:
                    raise ConfigError("a target arrived but no loss was configured: use model.remote_loss(criterion)")
                value = self.loss_fn(value, target)
        compute += time.perf_counter() - start

        start = time.perf_counter()
        outs, out_skel = flatten(value)
        stream = stream_index(out_skel) if self.ushape else None
        out_grads = [t.requires_grad for t in outs]
        traffic = Traffic()
        entries, out_coded = self.codecs.encode(outs, stream, "ret", ctx, out_grads, traffic)
        codec += time.perf_counter() - start
        eager_grads = None
        if msg.grad and msg.eager and target is not None and value.dim() == 0 and value.requires_grad:
            # One round trip per step: backpropagate now for an incoming gradient of 1; the edge
            # scales the cut's gradient itself and tells us (op "apply") how to scale ours.
            start = time.perf_counter()
            needed = [leaf for leaf, g in zip(leaves, grads) if g]
            params = [p for p in self.chain.parameters() if p.requires_grad]
            found = torch.autograd.grad(value, needed + params, allow_unused=True)
            compute += time.perf_counter() - start
            self.deferred[msg.call] = list(zip(params, found[len(needed):]))
            while len(self.deferred) > MAX_PENDING_CALLS:
                self.deferred.popitem(last=False)
            by_leaf = iter(found[:len(needed)])
            leaf_grads = [next(by_leaf) if g else None for g in grads]
            start = time.perf_counter()
            eager_grads = self._encode_input_grads(leaves, in_coded, grads, leaf_grads, CodecContext(
                "gradient", train=True, step=self.steps, sample_ids=msg.sample_ids))
            codec += time.perf_counter() - start
        elif msg.grad:
            self.pending[msg.call] = _Pending(leaves, in_coded, grads, outs, out_coded, msg.sample_ids)
            while len(self.pending) > MAX_PENDING_CALLS:
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
        outputs, grads = [], []
        for out, coded, slot in zip(pending.outputs, pending.out_coded, skeleton):
            if slot is None or not out.requires_grad:
                continue
            (grad,), _ = self.codecs.decode([got[slot.index]], 0 if coded.stream else None, "ret_bwd", ctx)
            grad = self.codecs.grad_at_input(grad, coded, "ret", ctx)
            if grad.shape != out.shape:
                raise ProtocolError(f"gradient of shape {tuple(grad.shape)} for an output of shape {tuple(out.shape)}")
            if not torch.isfinite(grad).all():
                raise ProtocolError("gradient contains NaN or Inf")
            outputs.append(out)
            grads.append(grad)
        codec += time.perf_counter() - start

        start = time.perf_counter()
        if outputs:
            torch.autograd.backward(outputs, grads)
        compute += time.perf_counter() - start

        start = time.perf_counter()
        entries = self._encode_input_grads(pending.inputs, pending.in_coded, pending.in_grad,
                                           [leaf.grad for leaf in pending.inputs], ctx)
        codec += time.perf_counter() - start
        return InputGrads(call=msg.call, grads=entries, timings={"compute": compute, "codec": codec})

    def state(self) -> dict[str, np.ndarray]:
        return {k: v.detach().cpu().numpy() for k, v in self.chain.qualified_state_dict().items()}


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
    """

    def __init__(self, listener: transports.Listener, factories: Iterable[str], *, max_sessions: int = 0,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.listener = listener
        names = list(factories)
        self.factories = {name: load_factory(name) for name in names}
        self.max_sessions = max_sessions
        self.sessions: dict[bytes, CloudSession] = {}
        self.ended = 0
        self.stop_event = threading.Event()
        self._on_event = on_event or (lambda text: log.info("%s", text))

    def _event(self, text: str) -> None:
        self._on_event(text)

    def serve(self, poll: float = 0.2) -> None:
        """Handle messages until stopped, or until ``max_sessions`` sessions have ended."""
        try:
            while not self.stop_event.is_set():
                if self.max_sessions and self.ended >= self.max_sessions and not self.sessions:
                    break
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

    def handle(self, peer: bytes, frames: list) -> None:
        """Answer one message. Never raises for anything the peer sent."""
        reply: protocol.Message | None
        msg: protocol.Message | None = None
        try:
            msg = protocol.decode(frames)
            before = self.sessions.get(peer)
            reply = self._dispatch(peer, msg)
            session = self.sessions.get(peer) or before
            if session is not None:
                session.metrics.count("up", _KIND.get(msg.TYPE, "control"),
                                      wire=transports.message_nbytes(frames))
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 — a bad request must never stop the server
            if not isinstance(exc, (SplitFTError, compressors.CompressionError)):
                log.exception("internal error while serving peer %s", peer.hex())
            call = getattr(msg, "call", 0)
            reply = Error(code=code_of(exc), message=f"{type(exc).__name__}: {exc}",
                          call=call if isinstance(call, int) else 0)
        if reply is not None:
            self._send(peer, reply)

    def _send(self, peer: bytes, reply: protocol.Message) -> None:
        session = self.sessions.get(peer)
        try:
            wire = self.listener.send(peer, protocol.encode(reply))
        except transports.TransportError as exc:
            log.warning("cannot reply to peer %s: %s", peer.hex(), exc)
            return
        if session is not None:
            session.metrics.count("down", _KIND.get(reply.TYPE, "control"), wire=wire)

    def _dispatch(self, peer: bytes, msg: protocol.Message) -> protocol.Message | None:
        if isinstance(msg, Hello):
            if peer in self.sessions:
                self._end(peer, "replaced by a new hello")
            session = CloudSession(msg, self.factories)
            self.sessions[peer] = session
            self._event(f"session {session.id} opened: {msg.factory} cut at {msg.cut}"
                        f"{' rejoin ' + str(msg.rejoin) if msg.rejoin else ''}, codecs "
                        f"{msg.codecs['fwd']} / {msg.codecs['bwd']}")
            return Welcome(session=session.id, server=f"splitft {protocol.PROTOCOL_VERSION}")
        session = self.sessions.get(peer)
        if session is None:
            if isinstance(msg, Bye):
                return None
            raise ProtocolError(f"no session for this peer: send a hello first (got {msg.TYPE})")
        session.last_seen = time.monotonic()
        if isinstance(msg, Forward):
            session.apply_ops(msg.ops)
            return session.forward(msg)
        if isinstance(msg, Backward):
            session.apply_ops(msg.ops)
            return session.backward(msg)
        if isinstance(msg, Sync):
            session.apply_ops(msg.ops)
            return Ack(state=session.state() if msg.want_state else None)
        if isinstance(msg, Bye):
            try:
                session.apply_ops(msg.ops)
            finally:
                self._end(peer, msg.reason or "edge said goodbye")
            return Ack()
        raise ProtocolError(f"a {msg.TYPE} message is not a request the cloud answers")

    def _end(self, peer: bytes, reason: str) -> None:
        session = self.sessions.pop(peer, None)
        if session is not None:
            self.ended += 1
            self._event(f"session {session.id} ended after {session.steps} steps: {reason}")

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


__all__ = ["CloudServer", "CloudSession", "load_factory", "serve_in_thread", "PeerGone"]
