"""Starting a cloud process on loopback: for the demo, the examples and the benchmarks.

A real ``splitft cloud`` process (not a thread), so the edge's traffic really crosses a socket
and the two halves really compute in two processes, as they would on two machines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..errors import SplitFTError

log = logging.getLogger(__name__)


class CloudStartError(SplitFTError):
    """The cloud process did not come up."""


def half_the_cores() -> int:
    """Torch threads for each of two processes that compute on this machine's CPU at once."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
    return max(1, cores // 2)


def start_cloud(models: Iterable[str], ready: Path, *, flags: Iterable[str] = (), sessions: int = 1,
                device: str | None = None, start_timeout: float = 60.0, quiet: bool = False,
                env: dict[str, str] | None = None, threads: int | None = None) -> tuple[subprocess.Popen, str]:
    """Start ``splitft cloud`` on a free port of 127.0.0.1 with ``flags`` and wait until it listens.

    Returns the process (the caller stops it; it runs in a session of its own) and its address,
    which it writes to ``ready``. Raises :class:`CloudStartError` if it exits or does not listen
    within ``start_timeout`` seconds. :func:`local_cloud` is this within a ``with`` block.
    ``threads``: the cloud's torch threads, unless the environment names them (``OMP_NUM_THREADS``).
    """
    env = os.environ.copy() if env is None else dict(env)
    if threads is not None:
        env.setdefault("OMP_NUM_THREADS", str(threads))
    cmd = [sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--sessions", str(sessions),
           "--ready-file", str(ready)]
    for model in models:
        cmd += ["--model", model]
    if device is not None:
        cmd += ["--device", device]
    proc = subprocess.Popen([*cmd, *flags], start_new_session=True, env=env,
                            stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL if quiet else None)
    deadline = time.monotonic() + start_timeout
    while not ready.exists() or not ready.read_text():
        if proc.poll() is not None:
            raise CloudStartError(f"the cloud process exited early (code {proc.returncode})")
        if time.monotonic() > deadline:
            proc.kill()
            raise CloudStartError(f"the cloud process did not start within {start_timeout:g} s")
        time.sleep(0.05)
    address = ready.read_text()
    log.info("cloud process %d listening on %s", proc.pid, address)
    return proc, address


@contextlib.contextmanager
def local_cloud(models: Iterable[str], *, sessions: int = 1, start_timeout: float = 60.0,
                exit_timeout: float = 10.0, quiet: bool = False, device: str | None = None,
                threads: int | None = None) -> Iterator[str]:
    """Run ``splitft cloud`` on a free port of 127.0.0.1 for the duration of the block.

    Yields the address to connect to. The cloud serves ``models`` (factory strings) and exits
    after ``sessions`` sessions; when the block ends it is given ``exit_timeout`` seconds to do so
    and is then terminated. It runs in a session of its own, so Ctrl-C in the terminal reaches the
    edge only, which then tells the cloud. ``quiet`` silences its session messages (for scripts
    that draw progress bars). ``device`` is its ``--device`` (default: its own, the first GPU
    when there is one). ``threads`` is its torch threads (default: torch's, all the cores) unless
    ``OMP_NUM_THREADS`` is set.
    """
    with tempfile.TemporaryDirectory(prefix="splitft-cloud-") as tmp:
        proc, address = start_cloud(models, Path(tmp) / "address", sessions=sessions, device=device,
                                    start_timeout=start_timeout, quiet=quiet, threads=threads)
        try:
            yield address
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=exit_timeout)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)


__all__ = ["CloudStartError", "half_the_cores", "local_cloud", "start_cloud"]
