"""What an edge may ask the cloud for: the cloud's negotiation policy.

An edge's hello names a codec spec per direction. Every option a spec can carry is either
*negotiable* — accepted within the bounds the cloud sets here (largest rank, iterations, keys,
sample ids, ...) — or *local-only* (it names a local resource, such as a file for a memory-mapped
buffer) and never accepted from the wire. The policy also says which codecs each direction may
use. A hello outside the policy is refused with a :class:`PolicyError` (code ``policy``) that
names the direction, the option and the bound, before anything is built.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import compressors

from ..errors import PolicyError

SLOTS = ("fwd", "bwd", "ret", "ret_bwd")


@dataclass(frozen=True)
class Policy:
    """The codecs and codec options a cloud accepts from edges.

    Attributes:
        codecs: per direction (``fwd``, ``bwd``, ``ret``, ``ret_bwd``), the codec names an edge
            may ask for; a direction not named accepts every registered codec.
        bounds: caps on the negotiable options (:class:`compressors.Bounds`).
    """

    codecs: Mapping[str, frozenset[str]] = field(default_factory=dict)
    bounds: compressors.Bounds = field(default_factory=compressors.Bounds)

    def __post_init__(self) -> None:
        known = set(compressors.names())
        for slot, names in self.codecs.items():
            if slot not in SLOTS:
                raise PolicyError(f"a codec policy names directions {SLOTS}, got {slot!r}")
            unknown = set(names) - known
            if unknown:
                raise PolicyError(f"the policy for {slot} names unknown codecs {sorted(unknown)}; "
                                  f"known: {', '.join(sorted(known))}")

    @classmethod
    def allowing(cls, names: Iterable[str] | None = None, *, per_slot: Mapping[str, Iterable[str]] | None = None,
                 bounds: compressors.Bounds | None = None) -> "Policy":
        """A policy from the CLI's words: codec names for every direction, and per direction."""
        codecs: dict[str, frozenset[str]] = {}
        if names is not None:
            codecs = {slot: frozenset(names) for slot in SLOTS}
        for slot, slot_names in (per_slot or {}).items():
            codecs[slot] = frozenset(slot_names)
        return cls(codecs=codecs, bounds=bounds or compressors.Bounds())

    def check(self, specs: Mapping[str, str]) -> None:
        """Refuse codec specs an edge may not ask for; each slot's spec must be canonical already."""
        for slot in SLOTS:
            spec = specs.get(slot)
            if spec is None:
                raise PolicyError(f"{slot}: no codec spec (the hello names one for each of {SLOTS})")
            try:
                compressors.check_spec(spec, self.bounds, self.codecs.get(slot))
            except compressors.PolicyError as exc:
                raise PolicyError(f"{slot}: {exc}") from None


def parse_slot_codecs(words: Iterable[str]) -> tuple[list[str] | None, dict[str, list[str]]]:
    """``["fp16,lowrank", "bwd=identity"]`` → codecs for every direction, and per direction."""
    every: list[str] | None = None
    per_slot: dict[str, list[str]] = {}
    for word in words:
        slot, sep, names = word.partition("=")
        if sep:
            if slot not in SLOTS:
                raise PolicyError(f"--allow-codecs {word!r}: the direction must be one of {', '.join(SLOTS)}")
            per_slot.setdefault(slot, []).extend(n for n in names.split(",") if n)
        else:
            every = (every or []) + [n for n in word.split(",") if n]
    return every, per_slot


__all__ = ["Policy", "parse_slot_codecs"]
