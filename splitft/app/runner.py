"""One training run of a registered task through a split: what ``splitft edge``, ``splitft demo``,
the experiments, the benchmarks and the ablations all run.

A :class:`TaskRun` names a task (:mod:`splitft.app.tasks`) and overrides its defaults; :func:`prepare`
loads the data, builds and splits the model and attaches the optimizer; :func:`train` trains,
evaluates after every epoch and closes the session. :func:`run` does both without disturbing the
caller's random number generator.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from .data import Split, first, moved
from ..devices import resolve_device
from ..edge import SplitModel, split
from ..edge.freezing import ProgressiveFreezing
from ..errors import ConfigError
from ..factories import load_factory
from ..metrics import Metrics
from ..options import Codecs, Factory, Faults, Link, Schedule
from .tasks import Task, get_task
from .train import fit


@dataclass(frozen=True)
class PrivacyRun:
    """Defences for a task run, in the command line's terms (see :mod:`splitft.privacy`).

    ``leak_loss``: the weight of the distance-correlation loss trained on the edge.
    ``epsilon``: differential privacy on what crosses, calibrated to (epsilon, ``delta``) over the
    run, each sample clipped to L2 norm ``clip``; ``on`` says which tensors are noised: the
    activation edge → cloud, the gradient a U-shape edge returns (it carries the labels), or both.
    ``adversarial``: the weight of adversarial training against the edge's own decoder.
    ``probe``: U-shape: stop training when the cloud's gradients are not the backward of what was sent.
    """

    leak_loss: float = 0.0
    epsilon: float | None = None
    delta: float = 1e-5
    clip: float = 1.0
    on: Literal["activations", "labels", "both"] = "activations"
    adversarial: float = 0.0
    probe: bool = False

    def __post_init__(self) -> None:
        if self.on not in ("activations", "labels", "both"):
            raise ConfigError(f"PrivacyRun(on=...) is 'activations', 'labels' or 'both', got {self.on!r}")
        self.defences(sample_rate=1.0, epochs=1)  # each defence checks itself when built: now, not after connecting

    def defences(self, *, sample_rate: float, epochs: int) -> Any:
        from ..privacy import Budget, Defences, Noise, Probe

        noise = Noise(self.clip) if self.epsilon is not None else None
        return Defences(
            leak_loss=self.leak_loss,
            activations=noise if self.on in ("activations", "both") else None,
            label_gradients=noise if self.on in ("labels", "both") else None,
            budget=Budget(epsilon=self.epsilon, delta=self.delta, sample_rate=sample_rate, epochs=epochs)
            if self.epsilon is not None else None,
            adversarial=self.adversarial, probe=Probe() if self.probe else None)


@dataclass(frozen=True)
class TaskRun:
    """What to train, and how. Every setting left at None keeps the task's own.

    ``factory`` defaults to the task's model (its weights pushed or built by the cloud as the
    task says); ``topology`` to the task's ("plain": the cloud computes the loss, "ushape": the
    head and labels stay on the edge); ``rejoin`` matters for a U-shape cut that is not a slice.
    ``seed`` orders the data and seeds torch's generator (dropout); the codecs carry their own.
    """

    task: str = "digits"
    factory: Factory | None = None
    cut: str | None = None
    rejoin: str | None = None
    topology: Literal["plain", "ushape"] | None = None
    epochs: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    seed: int = 0
    limit: int | None = None  # train on the first samples only
    max_length: int | None = None  # text tasks: tokens per sample
    codecs: Codecs = field(default_factory=Codecs)
    schedule: Schedule = field(default_factory=Schedule)
    faults: Faults = field(default_factory=Faults)
    freeze_edge: bool = False
    #: (window, threshold): freeze the edge's layers as they converge, then stream
    #: (:class:`splitft.edge.freezing.ProgressiveFreezing`); None: the edge trains throughout.
    freeze_progressively: tuple[int, float] | None = None
    metrics_path: str | None = None
    tensorboard: str | None = None  # write TensorBoard event files here (splitft.TensorBoard)
    progress: bool = False  # a progress bar per epoch (command line)
    privacy: PrivacyRun | None = None  # defences on what crosses (splitft.privacy)
    device: str | None = None  # where the edge half and its data live (None: the CPU)

    def __post_init__(self) -> None:
        get_task(self.task)  # an unknown task raises listing the known ones
        if self.topology not in (None, "plain", "ushape"):
            raise ConfigError(f"topology is 'plain' or 'ushape', got {self.topology!r}")
        if self.tensorboard is not None:
            from ..edge.tensorboard import require

            require()  # the extra is missing: said now, not after connecting


@dataclass
class Prepared:
    """A run ready to train: the split model, its optimizer and loss, and the data."""

    run: TaskRun
    task: Task
    model: SplitModel
    optimizer: torch.optim.Optimizer
    criterion: Any
    train: Split
    test: Split
    cut: str
    rejoin: str | None
    ushape: bool
    epochs: int
    batch_size: int
    protection: Any = None  # splitft.privacy.Protection when defences are on
    board: Any = None  # splitft.TensorBoard when the run writes event files


@dataclass
class RunResult:
    """What a run reached and what it cost on the wire."""

    fwd: str
    bwd: str
    seed: int
    accuracy: float
    seconds: float  # wall time of training and evaluation, the session's goodbye included
    steps: int
    fwd_ratio: float  # raw / wire bytes of activations edge -> cloud
    bwd_ratio: float  # raw / wire bytes of gradients cloud -> edge
    bytes_up: int
    bytes_down: int
    history: list[dict[str, float]] = field(default_factory=list)
    epsilon: float | None = None  # privacy spent, when a budget was set
    metrics: Metrics = field(default_factory=Metrics, repr=False, compare=False)
    scores: dict[str, float] = field(default_factory=dict)  # a task's own figures (a language model's perplexity)
    summary: str | None = None  # what a task's own trainer reached, in one line


def prepare(run: TaskRun, connect: Any) -> Prepared:
    """Load the task's data, build and split its model against the cloud at ``connect`` (anything
    :class:`~splitft.options.Link` takes), attach the optimizer. Seeds torch's generator."""
    from compressors.binary import keep_latent_weights_clipped

    task = get_task(run.task)
    cut = run.cut or task.cut
    factory = run.factory or Factory(task.model, kwargs=task.model_kwargs(cut=cut, freeze_edge=run.freeze_edge),
                                     weights=task.weights)  # type: ignore[arg-type]
    ushape = (run.topology or task.topology) == "ushape"
    rejoin = (run.rejoin or task.rejoin) if ushape and ":" not in cut else None
    torch.manual_seed(run.seed)
    train_data, test_data = task.load(max_length=run.max_length)
    limit = run.limit or task.limit
    if limit:
        train_data = first(train_data, limit)
    if run.device is not None:
        train_data, test_data = moved(train_data, resolve_device(run.device)), moved(test_data, resolve_device(run.device))
    model = split(load_factory(factory.name)(**factory.kwargs), cut, rejoin, factory=factory, connect=Link.of(connect),
                  codecs=run.codecs, schedule=run.schedule, faults=run.faults, freeze_edge=run.freeze_edge,
                  metrics_path=run.metrics_path, device=run.device)
    try:
        optimizer = model.attach(getattr(torch.optim, task.optimizer)(model.parameters(), lr=run.lr or task.lr))
        keep_latent_weights_clipped(optimizer, model)  # binarized edges (B-SL); nothing to clip otherwise
        if run.freeze_progressively is not None:
            ProgressiveFreezing(model, optimizer, window=run.freeze_progressively[0],
                                threshold=run.freeze_progressively[1])
        criterion = nn.CrossEntropyLoss() if ushape else model.remote_loss(nn.CrossEntropyLoss())
        epochs = run.epochs if run.epochs is not None else task.epochs
        batch_size = run.batch_size or task.batch_size
        protection = None
        if run.privacy is not None:
            from ..privacy import protect

            protection = protect(model, run.privacy.defences(sample_rate=batch_size / len(train_data),
                                                             epochs=epochs))
        board = _board(run, model, optimizer)
    except BaseException:
        model.close("error")
        raise
    return Prepared(run, task, model, optimizer, criterion, train_data, test_data, cut, rejoin, ushape,
                    epochs=epochs, batch_size=batch_size, protection=protection, board=board)


def _board(run: TaskRun, model: SplitModel, optimizer: torch.optim.Optimizer) -> Any:
    """The run's TensorBoard writer, watching the split model's steps (None without ``tensorboard``)."""
    if run.tensorboard is None:
        return None
    from ..edge.tensorboard import TensorBoard

    board = TensorBoard(run.tensorboard)
    board.watch(model, optimizer)
    return board


def _epoch_logger(board: Any) -> Any:
    """Each epoch's loss and test accuracy, written at the steps taken so far."""
    if board is None:
        return None

    def log(record: dict[str, float]) -> None:
        board.log(**{f"{'test' if key == 'accuracy' else 'train'}/{key}": value
                     for key, value in record.items() if key in ("loss", "accuracy")})
    return log


def train(prepared: Prepared) -> RunResult:
    """Train and evaluate after every epoch; the session ends with the run (or with its error)."""
    model, run = prepared.model, prepared.run
    start = time.perf_counter()
    trainer = prepared.task.train_function()
    log_epoch = _epoch_logger(prepared.board)
    try:
        with model:
            if trainer is not None:
                result = trainer(prepared)
                for record in result.history if log_epoch is not None else ():
                    log_epoch(record)
            else:
                result = fit(model, prepared.optimizer, prepared.criterion, prepared.train, prepared.test,
                             epochs=prepared.epochs, batch_size=prepared.batch_size, seed=run.seed,
                             predict=model.predict, progress=run.progress, pass_ids=True, on_epoch=log_epoch)
    finally:
        if prepared.board is not None:
            prepared.board.close()
    seconds = time.perf_counter() - start
    metrics, specs = model.metrics, model.session.codecs.specs
    return RunResult(
        fwd=specs["fwd"], bwd=specs["bwd"], seed=run.seed, accuracy=result.accuracy, seconds=seconds,
        steps=result.steps, fwd_ratio=metrics.bytes[("up", "activation")].ratio,
        bwd_ratio=metrics.bytes[("down", "gradient")].ratio, bytes_up=metrics.direction("up").wire,
        bytes_down=metrics.direction("down").wire, history=result.history, metrics=metrics,
        epsilon=prepared.protection.spent() if run.privacy is not None and run.privacy.epsilon is not None else None,
        scores=dict(getattr(result, "scores", {})), summary=getattr(result, "summary", None),
    )


def run(task_run: TaskRun, connect: Any) -> RunResult:
    """:func:`prepare` then :func:`train`; torch's generator is left as it was found."""
    with torch.random.fork_rng(devices=[]):
        return train(prepare(task_run, connect))


__all__ = ["Prepared", "PrivacyRun", "RunResult", "TaskRun", "prepare", "run", "train"]
