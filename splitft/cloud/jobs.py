"""Long work off the serving thread: one session's heavy request runs while the others are served.

The serving thread reads every message and answers every session. Before a request's work
starts it is priced (:mod:`.prices`), and the session's measured :class:`~.costs.Pace` turns
the price into seconds: work expected to take longer than :data:`SLICE` becomes a :class:`Job`
on a worker thread. Its session is *busy* until the job ends: further messages from its edge
wait, in order, in its inbox; everything else is served as usual. When the job ends, the serving
thread (the only one that touches the socket and the session table) sends the reply and handles
what waited.

Workers take jobs round-robin by origin, so one origin's queue of heavy requests does not hold
up another's, and a short job that had to leave the serving thread (it needs the process's random
generator, which a worker holds) goes before them all. A job whose session cannot leave the
serving thread (a shared half, a batch split across ranks) runs there, as before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..errors import CapacityError
from .limits import Limits
from .costs import Pace, Price
from .randomness import GENERATOR

log = logging.getLogger(__name__)

#: The most a request may be expected to take on the serving thread, in seconds.
SLICE = 0.05
#: Worker threads (each job's own torch ops use the cores as usual).
WORKERS = 2
#: How often the serving loop looks for ended jobs while some run, in seconds, when nothing wakes
#: it as one ends (a listener without ``wake``). A loop woken instead sleeps: on a 2-core machine a
#: serving thread waking every 2 ms stole a core from the job's own threads (a batch-8 token of
#: SmolLM2 took 80 ms on a worker against 61 ms with the serving thread asleep).
POLL = 0.002

#: :meth:`Jobs.start`'s answer for a job handed to a worker: its reply comes when it ends.
LATER = object()


@dataclass(eq=False)
class Job:
    """Work for one session (or one session being restored), and what to do with its result.

    ``work`` touches only its session, so it may run on a worker; ``then`` runs on the serving
    thread with ``work``'s result and returns the reply.
    """

    key: str  # the session id it works for
    origin: str
    price: Price
    work: Callable[[], Any]
    then: Callable[[Any], Any]
    pace: Pace | None = None  # the session's, to predict this job's time and learn from it
    off_thread: bool = True  # may run on a worker
    generator: bool = False  # needs the process's random generator (a half that draws)
    context: tuple = ()  # the server's: where the reply goes
    result: Any = None
    error: BaseException | None = None
    ended: bool = False
    started: float = field(default_factory=time.monotonic)


class Jobs:
    """The workers, the jobs they run, and the inboxes of the busy sessions."""

    def __init__(self, workers: int = WORKERS, slice_s: float = SLICE, wake: Callable[[], None] | None = None) -> None:
        self.workers = workers
        self.slice = slice_s
        self._wake = wake  # tells the serving loop, asleep in its receive, that a job ended
        self._lock = threading.Condition()
        self._queued: OrderedDict[str, deque[Job]] = OrderedDict()  # by origin, served round-robin
        self._short: deque[Job] = deque()  # short jobs that could not run on the serving thread
        self._busy: dict[str, Job] = {}  # session id -> its job, queued or running
        self._done: deque[Job] = deque()
        self._inbox: dict[str, deque[tuple[bytes, list]]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False

    # ------------------------------------------------------------ the serving thread

    def busy(self, key: str) -> bool:
        return key in self._busy

    def since(self, key: str) -> float:
        """Seconds the job of ``key`` has run (or waited), 0 when there is none."""
        job = self._busy.get(key)
        return time.monotonic() - job.started if job is not None else 0.0

    def hold(self, key: str, peer: bytes, frames: list, limits: Limits) -> bool:
        """Keep a message for a busy session until its job ends; True when it was kept.

        Raises :class:`CapacityError` when the inbox is full (an edge streams a bounded window).
        """
        if key not in self._busy:
            return False
        inbox = self._inbox.setdefault(key, deque())
        held = sum(sum(memoryview(f).nbytes for f in fs) for _, fs in inbox)
        size = sum(memoryview(f).nbytes for f in frames)
        if len(inbox) >= limits.max_pending_calls or held + size > limits.max_message_bytes:
            raise CapacityError(f"{len(inbox)} messages ({held} bytes) already wait for this session's request "
                                f"that has run {self.since(key):.1f} s; wait for its reply before sending more")
        inbox.append((peer, frames))
        return True

    def next_held(self, key: str) -> tuple[bytes, list] | None:
        """The oldest message that waited for ``key``'s job, once it is not busy."""
        inbox = self._inbox.get(key)
        if key in self._busy or not inbox:
            return None
        item = inbox.popleft()
        if not inbox:
            del self._inbox[key]
        return item

    def start(self, job: Job, context: tuple) -> Any:
        """Run ``job`` now on this thread when it is short, returning its reply; else hand it to
        a worker and return :data:`LATER`."""
        job.context = context
        if job.key in self._busy:
            raise CapacityError(f"session {job.key} is still working on a request (for {self.since(job.key):.1f} s); "
                                "try again when it has answered")
        short = (job.pace.predict(job.price) if job.pace is not None else 0.0) <= self.slice
        if not job.off_thread or (short and self._generator_free(job)):
            try:
                return job.then(self._timed(job))
            finally:
                if job.generator and job.off_thread:
                    GENERATOR.release()
        self._submit(job, short)
        return LATER

    def _generator_free(self, job: Job) -> bool:
        """A job that draws random numbers runs here only when no worker holds the generator;
        it then holds it itself (released by :meth:`start`)."""
        return not job.generator or GENERATOR.acquire(blocking=False)

    def poll(self, timeout: float) -> float:
        """How long the serving loop may wait for a message: briefly while jobs run, unless a
        job's end wakes it."""
        return min(timeout, POLL) if self._busy and self._wake is None else timeout

    def finished(self) -> list[Job]:
        """The jobs that ended since the last call (their sessions are no longer busy)."""
        if not self._done:
            return []
        with self._lock:
            done, self._done = list(self._done), deque()
            for job in done:
                self._busy.pop(job.key, None)
        return done

    def keys(self) -> set[str]:
        """The sessions (being restored, some) with a job under way."""
        return set(self._busy)

    def close(self, timeout: float = 10.0) -> None:
        """Stop taking jobs; wait up to ``timeout`` seconds for the running ones (a checkpoint
        being written, say) to end."""
        deadline = time.monotonic() + timeout
        with self._lock:
            self._closed = True
            for queue in (*self._queued.values(), self._short):
                for job in queue:
                    self._busy.pop(job.key, None)  # never started: nothing to wait for
            self._queued.clear()
            self._short.clear()
            self._lock.notify_all()
            while any(not job.ended for job in self._busy.values()) and time.monotonic() < deadline:
                self._lock.wait(0.05)

    # ------------------------------------------------------------ workers

    def _submit(self, job: Job, short: bool) -> None:
        with self._lock:
            self._busy[job.key] = job
            if short:
                self._short.append(job)
            else:
                self._queued.setdefault(job.origin, deque()).append(job)
            if len(self._threads) < self.workers:
                thread = threading.Thread(target=self._run, name=f"splitft-job-{len(self._threads)}", daemon=True)
                self._threads.append(thread)
                thread.start()
            self._lock.notify()

    def _next(self) -> Job | None:
        with self._lock:
            while not self._queued and not self._short and not self._closed:
                self._lock.wait()
            if self._closed:
                return None
            if self._short:
                return self._short.popleft()
            origin, queue = next(iter(self._queued.items()))
            job = queue.popleft()
            del self._queued[origin]
            if queue:
                self._queued[origin] = queue  # to the back: the next origin goes first
            return job

    def _run(self) -> None:
        while True:
            job = self._next()
            if job is None:
                return
            try:
                job.result = self._timed(job)
            except BaseException as exc:  # noqa: BLE001 — handed to the serving thread, which answers it
                job.error = exc
            with self._lock:
                job.ended = True
                self._done.append(job)
                self._lock.notify_all()
            if self._wake is not None:
                self._wake()
            del job  # a worker waiting for the next job holds nothing of the last (its session's memory)

    @staticmethod
    def _timed(job: Job) -> Any:
        start = time.perf_counter()
        result = job.work()
        if job.pace is not None:
            job.pace.observe(job.price, time.perf_counter() - start)
        return result


__all__ = ["Job", "Jobs", "LATER", "POLL", "SLICE", "WORKERS"]
