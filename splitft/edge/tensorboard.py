"""``splitft.TensorBoard(dir)``: a split run's figures as event files TensorBoard reads.

What a split adds to a training run — bytes each way, where each step's time went (the edge's
compute and codecs, the wire, the cloud), the privacy budget spent — is written once per optimizer
step, from the split model's own counters (:class:`~splitft.metrics.Metrics`), by a post-step hook
on the optimizer: the script's loop stays as it is. Its own figures (loss, accuracy) go through
:meth:`TensorBoard.log`. The writer is torch's ``SummaryWriter``; the ``tensorboard`` package is
the ``tensorboard`` extra.

Tags: ``traffic/up_bytes`` and ``traffic/down_bytes`` (on the wire, this step), ``traffic/up_ratio``
and ``traffic/down_ratio`` (raw over wire bytes, so far), ``time/edge_compute``, ``time/edge_codec``,
``time/wire``, ``time/cloud_compute``, ``time/cloud_codec`` (seconds of this step), and
``privacy/epsilon`` (spent so far) for a model with a privacy budget.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from ..errors import ConfigError
from ..metrics import Metrics


class TensorBoard:
    """Event files under ``log_dir`` for one run; use as a context manager, or :meth:`close`.

    ``tb.watch(model, optimizer)`` writes the split's figures after each ``optimizer.step()``;
    ``tb.log(loss=..., accuracy=...)`` writes a script's own at the current step.
    """

    def __init__(self, log_dir: str | os.PathLike) -> None:
        self.writer = require()(log_dir=str(log_dir))
        self.log_dir = self.writer.log_dir
        self.step = 0  # optimizer steps seen
        self._hooks: list[Any] = []
        self._last: tuple[float, int, int, dict[str, float]] | None = None

    def watch(self, model: Any, optimizer: torch.optim.Optimizer) -> None:
        """Write ``model``'s traffic, time split and privacy after each step of ``optimizer``."""
        metrics: Metrics = model.metrics
        self._last = _totals(metrics)

        def stepped(*_: Any) -> None:
            self.step += 1
            self._write_step(model, metrics)

        self._hooks.append(optimizer.register_step_post_hook(stepped))

    def log(self, step: int | None = None, **values: float) -> None:
        """Write each of ``values`` (``loss=0.3``) under its name, at ``step`` (default: the steps so far)."""
        for tag, value in values.items():
            self.writer.add_scalar(tag, float(value), self.step if step is None else step)

    def _write_step(self, model: Any, metrics: Metrics) -> None:
        now = _totals(metrics)
        assert self._last is not None
        (then, up0, down0, seconds0), (wall, up, down, seconds) = self._last, now
        self._last = now
        step = Metrics()
        step.seconds.update({k: v - seconds0.get(k, 0.0) for k, v in seconds.items()})
        add = self.writer.add_scalar
        add("traffic/up_bytes", up - up0, self.step)
        add("traffic/down_bytes", down - down0, self.step)
        for direction in ("up", "down"):
            ratio = metrics.direction(direction).ratio
            if ratio == ratio:  # not NaN: something crossed
                add(f"traffic/{direction}_ratio", ratio, self.step)
        for name, value in step.breakdown(wall - then).items():
            add(f"time/{name}", value, self.step)
        privacy = getattr(model, "privacy", None)
        if privacy is not None and getattr(privacy, "accountant", None) is not None:
            add("privacy/epsilon", privacy.spent(), self.step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.writer.close()

    def __enter__(self) -> TensorBoard:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def require() -> Any:
    """torch's ``SummaryWriter``, or a :class:`ConfigError` naming the extra to install."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ConfigError(f"TensorBoard event files need the tensorboard package ({exc}): install the "
                          "'tensorboard' extra (pip install 'splitft[tensorboard]')") from None
    return SummaryWriter


def _totals(metrics: Metrics) -> tuple[float, int, int, dict[str, float]]:
    return (time.perf_counter(), metrics.direction("up").wire, metrics.direction("down").wire,
            dict(metrics.seconds))


__all__ = ["TensorBoard", "require"]
