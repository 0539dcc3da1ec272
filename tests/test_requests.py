"""The edge's request layer on its own: numbered requests, a lost reply, a resumed session. No autograd."""

from __future__ import annotations

import pytest

from splitft import Codecs, Factory, Faults
from splitft.cloud import CloudServer, serve_in_thread
from splitft.cut import parse_cut
from splitft.edge.api import hello_for
from splitft.edge.requests import EdgeSession
from splitft.wire.operations import AttachOptimizer, Step
from splitft.wire.protocol import Ack, Sync
from tests.faulty import FaultyConnection, message_type
from tests.models import mlp
from transports import InprocListener

MLP = "tests.models:mlp"


@pytest.fixture
def cloud():
    listener = InprocListener()
    server = CloudServer(listener, [MLP])
    thread = serve_in_thread(server)
    yield server, listener
    server.stop()
    thread.join(timeout=10)


def _open(listener, **faulty) -> EdgeSession:
    model = mlp()
    hello = hello_for(model, parse_cut(model, 2), Factory(MLP), Codecs())
    opener = lambda: FaultyConnection(listener.connect(), **faulty)  # noqa: E731
    session = EdgeSession(opener(), codecs=Codecs(), faults=Faults(timeout=1.0, heartbeat=0), reconnect=opener)
    session.open(hello)
    return session


def test_requests_are_numbered_and_a_lost_reply_is_answered_from_the_cloud_cache(cloud):
    server, listener = cloud
    lose: list[str] = []  # message types to drop once, on arrival

    def drop(frames) -> bool:
        if message_type(frames) in lose:
            lose.remove(message_type(frames))
            return False
        return True

    session = _open(listener, on_recv=drop)
    try:
        session.outbox.queue(AttachOptimizer(name="SGD", settings={"lr": 0.1}, id=1))
        session.outbox.queue(Step(id=1, lr=0.1))
        assert session.sync() is None and session._seq == 1
        recoveries = session.recoveries  # a slow first step in the cloud may already have cost one
        lose.append("ack")
        session.outbox.queue(Step(id=2, lr=0.1))
        seq = session.send(Sync(ops=session.outbox.take()), "control")
        reply, _ = session.await_reply(seq, Ack)
        assert isinstance(reply, Ack) and reply.seq == seq == 2 and lose == []
        assert session.recoveries == recoveries + 1
        (cloud_session,) = server.sessions.values()
        assert cloud_session.mirrored.steps == 2 and cloud_session.replies.duplicates >= 1  # applied once, answered again
        assert session.send(Sync(), "control") == 3  # numbering goes on
    finally:
        session.close()


def test_without_a_reconnect_function_a_lost_reply_is_an_error(cloud):
    _, listener = cloud
    # One second: the handshake must get through on a loaded machine; only the ack is lost.
    session = EdgeSession(FaultyConnection(listener.connect(), on_recv=lambda frames: message_type(frames) != "ack"),
                          codecs=Codecs(), faults=Faults(timeout=1.0, heartbeat=0))
    model = mlp()
    session.open(hello_for(model, parse_cut(model, 2), Factory(MLP), Codecs()))
    try:
        with pytest.raises(Exception, match="no reply from the cloud"):
            session.sync()
    finally:
        session.drop()
