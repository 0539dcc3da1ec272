"""The cloud half's tensors as the edge sees them: every operation reaches the cloud or raises.

After :func:`splitft.split` the cloud half's parameters and buffers are :class:`CloudTensor`
placeholders: tensors with the shape, dtype and ``requires_grad`` of the originals but no values
(those live in the cloud), kept on the ``meta`` device, yet answering ``p.device`` with the edge
half's, where the unsplit model's values were (a buffer made ``device=p.device`` is a real one;
torch's C++ asks them too, so ``AveragedModel`` groups them with the edge's tensors by device),
and ``is_meta`` with False (torch's initialisers return early on a meta tensor, "sampling is a
no-op", which on a cloud parameter would be a silent divergence; answered False, they reach an
operation that is mirrored or refused). Their gradients are :class:`CloudGrad` handles, reported
on the edge's device so torch groups them with the edge's gradients in parameter order. Both are
tensor subclasses that own every torch operation on them (and ``t.new(size)``, which skips that),
as ``DTensor`` and ``FakeTensor`` own theirs: what the cloud can mirror is routed to it
(:class:`Remote`), what reads no values (shape, dtype, ``requires_grad``) answers here, and
anything else raises a :class:`~splitft.errors.PlaceholderError` naming the fix. So a script's
unforeseen use of a cloud tensor can never be a silent no-op.

What is mirrored:

* on a parameter or buffer: ``copy_(tensor)``, ``zero_()``, ``fill_(value)`` push the new values
  to the cloud (``load_state_dict`` of a submodule, ``reset_running_stats``, ``nn.init.zeros_``),
  and so do ``normal_``, ``uniform_`` and torch's initialisers built on them (``model.apply(init)``,
  ``p.data.normal_(0, 0.02)``, ``nn.init.kaiming_uniform_``, ``xavier_normal_``), whose values are
  drawn here from the edge's generator, as the unsplit model would draw them (also of a part, :mod:`.cloud_slices`);
  ``requires_grad_`` is sent with the next forward;
* ``p.grad`` is the cloud's gradient: ``None`` exactly when the cloud's is; assigning ``None``
  clears the cloud's; its norm (``torch.linalg.vector_norm``, ``Tensor.norm``, ``_foreach_norm``)
  is fetched from the cloud; ``mul_``, ``div_``, ``clamp_``, ``zero_`` and torch's foreach and
  loss-scaling kernels over it are applied there (:mod:`.cloud_grads`). Torch's own ``clip_grad_norm_``,
  ``clip_grad_value_`` and ``GradScaler`` therefore act on both halves, however they were imported;
* any other call of torch's elementwise functions, comparisons and reductions on them (and their
  in-place forms) is computed in the cloud (:mod:`.cloud_values`); ``torch.randn_like(p)`` and kin
  are drawn here, from the shape alone.

``p.new_zeros(n)`` and its kin make a tensor here, as unsplit, and so do ``torch.zeros_like(p)``,
``full_like``, ``ones_like`` and ``empty_like`` in a script (an average's buffers). Made by an
optimizer's constructor, they are a :class:`CloudState`: the state it makes for a cloud parameter
(Adagrad's accumulators), which the cloud's copy of the optimizer, built with the same settings, makes too.
It remembers how it was made, so the edge can check that it is still that initial state
(:mod:`.initial_state`), and refuses every operation on its values like a placeholder.
The state an optimizer's steps make for a cloud parameter stands in ``opt.state`` as
:class:`CloudMoment` placeholders, which refuse the same way.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any, Protocol, cast

import torch
from torch.utils._pytree import tree_flatten

from ..errors import PlaceholderError
from ..wire import expressions
from .cloud_grads import GRAD_OPS
from .cloud_slices import CloudSlice
from .made_here import drawn_like, itself_where_unmoved, legacy_new, made_like, new_like, new_values
from .metadata import DEVICE_QUERIES, IS_META, METADATA, REQUIRES_GRAD_SETTERS, set_requires_grad, where

Tensor = torch.Tensor


class Remote(Protocol):
    """What the placeholders need from the edge's handle on the cloud half (:class:`~.cloud_half.CloudHalf`)."""

    def grad_of(self, name: str) -> CloudGrad | None: ...
    def clear_grad(self, name: str) -> None: ...
    def grad_norms(self, names: list[str], norm_type: float) -> list[Tensor]: ...
    def change_grads(self, names: list[str], kind: str, value: Any) -> None: ...
    def computed(self, func: Any, args: tuple, kwargs: dict) -> Any: ...  # in the cloud, or NotImplemented
    def compute(self, op: Any) -> None: ...  # an in-place call on a cloud tensor (a Compute operation)
    def evaluate(self, nodes: list[dict]) -> list[Tensor]: ...  # expressions' values, computed in the cloud
    def version(self) -> int: ...  # moves whenever the cloud half's tensors may have changed
    def push_values(self, name: str, value: Tensor) -> None: ...
    def assign_grad(self, name: str, value: Any) -> None: ...  # p.grad = value, in the cloud
    @property
    def device(self) -> torch.device: ...  # the edge half's: where the unsplit model's values would be drawn
    params: dict[str, Any]  # the cloud half's parameters by name (the rest of its tensors are buffers)


class RemoteTensor(Tensor):
    """A tensor without values here: the base of :class:`CloudTensor` and :class:`CloudGrad`."""

    _splitft_name: str
    _splitft_remote: Remote
    _splitft_placeholder = True  # what other tensor subclasses ask, without importing this module
    new = legacy_new  # type: ignore[assignment]  # t.new(size): torch's legacy constructor skips __torch_function__

    @staticmethod
    def _make(cls: type, like: Tensor, name: str, remote: Remote, device: torch.device | str,
              requires_grad: bool, *, ask_device: bool = False) -> Any:
        """``ask_device``: torch's C++ asks the tensor its device too (:meth:`__torch_dispatch__`), so
        what groups tensors by device there (``AveragedModel.update_parameters``) sees the edge's."""
        made: Any = Tensor._make_wrapper_subclass(cls, like.shape, strides=like.stride(), dtype=like.dtype,
                                                  device=torch.device(device), requires_grad=requires_grad,
                                                  dispatch_device=ask_device)
        made._splitft_name, made._splitft_remote = name, remote
        return made

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's: unannotated
        return (f"{type(self).__name__}({self._splitft_name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                "values in the cloud)")

    def __deepcopy__(self, memo: dict) -> Any:
        raise PlaceholderError(f"copying {self._what()}: its values live in the cloud. Copy the model before "
                               "split(), or fetch the whole model's weights with model.state_dict()")

    def __reduce_ex__(self, proto: Any) -> Any:
        raise PlaceholderError(f"saving {self._what()}: its values live in the cloud. Save model.state_dict() "
                               "(it fetches the cloud half) or use model.save_checkpoint(path)")

    def _what(self) -> str:
        return f"cloud parameter {self._splitft_name!r}"

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in METADATA:
            if func in REQUIRES_GRAD_SETTERS:
                return set_requires_grad(func, args, kwargs)
            if func in DEVICE_QUERIES and not kwargs and len(args) == 1:
                return where(func, args[0]._splitft_remote.device)
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func == IS_META:
            return False
        if func in GRADIENT_HOOKS:
            raise PlaceholderError(f"a gradient hook on {args[0]._what()}: its gradient is computed and kept in the "
                                   "cloud, where the hook would not run. Change it after backward instead "
                                   "(under torch.no_grad(), p.grad.mul_(...)), or in an optimizer step pre-hook")
        remote = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, RemoteTensor)]
        self = args[0] if args else kwargs.get("tensor")  # torch.nn.init's initialisers pass tensor=
        if isinstance(self, CloudGrad) or (isinstance(self, list) and any(isinstance(t, CloudGrad) for t in self)):
            handler = _GRAD_OPS.get(func)
            if handler is not None and all(isinstance(t, CloudGrad) for t in remote):
                try:
                    return handler(*args, **kwargs)
                except PlaceholderError:
                    if func not in expressions.NAMES:
                        raise  # else: computed in the cloud as an expression (p.grad.mul_(p.grad))
        elif isinstance(self, (CloudTensor, CloudState)) and (
                len(remote) == 1 or func == _DATA_SETTER
                or (func == Tensor.copy_ and all(isinstance(t, CloudState) for t in remote[1:]))):
            handler = (_VALUE_OPS if isinstance(self, CloudTensor) else _STATE_OPS).get(func)
            if handler is not None:
                return handler(*args, **kwargs)
        computed = remote[0]._splitft_remote.computed(func, args, kwargs) if remote else NotImplemented
        if computed is not NotImplemented:
            return computed
        raise PlaceholderError(_refusal(func, remote[0] if remote else self))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's default is a plain function
            cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        # Reached only past __torch_function__ (torch internals that disable it): refuse all the same,
        # but for the device torch's C++ asks of a cloud tensor, which is where the edge's tensors are.
        if func is _DEVICE_ASKED and args and isinstance(args[0], RemoteTensor):
            return args[0]._splitft_remote.device
        remote = [t for t in tree_flatten((args, kwargs or {}))[0] if isinstance(t, RemoteTensor)]
        raise PlaceholderError(_refusal(func, remote[0] if remote else None))


#: What torch's C++ calls to read a tensor's device when the tensor answers it itself.
_DEVICE_ASKED = torch.ops.prim.device.default

#: Hooks on a tensor's gradient: a cloud tensor's is made in the cloud, which runs no hook of the edge's.
GRADIENT_HOOKS = frozenset({Tensor.register_hook, Tensor.register_post_accumulate_grad_hook})


class CloudTensor(RemoteTensor):
    """A parameter or buffer of the cloud half, without its values.

    ``isinstance(p, nn.Parameter)`` holds for the parameters' (``_is_param``), so modules keep
    them registered where the originals were.
    """

    @staticmethod
    def __new__(cls, like: Tensor, name: str, remote: Remote) -> CloudTensor:
        made = RemoteTensor._make(cls, like, name, remote, "meta", like.requires_grad, ask_device=True)
        if isinstance(like, torch.nn.Parameter):
            made._is_param = True
        return made

    def _what(self) -> str:
        kind = "parameter" if self._splitft_name in self._splitft_remote.params else "buffer"
        return f"cloud {kind} {self._splitft_name!r}"

    def alias(self) -> CloudTensor:
        """``p.data`` / ``p.detach()``: the same cloud tensor, not a parameter, no gradient."""
        made = RemoteTensor._make(CloudTensor, self, self._splitft_name, self._splitft_remote, "meta", False,
                                  ask_device=True)
        return made

    @property  # type: ignore[override]
    def grad(self) -> CloudGrad | None:
        return self._splitft_remote.grad_of(self._splitft_name)

    @grad.setter
    def grad(self, value: Any) -> None:
        if value is None:
            self._splitft_remote.clear_grad(self._splitft_name)
        elif value is not self.grad:  # the same handle back: an in-place operator (p.grad /= n), mirrored
            self._splitft_remote.assign_grad(self._splitft_name, value)

    @grad.deleter
    def grad(self) -> None:  # ``del p.grad``: torch's own spelling of ``p.grad = None``
        self._splitft_remote.clear_grad(self._splitft_name)


def remote_of(tensor: Any) -> Remote | None:
    """The handle on the cloud half behind a placeholder or its gradient (None for any other tensor,
    a :class:`CloudState` included: it is no tensor of the cloud half's)."""
    return tensor._splitft_remote if isinstance(tensor, (CloudTensor, CloudGrad)) else None


class CloudGrad(RemoteTensor):
    """The gradient of a cloud parameter, as ``p.grad`` shows it: its values stay in the cloud."""

    _splitft_grad = True  # what :func:`.cloud_grads.is_cloud_grad` reads

    @staticmethod
    def __new__(cls, param: Tensor, name: str, remote: Remote) -> CloudGrad:
        # on the meta device, answering ``device`` itself (the edge half's): a plain tensor's ``.data`` set to it is
        # refused by torch (on the edge's device, the tensor took it and was left without memory)
        return RemoteTensor._make(cls, param, name, remote, "meta", False, ask_device=True)

    def _what(self) -> str:
        return f"the gradient of cloud parameter {self._splitft_name!r}"


class CloudState(RemoteTensor):
    """A tensor an optimizer's constructor made from a cloud tensor's shape alone
    (``torch.full_like(p, 0.1)``): what it keeps for a cloud parameter. Its values are known (``fill``: a number,
    or None for ``empty_like``'s), but kept nowhere here: the cloud's copy of the optimizer makes
    its own; any operation on them raises, as on a placeholder."""

    _splitft_fill: Any

    @staticmethod
    def __new__(cls, like: Tensor, name: str, remote: Remote, dtype: torch.dtype, fill: Any) -> CloudState:
        made = RemoteTensor._make(cls, torch.empty(like.shape, dtype=dtype, device="meta"), name, remote, "meta",
                                  False)
        made._splitft_fill = fill
        return made

    def recipe(self) -> tuple[Any, ...]:
        """How it was made: two CloudStates of one recipe are the same tensor."""
        return self._splitft_name, tuple(self.shape), self.dtype, self._splitft_fill

    def _what(self) -> str:
        return (f"a tensor an optimizer's constructor made like cloud parameter {self._splitft_name!r} (its state "
                "for the cloud half lives in the cloud's copy of the optimizer, which made its own)")


class CloudMoment(CloudState):
    """An optimizer's state for a cloud parameter as its steps made it (Adam's ``exp_avg``, a step
    count): kept, and changed by each step, in the cloud's copy of the optimizer only. It stands in
    ``opt.state[p]`` where the unsplit optimizer keeps the real one, so a script that walks the
    optimizer's state meets it, and an operation on it raises, instead of skipping the cloud half."""

    def _what(self) -> str:
        return f"the optimizer state of cloud parameter {self._splitft_name!r}"

    def _hint(self) -> str:
        return ("it lives in the cloud's copy of the optimizer, which the edge can neither read nor change (split "
                "training would silently differ from the unsplit model). model.save_checkpoint(path) saves it")


# ---------------------------------------------------------------- a parameter's or buffer's values


#: What torch passes for ``t.data`` and ``t.data = v`` (``Tensor.data`` is a descriptor on the class).
_DATA_GETTER, _DATA_SETTER = cast(Any, Tensor.data).__get__, cast(Any, Tensor.data).__set__


def _data_set_to_itself(tensor: RemoteTensor, value: Any) -> None:
    """``p.data -= lr * p.grad`` sets ``p.data`` to what the in-place operator returned: the same
    cloud tensor. Any other would make ``p`` hold that tensor's memory, which a placeholder cannot."""
    if not (type(value) is type(tensor) and value._splitft_name == tensor._splitft_name
            and value._splitft_remote is tensor._splitft_remote):
        raise PlaceholderError(_refusal(_DATA_SETTER, tensor))


def _data_set(tensor: CloudTensor, value: Any) -> None:
    """``p.data = t`` on a cloud parameter or buffer. The same cloud tensor: nothing to do. A tensor
    of the edge's of its shape and dtype (SAM's ``p.data = old_p``, Reptile's ``p.data = o + e * (p.data
    - o)``): unsplit ``p`` then holds ``t``'s memory, so the cloud takes its values and ``t`` becomes
    ``p.data`` (what reads or writes it later reads or writes the cloud's tensor, as unsplit ``p``'s);
    one whose memory other tensors share too (``vector_to_parameters``' parts of a vector) is refused.
    An expression over the cloud half's tensors: copied there."""
    if type(value) is type(tensor) and value._splitft_name == tensor._splitft_name \
            and value._splitft_remote is tensor._splitft_remote:
        return
    if isinstance(value, Tensor) and (value.dtype != tensor.dtype or value.shape != tensor.shape):
        raise PlaceholderError(f"p.data = t on {tensor._what()} with t of {value.dtype} and shape {list(value.shape)} "
                               f"(p's: {tensor.dtype}, {list(tensor.shape)}): unsplit p would take t's dtype and shape, "
                               "which the cloud's tensor does not follow. Cast or resize the model before split(), "
                               "in the cloud's factory too")
    if not isinstance(value, Tensor) or isinstance(value, (CloudTensor, CloudGrad, CloudState)) or value.requires_grad:
        raise PlaceholderError(_refusal(_DATA_SETTER, tensor))  # (another cloud tensor: p and q would share memory)
    with torch.no_grad():
        if isinstance(value, RemoteTensor):  # an expression over cloud tensors (p.data = q * 2)
            tensor.alias().copy_(value)
            return
        if value.device != tensor._splitft_remote.device:
            raise PlaceholderError(_refusal(_DATA_SETTER, tensor))
        shared = f"p.data = t on {tensor._what()}, with t's memory held elsewhere too ("
        if torch._C._storage_Use_Count(value.untyped_storage()._cdata) > 2:  # the tensor, and the storage asked for
            raise PlaceholderError(shared + "p.data = w.data ties p to w; a part of a vector, as vector_to_parameters "
                                   "assigns): unsplit p would share that memory, which the cloud's tensor cannot; "
                                   "assign t.clone(), or copy the values (p.data.copy_(t))")
        alias = tensor.alias()
        try:
            torch.utils.swap_tensors(value, alias)  # the script's tensor is p.data now; alias holds its values
        except RuntimeError:
            raise PlaceholderError(shared + "a weak reference to it): unsplit p would hold t's memory, which the "
                                   "cloud's tensor cannot share; assign t.clone(), or copy the values "
                                   "(p.data.copy_(t))") from None
        try:
            value.copy_(alias)
        except BaseException:
            torch.utils.swap_tensors(value, alias)  # the script's tensor as it was
            raise


#: ``torch.zeros_like`` and its kin: a :class:`CloudState`, which ``p.copy_`` copies as the number it holds.
_LIKE_OPS, _values_of = made_like(CloudState)


_VALUE_OPS: dict[Any, Callable[..., Any]] = {
    Tensor.to: itself_where_unmoved(Tensor.to), Tensor.cpu: itself_where_unmoved(Tensor.cpu),
    **{new: new_like(new) for new in (Tensor.new_zeros, Tensor.new_ones, Tensor.new_empty, Tensor.new_full,
                                       Tensor.new_tensor)},
    torch.randn_like: drawn_like(torch.randn_like), torch.rand_like: drawn_like(torch.rand_like),
    torch.randint_like: drawn_like(torch.randint_like),
    Tensor.copy_: new_values(lambda value, source, non_blocking=False: value.copy_(_values_of(source))),
    **{op: new_values(op) for op in (Tensor.fill_, Tensor.zero_, Tensor.normal_, Tensor.uniform_)},
    # the initialisers torch lets a tensor subclass own; the others reach the Tensor methods above
    **{init: new_values(init, no_grad=True) for init in (torch.nn.init.normal_, torch.nn.init.uniform_,
                                                          torch.nn.init.constant_, torch.nn.init.kaiming_uniform_)},
    Tensor.detach: CloudTensor.alias, _DATA_GETTER: CloudTensor.alias, _DATA_SETTER: _data_set,
    Tensor.__getitem__: CloudSlice,  # p.data[i:j].fill_(1.0): new values for a part (cloud_slices.py)
    # a single value read as a Python number, as .item() reads it (int(bn.num_batches_tracked))
    Tensor.__int__: lambda t: int(t.item()), Tensor.__float__: lambda t: float(t.item()),
    Tensor.__bool__: lambda t: bool(t.item()), Tensor.__index__: lambda t: operator.index(cast(int, _integral(t).item())),
    **_LIKE_OPS,
}


#: On an optimizer's state for a cloud parameter: ``state[k].to(device)`` where it already is (as
#: Lightning's teardown moves every state tensor) gives the state itself, as unsplit.
_STATE_OPS: dict[Any, Callable[..., Any]] = {
    Tensor.to: itself_where_unmoved(Tensor.to), Tensor.cpu: itself_where_unmoved(Tensor.cpu), **_LIKE_OPS}


def _integral(tensor: CloudTensor) -> CloudTensor:
    """``operator.index`` of a tensor takes an integer one only, as torch's does."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        raise TypeError("only integer tensors of a single element can be converted to an index")
    return tensor


def _refusal(func: Any, tensor: Any) -> str:
    name = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or str(func)
    if name.endswith("__get__") or name.endswith("__set__"):  # a property's: p.data = t
        attribute = getattr(getattr(func, "__self__", None), "__name__", "an attribute")
        name = f"{'setting' if name.endswith('__set__') else 'reading'} .{attribute}"
    what = tensor._what() if isinstance(tensor, RemoteTensor) else "a cloud tensor"
    if name.endswith("numpy"):  # a histogram's, a plot's: an array over the tensor's memory, which is in the cloud
        return (f"{name} on {what}: a NumPy array shares the tensor's memory, and its values live in the cloud; for "
                "them (a histogram, a plot) take a copy, t.detach().clone().numpy(), which reads them back")
    if isinstance(tensor, CloudGrad):
        return (f"{name} on {what}: the gradient lives in the cloud, where only these reach it: torch's elementwise "
                "functions, comparisons and reductions (splitft.wire.expressions lists them; their in-place forms "
                "too), norms, clip_grad_norm_ / clip_grad_value_, p.grad = None; else compute on p.grad.clone()")
    if isinstance(tensor, CloudMoment):
        return f"{name} on {what}: {tensor._hint()}"
    if name == "setting .data":
        return (f"{name} on {what}: the parameter's values live in the cloud, where this new tensor would not "
                "go (split training would silently differ from the unsplit model). Change the values in place "
                "(with torch.no_grad(): p.mul_(0.5), p.copy_(tensor)) or load them with model.load_state_dict(...)")
    return (f"{name} on {what}: its values live in the cloud, so this would compute on nothing (split "
            "training would silently differ from the unsplit model), and the cloud computes only torch's "
            "elementwise functions, comparisons and reductions of them (splitft.wire.expressions lists them). "
            "Compute on a copy, p.detach().clone() (it reads the values back), or before split(); set values "
            "with p.copy_(tensor) or model.load_state_dict(...)")


_GRAD_OPS = {**GRAD_OPS, _DATA_SETTER: _data_set_to_itself}

#: Every torch function that reaches the cloud rather than raising, by the kind of tensor it takes.
MIRRORED: dict[str, frozenset[Any]] = {"values": frozenset(_VALUE_OPS), "gradients": frozenset(_GRAD_OPS),
                                       "made like": frozenset(_STATE_OPS),
                                       "computed": frozenset([*expressions.FUNCTIONS.values(), Tensor.__setitem__,
                                                              Tensor.index_fill_])}  # those two as masked fills


__all__ = ["CloudGrad", "CloudMoment", "CloudState", "METADATA", "CloudTensor", "MIRRORED", "Remote", "RemoteTensor",
           "remote_of"]
