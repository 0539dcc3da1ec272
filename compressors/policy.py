"""What a receiver lets a peer ask for: option classes, and the bounds on what options cost.

A codec spec such as ``"lowrank:rank=4"`` may arrive from a peer that this end does not trust
(an edge's hello names the codec of every direction). Building whatever is asked would let a
few bytes of spec hold gigabytes (``acsgd:capacity=300000000``), burn minutes per step
(``lowrank:iters=400000``) or write files where the peer says (``acsgd:path=...``). So every
codec class classifies each of its options:

- ``negotiable_options``: settings both ends must agree on, which may come from a peer;
- ``local_options``: settings that name a resource of this machine (a file, a memory map, a
  device), never accepted from a peer;
- ``bounded_by``: for the negotiable options that cost work or memory, the :class:`Bounds`
  field that caps them.

:func:`check_options` applies that to one parsed spec; ``compressors.check_spec`` is the entry
point a runtime calls. Registration refuses a codec that leaves an option unclassified, so a
new option cannot silently become negotiable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from .errors import CompressionError, PolicyError

if TYPE_CHECKING:
    from .base import Codec


@dataclass(frozen=True)
class Bounds:
    """The caps a receiver imposes on the options a peer may ask for.

    The defaults admit every spec the project documents, benchmarks and tests (rank <= 6,
    r <= 16, a few iterations, data sets of thousands of samples) with room to spare, and
    refuse the values that turn a handshake into a denial of service. Raise a field on an end
    that needs more; every field is validated here, so an impossible policy cannot be built.
    """

    #: lowrank ``rank``: factors per sample; decode work is output size x rank.
    max_rank: int = field(default=64, metadata={"min": 1, "help": "largest low-rank rank an edge may ask for"})
    #: lowrank ``iters``: power iterations per encode (work on the end that encodes: the
    #: cloud encodes gradients and U-shape returns with the codec the edge named).
    max_iters: int = field(default=16, metadata={"min": 1, "help": "most low-rank power iterations per encode"})
    #: c3sl ``r``: samples bound per vector; the keys held are r x row size float64 values.
    max_r: int = field(default=64, metadata={"min": 1, "help": "most samples C3-SL binds into one vector (r)"})
    #: acsgd ``capacity``, and one more than the largest sample id a payload may name: the
    #: per-sample buffers grow to (largest id + 1) rows.
    max_ids: int = field(default=1 << 22, metadata={"min": 1, "help": "AC-SGD capacity, and one more than the largest sample id a payload may name"})
    #: acsgd ``warmup``: full-precision sends per sample before deltas start.
    max_warmup: int = field(default=100, metadata={"min": 0, "help": "most AC-SGD full-precision warm-up sends per sample"})
    #: Codecs in one chain spec (``outliers>hadamard>delta>quant``): each stage adds its work
    #: and its part of the payload to every message.
    max_stages: int = field(default=8, metadata={"min": 1, "help": "most codecs one chain spec may compose"})
    #: Length of a spec string, so parsing and logging a spec stays cheap.
    max_spec_chars: int = field(default=256, metadata={"min": 1, "help": "longest codec spec string"})

    @classmethod
    def describe(cls, name: str) -> str:
        """One line saying what the bound ``name`` caps (for a CLI's --help)."""
        return next(f.metadata["help"] for f in fields(cls) if f.name == name)

    def __post_init__(self) -> None:
        for f in fields(self):
            value, lo = getattr(self, f.name), f.metadata["min"]
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise CompressionError(f"Bounds.{f.name} must be an int >= {lo}, got {value!r}")


def bound_names() -> frozenset[str]:
    """The :class:`Bounds` fields a codec's ``bounded_by`` may name."""
    return frozenset(f.name for f in fields(Bounds))


def check_classification(cls: type[Codec]) -> None:
    """Raise unless every option of ``cls`` is exactly one of negotiable or local-only, and
    every ``bounded_by`` entry maps a negotiable option to a real :class:`Bounds` field."""
    options = set(cls.options())
    negotiable, local = set(cls.negotiable_options), set(cls.local_options)
    where = f"codec {cls.name!r} ({cls.__qualname__})"
    if negotiable & local:
        raise CompressionError(f"{where}: options {sorted(negotiable & local)} are both negotiable and local-only")
    unclassified = options - negotiable - local
    if unclassified:
        raise CompressionError(
            f"{where}: options {sorted(unclassified)} are not classified; add each to negotiable_options "
            "(both ends agree on it, a peer may ask for it) or local_options (it names a file, memory "
            "map or device of this machine)"
        )
    stale = (negotiable | local) - options
    if stale:
        raise CompressionError(f"{where}: classifies {sorted(stale)}, which are not options of its __init__")
    for option, bound in cls.bounded_by.items():
        if option not in negotiable:
            raise CompressionError(f"{where}: bounded_by names {option!r}, which is not a negotiable option")
        if bound not in bound_names():
            raise CompressionError(
                f"{where}: bounded_by maps {option!r} to {bound!r}, which is not a Bounds field "
                f"(fields: {', '.join(sorted(bound_names()))})"
            )


def check_options(cls: type[Codec], options: Mapping[str, Any], bounds: Bounds) -> None:
    """Raise :class:`PolicyError` for the first option of a peer's spec this end refuses."""
    name = cls.name
    # a local resource is named in the refusal even when another option is also out of bounds
    ordered = sorted(options, key=lambda o: (o not in cls.local_options, o))
    for option in ordered:
        value = options[option]
        if option in cls.local_options:
            raise PolicyError(
                f"codec {name!r}: option {option} names a local resource and is never accepted from a peer "
                f"(got {option}={value!r}); leave it out of the spec, and configure it on this end if needed",
                codec=name, option=option, value=value,
            )
        if option not in cls.negotiable_options:
            raise PolicyError(
                f"codec {name!r}: option {option} is not negotiable, so it is not accepted from a peer",
                codec=name, option=option, value=value,
            )
        bound = cls.bounded_by.get(option)
        if bound is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue  # a wrong type is the codec's own validation to report
        cap = getattr(bounds, bound)
        if value > cap:
            raise PolicyError(
                f"codec {name!r}: option {option}={value!r} exceeds this end's bound {bound}={cap}; "
                f"ask for {option} <= {cap}, or raise Bounds.{bound} on the receiving end",
                codec=name, option=option, value=value, bound=bound,
            )
