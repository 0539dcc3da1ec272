"""Split-training runs for the tests, the benchmarks and the ablations: a task through the runner, its
cloud in this process.

The cloud runs in this process on a thread (in-process transport) unless an address is given,
in which case a ``splitft cloud`` must be listening there. The run itself is
:func:`splitft.app.runner.run`, the one behind ``splitft edge`` and ``splitft demo``.
"""

from __future__ import annotations

from typing import Any

import transports

from ..cloud import CloudServer, serve_in_thread
from ..options import Codecs, Factory, Faults, Link, Schedule
from .runner import RunResult, TaskRun, run
from .tasks import get_task


def model_for(fwd: str) -> str:
    """The factory a forward codec is meant for: the binary codec needs a binarized edge."""
    return "splitft.app.models:digits_bsl" if fwd.split(":")[0] == "binary" else "splitft.app.models:digits_cnn"


def time_to_accuracy(history: list[dict[str, float]], target: float) -> float | None:
    """Training seconds (evaluation excluded) until test accuracy first reached ``target``."""
    for record in history:
        if record["accuracy"] >= target:
            return record["train_seconds"]
    return None


def budgeted_score(accuracy: float, used: dict[str, float], budget: dict[str, float]) -> float:
    """Accuracy under a resource budget (in the spirit of AdaSplit's C3 score): a run within every
    budget scores its accuracy; one over a budget is discounted by the share of it the budget
    covers (``accuracy * prod(min(1, budget[k] / used[k]))``), so spending twice the bandwidth
    allowed halves the score. ``used`` and ``budget`` map resource names (``"MB"``, ``"seconds"``,
    ``"cloud_cpu_s"``...) to amounts; a resource without a budget is free."""
    score = accuracy
    for name, most in budget.items():
        spent = used.get(name, 0.0)
        if spent > most:
            score *= most / spent
    return score


def run_task(task_name: str, fwd: str = "identity", bwd: str | None = None, *, seed: int = 0,
             epochs: int | None = None, batch_size: int | None = None, lr: float | None = None,
             ushape: bool | None = None, address: str | None = None, link: str | None = None,
             micro_batches: int = 1, limit: int | None = None, progress: bool = False,
             timeout: float = 300.0) -> RunResult:
    """Train a registered task (:mod:`splitft.app.tasks`) split at its cut through the given codecs.

    Both halves start from the factory's ``seed``. ``link`` (e.g. ``"100mbit,20ms"``) runs the
    edge's connection through the link emulator; ``limit`` trains on the first samples only
    (short runs of slow tasks).
    """
    task = get_task(task_name)
    factory = Factory(model_for(fwd) if task_name == "digits" else task.model, kwargs={"seed": seed},
                      weights=task.weights)  # type: ignore[arg-type]
    task_run = TaskRun(task=task_name, factory=factory, topology=None if ushape is None else
                       "ushape" if ushape else "plain", epochs=epochs, batch_size=batch_size, lr=lr, seed=seed,
                       limit=limit, codecs=Codecs(fwd, bwd, seed=seed), schedule=Schedule(micro_batches),
                       faults=Faults(timeout=timeout), progress=progress)
    if address is not None:
        return run(task_run, Link(address, emulate=link))
    listener = transports.InprocListener()
    server = CloudServer(listener, [factory.name])
    thread = serve_in_thread(server)
    try:
        return run(task_run, Link(listener.connect(), emulate=link))
    finally:
        server.stop()
        thread.join(timeout=10)


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
