"""Codec names → classes, and the small spec grammar users type: ``name[:key=value,...]``.

The name travels in every payload, so a payload names its own decoder.
"""

from __future__ import annotations

import difflib
from typing import Any, TypeVar

from .base import Codec
from .errors import CompressionError, UnknownCodecError

_REGISTRY: dict[str, type[Codec]] = {}

C = TypeVar("C", bound=type[Codec])


def register(cls: C) -> C:
    """Class decorator: make a codec constructible by its ``name``."""
    name = cls.name
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


def make_codec(spec: str, *, seed: int = 0) -> Codec:
    """Build a codec from a spec string, validating its options."""
    name, options = parse_spec(spec)
    cls = codec_class(name)
    allowed = cls.options()
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise CompressionError(
            f"codec {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(allowed) or '(none)'}"
        )
    return cls(seed=seed, **options)


def canonical_spec(spec: str) -> str:
    """A normal form of a spec, so two ends can compare what they were configured with."""
    name, options = parse_spec(spec)
    codec_class(name)
    return name + (":" + ",".join(f"{k}={options[k]}" for k in sorted(options)) if options else "")


def default_grad_spec(forward_spec: str) -> str:
    """The gradient codec that pairs with a forward codec when the user names none."""
    name, _ = parse_spec(forward_spec)
    return codec_class(name).default_grad_codec
