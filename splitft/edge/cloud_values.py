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
  message, in the order the script made it;
* a call that returns its input or a view of it (``w.float()`` is ``w``) stays an expression
  whatever its size: unsplit it has no values of its own, so it must not be written either.

What reads no values (shapes) is answered here. A call outside the table that makes or changes
only the edge's tensors (an average of the weights kept by hand, ``avg.add_(p, alpha=0.1)``;
``F.linear(x, w)`` under no_grad) runs here on the values it reads, fetched in one round trip;
one that would write a cloud tensor or hand back the fetched memory still raises. A draw
(``torch.randn_like(p)``) is no expression: the cloud could not draw what the edge's generator
would.
"""

from __future__ import annotations

import contextlib
from typing import Any, cast

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..devices import autocast_dtype
from ..errors import PlaceholderError, ProtocolError
from ..wire import expressions as ex
from ..wire.operations import Compute
from .placeholders import CloudGrad, CloudState, CloudTensor, RemoteTensor
from .read_views import read_only_views

Tensor = torch.Tensor

#: The most elements a result may hold to be computed at once and read back (as the cloud allows).
MOST_READ = 1 << 16


class CloudValue(RemoteTensor):
    """A tensor computed from cloud tensors, not computed yet: its expression, and the version of
    the cloud half's tensors it stands for."""

    _splitft_node: dict
    _splitft_version: int

    @staticmethod
    def __new__(cls, meta: Tensor, node: dict, remote: Any, *, graph: bool = False) -> CloudValue:
        """``graph``: it stands for a tensor with a graph to a cloud weight (``p.clone()`` with
        gradients on), whose values only ``detach()`` gives."""
        made = RemoteTensor._make(cls, meta, f"{node['fn']}(...)", remote, "meta", graph, ask_device=True)
        made._splitft_node = node
        made._splitft_version = remote.version()
        return made

    def _what(self) -> str:
        return "a tensor computed from the cloud half's tensors"


def _with_other_models_fetched(func: Any, args: tuple, kwargs: dict, remotes: list[RemoteTensor]) -> Any:
    """A call on the cloud tensors of two split models (``pb.copy_(pa)``, warm-starting one trial
    from another): the first's cloud computes it, with the values of the other's tensors fetched
    now, which is what the call reads unsplit. NotImplemented where another's is no value to fetch
    (an optimizer's state, a value computed there)."""
    target = args[0] if args and isinstance(args[0], RemoteTensor) else remotes[0]
    others = [t for t in remotes if t._splitft_remote is not target._splitft_remote]
    if any(not isinstance(t, (CloudTensor, CloudGrad)) for t in others):
        return NotImplemented
    large = next((t for t in others if t.numel() > MOST_READ), None)
    if large is not None:
        raise PlaceholderError(
            f"{getattr(func, '__name__', func)} reads {large._what()} of another split model ({large.numel()} values; "
            f"at most {MOST_READ} are read back at once): copy whole layers from one split model to another (a target "
            "network's update) with target.load_state_dict(source.state_dict()), which fetches the weights whole, "
            "or by a state_dict() fetched first (tp.copy_(weights[name]))")
    with torch.no_grad():
        fetched = {id(t): t.detach().clone() for t in others}
    args, kwargs = tree_map(lambda v: fetched.get(id(v), v), (args, kwargs))
    return func(*args, **kwargs)


class _NotExpressible(Exception):
    """An operand or call an expression cannot hold: the call is refused as before."""


#: What reads a tensor's memory itself: a cloud tensor's is in the cloud.
_MEMORY = {Tensor.data_ptr, Tensor.untyped_storage, Tensor.storage, Tensor._typed_storage}

#: ``p.clone()``, and what gives its values without its graph.
_CLONES = {Tensor.clone, torch.clone}
_DETACHES = {Tensor.detach, cast(Any, Tensor.data).__get__}

#: Gradients asked of tensors (``inputs=``): a cloud parameter's are the cloud's backward's.
#: A tensor of the edge's shaped like a cloud one (``vec.view_as(p)`` in ``vector_to_parameters``): only
#: its shape, dtype and device are read, which a placeholder has.
_SHAPED_LIKE: dict[Any, Any] = {
    Tensor.view_as: lambda t, like: t.view(like.shape), Tensor.reshape_as: lambda t, like: t.reshape(like.shape),
    Tensor.expand_as: lambda t, like: t.expand(like.shape),
    Tensor.type_as: lambda t, like: t.to(device=like.device, dtype=like.dtype),
    Tensor.to: lambda t, like: t.to(device=like.device, dtype=like.dtype)}  # t.to(p): p's dtype and device
_GRADIENT_CALLS = {torch.autograd.grad: "torch.autograd.grad(...)", torch.autograd.backward: "backward(inputs=...)"}
#: Calls whose result has no gradient whatever their operands (comparisons, tests of values):
#: computed from a trainable cloud tensor with gradients on as unsplit, where they build no graph.
_NO_GRAPH = {f for name in ("eq", "ne", "lt", "le", "gt", "ge", "equal", "allclose", "isclose", "isnan", "isinf",
                            "isfinite", "isposinf", "isneginf", "count_nonzero", "__eq__", "__ne__", "__lt__", "__le__",
                            "__gt__", "__ge__")
             for f in (getattr(Tensor, name, None), getattr(torch, name, None)) if f is not None}


def handle(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on cloud tensors, computed in the cloud; NotImplemented where it cannot be."""
    remotes = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, RemoteTensor)]
    if func in _MEMORY and remotes:
        raise PlaceholderError(f"{func.__name__}() of {remotes[0]._what()}: its memory is in the cloud. To count "
                               "the model's parameters once each (tied ones too), walk model.parameters(), which "
                               "yields each parameter object once, and add p.numel(); to export the model "
                               "(torch.export, torch.onnx.export), export the one model.unsplit() gives")
    if func in _GRADIENT_CALLS and remotes:
        raise PlaceholderError(f"{_GRADIENT_CALLS[func]} naming {remotes[0]._what()}: the cloud half's gradients are "
                               "computed in the cloud by loss.backward(), into p.grad, and no graph here reaches its "
                               "parameters. Call loss.backward() and read (or apply by hand, under torch.no_grad()) "
                               "p.grad; inputs= and torch.autograd.grad of edge tensors only are mirrored")
    if func in _SHAPED_LIKE and len(args) == 2 and not kwargs and not isinstance(args[0], RemoteTensor) \
            and isinstance(args[1], RemoteTensor):
        return _SHAPED_LIKE[func](*args)
    if remotes and len({id(t._splitft_remote) for t in remotes}) > 1:
        return _with_other_models_fetched(func, args, kwargs, remotes)
    if not remotes or any(isinstance(t, CloudState) for t in remotes):
        return NotImplemented
    remote = remotes[0]._splitft_remote
    if func in _NO_GRAPH and torch.is_grad_enabled():  # (w == 0).sum() logged with gradients on: none to keep
        with torch.no_grad():
            return func(*args, **kwargs)
    graphed = next((t for t in remotes if isinstance(t, CloudValue) and t.requires_grad), None)
    if graphed is not None:
        if func in _DETACHES and len(remotes) == 1 and args and args[0] is graphed:
            return _detached(graphed, remote)
        raise PlaceholderError(_with_gradients(graphed))
    if (func in _CLONES and args and isinstance(args[0], CloudTensor) and len(remotes) == 1
            and torch.is_grad_enabled() and args[0].requires_grad):
        return _cloned_with_graph(func, args, kwargs, remote)
    if func is Tensor.__setitem__ or func is Tensor.index_fill_:
        written = _indexed_write(func, args, kwargs, remote)
        if written is not NotImplemented:
            return written
    func = _as_method(func)
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
        if getattr(func, "__name__", "").startswith("_foreach_") and args and isinstance(args[0], (list, tuple)):
            done = _foreach_in_place(func, args, kwargs, remote)
            if done is not NotImplemented:
                return done
    except _NotExpressible:
        return NotImplemented
    return _computed_here(func, args, kwargs, remotes, remote)  # anything else reads the values


def _as_method(func: Any) -> Any:
    """torch's in-place function as the tensor method it is (``torch.nan_to_num_(g)`` is ``g.nan_to_num_()``)."""
    name = getattr(func, "__name__", "")
    if name in ex.IN_PLACE and getattr(torch, name, None) is func and hasattr(Tensor, name):
        return getattr(Tensor, name)
    return func


def _foreach_in_place(func: Any, args: tuple, kwargs: dict, remote: Any) -> Any:
    """``torch._foreach_add_(params, grads, alpha=-lr)`` and its kin over lists holding cloud tensors:
    each cloud element's own in-place call (``p.add_(g, alpha=-lr)``, what the CPU's foreach kernel
    runs too), all checked before any is queued; the edge's elements by torch's kernel over them.
    NotImplemented where an element's call is no in-place expression."""
    method = getattr(Tensor, func.__name__.removeprefix("_foreach_"), None)
    name = ex.NAMES.get(method)
    targets, count = args[0], len(args[0])
    values = [*args[1:], *kwargs.values()]
    if name not in ex.IN_PLACE or any(isinstance(v, (list, tuple)) and len(v) != count for v in values):
        return NotImplemented
    cloud = [i for i, t in enumerate(targets)
             if isinstance(t, (CloudTensor, CloudGrad)) and not isinstance(t, CloudValue)]
    edge = [i for i, t in enumerate(targets) if not isinstance(t, RemoteTensor)]
    if not cloud or len(cloud) + len(edge) != count:
        return NotImplemented

    def nth(value: Any, i: int) -> Any:
        return value[i] if isinstance(value, (list, tuple)) else value

    def some(value: Any, at: list[int]) -> Any:
        return [value[i] for i in at] if isinstance(value, (list, tuple)) else value

    ops = [_in_place_op(name, method, tuple(nth(a, i) for a in args), {k: nth(v, i) for k, v in kwargs.items()},
                        remote) for i in cloud]
    if edge:
        func(*(some(a, edge) for a in args), **{k: some(v, edge) for k, v in kwargs.items()})
    for op in ops:
        remote.compute(op)
    return None


def _indexed_write(func: Any, args: tuple, kwargs: dict, remote: Any) -> Any:
    """``target[index] = value`` on a cloud tensor (``w[:, :3] = 0``, ``w[w.abs() < t] = 0``,
    ``p.grad[:n] = 0``, ``w[0] = row``) and ``target.index_fill_(dim, index, value)`` as the in-place
    call that sets the same elements to the same values: ``masked_fill_`` for a number, ``copy_`` of
    a ``where`` for an edge tensor. The index is applied by torch to a mask of the target's shape
    here, so it selects as torch's indexing does (and fails as it would). NotImplemented where the
    index or the value is a cloud tensor."""
    if kwargs or len(args) != (4 if func is Tensor.index_fill_ else 3):
        return NotImplemented
    target, *where, value = args
    if not isinstance(target, (CloudTensor, CloudGrad)) or isinstance(target, CloudValue) or \
            any(isinstance(t, RemoteTensor) for t in tree_flatten([where, value])[0]):
        return NotImplemented
    mask = torch.zeros(target.shape, dtype=torch.bool, device=target.device)
    if func is Tensor.index_fill_:
        dim, index = where
        mask.index_fill_(dim, index, True)
        return _in_place("masked_fill_", Tensor.masked_fill_, (target, mask, value), {}, remote)
    index = where[0]
    mask[index] = True
    if isinstance(value, (bool, int, float)) or (isinstance(value, Tensor) and value.dim() == 0):
        return _in_place("masked_fill_", Tensor.masked_fill_, (target, mask, value), {}, remote)
    full = torch.zeros(target.shape, dtype=target.dtype, device=target.device)
    full[index] = value
    with torch.no_grad():
        node = _call(ex.NAMES[torch.where], (mask, full, target), {}, remote)
    chosen = CloudValue(torch.empty(target.shape, dtype=target.dtype, device="meta"), node, remote)
    return _in_place("copy_", Tensor.copy_, (target, chosen), {}, remote)


def grad_assignment(name: str, value: Tensor, remote: Any) -> Compute:
    """``p.grad = value`` for the cloud parameter ``name``: its gradient (made, where it has none)
    takes ``value``'s values, an edge tensor or an expression over the cloud half's."""
    try:
        with torch.no_grad():
            operand = _operand(value, remote)
    except _NotExpressible:
        raise PlaceholderError(f"p.grad = ... of cloud parameter {name!r} with a tensor the cloud cannot take the "
                               "values of (one that requires a gradient, or an optimizer's state): assign "
                               "value.detach()") from None
    return Compute(target={"grad": name, "new": True}, fn="copy_", args=[operand], kwargs={})


def _computed(name: str, func: Any, args: tuple, kwargs: dict, remote: Any) -> Tensor:
    node = _call(name, args, kwargs, remote)
    meta, aliased = _on_meta(func, args, kwargs)
    if meta.numel() <= MOST_READ and not aliased:
        return _read(remote, [node])[0]
    # Unsplit, a call that returns its input or a view of it (w.float() is w) makes no values of its
    # own: it stays an expression, which reads as the tensor does and refuses to be written.
    return CloudValue(meta, node, remote)


def _in_place(name: str, func: Any, args: tuple, kwargs: dict, remote: Any) -> Tensor:
    remote.compute(_in_place_op(name, func, args, kwargs, remote))
    return args[0]


def _in_place_op(name: str, func: Any, args: tuple, kwargs: dict, remote: Any) -> Compute:
    """The operation that makes an in-place call on a cloud tensor in the cloud, checked as torch
    would check the call (shapes, in-place dtypes, a leaf that requires grad)."""
    target = args[0]
    if isinstance(target, CloudTensor) and torch.is_grad_enabled() and target.requires_grad:
        raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
    node = _call(name, args, kwargs, remote)
    _on_meta(func, args, kwargs)
    leaf, *operands = node["args"]
    return Compute(target=leaf, fn=name, args=operands, kwargs=node["kwargs"])


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
            raise PlaceholderError(_with_gradients(value))
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


def _with_gradients(value: RemoteTensor) -> str:
    if ".lora_" in value._splitft_name:  # peft computes an adapter's delta with gradients on as it merges
        return (f"computing from {value._what()} with gradients on, on the edge (peft's merge_adapter(), "
                "unmerge_adapter() and merge_and_unload() compute an adapter's delta so): the cloud computes values, "
                "not graphs. Call merge_adapter() and unmerge_adapter() under torch.no_grad(), where peft skips the "
                "layers merged already (the edge's, here); merge_and_unload() after model.unsplit()")
    return (f"computing from {value._what()} with gradients on, on the edge: the cloud computes values, not "
            "graphs, so no gradient would flow back from it. A penalty on weights in the loss (L2, L1) is the "
            "optimizer's weight_decay, or its gradient added after backward under torch.no_grad() (for c * "
            "p.pow(2).sum(): p.grad.add_(p, alpha=2 * c)); an edge layer holding it (a weight tied after "
            "split()) is tied before split(), which checks the tie; a parameter the edge's layers compute with (a "
            "policy's log_std kept on a cloud module) lives on an edge module, or the cloud module that holds it "
            "returns what is computed from it; a value only logged or checked is computed under torch.no_grad(), "
            "and a copy kept is p.detach().clone() (or p.clone().detach())")


def _cloned_with_graph(func: Any, args: tuple, kwargs: dict, remote: Any) -> CloudValue:
    """``p.clone()`` of a trainable cloud weight with gradients on: unsplit a tensor whose graph
    leads to ``p``. It stands for it, refusing all but ``detach()`` (``p.clone().detach()``, a copy
    of the weights kept), which gives its values."""
    with torch.no_grad():
        node = _call("clone", args, kwargs, remote)
        meta, _ = _on_meta(func, args, kwargs)
    return CloudValue(meta, node, remote, graph=True)


def _detached(value: CloudValue, remote: Any) -> Tensor:
    """The values of a clone that stood for a graph: read back now when small, as a clone's are."""
    _fresh(value, remote)
    if value.numel() <= MOST_READ:
        return _read(remote, [value._splitft_node])[0]
    return CloudValue(torch.empty(value.shape, dtype=value.dtype, device="meta"), value._splitft_node, remote)


def _on_meta(func: Any, args: tuple, kwargs: dict) -> tuple[Tensor, bool]:
    """What ``func`` makes, computed on meta tensors of the same shapes and dtypes, and whether it
    is one of its inputs or a view of one."""
    def meta(value: Any) -> Any:
        return torch.empty(value.shape, dtype=value.dtype, device="meta") if isinstance(value, Tensor) else value

    metas = tree_map(meta, (args, kwargs))
    inputs = {id(t) for t in tree_flatten(metas)[0] if isinstance(t, Tensor)}
    try:
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*metas[0], **metas[1])
    except NotImplementedError:  # no meta kernel (torch.where(condition)): no shape to expect
        raise _NotExpressible from None
    if not isinstance(result, Tensor):
        raise _NotExpressible  # max(dim=...) and kin: values and indices
    return result, id(result) in inputs or (result._is_view() and id(result._base) in inputs)


def _fresh(value: CloudValue, remote: Any) -> None:
    if value._splitft_version != remote.version():
        raise PlaceholderError("a tensor computed from the cloud half's tensors is used after they changed (an "
                               "operation, a forward or a step since): torch would have computed it before the "
                               "change. Reduce or read it (.sum(), float(...)) before changing them. A copy kept "
                               "to restore later (an EMA's store() and restore(), the best weights, SAM's old "
                               f"weights) holds the values when taken of at most {MOST_READ} (p.detach().clone(), "
                               "or under torch.no_grad()); of a larger weight it stays an expression of it in the "
                               "cloud (and so does a change made from its gradient, as SAM's e_w, which the next "
                               "backward changes): take the copy from copy.deepcopy(model.state_dict()) (fetched "
                               "whole) and load it back, or keep that layer on the edge")


def _read(remote: Any, nodes: list[dict]) -> list[Tensor]:
    return [value.to(remote.device) for value in remote.evaluate(nodes)]


def _computed_here(func: Any, args: tuple, kwargs: dict, remotes: list[RemoteTensor], remote: Any) -> Any:
    """``func`` run here, on the values of the cloud tensors and expressions it reads (fetched in
    one round trip), where it changes or makes only the edge's tensors: ``ema.add_(p.detach(), alpha=0.1)``,
    ``torch._foreach_lerp_(shadow, [p.detach() ...], 0.1)``, ``F.linear(x, w)`` under no_grad.

    NotImplemented (the placeholder refuses it) where it would write a cloud tensor, in place or
    through ``out=``, or hand back one of the fetched copies or a view of one: unsplit, that is the
    cloud's tensor itself (``p.cpu()`` is ``p``), and a write to it would change the weight.
    """
    written = tree_flatten(kwargs.get("out"))[0]
    if _writes_first(func) and args:
        written += tree_flatten(args[0])[0]
    if any(isinstance(t, RemoteTensor) for t in written):
        return NotImplemented
    graphed = [t for t in remotes if isinstance(t, CloudTensor) and t.requires_grad] if torch.is_grad_enabled() else []
    if graphed and not any(isinstance(t, Tensor) for t in written):  # a result made from it, whose graph a loss needs
        raise PlaceholderError(_with_gradients(graphed[0]))
    try:
        with torch.no_grad() if graphed else contextlib.nullcontext():
            nodes = [_operand(t, remote) for t in remotes]
    except _NotExpressible:
        return NotImplemented
    count = sum(t.numel() for t in {id(t): t for t in remotes}.values())
    if count > MOST_READ:
        raise PlaceholderError(
            f"reading {count} values computed in the cloud for {getattr(func, '__name__', func)} on "
            f"{remotes[0]._what()} (at most {MOST_READ} are read back): reduce them first (.sum(), .max(), .norm()), "
            "or compute with torch's elementwise functions and reductions, which the cloud computes")
    read = dict(zip(map(id, remotes), _read(remote, nodes)))
    for t in graphed:  # an edge tensor written from a trainable weight: its graph leads to a refusal
        read[id(t)] = _NoGradientBack.apply(read[id(t)], _ANCHOR, t._what())
    versions = {id(v): v._version for v in read.values()}
    generator = torch.default_generator.get_state()  # put back if refused: a draw (dropout) leaves no trace
    result = func(*tree_map(lambda v: read.get(id(v), v), args), **tree_map(lambda v: read.get(id(v), v), kwargs))
    refused = any(v._version != versions[id(v)] for v in read.values())  # written in place
    if not refused and _holds_any(result, list(read.values())):  # a view of the values: read-only, while current
        result = None if graphed else read_only_views(func, result, [(t, read[id(t)]) for t in remotes], remote.version)
        refused = result is None
    if refused:
        torch.default_generator.set_state(generator)
        return NotImplemented
    return result


class _NoGradientBack(torch.autograd.Function):
    """A trainable cloud weight's values, read into an edge tensor written in place with gradients
    on (``slow.data.copy_(p)``, as torch_optimizer's Lookahead keeps its slow weights): unsplit the
    tensor then has a graph that leads to the weight, so here one that leads to a refusal, raised
    by a backward that would need the weight's gradient and never by one that does not."""

    @staticmethod
    def forward(ctx: Any, values: Tensor, anchor: Tensor, what: str) -> Tensor:
        ctx.what = what
        return values.clone()

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> Any:
        raise PlaceholderError(f"a gradient through {ctx.what}, read into an edge tensor written with gradients on "
                               "(dst.copy_(p), dst.add_(p)), would reach the cloud half, which computes values, not "
                               "graphs. Write it under torch.no_grad(), or from p.detach()")


#: What makes :class:`_NoGradientBack`'s output need a gradient (it never gets one).
_ANCHOR = torch.zeros((), requires_grad=True)


def _writes_first(func: Any) -> bool:
    """Whether ``func`` changes its first argument in place, by torch's naming (``add_``,
    ``_foreach_mul_``, ``__iadd__``)."""
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


#: What a call computed here may hand back besides tensors: plain values (a storage, a capsule or
#: an array would be the fetched copy's memory, where unsplit it is the cloud tensor's own).
_PLAIN = (bool, int, float, complex, str, type(None), torch.dtype, torch.device, torch.Size)


def _holds_any(result: Any, copies: list[Tensor]) -> bool:
    """Whether ``result`` holds anything but tensors and plain values, or anything of the memory of
    one of ``copies`` (a view of one; an address, as ``data_ptr()`` gives)."""
    spans = [(c.untyped_storage().data_ptr(), c.untyped_storage().data_ptr() + c.untyped_storage().nbytes())
             for c in copies]
    for item in tree_flatten(result)[0]:
        if isinstance(item, Tensor):
            if item.layout != torch.strided:
                return True  # its memory cannot be told apart from the copies' (a sparse or opaque tensor)
            at = item.untyped_storage().data_ptr() if item.device.type == "cpu" else None
        elif isinstance(item, int) and not isinstance(item, bool):
            at = item
        elif isinstance(item, _PLAIN):
            continue
        else:
            return True
        if at is not None and any(start <= at < end for start, end in spans):
            return True
    return False


__all__ = ["MOST_READ", "CloudValue", "handle"]
