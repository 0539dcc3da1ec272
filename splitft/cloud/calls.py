"""A call's tensors through a session's codecs: a request's decoded and checked, a reply's encoded.

Nothing here computes with the half. A forward request's tensors are priced before any is decoded
(the ``check`` a session passes: memory and arithmetic), then decoded and checked (an activation
with NaN or Inf is the edge's fault, and said so); a backward request's gradients likewise, each
matched to the output it is for; the gradients of a call's inputs go back through the gradient
codecs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from compressors import CodecContext, all_finite

from ..errors import ProtocolError
from ..wire.coding import Coded, SlotCodecs, Traffic, flatten, from_wire, stream_index, unflatten
from ..wire.protocol import Backward, Forward
from ..wire.tree import Leaf
from .blame import blame, short
from .graphs import Pending
from .half import SharedPart

#: (entries, skeleton, stream index) of one tree of a request's tensors.
Group = tuple[list, Any, "int | None"]
#: Prices decoding ``groups`` in ``slot`` under a context (refusing what does not fit); returns the arithmetic.
DecodeCheck = Callable[[list[Group], str, CodecContext, str], int]


@dataclass
class Inputs:
    """A forward request's tensors, decoded, and how to put them back into arguments."""

    tensors: list[torch.Tensor]
    coded: list[Coded]
    grads: list[bool]
    skeletons: tuple[Any, Any, Any]
    counts: tuple[int, int]
    decode_flops: int = 0  # what decoding them took, priced before it was done


def forward_trees(msg: Forward) -> tuple[tuple[list, Any], tuple[list, Any], tuple[list, Any]]:
    """(entries, skeleton) of a forward request's args, kwargs and target, parsed once per
    request: its price (before it is queued) and its decode read the same trees."""
    found = vars(msg).get(_TREES)
    if found is None:
        args = from_wire(msg.args, before=0)
        kwargs = from_wire(msg.kwargs, before=len(args[0]))
        found = (args, kwargs, from_wire(msg.target, before=len(args[0]) + len(kwargs[0])))
        vars(msg)[_TREES] = found
    return found


_TREES = "_parsed_trees"


def decode_forward(msg: Forward, codecs: SlotCodecs, ctx: CodecContext, ushape: bool,
                   check: DecodeCheck, finite: bool = False) -> Inputs:
    """A forward request's tensors, priced by ``check``, then decoded and checked; with ``finite``
    (a half shared with other edges, whose running statistics a NaN would reach), the activation
    must hold no NaN or Inf. A session's own half computes on them as the unsplit model would:
    a NaN batch gives a NaN loss, which the script may skip."""
    if msg.sample_ids is not None and (msg.sample_ids.ndim != 1 or msg.sample_ids.dtype != np.int64):
        raise ProtocolError("sample_ids must be a 1-D int64 array")
    (args_entries, args_skel), (kw_entries, kw_skel), (target_entries, target_skel) = forward_trees(msg)
    if not isinstance(args_skel, list) or not isinstance(kw_skel, dict):
        raise ProtocolError("forward args must be a list and kwargs a map")
    if msg.target is not None and ushape:
        raise ProtocolError("a U-shape session computes no loss in the cloud; send no target")
    groups: list[Group] = [(args_entries, args_skel, stream_index(args_skel)), (kw_entries, kw_skel, None),
                           (target_entries, target_skel, None)]
    decode = check(groups, "fwd", ctx, "forward request")
    tensors: list[torch.Tensor] = []
    in_coded: list[Coded] = []
    with blame(ProtocolError, "a tensor in the forward request cannot be decoded"):
        for entries, _skeleton, stream in groups:
            decoded, coded = codecs.decode(entries, stream, "fwd", ctx)
            tensors += decoded
            in_coded += coded
    for tensor, one in zip(tensors, in_coded):
        if finite and one.stream and (tensor.is_floating_point() or tensor.is_complex()) and not all_finite(tensor):
            raise ProtocolError("the activation contains NaN or Inf (refused for a shared cloud part); the edge part "
                                "diverged or the data is bad")
    grads = [g and msg.grad for _, g in (*args_entries, *kw_entries, *target_entries)]
    return Inputs(tensors, in_coded, grads, (args_skel, kw_skel, target_skel),
                  (len(args_entries), len(kw_entries)), decode)


def edge_dtype(value: Any, received: list[torch.Tensor], half_dtype: torch.dtype | None) -> Any:
    """A half kept in another dtype (``--dtype``) answers in the edge's floating dtype."""
    if half_dtype is None:
        return value
    edge = next((t.dtype for t in received if t.is_floating_point()), torch.float32)
    outs, skeleton = flatten(value)
    return unflatten(skeleton, [t.to(edge) if t.is_floating_point() else t for t in outs])


def encode_input_grads(codecs: SlotCodecs, leaves: list[torch.Tensor], coded: list[Coded], needed: list[bool],
                       leaf_grads: list[torch.Tensor | None], ctx: CodecContext) -> list[dict | None]:
    """Gradients of a call's inputs, through the gradient codecs, as wire entries; None for an
    input the backward did not reach (the half does not differentiate through it: detached, or
    used on some inputs only), whose edge producers then get no gradient, as unsplit."""
    traffic = Traffic()
    entries: list[dict | None] = []
    for leaf, c, need, grad in zip(leaves, coded, needed, leaf_grads):
        if not need or grad is None:
            entries.append(None)
            continue
        grad = codecs.grad_for_sender(grad, c, "fwd", ctx)
        (entry,), _ = codecs.encode([grad], 0 if c.stream else None, "bwd", ctx, [False], traffic)
        entries.append(entry)
    return entries


def decode_backward(msg: Backward, pending: Pending, codecs: SlotCodecs, ctx: CodecContext,
                    shared: SharedPart | None, check: DecodeCheck) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs to backpropagate from and their gradients, priced, decoded and checked."""
    got, skeleton = from_wire(msg.grads)
    if not isinstance(skeleton, list) or len(skeleton) != len(pending.outputs):
        raise ProtocolError(f"backward carries {len(skeleton) if isinstance(skeleton, list) else '?'} "
                            f"gradients for {len(pending.outputs)} outputs")
    streams = {slot.index for slot, coded in zip(skeleton, pending.out_coded)
               if isinstance(slot, Leaf) and coded.stream}
    # The stream's gradient goes through ret_bwd, the others raw.
    check([([entry], None, 0 if i in streams else None) for i, entry in enumerate(got)],
          "ret_bwd", ctx, "backward request")
    if shared is not None and pending.version != shared.updates:
        # Another edge stepped the shared part since this graph was built: build it again on the
        # current weights, so the gradient is that of the model being trained now.
        pending.rebuild()
    outputs, grads = [], []
    for out, coded, slot in zip(pending.outputs, pending.out_coded, skeleton):
        if slot is None or not out.requires_grad:
            continue
        if not isinstance(slot, Leaf):
            raise ProtocolError(f"a backward gradient slot holds {short(slot)}, expected a tensor or nil")
        with blame(ProtocolError, "a gradient in the backward request cannot be decoded"):
            (grad,), _ = codecs.decode([got[slot.index]], 0 if coded.stream else None, "ret_bwd", ctx)
            grad = codecs.grad_at_input(grad, coded, "ret", ctx)
        if grad.shape != out.shape:
            raise ProtocolError(f"gradient of shape {tuple(grad.shape)} for an output of shape {tuple(out.shape)}")
        # An overflow under loss scaling is legitimate (GradScaler skips that step): it only reaches this
        # session's own gradients. A shared half's would reach the weights every edge trains.
        if shared is not None and grad.is_floating_point() and not torch.isfinite(grad).all():
            raise ProtocolError("gradient contains NaN or Inf (refused for a shared cloud part)")
        outputs.append(out)
        grads.append(grad)
    return outputs, grads


__all__ = ["DecodeCheck", "Group", "Inputs", "decode_backward", "decode_forward", "edge_dtype",
           "encode_input_grads", "forward_trees"]
