"""One split-training run on the digits task, as the tests, the benchmarks and the ablations run it.

The cloud runs in this process on a thread (in-process transport) unless an address is given,
in which case a ``splitft cloud`` must be listening there.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

import transports

from .cloud import CloudServer, serve_in_thread
from .edge import split
from .options import Codecs, Factory, Faults, Link, Schedule
from .train import fit


@dataclass
class RunResult:
    fwd: str
    bwd: str
    seed: int
    accuracy: float
    seconds: float
    steps: int
    fwd_ratio: float  # raw / wire bytes of activations edge -> cloud
    bwd_ratio: float  # raw / wire bytes of gradients cloud -> edge
    bytes_up: int
    bytes_down: int
    history: list[dict[str, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def model_for(fwd: str) -> str:
    """The factory a forward codec is meant for: the binary codec needs a binarized edge."""
    return "splitft.models:digits_bsl" if fwd.split(":")[0] == "binary" else "splitft.models:digits_cnn"


def time_to_accuracy(history: list[dict[str, float]], target: float) -> float | None:
    """Training seconds (evaluation excluded) until test accuracy first reached ``target``."""
    for record in history:
        if record["accuracy"] >= target:
            return record["train_seconds"]
    return None


def run_task(task_name: str, fwd: str = "identity", bwd: str | None = None, *, seed: int = 0,
             epochs: int | None = None, batch_size: int | None = None, lr: float | None = None,
             ushape: bool | None = None, address: str | None = None, link: str | None = None,
             micro_batches: int = 1, limit: int | None = None, progress: bool = False,
             timeout: float = 300.0) -> RunResult:
    """Train a registered task (:mod:`splitft.tasks`) split at its cut through the given codecs.

    ``link`` (e.g. ``"100mbit,20ms"``) runs the edge's connection through the link emulator;
    ``limit`` trains on the first samples only (short runs of slow tasks).
    """
    from compressors.binary import keep_latent_weights_clipped

    from .factories import load_factory
    from .data import first
    from .tasks import get_task

    task = get_task(task_name)
    factory = model_for(fwd) if task_name == "digits" else task.model
    ushape = task.topology == "ushape" if ushape is None else ushape
    cut, rejoin = task.cut, (task.rejoin if ushape and ":" not in task.cut else None)
    train, test = task.load()
    if limit:
        train = first(train, limit)
    server = thread = None
    if address is None:
        listener = transports.InprocListener()
        server = CloudServer(listener, [factory])
        thread = serve_in_thread(server)
        connection: Any = listener.connect()
    else:
        connection = transports.connect(address)
    try:
        model = split(load_factory(factory)(seed=seed), cut, rejoin,
                      factory=Factory(factory, kwargs={"seed": seed}, weights=task.weights),
                      connect=Link(connection, emulate=link), codecs=Codecs(fwd, bwd, seed=seed),
                      faults=Faults(timeout=timeout), schedule=Schedule(micro_batches=micro_batches))
        with model:
            optimizer_class = getattr(torch.optim, task.optimizer)
            optimizer = model.attach(optimizer_class(model.parameters(), lr=lr or task.lr))
            keep_latent_weights_clipped(optimizer, model)
            criterion = nn.CrossEntropyLoss() if ushape else model.remote_loss(nn.CrossEntropyLoss())
            start = time.perf_counter()
            result = fit(model, optimizer, criterion, train, test, epochs=epochs or task.epochs,
                         batch_size=batch_size or task.batch_size, seed=seed, predict=model.predict,
                         progress=progress, pass_ids=True)
            seconds = time.perf_counter() - start
            metrics = model.metrics
            specs = model.session.codecs.specs
    finally:
        if server is not None:
            server.stop()
            thread.join(timeout=10)
    return RunResult(
        fwd=specs["fwd"], bwd=specs["bwd"], seed=seed, accuracy=result.accuracy, seconds=seconds,
        steps=result.steps, fwd_ratio=metrics.bytes[("up", "activation")].ratio,
        bwd_ratio=metrics.bytes[("down", "gradient")].ratio, bytes_up=metrics.direction("up").wire,
        bytes_down=metrics.direction("down").wire, history=result.history,
    )


def run_digits(fwd: str = "identity", bwd: str | None = None, *, seed: int = 0, epochs: int = 10,
               batch_size: int = 64, lr: float = 1e-3, ushape: bool = False, address: str | None = None,
               link: str | None = None, micro_batches: int = 1, progress: bool = False,
               timeout: float = 60.0) -> RunResult:
    """The digits CNN split at ``block3`` (plain, or U-shape with the head on the edge)."""
    return run_task("digits", fwd, bwd, seed=seed, epochs=epochs, batch_size=batch_size, lr=lr, ushape=ushape,
                    address=address, link=link, micro_batches=micro_batches, progress=progress, timeout=timeout)


def run_bbc(fwd: str = "identity", bwd: str | None = None, **options: Any) -> RunResult:
    """Pre-trained MiniLM on BBC News, U-shape (needs the ``nlp`` extra)."""
    return run_task("bbc", fwd, bwd, **options)
