"""Invariant 4: every byte is counted; the edge's report equals what the cloud saw on the wire."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import splitft
from splitft import Codecs, Schedule
from splitft.app.data import batches, load_digits
from splitft.app.models import digits_cnn
from tests.conftest import DIGITS


def _train(model, steps, rejoin):
    data = load_digits()[0]
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))
    crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
    for (x, y, ids), _ in zip(batches(data, 64, shuffle=True), range(steps)):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.sync()


def test_edge_and_cloud_count_the_same_wire_bytes(inproc_cloud, tmp_path):
    for rejoin, fwd in ((None, "identity"), ("head", "fp16")):
        model = splitft.split(digits_cnn(), "block3", rejoin, factory=DIGITS, codecs=fwd,
                              connect=inproc_cloud.connect(), metrics_path=tmp_path / "m.jsonl")
        _train(model, 5, rejoin)
        (session,) = inproc_cloud.server.sessions.values()
        for direction in ("up", "down"):
            edge, cloud = model.metrics.direction(direction), session.metrics.direction(direction)
            assert edge.wire == cloud.wire and edge.messages == cloud.messages
        model.close()


@pytest.mark.parametrize("eager", [True, False], ids=["eager-backward", "backward-message"])
def test_raw_payload_and_ratio_per_direction(inproc_cloud, eager):
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, codecs=Codecs("fp16", bwd="fp16"),
                          connect=inproc_cloud.connect(), schedule=Schedule(eager_backward=eager))
    with model:
        _train(model, 3, None)
        activations = model.metrics.bytes[("up", "activation")]
        gradients = model.metrics.bytes[("down", "gradient")]
        cut = 64 * 32 * 8 * 8  # elements crossing per step at the digits cut, batch 64
        labels = 64 * 8
        assert activations.raw == 3 * (4 * cut + labels)
        assert activations.payload == 3 * (2 * cut + labels)
        assert gradients.raw == 3 * 4 * cut and gradients.payload == 3 * 2 * cut
        # headers are small; the first forward also carries the edge's generator state, which
        # the half (no dropout) turns out not to need, so the others go without
        state = torch.get_rng_state().numel()
        assert activations.payload + state < activations.wire < activations.payload + 3 * 1024 + state
        if eager:  # the gradient rode on the loss's reply: no message, no header of its own
            assert gradients.messages == 0 and gradients.ratio == 2.0
            assert model.metrics.bytes[("up", "gradient")].messages == 0  # no backward request either
        else:
            assert gradients.messages == 3 and 1.9 < gradients.ratio < 2.0


def test_jsonl_has_one_record_per_step(inproc_cloud, tmp_path):
    path = tmp_path / "run.jsonl"
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=inproc_cloud.connect(), metrics_path=path)
    with model:
        _train(model, 4, None)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[-1]["bytes"]["up"]["wire"] > records[0]["bytes"]["up"]["wire"] > 0


def test_the_handshake_is_timed_apart_from_training(inproc_cloud):
    """The hello waits for the cloud to build its model (seconds for a pre-trained transformer);
    counting that as training 'wait' would make the report's edge compute come out too small."""
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=inproc_cloud.connect())
    with model:
        assert model.metrics.seconds["handshake"] > 0 and model.metrics.seconds.get("wait", 0.0) == 0.0
        _train(model, 1, None)
        assert model.metrics.seconds["wait"] > 0
