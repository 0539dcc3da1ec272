"""One edge's batch split across the ranks of a cloud (``--split-batch``).

A real 2-rank cloud (two `splitft cloud` processes in a gloo group formed from torchrun's
variables, one listener on rank 0) must train an edge exactly as a 1-process cloud does: the
same edge, the same batches, both halves' final weights equal. Plain split with the loss in the
cloud, U-shape, gradient accumulation over odd-sized half-batches, clipping and a scheduler.
What cannot be split exactly is refused with a clear error.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import splitft
from splitft import Faults
from splitft.app.cli import main
from splitft.errors import ConfigError
from tests.conftest import ROOT, PipeReader, stop
from tests.models import mlp, mlp_batchnorm, residual_net, tiny_bert

MODELS = ("tests.models:mlp", "tests.models:residual_net", "tests.models:mlp_batchnorm", "tests.models:tiny_bert")
STEPS = 5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cloud(tmp_path: Path, ranks: int, *flags: str) -> tuple[list[subprocess.Popen], str, list[PipeReader]]:
    """``ranks`` real cloud processes (with --split-batch and ``flags`` when more than one); rank 0's address."""
    port, ready = _free_port(), tmp_path / f"address-{ranks}-{time.monotonic_ns()}"
    procs, errs = [], []
    for rank in range(ranks):
        env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        extra = ["--split-batch", *flags] if ranks > 1 else []
        if ranks > 1:
            env |= {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        models = [arg for name in MODELS for arg in ("--model", name)]
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0", "--ready-file", str(ready),
             "--sessions", "0", *models, *extra], cwd=ROOT, env=env, text=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
        procs.append(proc)
        errs.append(PipeReader(proc.stderr))
    deadline = time.monotonic() + 60
    while not (ready.exists() and ready.read_text()):
        if any(p.poll() is not None for p in procs) or time.monotonic() > deadline:
            for p in procs:
                stop(p)
            raise RuntimeError("cloud did not start:\n" + "\n".join(e.text for e in errs))
        time.sleep(0.05)
    return procs, ready.read_text(), errs


def _batches(seed: int, rows: int = 15) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        x = torch.randn(rows, 12, generator=g)
        out.append((x, x[:, :3].argmax(dim=1)))
    return out


def _sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def _train(connect: str, net: nn.Module, factory: str, cut, rejoin=None, seed: int = 0, optimizer=_sgd) -> dict:
    """STEPS steps, each accumulating two backward calls over odd-sized halves; clipping, a scheduler."""
    model = splitft.split(net, cut, rejoin, factory=factory, connect=connect, faults=Faults(timeout=60))
    with model:
        opt = model.attach(optimizer(model.parameters()))
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        crit = nn.CrossEntropyLoss() if rejoin is not None else model.remote_loss(nn.CrossEntropyLoss())
        losses = []
        for x, y in _batches(seed):
            for part in torch.tensor_split(torch.arange(len(y)), 2):
                loss = crit(model(x[part]), y[part]) / 2
                loss.backward()
                losses.append(float(loss.detach()))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
        return {"edge": model.edge_state_dict(), "cloud": model.cloud_state_dict(), "losses": losses}


def _train_bert(connect: str) -> dict:
    """A transformer trunk (U-shape): token rows of uneven length, the attention mask as a kwarg."""
    model = splitft.split(tiny_bert(), "bert.encoder.layer.1:3", factory=MODELS[3], connect=connect,
                          faults=Faults(timeout=60))
    g = torch.Generator().manual_seed(3)
    with model:
        opt = model.attach(torch.optim.AdamW(model.parameters(), lr=1e-3))
        losses = []
        for _ in range(3):
            ids = torch.randint(0, 100, (5, 10), generator=g)
            mask = (torch.arange(10) < torch.randint(4, 11, (5, 1), generator=g)).long()
            loss = nn.functional.cross_entropy(model(ids, mask), torch.randint(0, 3, (5,), generator=g))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return {"edge": model.edge_state_dict(), "cloud": model.cloud_state_dict(), "losses": losses}


RUNS = {
    "plain split, loss in the cloud": lambda c: _train(c, mlp(), MODELS[0], 2),
    "U-shape": lambda c: _train(c, mlp(), MODELS[0], 2, 4, seed=1),
    "residual net, U-shape": lambda c: _train(c, residual_net(), MODELS[1], "stage1", "head", seed=2),
    "tiny BERT trunk, attention mask": _train_bert,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("batch_split")
    out = {}
    for ranks in (1, 2):
        procs, address, errs = _cloud(tmp, ranks)
        try:
            out[ranks] = {name: run(address) for name, run in RUNS.items()}
            out[f"{ranks}-log"] = "\n".join(e.text for e in errs)
        except Exception as exc:
            raise AssertionError("\n".join(e.text for e in errs)) from exc
        finally:
            for p in procs:
                stop(p)
    return out


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("name", list(RUNS))
def test_a_batch_split_over_two_ranks_equals_one_rank(runs, name):
    one, two = runs[1][name], runs[2][name]
    _same(two["cloud"], one["cloud"])
    _same(two["edge"], one["edge"])
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert "each batch split over 2 rank(s)" in runs["2-log"]


def test_the_split_run_really_trained(runs):
    """Equal weights mean something only if the halves moved from where they started."""
    start = mlp().state_dict()
    trained = runs[2]["plain split, loss in the cloud"]["cloud"]
    assert set(trained) == {"2.weight", "2.bias", "4.weight", "4.bias"}
    assert all(not torch.allclose(value, start[name]) for name, value in trained.items())


def test_a_half_with_batchnorm_is_refused_with_a_clear_error(tmp_path):
    procs, address, errs = _cloud(tmp_path, 2)
    try:
        with pytest.raises(ConfigError, match="BatchNorm1d.*batch statistics"):
            splitft.split(mlp_batchnorm(), 2, factory=MODELS[2], connect=address, faults=Faults(timeout=30))
        # the cloud goes on serving: a splittable half trains next
        _train(address, mlp(), MODELS[0], 2)
    finally:
        for p in procs:
            stop(p)


@pytest.mark.parametrize("extra", [["--shared-model"], ["--checkpoint-dir", "ckpt"]])
def test_the_cloud_command_refuses_what_a_split_batch_cannot_serve(extra, capsys, tmp_path):
    args = ["cloud", "--bind", "tcp://127.0.0.1:0", "--model", MODELS[0], "--split-batch", *extra]
    if "ckpt" in extra:
        args[-1] = str(tmp_path / "ckpt")
    assert main(args) == 2
    assert "--split-batch" in capsys.readouterr().err
