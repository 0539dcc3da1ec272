"""The operations an edge mirrors to the cloud, as typed records checked like messages.

A user's loop changes the model and the optimizer between forward calls (``opt.step()``,
``opt.zero_grad()``, attaching an optimizer, choosing a loss); the edge records each change as an
operation that rides on its next request (``ops``), so the cloud applies them in the same order
and a step costs no extra round trip. On the wire an operation is a map ``{"op": NAME, field:
value, ...}``; :func:`from_wire` checks every field against the record's type hints before the
cloud looks at it, as :mod:`splitft.protocol` does for messages.

To add an operation: a record here (with ``NAME``), its handler in :mod:`splitft.cloud.ops`, and
the edge call that queues it.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .errors import ProtocolError
from .protocol import _accepted_types, _short, _type_name


@dataclass
class Operation:
    """Base of the mirrored operations. ``NAME`` is what travels in ``"op"``."""

    NAME: ClassVar[str] = ""


@dataclass
class AttachOptimizer(Operation):
    """The edge attached a ``torch.optim`` optimizer: build the same class with these settings.

    ``id`` numbers attachments, so a replayed attach is recognised and skipped.
    """

    NAME: ClassVar[str] = "optimizer"
    name: str
    settings: dict = field(default_factory=dict)
    id: int | None = None


@dataclass
class SetLoss(Operation):
    """Plain split: compute this ``torch.nn`` loss (by class name and settings) after the cloud half."""

    NAME: ClassVar[str] = "loss"
    name: str
    settings: dict = field(default_factory=dict)


@dataclass
class Step(Operation):
    """The edge's optimizer stepped: step the cloud's with the same learning rate.

    ``id`` is the step's number; the cloud applies step n once, however often it arrives.
    """

    NAME: ClassVar[str] = "step"
    id: int | None = None
    lr: float | None = None


@dataclass
class ApplyEager(Operation):
    """Eager backward: add the parameter gradients of ``call``, computed for an incoming gradient
    of 1, scaled by the incoming gradient the edge's backward actually saw."""

    NAME: ClassVar[str] = "apply"
    call: int
    scale: float


@dataclass
class ZeroGrad(Operation):
    """The edge cleared its gradients (``opt.zero_grad``): clear the cloud half's the same way."""

    NAME: ClassVar[str] = "zero_grad"
    set_to_none: bool = True


OPERATIONS: dict[str, type[Operation]] = {
    cls.NAME: cls for cls in (AttachOptimizer, SetLoss, Step, ApplyEager, ZeroGrad)
}

_SCHEMAS = {
    cls: [(f.name, typing.get_type_hints(cls)[f.name], _accepted_types(typing.get_type_hints(cls)[f.name]),
           f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
          for f in dataclasses.fields(cls)]
    for cls in OPERATIONS.values()
}


def to_wire(op: Operation) -> dict[str, Any]:
    """The map that travels: ``{"op": NAME, ...fields}``."""
    return {"op": op.NAME, **dataclasses.asdict(op)}


def from_wire(value: Any) -> Operation:
    """The operation a received map describes, every field checked; a :class:`ProtocolError` if not."""
    if not isinstance(value, dict) or not isinstance(value.get("op"), str):
        raise ProtocolError(f"an operation must be a map with an 'op' name, got {_short(value)}")
    cls = OPERATIONS.get(value["op"])
    if cls is None:
        raise ProtocolError(f"unknown operation {_short(value['op'])}; known: {', '.join(sorted(OPERATIONS))}")
    body = {k: v for k, v in value.items() if k != "op"}
    schema = _SCHEMAS[cls]
    unknown = set(body) - {name for name, *_ in schema}
    if unknown:
        raise ProtocolError(f"operation {cls.NAME} has no field(s) {sorted(map(str, unknown))}")
    for name, hint, accepted, required in schema:
        if name not in body:
            if required:
                raise ProtocolError(f"operation {cls.NAME} is missing field {name!r}")
            continue
        item = body[name]
        if accepted is not None and (not isinstance(item, accepted)
                                     or (isinstance(item, bool) and bool not in accepted)):
            raise ProtocolError(f"operation {cls.NAME}.{name} should be {_type_name(hint)}, got {_short(item)}")
    return cls(**body)


__all__ = ["ApplyEager", "AttachOptimizer", "OPERATIONS", "Operation", "SetLoss", "Step", "ZeroGrad",
           "from_wire", "to_wire"]
