"""Ctrl-C while the edge waits for the cloud: a script that catches KeyboardInterrupt, clears its
gradients and runs the batch again trains as the unsplit model interrupted at the same place (a
real cloud process; the interrupt is raised where a real Ctrl-C lands, in the wait for a reply)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import splitft
from tests.conftest import start_cloud, stop
from tests.models import mlp, mlp_dropout
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, _ = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", "tests.models:mlp",
                                   "--model", "tests.models:mlp_dropout")
    yield address
    stop(proc)


def _interrupt_the_next_wait() -> None:
    """Raise KeyboardInterrupt at the next wait for a reply, as Ctrl-C does."""
    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if event == "call" and frame.f_code.co_name == "_recv_frames":
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(tracer)


def _train(model: nn.Module, crit: Callable, interrupt: Callable[[], None], at: str) -> list[Any]:
    """Six batches; at the third, Ctrl-C before the loss (``at="loss"``) or the backward is
    interrupted; the loop clears the gradients and runs the batch again."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data, done, losses, i = _data(5), False, [], 0
    while i < len(data):
        x, y = data[i]
        try:
            if i == 2 and not done and at == "loss":
                done = True
                interrupt()
            loss = crit(model(x), y)
            if i == 2 and not done and at == "backward":
                done = True
                interrupt()
            loss.backward()
            sys.settrace(None)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        except KeyboardInterrupt:
            sys.settrace(None)
            opt.zero_grad()
            losses.append("interrupted")
            continue
        i += 1
    return losses


def _raise() -> None:
    raise KeyboardInterrupt


def test_ctrl_c_in_the_wait_for_the_trunks_backward_then_zero_grad_is_no_step(cloud):
    local = mlp()
    expected = _train(local, nn.CrossEntropyLoss(), _raise, "backward")
    with splitft.split(mlp(), "1", "4", factory="tests.models:mlp", connect=cloud) as model:
        assert _train(model, nn.CrossEntropyLoss(), _interrupt_the_next_wait, "backward") == expected
        assert_bitwise(model.state_dict(), local.state_dict())


def test_ctrl_c_in_the_wait_for_a_remote_loss_lands_after_the_cloud_half_drew(cloud):
    """Unsplit, the interrupt after the loss comes after the cloud half's dropout drew; the edge
    reads the reply (the generator's state after those draws) before it stops."""
    torch.manual_seed(3)
    local = mlp_dropout()

    def after_the_loss(crit: Callable) -> Callable:
        state = {"armed": False}

        def interrupted(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            loss = crit(out, y)
            if state["armed"]:
                state["armed"] = False
                raise KeyboardInterrupt
            return loss

        def arm() -> None:
            state["armed"] = True

        return interrupted, arm

    crit, arm = after_the_loss(nn.CrossEntropyLoss())
    expected = _train(local, crit, arm, "loss")
    expected_rng = torch.get_rng_state()
    torch.manual_seed(3)
    with splitft.split(mlp_dropout(), "2", factory="tests.models:mlp_dropout", connect=cloud) as model:
        assert _train(model, model.remote_loss(nn.CrossEntropyLoss()), _interrupt_the_next_wait, "loss") == expected
        assert torch.equal(torch.get_rng_state(), expected_rng)
        assert_bitwise(model.state_dict(), local.state_dict())
