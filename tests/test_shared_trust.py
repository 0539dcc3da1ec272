"""A shared cloud half against one hostile edge (real cloud processes, raw protocol).

A shared half is every edge's, so one edge must not be able to poison it (weights that overflow
the half's dtype, gradients scaled to Inf) or capture it (its optimizer or frozen set refusing
every later edge: those are the cloud's choice, ``--shared-optimizer`` / ``--shared-frozen``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import compressors
import transports
from splitft import protocol
from splitft.protocol import Backward, Forward, Sync, payload_to_wire
from tests.conftest import start_cloud, stop
from tests.test_faults import MLP
from tests.test_trust import _base_hello, hello

SGD = 'SGD:{"lr": 0.1}'


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
        assert reply.code == "protocol" and "NaN or Inf" in reply.message, reply
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
