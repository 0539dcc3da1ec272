"""Dropout in the cloud half draws from the session's own generator, not the cloud process's.

A real cloud process serves an edge alone, then the same edge again while another edge trains
in between its steps: the first edge's weights must come out the same both times. Drawn from the
process's generator, its masks would depend on the other edge's traffic and on its own earlier run.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft import Codecs, Faults
from tests.conftest import start_cloud, stop
from tests.models import mlp_dropout

MODEL = "tests.models:mlp_dropout"
STEPS = 6


def _edge(address: str, seed: int) -> tuple[splitft.SplitModel, torch.optim.Optimizer, list]:
    model = splitft.split(mlp_dropout(), 2, factory=MODEL, connect=address, codecs=Codecs(seed=seed),
                          faults=Faults(timeout=30))
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, opt, _edge_data(seed)


def _step(model: splitft.SplitModel, opt: torch.optim.Optimizer, crit: nn.Module, x: torch.Tensor,
          y: torch.Tensor) -> None:
    crit(model(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.timeout(120)
def test_an_edge_draws_the_same_dropout_masks_whoever_else_trains(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MODEL)
    try:
        finals = []
        for other in (False, True):
            model, opt, data = _edge(address, seed=0)
            crit = model.remote_loss(nn.CrossEntropyLoss())
            neighbour = _edge(address, seed=1) if other else None
            if neighbour is not None:
                neighbour_crit = neighbour[0].remote_loss(nn.CrossEntropyLoss())
            for i, (x, y) in enumerate(data):
                if neighbour is not None:  # the other edge's dropout runs between this edge's steps
                    _step(neighbour[0], neighbour[1], neighbour_crit, *neighbour[2][i])
                _step(model, opt, crit, x, y)
            finals.append(model.cloud_state_dict())
            model.close()
            if neighbour is not None:
                neighbour[0].close()
        for name, value in finals[0].items():
            assert torch.equal(value, finals[1][name]), name
        # and dropout did act: an edge with another seed draws other masks
        model, opt, data = _edge(address, seed=2)
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for x, y in _edge_data(seed=0):
            _step(model, opt, crit, x, y)
        other_seed = model.cloud_state_dict()
        model.close()
        assert any(not torch.equal(v, other_seed[n]) for n, v in finals[0].items())
    finally:
        stop(proc)
        print(err.text[-2000:])


def _edge_data(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)) for _ in range(STEPS)]


def test_starting_a_cloud_in_this_process_leaves_its_generator_alone():
    """The server warms its FLOP counter up on a thread of its own: building anything on the host
    there would draw from the process's generator under a caller that seeded it (it did)."""
    import threading

    import transports
    from splitft.cloud import CloudServer

    torch.manual_seed(123)
    before = torch.get_rng_state()
    server = CloudServer(transports.InprocListener(), ["splitft.app.models:digits_cnn"])
    try:
        for thread in threading.enumerate():
            if thread.name == "splitft-warm-up":
                thread.join(timeout=60)
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        server.stop()
