"""``Codecs("auto")`` / ``--codecs auto``: each direction's codec chosen from the measured link.

What the choice knows of each codec is measured, not guessed: :data:`ACTIVATIONS` and
:data:`GRADIENTS` hold each one's bytes ratio (raw over wire bytes) and quality cost (test
accuracy lost against identity) from the digits ablation of ``docs/codecs.md`` (``python
scripts/ablate.py --links loopback --seeds 3 --epochs 10``: 10 epochs, 3 seeds, plain split at
``block3``; identity reached 0.9880). The budget says how much of that accuracy may be given up.

The rule: compression pays while the bytes, not the latency, set a message's time. A direction
is coded with the least lossy codec (then the least compressing) under which a reference message
(:data:`REFERENCE_BYTES`, a MiniLM batch's activation) serialises within the link's one-way delay
or :data:`FLOOR_SECONDS`, whichever is longer; when none is that fast, with the most compressing
codec within the budget. So loopback keeps identity and ``10mbit,50ms`` compresses. Only codecs
the cloud's policy allows in that direction are considered (the probe's answer names them).
Codecs that need a binarized edge (``binary``) or sample ids (``acsgd``) are never chosen.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import compressors
import transports

from ..errors import ConfigError
from ..options import Codecs
from .link_probe import LinkEstimate, measure

log = logging.getLogger(__name__)

#: The message a choice is sized for: MiniLM's activation after layer 1, 32 x 64 x 384 float32
#: (3 MiB), rounded up.
REFERENCE_BYTES = 4 << 20
#: The time a reference message may always take: less than the compute of any step it would
#: be sent for measured here (a MiniLM forward alone takes 0.3 s on 2 cores), and a quarter of
#: the round trip of the fastest emulated link of the benchmarks (``100mbit,20ms``).
FLOOR_SECONDS = 0.02


@dataclass(frozen=True)
class Candidate:
    """A codec spec with what it was measured to do (see the module's source)."""

    spec: str
    ratio: float
    cost: float


#: Activations (``fwd``, ``ret``): the digits ablation's forward ratio and accuracy lost.
ACTIVATIONS = (
    Candidate("identity", 1.0, 0.0),            # 0.9880
    Candidate("fp16", 2.0, 0.0),                # 0.9880
    Candidate("fixpoint:bits=8", 4.0, 0.0),     # 0.9880
    Candidate("fixpoint:bits=4", 7.9, 0.0010),  # 0.9870
    Candidate("lowrank:rank=4", 10.4, 0.0047),  # 0.9833
    Candidate("lowrank:rank=1", 39.3, 0.0028),  # 0.9852; MiniLM needed 36 steps to 95% against 24
    Candidate("c3sl:r=4", 4.0, 0.0168),         # 0.9712
    Candidate("c3sl:r=16", 15.4, 0.1106),       # 0.8774
)
#: Gradients (``bwd``, ``ret_bwd``) of a non-linear forward codec: fp16's and fixpoint's rows,
#: whose gradients crossed as fp16 and 8-bit fixed point at identity's accuracy.
GRADIENTS = (
    Candidate("identity", 1.0, 0.0),
    Candidate("fp16", 2.0, 0.0),
    Candidate("fixpoint:bits=8", 4.0, 0.0),
)
#: Which way each direction travels, and what it carries.
DIRECTIONS = {"fwd": ("up", ACTIVATIONS), "bwd": ("down", GRADIENTS),
              "ret": ("down", ACTIVATIONS), "ret_bwd": ("up", GRADIENTS)}
#: The linear codecs of the table.
LINEAR = frozenset({"lowrank", "c3sl"})
#: A direction's gradient partner, which a linear forward codec fixes (its adjoint is already small).
PARTNER = {"fwd": "bwd", "ret": "ret_bwd"}


@dataclass(frozen=True)
class AutoChoice:
    """The codecs chosen, and the measurement and budget they were chosen from."""

    specs: dict[str, str]
    link: LinkEstimate
    budget: float

    def record(self) -> dict[str, Any]:
        """For the run's metrics and log."""
        return {"specs": dict(self.specs), "budget": self.budget, **self.link.summary()}


def _allowed(link: LinkEstimate, slot: str, spec: str) -> bool:
    names = link.allowed.get(slot)
    return names is None or compressors.parse_spec(spec)[0] in names


def _linear(spec: str) -> bool:
    """Whether the forward codec fixes its gradient codec: a linear codec's adjoint crosses back
    (docs/codecs.md), already as small as the forward payload."""
    return compressors.parse_spec(spec)[0] in LINEAR


def pick(slot: str, link: LinkEstimate, budget: float) -> str:
    """The codec of ``slot`` under the rule of this module."""
    way, table = DIRECTIONS[slot]
    rate = link.up if way == "up" else link.down
    within = [c for c in table if c.cost <= budget and _allowed(link, slot, c.spec)]
    partner = PARTNER.get(slot)
    if partner is not None:  # a linear codec needs its partner allowed on the way back
        within = [c for c in within if not _linear(c.spec)
                  or _allowed(link, partner, compressors.default_grad_spec(c.spec))]
    if not within:
        names = sorted(link.allowed.get(slot, ()))
        raise ConfigError(f"--codecs auto: no codec for {slot} is both allowed by the cloud ({', '.join(names)}) "
                          f"and within the budget {budget}; name one (--fwd/--bwd) or raise the budget")
    target = max(link.rtt / 2, FLOOR_SECONDS)
    fast = [c for c in within if REFERENCE_BYTES / (c.ratio * rate) <= target]
    if fast:
        return min(fast, key=lambda c: (c.cost, c.ratio)).spec
    return max(within, key=lambda c: (c.ratio, -c.cost)).spec


def choose(link: LinkEstimate, codecs: Codecs) -> AutoChoice:
    """Every direction ``codecs`` leaves open, chosen for ``link``; the named ones kept."""
    named = {"bwd": codecs.bwd, "ret": codecs.ret, "ret_bwd": codecs.ret_bwd}
    specs: dict[str, str] = {}
    for slot in ("fwd", "ret", "bwd", "ret_bwd"):
        if named.get(slot) is not None:
            specs[slot] = str(named[slot])
        elif slot in specs:
            continue  # fixed by a linear forward codec
        else:
            specs[slot] = pick(slot, link, codecs.budget)
            if slot in PARTNER and _linear(specs[slot]) and named.get(PARTNER[slot]) is None:
                specs[PARTNER[slot]] = compressors.default_grad_spec(specs[slot])
    return AutoChoice(specs, link, codecs.budget)


def resolve(connection: transports.Connection, codecs: Codecs, timeout: float) -> tuple[Codecs, AutoChoice]:
    """Measure the link over ``connection`` and return the concrete codecs (and why)."""
    link = measure(connection, timeout)
    choice = choose(link, codecs)
    log.info("codecs auto: rtt %.1f ms, up %s, down %s, budget %g -> %s", link.rtt * 1e3, _rate(link.up),
             _rate(link.down), codecs.budget, ", ".join(f"{k} {v}" for k, v in choice.specs.items()))
    chosen = replace(codecs, fwd=choice.specs["fwd"], bwd=choice.specs["bwd"], ret=choice.specs["ret"],
                     ret_bwd=choice.specs["ret_bwd"])
    return chosen, choice


def _rate(rate: float) -> str:
    return "unmeasurably fast" if rate == float("inf") else f"{rate / 1e6:.2f} MB/s"


__all__ = ["ACTIVATIONS", "AutoChoice", "GRADIENTS", "choose", "pick", "resolve"]
