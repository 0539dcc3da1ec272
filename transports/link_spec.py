"""How a slow link is written down: bandwidth and one-way delay per direction, parsed from text.

``LinkSpec.parse("100mbit,20ms")`` (both directions), ``"up=100mbit,20ms;down=10mbit,50ms"``
(asymmetric) or ``"loopback"`` (no emulation); ``to_text()`` writes the same form back. The
emulator that holds messages to such a spec is :mod:`transports.link`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

from .errors import LinkSpecError

_EXAMPLES = ("'100mbit,20ms' (both directions), '10mbit,50ms', '1gbit,0ms', "
             "'up=100mbit,20ms;down=10mbit,50ms' (asymmetric), 'loopback' (no emulation)")
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)(?:e[+-]?\d+)?"
_RATE = re.compile(rf"({_NUMBER})\s*([a-z]*)(?:/s)?")
_DELAY = re.compile(rf"({_NUMBER})\s*([a-zµ]*)")
_RATE_UNITS = {"": 1.0, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_DELAY_UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6}  # value / factor = seconds
_NO_LINK = {"loopback", "none"}

@dataclass(frozen=True)
class LinkDirection:
    """One direction of a link: how fast bits leave, and how long each takes to cross.

    ``bandwidth_bps`` is in bits per second (``math.inf``: serialisation takes no time);
    ``delay_s`` is the one-way propagation delay in seconds.
    """

    bandwidth_bps: float = math.inf
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.bandwidth_bps > 0:  # also rejects NaN
            raise LinkSpecError(f"bandwidth must be > 0 bit/s, got {self.bandwidth_bps!r}")
        if not (0 <= self.delay_s < math.inf):
            raise LinkSpecError(f"one-way delay must be a finite number of seconds >= 0, got {self.delay_s!r}")

    def serialise_s(self, nbytes: int) -> float:
        """Seconds the link is busy putting ``nbytes`` on the wire."""
        return 8 * nbytes / self.bandwidth_bps

    def transfer_s(self, nbytes: int) -> float:
        """Seconds from handing ``nbytes`` to an idle link until the last byte arrives."""
        return self.serialise_s(nbytes) + self.delay_s

    @property
    def is_ideal(self) -> bool:
        return self.bandwidth_bps == math.inf and self.delay_s == 0

    def to_text(self) -> str:
        """The shortest form :meth:`LinkSpec.parse` reads back to exactly this direction."""
        return f"{_rate_text(self.bandwidth_bps)},{_delay_text(self.delay_s)}"

    def __str__(self) -> str:
        return f"{_rate_human(self.bandwidth_bps)}, {_delay_human(self.delay_s)}"


@dataclass(frozen=True)
class LinkSpec:
    """A link to emulate: ``up`` carries edge→cloud traffic, ``down`` cloud→edge.

    Build one with :meth:`parse` (``"100mbit,20ms"``), :meth:`symmetric`, or directly.
    """

    up: LinkDirection = field(default_factory=LinkDirection)
    down: LinkDirection = field(default_factory=LinkDirection)

    @classmethod
    def symmetric(cls, bandwidth_bps: float = math.inf, delay_s: float = 0.0) -> "LinkSpec":
        direction = LinkDirection(float(bandwidth_bps), float(delay_s))
        return cls(direction, direction)

    @classmethod
    def loopback(cls) -> "LinkSpec":
        """No emulation: infinite bandwidth and no delay either way."""
        return cls()

    @property
    def is_loopback(self) -> bool:
        return self.up.is_ideal and self.down.is_ideal

    def round_trip_s(self, up_bytes: int, down_bytes: int) -> float:
        """Seconds for a request and its reply over an idle link, with an instant answer."""
        return self.up.transfer_s(up_bytes) + self.down.transfer_s(down_bytes)

    @classmethod
    def coerce(cls, value: "LinkSpec | str") -> "LinkSpec":
        """Accept a spec or its text, so options can take either."""
        if isinstance(value, LinkSpec):
            return value
        if isinstance(value, str):
            return cls.parse(value)
        raise LinkSpecError(f"expected a LinkSpec or a string such as {_EXAMPLES}; got {type(value).__name__}")

    @classmethod
    def parse(cls, text: str) -> "LinkSpec":
        """Read ``"BANDWIDTH,DELAY"`` (both directions) or ``"up=BANDWIDTH,DELAY;down=BANDWIDTH,DELAY"``.

        Bandwidth: a number of bit/s with an optional unit ``bit``, ``kbit``, ``mbit``, ``gbit``
        (decimal: 1 mbit = 10^6 bit), or ``inf``. Delay: a number with ``s``, ``ms`` or ``us``
        (a bare ``0`` is allowed). ``loopback`` or ``none`` means no emulation.
        """
        if not isinstance(text, str):
            raise LinkSpecError(f"expected link text such as {_EXAMPLES}; got {type(text).__name__}")
        clean = text.strip().lower()
        if clean in _NO_LINK:
            return cls.loopback()
        try:
            if "=" not in clean:
                direction = _parse_direction(clean)
                return cls(direction, direction)
            parts: dict[str, LinkDirection] = {}
            for part in clean.split(";"):
                name, eq, rest = part.partition("=")
                name = name.strip()
                if not eq or name not in ("up", "down"):
                    raise ValueError(f"{part.strip()!r} should start with 'up=' or 'down='")
                if name in parts:
                    raise ValueError(f"{name!r} is given twice")
                parts[name] = _parse_direction(rest.strip())
            missing = {"up", "down"} - parts.keys()
            if missing:
                raise ValueError(f"the asymmetric form needs both up= and down=; {' and '.join(sorted(missing))} is missing")
            return cls(parts["up"], parts["down"])
        except (ValueError, LinkSpecError) as exc:
            raise LinkSpecError(f"cannot read link {text!r}: {exc}. Examples: {_EXAMPLES}") from None

    def to_text(self) -> str:
        """A form :meth:`parse` reads back to an equal spec (for configs and logs)."""
        if self.is_loopback:
            return "loopback"
        if self.up == self.down:
            return self.up.to_text()
        return f"up={self.up.to_text()};down={self.down.to_text()}"

    def __str__(self) -> str:
        if self.is_loopback:
            return "loopback (no emulation)"
        if self.up == self.down:
            return f"{self.up} (each direction)"
        return f"up {self.up}; down {self.down}"


def _parse_direction(text: str) -> LinkDirection:
    pieces = [p.strip() for p in text.split(",")]
    if len(pieces) != 2 or not all(pieces):
        raise ValueError(f"expected BANDWIDTH,DELAY but got {text!r}")
    return LinkDirection(_parse_rate(pieces[0]), _parse_delay(pieces[1]))


def _parse_rate(text: str) -> float:
    if text in ("inf", "unlimited"):
        return math.inf
    match = _RATE.fullmatch(text)
    unit = match.group(2) if match else None
    if unit not in _RATE_UNITS:
        hint = ""
        if unit and unit.endswith(("bps", "b", "b/s")):
            hint = " (write bits per second as bit/kbit/mbit/gbit; 'mbps' is ambiguous)"
        raise ValueError(f"bandwidth {text!r} is not a number with a unit bit, kbit, mbit or gbit{hint}")
    value = float(match.group(1)) * _RATE_UNITS[unit]
    if not value > 0:
        raise ValueError(f"bandwidth {text!r} must be more than 0")
    return value


def _parse_delay(text: str) -> float:
    match = _DELAY.fullmatch(text)
    if match is None:
        raise ValueError(f"delay {text!r} is not a number with a unit s, ms or us")
    number, unit = match.groups()
    if not unit:
        if float(number) != 0:
            raise ValueError(f"delay {text!r} needs a unit: s, ms or us (e.g. '20ms')")
        return 0.0
    if unit not in _DELAY_UNITS:
        raise ValueError(f"delay {text!r} has unit {unit!r}; use s, ms or us")
    return float(number) / _DELAY_UNITS[unit]


def _trim(value: float) -> str:
    text = repr(value)
    return text[:-2] if text.endswith(".0") else text


def _rate_text(bps: float) -> str:
    if bps == math.inf:
        return "inf"
    for unit in ("gbit", "mbit", "kbit"):
        value = bps / _RATE_UNITS[unit]
        if value >= 1 and float(_trim(value)) * _RATE_UNITS[unit] == bps:
            return _trim(value) + unit
    return _trim(bps) + "bit"


def _delay_text(seconds: float) -> str:
    if seconds == 0:
        return "0ms"
    for unit in ("s", "ms", "us"):
        value = seconds * _DELAY_UNITS[unit]
        if value >= 1 and float(_trim(value)) / _DELAY_UNITS[unit] == seconds:
            return _trim(value) + unit
    return repr(seconds) + "s"


def _rate_human(bps: float) -> str:
    if bps == math.inf:
        return "unlimited bandwidth"
    for unit, factor in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= factor:
            return f"{bps / factor:g} {unit}"
    return f"{bps:g} bit/s"


def _delay_human(seconds: float) -> str:
    if seconds == 0:
        return "no delay"
    if seconds >= 1:
        return f"{seconds:g} s one-way"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:g} ms one-way"
    return f"{seconds * 1e6:g} µs one-way"


__all__ = ["LinkDirection", "LinkSpec"]
