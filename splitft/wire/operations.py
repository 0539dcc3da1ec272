"""The operations an edge mirrors to the cloud, as typed records checked like messages.

A user's loop changes the model and the optimizer between forward calls (``opt.step()``,
``opt.zero_grad()``, attaching an optimizer, choosing a loss); the edge records each change as an
operation that rides on its next request (``ops``), so the cloud applies them in the same order
and a step costs no extra round trip. The edge queues these records and puts them in its messages
as they are; only encoding a message turns each into the map that travels, ``{"op": NAME, field:
value, ...}`` (:func:`to_wire`, called by :mod:`splitft.wire.protocol`). A receiver gets the maps,
and :func:`from_wire` checks every field against the record's type hints before the cloud looks at
it, as :mod:`splitft.wire.protocol` does for messages.

To add an operation: a record here (with ``NAME``), its handler in :mod:`splitft.cloud.handlers`, and
the edge call that queues it.
"""

from __future__ import annotations

import dataclasses
import operator
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ..errors import ProtocolError
from .records import _short, build_checked


@dataclass
class Operation:
    """Base of the mirrored operations. ``NAME`` is what travels in ``"op"``."""

    NAME: ClassVar[str] = ""


@dataclass
class AttachOptimizer(Operation):
    """The edge attached an optimizer: build the same class with these settings.

    ``name`` is one of :mod:`splitft.optimizer_classes`' (a ``torch.optim`` class's own name, or
    a library's optimizer, whose ``version`` is the edge's release of that library). ``id``
    numbers attachments, so a replayed attach is recognised and skipped.
    """

    NAME: ClassVar[str] = "optimizer"
    name: str
    settings: dict = field(default_factory=dict)
    id: int | None = None
    #: The optimizer's parameter groups over the cloud half: ``{"names": [...], "settings": {...}}``
    #: each, the names those of the unsplit model. None: one group of every cloud parameter.
    groups: list | None = None
    version: str | None = None


@dataclass
class AddParamGroup(Operation):
    """The edge's optimizer got a parameter group (``opt.add_param_group``: layers unfrozen as a
    fine-tune goes on): add the same group, over the named parameters of the half, to the cloud's.

    ``index`` is the group's position among the optimizer's groups: one already there is a replay
    and is skipped. ``names`` may be empty (a group of the edge's parameters only), so that the
    groups keep their positions on both sides.
    """

    NAME: ClassVar[str] = "add_param_group"
    index: int
    names: list
    settings: dict = field(default_factory=dict)


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
    lr: float | None = None  # every group's learning rate
    lrs: list | None = None  # each group's learning rate (several groups)
    #: Per group, the settings (other than lr) changed since the last step: a scheduler cycling momentum.
    changes: list | None = None


@dataclass
class ApplyEager(Operation):
    """Eager backward: add the parameter gradients of ``call``, computed for an incoming gradient
    of 1, scaled by the incoming gradient the edge's backward actually saw."""

    NAME: ClassVar[str] = "apply"
    call: int
    scale: float
    pass_id: int | None = None  # the edge's backward pass: one pass's contributions are summed first (cloud/passes.py)
    #: The edge's graph through the call is freed with this backward (no ``retain_graph``): no
    #: second apply of it can come, so the cloud may give the gradients it kept away uncopied.
    last: bool = False


@dataclass
class ZeroGrad(Operation):
    """The edge cleared its gradients (``opt.zero_grad``): clear the cloud half's the same way."""

    NAME: ClassVar[str] = "zero_grad"
    set_to_none: bool = True
    model: bool = False  # model.zero_grad(): every parameter of the half, not just the optimizer's
    names: list | None = None  # only these parameters' gradients (``p.grad = None``, ``p.grad.zero_()``)


@dataclass
class ScaleGrads(Operation):
    """Multiply (``divide``: divide) the cloud half's gradients by ``factor``: clipping by the
    global norm, loss scaling, a script's ``p.grad.mul_(x)``."""

    NAME: ClassVar[str] = "scale_grads"
    factor: float
    names: list | None = None  # only these parameters (unsplit names); None: all
    divide: bool = False


@dataclass
class ClampGrads(Operation):
    """Clamp the cloud half's gradients to ``[low, high]`` (``clip_grad_value_``, ``p.grad.clamp_``);
    a bound that is None does not clamp."""

    NAME: ClassVar[str] = "clamp_grads"
    low: float | None = None
    high: float | None = None
    names: list | None = None


@dataclass
class Compute(Operation):
    """An in-place torch method on a cloud gradient or weight, its operands computed in the cloud
    (:mod:`splitft.wire.expressions`): ``p.grad.sign_()``, ``p.grad.add_(p.data, alpha=wd)``,
    ``w.div_(w.norm(dim=1, keepdim=True))``. ``target`` is ``{"grad": name}`` or ``{"value": name}``,
    ``fn`` one of :data:`~splitft.wire.expressions.IN_PLACE`."""

    NAME: ClassVar[str] = "compute"
    target: dict
    fn: str
    args: list = field(default_factory=list)
    kwargs: dict = field(default_factory=dict)


@dataclass
class LoadWeights(Operation):
    """Replace the cloud half's weights (``model.load_state_dict``): name → array, every name of the
    half; with ``partial``, only the named tensors (``p.copy_(tensor)`` on a placeholder)."""

    NAME: ClassVar[str] = "load_weights"
    weights: dict
    partial: bool = False


@dataclass
class LoadOptimizerState(Operation):
    """The optimizer's state is these entries from now on (``opt.load_state_dict`` of a state
    dict with the cloud half's moments): parameter name → {state key → array}; a parameter of the
    optimizer not named has no state, as after torch's own load."""

    NAME: ClassVar[str] = "load_optimizer_state"
    entries: dict
    #: Per group, the settings the loaded state dict holds that differ from the group's (torch's
    #: load takes them, ``amsgrad`` or a momentum that changes what the state keeps); None: none.
    changes: list | None = None


@dataclass
class SetFrozen(Operation):
    """The cloud half's parameters with ``requires_grad=False`` (``requires_grad_``, freezing a layer
    by name); every other parameter of the half trains. Sent when the set changes."""

    NAME: ClassVar[str] = "frozen"
    names: list


@dataclass
class SetModes(Operation):
    """The cloud half's modules whose train/eval mode differs from the split model's own (a layer
    put in ``eval()`` by name); the cloud flips them after setting each call's mode. Sent when the
    set changes."""

    NAME: ClassVar[str] = "modes"
    names: list


@dataclass
class SetFlags(Operation):
    """Private flags the script changed on cloud modules, which their code reads as it runs
    (PEFT's ``disable_adapter()`` sets ``_disable_adapters`` on every adapter layer): ``flags`` is
    ``{module: {flag: value}}``, set on the cloud's modules before the next forward."""

    NAME: ClassVar[str] = "flags"
    flags: dict


@dataclass
class FreeCache(Operation):
    """The edge's key/value cache ``id`` is gone (its generation ended): free the cloud's."""

    NAME: ClassVar[str] = "free_cache"
    id: int


@dataclass
class ChangeCache(Operation):
    """The edge's generation changed key/value cache ``id`` (beam search reorders it at every
    token): the same change to the cloud's part of it. ``kind``: ``reorder`` and ``select`` take
    ``indices`` along the batch, ``repeat`` repeats each entry ``count`` times, ``crop`` drops the
    last ``-count`` tokens (transformers' ``reorder_cache``, ``batch_select_indices``,
    ``batch_repeat_interleave``, ``crop``), ``reset`` empties it; ``whole`` makes cache ``id`` one whose
    layers keep all their tokens (a ``DynamicCache()`` built without the model's config); ``copy``
    makes cache ``id`` a copy of cache
    ``source`` (``copy.deepcopy`` of a prompt's cache, for another continuation)."""

    NAME: ClassVar[str] = "change_cache"
    id: int
    kind: str
    indices: list | None = None
    count: int | None = None
    source: int | None = None


OPERATIONS: dict[str, type[Operation]] = {
    cls.NAME: cls for cls in (AttachOptimizer, AddParamGroup, SetLoss, Step, ApplyEager, ZeroGrad, ScaleGrads, ClampGrads,
                              Compute, LoadWeights, LoadOptimizerState, SetFrozen, SetModes, SetFlags, FreeCache, ChangeCache)
}

#: Operations that act alike on a list of named parameters: two in a row over different
#: parameters are one operation over both (``zero_grad`` clears parameters one at a time).
_BY_NAMES = (ZeroGrad, ScaleGrads, ClampGrads)


def merged(previous: Operation, op: Operation, seen: set[str]) -> bool:
    """Fold ``op`` into ``previous`` (queued just before it) when they are one operation over two
    sets of parameters; ``seen`` holds ``previous``'s names and grows with them. Whether it did."""
    if previous.__class__ is not op.__class__:
        return False
    if isinstance(op, LoadWeights) and isinstance(previous, LoadWeights):
        if not (previous.partial and op.partial):
            return False
        previous.weights.update(op.weights)
        return True
    if not (isinstance(op, _BY_NAMES) and isinstance(previous, _BY_NAMES)):
        return False
    names, earlier = op.names, previous.names
    if names is None or earlier is None or not seen.isdisjoint(names):
        return False
    settings = _settings_of(op.__class__)
    if settings(previous) != settings(op):
        return False
    earlier.extend(names)
    seen.update(names)
    return True


_SETTINGS: dict[type, Callable[[Operation], tuple]] = {}


def _settings_of(cls: type) -> Callable[[Operation], tuple]:
    """Reads a by-names operation's fields other than ``names``, as a tuple (zero_grad clears
    parameters one at a time, so this runs once per parameter)."""
    read = _SETTINGS.get(cls)
    if read is None:
        others = tuple(f.name for f in dataclasses.fields(cls) if f.name != "names")
        getter = operator.attrgetter(*others)
        read = _SETTINGS[cls] = (lambda op: (getter(op),)) if len(others) == 1 else getter
    return read


def names_of(op: Operation) -> list[str]:
    """The parameters an operation over named parameters names (none for the others)."""
    return (op.names or []) if isinstance(op, _BY_NAMES) else []


#: Field names per record class, in declaration order (the order a map of them travels in).
_FIELDS: dict[type, tuple[str, ...]] = {}


def _field_names(op: Operation) -> tuple[str, ...]:
    cls = op.__class__
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in dataclasses.fields(op))
    return names


def to_wire(op: Operation) -> dict[str, Any]:
    """The map that travels: ``{"op": NAME, ...fields}``, in declaration order. The values are the
    record's own (not copies): it is packed at once, or written as JSON."""
    body = op.__dict__  # a record's attributes are its fields, set in order by __init__ ...
    names = _field_names(op)
    if len(body) == len(names):
        return {"op": op.NAME, **body}
    return {"op": op.NAME, **{name: getattr(op, name) for name in names}}  # ... unless someone added one


def from_wire(value: Any) -> Operation:
    """The operation a received map describes, every field checked; a :class:`ProtocolError` if not."""
    if not isinstance(value, dict) or not isinstance(value.get("op"), str):
        raise ProtocolError(f"an operation must be a map with an 'op' name, got {_short(value)}")
    cls = OPERATIONS.get(value["op"])
    if cls is None:
        raise ProtocolError(f"unknown operation {_short(value['op'])}; known: {', '.join(sorted(OPERATIONS))}")
    return build_checked(cls, {k: v for k, v in value.items() if k != "op"}, f"operation {cls.NAME}")


__all__ = ["AddParamGroup", "ApplyEager", "AttachOptimizer", "ClampGrads", "Compute", "FreeCache", "LoadOptimizerState", "LoadWeights", "OPERATIONS", "Operation", "ScaleGrads",
           "SetFrozen", "SetLoss", "SetModes", "Step", "ZeroGrad", "from_wire", "merged", "names_of", "to_wire"]
