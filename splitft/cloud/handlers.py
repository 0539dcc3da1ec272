"""Applying the operations an edge mirrors (:mod:`splitft.wire.operations`) to one session.

Each operation has one handler, found by its record type in :data:`HANDLERS`. Operations that
change state carry ids of their own (step n, attachment n), so applying a replayed request again
is harmless.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..wire import operations as o
from ..errors import CapacityError, ConfigError, ModelError, PolicyError, ProtocolError
from ..wire.protocol import _short
from .blame import blame
from .shared_policy import SharedPolicy

if TYPE_CHECKING:
    from .session import CloudSession

log = logging.getLogger(__name__)


def apply_ops(session: CloudSession, ops: list) -> int:
    """Apply mirrored operations in order; returns how many optimizer steps were new."""
    if len(ops) > session.limits.max_ops:
        raise CapacityError(f"a message carries {len(ops)} operations; this cloud applies at most "
                            f"{session.limits.max_ops} per message")
    stepped = 0
    for value in ops:
        op = o.from_wire(value)
        stepped += bool(HANDLERS[type(op)](session, op))
    return stepped


def check_norm_type(norm_type: float) -> None:
    """A gradient norm's type the edge may ask for: positive, or inf."""
    if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
        raise ProtocolError(f"a gradient norm's type must be positive, got {norm_type}")


def _positive_id(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ProtocolError(f"operation id must be a positive int, got {value}")
    return value


def attach_optimizer(session: CloudSession, op: o.AttachOptimizer) -> None:
    op_id = _positive_id(op.id)
    if op_id is not None and op_id <= session.optimizer_id and session.optimizer_spec is not None:
        return  # a replayed attach: the optimizer (and its state) is already there
    cls = getattr(torch.optim, op.name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
        raise ConfigError(f"{_short(op.name)} is not a torch.optim optimizer")
    groups = _param_groups(session, op)
    shared = session.shared
    if shared is not None:  # the cloud's optimizer, never the first edge's: an edge's must be it
        policy = shared_policy(session)
        policy.check_attach(cls.__name__, op.settings, op.groups, session.chain.qualified_parameters())
        if shared.optimizer is None:
            shared.optimizer = policy.build(list(session.chain.parameters()))
            shared.optimizer_spec = (policy.optimizer, policy.describe())
    else:
        session.own_optimizer = _make_optimizer(groups, cls, op.settings)
    session.optimizer_spec = o.AttachOptimizer(name=cls.__name__, settings=dict(op.settings), groups=op.groups)
    session.optimizer_id = op_id if op_id is not None else session.optimizer_id + 1


def _param_groups(session: CloudSession, op: o.AttachOptimizer) -> list[dict[str, Any]]:
    """The optimizer's groups over the half's parameters, by their unsplit names."""
    if op.groups is None:
        return [{"params": list(session.chain.parameters())}]
    if len(op.groups) > _MAX_GROUPS:
        raise CapacityError(f"an optimizer with {len(op.groups)} parameter groups; at most {_MAX_GROUPS}")
    groups, seen = [], set()
    for group in op.groups:
        if not (isinstance(group, dict) and set(group) == {"names", "settings"} and isinstance(group["names"], list)
                and all(isinstance(n, str) for n in group["names"]) and isinstance(group["settings"], dict)):
            raise ProtocolError(f"a parameter group is a map of 'names' (list of str) and 'settings' (map), "
                                f"got {_short(group)}")
        unknown = [k for k in group["settings"] if k not in op.settings]
        if unknown:
            raise ConfigError(f"a parameter group sets {_short(unknown[0])}, which is not among the optimizer's settings")
        names = group["names"]
        if seen.intersection(names) or len(set(names)) != len(names):
            raise ProtocolError("a parameter appears in more than one parameter group")
        seen.update(names)
        groups.append({"params": session.parameters_named(names), **group["settings"]})
    return groups


_MAX_GROUPS = 1024


def _make_optimizer(groups: list[dict[str, Any]], cls: type, settings: dict) -> torch.optim.Optimizer | None:
    """The optimizer, or None when none of its groups holds a parameter of this half (it steps nothing here)."""
    if not any(group["params"] for group in groups):
        return None
    try:
        return cls(groups, **settings)
    except Exception as exc:  # optimizers raise TypeError, ValueError, RuntimeError for bad settings
        raise ConfigError(f"cannot build {cls.__name__} with {_short(settings)}: {exc}") from exc


def free_cache(session: CloudSession, op: o.FreeCache) -> None:
    session.caches.free(op.id)


def set_modes(session: CloudSession, op: o.SetModes) -> None:
    """Modules to run in the other mode than each call's (``net.layer[3].eval()`` during training)."""
    modules = session.chain.qualified_modules()
    unknown = [n for n in op.names if not isinstance(n, str) or n not in modules]
    if unknown:
        raise ProtocolError(f"the cloud half has no module {_short(unknown[0])}")
    session.flipped = [modules[n] for n in dict.fromkeys(op.names)]


def set_frozen(session: CloudSession, op: o.SetFrozen) -> None:
    """``requires_grad`` of each parameter of the half, as the edge's script set it (a shared
    half's are the cloud's: the edge's must match them)."""
    frozen = {id(p) for p in session.parameters_named(op.names)}
    if session.shared is not None:
        shared_policy(session).check_frozen(op.names)
        return
    for param in session.chain.parameters():
        param.requires_grad_(id(param) not in frozen)


def set_loss(session: CloudSession, op: o.SetLoss) -> None:
    cls = getattr(nn, op.name, None)
    if not (isinstance(cls, type) and issubclass(cls, nn.modules.loss._Loss)):
        raise ConfigError(f"{_short(op.name)} is not a torch.nn loss")
    try:
        session.loss_fn = cls(**op.settings)
    except Exception as exc:
        raise ConfigError(f"cannot build {cls.__name__} with {_short(op.settings)}: {exc}") from exc
    session.loss_spec = op


def step(session: CloudSession, op: o.Step) -> bool:
    step_id = _positive_id(op.id)
    if step_id is not None:
        if step_id <= session.steps:
            session.duplicates += 1
            log.info("session %s: optimizer step %d was applied already; skipped", session.id, step_id)
            return False
        if step_id != session.steps + 1:
            raise ProtocolError(f"optimizer step {step_id} arrived but this session is at step {session.steps}; "
                                "steps in between were lost (resume the session to replay them)")
    if session.optimizer_spec is None:
        raise ConfigError("the edge stepped its optimizer, but none was attached: call model.attach(optimizer)")
    rounds = session.shared.rounds if session.shared is not None else None
    if rounds is not None:
        rounds.contribute(session, op)  # one optimizer step for all the round's edges, when it closes
    elif (optimizer := session.optimizer) is not None:
        step_settings(session, optimizer, op)
        with session.own_grads(), blame(ModelError, "the optimizer step failed"):
            if session.shared is not None:
                check_finite_grads(session.chain.parameters())
            optimizer.step()
    session.steps += 1
    if session.shared is not None:
        session.shared.updates += rounds is None
    else:
        session.pending.clear()  # graphs from before a step can no longer be backpropagated correctly
    session.deferred.clear()
    return True


def step_settings(session: CloudSession, optimizer: torch.optim.Optimizer, op: o.Step) -> None:
    """Set a step's learning rates (and changed settings) on the optimizer it steps: an own half's
    as the edge's scheduler left them, a shared half's within the cloud's policy."""
    if session.shared is None:
        _set_hyperparameters(optimizer, op)
        return
    lr = shared_policy(session).step_lr(op)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr


def check_finite_grads(params: Iterable[torch.Tensor]) -> None:
    """Refuse a step of a shared half on a gradient with NaN or Inf: it would reach every edge."""
    if not all(torch.isfinite(p.grad).all() for p in params if p.grad is not None):
        raise ProtocolError("the session's gradient contains NaN or Inf (refused for a shared cloud part)")


def shared_policy(session: CloudSession) -> SharedPolicy:
    """The cloud's settings for the session's shared half (none given: no optimizer, nothing frozen)."""
    policy = getattr(session.shared, "policy", None)
    return policy if policy is not None else _NO_POLICY


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
                raise ProtocolError(f"learning rate {_short(lr)} is not a finite number")
            group["lr"] = lr
        if not isinstance(changes, dict):
            raise ProtocolError(f"a group's changed settings must be a map, got {_short(changes)}")
        for key, value in changes.items():
            if key in ("params", "lr") or key not in group:
                raise ProtocolError(f"a step cannot change the optimizer's {_short(key)}")
            if not _plain_setting(value, group[key]):
                raise ProtocolError(f"setting {key} must keep its type, got {_short(value)}")
            group[key] = tuple(value) if isinstance(group[key], tuple) else value


def _plain_setting(value: Any, current: Any) -> bool:
    if isinstance(current, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(current, bool)
    if isinstance(current, (int, float)):
        return isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(current, (tuple, list)):
        return (isinstance(value, list) and len(value) == len(current)
                and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value))
    return False


def apply_eager(session: CloudSession, op: o.ApplyEager) -> None:
    """The edge backpropagated through an eager call: add its parameter gradients, scaled."""
    if not math.isfinite(op.scale):
        raise ProtocolError(f"apply needs a finite scale, got {op.scale}")
    deferred = session.deferred.get(op.call)
    if deferred is None:
        raise ProtocolError(f"no eager call {op.call} to apply (freed by an optimizer step, or never sent)")
    with torch.no_grad(), session.own_grads():
        for param, grad in deferred:
            if grad is None:
                continue
            if param.grad is None:
                param.grad = grad * op.scale
            else:
                param.grad.add_(grad, alpha=op.scale)


def zero_grad(session: CloudSession, op: o.ZeroGrad) -> None:
    if op.names is not None:  # p.grad = None / p.grad.zero_() on the edge, parameter by parameter
        params = session.parameters_named(op.names)
        with torch.no_grad(), session.own_grads():
            for param in params:
                if op.set_to_none:
                    param.grad = None
                elif param.grad is not None:
                    param.grad.zero_()
        return
    with session.own_grads():
        if op.model or session.shared is not None:
            session.chain.zero_grad(set_to_none=op.set_to_none)
        elif session.optimizer is not None:
            session.optimizer.zero_grad(set_to_none=op.set_to_none)


def scale_grads(session: CloudSession, op: o.ScaleGrads) -> None:
    if session.shared is not None and not abs(op.factor) <= 1:
        # Clipping and unscaling shrink gradients; growing one would grow every edge's weights.
        raise PolicyError(f"a shared half's gradients may be scaled down only (|factor| <= 1), got {op.factor}")
    if op.divide:
        _each_grad(session, (op.factor,), op.names, lambda grad: grad.div_(op.factor))
    else:
        _each_grad(session, (op.factor,), op.names, lambda grad: grad.mul_(op.factor))


def clamp_grads(session: CloudSession, op: o.ClampGrads) -> None:
    bounds = tuple(b for b in (op.low, op.high) if b is not None)
    if not bounds:
        raise ProtocolError("clamp_grads needs a low or a high bound")
    _each_grad(session, bounds, op.names, lambda grad: grad.clamp_(op.low, op.high))


def _each_grad(session: CloudSession, numbers: tuple[float, ...], names: list | None,
               change: Callable[[torch.Tensor], Any]) -> None:
    # A non-finite factor is what torch's clip_grad_norm_ applies after an overflow (the loss scaler then
    # skips the step): mirrored on the session's own half, refused where other edges' weights would take it.
    if session.shared is not None and not all(math.isfinite(n) for n in numbers):
        raise ProtocolError(f"gradient operations on a shared cloud part need finite numbers, got {numbers}")
    params = session.parameters_named(names)
    with torch.no_grad(), session.own_grads():
        for param in params:
            if param.grad is not None:
                change(param.grad)


def load_weights(session: CloudSession, op: o.LoadWeights) -> None:
    """Replace an own half's weights, each checked in the dtype it will have before any is loaded."""
    if session.shared is not None:
        raise PolicyError("the weights of a shared cloud half are every edge's; one edge may not replace them "
                          "(load_weights is refused)")
    weights = cast_weights(session.chain, op.weights, "load_weights.weights", partial=op.partial)
    session.chain.load_qualified_state_dict(weights, partial=op.partial)


def cast_weights(chain: Any, arrays: Any, what: str, partial: bool = False) -> dict[str, torch.Tensor]:
    """Pushed weights, every one of the half's tensors (``partial``: some of them), each cast to
    its tensor's dtype and checked there (1e300 sent as float64 is Inf in float32): a
    :class:`ProtocolError` before anything is loaded, so a refused push changes nothing."""
    from .session import tensors_from_wire

    weights = tensors_from_wire(arrays, what)
    targets = chain.qualified_state_dict()
    missing, extra = sorted(set(targets) - set(weights)), sorted(set(weights) - set(targets))
    if extra or (missing and not partial):
        raise ProtocolError(f"{what} do not fit the cloud half: missing {_short(missing)}, unexpected {_short(extra)}")
    cast = {}
    for name in weights:
        target, value = targets[name], weights[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ProtocolError(f"{what}: {name!r} has shape {tuple(value.shape)}; the cloud half's is "
                                f"{tuple(target.shape)}")
        with blame(ProtocolError, f"{what}: {name!r} cannot be cast to {target.dtype}"):
            cast[name] = value.to(target.dtype)
        if cast[name].is_floating_point() and not torch.isfinite(cast[name]).all():
            raise ProtocolError(f"{what}: {name!r} contains NaN or Inf in the half's dtype {target.dtype}")
    return cast


HANDLERS: dict[type[o.Operation], Callable[[Any, Any], Any]] = {
    o.AttachOptimizer: attach_optimizer,
    o.SetLoss: set_loss,
    o.Step: step,
    o.ApplyEager: apply_eager,
    o.ZeroGrad: zero_grad,
    o.ScaleGrads: scale_grads,
    o.ClampGrads: clamp_grads,
    o.LoadWeights: load_weights,
    o.SetFrozen: set_frozen,
    o.SetModes: set_modes,
    o.FreeCache: free_cache,
}

__all__ = ["HANDLERS", "apply_ops", "cast_weights", "check_norm_type"]
