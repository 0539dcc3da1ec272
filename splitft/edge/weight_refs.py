"""Weak references a module keeps to its own parameters: torch's RNNs (``nn.RNN``, ``nn.GRU``,
``nn.LSTM``) keep one per weight, to notice a weight set anew, and a tensor with a weak reference
cannot have its contents swapped. The cut drops them before the cloud half's tensors become
placeholders, points the edge's twin of the module at the values it holds, and gives the module
them back, to the values, when the model is whole again."""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn


def _rnns(modules: Iterable[nn.Module]) -> list[nn.RNNBase]:
    return [sub for module in modules for sub in module.modules() if isinstance(sub, nn.RNNBase)]


def drop(modules: Iterable[nn.Module]) -> None:
    """Before the swap: the RNNs among ``modules`` hold no weak reference to their weights."""
    for rnn in _rnns(modules):
        rnn._flat_weight_refs = [None] * len(rnn._flat_weights_names)


def point_twin(twin: nn.Module) -> None:
    """An RNN's twin computes with the weights it holds (its list of them was the original's),
    still without weak references: they would keep the swap from being undone."""
    if isinstance(twin, nn.RNNBase):
        twin._flat_weights = [twin._parameters.get(name) for name in twin._flat_weights_names]
        twin._flat_weight_refs = [None] * len(twin._flat_weights_names)


def restore(modules: Iterable[nn.Module]) -> None:
    """After the swap back: the RNNs notice a weight set anew again, as before the cut."""
    for rnn in _rnns(modules):
        rnn._init_flat_weights()


__all__ = ["drop", "point_twin", "restore"]
