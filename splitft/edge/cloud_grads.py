"""What a script does to a cloud parameter's gradient (``p.grad``), mirrored in the cloud.

Its norm (``torch.linalg.vector_norm``, ``Tensor.norm``, ``_foreach_norm``) is fetched from the
cloud; ``mul_``, ``div_``, ``clamp_``, ``zero_`` and torch's foreach and loss-scaling kernels over
it, alone or in a list that holds edge gradients too, are applied there, so torch's own
``clip_grad_norm_``, ``clip_grad_value_`` and ``GradScaler`` act on both halves. :data:`GRAD_OPS`
is the table :class:`~.placeholders.CloudGrad` dispatches by (with ``g.data = v``, refused there).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch

from ..errors import PlaceholderError
from .made_here import drawn_like, itself_where_unmoved

Tensor = torch.Tensor
#: What torch passes for ``t.data``.
_DATA_GETTER = cast(Any, Tensor.data).__get__


def is_cloud_grad(tensor: Any) -> bool:
    """Whether ``tensor`` is a cloud parameter's gradient (:class:`~.placeholders.CloudGrad` says so)."""
    return isinstance(tensor, Tensor) and getattr(type(tensor), "_splitft_grad", False)


def _split(tensors: list[Tensor]) -> tuple[list[int], list[Tensor], list[Any]]:
    """Indexes of the cloud gradients in ``tensors``, the edge's tensors, the cloud gradients."""
    cloud = [i for i, t in enumerate(tensors) if is_cloud_grad(t)]
    at = set(cloud)
    return cloud, [t for i, t in enumerate(tensors) if i not in at], [t for t in tensors if is_cloud_grad(t)]


def _names(grads: list[Any]) -> list[str]:
    return [g._splitft_name for g in grads]


def _remote_of(grads: list[Any]) -> Any:
    owners = {id(g._splitft_remote): g._splitft_remote for g in grads}
    if len(owners) > 1:
        raise PlaceholderError("one operation over the gradients of several split models; call it once per model")
    return next(iter(owners.values()))


def _norm_type(value: Any) -> float:
    if value is None or value == "fro":
        return 2.0
    if isinstance(value, Tensor):
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise PlaceholderError(f"a norm of type {value!r} of a cloud gradient is not mirrored; use a number or inf")
    return float(value)


def _whole(what: str, dim: Any, keepdim: bool, dtype: Any) -> None:
    if dim is not None or keepdim or dtype is not None:
        raise PlaceholderError(f"{what} of a cloud gradient is mirrored for the whole tensor only (no dim, keepdim "
                               "or dtype)")


def _vector_norm(grad: Any, ord: Any = 2, dim: Any = None, keepdim: bool = False, *, dtype: Any = None,
                 out: Any = None) -> Tensor:
    _whole("torch.linalg.vector_norm", dim, keepdim, dtype)
    return grad._splitft_remote.grad_norms([grad._splitft_name], _norm_type(ord))[0]


def _norm(grad: Any, p: Any = "fro", dim: Any = None, keepdim: bool = False, dtype: Any = None, out: Any = None) -> Tensor:
    _whole("norm", dim, keepdim, dtype)
    return grad._splitft_remote.grad_norms([grad._splitft_name], _norm_type(p))[0]


def _foreach_norm(tensors: list[Tensor], ord: Any = 2, dtype: Any = None) -> tuple[Tensor, ...]:
    if dtype is not None:
        raise PlaceholderError("torch._foreach_norm over cloud gradients is mirrored without dtype=")
    at, edge, cloud = _split(list(tensors))
    norms = list(torch._foreach_norm(edge, ord)) if edge else []
    fetched = _remote_of(cloud).grad_norms(_names(cloud), _norm_type(ord))
    return tuple(_merge(len(tensors), at, norms, fetched))


def _merge(count: int, at: list[int], edge: list[Any], cloud: list[Any]) -> list[Any]:
    out: list[Any] = []
    cloud_iter, edge_iter, wanted = iter(cloud), iter(edge), set(at)
    for i in range(count):
        out.append(next(cloud_iter) if i in wanted else next(edge_iter))
    return out


def _number(value: Any, what: str) -> float:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise PlaceholderError(f"{what} of a cloud gradient by a tensor is mirrored for a single number only")
        value = value.item()
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise PlaceholderError(f"{what} of a cloud gradient by {value!r} is not mirrored; use a number")
    return float(value)


def _change(kind: str, value_of: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The in-place method and the foreach kernel that change gradients the same way in the cloud."""

    def method(grad: Any, *args: Any, **kwargs: Any) -> Any:
        grad._splitft_remote.change_grads([grad._splitft_name], kind, value_of(*args, **kwargs))
        return grad

    def foreach(tensors: list[Tensor], *args: Any, **kwargs: Any) -> None:
        at, edge, cloud = _split(list(tensors))
        listed = [isinstance(a, (list, tuple)) and len(a) == len(tensors) for a in args]
        if not any(listed):
            if edge:
                getattr(torch, f"_foreach_{kind}_")(edge, *args, **kwargs)
            _remote_of(cloud).change_grads(_names(cloud), kind, value_of(*args, **kwargs))
            return
        # one value per tensor (torch._foreach_div_(grads, norms)): each cloud gradient its own, checked first
        values = [value_of(*(a[i] if each else a for a, each in zip(args, listed)), **kwargs) for i in at]
        if edge:
            mine = [i for i in range(len(tensors)) if i not in set(at)]
            getattr(torch, f"_foreach_{kind}_")(edge, *([a[i] for i in mine] if each else a
                                                        for a, each in zip(args, listed)), **kwargs)
        remote = _remote_of(cloud)
        for grad, value in zip(cloud, values):
            remote.change_grads([grad._splitft_name], kind, value)

    return method, foreach


def _scalar(what: str) -> Callable[..., float]:
    def value(other: Any = None, *, alpha: Any = None, rounding_mode: Any = None) -> float:
        if alpha is not None or rounding_mode is not None:
            raise PlaceholderError(f"{what} of a cloud gradient is mirrored without alpha= or rounding_mode=")
        return _number(other, what)
    return value


def _bounds(min: Any = None, max: Any = None) -> tuple[float | None, float | None]:
    low = None if min is None else _number(min, "clamp")
    high = None if max is None else _number(max, "clamp")
    return low, high


def _low(scalar: Any) -> tuple[float | None, float | None]:
    return _number(scalar, "clamp_min"), None


def _high(scalar: Any) -> tuple[float | None, float | None]:
    return None, _number(scalar, "clamp_max")


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


_MUL, _FOREACH_MUL = _change("mul", _scalar("mul_"))
_DIV, _FOREACH_DIV = _change("div", _scalar("div_"))
_CLAMP = _change("clamp", _bounds)[0]
_CLAMP_MIN, _FOREACH_CLAMP_MIN = _change("clamp_min", _low)
_CLAMP_MAX, _FOREACH_CLAMP_MAX = _change("clamp_max", _high)
_ZERO, _FOREACH_ZERO = _change("zero", _nothing)


def _unscale(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """``GradScaler.unscale_``: the cloud's gradients are checked for inf/NaN, then multiplied too."""
    _at, edge, cloud = _split(list(grads))
    if edge:
        torch._amp_foreach_non_finite_check_and_unscale_(edge, found_inf, inv_scale)
    remote = _remote_of(cloud)
    names = _names(cloud)
    if not all(math.isfinite(float(n)) for n in remote.grad_norms(names, math.inf)):
        found_inf.fill_(1.0)
    remote.change_grads(names, "mul", float(inv_scale))


def _same(grad: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """``detach()``, ``.data``, ``requires_grad_(False)``: a gradient is already all of these."""
    return grad


GRAD_OPS: dict[Any, Callable[..., Any]] = {
    torch.linalg.vector_norm: _vector_norm, Tensor.norm: _norm, torch.norm: _norm,
    torch._foreach_norm: _foreach_norm,
    Tensor.mul_: _MUL, Tensor.div_: _DIV, torch._foreach_mul_: _FOREACH_MUL, torch._foreach_div_: _FOREACH_DIV,
    Tensor.clamp_: _CLAMP, Tensor.clip_: _CLAMP, Tensor.clamp_min_: _CLAMP_MIN, Tensor.clamp_max_: _CLAMP_MAX,
    torch._foreach_clamp_min_: _FOREACH_CLAMP_MIN, torch._foreach_clamp_max_: _FOREACH_CLAMP_MAX,
    Tensor.zero_: _ZERO, torch._foreach_zero_: _FOREACH_ZERO,
    torch._amp_foreach_non_finite_check_and_unscale_: _unscale,
    Tensor.detach: _same, Tensor.detach_: _same, _DATA_GETTER: _same,
    Tensor.to: itself_where_unmoved(Tensor.to), Tensor.cpu: itself_where_unmoved(Tensor.cpu),
    torch.randn_like: drawn_like(torch.randn_like), torch.rand_like: drawn_like(torch.rand_like),
}


__all__ = ["GRAD_OPS", "is_cloud_grad"]
