"""Both ends must agree before any training: each mismatch is refused with a typed error."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest
import torch
from torch import nn

import compressors
import splitft
from splitft.wire.coding import resolve_codecs
from splitft import Factory
from splitft.wire import protocol
from splitft.wire.operations import AttachOptimizer, Operation
from splitft.errors import ConfigError, HandshakeError, ProtocolError
from splitft.app.models import digits_cnn
from tests.conftest import DIGITS


def test_factory_not_served(inproc_cloud):
    with pytest.raises(HandshakeError, match="not served here"):
        splitft.split(digits_cnn(), "block3", factory="splitft.app.models:other", connect=inproc_cloud.connect())


def test_architecture_mismatch_names_the_fingerprints(inproc_cloud):
    model = digits_cnn()
    model.head[1] = nn.Linear(1024, 7)  # the edge's idea of the cloud part differs
    with pytest.raises(HandshakeError, match="fingerprint"):
        splitft.split(model, "block3", factory=DIGITS, connect=inproc_cloud.connect())


def test_initial_weights_mismatch_in_factory_mode(inproc_cloud):
    with pytest.raises(HandshakeError, match="initial weights differ"):
        splitft.split(digits_cnn(seed=1), "block3", factory=Factory(DIGITS, weights="factory"),
                      connect=inproc_cloud.connect())
    model = splitft.split(digits_cnn(seed=0), "block3", factory=Factory(DIGITS, weights="factory"),
                          connect=inproc_cloud.connect())
    model.close()


def test_unknown_codec_lists_valid_names_before_connecting():
    with pytest.raises(ConfigError, match="valid names: .*fp16.*identity"):
        splitft.split(digits_cnn(), "block3", factory=DIGITS, connect="tcp://127.0.0.1:1", codecs="zip")
    with pytest.raises(compressors.UnknownCodecError, match="valid names"):
        compressors.make_codec("nope")


def _raw_exchange(cloud, message) -> protocol.Message:
    conn = cloud.connect()
    try:
        conn.send(protocol.encode(message))
        return protocol.decode(conn.recv(timeout=10))
    finally:
        conn.close()


def _hello(**changes) -> protocol.Hello:
    model = digits_cnn()
    from splitft.cut import extract, fingerprint, parse_cut

    fields = dict(protocol=protocol.PROTOCOL_VERSION, factory=DIGITS, cut="block3", rejoin=None,
                  fingerprint=fingerprint(extract(model, parse_cut(model, "block3"))),
                  codecs=resolve_codecs(), seed=0)
    fields.update(changes)
    return protocol.Hello(**fields)


def test_protocol_version_mismatch(inproc_cloud):
    reply = _raw_exchange(inproc_cloud, _hello(protocol=99))
    assert isinstance(reply, protocol.Error) and reply.code == "handshake" and "protocol 99" in reply.message


def test_codec_the_cloud_cannot_run(inproc_cloud):
    codecs = resolve_codecs() | {"fwd": "quantum"}
    reply = _raw_exchange(inproc_cloud, _hello(codecs=codecs))
    assert isinstance(reply, protocol.Error) and reply.code == "handshake" and "quantum" in reply.message


def test_messages_before_hello_are_refused(inproc_cloud):
    reply = _raw_exchange(inproc_cloud, protocol.Sync())
    # "session": the edge runtime answers it by resuming, so it has a code of its own
    assert isinstance(reply, protocol.Error) and reply.code == "session" and "hello first" in reply.message


def test_a_good_hello_after_errors_still_works(inproc_cloud):
    _raw_exchange(inproc_cloud, _hello(protocol=99))
    assert isinstance(_raw_exchange(inproc_cloud, _hello()), protocol.Welcome)


@dataclass
class _SelfDestruct(Operation):
    """An operation this cloud does not know (an edge of a newer version, or a hostile one)."""

    NAME: ClassVar[str] = "self_destruct"


def test_remote_errors_arrive_typed_on_the_edge(inproc_cloud):
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=inproc_cloud.connect())
    with model:
        model.session.outbox.queue(_SelfDestruct())
        with pytest.raises(ProtocolError, match="unknown operation"):
            model.sync()
        model.session.outbox.queue(AttachOptimizer(name="NotAnOptimizer"))
        with pytest.raises(ConfigError, match="not a torch.optim optimizer"):
            model.sync()
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        assert model.cloud_state_dict()  # the session survived both errors
        del opt
