"""The loss of a plain split, computed in the cloud: ``crit = model.remote_loss(criterion)``.

The model's forward stops at the cut and returns what would cross it; ``crit(out, target)``
sends that and the target, and the cloud runs its half and the loss. What it returns is a
:class:`CutTensor`: the activation at the cut, not the model's output, so a script that computes
on it as on the output (an accuracy from ``out.argmax(1)``, a term of the loss made from ``out``)
gets an error naming the fix instead of a silently different number.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..devices import autocast_dtype
from ..errors import ConfigError
from ..generator_state import host_state
from . import generator_sets
from .ghost_classes import settings_version
from .metadata import METADATA, SHAPE_AND_TYPE, described, requires_grad_changes
from .output_shapes import OutputShapes
from .remote_call import refuse_transforms
from .schedule import refuse_sparse
from .stray import crossed


def in_order(value: Any) -> Any:
    """``value`` through a view made now, at ``model(x)``, for the remote loss's call: unsplit, the
    cloud half's first autograd node takes the activation here, and the engine adds its gradient to
    the activation's after those of nodes made later (edge heads on the activation before the
    loss, made before the remote loss's node); the view keeps that place for the cloud's."""
    if isinstance(value, torch.Tensor) and value.requires_grad and torch.is_grad_enabled():
        return value.view_as(value)
    return value


@dataclass
class CutActivation:
    """What reaches a plain cut when more than one value crosses (e.g. hidden states and a mask)."""

    args: tuple
    kwargs: dict
    versions: tuple[int | None, ...] = field(init=False)  # of the values that are tensors, at model(x)

    def __post_init__(self) -> None:
        self.args = tuple(in_order(value) for value in self.args)
        self.kwargs = {key: in_order(value) for key, value in self.kwargs.items()}
        self.versions = _versions((*self.args, *self.kwargs.values()))


def _versions(values: tuple) -> tuple[int | None, ...]:
    """Each tensor's version counter (None for what is no tensor): what :func:`call_parts` compares."""
    return tuple(_version(value) if isinstance(value, torch.Tensor) else None for value in values)


def _version(tensor: torch.Tensor) -> int | None:
    """Its version counter; None for one made under ``torch.inference_mode()``, which keeps none
    (and which torch lets no one change in place outside it)."""
    return None if tensor.is_inference() else tensor._version


class CutTensor(torch.Tensor):
    """A plain split's ``model(x)``: the activation at the cut, for ``crit(out, target)`` (a remote
    loss) or ``model.predict``. It answers what reads no values: its shape and dtype as the unsplit
    model's output's (:mod:`.output_shapes`), its device and ``requires_grad``; any computation on
    it raises, since the unsplit model's ``model(x)`` is the output the cloud computes."""

    _splitft_value: torch.Tensor
    _splitft_passage: torch.Tensor  # what the cloud's call takes (see :func:`in_order`)
    _splitft_outputs: OutputShapes | None
    _splitft_version: int | None  # the activation's version counter at model(x)

    @staticmethod
    def __new__(cls, value: torch.Tensor, outputs: OutputShapes | None = None) -> CutTensor:
        refuse_sparse(value)
        made: Any = torch.Tensor._make_wrapper_subclass(cls, value.shape, strides=value.stride(), dtype=value.dtype,
                                                        device=value.device, requires_grad=value.requires_grad)
        made._splitft_value = value
        made._splitft_passage = in_order(value)
        made._splitft_outputs = outputs
        made._splitft_version = _version(value)
        return made

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's: unannotated
        return f"CutTensor(the activation at the cut, shape={tuple(self.shape)}, dtype={self.dtype})"

    @property
    def activation(self) -> torch.Tensor:
        """The activation itself, to compute on as such (what crosses the cut: a privacy analysis)."""
        crossed(self)
        return self._splitft_value

    def _output_like(self, func: Any) -> torch.Tensor:
        """A stand-in for the unsplit output, on which ``func`` answers the script's question."""
        name = f"out.{described(func)}"
        if self._splitft_outputs is None:
            raise ConfigError(f"{name} on what a plain split's model(x) returns: unsplit, that is the model's output, "
                              "whose shape the cloud computes later; read it from model.predict(x)")
        cut = self.__dict__.get(CUT_CONTEXT)
        return self._splitft_outputs.like(self._splitft_value, cut.autocast if cut else (None, None), name)

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if func in SHAPE_AND_TYPE and args and isinstance(args[0], CutTensor):
            args = (args[0]._output_like(func), *args[1:])
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise ConfigError(_REFUSAL.format(name=getattr(func, "__qualname__", None) or getattr(func, "__name__", func)))

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]  # torch's default is a plain function
            cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        raise ConfigError(_REFUSAL.format(name=func))


_REFUSAL = ("{name} on what a plain split's model(x) returns: the activation at the cut, not the model's output (the "
            "cloud computes that, with the loss: crit = model.remote_loss(criterion); crit(out, target)). For the "
            "output use model.predict(x); to compute on it while training, cut a U-shape (rejoin=) so the head "
            "runs on the edge; for the activation itself (what crosses the cut), out.activation")


def call_parts(cut: Any) -> tuple[tuple, dict]:
    """The arguments of the cloud's call for what the model's forward returned at the cut, once
    they are known to hold what they held at ``model(x)``."""
    if isinstance(cut, CutActivation):
        if _versions((*cut.args, *cut.kwargs.values())) != cut.versions:
            raise ConfigError(_CHANGED_SINCE)
        return cut.args, cut.kwargs
    if isinstance(cut, CutTensor):
        if _version(cut._splitft_value) != cut._splitft_version:
            raise ConfigError(_CHANGED_SINCE)
        return (cut._splitft_passage,), {}
    return (cut,), {}


_CHANGED_SINCE = (
    "what crossed the cut at model(x) was changed in place since (a hook's kept activation normalized with div_, "
    "the input x.mul_() when the cut is at the first layer): unsplit, the model's output was computed at model(x), "
    "before the change; split, the cloud half runs at the loss, on the changed values, so the loss would silently "
    "differ. Change a clone (h.clone().div_(...)), or compute the loss before the change")


@dataclass(frozen=True)
class CutContext:
    """What a plain split's ``model(x)`` ran under, where the unsplit model ran its cloud half too:
    the generator state at the cut (the half's dropout drew from there, before whatever the script
    drew since), the mode, whether gradients were on and the autocast dtype per device type."""

    rng: torch.Tensor
    training: bool
    grad: bool
    autocast: tuple[str | None, str | None]  # on the CPU, on CUDA
    weights: int  # the cloud half's weights' version (:attr:`.outbox.Outbox.weights_version`)
    settings: int  # the cloud modules' modes and settings' version (:func:`.ghost_classes.settings_version`)
    generator_sets: int  # :func:`.generator_sets.count`
    requires_grad: int  # :func:`.metadata.requires_grad_changes`

    @staticmethod
    def now(training: bool, weights: int) -> CutContext:
        return CutContext(host_state(), training, torch.is_grad_enabled(),
                          (autocast_dtype("cpu"), autocast_dtype("cuda")), weights, settings_version(),
                          generator_sets.count(), requires_grad_changes())

    def generator_since(self) -> str:
        """What the script did to the generator since ``model(x)``: ``"untouched"``, ``"drew"``, or
        ``"set"`` it before drawing (``torch.random.fork_rng`` around ``model(x)`` puts it back;
        unsplit, the cloud half's draws came first and what the generator holds after is the
        script's: :func:`.generator_sets.since`)."""
        return generator_sets.since(self.generator_sets, self.rng)

    def refuse_changes(self, training: bool, weights: int) -> None:
        """Refuse a loss computed in another mode or autocast than its ``model(x)``, or after the
        cloud half's weights changed (a step, a load, ``w.mul_()``) or a cloud layer's mode or
        setting did: the cloud half would run in those of the loss, where unsplit it ran in those
        of the forward."""
        autocast = (autocast_dtype("cpu"), autocast_dtype("cuda"))
        changed = ("mode (model.train() / model.eval())" if training != self.training else
                   "autocast" if autocast != self.autocast else
                   "cloud half's weights (a step, a load, an in-place change)" if weights != self.weights else
                   "mode or a setting of a cloud layer (net[3].eval(), m.p = 0.0)"
                   if settings_version() != self.settings else
                   "requires_grad of a cloud parameter (a layer frozen or unfrozen)"
                   if requires_grad_changes() != self.requires_grad else None)
        if changed:
            raise ConfigError(
                f"the {changed} changed between model(x) and its remote loss: unsplit, the cloud half ran in those "
                "of model(x); split, it runs at the loss, so it would run in the new ones and training would "
                "silently differ. Compute the loss right after model(x), in the same mode and autocast region (or "
                "use model.predict(x) for an output to compute on)")


#: Where a plain split's ``model(x)`` keeps its :class:`CutContext`.
CUT_CONTEXT = "_splitft_cut_context"


class CloudCall(Protocol):
    """The split model's call through the cut: the cloud half on ``(args, kwargs)``, with the loss
    for ``target``; ``again``: these arguments already crossed for an earlier loss, whose forward
    started from this generator state (the cloud repeats that forward, leaving no trace); ``cut``:
    what the ``model(x)`` that made them ran under."""

    def __call__(self, args: tuple, kwargs: dict, target: Any = None, again: torch.Tensor | None = None,
                 cut: CutContext | None = None) -> Any: ...


class RemoteLoss(torch.nn.Module):
    """``crit(out, target)`` for a plain split: the cloud runs its part and the loss.

    Made from a torch.nn loss (``criterion``), it stands for that loss as the script sees it: a
    module (what frameworks take a criterion to be: skorch uses a module as it is, and a parent
    module keeps it as a child, ``self.crit = model.remote_loss(self.crit)``), whose tensors, hooks
    and mode are the criterion's own, and an attribute read or set on it is the criterion's, so
    ``crit.label_smoothing = 0.1`` changes the loss the cloud computes, as it changes the unsplit
    one (set on this object only, it would change nothing). Made from a torch.nn.functional loss,
    it is a module with nothing in it, called as that function is."""

    _OWN = frozenset({"call", "before", "criterion"})

    def __init__(self, call: CloudCall, before: Callable[[], None] | None = None,
                 criterion: torch.nn.Module | None = None) -> None:
        super().__init__()  # torch sets its tables past __setattr__
        vars(self).update(call=call, before=before, criterion=criterion)  # before: sends the criterion again
        # if it is not the cloud's as it is now
        if criterion is not None:  # its parameters, buffers, hooks and mode: read from the criterion
            for key in [k for k in vars(self) if k not in self._OWN]:
                del vars(self)[key]

    def __getattr__(self, name: str) -> Any:
        criterion: torch.nn.Module | None = vars(self).get("criterion")
        if criterion is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        found = getattr(criterion, name)
        if callable(found) and getattr(found, "__self__", None) is criterion:
            return _returning_self(self, found)
        return found

    def __setattr__(self, name: str, value: Any) -> None:
        criterion = vars(self).get("criterion")
        if criterion is None or name in self._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(criterion, name, value)

    def __delattr__(self, name: str) -> None:
        criterion = vars(self).get("criterion")
        if criterion is None or name in self._OWN:
            object.__delattr__(self, name)
        else:
            delattr(criterion, name)

    def __repr__(self) -> str:
        criterion = vars(self).get("criterion")
        return f"{type(self).__name__}({criterion!r})" if criterion is not None else f"{type(self).__name__}()"

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``crit.forward(out, y)`` is the loss, as a module's forward is."""
        return self(*args, **kwargs)

    def __call__(self, out: Any, target: torch.Tensor, *more: Any, **kwargs: Any) -> torch.Tensor:
        refuse_transforms()  # before anything reads the generator's state, which a transform hides
        if more or kwargs:
            raise ConfigError(_MORE_ARGUMENTS.format(given=", ".join([*("a third argument" for _ in more[:1]),
                                                                       *map(repr, kwargs)])))
        if self.criterion is not None and torch.is_grad_enabled():
            _refuse_learned_settings(self.criterion)
        if self.before is not None:
            self.before()
        args, kwargs = call_parts(out)
        crossed(out)
        cut = out.__dict__.get(CUT_CONTEXT) if isinstance(out, (CutTensor, CutActivation)) else None
        gradless = cut is not None and not cut.grad and torch.is_grad_enabled()
        if gradless and isinstance(out, torch.Tensor) and out.requires_grad:
            raise ConfigError(_GRADIENTS_ADDED)
        # a model(x) under no_grad: unsplit, the cloud half ran there, building no graph
        with torch.no_grad() if gradless else contextlib.nullcontext():
            loss = self.call(args, kwargs, target, again=_again(out), cut=cut)
        if isinstance(out, CutTensor) and isinstance(loss, torch.Tensor) and loss.requires_grad:
            _one_pass_each(out, loss)
        return loss


def _returning_self(remote: RemoteLoss, method: Any) -> Callable[..., Any]:
    """The criterion's bound ``method``, giving back the remote loss where it gives back the criterion
    (``crit = crit.to(device)``, ``crit.train()``: the script keeps the remote loss, as unsplit the module)."""
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        result = method(*args, **kwargs)
        return remote if result is method.__self__ else result

    return call


def _refuse_learned_settings(criterion: torch.nn.Module) -> None:
    """A loss's tensor setting that requires a gradient (a learned ``pos_weight``): torch's losses
    are not differentiable in them, and unsplit the call raises; the cloud's copy takes its values."""
    for name, value in criterion._buffers.items():  # a torch.nn loss's tensor settings (weight, pos_weight)
        if value is not None and value.requires_grad:
            raise ConfigError(f"{type(criterion).__name__}'s {name} requires a gradient, in which torch's loss is not "
                              "differentiable (unsplit, this call raises); the cloud's loss would take its values "
                              "and no gradient would reach it. Pass it detached, or compute the loss on the edge "
                              "(a U-shape, split(..., rejoin=...))")


def mean_denominator(criterion: torch.nn.Module) -> Callable[[torch.Tensor], float] | None:
    """What ``criterion``'s mean divides a batch's sum by, from its targets, where that is not the
    number of rows: a cross-entropy or NLL loss of class indices divides by the class weights of
    the targets it counts (their number without weights), leaving out ``ignore_index``. Micro-batches
    of a call weigh their losses by it (their mean of rows would be another loss, and a part whose
    targets are all ignored has none). None where rows are the measure."""
    if not isinstance(criterion, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)) or criterion.reduction != "mean":
        return None

    def denominator(target: torch.Tensor) -> float:
        if target.is_floating_point():  # class probabilities: the mean is over rows
            return float(target.shape[0])
        counted = target[target != criterion.ignore_index]
        weight = criterion.weight
        return float(weight[counted].sum()) if weight is not None else float(counted.numel())

    return denominator


_MORE_ARGUMENTS = (
    "a remote loss is called as crit(out, target); this call also gives {given}. The cloud computes the loss "
    "by its torch.nn class and settings: give the settings to the loss itself (model.remote_loss("
    "nn.CrossEntropyLoss(weight=w)) for F.cross_entropy(out, y, weight=w), or crit.weight = w before the call). "
    "For a loss of more inputs, cut a U-shape (split(..., rejoin=...)) so it runs on the edge")


_GRADIENTS_ADDED = (
    "a remote loss of a model(x) that ran with gradients off and whose output was made to require them after it "
    "(torch.utils.checkpoint(model, x, use_reentrant=True), an autograd.Function around model(x), "
    "out.requires_grad_()): unsplit, the loss's gradient flows through what was wrapped around model(x); split, "
    "the cloud half runs at the loss on the activation itself, and that gradient would never reach the edge's "
    "layers, so training would silently differ. Checkpoint with use_reentrant=False, or the edge's layers "
    "inside the model")


def _again(out: Any) -> torch.Tensor | None:
    """For a second loss of one ``model(x)`` (a metric logged beside the training loss, mixup):
    the generator state the first loss's forward started from. Unsplit, the cloud half ran once
    for both, so its second run here must draw the same dropout masks, and leave its buffers (batch
    norm's running statistics) and its generator as the first left them. None for the first loss."""
    if not isinstance(out, (CutTensor, CutActivation)):
        return None
    start = out.__dict__.get("_splitft_start_rng")
    if start is None:
        out.__dict__["_splitft_start_rng"] = host_state()
    return start


def _one_pass_each(out: CutTensor, loss: torch.Tensor) -> None:
    """Refuse, in the backward, two losses of one ``model(x)`` backpropagated in one pass (mixup's
    ``lam * crit(out, ya) + (1 - lam) * crit(out, yb)``). Unsplit, the cloud half ran once and
    its backward gets the two losses' gradients summed; here each loss ran the cloud half on its
    own, whose gradients add up in another order (a silent drift of an ulp per step). Looked at
    once a second loss is made from the same ``out`` (a lone loss costs nothing): a hook on each
    notes its backward pass."""
    losses: list[torch.Tensor] = out.__dict__.setdefault("_splitft_losses", [])
    losses.append(loss)
    if len(losses) < 2:
        return
    passes: set[int] = out.__dict__.setdefault("_splitft_passes", set())

    def once_per_pass(grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task in passes:
            raise ConfigError("two remote losses computed from one model(x) are backpropagated together (mixup, a "
                              "weighted sum of losses): unsplit, the cloud half runs once and backpropagates their "
                              "summed gradient, which the cloud, having computed each loss on its own, cannot repeat "
                              "bit for bit. Make it one remote loss call (soft targets: crit(out, lam * ya_onehot + "
                              "(1 - lam) * yb_onehot)), or cut a U-shape (rejoin=) so the losses run on the edge")
        passes.add(task)

    try:
        for each in losses[:-1] if len(losses) == 2 else ():
            each.register_hook(once_per_pass)
        loss.register_hook(once_per_pass)
    except RuntimeError:  # a streamed loss, filled in when its step arrives, takes no hook
        raise ConfigError("a second remote loss from one model(x) while steps are streamed: whether the two are "
                          "backpropagated together (which the cloud cannot repeat bit for bit) cannot be told; "
                          "make it one remote loss call") from None


__all__ = ["CloudCall", "CutActivation", "CutTensor", "RemoteLoss", "call_parts", "mean_denominator"]
