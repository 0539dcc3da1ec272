"""The torch calls that read no values of a tensor: its shape, dtype, device, ``requires_grad``.

A tensor without values here (a cloud placeholder, what a plain split's ``model(x)`` returns)
answers these from its own metadata, since they tell nothing the cloud would compute differently;
every other call on it reaches the cloud or raises.
"""

from __future__ import annotations

from typing import Any, cast

import torch

Tensor = torch.Tensor

_PROPERTIES = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "ndim", "layout", "names",
               "is_cuda", "is_cpu", "is_sparse", "is_sparse_csr", "is_quantized", "is_mkldnn", "is_nested",
               "is_xpu", "is_mps", "is_mtia", "is_xla", "is_ipu", "is_vulkan", "is_maia", "itemsize", "nbytes",
               "output_nr", "_version", "_is_view", "is_complex", "is_floating_point", "is_signed", "dim", "ndimension",
               "size", "numel", "nelement", "element_size", "get_device", "is_contiguous", "stride", "storage_offset",
               "__len__", "__hash__", "__format__", "__dir__", "requires_grad_", "is_inference", "has_names",
               "_is_zerotensor", "is_conj", "is_neg", "_grad_fn")


#: The same questions asked as ``torch.is_complex(p)`` (Adagrad's constructor asks this one).
_TORCH_FUNCTIONS = ("is_complex", "is_floating_point", "is_signed", "is_conj", "is_neg", "is_inference", "numel")


def _metadata() -> set[Any]:
    found: set[Any] = {getattr(torch, name) for name in _TORCH_FUNCTIONS if hasattr(torch, name)}
    for name in _PROPERTIES:
        attribute = torch.Tensor.__dict__.get(name) or getattr(torch._C.TensorBase, name, None)
        if attribute is None:
            continue
        found.add(attribute.__get__ if hasattr(attribute, "__set__") else attribute)
        if name == "requires_grad":
            found.add(attribute.__set__)
    return found


#: ``t.is_meta``'s getter: a placeholder has values (in the cloud), so code that skips tensors
#: without any (``torch.nn.init.trunc_normal_``, ``orthogonal_``, ``sparse_``, ``dirac_``) must not skip it.
IS_META = cast(Any, Tensor.is_meta).__get__

#: Operations that read no values, answered from the tensor's own shape and dtype. ``requires_grad_``
#: is among them: the edge sends the cloud half's frozen set with each forward.
METADATA = frozenset(_metadata())

#: The calls among them that ask about a tensor's shape or element type: of a plain split's
#: ``model(x)``, the answers are the cloud half's output's (:mod:`.output_shapes`).
SHAPE_AND_TYPE = frozenset(
    query for name in ("shape", "dtype", "ndim", "itemsize", "nbytes", "dim", "ndimension", "size", "numel",
                       "nelement", "element_size", "is_contiguous", "stride", "storage_offset", "__len__",
                       "is_complex", "is_floating_point", "is_signed")
    if (attribute := torch.Tensor.__dict__.get(name) or getattr(torch._C.TensorBase, name, None)) is not None
    for query in [attribute.__get__ if hasattr(attribute, "__set__") else attribute]
) | {getattr(torch, name) for name in ("is_complex", "is_floating_point", "is_signed", "numel") if hasattr(torch, name)}

def described(func: Any) -> str:
    """A torch call as a script wrote it: ``shape`` for the getter torch hands ``__torch_function__``
    for ``t.shape`` (a descriptor's ``__get__``), else the function's name."""
    owner = getattr(func, "__self__", None)
    named = owner if isinstance(owner, type(Tensor.shape)) else func
    return str(getattr(named, "__name__", None) or func)


#: The calls among them that ask where a tensor is. A placeholder has no memory here (its C++
#: device is ``meta``), but its values are the unsplit model's, which were on the edge half's
#: device: a script that makes a buffer ``device=p.device`` or moves data ``.to(p.device)``
#: means that device, and ``meta`` would give it a tensor on which every operation does nothing.
DEVICE_QUERIES = frozenset(
    query for name in ("device", "is_cpu", "is_cuda", "is_xpu", "is_mps", "is_mtia", "is_xla", "is_ipu", "is_vulkan",
                       "is_maia", "get_device")
    if (attribute := torch.Tensor.__dict__.get(name) or getattr(torch._C.TensorBase, name, None)) is not None
    for query in [attribute.__get__ if hasattr(attribute, "__set__") else attribute])


def where(query: Any, device: torch.device) -> Any:
    """``query`` (one of :data:`DEVICE_QUERIES`) answered for a tensor on ``device``."""
    on = _EMPTY.get(device)
    if on is None:
        on = _EMPTY[device] = torch.empty(0, device=device)
    return query(on)


_EMPTY: dict[torch.device, torch.Tensor] = {}

#: The calls among them that set ``requires_grad``.
REQUIRES_GRAD_SETTERS = frozenset((cast(Any, Tensor.requires_grad).__set__, Tensor.requires_grad_))
_requires_grad_changes = 0


def set_requires_grad(func: Any, args: tuple, kwargs: dict) -> Any:
    """``p.requires_grad_(flag)`` / ``p.requires_grad = flag`` on a placeholder, counted when it
    changes the flag (see :func:`requires_grad_changes`)."""
    global _requires_grad_changes
    with torch._C.DisableTorchFunctionSubclass():
        before = args[0].requires_grad
        result = func(*args, **kwargs)
        _requires_grad_changes += args[0].requires_grad != before
    return result


def requires_grad_changes() -> int:
    """How many times a script flipped ``requires_grad`` of a cloud tensor: a plain split's loss
    refuses a change since its ``model(x)``, whose graph unsplit was built with the flags then."""
    return _requires_grad_changes


__all__ = ["DEVICE_QUERIES", "IS_META", "METADATA", "REQUIRES_GRAD_SETTERS", "SHAPE_AND_TYPE",
           "described", "requires_grad_changes", "set_requires_grad", "where"]
