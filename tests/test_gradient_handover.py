"""The cloud gives the gradients of a loss's eager backward to its parameters as they are (no
copy, ``apply.last``) only where each holds memory of its own: a gradient torch hands to two
parameters at once (``x + a + b``) is copied, or accumulating a second backward pass into one
parameter's ``grad`` would add to the other's too."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from tests.conftest import start_cloud, stop
from tests.models import twin_bias_mlp
from tests.test_script_corpus import assert_bitwise

TWIN = "tests.models:twin_bias_mlp"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, _ = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", TWIN)
    yield address
    stop(proc)


def _accumulating(model: nn.Module, crit, opt, batches) -> None:
    """Two backward passes a step (gradient accumulation), then the step."""
    for first, second in zip(batches[::2], batches[1::2]):
        for x, y in (first, second):
            crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def _batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 12, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def test_a_gradient_shared_by_two_cloud_parameters_accumulates_as_unsplit(cloud):
    batches = _batches(6)
    local = twin_bias_mlp()
    opt = torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9)
    _accumulating(local, nn.CrossEntropyLoss(), opt, batches)
    with splitft.split(twin_bias_mlp(), 2, factory=TWIN, connect=cloud) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _accumulating(model, model.remote_loss(nn.CrossEntropyLoss()), opt, batches)
        assert_bitwise(model.state_dict(), local.state_dict())


def _grads(loss_of, *params):
    return list(zip(params, torch.autograd.grad(loss_of(*params), params)))


def test_only_gradients_with_memory_of_their_own_are_handed_over():
    from splitft.cloud.graphs import sole_owners
    linear, x = nn.Linear(6, 3), torch.randn(5, 6, requires_grad=True)
    found = torch.autograd.grad(linear(x).square().sum(), [x, *linear.parameters()])
    assert sole_owners(found[:1], list(zip(linear.parameters(), found[1:])))  # fresh tensors (a view of all of one)
    a, b = (nn.Parameter(torch.randn(4)) for _ in range(2))
    assert not sole_owners([], _grads(lambda a, b: (a + b).square().sum(), a, b))  # one gradient for both
    assert not sole_owners([], _grads(lambda a, b: torch.cat([a, b]).square().sum(), a, b))  # slices of one
    assert not sole_owners([], _grads(lambda a: a.sum(), a))  # ones, expanded
    wide = nn.Parameter(torch.randn(3, 4).t())  # a parameter laid out otherwise than its gradient
    assert not sole_owners([], _grads(lambda w: (w * torch.arange(12.).reshape(4, 3)).sum(), wide))
