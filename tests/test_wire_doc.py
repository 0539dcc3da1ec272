"""docs/wire.md is the protocol's contract: its byte-exact examples decode to what it says and
re-encode to the same bytes, a changed byte never decodes silently into the same message, and a
peer of another protocol version gets a typed error naming both versions."""

from __future__ import annotations

import random
import re
from pathlib import Path

import msgpack
import numpy as np
import pytest

import transports
from splitft.wire import protocol
from splitft.cloud import CloudServer, serve_in_thread
from splitft.errors import ProtocolError

DOC = Path(__file__).resolve().parent.parent / "docs" / "wire.md"
BLOCK = re.compile(r"```hex (\w+) frame (\d+)\n(.*?)```", re.S)


def examples() -> dict[str, list[bytes]]:
    found: dict[str, dict[int, bytes]] = {}
    for name, index, text in BLOCK.findall(DOC.read_text(encoding="utf-8")):
        found.setdefault(name, {})[int(index)] = bytes.fromhex("".join(text.split()))
    return {name: [frames[i] for i in sorted(frames)] for name, frames in found.items()}


EXAMPLES = examples()


def _decode(frames: list[bytes]) -> protocol.Message:
    return protocol.decode([memoryview(bytearray(f)) for f in frames])


def test_the_doc_has_the_promised_examples():
    assert set(EXAMPLES) == {"hello", "forward", "error", "ping", "redirect"}
    assert len(EXAMPLES["forward"]) == 2


def test_examples_decode_to_what_the_doc_says():
    hello = _decode(EXAMPLES["hello"])
    assert isinstance(hello, protocol.Hello) and hello.protocol == protocol.PROTOCOL_VERSION == 20
    assert (hello.factory, hello.cut, hello.seed, hello.nonce) == ("pkg.models:net", "2", 0, "0123456789abcdef")
    assert set(hello.codecs) == {"fwd", "bwd", "ret", "ret_bwd"}
    forward = _decode(EXAMPLES["forward"])
    assert isinstance(forward, protocol.Forward) and forward.NUMBERED
    assert (forward.seq, forward.call, forward.train, forward.grad) == (2, 1, True, True)
    assert forward.ops == [{"op": "step", "id": 1, "lr": 0.01}]
    codec, version, meta, arrays, grad = forward.args[0]["$t"]
    assert (codec, version, meta, grad) == ("identity", 1, {}, True)
    np.testing.assert_array_equal(arrays["x"], np.array([[1, 2], [3, 4]], dtype=np.float32))
    error = _decode(EXAMPLES["error"])
    assert (error.code, error.message, error.seq) == ("capacity", "too big", 2)
    assert isinstance(_decode(EXAMPLES["ping"]), protocol.Ping)
    redirect = _decode(EXAMPLES["redirect"])
    assert (redirect.address, redirect.rank) == ("tcp://10.0.0.2:6001", 1)


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_examples_re_encode_to_the_same_bytes(name):
    again = protocol.encode(_decode(EXAMPLES[name]))
    assert [bytes(memoryview(f).cast("B")) for f in again] == EXAMPLES[name]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_a_changed_byte_is_another_message_or_a_protocol_error(name):
    original = _decode(EXAMPLES[name])
    rng = random.Random(name)
    for _ in range(200):
        frames = [bytearray(f) for f in EXAMPLES[name]]
        frame = frames[0] if len(frames) == 1 or rng.random() < 0.8 else frames[1]
        frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        try:
            changed = protocol.decode([memoryview(f) for f in frames])
        except ProtocolError:
            continue
        same_fields = vars(changed).keys() == vars(original).keys() and all(
            _equal(getattr(changed, k), getattr(original, k)) for k in vars(original))
        assert type(changed) is not type(original) or not same_fields


def _equal(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype \
            and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def test_a_peer_of_another_version_is_refused_with_both_versions_named():
    listener = transports.InprocListener()
    server = CloudServer(listener, ["tests.models:mlp"])
    thread = serve_in_thread(server)
    conn = listener.connect()
    try:
        head = msgpack.unpackb(EXAMPLES["hello"][0], raw=False)
        assert head[:3] == [20, "hello", 20]  # [version, type, hello.protocol, ...]
        other_version = msgpack.packb([1, *head[1:]], use_bin_type=True)
        other_field = msgpack.packb([*head[:2], 1, *head[3:]], use_bin_type=True)
        version_3 = msgpack.packb({"v": 3, "t": "hello", "b": {"protocol": 3}}, use_bin_type=True)  # a map then
        for frames, old in (([other_version], 1), ([other_field], 1), ([version_3], 3)):
            conn.send(frames)
            reply = protocol.decode(conn.recv(10))
            assert isinstance(reply, protocol.Error) and reply.code in ("protocol", "handshake")
            assert f"protocol {old}" in reply.message and f"speaks {protocol.PROTOCOL_VERSION}" in reply.message
        assert not server.by_id
    finally:
        conn.close()
        server.stop()
        thread.join(timeout=10)
