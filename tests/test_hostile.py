"""Hostile input: malformed messages get typed error replies, the cloud keeps serving, memory stays
bounded. The fuzzer mutates real messages recorded from a split training run (bit flips,
truncation, dropped/duplicated frames, field type swaps, shape and dtype lies, NaN, oversize)."""

from __future__ import annotations

import logging
import math
import random
import threading
from collections import Counter

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from torch import nn

import splitft
from splitft import Faults
from splitft.wire import protocol
from splitft.cloud import CloudServer, serve_in_thread
from splitft.errors import CODES
from splitft.cloud.limits import Limits
from tests.faulty import FaultyConnection
from tests.models import mlp
from tests.test_faults import MLP, _data, assert_same, local_weights, split_weights
from transports import InprocListener, TransportDisconnected, ZmqConnection, ZmqListener

LIMITS = Limits(max_message_bytes=256 * 1024, max_frames=64, max_sessions=16, max_pending_calls=8,
                max_model_params=100_000)
REPLIES = {"welcome", "output", "input_grads", "ack", "pong", "error"}


# ---------------------------------------------------------------- real messages to start from


def _record() -> list[list[bytes]]:
    """Every request of a short plain and a short U-shape run, as the bytes the edge sent."""
    listener = InprocListener()
    server = CloudServer(listener, [MLP], limits=LIMITS)
    thread = serve_in_thread(server)
    sent: list[list[bytes]] = []

    def keep(frames) -> int:
        sent.append([bytes(memoryview(f).cast("B")) for f in frames])
        return 1

    try:
        for rejoin in (None, 4):
            model = splitft.split(mlp(), 2, rejoin, factory=MLP, faults=Faults(heartbeat=0),
                                  connect=lambda: FaultyConnection(listener.connect(), on_send=keep))
            with model:
                opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
                crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
                for x, y in _data(2):
                    crit(model(x, sample_ids=torch.arange(len(y))), y).backward()
                    opt.step()
                    opt.zero_grad()
                with torch.no_grad():
                    model.predict(_data(1)[0][0])
                model.cloud_state_dict()
            model.session.connection.inner.close()
    finally:
        server.stop()
        thread.join(timeout=10)
    bases = []
    for frames in sent:
        bases.append(frames)
        msg = protocol.decode([memoryview(bytearray(f)) for f in frames])
        if getattr(msg, "seq", 0):
            msg.seq = 0  # unnumbered copies reach deeper than a sequence-number gap would
            bases.append([bytes(memoryview(f).cast("B")) for f in protocol.encode(msg)])
    return bases


BASES = _record()
HELLO = next(b for b in BASES if b"hello" in b[0][:16])


def _decoded(frames):
    return protocol.decode([memoryview(bytearray(f)) for f in frames])


# Unnumbered forwards that build a graph, by call id, and the unnumbered backwards that follow them.
FORWARDS = {m.call: f for f in BASES if isinstance(m := _decoded(f), protocol.Forward) and m.grad and not m.seq}
BACKWARDS = [f for f in BASES if isinstance(m := _decoded(f), protocol.Backward) and not m.seq
             and m.call in FORWARDS]


# ---------------------------------------------------------------- mutations

_EXT = msgpack.ExtType


def _unpack(header: bytes):
    return msgpack.unpackb(header, raw=False, strict_map_key=False, ext_hook=lambda code, data: _EXT(code, data))


def _pack(tree) -> bytes:
    return msgpack.packb(tree, use_bin_type=True)


def _deep(n: int):
    node: list = []
    for _ in range(n):
        node = [node]
    return node


ODD_VALUES = [
    None, True, False, -1, 0, 2**63 - 1, 2**64 - 1, -(2**63), 1.5, math.nan, math.inf, "", "x" * 3000, "$t",
    b"\x00\x01", [], [1, 2, 3], {}, {"$t": 1}, {"$t": ["identity", 1, {}, {}, False]}, {"$tuple": 5},
    {"$tuple": [{"$t": ["fp16", 1, {"dtype": "complex64"}, {}, True]}]}, _deep(300), [None] * 2000,
    _EXT(1, msgpack.packb([0, "float32", [2, 2]])), _EXT(9, b""), _EXT(1, b"\xc1"),
    {"op": "step", "id": 10**9}, {"op": "step", "id": 1, "lr": math.nan}, {"op": "step", "lr": "fast"},
    {"op": "optimizer", "name": "Adam", "settings": {"lr": -1}}, {"op": "optimizer", "name": "LBFGS", "settings": {}},
    {"op": "optimizer", "name": "SparseAdam", "id": 99}, {"op": "optimizer", "name": "Optimizer"},
    {"op": "optimizer", "name": "SGD", "settings": {"lr": 0.1, "params": []}},
    {"op": "loss", "name": "CrossEntropyLoss", "settings": {"reduction": "bogus"}},
    {"op": "loss", "name": "Module"}, {"op": "zero_grad", "set_to_none": "maybe"}, {"op": "__init__"},
    {"session": "0" * 16, "token": "x", "step": 0, "seq": 5, "log_from": 1},
    {"session": "../../etc", "token": "x", "step": 0, "seq": 0, "log_from": 0},
    {"fwd": "identity", "bwd": "identity", "ret": "zip", "ret_bwd": "identity"},
    {"seed": 2**64 - 1}, {"width": 10**6}, {b"bytes-key": 1},
]
DTYPES = ["float64", "float32", "float16", "int64", "int32", "int8", "uint8", "bool", "object", "<f4",
          "float128", "", "complex64", 5]
SHAPES = [[], [0], [2**62], [-1], [1] * 9, "abc", [1.5], [2**40, 2**40], [16, 16], [256], [8, 32], [4, 4, 4, 4],
          [1, 0, 3]]


def _paths(node, out, depth=0):
    """(container, key) pairs of every value below ``node``."""
    if depth > 12:
        return
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        out.append((node, key))
        _paths(value, out, depth + 1)


def _fields(tree, out):
    """(container, key) pairs below the header's fields: ``[version, type, field, ...]``."""
    if isinstance(tree, list):
        for index in range(2, len(tree)):
            out.append((tree, index))
            _paths(tree[index], out, 1)


def _exts(node, out, depth=0):
    if depth > 12:
        return
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        if isinstance(value, _EXT) and value.code == 1:
            out.append((node, key))
        else:
            _exts(value, out, depth + 1)


def _retree(frames, rng, change):
    try:
        tree = _unpack(frames[0])
    except Exception:  # noqa: BLE001
        return frames
    try:
        change(tree, rng)
        arrays = list(frames[1:])
        if rng.random() < 0.7:
            arrays = _keep_referenced(tree, arrays)
        return [_pack(tree), *arrays]
    except (OverflowError, ValueError, TypeError, IndexError, KeyError):  # an earlier mutation left nothing to lie about, or
        return frames  # not even msgpack can carry the lie: no one can send it


def _keep_referenced(tree, arrays):
    """Drop array frames the mutated header no longer refers to and renumber the references, so
    a structural lie reaches the code behind the frame-count check."""
    refs: list = []
    _exts(tree, refs)
    indices = []
    for node, key in refs:
        index, dtype, shape = msgpack.unpackb(node[key].data, raw=False)
        indices.append((node, key, index, dtype, shape))
    used = sorted({i for *_, i, _, _ in indices if isinstance(i, int) and 0 <= i < len(arrays)})
    if len(used) == len(arrays) or any(not (isinstance(i, int) and 0 <= i < len(arrays)) for *_, i, _, _ in indices):
        return arrays
    renumber = {old: new for new, old in enumerate(used)}
    for node, key, index, dtype, shape in indices:
        node[key] = _EXT(1, msgpack.packb([renumber[index], dtype, shape]))
    return [arrays[i] for i in used]


def m_field(frames, rng):
    def change(tree, rng):
        paths: list = []
        _fields(tree, paths)
        if paths:
            node, key = rng.choice(paths)
            node[key] = rng.choice(ODD_VALUES)
    return _retree(frames, rng, change)


def m_ext(frames, rng):
    def change(tree, rng):
        refs: list = []
        _exts(tree, refs)
        if not refs:
            return
        node, key = rng.choice(refs)
        index, dtype, shape = msgpack.unpackb(node[key].data, raw=False)
        what = rng.randrange(3)
        if what == 0:
            shape = rng.choice(SHAPES)
        elif what == 1:
            dtype = rng.choice(DTYPES)
        else:
            index = rng.choice([-1, 99, "0", None, index + 1, 0])
        node[key] = _EXT(1, msgpack.packb([index, dtype, shape]))
    return _retree(frames, rng, change)


def m_drop(frames, rng):
    """Remove one entry of a map or list somewhere in the body (a missing field, array, option)."""
    def change(tree, rng):
        paths: list = []
        _fields(tree, paths)
        containers = [node[key] for node, key in paths if isinstance(node[key], (dict, list)) and node[key]]
        if containers:
            node = rng.choice(containers)
            if isinstance(node, dict):
                del node[rng.choice(list(node))]
            else:
                del node[rng.randrange(len(node))]
    return _retree(frames, rng, change)


def m_retype(frames, rng):
    """Give one value another type that looks related (a list for a map, a string for a number...)."""
    def other(value):
        if isinstance(value, bool):
            return int(value)
        if isinstance(value, int):
            return rng.choice([str(value), float(value), [value], value > 0])
        if isinstance(value, float):
            return rng.choice([int(value) if math.isfinite(value) else 0, str(value)])
        if isinstance(value, str):
            return rng.choice([value.encode(), [value], len(value), {value: value}])
        if isinstance(value, dict):
            return rng.choice([list(value.values()), list(value), {str(i): v for i, v in enumerate(value.values())}])
        if isinstance(value, list):
            return rng.choice([dict(zip(map(str, range(len(value))), value)), tuple(value)[:1], value * 2])
        return rng.choice([0, "", [], {}])

    def change(tree, rng):
        paths: list = []
        _fields(tree, paths)
        if paths:
            node, key = rng.choice(paths)
            node[key] = other(node[key])
    return _retree(frames, rng, change)


def m_backward(frames, rng):
    """A valid forward that builds a graph, then a mutated backward for it."""
    backward = rng.choice(BACKWARDS)
    call = _decoded(backward).call
    mutate = rng.choice([m_field, m_drop, m_retype, m_ext, m_nonfinite, m_bitflip])
    return [FORWARDS[call], mutate(backward, rng)]


def m_envelope(frames, rng):
    def change(tree, rng):
        if rng.random() < 0.5:
            tree[0] = rng.choice([0, 2, 3, 99, "1", None, -1, True])
        else:
            tree[1] = rng.choice([*protocol.MESSAGES, "launch", "", 7, None])
    return _retree(frames, rng, change)


def m_seq(frames, rng):
    def change(tree, rng):
        cls = protocol.MESSAGES.get(tree[1])
        if cls is not None and "seq" in protocol._FIELD_TUPLES[cls]:
            tree[2 + protocol._FIELD_TUPLES[cls].index("seq")] = rng.choice([0, 1, 2, 3, -5, 2**63, 10**6])
    return _retree(frames, rng, change)


def m_bitflip(frames, rng):
    frames = list(frames)
    i = rng.randrange(len(frames))
    data = bytearray(frames[i])
    for _ in range(rng.randint(1, 4)):
        if data:
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    frames[i] = bytes(data)
    return frames


def m_truncate(frames, rng):
    frames = list(frames)
    i = rng.randrange(len(frames))
    frames[i] = frames[i][: rng.randrange(len(frames[i]) + 1)]
    return frames


def m_frames(frames, rng):
    frames = list(frames)
    what = rng.randrange(5)
    if what == 0 and frames:
        del frames[rng.randrange(len(frames))]
    elif what == 1:
        frames.insert(rng.randrange(len(frames) + 1), rng.choice(frames))
    elif what == 2 and len(frames) > 1:
        i, j = rng.sample(range(len(frames)), 2)
        frames[i], frames[j] = frames[j], frames[i]
    elif what == 3:
        frames.append(rng.randbytes(rng.randrange(64)))
    else:
        frames = [b""] * rng.randrange(0, 100)
    return frames


def m_nonfinite(frames, rng):
    frames = list(frames)
    floats = [i for i, f in enumerate(frames[1:], 1) if len(f) and len(f) % 4 == 0]
    if floats:
        i = rng.choice(floats)
        arr = np.frombuffer(frames[i], dtype=np.float32).copy()
        arr[rng.randrange(arr.size)] = rng.choice([np.nan, np.inf, -np.inf])
        frames[i] = arr.tobytes()
    return frames


def m_oversize(frames, rng):
    big = LIMITS.max_message_bytes + rng.randrange(1, 4096)
    return [*frames, bytes(big)] if rng.random() < 0.5 else [frames[0], *[bytes(big // 8)] * 9]


def m_garbage(frames, rng):
    return [rng.randbytes(rng.randrange(1, 200)) for _ in range(rng.randrange(1, 4))]


def m_twice(frames, rng):
    """Two mutations on top of each other."""
    ops = [m_field, m_drop, m_retype, m_ext, m_bitflip, m_truncate, m_frames, m_seq, m_nonfinite]
    once = rng.choice(ops)(frames, rng)
    return rng.choice(ops)(once, rng) if once and once[0] else once


MUTATIONS = [m_field, m_field, m_drop, m_drop, m_retype, m_retype, m_ext, m_ext, m_envelope, m_seq, m_bitflip,
             m_truncate, m_frames, m_nonfinite, m_oversize, m_garbage, m_twice, m_backward, m_backward]


def mutate(index: int, mutation: int, seed: int) -> list[list[bytes]]:
    """The messages one plan sends: usually one mutated message, sometimes a valid one before it."""
    out = MUTATIONS[mutation](BASES[index], random.Random(seed))
    return out if out and isinstance(out[0], list) else [out]


# ---------------------------------------------------------------- the storm


@pytest.fixture
def hostile_cloud(caplog):
    listener = InprocListener()
    server = CloudServer(listener, [MLP], limits=LIMITS)
    thread = serve_in_thread(server)
    caplog.set_level(logging.ERROR, logger="splitft")
    yield server, listener, thread
    server.stop()
    thread.join(timeout=10)


def _answer(conn) -> protocol.Message:
    return protocol.decode(conn.recv(timeout=10))


def test_ten_thousand_malformed_messages_get_typed_errors_and_the_cloud_still_trains(hostile_cloud, caplog):
    server, listener, thread = hostile_cloud
    peers = [listener.connect() for _ in range(4)]
    for conn in peers:
        conn.send(HELLO)
        assert isinstance(_answer(conn), protocol.Welcome)
    stats: Counter = Counter()
    lost: set = set()
    plan = st.tuples(st.integers(0, len(BASES) - 1), st.integers(0, len(MUTATIONS) - 1), st.integers(0, 2**32 - 1))

    # No shrinking: a failing batch names its message (base, mutation, seed), which replays it.
    @settings(max_examples=21, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    @given(plans=st.lists(plan, min_size=500, max_size=500))
    def storm(plans):
        for n, (base, mutation, seed) in enumerate(plans):
            conn = peers[n % len(peers)]
            opening = [HELLO] if conn in lost else []  # a mutated goodbye may have ended its session
            lost.discard(conn)
            batch = opening + mutate(base, mutation, seed)
            for k, frames in enumerate(batch):
                mutated = k == len(batch) - 1  # the others are valid set-up: a hello, a forward
                conn.send(frames)
                reply = _answer(conn)  # exactly one answer per message, within the timeout
                where = f"message (base {base}, mutation {MUTATIONS[mutation].__name__}, seed {seed})"
                assert reply.TYPE in REPLIES, f"{where}: {reply}"
                stats["messages"] += 1
                if isinstance(reply, protocol.Error):
                    assert reply.code in CODES, f"{where}: untyped error {reply.code}: {reply.message}"
                    assert reply.message
                    stats[reply.code] += 1
                    stats["mutated and refused"] += mutated
                    if reply.code == "session":
                        lost.add(conn)
                else:
                    stats["answered normally"] += 1
                stats["mutated"] += mutated
        assert thread.is_alive()

    storm()
    assert stats["messages"] >= 10_000, stats
    # Some mutations leave a valid message (a flipped bit in an activation); most must be refused.
    assert stats["mutated and refused"] > 0.75 * stats["mutated"], stats
    internal = [r for r in caplog.records if "internal error" in r.getMessage()]
    assert not internal, internal[0].exc_text
    # Memory stayed bounded.
    assert len(server.by_id) <= LIMITS.max_sessions
    for session in server.by_id.values():
        assert len(session.graphs.pending) <= LIMITS.max_pending_calls and len(session.replies) <= LIMITS.reply_cache
    # The cloud still serves a well-behaved edge, exactly.
    data = _data(3)
    model = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
    with model:
        weights = split_weights(model, data)
    assert_same(weights, local_weights(data))
    print(dict(stats))


def test_malformed_messages_over_zeromq_and_oversize_frames():
    """The same over tcp: typed replies up to twice the size limit; beyond that ZeroMQ cuts the
    sender off before buffering its frame, and the cloud serves everyone else."""
    listener = ZmqListener("tcp://127.0.0.1:0", max_message_bytes=2 * LIMITS.max_message_bytes)
    server = CloudServer(listener, [MLP], limits=LIMITS)
    thread = serve_in_thread(server)
    rng = random.Random(7)
    conn = ZmqConnection(listener.address)
    try:
        conn.send(HELLO)
        assert isinstance(_answer(conn), protocol.Welcome)
        codes: Counter = Counter()
        for _ in range(300):
            for frames in mutate(rng.randrange(len(BASES)), rng.randrange(len(MUTATIONS)), rng.randrange(2**32)):
                if not frames:
                    continue  # ZeroMQ has no empty message
                conn.send(frames)
                reply = _answer(conn)
                codes[reply.code if isinstance(reply, protocol.Error) else reply.TYPE] += 1
                assert not isinstance(reply, protocol.Error) or reply.code in CODES
        assert codes["too_large"] > 0
        conn.send([HELLO[0], bytes(3 * LIMITS.max_message_bytes)])  # beyond what ZeroMQ reads
        with pytest.raises(TransportDisconnected):  # no reply: the link is cut, and the edge is told so
            conn.recv(timeout=5.0)
        other = ZmqConnection(listener.address)
        other.send(HELLO)
        assert isinstance(_answer(other), protocol.Welcome)
        other.close()
    finally:
        conn.close()
        server.stop()
        thread.join(timeout=10)


# ---------------------------------------------------------------- specific refusals


def _raw(listener, *messages):
    conn = listener.connect()
    try:
        replies = []
        for message in messages:
            conn.send(message if isinstance(message, list) else protocol.encode(message))
            replies.append(_answer(conn))
        return replies
    finally:
        conn.close()


def _hello(**changes):
    return protocol.decode([memoryview(bytearray(f)) for f in HELLO]).__class__(
        **{**vars(protocol.decode([memoryview(bytearray(f)) for f in HELLO])), **changes})


def test_specific_hostile_requests_are_refused_with_their_code(hostile_cloud):
    server, listener, _ = hostile_cloud
    (reply,) = _raw(listener, _hello(factory_kwargs={"width": 10**6}))
    assert reply.code == "capacity" and "parameters" in reply.message  # refused before it was built
    (reply,) = _raw(listener, [*HELLO, bytes(LIMITS.max_message_bytes)])
    assert reply.code == "too_large" and "--max-message-mb" in reply.message
    (reply,) = _raw(listener, _hello(resume={"session": "../../../etc/x", "token": "", "step": 0, "seq": 0,
                                             "log_from": 1}))
    assert reply.code == "protocol"
    model = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
    with model:
        model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        x, y = _data(1)[0]
        assert math.isnan(crit(model(x * math.nan), y).item())  # its own half: computed as unsplit
        with pytest.raises(splitft.errors.TooLarge, match="the cloud accepts at most"):
            crit(model(torch.randn(8000, 12)), torch.zeros(8000, dtype=torch.long))  # checked before sending
        crit(model(x), y).backward()  # the session is fine after both
        (session,) = server.sessions.values()
        for _ in range(3 * LIMITS.max_pending_calls):
            crit(model(x), y)  # graphs (or eager gradients) whose backward never comes
        assert len(session.graphs.deferred) == LIMITS.max_pending_calls
        assert len(session.graphs.pending) <= LIMITS.max_pending_calls


def test_sessions_are_bounded(hostile_cloud):
    server, listener, _ = hostile_cloud
    conns = [listener.connect() for _ in range(LIMITS.max_sessions + 1)]
    replies = []
    for conn in conns:
        conn.send(HELLO)
        replies.append(_answer(conn))
    assert all(isinstance(r, protocol.Welcome) for r in replies[:-1])
    assert replies[-1].code == "capacity"
    for conn in conns:
        conn.send(protocol.encode(protocol.Bye()))
        _answer(conn)
        conn.close()
    assert not server.by_id
