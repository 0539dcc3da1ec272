"""What a script computes from the cloud half's tensors, computed in the cloud.

A NaN guard (``torch.isfinite(p.grad).all()``), the largest gradient for a log
(``p.grad.abs().max()``), sign SGD (``p.grad.sign_()``), weight decay added to the gradient by hand
(``p.grad.add_(p.data, alpha=wd)``), weights rescaled row by row (``w.div_(w.norm(dim=1,
keepdim=True))``): each is a torch call on placeholders whose values live in the cloud. When the
call is one of :data:`~splitft.wire.expressions.FUNCTIONS` it becomes an expression the cloud
computes with the very same callable, so the values are the unsplit script's, bitwise:

* a result of at most :data:`MOST_READ` elements (a reduction, a row of norms) is computed at
  once, in one round trip, and comes back as an ordinary tensor of the edge's, as torch would
  have made it at that point of the script;
* a larger one stays in the cloud as a :class:`CloudValue`, an expression not computed yet, until
  a reduction or an in-place call uses it. It stands for the cloud's tensors as they were when it
  was made: used after the cloud half changed (an operation, a forward, a step), it raises, since
  torch would have computed it before the change;
* an in-place call on a cloud gradient or weight rides as an operation (``compute``) on the next
  message, in the order the script made it.

What reads no values (shapes) is answered here; a call outside the table still raises, and a
draw (``torch.randn_like(p)``) is no expression: the cloud could not draw what the edge's
generator would.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..devices import autocast_dtype
from ..errors import PlaceholderError, ProtocolError
from ..wire import expressions as ex
from ..wire.operations import Compute
from .placeholders import CloudGrad, CloudState, CloudTensor, RemoteTensor

Tensor = torch.Tensor

#: The most elements a result may hold to be computed at once and read back (as the cloud allows).
MOST_READ = 1 << 16


class CloudValue(RemoteTensor):
    """A tensor computed from cloud tensors, not computed yet: its expression, and the version of
    the cloud half's tensors it stands for."""

    _splitft_node: dict
    _splitft_version: int

    @staticmethod
    def __new__(cls, meta: Tensor, node: dict, remote: Any) -> CloudValue:
        made = RemoteTensor._make(cls, meta, f"{node['fn']}(...)", remote, remote.device, False)
        made._splitft_node = node
        made._splitft_version = remote.version()
        return made

    def _what(self) -> str:
        return "a tensor computed from the cloud half's tensors"


class _NotExpressible(Exception):
    """An operand or call an expression cannot hold: the call is refused as before."""


def handle(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on cloud tensors, computed in the cloud; NotImplemented where it cannot be."""
    remotes = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, RemoteTensor)]
    if not remotes or any(isinstance(t, CloudState) for t in remotes) or \
            len({id(t._splitft_remote) for t in remotes}) > 1:
        return NotImplemented
    remote = remotes[0]._splitft_remote
    name = ex.NAMES.get(func)
    if name is not None and (autocast_dtype("cpu") or autocast_dtype("cuda")):
        raise PlaceholderError(f"{name} on {remotes[0]._what()} inside an autocast region: the cloud computes it "
                               "outside one, where its dtype could differ from what torch makes here; compute it "
                               "after the region ends")
    try:
        if name in ex.IN_PLACE:
            if args and isinstance(args[0], (CloudGrad, CloudTensor)) and not isinstance(args[0], CloudValue):
                return _in_place(name, func, args, kwargs, remote)
        elif name is not None and "out" not in kwargs:
            return _computed(name, func, args, kwargs, remote)
    except _NotExpressible:
        return NotImplemented
    values = [t for t in remotes if isinstance(t, CloudValue)]
    if len(values) == len(remotes):  # anything else reads the values computed in the cloud
        return _with_values(func, args, kwargs, values, remote)
    return NotImplemented


def _computed(name: str, func: Any, args: tuple, kwargs: dict, remote: Any) -> Tensor:
    node = _call(name, args, kwargs, remote)
    meta = _on_meta(func, args, kwargs)
    if meta.numel() <= MOST_READ:
        return _read(remote, [node])[0]
    return CloudValue(meta, node, remote)


def _in_place(name: str, func: Any, args: tuple, kwargs: dict, remote: Any) -> Tensor:
    target = args[0]
    if isinstance(target, CloudTensor) and torch.is_grad_enabled() and target.requires_grad:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    node = _call(name, args, kwargs, remote)
    _on_meta(func, args, kwargs)  # torch's own checks (shapes, in-place dtypes) before anything is queued
    leaf, *operands = node["args"]
    remote.compute(Compute(target=leaf, fn=name, args=operands, kwargs=node["kwargs"]))
    return target


def _call(name: str, args: tuple, kwargs: dict, remote: Any) -> dict:
    node = {"fn": name, "args": [_operand(a, remote) for a in args],
            "kwargs": {k: _operand(v, remote) for k, v in kwargs.items()}}
    try:
        ex.check(node, name, in_place=name in ex.IN_PLACE)
    except ProtocolError as exc:
        raise PlaceholderError(f"{exc}: read a part of it first (float(...), .item())") from None
    return node


def _operand(value: Any, remote: Any) -> Any:
    if isinstance(value, CloudValue):
        _fresh(value, remote)
        return value._splitft_node
    if isinstance(value, CloudGrad):
        return {"grad": value._splitft_name}
    if isinstance(value, CloudTensor):
        if torch.is_grad_enabled() and value.requires_grad:
            raise PlaceholderError(
                f"computing from {value._what()} with gradients on: the cloud computes values, not graphs, so no "
                "gradient would flow back from it. A penalty on weights in the loss (L2, L1) is the optimizer's "
                "weight_decay, or its gradient added after backward under torch.no_grad() (for c * p.pow(2).sum(): "
                "p.grad.add_(p, alpha=2 * c)); a value only logged or checked is computed under torch.no_grad()")
        return {"value": value._splitft_name}
    if isinstance(value, Tensor):
        if isinstance(value, RemoteTensor) or (value.requires_grad and torch.is_grad_enabled()):
            raise _NotExpressible
        return ex.array_leaf(value)
    if isinstance(value, torch.dtype):
        return {"dtype": ex.dtype_name(value)}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return list(value)
    raise _NotExpressible


def _on_meta(func: Any, args: tuple, kwargs: dict) -> Tensor:
    """What ``func`` makes, computed on meta tensors of the same shapes and dtypes."""
    def meta(value: Any) -> Any:
        return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, Tensor) else value

    with torch._C.DisableTorchFunctionSubclass():
        result = func(*tree_map(meta, args), **tree_map(meta, kwargs))
    if not isinstance(result, Tensor):
        raise _NotExpressible  # max(dim=...) and kin: values and indices
    return result


def _fresh(value: CloudValue, remote: Any) -> None:
    if value._splitft_version != remote.version():
        raise PlaceholderError("a tensor computed from the cloud half's tensors is used after they changed (an "
                               "operation, a forward or a step since): torch would have computed it before the "
                               "change. Reduce or read it (.sum(), float(...)) before changing them")


def _read(remote: Any, nodes: list[dict]) -> list[Tensor]:
    return [value.to(remote.device) for value in remote.evaluate(nodes)]


def _with_values(func: Any, args: tuple, kwargs: dict, values: list[CloudValue], remote: Any) -> Any:
    for value in values:
        _fresh(value, remote)
        if value.numel() > MOST_READ:
            raise PlaceholderError(f"reading {value.numel()} values computed in the cloud (at most {MOST_READ} are "
                                   "read back): reduce them first (.sum(), .max(), .norm())")
    read = dict(zip(map(id, values), _read(remote, [v._splitft_node for v in values])))

    def swap(value: Any) -> Any:
        return read.get(id(value), value) if isinstance(value, CloudValue) else value

    return func(*tree_map(swap, args), **tree_map(swap, kwargs))


__all__ = ["MOST_READ", "CloudValue", "handle"]
