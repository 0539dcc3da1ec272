"""A split model's modules, parameters and buffers, under the unsplit model's names.

A split model wraps the user's model (its ``.wrapped``). Were it an ordinary wrapper, torch would
name everything inside it ``model.<name>``, so a script that picks parameters by name —
``n.startswith("classifier.")`` for a head's own learning rate, ``name == "fc.weight"``, a layer
decay that matches ``^blocks\\.(\\d+)``, freezing by ``name.split(".")[0]`` — would pick nothing
and train the split model differently from the unsplit one, silently. :class:`UnsplitTree` makes
the split model answer ``named_parameters``, ``named_buffers``, ``named_modules``,
``named_children`` (and so ``parameters``, ``modules``, ``children`` ...) as the unsplit model
does (the root module is the wrapped model, the object the user built), as ``state_dict`` does.

torch's ``train``, ``apply`` and ``_apply`` walk ``children()``; they are passed to the wrapped
model whole, so its root module's own mode, parameters and buffers are reached as unsplit.

The parameters set on the wrapped model's root itself (CLIP's ``logit_scale``) are the split
model's own ``_parameters`` too, the same table: code that reads a model's root parameters there
(``transformers.Trainer`` builds its weight-decay groups from ``named_children()`` and
``model._parameters``) finds them as on the unsplit model. What a script sets on the split model
that it does not have itself — an auxiliary head (``model.aux = nn.Linear(...)``,
``add_module``), a buffer (``register_buffer``), a parameter, a setting the model's forward
reads — is set on the wrapped model, where the unsplit model would have it: in ``parameters()``
for the optimizer, in ``state_dict()``, read by the forward. (Private names stay the split model's.)

Other attributes the split model lacks are the wrapped model's (``model.config``); one both have
(a model with its own ``predict``) means the split model's, and :func:`hidden_attributes` names
them so that ``split()`` can say so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn


class UnsplitTree(nn.Module):
    """The module tree of ``self.wrapped`` under its own names (see the module)."""

    @property
    def wrapped(self) -> nn.Module:
        """The model that was split (the object the user built; its cloud modules are ghosts)."""
        return self._modules["model"]  # type: ignore[return-value]

    def named_children(self) -> Iterator[tuple[str, nn.Module]]:
        return self.wrapped.named_children()

    def named_modules(self, memo: set[nn.Module] | None = None, prefix: str = "",
                      remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
        # The root is the wrapped model, the user's own object, as it is the unsplit model's root:
        # a walk that checks its class (``isinstance(m, nn.Sequential)``) finds it.
        return self.wrapped.named_modules(memo, prefix, remove_duplicate)

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        return self.wrapped.named_parameters(prefix, recurse, remove_duplicate)

    def named_buffers(self, prefix: str = "", recurse: bool = True,
                      remove_duplicate: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        return self.wrapped.named_buffers(prefix, recurse, remove_duplicate)

    @property
    def training(self) -> bool:
        """The wrapped model's flag, the unsplit model's root's: ``model.training = False`` sets it
        (its forward reads ``self.training``), as unsplit."""
        return self.wrapped.training if self.__dict__.get("_sealed") else self.__dict__.get("_training", True)

    @training.setter
    def training(self, mode: bool) -> None:
        if self.__dict__.get("_sealed"):
            self.wrapped.training = mode
        else:
            self.__dict__["_training"] = mode

    def train(self, mode: bool = True) -> Any:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self.training = mode
        self.wrapped.train(mode)
        return self

    def apply(self, fn: Callable[[nn.Module], None]) -> Any:
        self.wrapped.apply(fn)  # every module once, the wrapped root last, as on the unsplit model
        return self

    def seal(self) -> None:
        """Called once the split model's own attributes are set: from now on the wrapped model's
        root parameters are this module's own table, and what a script sets on the split model
        that it does not have itself is set on the wrapped model (see the module)."""
        self.__dict__["_parameters"] = self.wrapped._parameters
        self.__dict__["_modules"] = _OwnModules(self._modules, self.wrapped)
        self.__dict__["_sealed"] = True

    def _is_own(self, name: str) -> bool:
        """Whether ``name`` is the split model's own (private, its attribute, or its class's),
        or, before :meth:`seal`, anything."""
        return (not self.__dict__.get("_sealed") or name.startswith("_") or name in self.__dict__
                or hasattr(type(self), name))

    def __setattr__(self, name: str, value: Any) -> None:
        if self._is_own(name):
            super().__setattr__(name, value)
        else:  # an aux head, a buffer, a setting the model's forward reads: set on the model, as unsplit
            setattr(self.wrapped, name, value)

    def __delattr__(self, name: str) -> None:
        if self._is_own(name):  # a root parameter, whatever its name, leaves the shared table
            super().__delattr__(name)
        else:
            delattr(self.wrapped, name)

    def register_buffer(self, name: str, tensor: torch.Tensor | None, persistent: bool = True) -> None:
        if self.__dict__.get("_sealed"):
            self.wrapped.register_buffer(name, tensor, persistent)
        else:
            super().register_buffer(name, tensor, persistent)

    def register_module(self, name: str, module: nn.Module | None) -> None:
        if self.__dict__.get("_sealed"):
            self.wrapped.register_module(name, module)
        else:
            super().register_module(name, module)

    add_module = register_module

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        self.wrapped._apply(fn, recurse)  # the root parameters with it: they are the wrapped model's
        own_parameters, self.__dict__["_parameters"] = self._parameters, {}
        try:
            return super()._apply(fn, recurse=False)  # this module's own buffers, if any
        finally:
            self.__dict__["_parameters"] = own_parameters


class _OwnModules(dict):
    """The split model's own submodules (the wrapped model, under ``"model"``). A public name
    written here is the wrapped model's child, where the unsplit model has it: a walk over
    ``named_children()`` that swaps a layer by ``module._modules[name] = new`` (activation
    replacement) replaces the model's layer, as unsplit, instead of adding one nothing calls."""

    def __init__(self, own: dict[str, Any], wrapped: nn.Module) -> None:
        super().__init__(own)
        self.wrapped = wrapped

    def _forwarded(self, name: str) -> bool:
        return isinstance(name, str) and name != "model" and not name.startswith("_")

    def __setitem__(self, name: str, module: Any) -> None:
        if self._forwarded(name):
            self.wrapped._modules[name] = module
        else:
            super().__setitem__(name, module)

    def __delitem__(self, name: str) -> None:
        if self._forwarded(name) and name not in self:
            del self.wrapped._modules[name]
        else:
            super().__delitem__(name)


def hidden_attributes(split: nn.Module, split_class: type, model: nn.Module, handled: tuple[str, ...] = ()) -> list[str]:
    """The public names ``model`` (the model that was split) answers that ``split`` (an instance of
    ``split_class`` or of a subclass that mirrors the model's own methods) answers too, beyond
    those every module has and those in ``handled`` (overridden to act as the model's)."""
    module_api = set(dir(nn.Module)) | set(vars(nn.Module()))
    ours = {n for n in (*dir(split_class), *vars(split)) if not n.startswith("_")} - module_api
    theirs = {*dir(type(model)), *vars(model), *model._modules, *model._parameters, *model._buffers} - module_api
    return sorted(ours & theirs - set(handled))


def caller_level() -> int:
    """The ``stacklevel`` of the first frame outside splitft: where the script called it."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: Any = sys._getframe(1)
    level = 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep):
        frame, level = frame.f_back, level + 1
    return level


__all__ = ["UnsplitTree", "caller_level", "hidden_attributes"]
