"""A switch a script flips on a layer's class (``Block.noise_on = False``) reaches every layer of
that class unsplit, the cloud's too: it is sent as the layers' own setting. Against a real cloud."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from tests.conftest import start_cloud, stop
from tests.models import ClassSwitchedNoise, class_switched_mlp
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

SWITCHED = "tests.models:class_switched_mlp"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", SWITCHED)
    yield address
    stop(proc)


def _train(model, crit):
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    try:
        for i, (x, y) in enumerate(_data(4)):
            if i == 1:
                ClassSwitchedNoise.noise_on = False  # the noise off for every layer of the class
            if i == 2:
                ClassSwitchedNoise.scale = 0.5
                ClassSwitchedNoise.noise_on = True
            loss = crit(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    finally:
        ClassSwitchedNoise.noise_on, ClassSwitchedNoise.scale = True, 0.1
    return losses, {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_switch_flipped_on_a_cloud_layers_class_reaches_the_cloud_as_unsplit(cloud, rejoin):
    expected, state = _train(class_switched_mlp(), nn.CrossEntropyLoss())
    with splitft.split(class_switched_mlp(), 2, rejoin, factory=SWITCHED, connect=cloud) as model:
        got, split_state = _train(model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()))
    assert got == expected
    assert_bitwise(split_state, state)
