"""Codecs in the runtime: convergence on real digits, pairing, sample ids, desync repair."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import splitft
from splitft.wire.coding import resolve_codecs
from splitft.app.data import batches, load_digits
from splitft.errors import ConfigError
from splitft.app.experiment import run_digits
from splitft.app.models import digits_cnn
from tests.conftest import DIGITS

FLOOR = 0.93  # identity reaches ~0.98 in these 4 epochs; every codec must clear the same floor


@pytest.fixture(scope="module")
def identity_accuracy():
    return run_digits("identity", epochs=4).accuracy


@pytest.mark.parametrize("fwd", ["fp16", "fixpoint:bits=4", "lowrank:rank=2", "c3sl:r=4", "binary", "acsgd:bits=4"])
def test_training_through_each_codec_reaches_the_floor(fwd, identity_accuracy):
    assert identity_accuracy >= FLOOR
    result = run_digits(fwd, epochs=4)
    assert result.accuracy >= FLOOR, (fwd, result.accuracy)
    assert result.fwd_ratio > 1.5 and result.bwd_ratio > 1.5  # every pairing shrinks both directions


def test_ushape_codecs_apply_to_both_crossings():
    result = run_digits("c3sl:r=4", epochs=3, ushape=True)
    assert result.accuracy >= 0.9
    assert result.bwd_ratio > 3.5


def test_default_pairings():
    pairs = {spec: resolve_codecs(spec)["bwd"] for spec in
             ("identity", "fp16", "binary", "acsgd", "c3sl:r=8", "lowrank:rank=2", "fixpoint:bits=4")}
    assert pairs == {"identity": "identity", "fp16": "fp16", "binary": "fixpoint:bits=8",
                     "acsgd": "fixpoint:bits=8", "c3sl:r=8": "identity", "lowrank:rank=2": "identity",
                     "fixpoint:bits=4": "fixpoint:bits=8"}
    assert resolve_codecs("c3sl:r=4", "fp16")["bwd"] == "fp16"
    assert resolve_codecs("c3sl:r=4")["ret"] == "c3sl:r=4"


def test_acsgd_without_sample_ids_is_a_clear_error(inproc_cloud):
    data = load_digits()[0]
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, codecs="acsgd", connect=inproc_cloud.connect())
    with model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        x, y, ids = next(batches(data, 16, shuffle=False))
        with pytest.raises(ConfigError, match="sample_ids"):
            crit(model(x), y)
        model.eval()
        with torch.no_grad():
            model.predict(x)  # evaluation needs no ids


def test_a_lost_acsgd_message_is_detected_and_repaired(inproc_cloud, caplog):
    data = load_digits()[0]
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, codecs="acsgd:bits=4",
                          connect=inproc_cloud.connect())
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        (x, y, ids), (x2, y2, ids2) = list(batches(data, 32, shuffle=False))[:2]

        def step(x, y, ids):
            crit(model(x, sample_ids=ids), y).backward()
            opt.step()
            opt.zero_grad()

        step(x, y, ids)  # warm-up send fills both buffers
        # A message lost in transit: the edge's codec advanced, the cloud never saw it.
        codec = model.stage.codecs.slots["fwd"]
        from compressors import CodecContext
        with torch.no_grad():
            codec.encode(model(x).activation * 1.5, CodecContext(train=True, sample_ids=ids.numpy()))
        with caplog.at_level(logging.WARNING, logger="splitft.edge"):
            step(x, y, ids)
        assert "resending at full precision" in caplog.text
        step(x2, y2, ids2)
        model.sync()
        (session,) = inproc_cloud.server.sessions.values()
        edge_state, cloud_state = codec.state_dict(), session.codecs.slots["fwd"].state_dict()
        assert set(edge_state) == set(cloud_state)
        for key in edge_state:
            a, b = torch.as_tensor(edge_state[key]), torch.as_tensor(cloud_state[key])
            assert torch.equal(a, b), key
