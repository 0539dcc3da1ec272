"""Rotary position tables rebuilt by each decoder layer, so that a cut inside the decoder carries
the position ids and not the tables.

A Llama-family decoder (``LlamaModel`` and the transformers models built like it) computes the
rotary tables (cos and sin, batch x tokens x head dim, float32) once per forward and passes them
to every layer. A cut between layers would then send them with every call: 64 KiB at 128 tokens,
as much as 2-bit hidden states of a batch of four. They are a function of the position ids alone
(and of a buffer of inverse frequencies every copy of the model holds), so
:func:`rebuild_rotary` gives each layer its own copy of the rotary module and a forward that
computes the tables from the ``position_ids`` it is called with, and has the decoder hand the
layers none. The cloud half recomputes them for its layers; only the position ids cross.
The values are those the decoder would have passed, bit for bit: the same module, the same ids,
the same dtype.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ...errors import ConfigError


class DeferredRotary(nn.Module):
    """The decoder's rotary module, giving the layers no tables: each rebuilds its own.

    Holds the original as ``rotary`` for code that wants the tables themselves (a layer called
    outside the decoder's forward, as :mod:`splitft.app.tasks.smollm_chain` calls them).
    """

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> None:
        return None


class RebuildsRotary(nn.Module):
    """Mixin before a decoder layer's class: its forward computes the rotary tables from the
    position ids when the caller passed none (a caller that passes tables keeps them).

    A class rather than a forward hook: a split model's edge keeps the cloud's layers as ghosts
    whose forward sends the call away, and hooks would still run there, on placeholders.
    """

    rotary: nn.Module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("position_embeddings") is None:
            hidden = args[0] if args else kwargs.get("hidden_states")
            positions = kwargs.get("position_ids")
            if hidden is None or positions is None:
                raise ConfigError(f"{type(self).__name__} rebuilds its rotary tables from position_ids, and was "
                                  "called without them (or without hidden states)")
            kwargs["position_embeddings"] = self.rotary(hidden, positions)
        return super().forward(*args, **kwargs)


_CLASSES: dict[type, type] = {}


def _rebuilding(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` with :class:`RebuildsRotary` before it (one class per layer class)."""
    if issubclass(cls, RebuildsRotary):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        made = _CLASSES[cls] = type(cls.__name__, (RebuildsRotary, cls),
                                    {"__module__": cls.__module__, "__qualname__": cls.__qualname__})
    return made


def rebuild_rotary(decoder: nn.Module) -> nn.Module:
    """Make every layer of ``decoder`` (a ``LlamaModel``-like module with ``rotary_emb`` and
    ``layers``) compute its rotary tables from its position ids; returns ``decoder``.

    Both halves of a split build the model with the same factory, so both get the change; a
    layer's copy of the rotary module holds a non-persistent buffer, not a weight.
    """
    rotary, layers = getattr(decoder, "rotary_emb", None), getattr(decoder, "layers", None)
    if not isinstance(rotary, nn.Module) or not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"rebuild_rotary takes a Llama-family decoder (a module with a rotary_emb module and a "
                          f"ModuleList of layers), got {type(decoder).__name__}")
    if isinstance(rotary, DeferredRotary):
        return decoder
    for layer in layers:
        layer.rotary = copy.deepcopy(rotary)
        layer.__class__ = _rebuilding(type(layer))
    decoder.rotary_emb = DeferredRotary(rotary)
    return decoder


def rotary_of(decoder: nn.Module) -> nn.Module:
    """The decoder's own rotary module, whether or not :func:`rebuild_rotary` deferred it."""
    rotary = decoder.get_submodule("rotary_emb")
    return rotary.rotary if isinstance(rotary, DeferredRotary) else rotary
