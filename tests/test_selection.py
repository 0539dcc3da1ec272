"""A selective server (AdaSplit): `splitft cloud --train-fraction F` trains on the hardest batches only.

A local-loss edge (frozen towards the cloud: nothing crosses back) sends a backward per step; a
real cloud process with ``--train-fraction 0.5`` must end with the weights of the same steps in
one process where the top is trained only on the batches the rule picks (its loss at least the
median of the edge's recent losses), and must skip about half of them.
"""

from __future__ import annotations

import torch
from torch import nn

import splitft
from splitft import Faults, Schedule
from splitft.cloud.selection import Selector
from tests.conftest import start_cloud, stop
from tests.models import mlp

MLP = "tests.models:mlp"
STEPS, FRACTION = 24, 0.5


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(5)
    out = []
    for _ in range(STEPS):
        x = torch.randn(16, 12, generator=g)
        out.append((x, x[:, :3].argmax(dim=1)))
    return out


def _local() -> tuple[dict, int]:
    net = mlp()
    bottom, top = net[:2], net[2:]
    opt = torch.optim.SGD(top.parameters(), lr=0.2, momentum=0.9)
    selector = Selector(FRACTION)
    for x, y in _batches():
        loss = nn.functional.cross_entropy(top(bottom(x).detach()), y)
        if selector.wants(float(loss.detach())):
            loss.backward()
        opt.step()
        opt.zero_grad()
    return top.state_dict(), selector.skipped


def test_a_selective_cloud_trains_on_the_batches_its_rule_picks_and_skips_the_rest(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--train-fraction", str(FRACTION))
    try:
        model = splitft.split(mlp(), 2, factory=MLP, connect=address, freeze_edge=True,
                              schedule=Schedule(eager_backward=False), faults=Faults(timeout=30))
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for x, y in _batches():
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        cloud = model.cloud_state_dict()
        model.close()
    finally:
        stop(proc)
    top, skipped = _local()
    assert STEPS // 4 <= skipped <= 3 * STEPS // 4  # about half the batches cost the server no backward
    assert set(cloud) == set(top)
    for name in top:
        torch.testing.assert_close(cloud[name], top[name], msg=lambda m: f"{name}: {m}\n{err.text}")
