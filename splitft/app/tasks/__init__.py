"""Ready-made training tasks: the data, the model factory and the cut that suit each other.

The CLI (``splitft demo --task bbc``, ``--task smollm``), the examples and the benchmarks share
these, so a figure in the README and a run on the command line train the same thing. A task's
model is named by its factory string, which both edge and cloud can import.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..data import Split
from ...errors import ConfigError


@dataclass(frozen=True)
class Task:
    """What one task trains, and the settings that train it well."""

    name: str
    summary: str
    model: str  # factory, "package.module:function"
    cut: str
    rejoin: str | None  # U-shape: where the edge takes over again (None when ``cut`` is a slice)
    topology: str  # "plain" or "ushape"
    loader: str  # "package.module:function" returning (train, test) Splits
    epochs: int
    batch_size: int
    lr: float
    optimizer: str  # a torch.optim class name
    weights: str = "push"  # "factory" for pre-trained models both sides load: no weights in the handshake
    options: dict[str, Any] = field(default_factory=dict)  # loader keywords the CLI exposes
    limit: int | None = None  # train on this many samples unless the run says otherwise (short demos)
    # "package.module:function"(prepared) -> FitResult, for tasks that do not train a classifier
    # (splitft.app.train.fit); a result with .scores and .summary says what the run reached
    trainer: str | None = None
    # "package.module:function"(cut=..., freeze_edge=...) -> the factory's arguments for a run
    factory_kwargs: str | None = None
    # what a run is judged by: "accuracy" (test accuracy, higher is better) or "perplexity" (held-out, lower)
    metric: str = "accuracy"

    def load(self, **options: Any) -> tuple[Split, Split]:
        """Train and test splits; ``options`` left at None keep the task's defaults."""
        given = {k: v for k, v in options.items() if v is not None}
        unknown = sorted(set(given) - set(self.options))
        if unknown:
            raise ConfigError(f"task {self.name!r} takes no option {', '.join(unknown)} "
                              f"(its options: {', '.join(self.options) or 'none'})")
        loader: Callable[..., tuple[Split, Split]] = _imported(self.loader)
        return loader(**{**self.options, **given})

    def model_kwargs(self, *, cut: str, freeze_edge: bool) -> dict[str, Any]:
        """The model factory's arguments for a run with this cut (none unless the task says)."""
        return _imported(self.factory_kwargs)(cut=cut, freeze_edge=freeze_edge) if self.factory_kwargs else {}

    def train_function(self) -> Callable[..., Any] | None:
        """The task's own training function (None: the classifier loop, splitft.app.train.fit)."""
        return _imported(self.trainer) if self.trainer else None


def _imported(name: str) -> Callable[..., Any]:
    module, _, attr = name.partition(":")
    return getattr(importlib.import_module(module), attr)


TASKS: dict[str, Task] = {
    "digits": Task(
        name="digits", summary="scikit-learn's 8x8 digits (1437 train / 360 test images, 10 classes), a small CNN",
        model="splitft.app.models:digits_cnn", cut="block3", rejoin="head", topology="plain",
        loader="splitft.app.data:load_digits", epochs=15, batch_size=64, lr=1e-3, optimizer="Adam",
    ),
    "bbc": Task(
        name="bbc", summary="BBC News (1781 train / 444 test articles, 5 classes), pre-trained all-MiniLM-L6-v2",
        model="splitft.app.tasks.bbc:minilm_classifier", cut="bert.encoder.layer.2:6", rejoin=None, topology="ushape",
        loader="splitft.app.tasks.bbc:load_bbc", epochs=1, batch_size=32, lr=3e-4, optimizer="AdamW", weights="factory",
        options={"max_length": 128},
    ),
    "bbc-plain": Task(
        name="bbc-plain", summary="BBC News as 128-token windows (1780 train / 444 test), all-MiniLM-L6-v2 as a chain "
                                  "cut plain: the loss in the cloud, so a frozen edge can stream (--window)",
        model="splitft.app.tasks.bbc:minilm_chain", cut="layer2", rejoin=None, topology="plain",
        loader="splitft.app.tasks.bbc:load_bbc_windows", epochs=1, batch_size=32, lr=3e-4, optimizer="AdamW",
        weights="factory", options={"max_length": 128},
    ),
    "smollm": Task(
        name="smollm", summary="BBC News text as a language-modelling corpus, pre-trained SmolLM2-135M with LoRA "
                               "(held-out perplexity before and after)",
        model="splitft.app.tasks.smollm:smollm_lora", cut="base_model.model.model.layers.2:28", rejoin=None,
        topology="ushape", loader="splitft.app.tasks.smollm:load_news", epochs=1, batch_size=8, lr=1e-3,
        optimizer="AdamW", weights="factory", options={"max_length": 128}, limit=192,
        trainer="splitft.app.tasks.smollm:train_run", factory_kwargs="splitft.app.tasks.smollm:factory_kwargs",
        metric="perplexity",
    ),
    "smollm-plain": Task(
        name="smollm-plain", summary="the smollm task's model and text as a chain cut plain: the loss in the cloud, so "
                                     "a frozen edge can stream (--window)",
        model="splitft.app.tasks.smollm_chain:smollm_chain", cut="layer2", rejoin=None, topology="plain",
        loader="splitft.app.tasks.smollm_chain:load_windows", epochs=1, batch_size=8, lr=1e-3, optimizer="AdamW",
        weights="factory", options={"max_length": 128}, limit=192, trainer="splitft.app.tasks.smollm_chain:train_run",
        factory_kwargs="splitft.app.tasks.smollm_chain:factory_kwargs", metric="perplexity",
    ),
}


def get_task(name: str) -> Task:
    """The task called ``name``; an unknown name raises listing the known ones."""
    try:
        return TASKS[name]
    except KeyError:
        raise ConfigError(f"unknown task {name!r}; tasks: {', '.join(TASKS)}") from None


__all__ = ["TASKS", "Task", "get_task"]
