"""The price of each request a session serves, from :mod:`.costs`' parts.

Two moments. Before anything of a request is done, :func:`guess` says roughly what it will cost,
so the server can tell work it may do on its serving thread from work it must hand to a worker
(:mod:`.jobs`); a guess never refuses anything and never raises, so a request fails, if it does,
at the same point and in the same order as it always did. Then, inside the work, each stage is
priced exactly before it is spent and refused over ``Limits.max_request_flops``: a forward's
decode from its payloads' metadata (:func:`check_decode`), its compute once its inputs are
decoded and before they reach the half (:func:`forward`), a backward before its gradients are
decoded (:func:`backward`).
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import numpy as np
import torch
from compressors import CodecContext

from ..wire import expressions
from ..wire import tree as trees
from ..wire.coding import CacheRef, Coded, SlotCodecs, expansions, flatten, from_wire, stream_index, unflatten
from ..wire.protocol import Backward, Forward, Message, Sync
from .calls import Group, Inputs, forward_trees
from .costs import BACKWARD_FACTOR, STEP_FLOPS_PER_PARAM, Price, Pricing, check
from .graphs import Graphs, Pending
from .half import Half
from .handlers import Mirrored
from .limits import Limits

log = logging.getLogger(__name__)

class Priced(Protocol):
    """What pricing reads of a session."""

    @property
    def id(self) -> str: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def codecs(self) -> SlotCodecs: ...

    @property
    def half(self) -> Half: ...

    @property
    def mirrored(self) -> Mirrored: ...

    @property
    def graphs(self) -> Graphs: ...

    @property
    def pricing(self) -> Pricing: ...

    @property
    def count_on_meta(self) -> bool: ...

    def context(self, role: Any, train: bool, step: int, sample_ids: Any) -> CodecContext: ...


#: Mirrored operations that touch every parameter once or so.
_PER_PARAM_OPS = {"zero_grad", "scale_grads", "clamp_grads", "apply", "optimizer", "add_param_group", "frozen"}


def state_nbytes(session: Priced) -> int:
    """What a checkpoint of ``session`` writes, at most: its half's trained state and its codecs'."""
    return session.half.model_bytes + session.codecs.held_nbytes()


def new_steps(ops: Any) -> int:
    """How many optimizer steps a request's operations may add (the upper bound: none repeated)."""
    if not isinstance(ops, list):
        return 0
    return sum(1 for value in ops if isinstance(value, dict) and value.get("op") == "step")


def guess(session: Priced, msg: Message, checkpoint: bool) -> Price:
    """A request's price before any of it is done (a forward's compute from its last ratio)."""
    price = Price(checkpoint_bytes=state_nbytes(session) if checkpoint else 0)
    try:
        price.flops = _ops(session, getattr(msg, "ops", []))
        if isinstance(msg, Forward):
            decode = sum(session.codecs.decode_flops(*group) for group in _forward_groups(session, msg))
            passes = 1 + (BACKWARD_FACTOR if msg.grad and msg.eager else 0)
            price.flops += decode + passes * session.pricing.cost.guess(decode)
        elif isinstance(msg, Backward) and msg.call in session.graphs.pending:
            price.flops += backward(session, msg, session.graphs.pending[msg.call], check_it=False)
        elif isinstance(msg, Sync):
            price.flops += session.pricing.cost.params * ((msg.want_state + msg.want_grads) * 4
                                                          + (msg.grad_norm is not None)
                                                          + bool(msg.want_optimizer_state) * 12
                                                          + expressions.nodes(msg.evaluate))
    except Exception as exc:  # noqa: BLE001 — the request fails in its own work, at its own point
        log.debug("session %s: request not priced ahead (%s); it fails where it always did", session.id, exc)
    return price


def _ops(session: Priced, ops: Any) -> int:
    if not isinstance(ops, list):
        return 0
    flops, params = 0, session.pricing.cost.params
    for value in ops[: session.limits.max_ops]:
        name = value.get("op") if isinstance(value, dict) else None
        if name == "step":
            flops += STEP_FLOPS_PER_PARAM * params
        elif name in _PER_PARAM_OPS:
            flops += params
        elif name == "compute":
            args, kwargs = value.get("args"), value.get("kwargs")
            operands = (args if isinstance(args, list) else []) + list(kwargs.values() if isinstance(kwargs, dict) else [])
            flops += params * (1 + expressions.nodes(operands))
        elif name == "load_weights" and isinstance(value.get("weights"), dict):
            flops += sum(int(a.nbytes) for a in value["weights"].values() if isinstance(a, np.ndarray))
        elif name == "load_optimizer_state" and isinstance(value.get("entries"), dict):
            flops += sum(int(a.nbytes) for entry in value["entries"].values() if isinstance(entry, dict)
                         for a in entry.values() if isinstance(a, np.ndarray))
            flops += STEP_FLOPS_PER_PARAM * params  # the layout it is checked against: a step over meta tensors
    return flops


def _forward_groups(session: Priced, msg: Forward) -> list[tuple]:
    """(entries, stream, slot, context, expansions) per tree of a forward request."""
    ctx = session.context("activation", msg.train, msg.step, msg.sample_ids)
    groups = []
    for (entries, skeleton), streams in zip(forward_trees(msg), (True, False, False)):
        groups.append((entries, stream_index(skeleton) if streams else None, "fwd", ctx, expansions(skeleton)))
    return groups


def check_decode(session: Priced, groups: list[Group], slot: str, ctx: Any, what: str,
                 expanded: list[dict[int, tuple[int, ...]]]) -> int:
    """The arithmetic of decoding a request's tensors (``expanded``: each group's
    :func:`expansions`), refused over the bound; returns it."""
    flops = sum(session.codecs.decode_flops(entries, stream, slot, ctx, expand_to)
                for (entries, _, stream), expand_to in zip(groups, expanded))
    check(flops, session.limits, f"decoding this {what}")
    return flops


def forward(session: Priced, msg: Forward, inputs: Inputs) -> int:
    """The arithmetic of a forward call whose inputs are decoded: their decode, the half's forward
    (counted on its meta twin), the encode of what it returns, and an eager backward. Refused over
    the bound before any of it runs; returns the half's forward alone (a later backward's price)."""
    decode, cost = inputs.decode_flops, session.pricing.cost
    found = cost.forward(_signature(msg, inputs), lambda twin: _meta_run(session, msg, inputs, twin),
                         decode) if session.count_on_meta else None
    if found is None:
        stream = inputs.tensors[0] if inputs.tensors else torch.empty(0)
        model = cost.fallback(stream.numel(), stream.shape[-1] if stream.dim() else 1)
        encode = 0
    else:
        model, (outs, out_stream) = found
        encode = session.codecs.encode_flops(outs, out_stream if session.half.ushape else None, "ret")
    total = decode + model + encode
    if msg.grad and msg.eager and msg.target is not None and session.half.shared is None:
        total += BACKWARD_FACTOR * model + decode + _input_grads(session, inputs.coded, inputs.grads)
    check(total, session.limits, "this forward call")
    return model


def backward(session: Priced, msg: Backward, pending: Pending, check_it: bool = True) -> int:
    """The arithmetic of a backward call, before its gradients are decoded: the decode, the
    half's backward, the codecs' adjoints and the encode of the input gradients."""
    got, skeleton = from_wire(msg.grads)
    ctx = session.context("gradient", True, session.mirrored.steps, pending.sample_ids)
    streams = {i for i, coded in enumerate(pending.out_coded) if coded.stream}
    decode = sum(session.codecs.decode_flops([entry], 0 if i in streams else None, "ret_bwd", ctx)
                 for i, entry in enumerate(got))
    total = decode + BACKWARD_FACTOR * pending.flops + pending.decode_flops \
        + _input_grads(session, pending.in_coded, pending.in_grad)
    if check_it:
        check(total, session.limits, "this backward call")
    return total


def _input_grads(session: Priced, coded: list[Coded], needed: list[bool]) -> int:
    """Encoding the gradients of a call's inputs (the stream's through the ``bwd`` codec)."""
    return sum(session.codecs.encode_flops([(c.shape, c.dtype)], 0 if c.stream else None, "bwd")
               for c, need in zip(coded, needed) if need)


def _signature(msg: Forward, inputs: Inputs) -> Any:
    """What decides a forward's cost: shapes, dtypes, the call's structure and mode."""
    return ([(tuple(t.shape), str(t.dtype)) for t in inputs.tensors], repr(inputs.skeletons), inputs.counts,
            msg.train, msg.grad, msg.target is not None)


def _meta_run(session: Priced, msg: Forward, inputs: Inputs, twin: torch.nn.Module) -> Any:
    """The session's forward (and loss) on its half's meta twin, for meta tensors of the decoded
    inputs' shapes; returns the outputs' (shape, dtype) list and the stream's index."""
    args_skel, kw_skel, target_skel = inputs.skeletons
    n_args, n_kw = inputs.counts
    half = session.half.placement.dtype  # the half's own dtype: floating arguments are cast to it

    def meta(i: int, t: torch.Tensor) -> torch.Tensor:
        cast = half is not None and t.is_floating_point() and i < n_args + n_kw
        return torch.empty(t.shape, dtype=half if cast else t.dtype, device="meta")

    metas = [meta(i, t) for i, t in enumerate(inputs.tensors)]
    seen: dict[int, Any] = {}
    args = _without_caches(unflatten(args_skel, metas[:n_args], seen))
    kwargs = _without_caches(unflatten(kw_skel, metas[n_args:n_args + n_kw], seen, n_args))
    twin.train(msg.train)
    value = twin(*args, **kwargs)
    loss_fn = session.mirrored.loss_meta
    if inputs.skeletons[2] is not None and loss_fn is not None:
        value = loss_fn(value, unflatten(target_skel, metas[n_args + n_kw:], seen, n_args + n_kw))
    outs, skeleton = flatten(value)
    return [(tuple(t.shape), t.dtype) for t in outs], stream_index(skeleton)


def _without_caches(tree: Any) -> Any:
    """A generation's key/value caches hold real tensors: the count runs as if they were empty."""
    return trees.rebuild(tree, lambda ref, path: None, is_leaf=lambda node: isinstance(node, CacheRef),
                         other=lambda node, path: node)


__all__ = ["Priced", "backward", "check_decode", "forward", "guess", "new_steps", "state_nbytes"]
