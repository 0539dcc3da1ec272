"""``Codecs("auto")`` / ``--codecs auto``: the edge measures its link before the hello and picks
each direction's codec within a quality budget and the cloud's policy, against real clouds."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import transports
from splitft import split
from splitft.app.models import digits_cnn
from splitft.edge import auto_codecs
from splitft.edge.link_probe import LinkEstimate
from splitft.errors import ConfigError
from splitft.options import Codecs, Link
from splitft.wire import protocol
from splitft.wire.protocol import Error, Probe, Probed
from tests.conftest import DIGITS, start_cloud, stop

SLOW = "10mbit,50ms"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", DIGITS)
    yield address
    stop(proc)


def _auto(address: str, emulate: str | None, metrics_path=None, **options):
    return split(digits_cnn(), "block3", factory=DIGITS, connect=Link(address, emulate=emulate),
                 codecs=Codecs("auto", **options), metrics_path=metrics_path)


def _ratio(spec: str) -> float:
    return next(c.ratio for c in auto_codecs.ACTIVATIONS + auto_codecs.GRADIENTS if c.spec == spec)


def test_a_fast_link_keeps_lossless_codecs_and_the_choice_is_in_the_metrics(cloud, tmp_path):
    path = tmp_path / "steps.jsonl"
    model = _auto(cloud, None, metrics_path=path)
    with model:
        specs = model.session.codecs.specs
        lossless = {c.spec for c in auto_codecs.ACTIVATIONS + auto_codecs.GRADIENTS if c.cost == 0}
        assert set(specs.values()) <= lossless, specs
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        loss = model.remote_loss(torch.nn.CrossEntropyLoss())(model(torch.randn(8, 1, 8, 8)), torch.zeros(8).long())
        loss.backward()
        opt.step()
    record = json.loads(path.read_text().splitlines()[0])
    auto = record["notes"]["codecs_auto"]
    assert auto["specs"] == {k: specs[k] for k in ("fwd", "ret", "bwd", "ret_bwd")}
    assert auto["rtt_ms"] < 50 and auto["budget"] == 0.002


def test_a_slow_link_compresses_both_ways(cloud):
    with _auto(cloud, SLOW) as model:
        specs = model.session.codecs.specs
        link = model.metrics.notes["codecs_auto"]
    assert _ratio(specs["fwd"]) >= 4 and _ratio(specs["bwd"]) >= 2, specs
    # the probes saw the emulated link: a round trip of 100 ms, and rates of the order of 10 Mbit/s
    assert 90 <= link["rtt_ms"] < 1000 and link["up_MBps"] < 5, link


def test_the_choice_obeys_the_clouds_policy(tmp_path):
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS,
                                   "--allow-codecs", "identity,fp16,lowrank", "--allow-codecs", "bwd=identity,fp16")
    try:
        with _auto(address, SLOW, budget=0.005) as model:
            specs = model.session.codecs.specs
    finally:
        stop(proc)
    # within budget 0.005 the most compressing codec is lowrank:rank=1 (its gradient partner is identity)
    assert specs["fwd"] == "lowrank:rank=1" and specs["bwd"] == "identity", specs


def test_a_named_direction_is_kept(cloud):
    with split(digits_cnn(), "block3", factory=DIGITS, connect=Link(cloud, emulate=SLOW),
               codecs=Codecs("auto", bwd="identity")) as model:
        specs = model.session.codecs.specs
    assert specs["bwd"] == "identity" and specs["fwd"] != "identity"


def _link(rate: float, rtt: float = 0.1, **allowed) -> LinkEstimate:
    return LinkEstimate(rtt=rtt, up=rate, down=rate, allowed={k: frozenset(v) for k, v in allowed.items()})


def test_the_rule_over_rates_budgets_and_policies():
    assert auto_codecs.choose(_link(math.inf, 1e-4), Codecs("auto")).specs == dict.fromkeys(
        ("fwd", "ret", "bwd", "ret_bwd"), "identity")
    # 1.25 MB/s: nothing within 0.002 serialises 4 MiB in 50 ms, so the most compressing one
    assert auto_codecs.choose(_link(1.25e6), Codecs("auto")).specs["fwd"] == "fixpoint:bits=4"
    assert auto_codecs.choose(_link(1.25e6), Codecs("auto", budget=0)).specs["fwd"] == "fixpoint:bits=8"
    # 200 MB/s over 0.1 s: fp16 is fast enough, and is preferred to anything more lossy or compressing
    assert auto_codecs.choose(_link(200e6, 0.02), Codecs("auto")).specs["fwd"] == "fp16"
    # a linear codec is not chosen when its gradient partner is refused on the way back
    refused = _link(1.25e6, fwd={"lowrank", "identity"}, bwd={"fp16"})
    assert auto_codecs.choose(refused, Codecs("auto", budget=0.005)).specs["fwd"] == "identity"
    with pytest.raises(ConfigError, match="no codec for fwd"):
        auto_codecs.choose(_link(1.25e6, fwd={"c3sl"}), Codecs("auto"))
    with pytest.raises(ConfigError, match="budget"):
        Codecs("auto", budget=1.5)


def _ask(conn: transports.Connection, msg) -> protocol.Message:
    conn.send(protocol.encode(msg) if not isinstance(msg, list) else msg)
    return protocol.decode(conn.recv(30))


def test_probes_need_no_session_echo_what_came_and_are_capped(cloud):
    with transports.connect(cloud) as conn:
        pad = np.arange(1000, dtype=np.uint8)
        reply = _ask(conn, Probe(pad=pad, echo=True))
        assert isinstance(reply, Probed) and bytes(reply.pad) == pad.tobytes() and reply.allowed == {}
        assert _ask(conn, Probe(pad=pad)).pad is None  # no echo asked, none sent
        big = _ask(conn, Probe(pad=np.zeros((1 << 20) + 1, np.uint8), echo=True))
        assert isinstance(big, Error) and big.code == "too_large" and "cap" in big.message
        wide = _ask(conn, Probe(pad=np.zeros(8, np.float32)))
        assert isinstance(wide, Error) and "uint8" in wide.message
        assert isinstance(_ask(conn, Probe()), Probed)  # the cloud goes on answering


def test_an_open_connection_is_probed_then_used_for_the_session(cloud):
    connection = transports.connect(cloud)
    with split(digits_cnn(), "block3", factory=DIGITS, connect=connection, codecs=Codecs("auto")) as model:
        assert model.session.session_id and model.metrics.notes["codecs_auto"]["rtt_ms"] < 50


def test_a_resumed_session_keeps_the_codecs_it_was_saved_with(tmp_path):
    """Saved on a slow link (compressing codecs), resumed on loopback: a new measurement would pick
    lossless codecs, the handshake's identity check would refuse them, and a run that went on with
    them would diverge from the one interrupted. The checkpoint's codecs are used instead."""
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS,
                                   "--checkpoint-dir", str(tmp_path / "ck"))
    x, y = torch.randn(8, 1, 8, 8), torch.randint(0, 10, (8,))
    try:
        first = _auto(address, SLOW)
        saved = dict(first.session.codecs.specs)
        assert saved["fwd"] != "identity", saved
        opt = first.attach(torch.optim.SGD(first.parameters(), lr=0.1))
        first.remote_loss(torch.nn.CrossEntropyLoss())(first(x), y).backward()
        opt.step()
        first.save_checkpoint(tmp_path / "edge")
        first.session.drop()
        with split(digits_cnn(), "block3", factory=DIGITS, connect=address, codecs=Codecs("auto"),
                   resume_from=tmp_path / "edge") as second:
            assert second.session.codecs.specs == saved and second.stage.step == 1
            opt = second.attach(torch.optim.SGD(second.parameters(), lr=0.1))
            second.remote_loss(torch.nn.CrossEntropyLoss())(second(x), y).backward()
            opt.step()
        with pytest.raises(ConfigError, match="different model, cut, codecs"):  # a named direction still checked
            split(digits_cnn(), "block3", factory=DIGITS, connect=address, codecs=Codecs("auto", bwd="identity"),
                  resume_from=tmp_path / "edge")
    finally:
        stop(proc)
