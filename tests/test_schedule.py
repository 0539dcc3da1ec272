"""The schedule of remote calls, with a stage that records what it is asked (no sockets, no codecs)."""

from __future__ import annotations

import threading
from contextlib import nullcontext

import pytest
import torch

from splitft import Schedule

from splitft.wire import tree
from splitft.wire.coding import Coded
from splitft.wire.operations import ApplyEager, Step, ZeroGrad
from splitft.edge.schedule import Call, Scheduler


class Recorder:
    """A stage whose cloud part doubles its input (or, with a target, returns the mean as a loss)."""

    def __init__(self, eager: bool = False) -> None:
        self.events: list[tuple] = []
        self.eager = eager

    def check(self, call):
        pass

    def can_eager(self):
        return True

    def send_forward(self, call, part, leaves, ops):
        self.events.append(("forward", part.id, leaves[0].shape[0], list(ops)))

    def receive_output(self, call, part, leaves):
        self.events.append(("output", part.id))
        out = leaves[0].mean() if call.has_target else leaves[0] * 2
        part.received = [Coded(None, True, tuple(out.shape), out.dtype)]
        part.out_grad = [call.grad]
        if call.eager:
            part.eager_grads = ([], [])
        return [out]

    def send_backward(self, call, part, grads, ops, params=True):
        self.events.append(("backward", part.id, grads[0].shape[0], list(ops)))
        part.grad = grads[0]

    def receive_input_grads(self, call, part):
        self.events.append(("input_grads", part.id))
        return [part.grad * 2]

    def borrowing(self):
        return nullcontext()

    def eager_input_grads(self, call, part, scale):
        self.events.append(("eager", part.id, float(scale)))
        rows = part.rows.stop - part.rows.start
        return [torch.full((rows, 2), float(scale)) if g else None for g in call.in_grad]


class Ops:
    def __init__(self) -> None:
        self.pending: list = []
        self.weights_version = 0

    def queue(self, op):
        self.pending.append(op)

    def take(self):
        ops, self.pending = self.pending, []
        return ops

    def requeue(self, ops):
        self.pending[:0] = ops


def _call(x: torch.Tensor, target=None, grad: bool = True) -> Call:
    leaves, skeleton = tree.flatten(([x], {}, target))
    return Call(skeleton, len(leaves), train=True, grad=grad, sample_ids=None)


def _scheduler(stage, ops, micro_batches: int, eager: bool = True) -> Scheduler:
    return Scheduler(stage, ops, threading.RLock(), Schedule(micro_batches, eager), ushape=False)


def test_every_part_is_sent_before_any_reply_is_awaited_and_ops_ride_once():
    stage, ops = Recorder(), Ops()
    ops.queue(Step(id=1))
    x = torch.arange(14.0).reshape(7, 2)
    call = _call(x)
    (out,) = _scheduler(stage, ops, 3).forward(call, [x], [True])
    torch.testing.assert_close(out, x * 2)
    assert [e[0] for e in stage.events] == ["forward"] * 3 + ["output"] * 3
    assert [e[2] for e in stage.events[:3]] == [2, 2, 3]  # uneven parts, in row order
    assert [e[3] for e in stage.events[:3]] == [[Step(id=1)], [], []]

    stage.events.clear()
    ops.queue(ZeroGrad(set_to_none=True))
    (grad,) = _scheduler(stage, ops, 3).backward(call, (torch.ones(7, 2),))
    assert [e[0] for e in stage.events] == ["backward"] * 3 + ["input_grads"] * 3
    assert [e[3] for e in stage.events[:3]] == [[ZeroGrad(set_to_none=True)], [], []]
    torch.testing.assert_close(grad, torch.full((7, 2), 2.0))
    assert ops.pending == []


def test_a_loss_from_micro_batches_is_the_batch_mean_and_its_gradient_is_shared_by_size():
    stage, ops = Recorder(eager=True), Ops()
    x = torch.arange(10.0).reshape(5, 2)
    call = _call(x, target=torch.zeros(5))
    scheduler = _scheduler(stage, ops, 2)
    (loss,) = scheduler.forward(call, [x, torch.zeros(5)], [True, False])
    torch.testing.assert_close(loss, x.mean())
    assert call.eager and call.out_join == ["mean"]

    stage.events.clear()
    ops.queue(Step(id=2))
    (grad, target_grad) = scheduler.backward(call, (torch.tensor(3.0),))
    # eager: nothing is sent; each part's share of the incoming gradient scales what came back
    assert [e[0] for e in stage.events] == ["eager", "eager"]
    assert [e[2] for e in stage.events] == pytest.approx([3.0 * 2 / 5, 3.0 * 3 / 5])
    assert ops.pending[0] == Step(id=2)  # kept for the next message, ahead of the applies
    assert [type(op) for op in ops.pending[1:]] == [ApplyEager, ApplyEager]
    assert sum(op.scale for op in ops.pending[1:]) == pytest.approx(3.0)
    assert target_grad is None
    torch.testing.assert_close(grad, torch.tensor([1.2] * 2 + [1.8] * 3).unsqueeze(1).expand(5, 2))


def test_no_eager_backward_when_the_schedule_turns_it_off_or_nothing_needs_a_gradient():
    x = torch.ones(4, 2)
    off = _call(x, target=torch.zeros(4))
    _scheduler(Recorder(), Ops(), 1, eager=False).forward(off, [x, torch.zeros(4)], [True, False])
    evaluation = _call(x, target=torch.zeros(4), grad=False)
    _scheduler(Recorder(), Ops(), 1).forward(evaluation, [x, torch.zeros(4)], [False, False])
    assert not off.eager and not evaluation.eager
