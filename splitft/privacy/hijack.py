"""Catching a cloud that steers the edge: scaled-gradient probes in a U-shape split.

In a U-shape split the edge returns the gradient ``g`` of its loss at the trunk's output, and
an honest cloud answers with ``dz = Jᵀ g``, the backward of its part: *linear in g*, whatever
the model, its normalisation or dropout. A cloud running feature-space hijacking (FSHA) answers
with the gradient of its own discriminator instead, which does not depend on ``g`` at all.

The probe: on a random half of the training steps (drawn from the edge's private generator, so
the cloud cannot predict which) the edge sends ``c · g`` with ``c`` drawn in ``scale``, and
divides the answer by ``c`` before training on it, so an honest cloud's gradient reaches the
edge unchanged. It then compares the gain ``|dz| / |g sent|`` of the probe with the median gain
of the last few ordinary steps: an honest backward keeps the gain (``|Jᵀ c g| / |c g|``), a
cloud that ignores ``g`` shows a gain ``c`` times smaller. Two probes in a row below
``threshold`` raise :class:`~splitft.errors.CloudMisbehaving` from the backward, before the edge
steps on it, and every later forward is refused.

Costs: nothing crosses but the gradient; the cloud's part trains on a scaled gradient on the
probed steps (under Adam almost nothing; under SGD a ``c`` times longer step, so a lower
``rate`` or learning rate there). Limits: a cloud that scales its crafted gradient with ``|g|``
(it can see that a probed gradient is larger) keeps the gain and passes; the probe tests that
the answer depends on what the edge sent, in size, not that it is the true backward.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from dataclasses import dataclass

import torch

from ..errors import CloudMisbehaving, ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Probe:
    """Settings of the hijack detector (``Defences(probe=Probe())``).

    Args:
        rate: share of training steps probed (drawn at random each step). High, because the
            attack is fast: on the digits a hijacking cloud's decoder passed SSIM 0.5 after 13 to
            22 steps; at 0.5 the probe stopped it first in 30 runs of 30, at 0.1 in 17 of 30.
        scale: the range the factor ``c`` is drawn from. Large, so that a cloud that ignores the
            gradient (ratio ~1/c) stays far under ``threshold`` while an honest one, whose gain
            varies from batch to batch, stays above it: on the digits the lowest honest ratio was
            0.65; on MiniLM 0.36, and a rank-1 low-rank codec there still raised a false alarm.
        threshold: a probe fails when its gain is below this share of the recent median gain
            (an honest cloud keeps ~1; one that ignores the gradient shows ~1/c).
        strikes: failed probes in a row that stop training.
        warmup: ordinary steps seen before the first probe (the median needs them).
        window: the recent ordinary steps whose median gain a probe is compared with. Few: the
            gain drifts as training goes, and a hijacking cloud's drifts fast (its critic's
            gradient grew ~15% a step in the digits measurements), so a long window lags behind it
            and lets its probes pass.
    """

    rate: float = 0.5
    scale: tuple[float, float] = (16.0, 32.0)
    threshold: float = 0.25
    strikes: int = 2
    warmup: int = 3
    window: int = 5

    def __post_init__(self) -> None:
        if not (0 < self.rate <= 1):
            raise ConfigError(f"Probe(rate=...) is a share of steps in (0, 1], got {self.rate!r}")
        low, high = self.scale
        if not (1 < low <= high):
            raise ConfigError(f"Probe(scale=(low, high)) needs 1 < low <= high, got {self.scale!r}")
        if not (0 < self.threshold < 1):
            raise ConfigError(f"Probe(threshold=...) is in (0, 1), got {self.threshold!r}")
        counts = (self.strikes, self.warmup, self.window)
        if not all(isinstance(n, int) and n >= 1 for n in counts):
            raise ConfigError(f"Probe(strikes=..., warmup=..., window=...) are ints >= 1, got {counts!r}")


class HijackDetector:
    """The probe's state on one edge: recent gains, strikes, and whether it has tripped."""

    def __init__(self, probe: Probe, generator: torch.Generator):
        self.probe = probe
        self.generator = generator
        self.gains: deque[float] = deque(maxlen=probe.window)
        self.strikes = 0
        self.probes = 0
        self.failed = 0
        self.steps = 0  # training steps whose answer was checked
        self.tripped: str | None = None
        self.last_ratio: float | None = None
        self.lowest_ratio: float | None = None  # how close an honest cloud came to an alarm

    def draw(self) -> float:
        """The factor for the next training step: 1 (ordinary) or a probe's ``c``."""
        self.refuse_if_tripped()
        u = torch.rand((2,), generator=self.generator, dtype=torch.float64)
        if len(self.gains) < self.probe.warmup or float(u[0]) >= self.probe.rate:
            return 1.0
        low, high = self.probe.scale
        return low + (high - low) * float(u[1])

    def refuse_if_tripped(self) -> None:
        if self.tripped is not None:
            raise CloudMisbehaving(self.tripped)

    def check(self, factor: float, sent_norm: float, answer_norm: float) -> None:
        """Record one step's gain; raise :class:`CloudMisbehaving` when the probes say the cloud's
        answer does not scale with what was sent."""
        self.steps += 1
        if not (sent_norm > 0 and answer_norm == answer_norm):
            return
        gain = answer_norm / sent_norm
        if factor == 1.0:
            self.gains.append(gain)
            return
        self.probes += 1
        reference = statistics.median(self.gains) if self.gains else 0.0
        if reference <= 0:
            return
        ratio = gain / reference
        self.last_ratio = ratio
        self.lowest_ratio = ratio if self.lowest_ratio is None else min(self.lowest_ratio, ratio)
        if ratio >= self.probe.threshold:
            self.strikes = 0
            return
        self.failed += 1
        self.strikes += 1
        log.warning("hijack probe %d: the cloud's answer to a gradient scaled by %.2f kept %.2f of the usual gain",
                    self.probes, factor, ratio)
        if self.strikes >= self.probe.strikes:
            self.tripped = (
                f"the cloud's gradients do not follow what the edge sends: on {self.strikes} probes in a row the "
                f"gradient sent was scaled by a factor of {self.probe.scale[0]:g}-{self.probe.scale[1]:g} and the "
                f"answer kept only {ratio:.2f} of the usual gain (an honest backward keeps ~1). The cloud is steering "
                f"the edge (e.g. feature-space hijacking); training stopped at step {self.steps}, before the edge "
                "trained on this answer. Do not use this cloud")
            raise CloudMisbehaving(self.tripped)

    def snapshot(self) -> dict[str, float | int | bool | None]:
        return {"probes": self.probes, "failed_probes": self.failed, "tripped": self.tripped is not None,
                "last_probe_ratio": self.last_ratio, "lowest_probe_ratio": self.lowest_ratio,
                "checked_steps": self.steps}
