"""Progressive freezing: edge layers freeze front to back by the gradient-norm rule, and once the
whole edge is frozen the run streams and is exactly a frozen-edge streaming run from there on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitft import split
from splitft.app.models import digits_cnn
from splitft.edge.freezing import ProgressiveFreezing, edge_layers
from splitft.edge.streaming import PendingTensor
from splitft.errors import ConfigError
from splitft.options import Schedule
from tests.conftest import DIGITS, start_cloud, stop

STEPS = 14


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, _ = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", DIGITS)
    yield address
    stop(proc)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(STEPS)]


def _train(model, batches, opt, after=None) -> list:
    criterion = model.remote_loss(nn.CrossEntropyLoss())
    losses = []
    for i, (x, y) in enumerate(batches):
        opt.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss)
        if after is not None:
            after(i)
    return losses


def test_layers_freeze_front_to_back_by_the_rule_then_the_run_is_a_frozen_streaming_one(cloud):
    torch.manual_seed(0)
    batches, snapshot = _batches(), {}
    with split(digits_cnn(), "block3", factory=DIGITS, connect=cloud, schedule=Schedule(window=4)) as model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))

        def after(i: int) -> None:  # the state a frozen-edge run would start from, once the step is done
            if freezing.frozen and not snapshot:
                snapshot.update(step=i + 1, edge=model.edge_state_dict(), cloud=model.cloud_state_dict())

        # threshold 10: every layer counts as converged as soon as it has two windows of norms (a change <= 10x)
        told: list[int] = []
        freezing = ProgressiveFreezing(model, opt, window=2, threshold=10.0, on_frozen=told.append)
        before = {n: p.detach().clone() for n, p in model.model.named_parameters() if not model.is_cloud(p)}
        losses = _train(model, batches, opt, after)
        final = model.cloud_state_dict()
        edge_after = {n: p.detach().clone() for n, p in model.model.named_parameters() if not model.is_cloud(p)}
    layers = freezing.record()["layers"]
    assert list(layers) == ["block1.0", "block1.1", "block2.0", "block2.1"]
    assert list(layers.values()) == [4, 5, 6, 7] and freezing.frozen_at == 7 == snapshot["step"] and told == [7]
    assert all(isinstance(loss, PendingTensor) for loss in losses[8:])  # streamed after the switch
    assert not any(isinstance(loss, PendingTensor) for loss in losses[:7])
    assert any(not torch.equal(before[n], edge_after[n]) for n in before)  # the edge did train first
    # a frozen-edge streaming run from the state at the switch, on the batches after it
    restarted = digits_cnn()
    restarted.load_state_dict({**snapshot["edge"], **snapshot["cloud"]})
    with split(restarted, "block3", factory=DIGITS, connect=cloud, schedule=Schedule(window=4),
               freeze_edge=True) as reference:
        opt = reference.attach(torch.optim.SGD(reference.parameters(), lr=0.05))
        _train(reference, batches[snapshot["step"]:], opt)
        expected = reference.cloud_state_dict()
        edge_expected = reference.edge_state_dict()
    assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in final)
    for name, value in edge_after.items():  # the edge's weights fixed since the switch, in both runs
        assert torch.equal(value, edge_expected[name]) and torch.equal(value, snapshot["edge"][name])


def test_a_layer_whose_gradient_norms_still_move_keeps_training(cloud):
    with split(digits_cnn(), "block3", factory=DIGITS, connect=cloud) as model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))
        freezing = ProgressiveFreezing(model, opt, window=2, threshold=1e-6)
        _train(model, _batches()[:8], opt)
    assert freezing.record() == {"frozen_at": None, "layers": dict.fromkeys(
        ["block1.0", "block1.1", "block2.0", "block2.1"])}
    assert all(len(layer.norms) == 8 and layer.norms[0] > 0 for layer in freezing.layers)


def test_layers_and_settings():
    names = [name for name, _ in edge_layers(
        [("bert.embeddings.word.weight", 1), ("bert.embeddings.norm.bias", 2), ("bert.encoder.layer.0.q.weight", 3),
         ("bert.encoder.layer.0.k.weight", 4), ("bert.encoder.layer.1.q.weight", 5)])]
    assert names == ["bert.embeddings", "bert.encoder.layer.0", "bert.encoder.layer.1"]
    chain = [name for name, _ in edge_layers([("embeddings.word.weight", 1), ("layer0.layer.q.weight", 2),
                                               ("layer0.layer.k.bias", 3), ("layer1.layer.q.weight", 4)])]
    assert chain == ["embeddings", "layer0", "layer1"]
    with pytest.raises(ConfigError, match="window"):
        ProgressiveFreezing(None, None, window=0)  # type: ignore[arg-type]


@pytest.mark.parametrize("rejoin", [None, "head"], ids=["plain", "ushape"])
def test_an_input_that_requires_a_gradient_is_refused_where_none_crosses_back(cloud, rejoin):
    """With ``freeze_edge`` no gradient crosses back from the cloud, so a saliency map's or FGSM's
    ``x.grad`` would stay None where the unsplit model computes it: refused at the forward; without
    the gradient asked for, the same model trains."""
    (x, y), = _batches()[:1]
    model = split(digits_cnn(), "block3", rejoin, factory=DIGITS, connect=cloud, freeze_edge=True)
    with model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        with pytest.raises(ConfigError, match=r"input of the model requires a gradient.*freeze_edge"):
            model(x.clone().requires_grad_())
        crit(model(x), y).backward()
        with torch.no_grad():
            model(x.clone().requires_grad_())  # no gradient asked for: nothing lost
