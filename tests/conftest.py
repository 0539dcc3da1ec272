"""Shared fixtures: a cloud in this process (in-process transport) or in a real OS process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from splitft.cloud import CloudServer, serve_in_thread
from transports import InprocListener

ROOT = Path(__file__).resolve().parent.parent
DIGITS = "splitft.app.models:digits_cnn"

torch.set_num_threads(1)  # two processes share 2 cores in these tests; avoid oversubscription


class InprocCloud:
    """A cloud on a thread of this process; ``options`` go to :class:`CloudServer`."""

    def __init__(self, factories: list[str], **options) -> None:
        self.listener = InprocListener()
        self.server = CloudServer(self.listener, factories, **options)
        self.thread = serve_in_thread(self.server)

    def connect(self):
        return self.listener.connect()

    def close(self) -> None:
        self.server.stop()
        self.thread.join(timeout=10)


@pytest.fixture
def inproc_cloud() -> Iterator[InprocCloud]:
    cloud = InprocCloud([DIGITS, "tests.models:residual_net", "tests.models:mlp", "tests.models:tiny_bert"])
    yield cloud
    cloud.close()


class PipeReader:
    """Drains a child's pipe on a thread, so the child never blocks and the test can wait for text."""

    def __init__(self, stream) -> None:
        self.chunks: list[str] = []
        self._thread = threading.Thread(target=self._drain, args=(stream,), daemon=True)
        self._thread.start()

    def _drain(self, stream) -> None:
        for line in iter(stream.readline, ""):
            self.chunks.append(line)

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def wait_for(self, needle: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if needle in self.text:
                return True
            time.sleep(0.05)
        return needle in self.text


def _interruptible() -> None:
    """Ctrl-C as in a terminal: a test run started in the background inherits SIGINT ignored,
    and Python then installs no KeyboardInterrupt handler in the children either."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def splitft_process(*args: str) -> subprocess.Popen:
    # PYTHONFAULTHANDLER: a child killed by a fatal signal (an abort in a C library) prints every
    # thread's Python stack on its stderr, which the failing test then shows.
    env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                        "PYTHONFAULTHANDLER": "1"}
    return subprocess.Popen([sys.executable, "-m", "splitft", *args], cwd=ROOT, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                            preexec_fn=_interruptible)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)


def start_cloud(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, str, PipeReader]:
    """A real `splitft cloud` process on a random port; returns it, its address and its stderr."""
    ready = tmp_path / f"address-{time.monotonic_ns()}"
    proc = splitft_process("cloud", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready), *extra)
    err = PipeReader(proc.stderr)
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text()):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop(proc)
            raise RuntimeError(f"cloud process did not start:\n{err.text}")
        time.sleep(0.05)
    return proc, ready.read_text(), err


@pytest.fixture
def cloud_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, PipeReader]]:
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS,
                                     "--model", "tests.models:residual_net")
    yield proc, address, err
    stop(proc)


def thread_errors(errors: list[BaseException]) -> str:
    """The exceptions worker threads collected, each with its traceback (a bare repr hides where)."""
    import traceback

    return "\n".join("".join(traceback.format_exception(exc)) for exc in errors)
