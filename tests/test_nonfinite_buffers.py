"""A cloud layer whose buffer holds ``-inf`` (an additive causal mask, a fresh observer's range):
pushed at split() and loaded back as torch loads it, not refused. Against a real cloud process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from tests.conftest import start_cloud, stop
from tests.models import minus_inf_mask_mlp
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

MASKED = "tests.models:minus_inf_mask_mlp"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MASKED)
    yield address
    stop(proc)


def _train(model, crit):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in _data(3):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})  # a checkpoint read back
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("weights", ["push", "factory"])
def test_a_mask_of_minus_infinity_in_the_cloud_half_pushes_trains_and_loads_as_unsplit(cloud, weights):
    local = _train(minus_inf_mask_mlp(), nn.CrossEntropyLoss())
    with splitft.split(minus_inf_mask_mlp(), 2, factory=splitft.Factory(MASKED, weights=weights), connect=cloud) as model:
        split = _train(model, model.remote_loss(nn.CrossEntropyLoss()))
    assert torch.isinf(split["2.mask"]).any()
    assert_bitwise(split, local)
