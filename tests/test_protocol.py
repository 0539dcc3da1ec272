"""The wire format: exact bytes, round trips, and typed errors for malformed messages."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from compressors import Payload
from splitft.wire import operations, protocol
from splitft.errors import ProtocolError


def test_ack_is_exactly_these_bytes():
    # array[20, "ack", state: nil, grad_norms: nil, optimizer_state: nil, values: nil, grads: nil, seq: 7]
    assert protocol.encode(protocol.Ack(seq=7)) == [b"\x98\x14\xa3ack\xc0\xc0\xc0\xc0\xc0\x07"]


def test_an_error_is_exactly_these_bytes():
    # array[17, "error", code, message, call 0, seq 2, raised "IndexError", rng nil]
    assert protocol.encode(protocol.Error(code="model", message="m", seq=2, raised="IndexError")) == [
        b"\x98\x14\xa5error\xa5model\xa1m\x00\x02\xaaIndexError\xc0"]


def test_array_travels_as_extension_reference_plus_raw_frame():
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    frames = protocol.encode(protocol.Output(call=7, value=protocol.payload_to_wire(Payload("identity", 1, {"x": arr}), True)))
    assert frames[0] == (
        b"\x99\x14\xa6output\x07\x81\xa2$t\x95\xa8identity\x01\x80"  # [20, "output", call 7, value: {"$t": [...
        b"\x81\xa1x"
        b"\xc7\x0d\x01" b"\x93\x00\xa7float32\x92\x02\x03"  # ext8, 13 bytes, type 1: [frame 0, dtype, shape]
        b"\xc3\x80\xc0\xc0\xc0\x00"  # ...grad]}, timings {}, grads nil, unreached nil, rng nil, seq 0]
    )
    assert len(frames) == 2
    assert bytes(memoryview(frames[1])) == bytes.fromhex("000000000000803f0000004000004040000080400000a040")


def test_array_frames_are_not_copied_on_encode():
    arr = np.ones((256, 256), dtype=np.float32)
    frames = protocol.encode(protocol.Output(call=1, value=protocol.payload_to_wire(Payload("identity", 1, {"x": arr}))))
    assert np.shares_memory(frames[1], arr)


@pytest.mark.parametrize("message", [
    protocol.Hello(protocol=1, factory="a:b", cut="x", rejoin=None, fingerprint="f", codecs={"fwd": "identity"},
                   seed=3, weights={"w": np.zeros((2, 2), np.float32)}),
    protocol.Welcome(session="s"),
    protocol.Forward(call=1, train=True, grad=False, args=[1, None, "a"], kwargs={"k": 2.5}, ops=[{"op": "step"}],
                     sample_ids=np.arange(4, dtype=np.int64)),
    protocol.Backward(call=2, grads=[None]),
    protocol.InputGrads(call=2, grads=[]),
    protocol.Sync(want_state=True),
    protocol.Error(code="protocol", message="m"),
    protocol.Error(code="model", message="m", raised="IndexError", rng=np.arange(8, dtype=np.uint8)),
    protocol.Bye(reason="r"),
])
def test_round_trip(message):
    frames = [memoryview(bytes(memoryview(f).cast("B"))) for f in protocol.encode(message)]
    back = protocol.decode(frames)
    assert type(back) is type(message)
    for name in protocol._FIELD_NAMES[type(message)]:
        a, b = getattr(message, name), getattr(back, name)
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, b)
        elif isinstance(a, dict) and a and isinstance(next(iter(a.values())), np.ndarray):
            assert a.keys() == b.keys()
        else:
            assert a == b


def test_a_different_array_does_not_compare_equal():
    a = protocol.decode(protocol.encode(protocol.Sync()))
    frames = protocol.encode(protocol.Hello(protocol=1, factory="a:b", cut="x", rejoin=None, fingerprint="f",
                                            codecs={}, seed=1, weights={"w": np.zeros(3, np.float32)}))
    other = protocol.encode(protocol.Hello(protocol=1, factory="a:b", cut="x", rejoin=None, fingerprint="f",
                                           codecs={}, seed=1, weights={"w": np.ones(3, np.float32)}))
    assert frames[0] == other[0] and bytes(memoryview(frames[1])) != bytes(memoryview(other[1]))
    assert a == protocol.Sync()


def _header(body: dict, t: str = "sync", v: int = protocol.PROTOCOL_VERSION) -> bytes:
    """A header from named fields: the message's defaults fill the rest, in order; a name that is
    not a field of ``t`` goes at the end, as an extra position."""
    cls = protocol.MESSAGES.get(t)
    fields = [] if cls is None else dataclasses.fields(cls)
    names = {f.name for f in fields}
    values = []
    for f in fields:
        if f.name in body:
            values.append(body[f.name])
        elif f.default is not dataclasses.MISSING:
            values.append(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            values.append(f.default_factory())
    values += [value for name, value in body.items() if name not in names]
    return msgpack.packb([v, t, *values], use_bin_type=True)


def _ext(index, dtype, shape) -> msgpack.ExtType:
    return msgpack.ExtType(1, msgpack.packb([index, dtype, shape]))


V = protocol.PROTOCOL_VERSION
MALFORMED = {
    "no frames": [],
    "not msgpack": [b"\xc1\xc1\xc1"],
    "truncated header": [protocol.encode(protocol.Ack())[0][:-3]],
    "header not an array": [msgpack.packb({"t": "sync"})],
    "header of one item": [msgpack.packb([protocol.PROTOCOL_VERSION])],
    "a version-3 map header": [msgpack.packb({"v": 3, "t": "sync", "b": {}})],
    "version as a bool": [msgpack.packb([True, "ping"])],
    "wrong version": [_header({}, v=99)],
    "the first version": [_header({}, v=1)],
    "unknown type": [_header({}, t="launch_missiles")],
    "unknown field": [_header({"bogus": 1})],
    "wrong field type": [_header({"call": "seven", "grads": []}, t="backward")],
    "bool as int": [_header({"call": True, "grads": []}, t="backward")],
    "missing field": [msgpack.packb([V, "backward", 1, []])],
    "one field too many": [msgpack.packb([V, "ping", 0])],
    "unknown extension": [_header({"ops": [msgpack.ExtType(9, b"")]})],
    "bad dtype": [_header({"ops": [_ext(0, "object", [1])]}), b"12345678"],
    "shape vs bytes": [_header({"ops": [_ext(0, "float32", [3])]}), b"12345678"],
    "negative dim": [_header({"ops": [_ext(0, "float32", [-1])]}), b""],
    "huge declared shape": [_header({"ops": [_ext(0, "float64", [2**40, 2**40])]}), b""],
    "frame index out of range": [_header({"ops": [_ext(5, "uint8", [1])]}), b"x"],
    "frame used twice": [_header({"ops": [_ext(0, "uint8", [1]), _ext(0, "uint8", [1])]}), b"x"],
    "extra frame": [protocol.encode(protocol.Ack())[0], b"surplus"],
    "garbage reference": [_header({"ops": [msgpack.ExtType(1, b"\xc1")]})],
}


def test_a_version_3_header_is_named_as_such():
    with pytest.raises(ProtocolError, match=f"the peer speaks protocol 3, this side speaks {protocol.PROTOCOL_VERSION}"):
        protocol.decode([msgpack.packb({"v": 3, "t": "ack", "b": {"seq": 1}})])


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_messages_raise_protocol_error(name):
    with pytest.raises(ProtocolError):
        protocol.decode(MALFORMED[name])


def test_unsupported_array_dtype_is_refused_on_encode():
    with pytest.raises(ProtocolError, match="dtype"):
        protocol.encode(protocol.Sync(ops=[{"x": np.array(["a"], dtype=object)}]))


# ---------------------------------------------------------------- the fast paths keep every check


def _forward_frames(n: int = 4) -> list:
    arr = np.arange(n, dtype=np.float32)
    entry = protocol.payload_to_wire(Payload("identity", 1, {"x": arr}), True)
    frames = protocol.encode(protocol.Forward(call=1, train=True, grad=True, args=[entry], kwargs={}))
    return [memoryview(bytes(memoryview(f).cast("B"))) for f in frames]


def test_a_remembered_array_reference_still_checks_its_frame():
    good = _forward_frames()
    protocol.decode(good)  # the reference [0, float32, [4]] is now remembered
    with pytest.raises(ProtocolError, match="needs 16 bytes"):
        protocol.decode([good[0], memoryview(b"\0" * 12)])
    with pytest.raises(ProtocolError, match="array frames arrived"):
        protocol.decode([good[0], good[1], good[1]])
    with pytest.raises(ProtocolError, match="out of range"):
        protocol.decode([good[0]])
    twice = _header({"ops": [_ext(0, "float32", [4]), _ext(0, "float32", [4])]})
    with pytest.raises(ProtocolError, match="used twice"):
        protocol.decode([twice, good[1]])


def test_a_body_that_passed_does_not_let_other_types_through():
    ok = msgpack.packb([V, "backward", 1, [], [], 2, True, 5])
    assert protocol.decode([ok]) == protocol.Backward(call=1, grads=[], seq=2, pass_id=5)
    for fields in ([True, [], [], 2, True, None], [1, {}, [], 2, True, None], [1, [], [], 2.0, True, None],
                   [1, [], [], 2, 1, None], [1, [], [], 2, True, "5"], [1, [], [], 2, True, None, 2],
                   [1, [], [], 2, True]):
        with pytest.raises(ProtocolError):
            protocol.decode([msgpack.packb([V, "backward", *fields])])


def test_the_first_problem_in_field_order_is_the_one_reported():
    body = {"grads": "not a list", "call": "not an int"}
    with pytest.raises(ProtocolError, match=r"backward\.call should be int"):
        protocol.decode([_header(body, t="backward")])


def test_remembered_references_and_bodies_stay_bounded():
    for n in range(protocol._CACHE_LIMIT + 50):
        frames = [_header({"ops": [_ext(0, "uint8", [n])]}), b"\0" * n]
        protocol.decode(frames)
    assert len(protocol._REFS_SEEN) <= protocol._CACHE_LIMIT
    assert len(protocol._PASSED_FIELDS) <= protocol._CACHE_LIMIT


def test_a_failed_encode_leaves_nothing_for_the_next():
    with pytest.raises(ProtocolError):
        protocol.encode(protocol.Sync(ops=[{"a": np.zeros(2, np.float32)}, {"x": np.array(["a"], dtype=object)}]))
    frames = protocol.encode(protocol.Sync(ops=[{"a": np.ones(3, np.float32)}]))
    assert len(frames) == 2
    assert protocol.decode(frames).ops[0]["a"].tolist() == [1.0, 1.0, 1.0]


def test_encoding_from_many_threads_keeps_each_message_whole():
    import sys
    import threading

    failures = []

    def work(k: int) -> None:
        try:
            for i in range(300):
                arrays = [np.full(k + 1, i, np.int64), np.full(2, k, np.int32), np.full(3, i + k, np.int16)]
                ops = [{"a": arrays[0]}, {"b": arrays[1]}, {"c": arrays[2]}]
                frames = protocol.encode(protocol.Sync(ops=ops, seq=i))
                back = protocol.decode([memoryview(bytes(memoryview(f).cast("B"))) for f in frames])
                if back.seq != i or [list(op.values())[0].tolist() for op in back.ops] != [a.tolist() for a in arrays]:
                    failures.append((k, i))
        except Exception as exc:  # noqa: BLE001 - reported below, from the test's thread
            failures.append(exc)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible, inside encodes too
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not any(t.is_alive() for t in threads) and not failures, failures[:3]


def test_a_message_with_an_extra_attribute_encodes_only_its_fields():
    msg = protocol.Ack(seq=7)
    msg.note = "local only"  # type: ignore[attr-defined]
    assert protocol.encode(msg) == protocol.encode(protocol.Ack(seq=7))


def test_operation_records_travel_as_the_maps_the_cloud_checks():
    """The edge puts records in a message; the bytes are those of their maps, field order kept,
    arrays as frames of their own, and the receiver's check builds the same records back."""
    weights = {"w": np.arange(4, dtype=np.float32)}
    records = [operations.Step(id=3, lr=0.5), operations.ZeroGrad(names=["a.weight"]),
               operations.LoadWeights(weights=weights, partial=True), operations.ApplyEager(call=7, scale=2.0)]
    maps = [{"op": "step", "id": 3, "lr": 0.5, "lrs": None, "changes": None},
            {"op": "zero_grad", "set_to_none": True, "model": False, "names": ["a.weight"]},
            {"op": "load_weights", "weights": weights, "partial": True},
            {"op": "apply", "call": 7, "scale": 2.0, "pass_id": None, "last": False}]
    sent = protocol.encode(protocol.Sync(ops=records, seq=4))
    assert [bytes(memoryview(f)) for f in sent] == [bytes(memoryview(f))
                                                    for f in protocol.encode(protocol.Sync(ops=maps, seq=4))]
    received = protocol.decode([memoryview(bytes(memoryview(f))) for f in sent])
    assert all(isinstance(op, dict) for op in received.ops)
    back = [operations.from_wire(op) for op in received.ops]
    assert back[:2] == records[:2] and back[3] == records[3]
    np.testing.assert_array_equal(back[2].weights["w"], weights["w"])


def test_two_operations_over_different_parameters_fold_into_one():
    seen = {"a"}
    first = operations.ZeroGrad(names=["a"])
    assert operations.merged(first, operations.ZeroGrad(names=["b"]), seen)
    assert first == operations.ZeroGrad(names=["a", "b"]) and seen == {"a", "b"}
    assert not operations.merged(first, operations.ZeroGrad(names=["a"]), seen)  # the same one twice: twice
    assert not operations.merged(first, operations.ZeroGrad(set_to_none=False, names=["c"]), seen)
    assert not operations.merged(first, operations.ScaleGrads(factor=2.0, names=["c"]), seen)
    assert not operations.merged(operations.SetFrozen(names=["x"]), operations.SetFrozen(names=["y"]), set())
    partial = operations.LoadWeights(weights={"x": 1}, partial=True)
    assert operations.merged(partial, operations.LoadWeights(weights={"y": 2}, partial=True), set())
    assert partial.weights == {"x": 1, "y": 2}
    assert not operations.merged(partial, operations.LoadWeights(weights={"z": 3}), set())
