"""``p[index]`` of a cloud parameter or buffer, for the in-place calls that only give it new values.

Initialisation code writes through a view: an LSTM's forget-gate bias set to 1
(``p.data[n // 4:n // 2].fill_(1.0)``), a block of a weight drawn anew (``w[:, :k].normal_(0, 0.02)``,
``nn.init.zeros_(w[0])``). The view's values live in the cloud, but these calls read none of them: each
runs here on the same view of a fresh tensor of the parameter's shape (so a draw comes from the edge's
generator, in the order torch draws for that view), and what it made is written through the index
(``p[index] = values``, which the cloud applies). Anything else on the view reads its values and is
refused, as on the parameter itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import PlaceholderError
from .metadata import METADATA

Tensor = torch.Tensor

#: The calls that give a view new values without reading the old ones (torch's initialisers that a
#: tensor subclass owns; the others reach these methods).
WRITES = frozenset((Tensor.fill_, Tensor.zero_, Tensor.copy_, Tensor.normal_, Tensor.uniform_,
                    torch.nn.init.normal_, torch.nn.init.uniform_, torch.nn.init.constant_,
                    torch.nn.init.kaiming_uniform_))


class CloudSlice(Tensor):
    """``base[index]`` of a cloud tensor ``base``: its shape here, its values in the cloud."""

    _splitft_base: Tensor
    _splitft_index: Any

    @staticmethod
    def __new__(cls, base: Tensor, index: Any) -> CloudSlice:
        view = torch.empty(base.shape, dtype=base.dtype, device="meta")[index]  # raises as torch's indexing would
        made: Any = Tensor._make_wrapper_subclass(cls, view.shape, strides=view.stride(), dtype=base.dtype,
                                                  device=base.device, requires_grad=base.requires_grad)
        made._splitft_base, made._splitft_index = base, index
        return made

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's: unannotated
        return f"CloudSlice(of {self._splitft_base!r}, shape={tuple(self.shape)}, values in the cloud)"

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        target = args[0] if args else kwargs.pop("tensor", None)
        if func in WRITES and isinstance(target, CloudSlice):
            return target._write(func, args[1:], kwargs)
        view = target if isinstance(target, CloudSlice) else next(
            (a for a in args if isinstance(a, CloudSlice)), None)
        base = view._splitft_base if view is not None else "a cloud tensor"
        raise PlaceholderError(
            f"{getattr(func, '__name__', func)} on an indexed part of {base!r}: its values live in the cloud. Calls "
            "that only give it new values are mirrored (fill_, zero_, copy_, normal_, uniform_, torch.nn.init's "
            "constant_, normal_, uniform_), as is an indexed write (p.data[i] = value); to read it, read the "
            "parameter's values first (model.state_dict()), or do it before split()")

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's default is a plain function
            cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise PlaceholderError(f"{func} on an indexed part of a cloud tensor: its values live in the cloud")

    def _write(self, func: Callable, args: tuple, kwargs: dict) -> CloudSlice:
        base, index = self._splitft_base, self._splitft_index
        if torch.is_grad_enabled() and base.requires_grad and getattr(func, "__module__", None) != "torch.nn.init":
            raise RuntimeError("a view of a leaf Variable that requires grad is being used in an in-place operation.")
        with torch.no_grad():
            scratch = torch.empty(base.shape, dtype=base.dtype, device=base.device)
            func(scratch[index], *args, **kwargs)  # the view's draws, in the order torch draws for it
            base[index] = scratch[index]
        return self


__all__ = ["WRITES", "CloudSlice"]
