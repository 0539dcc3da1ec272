"""Codec names → classes, and the small spec grammar users type: ``name[:key=value,...]``, and
chains of them joined by ``>`` (``hadamard>quant:bits=2``; see :mod:`compressors.chain`).

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

#: Separates the stages of a chain spec.
SEP = ">"

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


def split_chain(spec: str) -> list[str]:
    """The stage specs of a spec, in encode order (a plain spec is a chain of one)."""
    if not isinstance(spec, str) or not spec.strip():
        raise CompressionError(f"a codec spec is a non-empty string such as 'fp16' or 'hadamard>quant:bits=2', "
                               f"got {spec!r}")
    parts = [part.strip() for part in spec.split(SEP)]
    if any(not part for part in parts):
        raise CompressionError(f"codec spec {spec!r}: a chain is codec specs joined by {SEP!r}, none of them "
                               "empty (example: 'hadamard>quant:bits=2')")
    return parts


def parse_chain(spec: str) -> list[tuple[str, dict[str, Any]]]:
    """``"hadamard>quant:bits=2"`` as ``[("hadamard", {}), ("quant", {"bits": 2})]``."""
    return [parse_spec(part) for part in split_chain(spec)]


def parse_spec(spec: str) -> tuple[str, dict[str, Any]]:
    """Split ``"c3sl:r=4,foo=bar"`` into ``("c3sl", {"r": 4, "foo": "bar"})``.

    A chain (``a>b``) has no single name and options: :func:`parse_chain` splits it.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise CompressionError(f"a codec spec is a non-empty string such as 'fp16' or 'c3sl:r=4', got {spec!r}")
    if SEP in spec:
        raise CompressionError(f"codec spec {spec!r} is a chain of codecs; compressors.parse_chain splits it")
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
    stages = parse_chain(spec)
    codecs = [_build(name, options, seed + i, bounds) for i, (name, options) in enumerate(stages)]
    for outer, inner in zip(codecs[-2::-1], codecs[:0:-1]):  # inside out
        _require_stage(outer, spec)
        outer.wrap(inner)  # type: ignore[attr-defined]
    return codecs[0]


def _build(name: str, options: dict[str, Any], seed: int, bounds: Bounds | None) -> Codec:
    cls = codec_class(name)
    _known_options(name, cls, options)
    codec = cls(seed=seed, **options)
    codec.bounds = bounds
    return codec


def _require_stage(codec: Codec | type[Codec], spec: str) -> None:
    if not codec.wraps:
        stages = ", ".join(n for n in names() if codec_class(n).wraps)
        raise CompressionError(f"codec spec {spec!r}: {codec.name!r} ends a chain, so nothing can come after it; "
                               f"only {stages} may stand before another codec")


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
    stages = parse_chain(spec)
    if len(stages) > bounds.max_stages:
        raise PolicyError(
            f"codec spec {spec!r} chains {len(stages)} codecs, beyond this end's bound max_stages={bounds.max_stages}",
            value=len(stages), bound="max_stages",
        )
    for i, (name, options) in enumerate(stages):
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
        if i < len(stages) - 1:
            _require_stage(cls, spec)
        cls(seed=0, **options)
    return canonical_spec(spec)


def canonical_spec(spec: str) -> str:
    """A normal form of a spec, so two ends can compare what they were configured with."""
    parts = []
    for name, options in parse_chain(spec):
        codec_class(name)
        parts.append(name + (":" + ",".join(f"{k}={options[k]}" for k in sorted(options)) if options else ""))
    return SEP.join(parts)


def default_grad_spec(forward_spec: str) -> str:
    """The gradient codec that pairs with a forward codec when the user names none: for a chain,
    its last codec's (the stages before it pass the gradient through, or map it with their
    adjoints, and the last codec's partner suits what then travels)."""
    name, _ = parse_chain(forward_spec)[-1]
    return codec_class(name).default_grad_codec
