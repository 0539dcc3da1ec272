"""Records a peer sends, checked against their dataclass's type hints before they are built.

A message (:mod:`splitft.wire.protocol`) or a mirrored operation (:mod:`splitft.wire.operations`) arrives as
plain msgpack values; :func:`build_checked` turns a map of them into the record only after every
field's type is checked, so a hostile peer gets a :class:`ProtocolError` naming the first bad field
instead of a record with a string where an int belongs.
"""

from __future__ import annotations

import dataclasses
import reprlib
import types
import typing
from typing import Any, Union

from ..errors import ProtocolError

#: How many entries each cache of checked shapes keeps (here and in :mod:`splitft.wire.protocol`):
#: a peer that sends ever-new shapes cannot grow them without bound.
_CACHE_LIMIT = 1024


def _accepted_types(hint: Any) -> tuple[type, ...] | None:
    """The Python types msgpack decoding may produce for a field hint (None: anything)."""
    if hint is Any:
        return None
    if typing.get_origin(hint) in (Union, types.UnionType):
        parts = [_accepted_types(h) for h in typing.get_args(hint)]
        known = [p for p in parts if p is not None]
        return None if len(known) < len(parts) else tuple(t for p in known for t in p)
    if hint is float:
        return (int, float)
    return (typing.get_origin(hint) or hint,)


_SCHEMAS: dict[type, tuple[list[tuple[str, Any, tuple[type, ...] | None, bool]], frozenset[str]]] = {}


def record_fields(cls: type) -> tuple[list[tuple[str, Any, tuple[type, ...] | None, bool]], frozenset[str]]:
    """(field name, hint, accepted types, required) per field of a record class, and the names."""
    found = _SCHEMAS.get(cls)
    if found is None:
        hints = typing.get_type_hints(cls)
        fields = [(f.name, hints[f.name], _accepted_types(hints[f.name]),
                   f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                  for f in dataclasses.fields(cls)]
        found = _SCHEMAS[cls] = (fields, frozenset(name for name, *_ in fields))
    return found


def build_checked(cls: type, body: dict, what: str) -> Any:
    """``cls(**body)`` for a dataclass record, once every field is checked against its type hint.

    Unknown and missing fields are refused, and an int field refuses a bool. Mirrored operations
    are built through here, and so is each message whose field types a receiver has not seen yet
    (:mod:`splitft.wire.protocol` names its positional fields first).
    """
    signature = (cls, tuple(body), tuple(map(type, body.values())))
    if signature in _PASSED:
        return cls(**body)
    names, required, checks = _checks(cls)
    keys = body.keys()
    if keys <= names and required <= keys:
        for name, value in body.items():
            check = checks[name]
            if check is not None and (not isinstance(value, check[0]) or (check[1] and value.__class__ is bool)):
                break
        else:
            if len(_PASSED) >= _CACHE_LIMIT:
                _PASSED.clear()
            _PASSED.add(signature)
            return cls(**body)
    _refuse(cls, body, what)


#: (class, field names, value types) of bodies that passed: whether a body passes depends on
#: nothing else, and a stream of messages repeats a few of these.
_PASSED: set[tuple] = set()
_CHECKS: dict[type, tuple[frozenset[str], frozenset[str], dict[str, tuple[tuple[type, ...], bool] | None]]] = {}


def _checks(cls: type) -> tuple[frozenset[str], frozenset[str], dict[str, tuple[tuple[type, ...], bool] | None]]:
    """Per record class: its field names, the required ones, and per field (accepted types,
    refuses bool) or None for a field that takes anything."""
    found = _CHECKS.get(cls)
    if found is None:
        schema, names = record_fields(cls)
        found = _CHECKS[cls] = (
            names,
            frozenset(name for name, _, _, required in schema if required),
            {name: None if accepted is None else (accepted, bool not in accepted) for name, _, accepted, _ in schema},
        )
    return found


def _refuse(cls: type, body: dict, what: str) -> None:
    """Raise the first problem of a body that failed :func:`build_checked`, in field order."""
    schema, names = record_fields(cls)
    if not set(body) <= names:
        raise ProtocolError(f"{what} has no field(s) {sorted(map(str, set(body) - names))}")
    for name, hint, accepted, required in schema:
        if name not in body:
            if required:
                raise ProtocolError(f"{what} is missing field {name!r}")
            continue
        value = body[name]
        if accepted is not None and (not isinstance(value, accepted)
                                     or (isinstance(value, bool) and bool not in accepted)):
            raise ProtocolError(f"{what}.{name} should be {_type_name(hint)}, got {_short(value)}")
    raise ProtocolError(f"{what} is malformed")


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


_REPR = reprlib.Repr()
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 6, 4, 60, 60


def _short(value: Any, limit: int = 80) -> str:
    """A short description of a received value for an error message: it never renders more of
    the value than it shows (a header of millions of entries is quoted as cheaply as one)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
