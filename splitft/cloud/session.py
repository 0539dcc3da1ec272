"""One edge's session: its cloud half, codecs, optimizer and the graphs awaiting their backward.

A session owns the cloud part (built from an allowed factory), its codecs, its optimizer and the
graphs of forward calls awaiting their backward. What it holds counts against its memory budget
(:mod:`splitft.cloud.budget`): a request is priced before its tensors are decoded, and a graph is
measured before it is kept.

Many edges. By default each session has its own copy of the cloud part. With ``shared_model``
every session that asks for the same model and cut trains one :class:`SharedPart`, in the order
requests arrive (sequential split learning): each session still has its own codec state,
sequence numbers, loss and gradient buffers, so one edge's accumulated gradients never leak into
another's step.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

import compressors
from compressors import CodecContext

from ..wire import operations as o
from ..wire import protocol
from .budget import GraphMeter, MemoryBook, model_nbytes, tensors_nbytes
from ..wire.coding import SLOTS, Coded, SlotCodecs, Traffic, _Leaf, expansions, flatten, from_wire, stream_index, \
    to_wire, unflatten
from ..cut import Chain, value_hash
from ..devices import Placement, autocast_region
from ..errors import ConfigError, HandshakeError, ModelError, ProtocolError
from .build import build_chain
from .limits import Limits
from ..metrics import Metrics
from .codec_policy import Policy
from ..wire.protocol import Backward, Forward, Hello, InputGrads, Output
from . import prices
from .caches import SessionCaches
from .blame import Stopwatch, blame
from .handlers import apply_ops, cast_weights, check_norm_type
from .costs import HalfCost, Pace
from .randomness import SessionRandom, half_kind

log = logging.getLogger(__name__)


def hello_identity(hello: Hello) -> dict[str, Any]:
    """What a resumed session must agree on with the one it resumes."""
    return {"factory": hello.factory, "factory_kwargs": hello.factory_kwargs, "cut": hello.cut,
            "rejoin": hello.rejoin, "fingerprint": hello.fingerprint, "codecs": hello.codecs, "seed": hello.seed}


def check_codecs(codecs: Any) -> None:
    """The hello names a canonical codec spec for every slot."""
    if not isinstance(codecs, dict) or set(codecs) != set(SLOTS) \
            or not all(isinstance(v, str) for v in codecs.values()):
        raise HandshakeError(f"codecs must name a spec for each of {SLOTS}, got {codecs!r}")
    try:
        canonical = {slot: compressors.canonical_spec(spec) for slot, spec in codecs.items()}
    except compressors.CompressionError as exc:
        raise HandshakeError(f"edge asked for a codec this cloud cannot run: {exc}") from exc
    if canonical != codecs:
        raise HandshakeError(f"codec specs are not in canonical form: {codecs} (expected {canonical})")


def tensors_from_wire(arrays: Any, what: str) -> dict[str, torch.Tensor]:
    if not isinstance(arrays, dict) or not all(isinstance(v, np.ndarray) for v in arrays.values()):
        raise ProtocolError(f"{what} must map names to arrays")
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


@dataclass
class Pending:
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
    nbytes: int = 0  # what the graph holds: its inputs, outputs and the tensors saved for backward
    flops: int = 0  # its forward's arithmetic (its backward costs twice that) and its decode's
    decode_flops: int = 0


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
    rounds: Any = None  # synchronous data-parallel rounds (:mod:`.rounds`), or None: steps in arrival order
    policy: Any = None  # what edges may set on it: the cloud's (:mod:`.shared_policy`); None: no optimizer


@dataclass
class _Inputs:
    """A forward request's tensors, decoded, and how to put them back into arguments."""

    tensors: list[torch.Tensor]
    coded: list[Coded]
    grads: list[bool]
    skeletons: tuple[Any, Any, Any]
    counts: tuple[int, int]
    decode_flops: int = 0  # what decoding them took, priced before it was done


class CloudSession:
    """Everything the cloud keeps for one edge.

    Args:
        hello: the edge's handshake.
        factories: the model factories this cloud serves.
        limits: what the session may keep (pending graphs, replies, memory).
        shared: a cloud part shared with other sessions (``shared_model``), or None for a copy
            of its own.
        restoring: the weights come from a checkpoint, not from the hello.
        policy: the codecs and codec options this cloud accepts.
        admit: called with a model's estimated bytes before it is built; may refuse it.
        placement: the device (and dtype) the half computes in (default: the CPU).
    """

    #: Its heavy requests may run on a worker thread (:mod:`.jobs`) while the server serves others.
    off_thread = True
    #: Its forward can be priced by running the half on the meta device (:mod:`.pricing`).
    count_on_meta = True

    def __init__(self, hello: Hello, factories: dict[str, Callable[..., nn.Module]],
                 limits: Limits | None = None, shared: SharedPart | None = None,
                 restoring: bool = False, policy: Policy | None = None,
                 admit: Callable[[int], None] | None = None, placement: Placement | None = None) -> None:
        if hello.protocol != protocol.PROTOCOL_VERSION:
            raise HandshakeError(f"the edge speaks protocol {hello.protocol}, this cloud speaks "
                                 f"{protocol.PROTOCOL_VERSION}; install the same splitft version on both")
        self.limits = limits or Limits()
        self.policy = policy or Policy()
        self.id = secrets.token_hex(8)
        self.token = secrets.token_hex(16)
        self.identity = hello_identity(hello)
        self.nonce = hello.nonce
        check_codecs(hello.codecs)
        self.policy.check(hello.codecs)
        self.shared = shared
        if shared is not None:
            self.chain, self.ushape = shared.chain, shared.ushape
        else:
            self.chain, self.ushape = build_chain(hello, factories, self.limits, admit)
        if not restoring and not (shared is not None and shared.initialized):
            self._initial_weights(hello)
        self.placement = placement or Placement()
        self.placement.place(self.chain)
        self.random = SessionRandom(hello.seed, self.placement.device, kind=half_kind(hello))
        self.cost, self.pace = HalfCost(self.chain), Pace()  # what its requests cost, and how fast they run
        self.codecs = SlotCodecs(hello.codecs, hello.seed, bounds=self.policy.bounds)
        #: What this session's own copy of the cloud half holds when trained (0 for a shared half).
        self.model_bytes = model_nbytes(self.chain) if shared is None else 0
        self.trained = restoring  # a forward arrived: the session is doing work
        self.own_optimizer: torch.optim.Optimizer | None = None
        self.optimizer_spec: o.AttachOptimizer | None = None
        self.optimizer_id = 0
        self.flipped: list[nn.Module] = []  # modules the edge runs in the other mode (SetModes)
        self.caches = SessionCaches()  # key/value caches for generation
        self.loss_fn: nn.Module | None = None
        self.loss_spec: o.SetLoss | None = None
        self.pending: OrderedDict[int, Pending] = OrderedDict()
        # eager calls' parameter gradients, for an incoming gradient of 1, until the edge says how to scale them
        self.deferred: OrderedDict[int, list[tuple[torch.Tensor, torch.Tensor | None]]] = OrderedDict()
        self.steps = 0
        self.metrics = Metrics()
        self.last_seen = time.monotonic()
        # Request sequence numbers: the last one applied, and the replies to the last few.
        self.last_seq = 0
        self.replies: OrderedDict[int, tuple[str, list, int]] = OrderedDict()  # seq → (type, frames, bytes)
        self.reply_bytes = 0
        self.duplicates = 0  # repeated requests answered from the cache, repeated steps skipped
        self._grads: list[torch.Tensor | None] | None = None  # shared model: this session's gradients
        self.book: MemoryBook | None = None  # the server's, set when the session is bound
        self.origin = ""  # who opened it (address or key), for the per-origin cap
        if shared is not None:
            shared.initialized = True
            shared.sessions += 1

    def _initial_weights(self, hello: Hello) -> None:
        """Load the weights the edge pushed, or check that the factory's equal the edge's."""
        with blame(HandshakeError, "the weights the edge pushed cannot be loaded"):
            if hello.weights is not None:  # checked in the half's dtypes before any is loaded
                self.chain.load_qualified_state_dict(cast_weights(self.chain, hello.weights, "the pushed weights"))
            elif hello.value_hash is not None and hello.value_hash != value_hash(self.chain):
                raise HandshakeError(
                    "the cloud part's initial weights differ between edge and cloud; make the factory "
                    "deterministic (load the same checkpoint, seed it) or let the edge push them (weights='push')"
                )

    # ------------------------------------------------------------ memory

    def held_bytes(self) -> int:
        """What this session holds now (see :mod:`splitft.cloud.budget`)."""
        pending = sum(p.nbytes for p in self.pending.values())
        deferred = sum(tensors_nbytes(g for _, g in d) for d in self.deferred.values())
        return (self.model_bytes + self.codecs.held_nbytes() + pending + deferred + self.reply_bytes
                + self.caches.nbytes())

    def fits(self, extra: int, what: str) -> None:
        """Refuse work that would take this session (or the cloud) over its memory budget."""
        if self.book is not None:
            self.book.check(self.id, self.held_bytes(), extra, what)

    def _check_decode(self, groups: list[tuple[list, Any, int | None]], slot: str, ctx: CodecContext,
                      what: str) -> int:
        """Bound what decoding a request's tensors will allocate and compute, before anything is
        decoded; returns the arithmetic. ``groups`` holds (entries, skeleton, stream index) per tree.
        """
        nbytes = 0
        with blame(ProtocolError, f"a tensor in the {what} cannot be decoded"):
            for entries, skeleton, stream in groups:
                nbytes += self.codecs.decode_cost(entries, stream, slot, ctx, expansions(skeleton))
            flops = prices.check_decode(self, groups, slot, ctx, what)
        self.limits.check_decoded(nbytes, f"this {what}")
        self.fits(nbytes, f"decoding this {what}")
        return flops

    # ------------------------------------------------------------ the optimizer (own or shared)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.shared.optimizer if self.shared is not None else self.own_optimizer

    @contextmanager
    def own_grads(self) -> Iterator[None]:
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

    # ------------------------------------------------------------ forward

    def _run(self, inputs: _Inputs, train: bool, grad: bool,
             autocast: str | None = None) -> tuple[list[torch.Tensor], Any, int]:
        """Run the cloud part (and the loss) on decoded inputs.

        Returns (input leaves, value, bytes autograd saved for the backward).
        """
        args_skel, kw_skel, target_skel = inputs.skeletons
        n_args, n_kw = inputs.counts
        leaves = [t.detach().requires_grad_() if g and t.is_floating_point() else t
                  for t, g in zip(inputs.tensors, inputs.grads)]
        cast = [self.placement.cast_in(t) for t in leaves[:n_args + n_kw]]  # in the graph: grads keep the edge's dtype
        args, kwargs = self.caches.bind((unflatten(args_skel, cast[:n_args]),
                                         unflatten(kw_skel, cast[n_args:n_args + n_kw])))
        target = unflatten(target_skel, leaves[n_args + n_kw:])
        self.chain.train(train)
        for module in self.flipped:
            module.train(not train)
        if self.flipped:
            self.random.on_its_own()
        caching = self.caches.named((args_skel, kw_skel))
        try:
            with torch.set_grad_enabled(grad), blame(ModelError, "the cloud part failed on the inputs the edge sent"), \
                    GraphMeter(self.chain) as meter, autocast_region(autocast, self.placement.device), \
                    self.random.active(train):
                value = self._edge_dtype(self.chain(*args, **kwargs), inputs.tensors)
                if target is not None:
                    if self.loss_fn is None:
                        raise ConfigError("a target arrived but no loss was configured: use "
                                          "model.remote_loss(criterion)")
                    value = self.loss_fn(value, target)
            if caching:
                self.fits(0, "the key/value cache")  # it grew: it must fit
        except BaseException:
            self.caches.drop(caching)  # a failed step leaves no half-filled cache behind
            raise
        return leaves, value, meter.nbytes

    def _edge_dtype(self, value: Any, received: list[torch.Tensor]) -> Any:
        """A half kept in another dtype (``--dtype``) answers in the edge's floating dtype."""
        if self.placement.dtype is None:
            return value
        edge = next((t.dtype for t in received if t.is_floating_point()), torch.float32)
        outs, skeleton = flatten(value)
        return unflatten(skeleton, [t.to(edge) if t.is_floating_point() else t for t in outs])

    def _context(self, role: compressors.base.Role, train: bool, step: int, sample_ids: Any) -> CodecContext:
        """A codec context for this session: decodes land on the half's device."""
        return CodecContext(role, train=train, step=step, sample_ids=sample_ids, device=self.placement.device)

    def _decode_forward(self, msg: Forward, ctx: CodecContext) -> _Inputs:
        """A forward request's tensors, priced, then decoded and checked."""
        if msg.sample_ids is not None and (msg.sample_ids.ndim != 1 or msg.sample_ids.dtype != np.int64):
            raise ProtocolError("sample_ids must be a 1-D int64 array")
        args_entries, args_skel = from_wire(msg.args)
        kw_entries, kw_skel = from_wire(msg.kwargs)
        target_entries, target_skel = from_wire(msg.target)
        if not isinstance(args_skel, list) or not isinstance(kw_skel, dict):
            raise ProtocolError("forward args must be a list and kwargs a map")
        if msg.target is not None and self.ushape:
            raise ProtocolError("a U-shape session computes no loss in the cloud; send no target")
        groups = [(args_entries, args_skel, stream_index(args_skel)), (kw_entries, kw_skel, None),
                  (target_entries, target_skel, None)]
        decode = self._check_decode(groups, "fwd", ctx, "forward request")
        self.trained = True
        tensors, in_coded = [], []
        with blame(ProtocolError, "a tensor in the forward request cannot be decoded"):
            for entries, _skeleton, stream in groups:
                decoded, coded = self.codecs.decode(entries, stream, "fwd", ctx)
                tensors += decoded
                in_coded += coded
        for tensor, coded in zip(tensors, in_coded):
            if coded.stream and tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise ProtocolError("the activation contains NaN or Inf; the edge part diverged or the data is bad")
        grads = [g and msg.grad for _, g in (*args_entries, *kw_entries, *target_entries)]
        return _Inputs(tensors, in_coded, grads, (args_skel, kw_skel, target_skel),
                       (len(args_entries), len(kw_entries)), decode)

    def forward(self, msg: Forward) -> Output:
        watch = Stopwatch()
        ctx = self._context("activation", msg.train, msg.step, msg.sample_ids)
        with watch("codec"):
            inputs = self._decode_forward(msg, ctx)
        flops = prices.forward(self, msg, inputs)  # refused here, before the half runs
        with watch("compute"):
            leaves, value, saved = self._run(inputs, msg.train, msg.grad, msg.autocast)
        with watch("codec"):
            outs, out_skel = flatten(value)
            stream = stream_index(out_skel) if self.ushape else None
            entries, out_coded = self.codecs.encode(outs, stream, "ret", ctx, [t.requires_grad for t in outs],
                                                    Traffic())
        eager_grads, unreached = None, None
        if (msg.grad and msg.eager and msg.target is not None and self.shared is None
                and isinstance(value, torch.Tensor) and value.dim() == 0 and value.requires_grad):
            eager_grads = self._eager_backward(msg, value, leaves, inputs, watch)
            unreached = [self._param_names[id(p)] for p, g in self.deferred[msg.call] if g is None] or None
        elif msg.grad:
            self._keep_graph(msg, leaves, inputs, outs, out_coded, saved, flops)
        return Output(call=msg.call, value=to_wire(out_skel, entries), timings=watch.seconds, grads=eager_grads,
                      unreached=unreached)

    def _eager_backward(self, msg: Forward, loss: torch.Tensor, leaves: list[torch.Tensor], inputs: _Inputs,
                        watch: Stopwatch) -> list[dict | None]:
        """One round trip per step: backpropagate now for an incoming gradient of 1.

        The edge scales the cut's gradient itself and tells us (operation ``apply``) how to scale
        ours. (Not for a shared cloud half: another edge's step would make these gradients stale.)
        """
        with watch("compute"):
            needed = [leaf for leaf, g in zip(leaves, inputs.grads) if g]
            params = [p for p in self.chain.parameters() if p.requires_grad]
            with blame(ModelError, "the cloud part's backward failed"):
                found = torch.autograd.grad(loss, needed + params, allow_unused=True)
        self.fits(tensors_nbytes(found[len(needed):]), "keeping this call's parameter gradients")
        self.deferred[msg.call] = list(zip(params, found[len(needed):]))
        while len(self.deferred) > self.limits.max_pending_calls:
            self.deferred.popitem(last=False)
        by_leaf = iter(found[:len(needed)])
        leaf_grads = [next(by_leaf) if g else None for g in inputs.grads]
        with watch("codec"):
            return self._encode_input_grads(leaves, inputs.coded, inputs.grads, leaf_grads,
                                            self._context("gradient", True, self.steps, msg.sample_ids))

    def _keep_graph(self, msg: Forward, leaves: list[torch.Tensor], inputs: _Inputs, outs: list[torch.Tensor],
                    out_coded: list[Coded], saved: int, flops: int = 0) -> None:
        """Keep a forward call's graph for its backward, if it fits the session's memory."""
        def rerun() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            again, value, _ = self._run(inputs, msg.train, True, msg.autocast)
            return again, flatten(value)[0]
        nbytes = saved + tensors_nbytes(leaves) + tensors_nbytes(outs)
        self.fits(nbytes, "keeping this forward call's graph for its backward")
        self.pending[msg.call] = Pending(leaves, inputs.coded, inputs.grads, outs, out_coded, msg.sample_ids,
                                         rerun if self.shared is not None else None,
                                         self.shared.updates if self.shared is not None else 0, nbytes,
                                         flops, inputs.decode_flops)
        while len(self.pending) > self.limits.max_pending_calls:
            dropped, _ = self.pending.popitem(last=False)
            log.warning("session %s: dropping the graph of call %s, never backpropagated", self.id, dropped)

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

    # ------------------------------------------------------------ backward

    def backward(self, msg: Backward) -> InputGrads:
        pending = self.pending.get(msg.call)  # taken once the request is checked: a refusal loses nothing
        if pending is None:
            raise ProtocolError(
                f"no forward call {msg.call} awaits a backward (already backpropagated, run without "
                "grad, or freed by an optimizer step)"
            )
        prices.backward(self, msg, pending)  # refused here, before its gradients are decoded
        watch = Stopwatch()
        ctx = self._context("gradient", True, self.steps, pending.sample_ids)
        with watch("codec"):
            outputs, grads = self._decode_backward(msg, pending, ctx)
        del self.pending[msg.call]
        with watch("compute"):
            if outputs:
                self._backpropagate(msg.call, outputs, grads)
        with watch("codec"):
            entries = self._encode_input_grads(pending.inputs, pending.in_coded, pending.in_grad,
                                               [leaf.grad for leaf in pending.inputs], ctx)
        return InputGrads(call=msg.call, grads=entries, timings=watch.seconds, unreached=self.unreached())

    def _backpropagate(self, call: int, outputs: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
        """The backward of forward call ``call`` (a batch split across ranks overrides it)."""
        with self.own_grads(), blame(ModelError, "backpropagating the edge's gradient failed"):
            torch.autograd.backward(outputs, grads)

    def apply_ops(self, values: list) -> int:
        """Apply the operations the edge mirrored (a batch split across ranks also sends them on)."""
        return apply_ops(self, values)

    def _decode_backward(self, msg: Backward, pending: Pending,
                         ctx: CodecContext) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs to backpropagate from and their gradients, priced, decoded and checked."""
        got, skeleton = from_wire(msg.grads)
        if not isinstance(skeleton, list) or len(skeleton) != len(pending.outputs):
            raise ProtocolError(f"backward carries {len(skeleton) if isinstance(skeleton, list) else '?'} "
                                f"gradients for {len(pending.outputs)} outputs")
        streams = {slot.index for slot, coded in zip(skeleton, pending.out_coded)
                   if isinstance(slot, _Leaf) and coded.stream}
        # The stream's gradient goes through ret_bwd, the others raw.
        self._check_decode([([entry], None, 0 if i in streams else None) for i, entry in enumerate(got)],
                           "ret_bwd", ctx, "backward request")
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
            with blame(ProtocolError, "a gradient in the backward request cannot be decoded"):
                (grad,), _ = self.codecs.decode([got[slot.index]], 0 if coded.stream else None, "ret_bwd", ctx)
                grad = self.codecs.grad_at_input(grad, coded, "ret", ctx)
            if grad.shape != out.shape:
                raise ProtocolError(f"gradient of shape {tuple(grad.shape)} for an output of shape {tuple(out.shape)}")
            # An overflow under loss scaling is legitimate (GradScaler skips that step): it only reaches this
            # session's own gradients. A shared half's would reach the weights every edge trains.
            if self.shared is not None and grad.is_floating_point() and not torch.isfinite(grad).all():
                raise ProtocolError("gradient contains NaN or Inf (refused for a shared cloud part)")
            outputs.append(out)
            grads.append(grad)
        return outputs, grads

    def grad_norms(self, norm_type: float, names: list | None = None) -> list[float | None]:
        """The ``norm_type`` norm of each parameter gradient of the half, or of the ``names``d
        parameters' (for clipping by the global norm); None for a parameter without a gradient."""
        check_norm_type(norm_type)
        params = self.parameters_named(names)
        with torch.no_grad(), self.own_grads():
            return [None if p.grad is None else float(torch.linalg.vector_norm(p.grad, norm_type)) for p in params]

    def unreached(self) -> list[str] | None:
        """After a backward: the parameters that require a gradient and still have none, so the
        edge knows exactly which ``p.grad`` exist there; None when there are none."""
        with self.own_grads():
            names = [name for name, p in self.named_params.items() if p.requires_grad and p.grad is None]
        return names or None

    @property
    def named_params(self) -> dict[str, nn.Parameter]:
        """The half's parameters by unsplit name, in the order :meth:`grad_norms` answers for all."""
        named = self.__dict__.get("_named_params")
        if named is None:
            named = self.__dict__["_named_params"] = self.chain.qualified_parameters()
        return named

    @property
    def _param_names(self) -> dict[int, str]:
        names = self.__dict__.get("_names_by_id")
        if names is None:
            names = self.__dict__["_names_by_id"] = {id(p): n for n, p in self.named_params.items()}
        return names

    def parameters_named(self, names: list | None) -> list[nn.Parameter]:
        """The half's parameters called ``names`` (unsplit names), all of them for None."""
        if names is None:
            return list(self.named_params.values())
        known = self.named_params
        unknown = [n for n in names if not isinstance(n, str) or n not in known]
        if unknown:
            raise ProtocolError(f"the cloud half has no parameter {protocol._short(unknown[0])}")
        return [known[n] for n in dict.fromkeys(names)]

    def state(self) -> dict[str, np.ndarray]:
        """The half's weights on the host (bfloat16, which numpy lacks, as float32)."""
        return {k: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy()
                for k, v in self.weights().items()}

    def weights(self) -> dict[str, torch.Tensor]:
        """The half's whole state under the original model's names (a sharded half gathers it)."""
        return self.chain.qualified_state_dict()


__all__ = ["CloudSession", "Pending", "SharedPart", "check_codecs", "hello_identity", "tensors_from_wire"]
