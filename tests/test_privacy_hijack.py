"""The hijack probe against real ``splitft cloud`` processes: a cloud running feature-space
hijacking (tests/fsha.py) is caught and training stops with CloudMisbehaving; an honest cloud
answers every probe as a backward does and is never accused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import splitft
from splitft.app.data import batches, load_digits
from splitft.app.models import digits_cnn
from splitft.errors import CloudMisbehaving
from splitft.privacy import Defences, Probe, protect
from splitft.privacy.attacks import ssim
from splitft.privacy.evaluate import data
from tests import fsha
from tests.conftest import DIGITS, InprocCloud, start_cloud, stop

HIJACK = "tests.fsha:fsha_digits"
STEPS = 40


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("hijack"), "--sessions", "0", "--model", DIGITS,
                                     "--model", HIJACK)
    yield address
    stop(proc)


def _train(address: str, factory: str, probe: Probe, steps: int = STEPS):
    """Train the digits CNN U-shape against ``factory`` for ``steps`` steps; returns the protection
    and the exception that stopped training (None: it ran to the end)."""
    train, _ = load_digits()
    model = splitft.split(digits_cnn(), "block3", "head", factory=factory, connect=address,
                          faults=splitft.Faults(timeout=60))
    with model:
        protection = protect(model, Defences(probe=probe, seed=5))
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
        crit = nn.CrossEntropyLoss()
        data = [(x, y) for (x, y, _), _ in zip(batches(train, 32, shuffle=True, seed=1), range(steps))]
        for i, (x, y) in enumerate(data):
            try:
                crit(model(x), y).backward()
            except CloudMisbehaving as exc:
                with pytest.raises(CloudMisbehaving):  # and no further step is taken
                    model(x)
                return protection, exc, i
            opt.step()
            opt.zero_grad()
    return protection, None, steps


def test_the_fixture_hijacks_an_unprotected_edge():
    """The malicious cloud is a working attack: left alone, its decoder rebuilds held-out digits
    from the edge's activations within a few dozen steps. The cloud is on a thread of this process
    (the same server code) so that the attacker it built, and only that one, can be read."""
    cloud = InprocCloud([HIJACK])
    before = len(fsha.ATTACKERS)
    train, _, test = data()
    try:
        model = splitft.split(digits_cnn(), "block3", "head", factory=HIJACK, connect=cloud.connect(),
                              faults=splitft.Faults(timeout=60))
        with model:
            (attacker,) = fsha.ATTACKERS[before:]  # the cloud's parameter count builds no attacker
            opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
            for epoch in range(5):
                for x, y, _ in batches(train, 64, shuffle=True, seed=0, epoch=epoch):
                    nn.functional.cross_entropy(model(x), y).backward()
                    opt.step()
                    opt.zero_grad()
            edge = model.model.eval()
            with torch.no_grad():
                z = edge.block2(edge.block1(test.x))
    finally:
        cloud.close()
    assert attacker.steps == 85
    assert ssim(attacker.reconstruct(z), test.tensor().float()) > 0.5


def test_probe_stops_a_hijacking_cloud(cloud):
    protection, error, step = _train(cloud, HIJACK, Probe(rate=0.5, warmup=3))
    assert isinstance(error, CloudMisbehaving), protection.detector.snapshot()
    assert "steering the edge" in str(error)
    assert protection.detector.failed >= 2 and step < STEPS


def test_probe_never_accuses_an_honest_cloud(cloud):
    protection, error, _ = _train(cloud, DIGITS, Probe(rate=0.5, warmup=3))
    assert error is None, protection.detector.snapshot()
    snap = protection.detector.snapshot()
    assert snap["probes"] >= 5 and snap["failed_probes"] == 0
    assert 0.5 < snap["last_probe_ratio"] < 2.0  # an honest backward keeps its gain when the gradient is scaled
    assert 0.5 < snap["lowest_probe_ratio"] <= snap["last_probe_ratio"]


def test_probe_checks_a_trunk_of_several_modules(cloud):
    """A trunk of several modules hands the edge's forward an inner output at its first module;
    the probe must still see the gradient the edge returns for the trunk's own output."""
    train, _ = load_digits()
    model = splitft.split(digits_cnn(), "block2", "head", factory=DIGITS, connect=cloud,
                          faults=splitft.Faults(timeout=60))
    with model:
        protection = protect(model, Defences(probe=Probe(rate=0.5, warmup=3), seed=5))
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
        for (x, y, _), _ in zip(batches(train, 32, shuffle=True, seed=1), range(20)):
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    snap = protection.detector.snapshot()
    assert snap["checked_steps"] == 20 and snap["probes"] >= 3 and snap["failed_probes"] == 0, snap


def test_probe_needs_a_ushape_split_and_checks_its_settings(cloud):
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=cloud, faults=splitft.Faults(timeout=60))
    with model, pytest.raises(splitft.ConfigError, match="U-shape"):
        protect(model, Defences(probe=Probe()))
    for bad in ({"rate": 0}, {"scale": (1.0, 2.0)}, {"threshold": 1.5}, {"strikes": 0}):
        with pytest.raises(splitft.ConfigError):
            Probe(**bad)
    with pytest.raises(splitft.ConfigError, match="Probe"):
        Defences(probe=0.1)


def test_the_command_line_turns_the_probe_and_adversarial_training_on():
    from splitft.app.cli import _build_parser, _task_run

    args = _build_parser().parse_args(["demo", "--topology", "ushape", "--detect-hijack", "--adversarial", "1.5"])
    defences = _task_run(args).privacy.defences(sample_rate=0.1, epochs=2)
    assert defences.probe == Probe() and defences.adversarial == 1.5 and defences.budget is None
