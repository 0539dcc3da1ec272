"""A shared cloud half against one hostile edge (real cloud processes, raw protocol).

A shared half is every edge's, so one edge must not be able to poison it (weights that overflow
the half's dtype, gradients scaled to Inf), capture it (its optimizer or frozen set refusing
every later edge: those are the cloud's choice, ``--shared-optimizer`` / ``--shared-frozen``) or
park requests outside the memory budget while it waits for a round.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

import compressors
import transports
from splitft.wire import protocol
from splitft.wire.protocol import Backward, Forward, Sync, payload_to_wire
from tests.conftest import start_cloud, stop
from tests.test_faults import MLP
from tests.test_trust import _base_hello, hello

MiB = 1 << 20
SGD = 'SGD:{"lr": 0.1}'


def _memory(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    return 0


def _tensor(rows: int, cols: int, grad: bool = False, value: float | None = None) -> dict:
    array = torch.randn(rows, cols) if value is None else torch.full((rows, cols), value)
    return payload_to_wire(compressors.make_codec("identity").encode(array, compressors.CodecContext()), grad)


class Edge:
    """A raw connection that speaks the protocol request by request."""

    def __init__(self, address: str, **changes) -> None:
        self.conn = transports.connect(address)
        self.seq = 0
        welcome = self.ask(hello(**changes))
        assert welcome.TYPE == "welcome", welcome

    def ask(self, msg, timeout: float = 30.0) -> protocol.Message:
        if getattr(msg, "seq", None) == -1:
            self.seq += 1
            msg.seq = self.seq
        self.conn.send(protocol.encode(msg))
        return protocol.decode(self.conn.recv(timeout))

    def sync(self, *ops) -> protocol.Message:
        return self.ask(Sync(ops=list(ops), seq=-1))

    def state(self) -> dict[str, np.ndarray]:
        reply = self.ask(Sync(want_state=True, seq=-1))
        assert reply.TYPE == "ack", reply
        return reply.state

    def gradient(self, call: int, grad_value: float | None = None) -> None:
        """A forward with a graph and its backward: the session holds a gradient."""
        reply = self.ask(Forward(call=call, train=True, grad=True, args=[_tensor(4, 16, grad=True)], kwargs={},
                                 seq=-1))
        assert reply.TYPE == "output", reply
        reply = self.ask(Backward(call=call, grads=[_tensor(4, 3, value=grad_value)], seq=-1))
        assert reply.TYPE == "input_grads", reply

    def close(self) -> None:
        self.conn.close()


def _finite(state: dict[str, np.ndarray]) -> bool:
    return all(np.isfinite(v).all() for v in state.values())


ATTACH = {"op": "optimizer", "name": "SGD", "settings": {"lr": 0.1}, "id": 1}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("shared"), "--sessions", "0", "--model", MLP,
                                     "--shared-model", "--shared-optimizer", SGD, "--handshake-timeout", "60")
    yield proc, address, err
    stop(proc)


# ---------------------------------------------------------------- poisoning


def test_weights_that_overflow_the_halfs_dtype_never_reach_it(shared, tmp_path):
    proc, address, err = shared
    huge = {k: np.full_like(v, 1e300, dtype=np.float64) for k, v in _base_hello().weights.items()}
    edge = Edge(address)
    try:
        reply = edge.sync({"op": "load_weights", "weights": huge})
        assert reply.code == "policy" and "shared" in reply.message, reply  # one edge may not replace them
        assert _finite(edge.state())
    finally:
        edge.close()
    own, own_address, own_err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP)
    try:  # an own half may load weights, each checked in the dtype it will have
        edge = Edge(own_address)
        before = edge.state()
        reply = edge.sync({"op": "load_weights", "weights": huge})
        assert reply.code == "protocol" and "too large for the half's dtype" in reply.message, reply
        after = edge.state()
        assert all(np.array_equal(before[k], after[k]) for k in before)  # nothing was loaded
        edge.close()
    finally:
        stop(own)


def test_gradients_scaled_or_grown_to_inf_never_step_the_shared_half(shared):
    proc, address, err = shared
    edge = Edge(address)
    try:
        assert edge.sync(ATTACH).TYPE == "ack"
        edge.gradient(1)
        scale = {"op": "scale_grads", "factor": 1e308}
        reply = edge.sync(scale, scale, {"op": "step", "id": 1, "lr": 0.1})
        assert reply.code == "policy" and "scaled down" in reply.message, reply
        edge.sync({"op": "zero_grad", "model": True})
        edge.gradient(2, grad_value=3e38)  # finite on the wire, Inf once summed into the weights' gradient
        reply = edge.sync({"op": "step", "id": 1, "lr": 0.1})
        assert reply.code == "protocol" and "NaN or Inf" in reply.message, reply
        assert _finite(edge.state())
    finally:
        edge.close()
    assert proc.poll() is None, err.text


# ---------------------------------------------------------------- capture


def test_the_first_edge_cannot_choose_the_optimizer_or_frozen_set_of_later_edges(shared):
    proc, address, err = shared
    first, second = Edge(address), Edge(address)
    try:
        reply = first.sync({"op": "optimizer", "name": "Adam", "settings": {"lr": 1e-9}, "id": 1})
        assert reply.code == "policy" and "--shared-optimizer" in reply.message, reply
        reply = first.sync({"op": "frozen", "names": ["2.weight", "2.bias", "4.weight", "4.bias"]})
        assert reply.code == "policy" and "--shared-frozen" in reply.message, reply
        assert first.sync({**ATTACH, "settings": {"lr": 0.01}}).TYPE == "ack"  # a lower rate is fine
        reply = first.sync({"op": "step", "id": 1, "lr": 10.0})
        assert reply.code == "policy" and "at most 0.1" in reply.message, reply
        reply = first.sync({"op": "add_param_group", "index": 1, "names": [], "settings": {"lr": 10.0}})
        assert reply.code == "policy" and "--shared-optimizer" in reply.message, reply
        # The second edge, while the first is still there, attaches the cloud's optimizer and steps.
        assert second.sync(ATTACH).TYPE == "ack"
        second.gradient(1)
        assert second.sync({"op": "step", "id": 1, "lr": 0.1}).TYPE == "ack"
        assert _finite(second.state())
    finally:
        first.close()
        second.close()


def test_the_frozen_set_is_the_clouds(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--shared-model",
                                     "--shared-optimizer", SGD, "--shared-frozen", "2.weight,2.bias")
    try:
        edge = Edge(address)
        assert edge.sync({"op": "frozen", "names": ["2.bias", "2.weight"]}).TYPE == "ack"
        assert edge.sync({"op": "frozen", "names": []}).code == "policy"
        assert edge.sync(ATTACH).TYPE == "ack"
        before = edge.state()
        edge.gradient(1)
        assert edge.sync({"op": "step", "id": 1, "lr": 0.1}).TYPE == "ack"
        after = edge.state()
        assert np.array_equal(before["2.weight"], after["2.weight"])  # frozen by the cloud
        assert not np.array_equal(before["4.weight"], after["4.weight"])
        edge.close()
    finally:
        stop(proc)


# ---------------------------------------------------------------- parked requests


def test_requests_parked_for_a_round_count_against_the_memory_budget(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--shared-model",
                                     "--shared-optimizer", SGD, "--sync-rounds", "2", "--round-timeout", "60",
                                     "--memory-mb", "128", "--session-memory-mb", "96", "--max-message-mb", "64")
    edge = Edge(address)
    try:
        assert edge.sync(ATTACH).TYPE == "ack"
        edge.gradient(1)
        assert edge.sync({"op": "step", "id": 1, "lr": 0.1}).TYPE == "ack"  # in the round: what follows waits
        before = _memory(proc.pid, "VmHWM")
        big = Forward(call=99, train=False, grad=False, args=[_tensor(MiB // 4, 16)], kwargs={})  # 16 MiB
        frames = protocol.encode(big)
        refused, wanted = 0, 24 - 96 // 16

        def reply_within(timeout: float) -> bool:
            nonlocal refused
            try:
                reply = protocol.decode(edge.conn.recv(timeout))
            except transports.TransportTimeout:
                return False
            assert reply.code == "capacity" and "round" in reply.message, reply
            refused += 1
            return True

        for _ in range(24):  # 384 MiB, three times the cloud's budget; one at a time, so that what
            edge.conn.send(frames)  # ZeroMQ buffers before the cloud reads is not what is measured
            reply_within(0.5)  # a refusal comes at once; a kept request is answered when its round closes
        deadline = time.monotonic() + 10
        while refused < wanted and reply_within(max(0.1, deadline - time.monotonic())):
            pass
        assert refused >= wanted, f"{refused} of 24 requests refused; the others wait outside the budget"
        assert _memory(proc.pid, "VmHWM") - before < (128 + 64) * MiB
        assert proc.poll() is None, err.text
    finally:
        edge.close()
        stop(proc)


@pytest.mark.parametrize("args, says", [
    (["--shared-optimizer", SGD], "add --shared-model"),
    (["--shared-model", "--shared-optimizer", "SGD:{lr: 1}"], "must be a JSON object"),
    (["--shared-model", "--shared-optimizer", "Nope"], "not a torch.optim optimizer"),
    (["--shared-model", "--shared-optimizer", 'SGD:{"lr": 0.1, "bogus": 1}'], "cannot build SGD"),
])
def test_the_cloud_command_refuses_a_shared_policy_it_cannot_apply(args, says, capsys):
    from splitft.app.cli import main

    assert main(["cloud", "--bind", "tcp://127.0.0.1:0", "--model", MLP, *args]) == 2
    assert says in capsys.readouterr().err
