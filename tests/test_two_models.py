"""Two split models in one script, one's cloud weights read into the other's (a sweep warm-starting
a trial from the last, a student from a teacher): as unsplit. Against a real cloud process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from tests.conftest import start_cloud, stop
from tests.models import mlp
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

MLP = "tests.models:mlp"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MLP)
    yield address
    stop(proc)


def _script(a, b, crit_a, crit_b):
    data = _data(4)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    for x, y in data[:2]:
        crit_a(a(x), y).backward()
        opt.step()
        opt.zero_grad()
    with torch.no_grad():  # warm-start b from a, weight by weight; then nudge it toward a
        for pb, pa in zip(b.parameters(), a.parameters()):
            pb.copy_(pa)
            pb.add_(pa, alpha=0.5)
    opt = torch.optim.SGD(b.parameters(), lr=0.1)
    for x, y in data[2:]:
        crit_b(b(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.clone() for k, v in b.state_dict().items()}


def test_one_split_models_weights_copied_into_anothers_as_unsplit(cloud):
    local = _script(mlp(0), mlp(1), nn.CrossEntropyLoss(), nn.CrossEntropyLoss())
    with splitft.split(mlp(0), 2, factory=MLP, connect=cloud) as a, \
            splitft.split(mlp(1), 2, factory=splitft.Factory(MLP, {"seed": 1}), connect=cloud) as b:
        split = _script(a, b, a.remote_loss(nn.CrossEntropyLoss()), b.remote_loss(nn.CrossEntropyLoss()))
    assert_bitwise(split, local)


def test_a_layer_too_large_to_read_back_copied_from_another_split_model_is_refused_naming_load_state_dict(cloud):
    """``tp.copy_(p)`` from another split model's cloud layer of more than 65,536 values (a DQN's target
    network kept split too): refused before that layer changes, pointing to ``load_state_dict``, which
    copies whole layers at any size."""
    from splitft.errors import PlaceholderError

    wide = splitft.Factory(MLP, {"width": 300})
    with splitft.split(mlp(0, width=300), 2, factory=wide, connect=cloud) as online, \
            splitft.split(mlp(1, width=300), 2, factory=wide, connect=cloud) as target:
        before = {k: v.clone() for k, v in target.state_dict().items()}
        with torch.no_grad(), pytest.raises(PlaceholderError, match=r"copy_ reads .* of another split model "
                                                                    r"\(90000 values.*load_state_dict"):
            for tp, p in zip(target.parameters(), online.parameters()):
                tp.copy_(p)
        assert all(torch.equal(v, before[k]) for k, v in target.state_dict().items() if not k.startswith("0."))
        target.load_state_dict(online.state_dict())  # the way that works at any size
        assert_bitwise(target.state_dict(), online.state_dict())
