"""The training loop the CLI and the benchmarks share: ordinary PyTorch, split or not."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .data import Split, batches, call


@dataclass
class FitResult:
    accuracy: float
    history: list[dict[str, float]] = field(default_factory=list)
    seconds: float = 0.0
    steps: int = 0


def accuracy(predict: Callable[..., torch.Tensor], data: Split, batch_size: int = 256) -> float:
    """Share of ``data`` whose argmax prediction is the label (no grad, eval mode is the caller's)."""
    correct = 0
    with torch.no_grad():
        for x, y, ids in batches(data, batch_size, shuffle=False):
            correct += int((call(predict, x).argmax(dim=1) == y).sum())
    return correct / max(1, len(data))


#: Steps a loss is read after it was computed: reading a streamed step's loss waits for its
#: reply (splitft.edge.streaming), so the loop reads it only once the window moved past it.
LOSS_LAG = 64


def _read(unread: deque[tuple[torch.Tensor, int]], count: int, total: float, seen: int) -> tuple[float, int]:
    """Add the oldest ``count`` unread losses (weighted by their batch sizes) to the running sum."""
    for _ in range(count):
        loss, n = unread.popleft()
        total += float(loss) * n
        seen += n
    return total, seen


def fit(model: nn.Module, optimizer: torch.optim.Optimizer, criterion: Callable[[Any, torch.Tensor], torch.Tensor],
        train: Split, test: Split, *, epochs: int, batch_size: int, seed: int = 0,
        predict: Callable[..., torch.Tensor] | None = None, progress: bool = False,
        pass_ids: bool = False, evaluate: bool = True,
        on_epoch: Callable[[dict[str, float]], None] | None = None) -> FitResult:
    """Train ``epochs`` epochs, evaluating after each; shows a bar per epoch when ``progress``.

    ``pass_ids`` gives the model each sample's stable id (``model(x, sample_ids=ids)``), which
    codecs with per-sample state need. ``evaluate=False`` skips the test accuracy, for a task
    that measures itself otherwise (a language model's perplexity). ``on_epoch`` is given each
    epoch's record (loss, accuracy) as soon as it is known (a TensorBoard writer).
    """
    from tqdm.auto import tqdm

    predict = predict or model
    result = FitResult(accuracy=0.0)
    start = time.perf_counter()
    training = 0.0  # seconds spent in training steps only, evaluation excluded
    for epoch in range(epochs):
        epoch_start = time.perf_counter()
        model.train()
        total_loss, seen = 0.0, 0
        steps_per_epoch = -(-len(train) // batch_size)
        bar = tqdm(batches(train, batch_size, shuffle=True, seed=seed, epoch=epoch), total=steps_per_epoch,
                   desc=f"epoch {epoch + 1:>2}/{epochs}", disable=not progress, leave=True,
                   dynamic_ncols=True, unit="step")
        unread: deque[tuple[torch.Tensor, int]] = deque()  # losses not read yet (see LOSS_LAG)
        for x, y, ids in bar:
            out = call(model, x, sample_ids=ids) if pass_ids else call(model, x)
            loss = criterion(out, y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            unread.append((loss.detach(), len(y)))
            result.steps += 1
            if len(unread) > LOSS_LAG:
                total_loss, seen = _read(unread, 1, total_loss, seen)
                bar.set_postfix(loss=f"{total_loss / seen:.4f}")
        total_loss, seen = _read(unread, len(unread), total_loss, seen)
        training += time.perf_counter() - epoch_start
        record = {"epoch": epoch + 1, "loss": total_loss / max(1, seen)}
        if evaluate:
            model.eval()
            result.accuracy = record["accuracy"] = accuracy(predict, test)
            bar.set_postfix(loss=f"{record['loss']:.4f}", test_acc=f"{result.accuracy:.4f}")
        result.history.append(record | {"seconds": time.perf_counter() - start, "train_seconds": training})
        if on_epoch is not None:
            on_epoch(result.history[-1])
        bar.close()
    result.seconds = time.perf_counter() - start
    return result
