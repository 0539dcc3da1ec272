"""One edge's session: a composition of rooms, and the compute of its forward and backward calls.

Each piece of a session's state has one owner, the room whose job it is: the half and its
parameters (:class:`~.half.Half`), what the edge mirrored (:class:`~.handlers.Mirrored`: optimizer,
loss, modes, steps), request numbers and replies (:class:`~.replies.Replies`), graphs awaiting
their backward (:class:`~.graphs.Graphs`), its place in the cloud (:class:`~.admission.Seat`), its
pricing (:class:`~.costs.Pricing`), its codecs, generator state and key/value caches. The session
runs a call through them: decode (priced first, :mod:`.calls`), compute, encode. What it holds
counts against its memory budget (:mod:`.budget`): a request is priced before its tensors are
decoded, and a graph is measured before it is kept.

Many edges. By default each session has its own copy of the cloud part. With ``shared_model``
every session that asks for the same model and cut trains one :class:`~.half.SharedPart` (see
:mod:`.half`).
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import compressors
import numpy as np
import torch
from compressors import CodecContext
from torch import nn

from ..devices import Placement, autocast_region
from ..errors import ConfigError, ModelError, ProtocolError
from ..metrics import Metrics
from ..numerics import check_hello as check_numerics
from ..wire.coding import Coded, SlotCodecs, Traffic, expansions, flatten, stream_index, to_wire, unflatten
from ..wire.protocol import Backward, Forward, Hello, InputGrads, Output
from . import prices
from .admission import Seat
from .blame import Stopwatch, blame
from .budget import GraphMeter, tensors_nbytes
from .build import build_chain, check_codecs, check_version, hello_identity
from .caches import SessionCaches, model_config
from .calls import Group, Inputs, decode_backward, decode_forward, edge_dtype, encode_input_grads
from .codec_policy import Policy
from .costs import Pricing
from .passes import PassGrads
from .graphs import Deferred, Graphs, Pending, sole_owners
from .half import Half, SharedPart, host_state, load_initial
from .handlers import Mirrored, apply_ops
from .limits import Limits
from ..generator_state import checked_host_state
from .randomness import SessionRandom, half_kind
from .repeats import Snapshot, refuse_moved
from .replies import Replies

log = logging.getLogger(__name__)


class CloudSession:
    """Everything the cloud keeps for one edge, each piece in the room that owns it.

    Args:
        hello: the edge's handshake.
        factories: the model factories this cloud serves.
        limits: what the session may keep (pending graphs, replies, memory).
        shared: a cloud part shared with other sessions (``shared_model``), or None for a copy
            of its own.
        restoring: the weights come from a checkpoint (or from another rank), not from the hello.
        policy: the codecs and codec options this cloud accepts.
        admit: called with a model's estimated bytes before it is built; may refuse it.
        placement: the device (and dtype) the half computes in (default: the CPU).
        known_as: the session's id and resume token (a session restored from its checkpoint).
        stream: the generator stream its half draws from (a replica on another rank draws its own).
    """

    #: Its heavy requests may run on a worker thread (:mod:`.jobs`) while the server serves others.
    off_thread = True
    #: Its forward can be priced by running the half on the meta device (:mod:`.costs`).
    count_on_meta = True

    def __init__(self, hello: Hello, factories: dict[str, Callable[..., nn.Module]],
                 limits: Limits | None = None, shared: SharedPart | None = None,
                 restoring: bool = False, policy: Policy | None = None,
                 admit: Callable[[int], None] | None = None, placement: Placement | None = None,
                 known_as: tuple[str, str] | None = None, stream: int | None = None) -> None:
        check_version(hello)
        self.limits = limits or Limits()
        self.policy = policy or Policy()
        self.id, self.token = known_as or (secrets.token_hex(8), secrets.token_hex(16))
        self.identity = hello_identity(hello)
        self.nonce = hello.nonce
        check_codecs(hello.codecs)
        self.policy.check(hello.codecs)
        check_numerics(hello.numerics, (placement or Placement()).device)
        chain, ushape = (shared.chain, shared.ushape) if shared is not None else \
            build_chain(hello, factories, self.limits, admit)
        if not restoring and not (shared is not None and shared.initialized):
            load_initial(chain, hello)
        self.half = Half(chain, ushape, shared, placement or Placement())
        device = self.half.placement.device
        self.random = SessionRandom(hello.seed, device, kind=half_kind(hello)) if stream is None else \
            SessionRandom(hello.seed, device, stream=stream)
        self._drew_from = self.random.host  # where the stream was as the half's current forward began
        self.pricing = Pricing(chain)  # what its requests cost, and how fast they run
        self.codecs = SlotCodecs(hello.codecs, hello.seed, bounds=self.policy.bounds)
        self.seat = Seat(trained=restoring)
        self.mirrored = Mirrored(shared)
        self.caches = SessionCaches(model_config(chain))  # key/value caches for generation
        self.through_cache = False  # the last run read a cache holding an earlier call's graph
        self.graphs = Graphs(self.limits.max_pending_calls)
        self.passes = PassGrads()
        self.replies = Replies(self.id)
        self.metrics = Metrics()
        if shared is not None:
            shared.join()

    def sharded(self, placement: Placement, model_bytes: int) -> None:
        """The half was cut into shards across ranks: it computes on ``placement``'s device now
        (its generator stream with it), and this rank holds ``model_bytes`` of it."""
        self.half.sharded(placement, model_bytes)
        self.random = self.random.on(placement.device)

    # ------------------------------------------------------------ memory

    def held_bytes(self) -> int:
        """What this session holds now (see :mod:`splitft.cloud.budget`)."""
        return (self.half.model_bytes + self.codecs.held_nbytes() + self.graphs.nbytes() + self.replies.nbytes
                + self.caches.nbytes() + self.passes.nbytes())

    def fits(self, extra: int, what: str) -> None:
        """Refuse work that would take this session (or the cloud) over its memory budget."""
        self.seat.fits(self.id, self.held_bytes(), extra, what)

    def check_decode(self, groups: list[Group], slot: str, ctx: CodecContext, what: str) -> int:
        """Bound what decoding a request's tensors will allocate and compute, before anything is
        decoded; returns the arithmetic. ``groups`` holds (entries, skeleton, stream index) per tree.
        """
        nbytes = 0
        with blame(ProtocolError, f"a tensor in the {what} cannot be decoded"):
            expanded = [expansions(skeleton) for _, skeleton, _ in groups]
            for (entries, _, stream), expand_to in zip(groups, expanded):
                nbytes += self.codecs.decode_cost(entries, stream, slot, ctx, expand_to)
            flops = prices.check_decode(self, groups, slot, ctx, what, expanded)
        self.limits.check_decoded(nbytes, f"this {what}")
        self.fits(nbytes, f"decoding this {what}")
        return flops

    def context(self, role: compressors.base.Role, train: bool, step: int, sample_ids: Any) -> CodecContext:
        """A codec context for this session: decodes land on the half's device."""
        return CodecContext(role, train=train, step=step, sample_ids=sample_ids, device=self.half.placement.device)

    # ------------------------------------------------------------ forward

    def run(self, inputs: Inputs, train: bool, grad: bool,
            autocast: str | None = None) -> tuple[list[torch.Tensor], Any, GraphMeter]:
        """Run the cloud part (and the loss) on decoded inputs (a batch split across ranks
        overrides it). Returns (input leaves, value, what autograd saved for the backward)."""
        half, mirrored = self.half, self.mirrored
        args_skel, kw_skel, target_skel = inputs.skeletons
        n_args, n_kw = inputs.counts
        leaves = [t.detach().requires_grad_() if g and t.is_floating_point() else t
                  for t, g in zip(inputs.tensors, inputs.grads)]
        # In the graph (grads keep the edge's dtype), through a view where it takes a gradient: the
        # activation is no leaf unsplit, and autocast caches one cast of a leaf for all its readers
        # (a block's query, key and value layers), where each reader of a non-leaf casts its own.
        cast = [half.placement.cast_in(t.view_as(t) if t.requires_grad else t) for t in leaves[:n_args + n_kw]]
        caching = self.caches.named((args_skel, kw_skel))
        seen: dict[int, Any] = {}  # a tensor the edge passed in several places is one object here too
        args = unflatten(args_skel, cast[:n_args], seen)
        kwargs = unflatten(kw_skel, cast[n_args:n_args + n_kw], seen, n_args)
        if caching:  # the session's caches in place of their numbers (a training step names none)
            args, kwargs = self.caches.bind((args, kwargs))
        self.through_cache = bool(caching) and grad and self.caches.hold_graphs(caching)
        target = unflatten(target_skel, leaves[n_args + n_kw:], seen, n_args + n_kw)
        _set_modes(half.chain, train, mirrored.flipped)
        self.random.configured(mirrored.flipped, mirrored.flags)
        try:
            with torch.set_grad_enabled(grad), blame(ModelError, "the cloud part failed on the inputs the edge sent"), \
                    GraphMeter(half.chain, half.parameter_storages()) as meter, \
                    autocast_region(autocast, half.placement.device), self.random.active(train):
                value = edge_dtype(_chain_run(half.chain, args, kwargs), inputs.tensors, half.placement.dtype)
                if target is not None:
                    if mirrored.loss_fn is None:
                        raise ConfigError("a target arrived but no loss was configured: use "
                                          "model.remote_loss(criterion)")
                    value = mirrored.loss_fn(value, target)
            if caching:
                self.fits(0, "the key/value cache")  # it grew: it must fit
        except BaseException:
            self.caches.drop(caching)  # a failed step leaves no half-filled cache behind
            raise
        return leaves, value, meter

    def forward(self, msg: Forward) -> Output:
        self._drew_from = self.random.host
        try:
            return self._forward(msg)
        except ModelError as exc:  # what the half drew before it failed moved the stream: the edge goes on from it
            exc.rng = self._drawn(msg)
            raise

    def _forward(self, msg: Forward) -> Output:
        watch = Stopwatch()
        edge_rng = checked_host_state(msg.rng, "forward.rng") if msg.rng is not None else None
        ctx = self.context("activation", msg.train, msg.step, msg.sample_ids)
        with watch("codec"):
            inputs = decode_forward(msg, self.codecs, ctx, self.half.ushape, self.check_decode,
                                    finite=self.half.shared is not None)
        self.seat.working()
        flops = prices.forward(self, msg, inputs)  # refused here, before the half runs
        stream_at = self.random.host  # where the session's stream is: a repeated forward puts it back
        if edge_rng is not None:
            self.random.follow(edge_rng)
        self._drew_from = self.random.host
        with watch("compute"), self._traceless(msg.again, stream_at):
            leaves, value, saved = self.run(inputs, msg.train, msg.grad, msg.autocast)
        drawn = self._drawn(msg)
        with watch("codec"):
            outs, out_skel = flatten(value)
            stream = stream_index(out_skel) if self.half.ushape else None
            entries, out_coded = self.codecs.encode(outs, stream, "ret", ctx, [t.requires_grad for t in outs],
                                                    Traffic())
        eager_grads, unreached = None, None
        if (msg.grad and msg.eager and msg.target is not None and self.half.shared is None
                and isinstance(value, torch.Tensor) and value.dim() == 0 and value.requires_grad):
            # The graph is kept too, until the edge's backward says how the loss's gradient scales
            # (apply_eager frees it; a backward of its own runs it again for a scale that is not exact).
            self.keep_graph(msg, leaves, inputs, outs, out_coded, saved, flops)
            eager_grads = self._eager_backward(msg, value, leaves, inputs, watch)
            unreached = [self.half.name_of(p) for p, g in self.graphs.deferred[msg.call] if g is None] or None
        elif msg.grad:
            self.keep_graph(msg, leaves, inputs, outs, out_coded, saved, flops)
            if self.through_cache and msg.call in self.graphs.pending:
                self.graphs.pending[msg.call].through_cache = True
        return Output(call=msg.call, value=to_wire(out_skel, entries), timings=watch.seconds, grads=eager_grads,
                      unreached=unreached, rng=drawn)

    def _drawn(self, msg: Forward) -> np.ndarray | None:
        """The stream's state, when the half drew in this forward (not a repeated one) since it began."""
        after, start = self.random.host, self._drew_from
        return None if msg.again or after is start or torch.equal(after, start) else after.numpy()

    @contextmanager
    def _traceless(self, again: bool, rng: torch.Tensor) -> Iterator[None]:
        """A forward repeated for another loss of the same inputs (``forward.again``) leaves the
        half as the first left it, as unsplit the half ran once: its buffers (batch norm's running
        statistics, counted batches), what its modules keep, and its generator stream (``rng``) are
        put back; a repeat that moved more than running statistics is refused (:mod:`.repeats`)."""
        if not again:
            yield
            return
        kept = Snapshot(self.half.chain)
        try:
            yield
        finally:
            self.random.follow(rng)
            moved = kept.put_back()
        refuse_moved(moved)

    def _eager_backward(self, msg: Forward, loss: torch.Tensor, leaves: list[torch.Tensor], inputs: Inputs,
                        watch: Stopwatch) -> list[dict | None]:
        """One round trip per step: backpropagate now for an incoming gradient of 1.

        The edge scales the cut's gradient itself and tells us (operation ``apply``) how to scale
        ours. (Not for a shared cloud half: another edge's step would make these gradients stale.)
        """
        with watch("compute"):
            needed = [leaf for leaf, g in zip(leaves, inputs.grads) if g]
            params: list[torch.Tensor] = [p for p in self.half.named_params.values() if p.requires_grad]
            with blame(ModelError, "the cloud part's backward failed"):
                found = torch.autograd.grad(loss, needed + params, allow_unused=True, retain_graph=True)
        nbytes = tensors_nbytes(found[len(needed):])
        self.fits(nbytes, "keeping this call's parameter gradients")
        deferred: Deferred = list(zip(params, found[len(needed):]))
        self.graphs.defer(msg.call, deferred, nbytes, exclusive=sole_owners(found[:len(needed)], deferred))
        by_leaf = iter(found[:len(needed)])
        leaf_grads = [next(by_leaf) if g else None for g in inputs.grads]
        with watch("codec"):
            return encode_input_grads(self.codecs, leaves, inputs.coded, inputs.grads, leaf_grads,
                                      self.context("gradient", True, self.mirrored.steps, msg.sample_ids))

    def keep_graph(self, msg: Forward, leaves: list[torch.Tensor], inputs: Inputs, outs: list[torch.Tensor],
                   out_coded: list[Coded], saved: GraphMeter, flops: int = 0) -> None:
        """Keep a forward call's graph for its backward, if it fits the session's memory."""
        def rerun() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
            again, value, _ = self.run(inputs, msg.train, True, msg.autocast)
            return again, flatten(value)[0]
        nbytes = saved.nbytes + tensors_nbytes(leaves) + tensors_nbytes(outs)
        self.fits(nbytes, "keeping this forward call's graph for its backward")
        shared = self.half.shared
        pending = Pending(leaves, inputs.coded, inputs.grads, outs, out_coded, msg.sample_ids,
                          rerun if shared is not None else None, shared.updates if shared is not None else 0,
                          nbytes, flops, inputs.decode_flops, saved.saved)
        for dropped in self.graphs.keep(msg.call, pending):
            log.warning("session %s: dropping the graph of call %s, never backpropagated", self.id, dropped)

    # ------------------------------------------------------------ backward

    def backward(self, msg: Backward) -> InputGrads:
        pending = self.graphs.pending.get(msg.call)  # taken once the request is checked: a refusal loses nothing
        if pending is None:
            raise ProtocolError(
                f"no forward call {msg.call} awaits a backward (already backpropagated, run without "
                "grad, or freed by an optimizer step)"
            )
        if pending.through_cache:
            raise ConfigError("a backward through a key/value cache an earlier call filled with gradients on "
                              "(training through a shared prompt's cache): the cloud backpropagates each call at its "
                              "own backward, so the earlier call's part of the gradient would not reach the edge, or "
                              "be computed twice. Forward the prompt and its continuation as one sequence, fill the "
                              "cache under torch.no_grad(), or train with the unsplit model")
        prices.backward(self, msg, pending)  # refused here, before its gradients are decoded
        watch = Stopwatch()
        ctx = self.context("gradient", True, self.mirrored.steps, pending.sample_ids)
        with watch("codec"):
            outputs, grads = decode_backward(msg, pending, self.codecs, ctx, self.half.shared, self.check_decode)
        self.graphs.take(msg.call)
        self.graphs.applied(msg.call)  # an eager call backpropagated again: its gradients for 1 go
        with watch("compute"), _as_computed(pending.inputs) as computed:
            if outputs:
                self._backward_pass(msg, outputs, grads, None if msg.params else _needed(pending.inputs))
        with watch("codec"):
            entries = encode_input_grads(self.codecs, pending.inputs, pending.in_coded, pending.in_grad,
                                         computed, ctx)
        unreached = [name for name in self.half.unreached() or ()
                     if not self.passes.holds(self.half.named_params[name])]  # summed, not in .grad yet
        return InputGrads(call=msg.call, grads=entries, timings=watch.seconds, unreached=unreached or None)

    #: Whether a backward's parameter gradients join the edge's pass (:mod:`.passes`): a batch split
    #: across ranks accumulates on every rank's replica, and leaves its gradients where they land.
    groups_passes = True

    def _backward_pass(self, msg: Backward, outputs: list[torch.Tensor], grads: list[torch.Tensor],
                       only: list[torch.Tensor] | None) -> None:
        """Backpropagate ``msg``'s call, its parameter gradients a contribution to the edge's pass."""
        pass_id = msg.pass_id if self.groups_passes and self.half.shared is None and only is None else None
        if pass_id is None:
            self.passes.flush()
            self.backpropagate(msg.call, outputs, grads, only)
            return
        params = [p for p in self.half.named_params.values() if p.requires_grad]
        before = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            self.backpropagate(msg.call, outputs, grads, only)
            fresh = [(p, p.grad) for p in params]
        finally:
            for p, grad in zip(params, before):
                p.grad = grad
        self.passes.add(pass_id, fresh, owned=True)

    def backpropagate(self, call: int, outputs: list[torch.Tensor], grads: list[torch.Tensor],
                      only: list[torch.Tensor] | None = None) -> None:
        """The backward of forward call ``call`` (a batch split across ranks overrides it); with
        ``only``, into those inputs alone, the half's parameters untouched."""
        if only is not None and not only:
            return  # no input wants a gradient, and the parameters must get none
        with self.half.own_grads(), blame(ModelError, "backpropagating the edge's gradient failed"):
            torch.autograd.backward(outputs, grads, inputs=only)

    # ------------------------------------------------------------ operations and answers

    def apply_ops(self, values: list) -> int:
        """Apply the operations the edge mirrored (a batch split across ranks also sends them on)."""
        return apply_ops(self, values)

    def grad_norms(self, norm_type: float, names: list | None = None) -> list[float | None]:
        """Gradient norms the edge asked for (a sharded half gathers them from every rank)."""
        self.passes.flush()
        return self.half.grad_norms(norm_type, names)

    def grads(self) -> dict[str, np.ndarray]:
        """The half's gradients on the host, by parameter name, where a parameter has one."""
        self.passes.flush()
        return self.half.grads()

    def state(self) -> dict[str, np.ndarray]:
        """The half's weights on the host (bfloat16, which numpy lacks, as float32)."""
        return host_state(self.weights())

    def weights(self) -> dict[str, torch.Tensor]:
        """The half's whole state under the original model's names (a sharded half gathers it)."""
        return self.half.chain.qualified_state_dict()


_CHANGED_IN_PLACE = ("a cloud module changes a tensor it receives from the edge in place (an nn.ReLU(inplace=True) "
                     "first in the cloud half, a statistic added to an argument), or a list or dict it receives (an "
                     "auxiliary loss appended): the edge's, which the model's forward may read again (a skip "
                     "connection, the losses it sums), would not change as unsplit; build that layer with "
                     "inplace=False (in the cloud's factory too), return what it computes, or cut after it")


def _chain_run(chain: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The half's forward; one that changes what it received in place is refused: the edge's
    tensor, which its forward may read again, would not change, where unsplit it does."""
    received = [t for value in (*args, *kwargs.values())
                for t in (value if isinstance(value, (tuple, list)) else (value,)) if isinstance(t, torch.Tensor)]
    versions = [t._version for t in received]
    held = [(value, _contents(value)) for value in (*args, *kwargs.values()) if isinstance(value, (list, dict))]
    try:
        out = chain(*args, **kwargs)
    except RuntimeError as exc:
        if "leaf Variable that requires grad is being used in an in-place operation" not in str(exc):
            raise
        raise ConfigError(_CHANGED_IN_PLACE) from exc
    if any(t._version != version for t, version in zip(received, versions)) or \
            any(_contents(value) != before for value, before in held):
        raise ConfigError(_CHANGED_IN_PLACE)
    return out


def _contents(value: list | dict) -> list[int]:
    """What a list or dict holds, by identity (and its keys): an append or an entry set changes it."""
    return [id(v) for v in value] if isinstance(value, list) else [id(k) for k in value] + [id(v) for v in value.values()]


@contextmanager
def _as_computed(leaves: list[torch.Tensor]) -> Iterator[list[torch.Tensor | None]]:
    """The gradients a backward in the block brings the received tensors, as computed (filled in
    after it): a leaf's ``.grad`` takes the leaf's layout (torch's layout contract), where unsplit
    the activation's gradient kept the one its backward made (a transposed one, from a layer that
    computes in another order), which the edge's backward then rounds by."""
    computed: list[torch.Tensor | None] = []
    raw: dict[int, torch.Tensor] = {}
    hooks = [leaf.register_hook(functools.partial(raw.__setitem__, i)) for i, leaf in enumerate(leaves)
             if leaf.requires_grad and leaf.grad is None]  # one gradient: what .grad holds, in its own layout
    try:
        yield computed
    finally:
        for hook in hooks:
            hook.remove()
    computed.extend(raw.get(i, leaf.grad) for i, leaf in enumerate(leaves))


def _needed(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    return [leaf for leaf in inputs if leaf.requires_grad]


def _set_modes(chain: nn.Module, train: bool, flipped: list[nn.Module]) -> None:
    """Put the half in ``train`` mode but ``flipped`` in the other, walking its modules only when
    that differs from the last call's (a walk per message is ~2 us a module; a shared half's
    sessions may differ, so what was set is kept on the half itself)."""
    modes = (train, tuple(map(id, flipped)))
    if chain.__dict__.get("_splitft_modes") == modes:
        return
    chain.train(train)
    for module in flipped:
        module.train(not train)
    chain.__dict__["_splitft_modes"] = modes


__all__ = ["CloudSession"]
