"""State taken from the model before split() without a copy, loaded after it: as unsplit, or refused.

``init = net.state_dict()`` shares the weights' memory. Unsplit, a k-fold loop's
``model.load_state_dict(init)`` copies each weight onto itself: a no-op, and the folds go on from
one another. Split, that memory kept the cloud half's values of the cut; sending it rewound the
cloud half silently. Run against a real cloud process.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import splitft
from splitft.errors import ConfigError
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


def _folds(net, wrap, init_of):
    """A k-fold loop as scripts write it: the state to reset to taken before the model is wrapped."""
    init = init_of(net)
    model, crit = wrap(net)
    with model as inside:
        return _train_folds(inside, crit, init)


class _Plain:
    """The unsplit model in a ``with`` block, as the split one is used."""

    def __init__(self, net):
        self.net = net

    def __enter__(self):
        return self.net

    def __exit__(self, *exc):
        return False


def _train_folds(model, crit, init):
    for _ in range(2):
        model.load_state_dict(init)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _data(3):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("init_of", [lambda net: net.state_dict(), lambda net: copy.deepcopy(net.state_dict()),
                                     lambda net: {k: v.data for k, v in net.named_parameters()}],
                         ids=["shared", "copied", "data"])
def test_a_reset_to_state_taken_before_split_loads_as_unsplit(cloud, init_of):
    local = _folds(mlp(), lambda net: (_Plain(net), nn.CrossEntropyLoss()), init_of)

    def wrap(net):
        model = splitft.split(net, 2, factory=MLP, connect=cloud)
        return model, model.remote_loss(nn.CrossEntropyLoss())

    assert_bitwise(_folds(mlp(), wrap, init_of), local)


def test_state_taken_before_split_loaded_under_another_name_is_refused(cloud):
    net = mlp()
    init = net.state_dict()
    with splitft.split(net, 2, factory=MLP, connect=cloud) as model:
        renamed = dict(model.state_dict())
        renamed["4.weight"] = init["2.weight"][:3].clone()  # a copy: fine
        model.load_state_dict(renamed)
        renamed["2.weight"] = init["2.weight"].t()  # the memory of the cut, another view of it
        with pytest.raises(ConfigError, match=r"'2\.weight' was taken from the model before split\(\) \(from '2\.weight'"):
            model.load_state_dict(renamed)


def test_state_taken_before_one_split_is_refused_by_another(cloud):
    first, second = mlp(), mlp()
    init = first.state_dict()
    with splitft.split(first, 2, factory=MLP, connect=cloud), \
            splitft.split(second, 2, factory=MLP, connect=cloud) as other:
        with pytest.raises(ConfigError, match="taken from the model before split"):
            other.load_state_dict(init)


def test_a_load_after_another_split_model_was_made_whole_again_loads(cloud):
    """The twins of a model unsplit() made whole hold its placeholders since: no memory of a cut."""
    first = splitft.split(mlp(), 2, factory=MLP, connect=cloud)
    whole = first.unsplit()
    with splitft.split(mlp(1), 2, factory=splitft.Factory(MLP, {"seed": 1}), connect=cloud) as model:
        model.load_state_dict(copy.deepcopy(whole.state_dict()))
        assert_bitwise(model.state_dict(), whole.state_dict())
