"""Applying the operations an edge mirrors (:mod:`splitft.wire.operations`) to one session.

Each operation has one handler, registered for its record type with :func:`handles` (a new operation is a
record, a handler here, and the edge call that queues it). What the handlers set is :class:`Mirrored`, the one
owner of a session's optimizer, loss, module modes and step count; what else they touch (the half, its graphs,
its caches) they reach through :class:`Target`. Operations that change state carry ids of their own (step n,
attachment n), so applying a replayed request again is harmless.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from ..config_reads import apply_flags
from ..errors import CapacityError, ConfigError, ModelError, PolicyError, ProtocolError
from ..optimizer_classes import optimizer_class
from ..wire import operations as o
from . import offload, optimizer_state
from .blame import blame, short
from .caches import SessionCaches
from .costs import Pricing
from .passes import PassGrads
from .graphs import Graphs
from .half import Half, SharedPart, cast_weights
from .limits import Limits
from .replies import Replies
from .shared_policy import SharedPolicy

log = logging.getLogger(__name__)


@dataclass
class Mirrored:
    """What the edge's loop set that the cloud repeats for one session: its optimizer (its own, or
    the shared half's), the loss after a plain split's half, the modules run in the other mode, and
    the optimizer steps applied."""

    shared: SharedPart | None = None
    own_optimizer: torch.optim.Optimizer | None = None
    optimizer_spec: o.AttachOptimizer | None = None
    optimizer_id: int = 0
    loss_fn: nn.Module | None = None
    loss_meta: nn.Module | None = None  # the loss's twin on the meta device, for pricing a call
    loss_spec: o.SetLoss | None = None
    flipped: list[nn.Module] = field(default_factory=list)  # modules the edge runs in the other mode
    flags: dict[str, dict[str, Any]] = field(default_factory=dict)  # flags set, by module name
    steps: int = 0

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer this session steps: the shared half's, or its own."""
        return self.shared.optimizer if self.shared is not None else self.own_optimizer

    def restored(self, steps: int, optimizer_id: int) -> None:
        """Counters as a checkpoint left them (its operations were applied again first)."""
        self.steps, self.optimizer_id = steps, optimizer_id


class Target(Protocol):
    """What a handler reaches of a session."""

    @property
    def id(self) -> str: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def half(self) -> Half: ...

    @property
    def mirrored(self) -> Mirrored: ...

    @property
    def graphs(self) -> Graphs: ...

    @property
    def passes(self) -> PassGrads: ...

    @property
    def caches(self) -> SessionCaches: ...

    @property
    def pricing(self) -> Pricing: ...

    @property
    def replies(self) -> Replies: ...

    def fits(self, extra: int, what: str) -> None: ...


Handler = Callable[[Any, Any], Any]
H = TypeVar("H", bound=Handler)

#: Record type → its one handler, filled by :func:`handles`.
HANDLERS: dict[type[o.Operation], Handler] = {}


def handles(kind: type[o.Operation]) -> Callable[[H], H]:
    """Register the decorated function as the handler of ``kind``; a second one is refused."""
    def register(handler: H) -> H:
        if kind in HANDLERS:
            raise TypeError(f"operation {kind.__name__} already has a handler: {HANDLERS[kind].__name__}")
        HANDLERS[kind] = handler
        return handler
    return register


def handler_for(kind: type[o.Operation]) -> Handler:
    """The handler of record type ``kind``; a :class:`ProtocolError` for a type without one."""
    handler = HANDLERS.get(kind)
    if handler is None:
        raise ProtocolError(f"this cloud applies no operation {short(getattr(kind, 'NAME', kind))}; it applies "
                            f"{', '.join(sorted(k.NAME for k in HANDLERS))}")
    return handler


def apply_ops(session: Target, ops: list) -> int:
    """Apply mirrored operations in order; returns how many optimizer steps were new."""
    if len(ops) > session.limits.max_ops:
        raise CapacityError(f"a message carries {len(ops)} operations; this cloud applies at most "
                            f"{session.limits.max_ops} per message")
    groups = sum(_groups_built(value) for value in ops)
    if groups > _MAX_GROUPS:  # torch builds an optimizer's groups in time quadratic in their number
        raise CapacityError(f"a message builds {groups} parameter groups; an optimizer has at most {_MAX_GROUPS}")
    stepped = 0
    for value in ops:
        op = o.from_wire(value)
        if not isinstance(op, o.ApplyEager):
            session.passes.flush()  # the edge's backward pass ended before this: its sums reach .grad
        stepped += bool(handler_for(type(op))(session, op))
    return stepped


def _groups_built(value: Any) -> int:
    """The parameter groups a received operation (a map, unchecked) has the cloud build."""
    if not isinstance(value, dict):
        return 0
    if value.get("op") == "add_param_group":
        return 1
    if value.get("op") == "optimizer":
        groups = value.get("groups")
        return len(groups) if isinstance(groups, list) else 1
    return 0


def _positive_id(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ProtocolError(f"operation id must be a positive int, got {value}")
    return value


@handles(o.AttachOptimizer)
def attach_optimizer(session: Target, op: o.AttachOptimizer) -> None:
    mirrored, half = session.mirrored, session.half
    op_id = _positive_id(op.id)
    if op_id is not None and op_id <= mirrored.optimizer_id and mirrored.optimizer_spec is not None:
        return  # a replayed attach: the optimizer (and its state) is already there
    cls = optimizer_class(op.name, op.version)
    groups = _param_groups(half, op)
    shared = half.shared
    if shared is not None:  # the cloud's optimizer, never the first edge's: an edge's must be it
        policy = shared_policy(shared)
        policy.check_attach(cls.__name__, op.settings, op.groups, half.chain.qualified_parameters())
        shared.attach(lambda: policy.build(list(half.chain.parameters())),
                      (policy.optimizer or "", policy.describe()))
    else:
        mirrored.own_optimizer = _make_optimizer(groups, cls, op.settings)
    mirrored.optimizer_spec = o.AttachOptimizer(name=op.name, settings=dict(op.settings), groups=op.groups,
                                                version=op.version)
    mirrored.optimizer_id = op_id if op_id is not None else mirrored.optimizer_id + 1


@handles(o.AddParamGroup)
def add_param_group(session: Target, op: o.AddParamGroup) -> None:
    """``opt.add_param_group`` on the edge: the same group in the cloud's copy, checked first. Only
    the new group is checked (its names against those the groups hold), so adding groups one by
    one costs what building them at once would."""
    mirrored, half = session.mirrored, session.half
    spec = mirrored.optimizer_spec
    if spec is None:
        raise ProtocolError("a parameter group added before any optimizer was attached")
    if half.shared is not None:
        raise PolicyError("a shared cloud half's optimizer is the cloud's (--shared-optimizer): an edge may not add "
                          "a parameter group to it")
    groups = spec.groups if spec.groups is not None else \
        [{"names": [half.name_of(p) for p in half.chain.parameters()], "settings": {}}]  # the one group, in order
    if not isinstance(op.index, int) or isinstance(op.index, bool) or op.index < 0:
        raise ProtocolError(f"a parameter group's index must be an int of at least 0, got {short(op.index)}")
    if op.index < len(groups):
        return  # a replay: the group is there
    if op.index > len(groups):
        raise ProtocolError(f"parameter group {op.index} added where the optimizer has {len(groups)}")
    if len(groups) >= _MAX_GROUPS:
        raise CapacityError(f"an optimizer with more than {_MAX_GROUPS} parameter groups")
    if not (isinstance(op.names, list) and all(isinstance(n, str) for n in op.names)):
        raise ProtocolError(f"a parameter group's names are a list of str, got {short(op.names)}")
    settings = optimizer_state.checked_settings(dict(spec.settings), op.settings, "a new parameter group",
                                                fixed=("params",))
    params = half.parameters_named(op.names)
    optimizer = mirrored.own_optimizer
    held = {id(p) for group in optimizer.param_groups for p in group["params"]} if optimizer is not None else set()
    if len(params) != len(op.names) or any(id(p) in held for p in params):
        raise ProtocolError("a parameter appears in more than one parameter group, or twice in one")
    grown = o.AttachOptimizer(name=spec.name, settings=spec.settings, id=spec.id,
                              groups=[*groups, {"names": op.names, "settings": op.settings}], version=spec.version)
    if optimizer is not None:
        try:
            optimizer.add_param_group({"params": params, **settings})
        except Exception as exc:  # torch's own checks, made before it adds anything
            raise ConfigError(f"cannot add a parameter group to {spec.name}: {exc}") from exc
    elif params:  # the first group with a parameter of this half: the optimizer, over every group
        built = _param_groups(half, grown)
        built[-1].update(settings)  # as the optimizer holds them (tuples as tuples)
        mirrored.own_optimizer = _make_optimizer(built, optimizer_class(spec.name, spec.version), spec.settings)
    mirrored.optimizer_spec = grown


def _param_groups(half: Half, op: o.AttachOptimizer) -> list[dict[str, Any]]:
    """The optimizer's groups over the half's parameters, by their unsplit names."""
    if op.groups is None:
        return [{"params": list(half.chain.parameters())}]
    if len(op.groups) > _MAX_GROUPS:
        raise CapacityError(f"an optimizer with {len(op.groups)} parameter groups; at most {_MAX_GROUPS}")
    groups: list[dict[str, Any]] = []
    seen: set[str] = set()
    for group in op.groups:
        if not (isinstance(group, dict) and set(group) == {"names", "settings"} and isinstance(group["names"], list)
                and all(isinstance(n, str) for n in group["names"]) and isinstance(group["settings"], dict)):
            raise ProtocolError(f"a parameter group is a map of 'names' (list of str) and 'settings' (map), "
                                f"got {short(group)}")
        unknown = [k for k in group["settings"] if k not in op.settings]
        if unknown:
            raise ConfigError(f"a parameter group sets {short(unknown[0])}, which is not among the optimizer's settings")
        names = group["names"]
        if seen.intersection(names) or len(set(names)) != len(names):
            raise ProtocolError("a parameter appears in more than one parameter group")
        seen.update(names)
        groups.append({"params": half.parameters_named(names), **group["settings"]})
    return groups


_MAX_GROUPS = 1024


def _make_optimizer(groups: list[dict[str, Any]], cls: type, settings: dict) -> torch.optim.Optimizer | None:
    """The optimizer, or None when none of its groups holds a parameter of this half (it steps nothing here)."""
    if not any(group["params"] for group in groups):
        return None
    try:
        return cls(groups, **settings)
    except Exception as exc:  # optimizers raise TypeError, ValueError, RuntimeError for bad settings
        raise ConfigError(f"cannot build {cls.__name__} with {short(settings)}: {exc}") from exc


@handles(o.FreeCache)
def free_cache(session: Target, op: o.FreeCache) -> None:
    session.caches.free(op.id)


@handles(o.SetFlags)
def set_flags(session: Target, op: o.SetFlags) -> None:
    if session.half.shared is not None:
        raise PolicyError("a shared cloud half's modules are every edge's: an edge may not set their flags")
    apply_flags(session.half.chain.qualified_modules(), op.flags)
    session.pricing.cost.forget()  # a setting may change what a forward costs (a rate, a head count)
    for where, values in op.flags.items():
        session.mirrored.flags.setdefault(where, {}).update(values)


@handles(o.ChangeCache)
def change_cache(session: Target, op: o.ChangeCache) -> None:
    session.caches.change(op.id, op.kind, op.indices, op.count, session.fits, source=op.source)


@handles(o.SetModes)
def set_modes(session: Target, op: o.SetModes) -> None:
    """Modules to run in the other mode than each call's (``net.layer[3].eval()`` during training)."""
    modules = session.half.chain.qualified_modules()
    unknown = [n for n in op.names if not isinstance(n, str) or n not in modules]
    if unknown:
        raise ProtocolError(f"the cloud half has no module {short(unknown[0])}")
    session.mirrored.flipped = [modules[n] for n in dict.fromkeys(op.names)]


@handles(o.SetFrozen)
def set_frozen(session: Target, op: o.SetFrozen) -> None:
    """``requires_grad`` of each parameter of the half, as the edge's script set it (a shared
    half's are the cloud's: the edge's must match them)."""
    half = session.half
    frozen = {id(p) for p in half.parameters_named(op.names)}
    if half.shared is not None:
        shared_policy(half.shared).check_frozen(op.names)
        return
    for param in half.chain.parameters():
        param.requires_grad_(id(param) not in frozen)


@handles(o.SetLoss)
def set_loss(session: Target, op: o.SetLoss) -> None:
    cls = getattr(nn, op.name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.modules.loss._Loss)):
        raise ConfigError(f"{short(op.name)} is not a torch.nn loss")
    if not isinstance(op.settings, dict):
        raise ProtocolError(f"a loss's settings must be a map, got {short(op.settings)}")
    settings: dict[str, Any] = {k: loss_tensor(v, f"{cls.__name__}({k}=...)") if isinstance(v, dict) else v
                                for k, v in op.settings.items()}
    try:
        loss_fn = cls(**settings).to(session.half.placement.device)
    except Exception as exc:
        raise ConfigError(f"cannot build {cls.__name__} with {short(op.settings)}: {exc}") from exc
    session.mirrored.loss_fn = loss_fn
    session.mirrored.loss_meta = copy.deepcopy(loss_fn).to("meta") if any(True for _ in loss_fn.buffers()) else loss_fn
    session.mirrored.loss_spec = op


#: The most numbers a loss's tensor setting may hold (a class weight over a vocabulary fits).
MAX_LOSS_TENSOR = 1 << 20
_LOSS_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64}


def loss_tensor(value: dict, what: str) -> torch.Tensor:
    """A loss's tensor setting (a class weight, ``pos_weight``) from the numbers the edge sent, checked."""
    numbers, dtype, shape = value.get("tensor"), _LOSS_DTYPES.get(str(value.get("dtype"))), value.get("shape")
    if (set(value) != {"tensor", "dtype", "shape"} or dtype is None or not isinstance(numbers, list)
            or not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape)):
        raise ProtocolError(f"{what} must be a tensor as numbers, a float dtype and a shape")
    if len(numbers) > MAX_LOSS_TENSOR or len(numbers) != math.prod(shape):
        raise ProtocolError(f"{what} holds {len(numbers)} numbers for shape {short(shape)} "
                            f"(at most {MAX_LOSS_TENSOR})")
    if not all(isinstance(n, float) and math.isfinite(n) for n in numbers):
        raise ProtocolError(f"{what} must hold finite floats")
    return torch.tensor(numbers, dtype=dtype).reshape(shape)


@handles(o.Step)
def step(session: Target, op: o.Step) -> bool:
    mirrored, half = session.mirrored, session.half
    step_id = _positive_id(op.id)
    if step_id is not None:
        if step_id <= mirrored.steps:
            session.replies.repeated_step()
            log.info("session %s: optimizer step %d was applied already; skipped", session.id, step_id)
            return False
        if step_id != mirrored.steps + 1:
            raise ProtocolError(f"optimizer step {step_id} arrived but this session is at step {mirrored.steps}; "
                                "steps in between were lost (resume the session to replay them)")
    if mirrored.optimizer_spec is None:
        raise ConfigError("the edge stepped its optimizer, but none was attached: call model.attach(optimizer)")
    rounds = half.shared.rounds if half.shared is not None else None
    if rounds is not None:
        rounds.contribute(session.id, half, op)  # one optimizer step for all the round's edges, when it closes
    elif (optimizer := mirrored.optimizer) is not None:
        step_settings(half.shared, optimizer, op)
        with half.own_grads(), blame(ModelError, "the optimizer step failed"):
            if half.shared is not None:
                check_finite_grads(half.chain.parameters())
            with offload.stepping(optimizer, half.placement.device, half.placement.offload):
                optimizer.step()
    mirrored.steps += 1
    if half.shared is not None and rounds is None:
        half.shared.stepped()
    session.graphs.after_step(shared=half.shared is not None)
    return True


def step_settings(shared: SharedPart | None, optimizer: torch.optim.Optimizer, op: o.Step) -> None:
    """Set a step's learning rates (and changed settings) on the optimizer it steps: an own half's
    as the edge's scheduler left them, a shared half's within the cloud's policy."""
    if shared is None:
        _set_hyperparameters(optimizer, op)
        return
    lr = shared_policy(shared).step_lr(op)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr


def check_finite_grads(params: Iterable[torch.Tensor]) -> None:
    """Refuse a step of a shared half on a gradient with NaN or Inf: it would reach every edge."""
    if not all(torch.isfinite(p.grad).all() for p in params if p.grad is not None):
        raise ProtocolError("the session's gradient contains NaN or Inf (refused for a shared cloud part)")


def shared_policy(shared: SharedPart) -> SharedPolicy:
    """The cloud's settings for a shared half (none given: no optimizer, nothing frozen)."""
    return shared.policy if shared.policy is not None else _NO_POLICY


_NO_POLICY = SharedPolicy()


def _set_hyperparameters(optimizer: torch.optim.Optimizer, op: o.Step) -> None:
    """The learning rates (and any other setting a scheduler changed) of this step, per group."""
    groups = optimizer.param_groups
    lrs = [op.lr] * len(groups) if op.lrs is None else op.lrs
    for name, values in (("lrs", op.lrs), ("changes", op.changes)):
        if values is not None and len(values) != len(groups):
            raise ProtocolError(f"a step's {name} has {len(values)} entries for {len(groups)} parameter groups")
    for group, lr, changes in zip(groups, lrs, op.changes or [{}] * len(groups)):
        if lr is not None:
            if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr)):
                raise ProtocolError(f"learning rate {short(lr)} is not a finite number")
            group["lr"] = lr
        group.update(optimizer_state.checked_settings(group, changes, "a step", fixed=("params", "lr")))


@handles(o.ApplyEager)
def apply_eager(session: Target, op: o.ApplyEager) -> None:
    """The edge backpropagated through an eager call: add its parameter gradients, scaled."""
    if not math.isfinite(op.scale):
        raise ProtocolError(f"apply needs a finite scale, got {op.scale}")
    grads, owned = session.graphs.applicable(op.call, last=op.last)
    # torch's AccumulateGrad asks at the backward: a parameter frozen since the forward gets none
    deferred = [(p, g) for p, g in grads if p.requires_grad]
    with session.half.own_grads():  # gradients of a backward without create_graph: no graph to keep out of
        session.passes.add(op.pass_id if session.half.shared is None else None, deferred, op.scale, owned=owned)
    session.graphs.take(op.call)  # the graph kept in case the scale was not exact is not needed


@handles(o.ZeroGrad)
def zero_grad(session: Target, op: o.ZeroGrad) -> None:
    half, optimizer = session.half, session.mirrored.optimizer
    if op.names is not None:  # p.grad = None / p.grad.zero_() on the edge, parameter by parameter
        params = half.parameters_named(op.names)
        with torch.no_grad(), half.own_grads():
            for param in params:
                if op.set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()
        return
    with half.own_grads():
        if op.model or half.shared is not None:
            half.chain.zero_grad(set_to_none=op.set_to_none)
        elif optimizer is not None:
            optimizer.zero_grad(set_to_none=op.set_to_none)


@handles(o.ScaleGrads)
def scale_grads(session: Target, op: o.ScaleGrads) -> None:
    if session.half.shared is not None and not abs(op.factor) <= 1:
        # Clipping and unscaling shrink gradients; growing one would grow every edge's weights.
        raise PolicyError(f"a shared half's gradients may be scaled down only (|factor| <= 1), got {op.factor}")
    if op.divide:
        _each_grad(session.half, (op.factor,), op.names, lambda grad: grad.div_(op.factor))
    else:
        _each_grad(session.half, (op.factor,), op.names, lambda grad: grad.mul_(op.factor))


@handles(o.ClampGrads)
def clamp_grads(session: Target, op: o.ClampGrads) -> None:
    bounds = tuple(b for b in (op.low, op.high) if b is not None)
    if not bounds:
        raise ProtocolError("clamp_grads needs a low or a high bound")
    _each_grad(session.half, bounds, op.names, lambda grad: grad.clamp_(op.low, op.high))


def _each_grad(half: Half, numbers: tuple[float, ...], names: list | None,
               change: Callable[[torch.Tensor], Any]) -> None:
    # A non-finite factor is what torch's clip_grad_norm_ applies after an overflow (the loss scaler then
    # skips the step): mirrored on the session's own half, refused where other edges' weights would take it.
    if half.shared is not None and not all(math.isfinite(n) for n in numbers):
        raise ProtocolError(f"gradient operations on a shared cloud part need finite numbers, got {numbers}")
    params = half.parameters_named(names)
    with torch.no_grad(), half.own_grads():
        for param in params:
            if param.grad is not None:
                change(param.grad)


@handles(o.LoadWeights)
def load_weights(session: Target, op: o.LoadWeights) -> None:
    """Replace an own half's weights, each checked in the dtype it will have before any is loaded."""
    half = session.half
    if half.shared is not None:
        raise PolicyError("the weights of a shared cloud half are every edge's; one edge may not replace them "
                          "(load_weights is refused)")
    weights = cast_weights(half.chain, op.weights, "load_weights.weights", partial=op.partial)
    half.chain.load_qualified_state_dict(weights, partial=op.partial)


@handles(o.LoadOptimizerState)
def load_optimizer_state(session: Target, op: o.LoadOptimizerState) -> None:
    """``opt.load_state_dict`` with the cloud half's entries: they become its optimizer's state
    (and the settings the loaded state dict's groups hold, its groups' settings)."""
    optimizer_state.load(session, op.entries, op.changes)


__all__ = ["HANDLERS", "Mirrored", "Target", "apply_ops", "check_finite_grads", "handler_for", "handles",
           "step_settings"]
