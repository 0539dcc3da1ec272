"""A shared cloud half trained in synchronous data-parallel rounds (``--sync-rounds``).

Each round: every edge's gradient, their mean, one optimizer step. One cloud process serving 4
edges must equal the same rounds computed in this process; 2 ranks (a gloo group formed from
torchrun's variables) serving 2 edges each must equal the one process; PowerSGD must differ,
still train, and all-reduce fewer bytes; a silent edge is dropped from its round.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import splitft
from splitft import Faults
from splitft.cloud import CloudServer, serve_in_thread
from splitft.cloud.allreduce import GradCompression
from splitft.cloud.rounds import Rounds, RoundSettings
from splitft.cloud.shared_policy import SharedPolicy
from splitft.errors import CapacityError, ConfigError
from tests.conftest import ROOT, PipeReader, stop, thread_errors
from tests.models import mlp
from transports import InprocListener

MLP = "tests.models:mlp"
EDGES, ROUNDS, LR = 4, 16, 0.3


def _data(seed: int, rounds: int = ROUNDS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Learnable batches: the label is the largest of the first three features."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(rounds):
        x = torch.randn(16, 12, generator=g)
        batches.append((x, x[:, :3].argmax(dim=1)))
    return batches


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


SHARED_OPTIMIZER = f'SGD:{{"lr": {LR}, "momentum": 0.9}}'  # the cloud's choice, which the edges' _optimizer matches


def _local(datas: list, rounds: list[list[int]] | None = None) -> tuple[dict, list[dict]]:
    """The same rounds in one process: each edge's bottom steps alone, the top on the mean of the
    gradients of the edges in ``rounds[r]`` (default: every edge in every round)."""
    top = mlp()[2:]
    bottoms = [mlp()[:2] for _ in datas]
    top_opt, bottom_opts = _optimizer(top.parameters()), [_optimizer(b.parameters()) for b in bottoms]
    for r in range(len(rounds) if rounds is not None else len(datas[0])):
        members = rounds[r] if rounds is not None else range(len(datas))
        grads = []
        for i in members:
            x, y = datas[i][r]
            nn.functional.cross_entropy(top(bottoms[i](x)), y).backward()
            grads.append([p.grad.clone() for p in top.parameters()])
            top.zero_grad()
            bottom_opts[i].step()
            bottom_opts[i].zero_grad()
        for p, *per_edge in zip(top.parameters(), *grads):
            p.grad = torch.stack(per_edge).mean(dim=0)
        top_opt.step()
        top_opt.zero_grad()
    return top.state_dict(), [b.state_dict() for b in bottoms]


def _edge(connect, net: nn.Module, data: list, out: dict, key: int, errors: list,
          pause: threading.Event | None = None) -> None:
    try:
        model = splitft.split(net, 2, factory=MLP, connect=connect, faults=Faults(timeout=60))
        opt = model.attach(_optimizer(model.parameters()))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        losses = []
        for r, (x, y) in enumerate(data):
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
            if pause is not None and r == 0:
                pause.wait(60)  # silent: no request while the others train
        out[key] = {"edge": model.edge_state_dict(), "cloud": model.cloud_state_dict(), "losses": losses}
        model.close()
    except BaseException as exc:  # noqa: BLE001 — reported by the caller
        errors.append(exc)


def _train(connects: list, datas: list) -> dict:
    out: dict = {}
    errors: list = []
    nets = [mlp() for _ in datas]  # built here: mlp() seeds torch's global RNG, which threads share
    threads = [threading.Thread(target=_edge, args=(connect, nets[i], data, out, i, errors))
               for i, (connect, data) in enumerate(zip(connects, datas))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, thread_errors(errors)
    assert len(out) == len(datas)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _clouds(tmp_path: Path, ranks: int, per_rank: int, *extra: str) -> list:
    """``ranks`` real `splitft cloud` processes, a gloo group when more than one; (proc, address, stderr)."""
    import subprocess
    import sys

    port = _free_port()
    started = []
    for rank in range(ranks):
        env = os.environ | {"PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        if ranks > 1:
            env |= {"RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
                    "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        ready = tmp_path / f"address-{rank}-{time.monotonic_ns()}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitft", "-v", "cloud", "--bind", "tcp://127.0.0.1:0", "--ready-file",
             str(ready), "--sessions", "0", "--model", MLP, "--shared-model", "--sync-rounds", str(per_rank), "--round-timeout", "30",
             "--shared-optimizer", SHARED_OPTIMIZER,
             *extra], cwd=ROOT, env=env, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL)
        started.append((proc, ready, PipeReader(proc.stderr)))
    deadline = time.monotonic() + 90
    for proc, ready, err in started:
        while not (ready.exists() and ready.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                for p, _, _ in started:
                    stop(p)
                raise RuntimeError(f"cloud process did not start:\n{err.text}")
            time.sleep(0.05)
    return [(proc, ready.read_text(), err) for proc, ready, err in started]


def _run(tmp_path: Path, ranks: int, *extra: str) -> tuple[dict, str]:
    """4 edges over ``ranks`` cloud processes (4 / ranks each); their results and rank 0's log."""
    clouds = _clouds(tmp_path, ranks, EDGES // ranks, *extra)
    try:
        per_rank = EDGES // ranks
        try:
            out = _train([clouds[i // per_rank][1] for i in range(EDGES)], [_data(i) for i in range(EDGES)])
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n" + "\n".join(err.text for _, _, err in clouds)) from None
        return out, clouds[0][2].text
    finally:
        for proc, _, _ in clouds:
            stop(proc)


def _round_bytes(log: str) -> list[int]:
    return [int(b) for b in re.findall(r"round \d+: .* (\d+) gradient bytes all-reduced", log)]


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m: f"{name}: {m}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("rounds")
    return {"one": _run(tmp, 1), "two": _run(tmp, 2),
            "powersgd": _run(tmp, 2, "--grad-compression", "powersgd:rank=1,start=3")}


def test_four_edges_in_one_cloud_process_equal_the_mean_of_their_gradients_computed_locally(runs):
    out, _ = runs["one"]
    top, bottoms = _local([_data(i) for i in range(EDGES)])
    for i in range(EDGES):
        _same(out[i]["cloud"], top)  # every edge sees the one shared half
        _same({k: v for k, v in out[i]["edge"].items()}, bottoms[i])


def test_two_ranks_each_serving_two_edges_equal_one_process(runs):
    one, _ = runs["one"]
    two, log = runs["two"]
    for i in range(EDGES):
        _same(two[i]["cloud"], one[0]["cloud"])
        _same(two[i]["edge"], one[i]["edge"])
    numel = sum(p.numel() for p in mlp()[2:].parameters())
    sent = _round_bytes(log)  # a loaded machine can log one more round as the edges leave
    assert sent[:ROUNDS] == [4 * numel] * ROUNDS and set(sent) == {4 * numel}  # plain: the whole fp32 bucket


def test_powersgd_differs_from_plain_all_reduce_yet_trains_on_fewer_bytes(runs):
    plain, plain_log = runs["two"]
    compressed, log = runs["powersgd"]
    for i in range(EDGES):
        _same(compressed[i]["cloud"], compressed[0]["cloud"])  # every rank holds the same weights
    with pytest.raises(AssertionError):
        _same(compressed[0]["cloud"], plain[0]["cloud"])
    losses = torch.tensor([compressed[i]["losses"] for i in range(EDGES)]).mean(dim=0)
    assert losses[-3:].mean() < 0.8 * losses[:3].mean(), losses
    sent, full = _round_bytes(log), _round_bytes(plain_log)
    assert len(sent) == ROUNDS and sent[:3] == full[:3]  # warm-up: plain all-reduce
    assert all(s < f / 2 for s, f in zip(sent[3:], full[3:])), (sent, full)


# ------------------------------------------------------------------ one process, in this process


def _server(edges: int, timeout: float = 30.0, events: list | None = None) -> tuple[CloudServer, InprocListener]:
    listener = InprocListener()
    server = CloudServer(listener, [MLP], shared_model=True, rounds=Rounds(RoundSettings(edges, timeout)),
                         on_event=(events.append if events is not None else None),
                         shared_policy=SharedPolicy.parse(SHARED_OPTIMIZER, None))
    return server, listener


def test_a_silent_edge_is_dropped_from_its_round_and_the_others_go_on():
    events: list[str] = []
    server, listener = _server(3, timeout=1.5, events=events)
    thread = serve_in_thread(server)
    try:
        datas = [_data(i, rounds=4) for i in range(3)]
        out: dict = {}
        errors: list = []
        pause = threading.Event()
        nets = [mlp() for _ in range(3)]  # built here: mlp() seeds torch's global RNG, which threads share
        silent = threading.Thread(target=_edge, args=(listener.connect, nets[2], datas[2][:2], out, 2, errors, pause))
        silent.start()
        started = time.monotonic()
        others = [threading.Thread(target=_edge, args=(listener.connect, nets[i], datas[i], out, i, errors))
                  for i in range(2)]
        for t in others:
            t.start()
        for t in others:
            t.join(timeout=60)
        took = time.monotonic() - started
        pause.set()
        silent.join(timeout=60)
        assert not errors, thread_errors(errors)
        assert took < 15, took  # one timeout, not one per round
        assert any("dropped from the round" in e for e in events), events
        assert any("discarded" in e for e in events), events  # the silent edge's late step
        # Round 0: three edges; rounds 1-3: the two that kept training; the late step changed nothing.
        top, bottoms = _local(datas, rounds=[[0, 1, 2], [0, 1], [0, 1], [0, 1]])
        for i in range(3):
            _same(out[i]["cloud"], top)
        for i in range(2):
            _same(out[i]["edge"], bottoms[i])
        assert server.rounds.parts[0].late == 1
    finally:
        server.stop()
        thread.join(timeout=10)


def test_edges_beyond_the_rounds_seats_are_refused():
    server, listener = _server(2)
    thread = serve_in_thread(server)
    try:
        models = [splitft.split(mlp(), 2, factory=MLP, connect=listener.connect) for _ in range(2)]
        with pytest.raises(CapacityError, match="rounds of 2 edges"):
            splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
        for m in models:
            m.close()
    finally:
        server.stop()
        thread.join(timeout=10)


def test_edges_of_one_round_stepping_with_different_learning_rates_are_refused():
    server, listener = _server(2, timeout=5.0)
    thread = serve_in_thread(server)
    try:
        (x, y), = _data(0, rounds=1)
        models = [splitft.split(mlp(), 2, factory=MLP, connect=listener.connect) for _ in range(2)]
        opts = [m.attach(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)) for m in models]
        opts[1].param_groups[0]["lr"] = 0.2  # a scheduler that differs between the edges
        for i, (model, opt) in enumerate(zip(models, opts)):
            model.remote_loss(nn.CrossEntropyLoss())(model(x), y).backward()
            if i == 0:
                opt.step()
            else:
                with pytest.raises(ConfigError, match="same settings"):
                    opt.step()
        models[1].close()  # the round no longer waits for it: the first edge's request is answered
        models[0].close()
    finally:
        server.stop()
        thread.join(timeout=10)


def test_rounds_need_a_shared_half_and_a_session_timeout_above_the_round_timeout():
    with pytest.raises(ConfigError, match="--shared-model"):
        CloudServer(InprocListener(), [MLP], rounds=Rounds(RoundSettings(2)))
    from splitft.cloud.limits import Limits
    with pytest.raises(ConfigError, match="session timeout"):
        CloudServer(InprocListener(), [MLP], shared_model=True, limits=Limits(session_timeout=10),
                    rounds=Rounds(RoundSettings(2, timeout=30)))


@pytest.mark.parametrize("spec, expected", [
    ("none", GradCompression()), ("fp16", GradCompression("fp16")),
    ("powersgd:rank=4", GradCompression("powersgd", rank=4)),
    ("powersgd:rank=2,start=5,min_rate=1.5", GradCompression("powersgd", rank=2, start=5, min_rate=1.5)),
])
def test_gradient_compression_specs(spec, expected):
    assert GradCompression.parse(spec) == expected
    assert GradCompression.parse(str(expected)) == expected


@pytest.mark.parametrize("spec", ["topk", "fp16:rank=2", "powersgd:rank=0", "powersgd:start=1", "powersgd:r=2",
                                  "powersgd:rank=x"])
def test_bad_gradient_compression_specs_are_refused(spec):
    with pytest.raises(ConfigError):
        GradCompression.parse(spec)


@pytest.mark.parametrize("args, says", [
    (["--sync-rounds", "2"], "--shared-model"),
    (["--shared-model", "--sync-rounds", "2", "--grad-compression", "topk"], "gradient compression must be"),
    (["--shared-model", "--sync-rounds", "2", "--round-timeout", "400"], "session timeout"),
])
def test_the_cloud_command_refuses_rounds_it_cannot_run(args, says, capsys):
    from splitft.app.cli import main

    assert main(["cloud", "--bind", "tcp://127.0.0.1:0", "--model", MLP, *args]) == 2
    assert says in capsys.readouterr().err
