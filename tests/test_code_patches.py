"""The code a cloud half runs is the cloud process's import of it: a script that patches a class or
a function the cloud's layers use, in its own process, is refused by name (at the handshake when
it patched before split(), at the next forward when after), never trained on silently. Scripts
written as users write them, against a real cloud process."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import splitft
from splitft.errors import ConfigError, HandshakeError
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


@contextlib.contextmanager
def patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` for a block, then back, as a script's monkeypatch does."""
    original = vars(owner)[name]
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


def _leaky(self: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return nn.functional.leaky_relu(x, 0.1)


def _step(model, opt, crit, x, y) -> None:
    opt.zero_grad()
    crit(model(x), y).backward()
    opt.step()


@pytest.mark.parametrize("patch", [
    (nn.ReLU, "forward", _leaky, r"ReLU\.forward was replaced after split\(\)"),
    (nn.functional, "relu", lambda x, inplace=False: nn.functional.leaky_relu(x, 0.1),
     r"torch\.nn\.functional\.relu was replaced after split\(\)"),
    (torch, "relu", lambda x: nn.functional.leaky_relu(x, 0.1), r"torch\.relu was replaced after split\(\)"),
], ids=["a layer class's forward", "a torch function a layer calls", "a torch function that one calls"])
def test_code_a_cloud_layer_runs_patched_after_split_is_refused_at_the_next_forward_and_put_back_trains_on(
        cloud, patch):
    owner, name, value, message = patch
    data = _data(4)
    local = mlp()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for x, y in data:
        _step(local, local_opt, nn.CrossEntropyLoss(), x, y)
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(nn.CrossEntropyLoss())
        _step(model, opt, crit, *data[0])
        with patched(owner, name, value), pytest.raises(ConfigError, match=message):
            _step(model, opt, crit, *data[1])  # nothing reached the cloud: refused before the forward
        for x, y in data[1:]:
            _step(model, opt, crit, x, y)
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_layer_class_patched_before_split_is_refused_at_the_handshake(cloud):
    with patched(nn.ReLU, "forward", _leaky):
        with pytest.raises(HandshakeError, match=r"the code its layers run patched in the edge's process"):
            splitft.split(mlp(), 2, factory=MLP, connect=cloud)
    splitft.split(mlp(), 2, factory=MLP, connect=cloud).close()  # unpatched: accepted


def test_a_forward_set_on_one_cloud_layer_before_split_is_refused_at_the_handshake(cloud):
    """``net[3].forward = ...`` on the layer itself, not its class: the cloud's layer has none."""
    net = mlp()
    net[3].forward = types.MethodType(_leaky, net[3])
    with pytest.raises(HandshakeError, match=r"the cloud's '3' differs from the edge's model"):
        splitft.split(net, 2, factory=MLP, connect=cloud)


def test_a_method_added_to_a_layer_class_over_its_bases_after_split_is_refused():
    """A subclass that defined no forward of its own gets one: the cloud's class has none."""
    from splitft.code_reads import CodeGuard

    class Rectifier(nn.ReLU):
        """A subclass that adds nothing until a script gives it a forward of its own."""

    guard = CodeGuard([("3", Rectifier())])
    guard.check()
    Rectifier.note = "set on the class, not code"
    guard.check()
    Rectifier.forward = _leaky
    with pytest.raises(ConfigError, match=r"Rectifier\.forward was added after split\(\)"):
        guard.check()
