"""SGLR on a shared half in rounds: the averaged cut-layer gradient and split learning rates.

A real `splitft cloud --shared-model --sync-rounds 4 --average-cut-grads --server-lr` serving 4
edges must equal the same rounds computed in this process: each edge's bottom steps (at its own,
client-side rate) on the mean of the round's cut gradients, the top on the mean of the edges'
gradients at the server's rate. An edge whose batch has another shape is refused with a typed error.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

import splitft
from splitft import Faults
from splitft.errors import ConfigError
from tests.conftest import stop, thread_errors
from tests.models import mlp
from tests.test_rounds import MLP, _clouds, _data

EDGES, ROUNDS = 4, 12
CLIENT_LR, SERVER_LR = 0.5, 0.2  # the edge's rate is above the cloud's optimizer's: with split rates it may be
SPLIT = ("--average-cut-grads", "--server-lr", str(SERVER_LR))


def _sgd(params, lr: float) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=lr, momentum=0.9)


def _local(datas: list) -> tuple[dict, list[dict]]:
    """The rounds in one process: every edge's forward on the round's weights, the mean cut
    gradient back into every bottom, the mean of the top's gradients stepped at the server's rate."""
    top = mlp()[2:]
    bottoms = [mlp()[:2] for _ in datas]
    top_opt, bottom_opts = _sgd(top.parameters(), SERVER_LR), [_sgd(b.parameters(), CLIENT_LR) for b in bottoms]
    for r in range(len(datas[0])):
        cuts, top_grads, cut_grads = [], [], []
        for i, bottom in enumerate(bottoms):
            x, y = datas[i][r]
            cut = bottom(x)
            sent = cut.detach().requires_grad_()
            nn.functional.cross_entropy(top(sent), y).backward()
            top_grads.append([p.grad.clone() for p in top.parameters()])
            top.zero_grad()
            cuts.append(cut)
            cut_grads.append(sent.grad)
        mean_cut = torch.stack(cut_grads).mean(dim=0)
        for cut, opt in zip(cuts, bottom_opts):
            cut.backward(mean_cut)
            opt.step()
            opt.zero_grad()
        for p, *per_edge in zip(top.parameters(), *top_grads):
            p.grad = torch.stack(per_edge).mean(dim=0)
        top_opt.step()
        top_opt.zero_grad()
    return top.state_dict(), [b.state_dict() for b in bottoms]


def _edge(connect: str, net: nn.Module, data: list, out: dict, key: int, errors: list) -> None:
    try:
        model = splitft.split(net, 2, factory=MLP, connect=connect, faults=Faults(timeout=60))
        opt = model.attach(_sgd(model.parameters(), CLIENT_LR))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for x, y in data:
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        out[key] = {"edge": model.edge_state_dict(), "cloud": model.cloud_state_dict()}
        model.close()
    except BaseException as exc:  # noqa: BLE001 — reported by the caller
        errors.append(exc)


def _train(connect: str, datas: list) -> tuple[dict, list]:
    out: dict = {}
    errors: list = []
    nets = [mlp() for _ in datas]  # built here: mlp() seeds torch's global RNG, which threads share
    threads = [threading.Thread(target=_edge, args=(connect, nets[i], data, out, i, errors))
               for i, data in enumerate(datas)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    return out, errors


def _same(a: dict, b: dict) -> None:
    # float32 and a tolerance: the cloud sums the round's gradients in the order they arrive, this
    # process in the edges' order, and float addition is not associative (differences of an ulp or
    # so per round, carried by the momentum over 12 rounds; assert_close's float32 defaults).
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m: f"{name}: {m}")


def test_averaged_cut_gradient_and_split_rates_equal_the_rounds_in_one_process(tmp_path):
    datas = [_data(i, ROUNDS) for i in range(EDGES)]
    ((proc, address, err),) = _clouds(tmp_path, 1, EDGES, *SPLIT)
    try:
        out, errors = _train(address, datas)
        assert not errors, thread_errors(errors) + "\n" + err.text
    finally:
        stop(proc)
    top, bottoms = _local(datas)
    for i in range(EDGES):
        _same(out[i]["cloud"], top)
        _same(out[i]["edge"], bottoms[i])


def test_a_batch_of_another_size_is_refused_with_a_typed_error(tmp_path):
    datas = [_data(i, 1) for i in range(2)]
    x, y = datas[1][0]
    datas[1] = [(x[:8], y[:8])]
    ((proc, address, err),) = _clouds(tmp_path, 1, 2, *SPLIT, "--round-timeout", "2")
    try:
        out, errors = _train(address, datas)
    finally:
        stop(proc)
    assert len(errors) == 1 and isinstance(errors[0], ConfigError), thread_errors(errors) + "\n" + err.text
    assert "same size" in str(errors[0])


def test_a_silent_edge_holds_the_round_s_averaged_answers_no_longer_than_the_round_timeout(tmp_path):
    """Edge 1 says hello and goes silent: edge 0's backward is answered with the mean of the
    gradients that came (its own) once the round timeout passed, and it trains on."""
    ((proc, address, err),) = _clouds(tmp_path, 1, 2, *SPLIT, "--round-timeout", "2")
    silent = threading.Event()
    errors: list = []
    out: dict = {}

    def quiet() -> None:
        try:
            model = splitft.split(mlp(), 2, factory=MLP, connect=address, faults=Faults(timeout=60))
            model.attach(_sgd(model.parameters(), CLIENT_LR))
            silent.wait(60)
            model.close()
        except BaseException as exc:  # noqa: BLE001 — reported below
            errors.append(exc)

    try:
        other = threading.Thread(target=quiet)
        other.start()
        _edge(address, mlp(), _data(0, 3), out, 0, errors)
        silent.set()
        other.join(timeout=60)
    finally:
        stop(proc)
    assert not errors, thread_errors(errors) + "\n" + err.text
    assert 0 in out and "sent no gradient within 2 s; dropped" in err.text
