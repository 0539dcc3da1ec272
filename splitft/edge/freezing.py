"""Progressive freezing of the edge (PipeTransformer's idea): layers stop training as they
converge, front to back, and once the whole edge is frozen its steps stream.

The rule, per layer, on what the edge already has: the norm of the layer's gradient at each
optimizer step. A layer has converged when that norm has reached a plateau: its mean over the
last ``window`` steps differs from its mean over the ``window`` steps before by at most
``threshold`` of the latter. A plateau, not a fall: fine-tuning a pre-trained encoder with AdamW,
the edge's gradient norms grow some 25 times over the first 16 steps and then stay within about
30% (MiniLM on BBC News, docs/slow-links.md), so a rule waiting for them to shrink never fires.
Layers freeze front to back, at most one per step, and only the frontmost trainable layer is
asked: a frozen layer behind a training one would still pass gradients it no longer uses, and
freezing the front first is what lets the backward stop early. A frozen layer's parameters stop
requiring gradients and lose the ones they had, so no optimizer moves them again.

When the last edge layer freezes, nothing needs the cut's gradient: the edge then runs as a
frozen edge does (``split(..., freeze_edge=True)``), and with ``Schedule(window=W)`` its steps
stream W at a time instead of waiting a round trip each (:mod:`splitft.edge.streaming`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError

log = logging.getLogger(__name__)


@dataclass
class Layer:
    """One edge layer: its parameters and the gradient norms seen so far."""

    name: str
    params: list[nn.Parameter]
    norms: list[float] = field(default_factory=list)
    frozen_at: int | None = None

    def norm(self) -> float:
        grads = [p.grad.detach().float().norm() for p in self.params if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(grads))) if grads else 0.0

    def converged(self, window: int, threshold: float) -> bool:
        if len(self.norms) < 2 * window:
            return False
        before = sum(self.norms[-2 * window:-window]) / window
        last = sum(self.norms[-window:]) / window
        return abs(last - before) <= threshold * before

    def freeze(self, step: int) -> None:
        for p in self.params:
            p.requires_grad_(False)
            p.grad = None
        self.frozen_at = step


def edge_layers(named: Iterable[tuple[str, nn.Parameter]]) -> list[tuple[str, list[nn.Parameter]]]:
    """The edge's parameters grouped into layers, in the order the model registers them (its
    forward order): the modules at the first depth where the edge's parameters part ways
    (``embeddings``, ``layer0`` of a chain; ``bert.embeddings`` under one wrapper), and a numbered
    container's members one by one (``bert.encoder.layer.0``, ``block1.0``)."""
    named = list(named)
    paths = [name.split(".")[:-1] for name, _ in named]
    depth = 1
    while len({tuple(p[:depth]) for p in paths}) == 1 and any(len(p) > depth for p in paths):
        depth += 1
    layers: dict[str, list[nn.Parameter]] = {}
    for (name, p), parts in zip(named, paths):
        numbered = next((i for i, part in enumerate(parts) if part.isdigit()), None)
        end = numbered + 1 if numbered is not None and numbered >= depth - 1 else depth
        layers.setdefault(".".join(parts[:end]) or name, []).append(p)
    return list(layers.items())


class ProgressiveFreezing:
    """Freeze ``model``'s edge layers as they converge (see the module); hooked on ``optimizer``'s
    step, so a training loop changes nothing.

    Args:
        model: a split model (:func:`splitft.split`) in a plain split with its loss in the cloud.
        optimizer: the optimizer that steps the edge (checked after each of its steps).
        window: steps per mean of gradient norms.
        threshold: how much, relative, a layer's last mean may differ from the one before it.
        on_frozen: called once, with the step, when the last edge layer froze.
    """

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer, *, window: int = 4, threshold: float = 0.3,
                 on_frozen: Callable[[int], None] | None = None) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ConfigError(f"window must be an int >= 1, got {window!r}")
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not threshold > 0:
            raise ConfigError(f"threshold must be a number > 0, got {threshold!r}")
        if model.spec.ushape:
            raise ConfigError("progressive freezing switches a plain split to streaming; a U-shape edge "
                              "needs its trunk's output back every step")
        cloud = {id(p) for p in model.cloud_parameters()}
        named = [(n, p) for n, p in model.named_parameters() if id(p) not in cloud and p.requires_grad]
        self.layers = [Layer(name, params) for name, params in edge_layers(named)]
        if not self.layers:
            raise ConfigError("the edge has no trainable parameters: nothing to freeze (use freeze_edge=True)")
        self.model, self.window, self.threshold, self.on_frozen = model, window, float(threshold), on_frozen
        self.step = 0
        self.frozen_at: int | None = None
        self._hook = optimizer.register_step_post_hook(self._after_step)
        self._publish()

    @property
    def frozen(self) -> bool:
        """Whether the whole edge is frozen (and streams, given a window)."""
        return self.frozen_at is not None

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.step += 1
        training = [layer for layer in self.layers if layer.frozen_at is None]
        for layer in training:
            layer.norms.append(layer.norm())
        if training and training[0].converged(self.window, self.threshold):
            training[0].freeze(self.step)
            log.info("edge layer %s froze at step %d (gradient norm %.3g)", training[0].name, self.step,
                     training[0].norms[-1])
            if len(training) == 1:
                self._all_frozen()
            self._publish()

    def _all_frozen(self) -> None:
        self.frozen_at = self.step
        self.model.caller.freeze_edge = True  # as split(freeze_edge=True): nothing crosses back
        self._hook.remove()
        log.info("the edge is frozen after step %d: its steps need no gradient back and stream from now on",
                 self.step)
        if self.on_frozen is not None:
            self.on_frozen(self.step)

    def _publish(self) -> None:
        """Keep the run's metrics (each ``metrics_path`` record) up to date with :meth:`record`."""
        self.model.metrics.notes["freezing"] = self.record()

    def record(self) -> dict[str, Any]:
        """When each layer froze (None: still training), for the run's metrics."""
        return {"frozen_at": self.frozen_at, "layers": {layer.name: layer.frozen_at for layer in self.layers}}


__all__ = ["ProgressiveFreezing", "edge_layers"]
