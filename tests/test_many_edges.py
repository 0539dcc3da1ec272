"""Many edges on one cloud: isolated sessions by default, or one shared cloud half (SplitNN-style)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from torch import nn

import splitft
from splitft import Codecs
from splitft.cloud import CloudServer, serve_in_thread
from splitft.cloud.shared_policy import SharedPolicy
from tests.conftest import ROOT, thread_errors
from tests.test_faults import MLP, _data, assert_same, local_weights, split_weights
from tests.models import mlp
from transports import InprocListener


def _cloud(shared: bool, policy: SharedPolicy | None = None):
    listener = InprocListener()
    server = CloudServer(listener, [MLP], shared_model=shared, shared_policy=policy)
    thread = serve_in_thread(server)
    yield server, listener
    server.stop()
    thread.join(timeout=10)


@pytest.fixture
def cloud():
    yield from _cloud(shared=False)


@pytest.fixture
def shared_cloud():
    yield from _cloud(shared=True, policy=SharedPolicy("Adam", {"lr": 0.01}))


@pytest.fixture
def shared_sgd_cloud():
    yield from _cloud(shared=True, policy=SharedPolicy("SGD", {"lr": 0.1}))


def test_concurrent_edges_have_isolated_sessions(cloud):
    server, listener = cloud
    results: dict[int, dict] = {}
    errors: list[BaseException] = []

    models = [mlp() for _ in range(4)]  # built here: mlp() seeds torch's global RNG, not thread-safe

    def edge(i: int) -> None:
        try:
            model = splitft.split(models[i], 2, factory=MLP, connect=listener.connect, codecs=Codecs(seed=i))
            with model:
                results[i] = split_weights(model, _data(5, seed=i))
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    threads = [threading.Thread(target=edge, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, thread_errors(errors)
    for i in range(4):
        assert_same(results[i], local_weights(_data(5, seed=i)))


def _local_shared(phases, lr: float = 0.01):
    """What a shared cloud half should give: each edge's bottom and one top, Adam everywhere,
    the top's optimizer shared, edges training one after another."""
    bottoms = {name: mlp(seed=seed)[:2] for name, seed in (("a", 0), ("b", 1))}
    top = mlp(seed=0)[2:]
    opts = {name: torch.optim.Adam(b.parameters(), lr=lr) for name, b in bottoms.items()}
    top_opt = torch.optim.Adam(top.parameters(), lr=lr)
    for name, data in phases:
        for x, y in data:
            nn.functional.cross_entropy(top(bottoms[name](x)), y).backward()
            opts[name].step()
            top_opt.step()
            opts[name].zero_grad()
            top_opt.zero_grad()
    return bottoms, top


def test_shared_cloud_half_trains_edges_in_turn(shared_cloud):
    server, listener = shared_cloud
    a_data, b_data, a_more = _data(3, seed=1), _data(3, seed=2), _data(2, seed=3)
    edges = {name: splitft.split(mlp(seed=seed), 2, factory=MLP, connect=listener.connect)
             for name, seed in (("a", 0), ("b", 1))}  # b's pushed weights are ignored: a's came first
    opts = {name: m.attach(torch.optim.Adam(m.parameters(), lr=0.01)) for name, m in edges.items()}
    crits = {name: m.remote_loss(nn.CrossEntropyLoss()) for name, m in edges.items()}
    for name, data in (("a", a_data), ("b", b_data), ("a", a_more)):
        for x, y in data:
            crits[name](edges[name](x), y).backward()
            opts[name].step()
            opts[name].zero_grad()
    bottoms, top = _local_shared([("a", a_data), ("b", b_data), ("a", a_more)])
    cloud_a, cloud_b = edges["a"].cloud_state_dict(), edges["b"].cloud_state_dict()
    assert_same(cloud_a, cloud_b)  # one cloud half
    assert_same(cloud_a, top.state_dict())  # a slice of a Sequential keeps the original names
    for name, model in edges.items():
        assert_same(model.model[0].state_dict(), bottoms[name][0].state_dict())
        model.close()
    assert len(server.shared) == 1


def test_shared_cloud_half_keeps_each_edges_gradients_apart(shared_sgd_cloud):
    """Edge a accumulates a gradient, edge b steps in between: b's step uses b's gradient only,
    and a's later step a's only."""
    server, listener = shared_sgd_cloud
    (xa, ya), (xb, yb) = _data(1, seed=1)[0], _data(1, seed=2)[0]
    edges = [splitft.split(mlp(), 2, factory=MLP, connect=listener.connect) for _ in range(2)]
    opts = [m.attach(torch.optim.SGD(m.parameters(), lr=0.1)) for m in edges]
    crits = [m.remote_loss(nn.CrossEntropyLoss()) for m in edges]
    crits[0](edges[0](xa), ya).backward()
    crits[1](edges[1](xb), yb).backward()
    opts[1].step()
    opts[0].step()
    got = edges[0].cloud_state_dict()

    model = mlp()
    top = list(model[2:].parameters())
    grads_a = torch.autograd.grad(nn.functional.cross_entropy(model(xa), ya), top)
    grads_b = torch.autograd.grad(nn.functional.cross_entropy(model(xb), yb), top)
    with torch.no_grad():
        for p, ga, gb in zip(top, grads_a, grads_b):
            p -= 0.1 * (ga + gb)
    assert_same(got, {k: v for k, v in model.state_dict().items() if not k.startswith("0.")})
    for m in edges:
        m.close()


def test_shared_model_and_checkpoints_do_not_mix():
    with pytest.raises(splitft.ConfigError, match="shared_model / checkpoint_dir"):
        CloudServer(InprocListener(), [MLP], shared_model=True, checkpoint_dir="/tmp/x")


def test_shared_cloud_half_recomputes_a_graph_another_edge_made_stale(shared_sgd_cloud):
    """Edge a's forward, then edge b's whole step, then a's backward: a's gradient is that of the
    cloud half as it is now (after b's step), on a's activation, not of the weights it ran on."""
    server, listener = shared_sgd_cloud
    (xa, ya), (xb, yb) = _data(1, seed=1)[0], _data(1, seed=2)[0]
    edges = [splitft.split(mlp(), 2, factory=MLP, connect=listener.connect) for _ in range(2)]
    opts = [m.attach(torch.optim.SGD(m.parameters(), lr=0.1)) for m in edges]
    crits = [m.remote_loss(nn.CrossEntropyLoss()) for m in edges]
    loss_a = crits[0](edges[0](xa), ya)
    crits[1](edges[1](xb), yb).backward()
    opts[1].step()
    loss_a.backward()
    opts[0].step()
    got = edges[0].cloud_state_dict()

    model = mlp()
    top = list(model[2:].parameters())
    grads_b = torch.autograd.grad(nn.functional.cross_entropy(model(xb), yb), top)
    with torch.no_grad():
        for p, g in zip(top, grads_b):
            p -= 0.1 * g
    grads_a = torch.autograd.grad(nn.functional.cross_entropy(model(xa), ya), top)
    with torch.no_grad():
        for p, g in zip(top, grads_a):
            p -= 0.1 * g
    assert_same(got, {k: v for k, v in model.state_dict().items() if not k.startswith("0.")})
    for m in edges:
        m.close()


_CONCURRENT_SPLITS = r"""
import sys
import threading
import torch
from torch import nn
from torch.optim import optimizer as torch_optimizer
from splitft.edge import optimizers

sys.setswitchinterval(1e-6)  # threads take turns as often as they can: a race shows at once
barrier = threading.Barrier(8)
errors = []

def edge():
    try:
        barrier.wait(30)
        for _ in range(10):
            optimizers.install()
    except BaseException as exc:
        errors.append(repr(exc))

threads = [threading.Thread(target=edge) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join(120)
hooks = [h for h in torch_optimizer._global_optimizer_pre_hooks.values() if h is optimizers._before_step]
wrapped = getattr(torch.optim.Optimizer.load_state_dict, "__splitft_original__", None)
print(errors, len(hooks), wrapped is not None and not hasattr(wrapped, "__splitft_original__"))
"""


def test_edges_split_in_many_threads_of_one_process_install_the_hooks_once():
    """Models split in threads at once: torch's optimizer hooks go in once (twice would mirror
    every step twice). A fresh interpreter, so that the hooks are installed here and not by an
    earlier test."""
    result = subprocess.run([sys.executable, "-c", _CONCURRENT_SPLITS], cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=os.environ | {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == "[] 1 True", result.stdout
