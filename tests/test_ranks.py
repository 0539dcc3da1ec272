"""A cloud of two ranks (a torch.distributed job on gloo, real processes): sessions land on both
ranks and each edge trains exactly as it would alone against a one-process cloud; a rank killed
mid-run costs its edges time, never a step, whether torch's launcher restarts the group or the
surviving rank takes the sessions over."""

from __future__ import annotations

import collections
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import splitft
from splitft import Faults
from splitft.cloud.job_store import SECRET_ENV
from tests.conftest import ROOT, InprocCloud, PipeReader
from tests.models import mlp
from tests.test_faults import MLP, _data, assert_same

EDGES = 4
STEPS = 8
FAULTS = Faults(timeout=10, reconnect_timeout=60, heartbeat=0)
SECRET = "0123456789abcdef0123456789abcdef"  # what the ranks of these jobs sign the store's values with
LISTENING = re.compile(r"cloud rank (\d+)/2 \(pid (\d+)\): listening on (\S+),")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return env | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                  SECRET_ENV: SECRET} | extra


def _cloud_args(ready: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready),
            "--model", MLP, "--sessions", str(EDGES), "--rank-timeout", "3", *extra]


class Job:
    """Processes of one cloud, each in a session of its own so that teardown reaches their children."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.logs: list[PipeReader] = []

    def start(self, args: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, text=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        self.procs.append(proc)
        self.logs.append(PipeReader(proc.stderr))

    @property
    def text(self) -> str:
        return "".join(log.text for log in self.logs)

    def ranks(self) -> list[tuple[int, int]]:
        """(rank, pid) of every rank that came up, in order of appearance."""
        return [(int(r), int(p)) for r, p, _ in LISTENING.findall(self.text)]

    def wait_ready(self, ready: Path, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while not (ready.exists() and ready.read_text()):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                raise RuntimeError(f"the cloud did not start:\n{self.text}")
            time.sleep(0.05)
        return ready.read_text()

    def wait(self, timeout: float) -> list[int | None]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self.procs]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()  # torch's launcher stops its ranks on SIGTERM
        self.wait(10)
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of this job's own process group
            except ProcessLookupError:
                pass
            proc.wait(timeout=10)


def _alone(i: int) -> dict[str, torch.Tensor]:
    """Edge ``i`` trained against a one-process cloud."""
    cloud = InprocCloud([MLP])
    try:
        model = splitft.split(mlp(seed=i), 2, factory=MLP, connect=cloud.connect, faults=FAULTS)
        with model:
            return _train(model, _data(STEPS, seed=i), lambda step: None)
    finally:
        cloud.close()


def _train(model, data, at_step) -> dict[str, torch.Tensor]:
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    for step, (x, y) in enumerate(data):
        loss = crit(model(x), y)
        at_step(step)  # after a forward, before its backward: a fault here is one mid-step
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {**model.edge_state_dict(), **model.cloud_state_dict()}


def _edges(address: str, at_step=lambda i, rank, step: None) -> dict[int, dict]:
    """Four edges at once (all open before any trains, so placement sees them all)."""
    out: dict[int, dict] = {}
    errors: list[BaseException] = []
    opened = threading.Barrier(EDGES, timeout=60)
    build = threading.Lock()  # a model factory seeds torch's global generator: one thread at a time

    def run(i: int) -> None:
        try:
            with build:
                full = mlp(seed=i)
            model = splitft.split(full, 2, factory=MLP, connect=address, faults=FAULTS)
            with model:
                placed = model.session.route.rank
                opened.wait()
                weights = _train(model, _data(STEPS, seed=i), lambda step: at_step(i, placed, step))
                out[i] = {"placed": placed, "now": model.session.route.rank, "weights": weights,
                          "recoveries": model.session.recoveries}
        except BaseException as exc:  # noqa: BLE001 — re-raised in the test's thread
            errors.append(exc)
            opened.abort()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(EDGES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    assert sorted(out) == list(range(EDGES))
    return out


def _killer(job: Job, victim_rank: int, at: int = 3):
    """An edge hook that SIGKILLs the victim rank once, when an edge it serves reaches step ``at``."""
    done = threading.Lock()
    killed: list[int] = []

    def at_step(i: int, rank: int, step: int) -> None:
        if rank == victim_rank and step == at and done.acquire(blocking=False):
            pid = dict(job.ranks())[victim_rank]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    return at_step, killed


@pytest.mark.timeout(90)
def test_four_edges_on_two_ranks_land_on_both_and_train_each_as_alone(tmp_path):
    job = Job()
    try:
        job.start(_cloud_args(tmp_path / "ready", "--workers", "2"), _env())
        address = job.wait_ready(tmp_path / "ready")
        out = _edges(address)
        assert collections.Counter(r["placed"] for r in out.values()) == {0: 2, 1: 2}, job.text
        for i, r in out.items():
            assert_same(r["weights"], _alone(i))
            assert r["recoveries"] == 0
        assert job.wait(30) == [0], job.text  # --sessions counts the sessions ended on every rank
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_run_under_torchs_launcher_loses_no_step(tmp_path):
    """The launcher restarts the group; every edge comes back to the front door and resumes."""
    job = Job()
    args = _cloud_args(tmp_path / "ready", "--workers", "2", "--max-restarts", "1",
                       "--checkpoint-dir", str(tmp_path / "ck"), "--no-fsync")
    try:
        job.start(args, _env())
        address = job.wait_ready(tmp_path / "ready")
        at_step, killed = _killer(job, victim_rank=1)
        out = _edges(address, at_step)
        assert killed, "no edge was placed on rank 1"
        assert len(job.ranks()) == 4, job.text  # both ranks started twice: the group was restarted
        for i, r in out.items():
            assert_same(r["weights"], _alone(i))
        assert all(r["recoveries"] >= 1 for r in out.values() if r["placed"] == 1)
        assert job.wait(30) == [0], job.text
    finally:
        job.close()


@pytest.mark.timeout(120)
def test_a_rank_killed_mid_run_outside_a_launcher_hands_its_edges_to_a_live_rank(tmp_path):
    """Ranks started one by one (any scheduler that sets RANK, WORLD_SIZE, MASTER_ADDR/PORT): the
    survivor sees the dead rank's heartbeat stop, and its edges resume on the front door's rank."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # the job's store, as an agent holds it
    job = Job()
    try:
        for rank in (0, 1):
            job.start(_cloud_args(tmp_path / "ready", "--checkpoint-dir", str(tmp_path / "ck"), "--no-fsync"),
                      _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0"))
        address = job.wait_ready(tmp_path / "ready")
        at_step, killed = _killer(job, victim_rank=1)
        out = _edges(address, at_step)
        assert killed and len(job.ranks()) == 2, job.text  # nothing restarted
        moved = [r for r in out.values() if r["placed"] == 1]
        assert moved and all(r["now"] == 0 and r["recoveries"] >= 1 for r in moved)
        for i, r in out.items():
            assert_same(r["weights"], _alone(i))
        assert job.wait(30)[0] == 0, job.text  # the survivor counted every session and stopped
    finally:
        job.close()


@pytest.mark.timeout(90)
def test_what_others_write_in_the_jobs_store_steers_nothing(tmp_path):
    """The job's TCPStore answers anyone: a forged heartbeat saying rank 1 stopped, rewritten
    faster than rank 1 beats, and a forged count of ended sessions. The front door still places
    edges on rank 1, and the job does not end."""
    import json

    import transports
    from splitft.wire import protocol
    from tests.test_trust import hello

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    job = Job()
    stop_forging = threading.Event()
    try:
        for rank in (0, 1):
            job.start(_cloud_args(tmp_path / "ready"),
                      _env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                           MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                           TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0"))
        address = job.wait_ready(tmp_path / "ready")
        stranger = dist.TCPStore("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        # Forging starts once the front door has seen rank 1 beat: a rank whose every beat is
        # overwritten before the door first reads one is never seen serving, which no signature
        # prevents (what the warning about the store's port is for).
        deadline = time.monotonic() + 30
        while not stranger.check(["splitft/attempt0/beat/1"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)  # two of the front door's looks

        def forge() -> None:
            n = time.monotonic_ns()
            while not stop_forging.is_set():
                n += 10**9
                beat = {"n": n, "boot": "forged", "sessions": 0, "hellos": 0, "stopped": True}
                stranger.set("splitft/attempt0/beat/1", json.dumps(beat))
                stop_forging.wait(0.02)

        forger = threading.Thread(target=forge, daemon=True)
        forger.start()
        time.sleep(1.0)  # the front door looks at the beats every 0.5 s
        stranger.add("splitft/ended", 100)
        for r in (0, 1):
            stranger.set(f"splitft/ended/{r}", "100")
        conns = [transports.connect(address) for _ in range(4)]
        replies = []
        for conn in conns:
            conn.send(protocol.encode(hello()))
            replies.append(protocol.decode(conn.recv(30.0)))
        assert any(isinstance(r, protocol.Redirect) and r.rank == 1 for r in replies), (replies, job.text)
        for conn in conns:
            conn.close()
        time.sleep(2.0)  # a job told it had ended its --sessions would stop now
        assert all(p.poll() is None for p in job.procs), job.text
        assert "not signed with this job's secret" in job.text
    finally:
        stop_forging.set()
        job.close()
