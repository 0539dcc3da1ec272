"""Codec names → classes, and the small spec grammar users type: ``name[:key=value,...]``.

The name travels in every payload, so a payload names its own decoder. A spec that comes from
a peer goes through :func:`check_spec` (with this end's :class:`~compressors.Bounds`) before
anything is built from it.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any, TypeVar

from .base import Codec
from .errors import CompressionError, PolicyError, UnknownCodecError
from .policy import Bounds, check_classification, check_options

_REGISTRY: dict[str, type[Codec]] = {}

C = TypeVar("C", bound=type[Codec])


def register(cls: C) -> C:
    """Class decorator: make a codec constructible by its ``name``.

    Refuses a class that leaves an option unclassified (see :mod:`compressors.policy`), so no
    option becomes negotiable by omission.
    """
    name = cls.name
    check_classification(cls)
    if name in _REGISTRY and _REGISTRY[name] is not cls:
        raise CompressionError(f"codec name {name!r} is registered twice")
    _REGISTRY[name] = cls
    return cls


def names() -> list[str]:
    """Every registered codec name, sorted."""
    return sorted(_REGISTRY)


def codec_class(name: str) -> type[Codec]:
    """The class registered under ``name``; an unknown name raises listing the valid ones."""
    try:
        return _REGISTRY[name]
    except KeyError:
        close = difflib.get_close_matches(name, _REGISTRY, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UnknownCodecError(
            f"unknown codec {name!r}; valid names: {', '.join(names())}.{hint}"
        ) from None


def _parse_value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"c3sl:r=4,foo=bar"`` into ``("c3sl", {"r": 4, "foo": "bar"})``."""
    if not isinstance(spec, str) or not spec.strip():
        raise CompressionError(f"a codec spec is a non-empty string such as 'fp16' or 'c3sl:r=4', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise CompressionError(
                f"codec spec {spec!r}: option {item!r} is not key=value (example: 'fixpoint:bits=8')"
            )
        options[key.strip()] = _parse_value(value.strip())
    return name.strip(), options


def _known_options(name: str, cls: type[Codec], options: dict[str, Any]) -> None:
    allowed = cls.options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise CompressionError(
            f"codec {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(allowed) or '(none)'}"
        )


def make_codec(spec: str, *, seed: int = 0, bounds: Bounds | None = None) -> Codec:
    """Build a codec from a spec string, validating its options.

    With ``bounds``, the codec is for traffic with an untrusted peer: the spec must pass
    :func:`check_spec` under those bounds, and the codec keeps them (``codec.bounds``) to
    enforce what only payloads reveal, such as the largest AC-SGD sample id.
    """
    if bounds is not None:
        check_spec(spec, bounds)
    name, options = parse_spec(spec)
    cls = codec_class(name)
    _known_options(name, cls, options)
    codec = cls(seed=seed, **options)
    codec.bounds = bounds
    return codec


def check_spec(spec: str, bounds: Bounds, allowed: Iterable[str] | None = None) -> str:
    """The canonical form of a spec a peer asked for, once this end agrees to build it.

    Refuses, with a :class:`PolicyError` naming the codec, option, value and bound: a spec
    longer than ``bounds.max_spec_chars``; a codec name outside ``allowed`` (codec names; None
    allows every registered codec); an option that names a local resource (``acsgd:path``);
    an option beyond its bound (``lowrank:iters``, ``c3sl:r``, ``acsgd:capacity``, ...).
    Unknown names and options, and values the codec itself rejects, raise
    :class:`CompressionError` as :func:`make_codec` does: the codec is built once with seed 0
    to validate them, which costs nothing in proportion to its options.
    """
    if not isinstance(bounds, Bounds):
        raise CompressionError(f"check_spec needs a compressors.Bounds, got {type(bounds).__name__}")
    if isinstance(spec, str) and len(spec) > bounds.max_spec_chars:
        raise PolicyError(
            f"codec spec of {len(spec)} characters exceeds this end's bound max_spec_chars={bounds.max_spec_chars}",
            value=len(spec), bound="max_spec_chars",
        )
    name, options = parse_spec(spec)
    if allowed is not None:
        permitted = sorted({str(a) for a in allowed})
        if name not in permitted:
            raise PolicyError(
                f"codec {name!r} is not allowed on this end; allowed: {', '.join(permitted) or '(none)'}",
                codec=name,
            )
    cls = codec_class(name)
    _known_options(name, cls, options)
    check_options(cls, options, bounds)
    cls(seed=0, **options)
    return canonical_spec(spec)


def canonical_spec(spec: str) -> str:
    """A normal form of a spec, so two ends can compare what they were configured with."""
    name, options = parse_spec(spec)
    codec_class(name)
    return name + (":" + ",".join(f"{k}={options[k]}" for k in sorted(options)) if options else "")


def default_grad_spec(forward_spec: str) -> str:
    """The gradient codec that pairs with a forward codec when the user names none."""
    name, _ = parse_spec(forward_spec)
    return codec_class(name).default_grad_codec
