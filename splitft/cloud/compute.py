"""Computing what a script computes from the cloud half's tensors (:mod:`splitft.wire.expressions`).

An expression arrives as plain values from a peer the cloud does not trust. Before any of it runs
on the half's tensors it is checked: its shape (a bounded tree of known functions), then every
call on meta tensors, so that each intermediate's size is known and none is larger than the
largest tensor the expression names (broadcasting may not blow two vectors up into a matrix), and
what they hold together fits the session's memory. Then it runs under ``no_grad`` on the half's
own tensors: an in-place call (operation ``compute``) changes a gradient or weight as the script's
call did on the edge; a sync's ``evaluate`` answers with the values.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ..errors import ModelError, PolicyError, ProtocolError
from ..wire import expressions as ex
from ..wire import operations as o
from .blame import blame
from .handlers import Target, handles

#: The most elements a value the edge reads may hold (a reduction, a row of norms).
MOST_VALUE_ELEMENTS = 1 << 16
#: The most expressions one sync may ask to evaluate.
MOST_EVALUATED = 64


class _Leaves:
    """The cloud tensors an expression names, resolved once (real ones, or meta twins)."""

    def __init__(self, session: Target) -> None:
        half = session.half
        if half.is_sharded:
            raise PolicyError("a cloud half sharded across ranks computes no expressions of an edge's")
        self.half = half
        self._values: dict[str, torch.Tensor] | None = None
        self.largest = 0

    def tensor(self, leaf: dict, meta: bool) -> torch.Tensor:
        if "grad" in leaf:
            param = self.half.named_params.get(leaf["grad"])
            if param is None:
                raise ProtocolError(f"an expression names the gradient of {str(leaf['grad'])[:80]!r}, no parameter "
                                    "of this half")
            if param.grad is None:
                raise ProtocolError(f"an expression names the gradient of {leaf['grad']!r}, which has none here")
            found = param.grad
        elif "value" in leaf:
            if self._values is None:
                self._values = self.half.chain.qualified_state_dict()
            value = self._values.get(leaf["value"])  # detached: an in-place change reaches the parameter
            if value is None:
                raise ProtocolError(f"an expression names {str(leaf['value'])[:80]!r}, no tensor of this half")
            found = value
        else:
            array = torch.from_numpy(np.array(leaf["array"]))  # a copy: received frames are read-only
            dtype = ex.dtype_of(leaf["dtype"])
            found = array.to(dtype) if array.dtype != dtype else array
            if not meta:
                found = found.to(self.half.placement.device)
        self.largest = max(self.largest, found.numel())
        return torch.empty_like(found, device="meta") if meta else found


def _run(node: Any, leaves: _Leaves, meta: bool, sizes: list[int]) -> Any:
    """Evaluate ``node`` (checked by :func:`~splitft.wire.expressions.check`); ``sizes`` collects
    each call's result bytes."""
    if isinstance(node, dict):
        if "fn" in node:
            args = [_run(a, leaves, meta, sizes) for a in node["args"]]
            kwargs = {k: _run(v, leaves, meta, sizes) for k, v in node["kwargs"].items()}
            result = ex.FUNCTIONS[node["fn"]](*args, **kwargs)
            if not isinstance(result, torch.Tensor):
                raise ProtocolError(f"{node['fn']} gave no single tensor (a call with dim= that returns indices?)")
            sizes.append(result.numel() * result.element_size())
            return result
        if set(node) == {"dtype"}:
            return ex.dtype_of(node["dtype"])
        return leaves.tensor(node, meta)
    return node


def _checked(session: Target, node: Any, what: str, target: torch.Tensor | None = None) -> None:
    """Run ``node`` on meta tensors: it must be a valid call, no larger than what it names, and fit."""
    leaves = _Leaves(session)
    sizes: list[int] = []
    with blame(ProtocolError, f"{what} cannot be computed"), torch.no_grad():
        _run(node, leaves, True, sizes)
    largest = max([leaves.largest] + ([target.numel()] if target is not None else []))
    if any(size > 8 * largest for size in sizes):  # 8 bytes an element at most
        raise ProtocolError(f"{what} makes a tensor larger than any it names")
    session.fits(sum(sizes), what)


@handles(o.Compute)
def compute(session: Target, op: o.Compute) -> None:
    """An in-place call on a cloud gradient or weight, as the script made it on the edge."""
    if session.half.shared is not None:
        raise PolicyError("the tensors of a shared cloud half are every edge's; one edge may not change them by "
                          "its own computation")
    new = isinstance(op.target, dict) and op.target.get("new") is True  # p.grad = g: made where there is none
    leaf = {k: v for k, v in op.target.items() if k != "new"} if new else op.target
    if op.fn not in ex.IN_PLACE or not isinstance(leaf, dict) or set(leaf) not in ({"grad"}, {"value"}) or \
            (new and (set(leaf) != {"grad"} or op.fn != "copy_")):
        raise ProtocolError(f"compute: {str(op.fn)[:40]!r} on {str(op.target)[:80]} is no in-place call on a cloud "
                            "gradient or weight")
    call = {"fn": op.fn, "args": [leaf, *op.args], "kwargs": op.kwargs}
    ex.check(call, "compute", in_place=True)
    with torch.no_grad(), session.half.own_grads():
        param = _new_grad_of(session, leaf["grad"]) if new else None
        shaped = {"value": leaf["grad"]} if new else leaf  # a gradient to be made: checked as its parameter
        target = _Leaves(session).tensor(shaped, meta=False)
        _checked(session, {"fn": op.fn, "args": [shaped, *op.args], "kwargs": op.kwargs}, "compute", target)
        if param is not None and param.grad is None:
            param.grad = torch.zeros_like(param)
        with blame(ModelError, f"compute {op.fn} on the cloud half failed"):
            _run(call, _Leaves(session), False, [])


def _new_grad_of(session: Target, name: Any) -> torch.nn.Parameter:
    """The parameter whose gradient ``p.grad = g`` sets (checked against its shape as its values are)."""
    param = session.half.named_params.get(name) if isinstance(name, str) else None
    if param is None:
        raise ProtocolError(f"compute sets the gradient of {str(name)[:80]!r}, no parameter of this half")
    return param


def evaluate(session: Target, expressions: list) -> list[Any]:
    """The values of a sync's expressions, on the host (bfloat16 as float32, with its name)."""
    if len(expressions) > MOST_EVALUATED:
        raise ProtocolError(f"a sync evaluates at most {MOST_EVALUATED} expressions, got {len(expressions)}")
    session.passes.flush()  # the edge's backward pass ended: its sums are the gradients read
    out: list[Any] = []
    with torch.no_grad(), session.half.own_grads():
        for node in expressions:
            ex.check(node, "evaluate")
            _checked(session, node, "evaluate")
            with blame(ModelError, "an expression of the edge's failed on the cloud half"):
                value = _run(node, _Leaves(session), False, [])
            if not isinstance(value, torch.Tensor) or value.numel() > MOST_VALUE_ELEMENTS:
                raise ProtocolError(f"an evaluated expression is read as at most {MOST_VALUE_ELEMENTS} elements")
            out.append(_host(value))
    return out


def _host(value: torch.Tensor) -> list:
    host = value.detach().cpu()
    dtype = ex.dtype_name(host.dtype)
    wire = host.float() if host.dtype == torch.bfloat16 else host
    return [wire.contiguous().numpy().copy(), dtype]  # its own memory (not a weight's, kept in a reply); 0-d stays 0-d


__all__ = ["MOST_EVALUATED", "MOST_VALUE_ELEMENTS", "compute", "evaluate"]
