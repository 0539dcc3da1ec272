"""Faults: a repeated or retried request is applied once, a lost reply costs a retry, not a step.

Each test trains a small MLP split after its first layer and checks the final weights of both
halves against the same model trained in one process: a step applied twice or lost would show.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import splitft
from splitft import Faults, Schedule
from splitft.wire import protocol
from splitft.wire.operations import Step
from splitft.cloud import CloudServer, serve_in_thread
from splitft.cloud.limits import Limits
from tests.faulty import FaultyConnection, carries_step, message_type
from tests.models import mlp
from transports import InprocListener

MLP = "tests.models:mlp"
STEPS = 6


def _data(steps: int = STEPS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=g), torch.randint(0, 3, (16,), generator=g)) for _ in range(steps)]


def _train(model, opt, crit, data, accumulate: int = 1) -> None:
    for x, y in data:
        for part in torch.chunk(torch.arange(len(y)), accumulate):
            (crit(model(x[part]), y[part]) / accumulate).backward()
        opt.step()
        opt.zero_grad()


def local_weights(data, accumulate: int = 1) -> dict[str, torch.Tensor]:
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, nn.CrossEntropyLoss(), data, accumulate)
    return model.state_dict()


def split_weights(model: splitft.SplitModel, data, accumulate: int = 1) -> dict[str, torch.Tensor]:
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    _train(model, opt, model.remote_loss(nn.CrossEntropyLoss()), data, accumulate)
    return {**model.edge_state_dict(), **model.cloud_state_dict()}


def assert_same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m: f"{name}: {m}")


@pytest.fixture
def cloud():
    listener = InprocListener()
    server = CloudServer(listener, [MLP])
    thread = serve_in_thread(server)
    yield server, listener
    server.stop()
    thread.join(timeout=10)


def test_every_message_duplicated_is_applied_once(cloud):
    server, listener = cloud
    data = _data()
    model = splitft.split(mlp(), 2, factory=MLP, connect=lambda: FaultyConnection(
        listener.connect(), on_send=lambda frames: 2))
    with model:
        weights = split_weights(model, data, accumulate=2)
        (session,) = server.sessions.values()
        assert session.mirrored.steps == STEPS
        assert session.replies.last_seq >= 2 * STEPS  # at least the two forwards of every accumulated step
        # every request came twice and was applied once (the very last copy may still be in flight)
        assert session.replies.duplicates >= session.replies.last_seq - 1
    assert_same(weights, local_weights(data, accumulate=2))


def test_lost_replies_cost_a_retry_not_a_step(cloud):
    """The reply to every request that carries an optimizer step is lost once: the edge times out,
    reconnects, resumes the session and asks again; the cloud answers from its cache."""
    server, listener = cloud
    data = _data()
    dropped: set[int] = set()

    def lose_step_replies(frames) -> bool:
        reply = protocol.decode(frames)
        seq = getattr(reply, "seq", 0)
        if seq and seq in stepping and seq not in dropped:
            dropped.add(seq)
            return False
        return True

    stepping: set[int] = set()

    def note(frames) -> int:
        if carries_step(frames):
            stepping.add(protocol.decode([bytes(memoryview(f)) for f in frames]).seq)
        return 1

    model = splitft.split(mlp(), 2, factory=MLP, faults=Faults(timeout=0.25, heartbeat=0),
                          connect=lambda: FaultyConnection(listener.connect(), on_send=note, on_recv=lose_step_replies))
    with model:
        weights = split_weights(model, data)
        (session,) = server.sessions.values()
        # a loaded machine's slow reply may add a retry through the 0.25 s timeout: never a step
        assert session.mirrored.steps == STEPS and session.replies.duplicates >= len(dropped) >= STEPS - 1
        assert model.session.recoveries >= len(dropped)
    assert_same(weights, local_weights(data))


@pytest.mark.parametrize("eager", [False, True], ids=["backward-message", "eager-backward"])
def test_lost_requests_are_resent(cloud, eager):
    """Every third request never reaches the cloud; the edge notices the silence and re-sends."""
    server, listener = cloud
    data = _data()
    count = iter(range(10**6))

    def lose_every_third(frames) -> int:
        return 0 if message_type(frames) != "hello" and next(count) % 3 == 2 else 1

    model = splitft.split(mlp(), 2, factory=MLP, faults=Faults(timeout=0.25, heartbeat=0),
                          schedule=Schedule(eager_backward=eager),
                          connect=lambda: FaultyConnection(listener.connect(), on_send=lose_every_third))
    with model:
        weights = split_weights(model, data)
        # two requests a step (forward, backward), or one with eager backward; a third of them lost
        assert model.session.recoveries >= (STEPS if not eager else STEPS // 3)
    assert_same(weights, local_weights(data))


def test_a_repeated_step_id_is_skipped(cloud):
    server, listener = cloud
    model = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.5))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        x, y = _data(1)[0]
        crit(model(x), y).backward()
        opt.step()
        before = model.cloud_state_dict()
        model.session.outbox.queue(Step(id=1, lr=0.5))  # step 1 again, e.g. from a replay
        after = model.cloud_state_dict()
        assert_same(before, after)
        assert server.sessions[next(iter(server.sessions))].mirrored.steps == 1
        model.session.outbox.queue(Step(id=3, lr=0.5))  # step 2 never came
        with pytest.raises(splitft.errors.ProtocolError, match="step 3 arrived but this session is at step 1"):
            model.sync()


def test_raw_duplicate_request_gets_the_cached_reply(cloud):
    """At the wire: the same numbered request twice gives the same reply bytes, applied once."""
    server, listener = cloud
    model = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
    with model:
        model.attach(torch.optim.SGD(model.parameters(), lr=0.5))
        model.sync()
        conn = model.session.connection
        seq = model.session._seq + 1
        frames = protocol.encode(protocol.Sync(ops=[{"op": "zero_grad"}], want_state=True, seq=seq))
        conn.send(frames)
        first = [bytes(f) for f in conn.recv(5)]
        conn.send(frames)
        second = [bytes(f) for f in conn.recv(5)]
        assert first == second and protocol.decode(first).seq == seq
        (session,) = server.sessions.values()
        assert session.replies.last_seq == seq and session.replies.duplicates == 1
        model.session._seq = seq


def test_idle_sessions_expire_unless_the_edge_heartbeats():
    listener = InprocListener()
    server = CloudServer(listener, [MLP], limits=Limits(session_timeout=1.0))
    thread = serve_in_thread(server)
    try:
        quiet = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect, faults=Faults(heartbeat=0))
        alive = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect, faults=Faults(heartbeat=0.2))
        deadline = time.monotonic() + 10
        while quiet.session.session_id in server.by_id and time.monotonic() < deadline:
            time.sleep(0.1)
        assert quiet.session.session_id not in server.by_id, "a vanished edge's session was never freed"
        assert alive.session.session_id in server.by_id
        alive.sync()
        alive.close()
        quiet.session.drop()
    finally:
        server.stop()
        thread.join(timeout=10)


def test_an_expired_session_is_resumed_from_memory_or_refused_clearly():
    listener = InprocListener()
    server = CloudServer(listener, [MLP], limits=Limits(session_timeout=0.3))
    thread = serve_in_thread(server)
    try:
        model = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect,
                              faults=Faults(heartbeat=0, reconnect_timeout=2))
        model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        model.sync()
        time.sleep(1.8)  # expired, and no checkpoint folder: nothing to resume from
        with pytest.raises(splitft.HandshakeError, match="cannot resume session .* --checkpoint-dir"):
            model.sync()
        model.session.drop()
    finally:
        server.stop()
        thread.join(timeout=10)


@pytest.mark.parametrize("eager", [False, True], ids=["backward-message", "eager-backward"])
def test_lost_requests_among_micro_batches_in_flight(cloud, eager):
    """Several requests are in flight at once (3 micro-batches a call); every fourth never arrives.
    Recovery re-sends all that were lost, and each part's reply still reaches its own await."""
    server, listener = cloud
    data = _data()
    count = iter(range(10**6))

    def lose_every_fourth(frames) -> int:
        return 0 if message_type(frames) != "hello" and next(count) % 4 == 3 else 1

    model = splitft.split(mlp(), 2, factory=MLP, faults=Faults(timeout=0.25, heartbeat=0),
                          schedule=Schedule(micro_batches=3, eager_backward=eager),
                          connect=lambda: FaultyConnection(listener.connect(), on_send=lose_every_fourth))
    with model:
        weights = split_weights(model, data)
        assert model.session.recoveries >= 2
        (session,) = server.sessions.values()
        assert session.mirrored.steps == STEPS
    local = local_weights(data)
    assert set(weights) == set(local)
    for name in local:  # micro-batches sum the gradient in another order: rounding-level differences
        torch.testing.assert_close(weights[name], local[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
