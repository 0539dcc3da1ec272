"""A metric logged beside the loss, both remote losses of one ``model(x)``: the cloud runs its half
again for the second, which is exact when the first run moved nothing the half reads (batch norm's
running statistics), and refused when it moved state the half keeps. Against a real cloud process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft.errors import ModelError
from tests.conftest import start_cloud, stop
from tests.models import kept_state_mlp
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

KEPT = "tests.models:kept_state_mlp"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", KEPT)
    yield address
    stop(proc)


def _train(model, crit, logged: bool):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = []
    for x, y in _data(3):
        out = model(x)
        loss = crit(out, y)
        if logged:
            with torch.no_grad():
                log.append(crit(out, y).item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        log.append(loss.item())
    return log


def _split(cloud, kind):
    return splitft.split(kept_state_mlp(kind=kind), 2, factory=splitft.Factory(KEPT, kwargs={"kind": kind}),
                         connect=cloud)


@pytest.mark.parametrize("kind", ["average", "counter", "generator"])
def test_a_second_loss_of_a_layer_that_moves_its_own_state_is_refused_and_training_goes_on(cloud, kind):
    with _split(cloud, kind) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        x, y = _data(1)[0]
        out = model(x)
        loss = crit(out, y)
        with pytest.raises(ModelError, match=r"its forward moved '2\.(average|calls|noise)'"):
            crit(out, y)
        loss.backward()  # the first loss's graph and the half's state are as the first run left them
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        state = model.state_dict()
    local = kept_state_mlp(kind=kind)
    loss = nn.CrossEntropyLoss()(local(x), y)
    loss.backward()
    torch.optim.SGD(local.parameters(), lr=0.1).step()
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("kind", ["average", "counter", "generator"])
def test_one_loss_a_step_of_a_layer_that_keeps_state_trains_as_unsplit(cloud, kind):
    local = kept_state_mlp(kind=kind)
    expected = _train(local, nn.CrossEntropyLoss(), logged=False)
    with _split(cloud, kind) as model:
        assert _train(model, model.remote_loss(nn.CrossEntropyLoss()), logged=False) == expected
        assert_bitwise(model.state_dict(), local.state_dict())
