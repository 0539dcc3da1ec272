"""The trust boundary: what a well-formed request may make the cloud do.

Each test is one finding of a hostile run: a few hundred well-formed bytes that made the cloud write
files where the edge said, hold gigabytes, spin for a minute or lock good edges out. Each must now be
refused with a typed error before the work or memory is spent, and the cloud must keep serving.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import pytest
import torch
from torch import nn

import compressors
import splitft
import transports
from splitft.wire import protocol
from splitft.cloud import CloudServer, serve_in_thread
from splitft.cloud.shared_policy import SharedPolicy
from splitft.errors import PolicyError
from splitft.cloud.limits import Limits
from splitft.options import Faults, Link
from splitft.cloud.codec_policy import Policy
from splitft.wire.protocol import Forward, Hello, Sync, payload_to_wire
from tests.conftest import InprocCloud, start_cloud, stop
from tests.models import mlp
from tests.test_faults import MLP, _data, assert_same, local_weights, split_weights
from tests.test_hostile import HELLO, _answer, _deep

MiB = 1 << 20
TIGHT = Limits(max_message_bytes=4 * MiB, max_decoded_bytes=16 * MiB, session_memory_bytes=32 * MiB,
               memory_bytes=256 * MiB, max_ops=64, max_pending_calls=1000, max_model_params=100_000,
               handshake_timeout=10, sessions_per_peer=64)


class Cloud(InprocCloud):
    """An in-process cloud with tight budgets, for the requests below."""

    def __init__(self, limits: Limits = TIGHT, **options) -> None:
        super().__init__([MLP], limits=limits, **options)


@pytest.fixture
def cloud(caplog):
    caplog.set_level(logging.INFO, logger="splitft")
    c = Cloud()
    yield c
    c.close()


def _base_hello() -> Hello:
    return protocol.decode([memoryview(bytearray(f)) for f in HELLO])


def hello(**changes) -> Hello:
    base = _base_hello()
    return Hello(**{**vars(base), "nonce": "", **changes})


def codecs(fwd: str, bwd: str | None = None) -> dict:
    """Canonical specs, as a real edge sends them (local-only options included, to be refused)."""
    return {slot: compressors.canonical_spec(spec) for slot, spec in
            {"fwd": fwd, "bwd": bwd or "identity", "ret": fwd, "ret_bwd": bwd or "identity"}.items()}


def ask(conn, msg) -> protocol.Message:
    conn.send(msg if isinstance(msg, list) else protocol.encode(msg))
    return _answer(conn)


def opened(conn, **changes) -> protocol.Welcome:
    reply = ask(conn, hello(**changes))
    assert isinstance(reply, protocol.Welcome), reply
    return reply


def timed(conn, msg) -> tuple[protocol.Message, float]:
    start = time.perf_counter()
    reply = ask(conn, msg)
    return reply, time.perf_counter() - start


# ---------------------------------------------------------------- files


def test_a_local_only_codec_option_is_refused_and_no_file_appears(cloud, tmp_path):
    target = tmp_path / "elsewhere" / "x.npy"
    conn = cloud.connect()
    reply = ask(conn, hello(codecs=codecs(f"acsgd:capacity=2000,path={target}")))
    assert reply.code == "policy" and "path" in reply.message
    assert not target.exists() and not target.parent.exists()
    assert not cloud.server.by_id


def test_ended_sessions_leave_no_checkpoint_folders(tmp_path):
    c = Cloud(checkpoint_dir=str(tmp_path / "ck"), fsync=False)
    try:
        conn = c.connect()
        for _ in range(30):  # each hello replaces the last session of this connection
            opened(conn)
        assert len(list((tmp_path / "ck").iterdir())) == 1
        assert isinstance(ask(conn, protocol.Bye(seq=1)), protocol.Ack)
        assert list((tmp_path / "ck").iterdir()) == []
    finally:
        c.close()


def test_the_checkpoint_folder_is_capped(tmp_path):
    small = Limits(checkpoint_bytes=1, handshake_timeout=60)
    c = Cloud(small, checkpoint_dir=str(tmp_path / "ck"), fsync=False)
    try:
        opened(c.connect())  # its first checkpoint is refused (logged), the session still opens
        (tmp_path / "ck" / ("0" * 16)).mkdir()
        (tmp_path / "ck" / ("0" * 16) / "seq-000000000001.json").write_text("{}")
        c.server.checkpoints._update("0" * 16)
        assert ask(c.connect(), hello()).code == "capacity"
    finally:
        c.close()


# ---------------------------------------------------------------- memory and work per byte


@pytest.mark.parametrize("spec, option", [
    ("acsgd:capacity=300000000", "capacity"),
    ("lowrank:rank=1,iters=400000", "iters"),
    ("c3sl:r=100000", "r"),
    ("lowrank:rank=100000", "rank"),
])
def test_negotiable_options_are_bounded_by_the_cloud(cloud, spec, option):
    reply, seconds = timed(cloud.connect(), hello(codecs=codecs(spec)))
    assert reply.code == "policy" and option in reply.message, reply.message
    assert seconds < 5 and not cloud.server.by_id


def test_the_cloud_chooses_which_codecs_each_direction_may_use():
    c = Cloud(policy=Policy.allowing(["identity", "fp16"], per_slot={"bwd": ["identity"]}))
    try:
        assert ask(c.connect(), hello(codecs=codecs("lowrank:rank=2"))).code == "policy"
        reply = ask(c.connect(), hello(codecs=codecs("fp16", "fp16")))
        assert reply.code == "policy" and "bwd" in reply.message and "identity" in reply.message
        opened(c.connect(), codecs=codecs("fp16"))
    finally:
        c.close()


def _forward(entry, call=1, **fields) -> Forward:
    return Forward(call=call, train=True, grad=fields.pop("grad", False), args=[entry], kwargs=fields.pop("kwargs", {}),
                   **fields)


def test_a_low_rank_payload_that_would_decode_to_gigabytes_is_refused_before_decoding(cloud):
    conn = cloud.connect()
    opened(conn, codecs=codecs("lowrank:rank=1"))
    payload = compressors.make_codec("lowrank:rank=1").encode(torch.randn(4, 12), compressors.CodecContext())
    big = {name: np.zeros((32768,) + a.shape[1:], a.dtype) if a.ndim else a for name, a in payload.arrays.items()}
    payload = compressors.Payload(payload.codec, payload.version, big, {**payload.meta, "shape": [32768, 32768]})
    reply, seconds = timed(conn, _forward(payload_to_wire(payload, False)))
    assert reply.code in ("capacity", "compression", "protocol"), reply
    assert seconds < 2  # 11.5 GiB and 13.6 s before the check
    assert cloud.server.book.total < TIGHT.session_memory_bytes


def test_compacted_side_tensors_count_what_they_unfold_to(cloud):
    conn = cloud.connect()
    opened(conn)
    identity = compressors.make_codec("identity")
    x = payload_to_wire(identity.encode(torch.randn(4, 12), compressors.CodecContext()), False)
    one = payload_to_wire(identity.encode(torch.ones(1, 1, dtype=torch.float64), compressors.CodecContext()), False)
    mask = {"$expand": [one, [1 << 14, 1 << 14]]}  # 2 GiB each once repeated
    reply, seconds = timed(conn, _forward(x, kwargs={"a": mask, "b": mask, "c": mask}))
    assert reply.code == "capacity" and "decode" in reply.message
    assert seconds < 2


def test_one_message_carries_a_bounded_number_of_operations(cloud):
    conn = cloud.connect()
    opened(conn)
    reply, seconds = timed(conn, Sync(ops=[{"op": "zero_grad"}] * 1_000_000, seq=1))
    assert reply.code in ("capacity", "too_large") and seconds < 5
    assert isinstance(ask(conn, Sync(ops=[{"op": "zero_grad"}] * TIGHT.max_ops, seq=1)), protocol.Ack)


def test_graphs_never_backpropagated_are_bounded_by_the_session_budget(cloud):
    conn = cloud.connect()
    opened(conn)
    identity = compressors.make_codec("identity")
    x = payload_to_wire(identity.encode(torch.randn(4096, 16), compressors.CodecContext()), True)
    codes = []
    for call in range(1, 200):
        reply = ask(conn, _forward(x, call=call, grad=True))
        codes.append(getattr(reply, "code", "ok"))
        if reply.TYPE == "error":
            break
    assert codes[-1] == "capacity" and codes.count("ok") >= 2
    (session,) = cloud.server.by_id.values()
    assert session.held_bytes() <= TIGHT.session_memory_bytes
    assert cloud.server.book.total <= TIGHT.session_memory_bytes


def test_a_model_too_large_for_the_memory_budget_is_refused_before_it_is_built():
    c = Cloud(Limits(session_memory_bytes=64 * 1024))
    try:
        reply = ask(c.connect(), hello(factory_kwargs={"width": 512}))
        assert reply.code == "capacity" and "model" in reply.message
    finally:
        c.close()


# ---------------------------------------------------------------- sessions


def test_silent_hellos_are_reaped_and_good_edges_get_in():
    c = Cloud(Limits(max_sessions=8, handshake_timeout=2))
    try:
        strangers = [c.connect() for _ in range(8)]
        for conn in strangers:
            opened(conn)
        assert ask(c.connect(), hello()).code == "capacity"
        deadline = time.monotonic() + 10
        while c.server.by_id and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not c.server.by_id
        data = _data(3)
        with splitft.split(mlp(), 2, factory=MLP, connect=c.listener.connect, faults=Faults(heartbeat=0)) as model:
            assert_same(split_weights(model, data), local_weights(data))
    finally:
        c.close()


def test_a_strangers_hello_and_bye_do_not_end_a_cloud_started_for_one_session(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "1", "--model", MLP)
    try:
        conn = transports.connect(address)
        try:
            assert isinstance(ask(conn, hello()), protocol.Welcome)
            assert isinstance(ask(conn, protocol.Bye(seq=1)), protocol.Ack)
        finally:
            conn.close()
        time.sleep(0.5)
        assert proc.poll() is None, err.text
        data = _data(2)
        model = splitft.split(mlp(), 2, factory=MLP, connect=address, faults=Faults(timeout=20, heartbeat=0))
        with model:
            opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
            crit = model.remote_loss(nn.CrossEntropyLoss())
            for x, y in data:
                crit(model(x), y).backward()
                opt.step()
                opt.zero_grad()
        assert proc.wait(timeout=30) == 0, err.text
    finally:
        stop(proc)


def test_sessions_per_origin_are_capped_so_one_key_cannot_fill_the_table(tmp_path):
    from splitft.app.cli import main as cli
    assert cli(["keys", "--dir", str(tmp_path), "cloud", "good", "stranger"]) == 0
    _, secret = transports.load_secret_key(tmp_path / "cloud.key_secret")
    listener = transports.listen("tcp://127.0.0.1:0", secret_key=secret,
                                 allowed_keys=transports.load_allowed_keys([tmp_path / "good.key",
                                                                            tmp_path / "stranger.key"]))
    server = CloudServer(listener, [MLP], limits=Limits(sessions_per_peer=2, max_sessions=4))
    thread = serve_in_thread(server)
    conns = []
    try:
        options = {"server_key": transports.load_public_key(tmp_path / "cloud.key")}
        pub, sec = transports.load_secret_key(tmp_path / "stranger.key_secret")
        replies = []
        for _ in range(3):
            conn = transports.connect(listener.address, public_key=pub, secret_key=sec, **options)
            conns.append(conn)
            replies.append(ask(conn, hello()))
        assert [r.TYPE for r in replies] == ["welcome", "welcome", "error"]
        assert replies[-1].code == "capacity" and "sessions-per-peer" in replies[-1].message
        data = _data(2)
        model = splitft.split(mlp(), 2, factory=MLP, faults=Faults(heartbeat=0),
                              connect=Link(listener.address, cloud_key=tmp_path / "cloud.key",
                                           key=tmp_path / "good.key_secret"))
        with model:
            opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
            crit = model.remote_loss(nn.CrossEntropyLoss())
            for x, y in data:
                crit(model(x), y).backward()
                opt.step()
                opt.zero_grad()
    finally:
        for conn in conns:
            conn.close()
        server.stop()
        thread.join(timeout=10)


# ---------------------------------------------------------------- order of checks


def test_a_forged_resume_token_is_refused_before_the_checkpoint_is_read(tmp_path):
    c = Cloud(Limits(handshake_timeout=60), checkpoint_dir=str(tmp_path / "ck"), fsync=False)
    try:
        welcome = opened(c.connect())
        (folder,) = (tmp_path / "ck").iterdir()
        for tensors in folder.glob("*.safetensors"):
            tensors.write_bytes(b"damaged")  # reading it would say so; the token check comes first
        c.server.by_id.clear()  # as after a restart: only the checkpoint is left
        c.server.sessions.clear()
        forged = {"session": welcome.session, "token": "0" * 32, "step": 0, "seq": 0, "log_from": 1}
        reply = ask(c.connect(), hello(resume=forged))
        assert reply.code == "resume" and "wrong resume token" in reply.message
    finally:
        c.close()


def test_deep_and_badly_typed_values_get_typed_errors_without_a_traceback_each(cloud, caplog):
    for _ in range(5):
        reply = ask(cloud.connect(), hello(factory_kwargs={"width": _deep(1000)}))
        assert reply.code == "handshake"
        reply = ask(cloud.connect(), hello(factory_kwargs=[1, 2]))
        assert reply.code in ("handshake", "protocol")
    conn = cloud.connect()
    opened(conn)
    reply = ask(conn, _forward(_deep(1000)))
    assert reply.code == "protocol"
    assert "Traceback" not in caplog.text


def test_internal_errors_are_answered_typed_and_logged_once_a_minute(cloud, caplog, monkeypatch):
    conn = cloud.connect()
    opened(conn)
    (session,) = cloud.server.by_id.values()

    def broken(msg):
        raise RuntimeError("a bug")

    monkeypatch.setattr(session, "forward", broken)
    x = payload_to_wire(compressors.make_codec("identity").encode(torch.randn(2, 12), compressors.CodecContext()),
                        False)
    for call in range(1, 6):
        assert ask(conn, _forward(x, call=call)).code == "internal"
    assert caplog.text.count("internal error while serving") == 1


# ---------------------------------------------------------------- a shared cloud half


def test_shared_half_refuses_weights_that_overflow_its_dtype_and_takes_the_clouds_optimizer():
    c = Cloud(Limits(handshake_timeout=60), shared_model=True, shared_policy=SharedPolicy("Adam", {"lr": 0.01}))
    try:
        weights = {k: np.full_like(v, 1e300, dtype=np.float64) for k, v in _base_hello().weights.items()}
        assert ask(c.connect(), hello(weights=weights)).code == "protocol"
        first = splitft.split(mlp(), 2, factory=MLP, connect=c.listener.connect, faults=Faults(heartbeat=0))
        with first, pytest.raises(PolicyError, match="--shared-optimizer"):
            first.attach(torch.optim.SGD(first.parameters(), lr=0.1))
            first.sync()
        second = splitft.split(mlp(), 2, factory=MLP, connect=c.listener.connect, faults=Faults(heartbeat=0))
        with second:
            second.attach(torch.optim.Adam(second.parameters(), lr=0.01))
            second.sync()
    finally:
        c.close()


def test_a_goodbye_that_fails_still_ends_the_session(cloud):
    """An edge interrupted between numbering a request and sending it says goodbye past a gap; it
    is leaving whatever the cloud answers, so the session ends rather than waiting for its timeout."""
    conn = cloud.connect()
    opened(conn)
    assert cloud.server.by_id
    reply = ask(conn, protocol.Bye(reason="interrupted", seq=3))  # request 1 and 2 never arrived
    assert isinstance(reply, protocol.Error) and reply.code == "session"
    assert not cloud.server.by_id and not cloud.server.sessions
