"""Optimizers over a split model's parameters: mirrored to the cloud half, whoever built them.

A split model's ``parameters()`` include the cloud half's placeholders (:mod:`.placeholders`), and
the objects a script held before :func:`splitft.split` *are* those placeholders now, so any
optimizer that holds one is over the cloud half: built after the cut, before it, by
``transformers.Trainer`` or by Accelerate. The first time such an optimizer steps it is attached
to its split model (``model.attach(opt)`` does the same, earlier; so does reading the state of one
over a model resumed from a checkpoint, whose state loads at attachment), through a global optimizer
step hook; from then on each step is forwarded to the cloud, and while it runs the cloud's
gradients are hidden from it, so the edge's step leaves the cloud's parameters to the cloud's.
The hiding and the forwarding are step hooks of the optimizer's own, kept last among its
pre-hooks and first among its post-hooks, so a script's hooks see the gradients as unsplit.
One that only holds edge parameters is local, as it would be on the unsplit model.

Optimizer state. ``opt.state_dict()`` of a mirrored optimizer holds both halves' entries (the
cloud's fetched), and ``opt.load_state_dict`` loads the edge half's here and sends the cloud
half's to the cloud's copy (settings are mirrored at the next step); see
:class:`~splitft.edge.optimizer_mirror.OptimizerMirror`.

``opt.step(closure)``: the hook runs the closure (its forward and backward) before the cloud's
gradients are hidden, and the step gets the loss it returned, as an optimizer that calls its closure
once would. LBFGS, which calls it many times within one step, is refused when it is attached.

Clearing, clipping and unscaling gradients need no hook: ``p.grad`` of a placeholder routes
torch's own functions to the cloud (see :mod:`.placeholders`).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch

from ..errors import ConfigError
from ..optimizer_layout import STEP_GUARD
from .optimizer_settings import plain_setting
from .placeholders import remote_of


class Attaches(Protocol):
    """Who mirrors an optimizer over a cloud half (:class:`~splitft.edge.mirror.ModelMirror`)."""

    def attach(self, optimizer: torch.optim.Optimizer) -> Any: ...

    def resuming(self) -> bool: ...


_INSTALLED = False
#: Held while the hooks are installed: edges split in several threads of one process at once.
_INSTALLING = threading.Lock()
#: Optimizers mirrored to a cloud half, with their mirror (see splitft.edge.optimizer_mirror.OptimizerMirror),
#: held weakly: the mirror holds its optimizer, and a value holding its key would keep the entry, and
#: so the split model, alive after the script dropped both. The split model keeps its mirror.
_MIRRORS: weakref.WeakKeyDictionary[torch.optim.Optimizer, weakref.ref[Any]] = weakref.WeakKeyDictionary()
#: Optimizers found to hold no cloud placeholder, with how many parameters they had then and how many
#: cloud halves had been made (a split() turns parameters an optimizer holds into placeholders in place).
_LOCAL: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()
_HALVES = 0  # cloud halves registered in this process so far
#: Each mirrored optimizer's own step hooks (their handle ids): the pre-hook that hides the cloud's
#: gradients and sends the step's settings, the post-hook that sends the step.
_STEP_HOOKS: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]] = weakref.WeakKeyDictionary()
#: Each cloud half's handle (splitft.edge.cloud_half.CloudHalf), with who attaches optimizers over it.
_OWNERS: weakref.WeakKeyDictionary[Any, weakref.ref[Attaches]] = weakref.WeakKeyDictionary()
#: Each optimizer's param group settings as its constructor left them, built after :func:`install`.
_BUILT: weakref.WeakKeyDictionary[torch.optim.Optimizer, list[dict[str, Any]]] = weakref.WeakKeyDictionary()


def register(remote: Any, owner: Attaches) -> None:
    """An optimizer that holds ``remote``'s placeholders is attached by ``owner`` (kept weakly)."""
    global _HALVES
    _OWNERS[remote] = weakref.ref(owner)
    _HALVES += 1  # an optimizer found local before may hold this half's placeholders now


def mirrored(optimizer: torch.optim.Optimizer, mirror: Any) -> None:
    """``optimizer`` is now mirrored by ``mirror``: its steps reach the cloud."""
    _MIRRORS[optimizer] = weakref.ref(mirror)
    _LOCAL.pop(optimizer, None)


def forget(optimizer: torch.optim.Optimizer) -> None:
    """``optimizer`` is mirrored no more (its model is whole again): its steps are local."""
    _MIRRORS.pop(optimizer, None)


def _mirror(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer``'s mirror, or None."""
    ref = _MIRRORS.get(optimizer)
    return ref() if ref is not None else None


def cloud_owner(optimizer: torch.optim.Optimizer) -> Attaches | None:
    """Who attaches ``optimizer`` (the split model whose cloud placeholders it holds), or None."""
    owners: dict[int, Attaches] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            remote = remote_of(p)
            ref = _OWNERS.get(remote) if remote is not None else None
            owner = ref() if ref is not None else None
            if owner is not None:
                owners[id(owner)] = owner
    if len(owners) > 1:
        raise ConfigError(f"{type(optimizer).__name__} holds the parameters of {len(owners)} split models; the "
                          "cloud halves step with one optimizer each: give each split model its own")
    return next(iter(owners.values()), None)


def _mirror_of(optimizer: torch.optim.Optimizer) -> Any:
    """``optimizer``'s mirror, attaching it to its split model the first time it is seen holding
    cloud placeholders; None for an optimizer that holds none."""
    mirror = _mirror(optimizer)
    if mirror is not None:
        return mirror
    seen = sum(len(group["params"]) for group in optimizer.param_groups), _HALVES
    if _LOCAL.get(optimizer) == seen:
        return None  # checked already: one look per optimizer and split, not one per step
    owner = cloud_owner(optimizer)
    if owner is None or _wraps_another(optimizer):
        _LOCAL[optimizer] = seen
        return None
    owner.attach(optimizer)
    return _mirror(optimizer)


def _wraps_another(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` wraps another that it holds and whose parameter groups it shares (SAM
    over its base optimizer, a Lookahead over its inner one): the inner one's steps are those the
    cloud mirrors, and what the wrapper does to the weights itself reaches the cloud as it does."""
    return any(isinstance(value, torch.optim.Optimizer) and value is not optimizer
               and value.param_groups is optimizer.param_groups for value in vars(optimizer).values())


def _attach_if_resuming(optimizer: torch.optim.Optimizer) -> None:
    """Attach ``optimizer`` now when it is over a model split with ``resume_from=`` whose
    checkpoint's optimizer state has not loaded yet: what reads that state before the first step
    (``opt.state_dict()``, a scheduler resuming from ``last_epoch=``) reads the checkpoint's, as
    after the ``opt.load_state_dict`` the unsplit script made first."""
    if not _HALVES or optimizer in _MIRRORS:
        return
    owner = cloud_owner(optimizer)
    if owner is not None and owner.resuming():
        owner.attach(optimizer)


def _state_dict_resumed(original: Callable[..., dict]) -> Callable[..., dict]:
    @functools.wraps(original)
    def state_dict(self: torch.optim.Optimizer) -> dict:
        _attach_if_resuming(self)
        return original(self)

    state_dict.__splitft_original__ = original  # type: ignore[attr-defined]
    return state_dict


def _scheduler_resumed(init: Callable[..., None]) -> Callable[..., None]:
    """``LRScheduler.__init__``: one that resumes (``last_epoch`` not -1) reads the
    ``initial_lr`` a loaded optimizer state holds."""
    @functools.wraps(init)
    def __init__(self: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        last_epoch = kwargs.get("last_epoch", args[0] if args else -1)
        if last_epoch != -1 and isinstance(optimizer, torch.optim.Optimizer):
            _attach_if_resuming(optimizer)
        init(self, optimizer, *args, **kwargs)

    __init__.__splitft_original__ = init  # type: ignore[attr-defined]
    return __init__


def _before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Torch's global pre-hook: attaches an optimizer the first time it steps holding cloud
    placeholders, then puts the optimizer's own hooks that mirror the step in place around the
    script's. Torch runs global pre-hooks before an optimizer's own and global post-hooks after
    them, so a script's ``opt.register_step_pre_hook`` (scaling gradients, setting a learning
    rate) would run after the cloud's gradients were hidden and its settings read, and change
    nothing in the cloud; ours run last before the step and first after it."""
    if _mirror_of(optimizer) is None:
        return
    pre, post = _STEP_HOOKS.get(optimizer) or _add_step_hooks(optimizer)
    before, after = optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks
    if next(reversed(before)) != pre:
        before[pre] = before.pop(pre)
    if next(iter(after)) != post:  # in place: the handles of the script's hooks hold this dict
        others = [(key, hook) for key, hook in after.items() if key != post]
        ours = after[post]
        after.clear()
        after.update([(post, ours), *others])


def _add_step_hooks(optimizer: torch.optim.Optimizer) -> tuple[int, int]:
    ids = (optimizer.register_step_pre_hook(_prepare_step).id, optimizer.register_step_post_hook(_after_step).id)
    _STEP_HOOKS[optimizer] = ids
    return ids


def _prepare_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> tuple[tuple, dict] | None:
    mirror = _mirror(optimizer)
    if mirror is None:
        return None
    if getattr(optimizer, "grad_scale", None) is not None or getattr(optimizer, "found_inf", None) is not None:
        raise ConfigError(f"GradScaler stepping a {type(optimizer).__name__}(fused=True) over the cloud half: a fused "
                          "step takes the scale and the overflow flag from the scaler, which the cloud's copy of the "
                          "optimizer would not see (it would step on scaled gradients, and through an overflow). Use "
                          "the optimizer without fused=True, which GradScaler unscales for, or fused without GradScaler")
    closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
    if closure is None:
        mirror.before_step()
        return None
    # opt.step(closure): its forward and backward run now, as the step would run them first, but
    # before the step hides the cloud half's gradients; the step gets the loss it computed.
    with torch.enable_grad():
        loss = closure()
    mirror.before_step()
    return (args[0],), {"closure": lambda: loss}


def _after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    mirror = _mirror(optimizer)
    if mirror is not None:
        mirror.after_step()


def _load_mirrored(original: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(original)
    def load_state_dict(self: torch.optim.Optimizer, state_dict: dict) -> None:
        mirror = _mirror_of(self)  # attached now, if it holds a cloud half's placeholders
        if mirror is None:
            original(self, state_dict)
        else:
            mirror.load_state(state_dict, original)

    load_state_dict.__splitft_original__ = original  # type: ignore[attr-defined]
    return load_state_dict


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """Load ``state`` into ``optimizer`` past the refusal above (an edge checkpoint's own state)."""
    load = type(optimizer).load_state_dict
    getattr(load, "__splitft_original__", load)(optimizer, state)


def _group_settings(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each param group's settings as plain values (a tuple as the list a checkpoint holds)."""
    return [{key: plain_setting(value) for key, value in group.items() if key != "params"}
            for group in optimizer.param_groups]


def _recorded(init: Callable[..., None]) -> Callable[..., None]:
    """``Optimizer.__init__``, remembering the settings it left (see :func:`set_since_built`)."""
    @functools.wraps(init)
    def __init__(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        _BUILT[self] = _group_settings(self)

    __init__.__splitft_original__ = init  # type: ignore[attr-defined]
    return __init__


def set_since_built(optimizer: torch.optim.Optimizer) -> list[tuple[int, str, Any]] | None:
    """The param group settings the script changed after building ``optimizer``, as (group, key,
    value) with the value as :func:`~splitft.edge.optimizer_settings.plain_setting` gives it; None
    where that cannot be told apart from a scheduler's work: one built over it adds its keys
    (``initial_lr``) and sets the learning rate, and it is not known what it was built with."""
    built = _BUILT.get(optimizer)
    if built is None:
        return None
    now = _group_settings(optimizer)
    if any(set(group) - set(before) for group, before in zip(now, built)):
        return None
    missing = object()
    return [(i, key, value) for i, group in enumerate(now) for key, value in group.items()
            if value != (built[i].get(key, missing) if i < len(built) else missing)]


def _guarded(step: Callable[..., Any]) -> Callable[..., Any]:
    """``step``, and when it raises (out of memory, an assertion of torch's on its settings) the
    cloud's gradients shown again: hidden for the step only, they would stay hidden from the
    script's ``zero_grad`` after a step it caught, and the next backward would add to them."""
    @functools.wraps(step)
    def step_guarded(self: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        try:
            return step(self, *args, **kwargs)
        except BaseException:
            mirror = _mirror(self)
            if mirror is not None:
                mirror.step_failed()
            raise

    setattr(step_guarded, STEP_GUARD, True)
    return step_guarded


def _guard_steps() -> None:
    """Guard the step of every torch.optim optimizer class (the ones a split model mirrors)."""
    for cls in vars(torch.optim).values():
        if isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer) and "step" in vars(cls):
            if not getattr(cls.step, STEP_GUARD, False):
                cls.step = _guarded(cls.step)  # type: ignore[method-assign]


def install() -> None:
    """Put the optimizer hooks in place, once per process."""
    global _INSTALLED
    with _INSTALLING:
        if _INSTALLED:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        register_optimizer_step_pre_hook(_before_step)
        optimizer = torch.optim.Optimizer
        optimizer.load_state_dict = _load_mirrored(optimizer.load_state_dict)  # type: ignore[method-assign]
        optimizer.__init__ = _recorded(optimizer.__init__)  # type: ignore[method-assign]
        optimizer.state_dict = _state_dict_resumed(optimizer.state_dict)  # type: ignore[method-assign]
        scheduler = torch.optim.lr_scheduler.LRScheduler
        scheduler.__init__ = _scheduler_resumed(scheduler.__init__)  # type: ignore[method-assign]
        _guard_steps()
        _INSTALLED = True


__all__ = ["Attaches", "cloud_owner", "forget", "install", "load_optimizer_state", "mirrored", "register",
           "set_since_built"]
