"""Complex and sparse tensors in a split model: complex weights (a Fourier layer's) live in the
cloud and come back in state_dict() bit for bit, and a complex output crosses the cut with its
gradient; what the cloud cannot differentiate or hold (a complex input that needs a gradient, a
sparse tensor) is refused with the fix named, before anything is sent or built."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft.errors import ConfigError, CutError
from tests.conftest import start_cloud, stop
from tests.models import sparse_activation_mlp, sparse_graph_mlp, spectral_net
from tests.test_script_corpus import assert_bitwise

SPECTRAL = "tests.models:spectral_net"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, _ = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", SPECTRAL,
                                   "--model", "tests.models:sparse_graph_mlp", "--model", "tests.models:sparse_activation_mlp")
    yield address
    stop(proc)


def _train(model, steps: int = 3) -> list[torch.Tensor]:
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(4, 2, 16, generator=gen), torch.randint(0, 3, (4,), generator=gen)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("spectrum_first", [False, True], ids=["complex weights", "complex output"])
def test_complex_weights_and_a_complex_output_train_and_come_back_as_unsplit(cloud, spectrum_first):
    local = spectral_net(spectrum_first=spectrum_first)
    expected = _train(local)
    factory = splitft.Factory(SPECTRAL, {"spectrum_first": spectrum_first})
    with splitft.split(spectral_net(spectrum_first=spectrum_first), "1", "2" if spectrum_first else "3",
                       factory=factory, connect=cloud) as model:
        assert all(torch.equal(a, b) for a, b in zip(_train(model), expected))
        state = model.state_dict()
        assert_bitwise(state, local.state_dict())
        if not spectrum_first:
            assert state["1.weight"].dtype == torch.cfloat
        whole = model.unsplit()
    assert_bitwise(whole.state_dict(), local.state_dict())


def test_a_complex_tensor_that_needs_a_gradient_is_refused_at_the_cut_naming_view_as_real(cloud):
    factory = splitft.Factory(SPECTRAL, {"spectrum_first": True})
    with splitft.split(spectral_net(spectrum_first=True), "2", "3", factory=factory, connect=cloud) as model:
        with pytest.raises(ConfigError, match=r"complex tensor that needs a gradient.*view_as_real"):
            model(torch.randn(4, 2, 16))
        with torch.no_grad():  # no gradient to take: it crosses as it is
            assert torch.equal(model(torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(1))),
                               spectral_net(spectrum_first=True)(torch.randn(4, 2, 16,
                                                                 generator=torch.Generator().manual_seed(1))))
        assert_bitwise(model.state_dict(), spectral_net(spectrum_first=True).state_dict())  # the session goes on


def test_a_sparse_tensor_in_the_cloud_half_is_refused_at_split_and_one_crossing_at_the_cut(cloud):
    net = sparse_graph_mlp()
    with pytest.raises(CutError, match=r"2\.adj is a sparse tensor.*torch\.mm"):
        splitft.split(net, "2", factory="tests.models:sparse_graph_mlp", connect=cloud)
    assert net[2].adj.is_sparse  # the model is left as it was
    assert sparse_activation_mlp()(torch.randn(6, 12)).shape == (6, 3)  # unsplit, it computes
    with splitft.split(sparse_activation_mlp(), "2", factory="tests.models:sparse_activation_mlp",
                       connect=cloud) as model:
        with pytest.raises(ConfigError, match=r"sparse_coo tensor crosses the cut.*to_dense"):
            model.remote_loss(nn.CrossEntropyLoss())(model(torch.randn(6, 12)), torch.zeros(6, dtype=torch.long))
