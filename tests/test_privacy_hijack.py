"""The hijack probe against real ``splitft cloud`` processes: a cloud running feature-space
hijacking (tests/fsha.py) is caught and training stops with CloudMisbehaving; an honest cloud
answers every probe as a backward does and is never accused."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import nn

import splitft
from splitft.app.data import batches, load_digits
from splitft.app.models import digits_cnn
from splitft.errors import CloudMisbehaving
from splitft.privacy import Defences, Probe, protect
from splitft.privacy.hijack import HijackDetector
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


def _probed_run(answer: Callable[[int, float], float], steps: int = 100) -> HijackDetector:
    """The default detector over ``steps`` steps whose answer norm is ``answer(step, sent norm)``."""
    detector = HijackDetector(Probe(), torch.Generator().manual_seed(0))
    for step in range(steps):
        factor = detector.draw()
        sent = 0.07 * factor
        try:
            detector.check(factor, sent, answer(step, sent))
        except CloudMisbehaving:
            break
    return detector


def test_probe_keeps_up_with_a_gain_that_drifts():
    """A hijacking cloud's critic grows its gradient fast while it trains (~15% a step on the
    digits): its probes must fail against the recent gain, not pass against a stale one; an
    honest cloud whose gain drifts as fast is still never accused."""
    hijacking = _probed_run(lambda step, sent: 0.01 * 1.15 ** step)
    assert hijacking.tripped is not None and hijacking.failed == 2, hijacking.snapshot()
    honest = _probed_run(lambda step, sent: sent * 0.2 * 1.15 ** step)
    assert honest.tripped is None and honest.probes >= 5 and honest.failed == 0, honest.snapshot()


def test_probe_needs_a_ushape_split_and_checks_its_settings(cloud):
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=cloud, faults=splitft.Faults(timeout=60))
    with model, pytest.raises(splitft.ConfigError, match="U-shape"):
        protect(model, Defences(probe=Probe()))
    for bad in ({"rate": 0}, {"scale": (1.0, 2.0)}, {"threshold": 1.5}, {"strikes": 0}, {"window": 0}):
        with pytest.raises(splitft.ConfigError):
            Probe(**bad)
    with pytest.raises(splitft.ConfigError, match="Probe"):
        Defences(probe=0.1)


def test_the_command_line_turns_the_probe_and_adversarial_training_on():
    from splitft.app.cli import _build_parser, _task_run

    args = _build_parser().parse_args(["demo", "--topology", "ushape", "--detect-hijack", "--adversarial", "1.5"])
    defences = _task_run(args).privacy.defences(sample_rate=0.1, epochs=2)
    assert defences.probe == Probe() and defences.adversarial == 1.5 and defences.budget is None
