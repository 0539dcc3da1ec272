"""A U-shape cut must account for every tensor the trunk reads: what crosses is the first trunk
module's arguments, and the cloud has nothing else the edge computed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitft.errors import CutError
from splitft.cut import parse_cut
from splitft.edge.ghosts import install, standin_of


def _identity_remote(x, *args, **kwargs):
    return x


class SharedGate(nn.Module):
    """The edge's forward writes a tensor into a dict that a trunk module reads: a side channel."""

    def __init__(self) -> None:
        super().__init__()
        self.context: dict[str, torch.Tensor] = {}
        self.stem = nn.Linear(4, 4)
        self.a = Gated(self.context)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        self.context["gate"] = torch.sigmoid(h.mean())
        return self.head(self.b(self.a(h)))


class Gated(nn.Module):
    def __init__(self, context: dict) -> None:
        super().__init__()
        self.context = context
        self.lin = nn.Linear(4, 4)
        self.scale = torch.tensor(0.5)  # a plain tensor attribute built with the model: the cloud has it too

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.context["gate"] if gate is None else gate
        return self.lin(x) * gate * self.scale


class PassedGate(SharedGate):
    """The same model, handing the gate over as an argument: accounted for."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        return self.head(self.b(self.a(h, torch.sigmoid(h.mean()))))


def test_a_trunk_reading_a_tensor_the_edge_set_aside_is_refused():
    model = SharedGate()
    install(model, parse_cut(model, "a", "head"), remote=_identity_remote)
    with pytest.raises(CutError, match=r"trunk a\.\.b reads tensors that do not cross the cut: \S*mul\(\) read "
                                       r"a float32 tensor of shape \(\)"):
        model(torch.ones(3, 4))


def test_a_trunk_fed_only_through_its_arguments_passes_the_check():
    model = PassedGate()
    install(model, parse_cut(model, "a", "b"), remote=_identity_remote)
    assert model(torch.ones(3, 4)).shape == (3, 2)


def test_a_trunk_that_cannot_run_as_a_chain_fails_the_check_with_the_reason():
    model = PassedGate()  # b does not take the gate that a gets, but the cloud would pass it
    install(model, parse_cut(model, "a", "head"), remote=_identity_remote)
    with pytest.raises(CutError, match=r"run as the cloud runs it .* fails: TypeError"):
        model(torch.ones(3, 4))


def test_the_check_can_be_skipped():
    model = SharedGate()
    install(model, parse_cut(model, "a", "head"), remote=_identity_remote, check=False)
    assert model(torch.ones(3, 4)).shape == (3, 2)


class TwoMasks(nn.Module):
    """Later trunk modules get other extra arguments than the first: the cloud cannot know them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Masked() for _ in range(3))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.layers[0](x, mask)
        x = self.layers[1](x, mask, scale=2.0)
        return self.layers[2](x, 1 - mask)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return self.lin(x) * mask * scale


@pytest.mark.parametrize("cut, differs", [("layers.1:3", "argument 2 differs"),
                                          ("layers.0:2", r"keyword arguments \['scale'\] instead of \[\]")])
def test_later_trunk_modules_with_other_arguments_are_refused(cut, differs):
    model = TwoMasks()
    install(model, parse_cut(model, cut), remote=_identity_remote, check=False)
    with pytest.raises(CutError,
                       match=rf"other arguments than the first trunk module .*\({differs}, or changed in place since\)"):
        model(torch.ones(2, 4), torch.ones(2, 4))


def test_the_check_leaves_running_statistics_and_the_rng_alone():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 2))
    install(model, parse_cut(model, "1:3"), remote=_identity_remote)
    bn = standin_of(model[1])._probe[0].stages[0]
    assert isinstance(bn, nn.BatchNorm1d)
    x = torch.randn(8, 4)
    rng = torch.get_rng_state()
    model(x)
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(bn.running_mean, torch.zeros(4)) and int(bn.num_batches_tracked) == 0
