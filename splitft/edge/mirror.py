"""Mirroring: what the user's loop does to the edge's half that the cloud must do to its own.

The optimizer the user attaches is rebuilt in the cloud by class name and settings; its steps and
``zero_grad`` calls, the loss the cloud computes in a plain split, the cloud parameters a script
freezes and the cloud modules it puts in the other mode are *operations*
(:mod:`splitft.wire.operations`) that ride on the next message the edge sends, which the cloud
applies before that message. So a step costs no extra round trip, and gradient accumulation
behaves exactly as it does locally. The optimizer's copy is :mod:`.optimizer_mirror`'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from ..errors import ConfigError
from ..wire.operations import Operation, SetFlags, SetFrozen, SetLoss, SetModes
from . import optimizers
from .cloud_half import CloudHalf
from .ghost_hooks import HOOK_TABLES
from .metadata import requires_grad_changes
from .optimizer_mirror import OptimizerMirror
from .optimizer_settings import NOT_PLAIN, optimizer_settings, plain_setting
from .placeholders import RemoteTensor


class Link(Protocol):
    """What a mirror needs of the session (:class:`~splitft.edge.requests.EdgeSession`)."""

    shared: bool  # other edges train the same cloud half: a step is sent at once

    def sync(self, want_state: bool = False, checkpoint: bool = False, pin: bool = False) -> Any: ...

    def optimizer_state(self) -> dict[str, dict[str, Any]]: ...


class Queue(Protocol):
    """Where operations wait for the next message (:class:`~splitft.edge.outbox.Outbox`)."""

    def queue(self, op: Operation) -> None: ...


class Steps(Protocol):
    """The optimizer step count (:class:`~splitft.edge.stage.CloudStage` keeps it)."""

    step: int


def _refuse_replaced_settings(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A setting the script changed after building the optimizer of a resumed model, which the
    checkpoint's state, loading as the optimizer is attached, would replace unseen."""
    saved = state.get("param_groups", [])
    for i, key, value in optimizers.set_since_built(optimizer) or ():
        if i < len(saved) and key in saved[i] and value != plain_setting(saved[i][key]):
            raise ConfigError(f"{key}={value!r} was set on param group {i} of this {type(optimizer).__name__} after it "
                              f"was built, and split(..., resume_from=) would replace it with the checkpoint's "
                              f"{key}={saved[i][key]!r}: the checkpoint's optimizer state loads when the optimizer is "
                              "attached (its first step, or model.attach(opt)). Call model.attach(opt) right after "
                              f"building the optimizer and set {key} after that, or leave it to go on with the "
                              "checkpoint's")


class ModelMirror:
    """What the cloud must repeat of one split model's training: its optimizer (one at a time,
    attachments numbered so that a replayed one is recognised), the cloud parameters the script
    froze and the cloud modules it put in the other mode (sent when they change), its loss.

    Args:
        link: the session (a shared half gets each step at once).
        outbox: where the operations wait for the next message.
        steps: the optimizer step count, which each mirrored step advances.
        cloud_half: the edge's record of the cloud half's parameters and gradients.
        on_step: runs after each mirrored step.
    """

    def __init__(self, link: Link, outbox: Queue, steps: Steps, cloud_half: CloudHalf, *,
                 on_step: Callable[[], None]) -> None:
        self.link, self.outbox, self.steps, self.cloud_half, self.on_step = link, outbox, steps, cloud_half, on_step
        #: Runs before each mirrored step: refuses what the model's tensors went through that the cloud would not follow.
        self.before_step: Callable[[], None] = lambda: None
        self.optimizer: torch.optim.Optimizer | None = None
        self.optimizer_mirror: OptimizerMirror | None = None
        self._criterion: nn.Module | None = None  # the remote loss, and what it was when last sent
        self._criterion_sent: tuple = ()
        self.optimizer_id = 0  # optimizers attached so far: the cloud builds each id once
        self.resume_state: dict | None = None  # optimizer state from an edge checkpoint, for the next attach
        self._attaching = False
        #: The cloud parameters that require a gradient, as last sent.
        self.trainable: frozenset[str] = frozenset()
        self._frozen_sent: frozenset[str] | None = None
        self._flags_read_at = -1  # :func:`.metadata.requires_grad_changes` when the flags were last read
        self._flipped_sent: list[str] = []

    def resume(self, optimizer_state: dict | None, optimizer_id: int) -> None:
        """An edge checkpoint's optimizer: its state loads at the next attach, which the cloud,
        having restored its own, skips."""
        self.resume_state, self.optimizer_id = optimizer_state, optimizer_id

    def resuming(self) -> bool:
        """An edge checkpoint's optimizer state waits for the next attach (not under way)."""
        return self.resume_state is not None and not self._attaching

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Mirror ``optimizer`` in the cloud (see :meth:`SplitModel.attach`)."""
        if self.optimizer is optimizer:
            return optimizer
        self._attaching = True  # what the attach reads of the optimizer (its state_dict) does not attach it again
        try:
            return self._attach(optimizer)
        finally:
            self._attaching = False

    def _attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        optimizer_mirror = OptimizerMirror(self, optimizer)  # refuses what it cannot mirror, before any change
        carried = optimizer_mirror.check_initial_state()  # stepped before split(): goes on from there
        if carried is not None and self.resume_state is not None:
            raise ConfigError(f"this {type(optimizer).__name__} holds state of its own, and split(..., resume_from=) "
                              "restores the checkpoint's: build a new optimizer to resume with")
        if self.resume_state is not None:
            _refuse_replaced_settings(optimizer, self.resume_state)
        if self.optimizer_mirror is not None:
            # A new optimizer (one per stage, say) replaces the one before, in the cloud too, as
            # the unsplit loop would step only the new one; the old one stepping again is refused.
            self.optimizer_mirror.replaced(optimizer)
        if self.resume_state is not None:
            optimizers.load_optimizer_state(optimizer, self.resume_state)
            op_id = self.optimizer_id  # the cloud restored its optimizer: this attach is a no-op there
        else:
            self.optimizer_id += 1
            op_id = self.optimizer_id
        optimizer_mirror.attached(op_id)
        optimizers.mirrored(optimizer, optimizer_mirror)
        if carried is not None:
            optimizer_mirror.carry(carried)
        self.resume_state = None
        self.optimizer, self.optimizer_mirror = optimizer, optimizer_mirror
        return optimizer

    def follow_optimizer_state(self) -> None:
        """What the script did to the attached optimizer's state (a reset) reaches the cloud's copy,
        or is refused, before the cloud's is read or checkpointed."""
        if self.optimizer_mirror is not None:
            self.optimizer_mirror.follow_state()

    def edge_optimizer_state(self) -> dict | None:
        """The attached optimizer's ``state_dict()`` without the cloud parameters' entries (the
        cloud checkpoints its own; the edge's are placeholders), for an edge checkpoint."""
        if self.optimizer is None or self.optimizer_mirror is None:
            return None
        with self.optimizer_mirror.edge_only():
            return self.optimizer.state_dict()

    def module_state(self, flipped: list[str], flags: dict[str, dict[str, Any]] | None = None) -> None:
        """Tell the cloud what the script changed on its modules by name, when that changed: the
        parameters it froze (``requires_grad_(False)``), the modules in the other mode than the
        split model's (``flipped``, by name) and the flags their code reads (``flags``:
        those changed, see :class:`~splitft.config_reads.ModuleFlags`)."""
        if flags:
            self.outbox.queue(SetFlags(flags=flags))
        self.frozen_state()
        if flipped != self._flipped_sent:
            self.outbox.queue(SetModes(names=flipped))
            self._flipped_sent = flipped

    def frozen_state(self) -> None:
        """Tell the cloud which of its parameters the script froze, when that changed: with each
        forward, and before each backward (unsplit, a parameter frozen since its forward gets no
        gradient in the backward: torch asks at the backward). The flags are read again only after
        a script flipped one (every flip of a placeholder's is counted)."""
        changes = requires_grad_changes()
        if changes == self._flags_read_at:
            return
        self._flags_read_at = changes
        params = self.cloud_half.params
        with torch._C.DisableTorchFunctionSubclass():  # a flag read on each placeholder, not a dispatch each
            frozen = frozenset(name for name, param in params.items() if not param.requires_grad)
        if frozen != self._frozen_sent:
            self.outbox.queue(SetFrozen(names=sorted(frozen)))
            self._frozen_sent = frozen
            self.trainable = frozenset(params) - frozen

    def loss(self, criterion: nn.Module) -> str:
        """Plain split: the cloud computes ``criterion``; returns its reduction (how the losses of
        micro-batches add up)."""
        settings = loss_settings(criterion)  # a torch.nn loss, or refused
        refuse_hooked(criterion)
        self.outbox.queue(SetLoss(name=type(criterion).__name__, settings=settings))
        self._criterion, self._criterion_sent = criterion, loss_fingerprint(criterion)
        return str(settings.get("reduction", "mean"))

    def loss_for_call(self, criterion: nn.Module) -> str | None:
        """Before a call of the remote loss of ``criterion``: sent again when it is not the one the
        cloud computes (a script with two remote losses, called in turn) or changed since it was
        sent (a curriculum's ``label_smoothing``, class weights set anew or changed in place), so
        the cloud's loss follows; returns the reduction then (None: nothing to send)."""
        refuse_hooked(criterion)
        if criterion is self._criterion and loss_fingerprint(criterion) == self._criterion_sent:
            return None
        return self.loss(criterion)


F = nn.functional
#: torch.nn.functional's losses of ``(input, target)``, each as the torch.nn loss whose forward
#: calls it with the same defaults: ``model.remote_loss(F.cross_entropy)`` computes what
#: ``F.cross_entropy(out, y)`` does.
_FUNCTIONAL_LOSSES: dict[Callable[..., Any], type[nn.Module]] = {
    F.cross_entropy: nn.CrossEntropyLoss, F.nll_loss: nn.NLLLoss, F.mse_loss: nn.MSELoss, F.l1_loss: nn.L1Loss,
    F.smooth_l1_loss: nn.SmoothL1Loss, F.huber_loss: nn.HuberLoss, F.binary_cross_entropy: nn.BCELoss,
    F.binary_cross_entropy_with_logits: nn.BCEWithLogitsLoss, F.kl_div: nn.KLDivLoss,
    F.poisson_nll_loss: nn.PoissonNLLLoss, F.soft_margin_loss: nn.SoftMarginLoss,
    F.multilabel_soft_margin_loss: nn.MultiLabelSoftMarginLoss, F.multi_margin_loss: nn.MultiMarginLoss,
    F.multilabel_margin_loss: nn.MultiLabelMarginLoss, F.hinge_embedding_loss: nn.HingeEmbeddingLoss,
}


def loss_module(criterion: Any) -> nn.Module:
    """``criterion`` as a torch.nn loss: itself, or the one a torch.nn.functional loss stands for."""
    module = next((loss for function, loss in _FUNCTIONAL_LOSSES.items() if function is criterion), None)
    return module() if module is not None else criterion


def loss_settings(criterion: nn.Module) -> dict[str, Any]:
    """What the cloud needs to build the same torch.nn loss; refuses what it cannot rebuild by name."""
    cls = type(criterion)
    if getattr(nn, cls.__name__, None) is not cls or not issubclass(cls, nn.modules.loss._Loss):
        raise ConfigError(f"the cloud computes torch.nn losses by name (and torch.nn.functional's of (input, target)); "
                          f"{getattr(criterion, '__name__', cls.__qualname__)} is not one. For a loss of "
                          "your own (a distillation loss, a function), compute it on the edge from out = "
                          "model.predict(x) (the cloud half's output comes back, and your loss's gradient goes to the "
                          "cloud at out's backward), or cut a U-shape (split(..., rejoin=...)) so the head runs on the "
                          "edge too")
    settings: dict[str, Any] = {}
    for name in _setting_names(cls):
        value = getattr(criterion, name, None)
        if isinstance(value, torch.Tensor):  # a class weight, BCEWithLogitsLoss's pos_weight
            settings[name] = loss_tensor(cls, name, value)
        elif plain_setting(value) is not NOT_PLAIN and value is not None:
            settings[name] = value
    return settings


#: Where a module keeps the hooks its call runs.
_CALL_HOOKS = tuple(dict.fromkeys(HOOK_TABLES.values()))


def refuse_hooked(criterion: nn.Module) -> None:
    """Refuse a criterion whose call would do more than torch's loss: a hook on it, or its
    ``forward`` replaced (on it, or on its class). The cloud computes torch's own loss by name,
    so what was added would never run, and the loss would silently differ."""
    hooked = next((table for table in _CALL_HOOKS if getattr(criterion, table, None)), None)
    replaced = "forward" in vars(criterion) or type(criterion).forward.__module__ != "torch.nn.modules.loss"
    if hooked or replaced:
        what = f"a hook ({hooked.strip('_')})" if hooked else "its forward replaced"
        raise ConfigError(f"the criterion of model.remote_loss ({type(criterion).__name__}) has {what}: the cloud "
                          "computes torch's own loss by its class and settings, so that would never run. Work on the "
                          "loss the remote loss returns (it is the loss itself), or cut a U-shape (split(..., "
                          "rejoin=...)) so your criterion runs on the edge as it is")


_SETTING_NAMES: dict[type, tuple[str, ...]] = {}


def _setting_names(cls: type) -> tuple[str, ...]:
    """A loss class's constructor arguments (its settings), looked up once per class."""
    names = _SETTING_NAMES.get(cls)
    if names is None:
        names = _SETTING_NAMES[cls] = tuple(inspect.signature(cls).parameters)
    return names


def loss_fingerprint(criterion: nn.Module) -> tuple:
    """What changes when a criterion's settings change: each setting, a tensor by identity and
    version (an in-place change bumps it), cheaply enough to look before every call."""
    return tuple(_fingerprint(getattr(criterion, name, None)) for name in _setting_names(type(criterion)))


_ATOMS = (type(None), bool, int, float, str)


def _fingerprint(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return id(value), value._version
    return value if type(value) in _ATOMS else repr(value)  # a container changed in place reads otherwise


def loss_tensor(cls: type, name: str, value: torch.Tensor) -> dict[str, Any]:
    """A loss's tensor setting as numbers the cloud rebuilds exactly (each float is a double on the wire)."""
    if not value.is_floating_point() or isinstance(value, RemoteTensor):
        raise ConfigError(f"{cls.__name__}({name}=...) must be a floating tensor of the edge's to be mirrored")
    flat = value.detach().to("cpu").reshape(-1)
    return {"tensor": flat.tolist(), "dtype": str(value.dtype).removeprefix("torch."), "shape": list(value.shape)}


__all__ = ["Link", "ModelMirror", "OptimizerMirror", "Queue", "Steps", "loss_module", "loss_settings",
           "optimizer_settings"]
