"""Tensors a script makes on the edge from a cloud tensor without reading its values.

``torch.randn_like(p)`` draws, ``p.new_zeros(n)`` makes a tensor of ``p``'s dtype, and ``p.to(p.device)``
or ``p.cpu()`` is ``p`` itself: unsplit none of them reads a value of ``p``, so each is made here,
where the unsplit model's values were (the edge half's device), from ``p``'s shape and dtype alone.
New values for a cloud tensor that read none of its old ones (``p.normal_()``, ``nn.init``'s
initialisers) are made here too, then pushed to the cloud (:func:`new_values`). ``torch.zeros_like(p)``
and its kin are made here too, but in an optimizer's constructor, where they stand for the number
they hold: that state is the cloud's copy's (:func:`made_like`).
"""

from __future__ import annotations

import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import torch

from ..errors import PlaceholderError

Tensor = torch.Tensor


def drawn_like(draw: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``torch.randn_like(p)`` and kin: drawn here, on the edge half's device, from the generator
    the unsplit model's draw would use; they read no values of ``p``, only its shape."""

    def drawn(source: Any, *args: Any, dtype: Any = None, device: Any = None, **kwargs: Any) -> Tensor:
        like = torch.empty(source.shape, dtype=dtype or source.dtype,
                           device=device if device is not None else source._splitft_remote.device)
        return draw(like, *args, **kwargs)

    return drawn


def new_like(factory: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``p.new_zeros(size)`` and kin: a tensor made here, of ``p``'s dtype on the edge half's device
    unless the call names others, as unsplit (they read no values of ``p``)."""

    def new(source: Any, *args: Any, **kwargs: Any) -> Tensor:
        return factory(torch.empty(0, dtype=source.dtype, device=source._splitft_remote.device), *args, **kwargs)

    return new


def legacy_new(source: Any, *args: Any, **kwargs: Any) -> Tensor:
    """``t.new(size)``, torch's legacy constructor, which a tensor subclass's ``__torch_function__``
    does not see (it read a ``torch.Size`` as the values of a tensor): a tensor made here, of ``t``'s
    dtype on the edge half's device unless the call names others, as unsplit (it reads no values)."""
    return torch.empty(0, dtype=source.dtype, device=source._splitft_remote.device).new(*args, **kwargs)


def made_like(state: Callable[..., Tensor]) -> tuple[dict[Any, Callable[..., Any]], Callable[[Any], Tensor]]:
    """``torch.zeros_like(p)`` and its kin, and what ``p.copy_(t)`` copies.

    Made by an optimizer's constructor (Adagrad's accumulators), a tensor like a cloud one is
    ``state(source, name, remote, dtype, fill)`` (the number in every element; None for
    ``empty_like``'s): the cloud's copy of the optimizer makes its own, so the edge keeps no
    memory for it. Made by the script (an average's or a momentum's buffers), or asked for on a
    device of its own, it is a real tensor, as unsplit. Either reads no values of the cloud's.
    Copied into a cloud tensor, a ``state`` is its number, in its dtype; any other source is copied
    as it is.
    """

    def like(fill_of: Callable[..., Any]) -> Callable[..., Any]:
        def made(source: Any, *args: Any, dtype: Any = None, layout: Any = None, device: Any = None,
                 pin_memory: Any = None, requires_grad: bool = False, memory_format: Any = None, **fill: Any) -> Tensor:
            value = fill_of(*args, **fill)
            if (layout not in (None, torch.strided) or pin_memory
                    or memory_format not in (None, torch.preserve_format, torch.contiguous_format)):
                raise PlaceholderError(f"a tensor like {source._what()} is made here with the default layout and "
                                       "memory format only")
            dtype = dtype or source.dtype
            if device is not None and torch.device(device).type == "meta":
                device = None
            if device is not None or requires_grad or not _an_optimizers_constructor():
                tensor = torch.empty(source.shape, dtype=dtype,
                                     device=device if device is not None else source._splitft_remote.device)
                return (tensor if value is None else tensor.fill_(value)).requires_grad_(requires_grad)
            return state(source, source._splitft_name, source._splitft_remote, dtype, value)

        return made

    def values_of(source: Any) -> Tensor:
        if not isinstance(source, state):  # type: ignore[arg-type]  # a class, given as its constructor
            return source.detach()
        if source._splitft_fill is None:
            raise PlaceholderError(f"copying {source._what()} made by torch.empty_like: its values are whatever "
                                   "memory held; fill it first (torch.zeros_like, torch.full_like)")
        return torch.full(source.shape, source._splitft_fill, dtype=source.dtype)

    ops = {torch.zeros_like: like(lambda: 0), torch.ones_like: like(lambda: 1), torch.full_like: like(_fill_value),
           torch.empty_like: like(lambda: None)}
    return ops, values_of


def _an_optimizers_constructor() -> bool:
    """Whether an optimizer's ``__init__`` is running (Adagrad's makes its accumulators there): what
    it makes for a cloud parameter is the cloud's copy's to keep."""
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), torch.optim.Optimizer):
            return True
        frame = frame.f_back
    return False


def _fill_value(fill_value: Any) -> Any:
    if not isinstance(fill_value, (bool, int, float, complex)):
        raise PlaceholderError("torch.full_like of a cloud tensor takes a Python number as its value")
    return fill_value


def itself_where_unmoved(convert: Callable[..., Tensor]) -> Callable[..., Tensor]:
    """``p.to(p.device)``, ``p.cpu()`` with the edge half on the CPU: unsplit, ``p`` itself (torch
    returns a tensor that already is where and what it is asked to be), so the cloud tensor itself;
    moved or cast, a copy of values that are in the cloud, refused."""

    def converted(source: Any, *args: Any, **kwargs: Any) -> Any:
        probe = torch.empty(0, dtype=source.dtype, device=source._splitft_remote.device)
        if convert(probe, *args, **kwargs) is probe:
            return source
        raise PlaceholderError(f"{convert.__name__}(...) to another device or dtype on {source._what()}: its values "
                               "live in the cloud, and this copy of them would be the unsplit model's own tensor only "
                               "where it does not move; read the weights with model.state_dict()")

    return converted


def new_values(make: Callable[..., Any], *, no_grad: bool = False) -> Callable[..., Any]:
    """An in-place operation that gives a cloud parameter or buffer new values without reading the
    old ones (``copy_``, ``fill_``, ``zero_``, ``normal_``, ``uniform_``, torch's initialisers): run
    here on a fresh tensor on the edge half's device, so a draw comes from the generator the unsplit
    model's would use (the call's, else torch's), and its result pushed to the cloud. ``no_grad``:
    an initialiser, which torch runs without grad."""

    def made(*args: Any, **kwargs: Any) -> Any:
        target, args = (args[0], args[1:]) if args else (kwargs.pop("tensor"), ())  # torch.nn.init passes tensor=
        with torch.no_grad() if no_grad else contextlib.nullcontext():
            if torch.is_grad_enabled() and target.requires_grad:
                raise RuntimeError("a leaf Variable that requires grad is being used in an in-place operation.")
            value = torch.empty(target.shape, dtype=target.dtype, device=target._splitft_remote.device)
            make(value, *args, **kwargs)
        target._splitft_remote.push_values(target._splitft_name, value)
        return target

    return made


__all__ = ["drawn_like", "itself_where_unmoved", "legacy_new", "made_like", "new_like", "new_values"]
