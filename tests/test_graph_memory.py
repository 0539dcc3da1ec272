"""A graph the cloud keeps and then drops is freed: nothing of it outlives the memory book's entry.

The cloud meters every tensor autograd saves (``GraphMeter``). A pack hook that stored the tensor
itself made each saved *output* hold its own node (output -> grad_fn -> saved output): a cycle
through C++ that Python's collector cannot see, so a graph dropped without its backward, or kept
with ``retain_graph``, was never freed, while the memory book counted it gone.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import splitft
from splitft.cloud.budget import GraphMeter
from tests.conftest import DIGITS, start_cloud, stop

MIB = 1 << 20


def test_a_graph_dropped_without_its_backward_frees_what_it_saved():
    net = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    seen: list[weakref.ref] = []
    net[1].register_forward_hook(lambda module, args, out: seen.append(weakref.ref(out)))  # ReLU saves its output
    x = torch.randn(16, 8, requires_grad=True)
    with GraphMeter(net) as meter:
        out = net(x)
    assert meter.nbytes > 0
    del out
    gc.collect()
    assert seen[0]() is None, "the graph's saved output is still alive after the graph was dropped"


def test_a_graph_kept_with_retain_graph_is_freed_once_dropped():
    net = nn.Sequential(nn.Linear(8, 64), nn.Tanh(), nn.Linear(64, 4))  # Tanh saves its output too
    seen: list[weakref.ref] = []
    net[1].register_forward_hook(lambda module, args, out: seen.append(weakref.ref(out)))
    x = torch.randn(16, 8, requires_grad=True)
    with GraphMeter(net):
        loss = net(x).sum()
    kept = torch.autograd.grad(loss, [x], retain_graph=True)
    plain = torch.autograd.grad(net(x).sum(), [x])  # unmetered: the metered backward read the same values
    assert torch.equal(kept[0], plain[0])
    del loss
    gc.collect()
    assert seen[0]() is None


def _rss(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * 4096


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="reads a process's memory from /proc")
def test_a_cloud_does_not_grow_with_forwards_that_are_never_backpropagated(tmp_path):
    """An edge that asks for gradients and never backpropagates: past the cloud's bound on pending
    calls (64) each new graph drops the oldest, whose memory must come back (before the fix the
    cloud grew ~2 MiB a call here)."""
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS)
    try:
        _forwards_without_backward(proc, address)
    finally:
        stop(proc)


def _forwards_without_backward(proc, address) -> None:
    from splitft.app.models import digits_cnn

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 1, 8, 8, generator=g), torch.randint(0, 10, (32,), generator=g)
    model = splitft.split(digits_cnn(), "block2", factory=DIGITS, connect=address)
    with model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for _ in range(80):  # the bound is reached: from here on each call drops one
            crit(model(x), y)  # a loss with a graph, never backpropagated
        before = _rss(proc.pid)
        for _ in range(120):
            crit(model(x), y)
        grown = _rss(proc.pid) - before
    assert grown < 60 * MIB, f"the cloud grew {grown / MIB:.0f} MiB over 120 forwards it dropped"
