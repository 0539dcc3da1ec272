"""A live session moved between two independent `splitft cloud` processes (no shared folder).

The edge trains on cloud A, moves to cloud B mid-training (``model.move_to``), trains on: its
weights, both halves, equal bitwise those of a run that never moved (same arithmetic, same order).
Cloud B takes the state only with the session's token and an untouched MAC, and within its size
bound; a cloud that refuses it leaves the session where it was, training on.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import splitft
import transports
from splitft import Faults
from splitft.edge.move import _resume_hello
from splitft.errors import CapacityError
from splitft.wire import protocol
from splitft.wire.protocol import Arrive, Error, Handoff, Leave, Welcome
from tests.conftest import start_cloud, stop
from tests.faulty import FaultyConnection, message_type
from tests.models import mlp

MLP = "tests.models:mlp"
STEPS, MOVE_AT = 8, 4


@pytest.fixture(scope="module")
def clouds(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("moves")
    started = [start_cloud(tmp, "--sessions", "0", "--model", MLP, *extra)
               for extra in ((), (), ("--max-move-mb", "0.001"))]
    yield [(address, err) for _, address, err in started]
    for proc, _, _ in started:
        stop(proc)


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(STEPS)]


def _train(address: str, move_to: str | None = None, codecs: str = "identity",
           lose_handoff: bool = False) -> tuple[dict, dict, str | None]:
    model = splitft.split(mlp(), 2, factory=MLP, connect=address, codecs=codecs,
                          faults=Faults(timeout=3 if lose_handoff else 30))
    if lose_handoff:  # the first handoff never reaches the edge; a new link (the session's reconnect) is clean
        lost = []
        model.session.connection = FaultyConnection(
            model.session.connection, on_recv=lambda frames: lost or message_type(frames) != "handoff"
            or lost.append(1))
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    try:
        for step, (x, y) in enumerate(_batches(), 1):
            ids = torch.arange(16) + 16 * (step % 2)  # each sample seen again two steps later
            crit(model(x, sample_ids=ids), y).backward()
            opt.step()
            opt.zero_grad()
            if step == MOVE_AT and move_to is not None:
                model.move_to(move_to)
        return model.edge_state_dict(), model.cloud_state_dict(), model.session.session_id
    finally:
        model.close()


def _moved_here(err, session: str | None) -> bool:
    deadline = time.monotonic() + 10
    while f"session {session} moved here" not in err.text and time.monotonic() < deadline:
        time.sleep(0.05)
    return f"session {session} moved here" in err.text


def _equal(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


# AC-SGD keeps each sample's last activation on both ends: the cloud's copy must travel with the session
@pytest.mark.parametrize("codecs", ["identity", "acsgd:bits=4"])
def test_a_session_moved_mid_training_ends_with_the_weights_of_one_that_never_moved(clouds, codecs):
    (a, a_log), (b, b_log), _ = clouds
    edge, cloud, _ = _train(a, codecs=codecs)
    moved_edge, moved_cloud, sid = _train(a, move_to=b, codecs=codecs)
    assert _moved_here(b_log, sid) and f"ended after {MOVE_AT} steps: moved to another cloud" in a_log.text
    _equal(moved_edge, edge)
    _equal(moved_cloud, cloud)  # weights, and Adam's moments and step count, travelled


def test_a_handoff_lost_on_the_way_is_asked_for_again_and_nothing_is_lost(clouds):
    (a, a_log), (b, b_log), _ = clouds
    edge, cloud, _ = _train(a)
    moved_edge, moved_cloud, sid = _train(a, move_to=b, lose_handoff=True)
    assert _moved_here(b_log, sid) and f"session {sid} ended after {MOVE_AT} steps: moved to another cloud" in a_log.text
    _equal(moved_edge, edge)
    _equal(moved_cloud, cloud)


def test_a_session_comes_back_to_a_cloud_that_never_heard_its_goodbye(clouds):
    (a, a_log), (b, _), _ = clouds
    edge, cloud, _ = _train(a)
    model = splitft.split(mlp(), 2, factory=MLP, connect=a, faults=Faults(timeout=30))
    # the goodbye to A after the move is lost: A still holds the session when it comes back
    model.session.connection = FaultyConnection(model.session.connection,
                                                on_send=lambda frames: 0 if message_type(frames) == "bye" else 1)
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    try:
        for step, (x, y) in enumerate(_batches(), 1):
            ids = torch.arange(16) + 16 * (step % 2)
            crit(model(x, sample_ids=ids), y).backward()
            opt.step()
            opt.zero_grad()
            if step in (MOVE_AT, MOVE_AT + 2):
                model.move_to(b if step == MOVE_AT else a)
        _equal(model.edge_state_dict(), edge)
        _equal(model.cloud_state_dict(), cloud)
    finally:
        model.close()
    assert f"session {model.session.session_id} ended after {MOVE_AT} steps: it moved away and came back" in a_log.text


def test_a_cloud_that_refuses_the_state_leaves_the_session_where_it_was(clouds):
    (a, _), _, (small, _) = clouds
    edge, cloud, _ = _train(a)
    with pytest.raises(CapacityError, match="--max-move-mb"):
        _train(a, move_to=small)
    # the session stayed on A; a run that carries on after the refusal still matches
    model = splitft.split(mlp(), 2, factory=MLP, connect=a, faults=Faults(timeout=30))
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    try:
        for step, (x, y) in enumerate(_batches(), 1):
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            if step == MOVE_AT:
                with pytest.raises(CapacityError):
                    model.move_to(small)
        _equal(model.edge_state_dict(), edge)
        _equal(model.cloud_state_dict(), cloud)
    finally:
        model.close()


def _ask(address: str, msg: protocol.Message) -> protocol.Message:
    connection = transports.connect(address)
    try:
        connection.send(protocol.encode(msg))
        return protocol.decode(connection.recv(20))
    finally:
        connection.close()


def test_the_state_is_taken_only_with_its_token_and_untouched(clouds):
    (a, _), (b, _), _ = clouds
    model = splitft.split(mlp(), 2, factory=MLP, connect=a, faults=Faults(timeout=30))
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    x, y = _batches()[0]
    model.remote_loss(nn.CrossEntropyLoss())(model(x), y).backward()
    opt.step()
    session = model.session
    with session.lock:
        session.sync()
        handoff, _ = session.exchange(Leave(), "control", Handoff)
        hello = vars(_resume_hello(session, model.stage.step))
    state = handoff.state
    name = next(k for k, v in state["tensors"].items() if v.ndim == 2)  # one weight matrix, changed
    tampered = {**state, "tensors": {**state["tensors"], name: state["tensors"][name] * 2}}
    wrong_token = {**hello, "resume": {**hello["resume"], "token": "0" * 32}}
    for bad in (Arrive(hello=hello, state=tampered), Arrive(hello=wrong_token, state=state)):
        reply = _ask(b, bad)
        assert isinstance(reply, Error) and reply.code == "resume", reply
    malformed = {**state, "tensors": {**state["tensors"], name: [1.0, 2.0]}}  # a list where an array belongs
    for bad in (Arrive(hello=hello, state=malformed), Arrive(hello={**hello, "cut": 7}, state=state)):
        reply = _ask(b, bad)
        assert isinstance(reply, Error) and reply.code == "protocol", reply
    reply = _ask(b, Arrive(hello=hello, state=state))
    assert isinstance(reply, Welcome) and reply.session == session.session_id and reply.steps == 1
    session.drop()
