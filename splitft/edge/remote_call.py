"""A call of the cloud half from the user's forward, and the cut as an autograd function.

What the model passes to the cloud half is flattened into tensors and a skeleton (a key/value
cache the cloud keeps stands in as its number), handed to the schedule inside a
``torch.autograd.Function`` (:class:`_RemoteCall`), and rebuilt from what comes back. Its forward
returns what the cloud sent; its backward hands over the incoming gradient and returns the
gradient at the cut. A delayed-gradient step also keeps here the edge weights its forward ran with.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from ..devices import autocast_dtype
from ..errors import ConfigError
from ..kv_caches import crop_held
from ..wire import tree as trees
from ..wire.coding import CacheRef, distinct, flatten, is_cache, sample_ids_array, unflatten
from ..wire.operations import ChangeCache, FreeCache, Operation
from . import cloud_kv
from .cloud_half import CloudHalf
from .schedule import Call, Scheduler
from .streaming import stash_weights


_TRANSFORMS = (
    "a torch.func transform (vmap, grad, jacrev, jvp, functional_call under them), a batched backward "
    "(autograd.grad(is_grads_batched=True), jacobian(vectorize=True)) or forward-mode AD "
    "(torch.autograd.forward_ad) through a split model: the cloud half computes on plain tensors, so the batched "
    "or dual tensors these make cannot cross the cut. Apply them to edge modules alone, or to the whole model "
    "after model.unsplit()")


def refuse_transforms(tensors: tuple[torch.Tensor | None, ...] = ()) -> None:
    """Refuse a torch.func transform (or a batched backward, whose gradients come batched) around
    a call of the cloud half: what it would hand over are batched or dual tensors, which cannot cross."""
    if torch._C._functorch.peek_interpreter_stack() is not None or any(
            t is not None and (torch._C._functorch.is_batchedtensor(t) or torch._C._functorch.is_legacy_batchedtensor(t))
            for t in tensors):
        raise ConfigError(_TRANSFORMS)


#: torch.jit.trace / torch.jit.script of a split model.
COMPILED_TO_TORCHSCRIPT = (
    "torch.jit.trace / torch.jit.script of a split model: TorchScript would record the edge's half and a call of the "
    "cloud it cannot run. To export the trained model, take it whole with model.unsplit() (which ends the "
    "session) and trace or script that; edge modules alone may be scripted as they are")


def refuse_foreign_contexts() -> None:
    """Refuse what the split model's forward or loss runs under that the cloud half would not: a
    TorchScript trace, a ``TorchDispatchMode`` (unsplit, the whole model computed under it: a
    numerics emulation rounding matmuls, an operation counter)."""
    if torch._C._get_tracing_state() is not None:
        raise ConfigError(COMPILED_TO_TORCHSCRIPT)
    if torch._C._len_torch_dispatch_stack() > 0:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

        counting = any("FlopCounter" in type(mode).__name__ for mode in _get_current_dispatch_mode_stack())
        raise ConfigError("a TorchDispatchMode is active around the split model (a numerics emulation, an operation "
                          "counter): unsplit the whole model computed under it; the cloud half computes outside it, "
                          "so its results (or counts) would silently differ. Use it on edge modules alone, or on the "
                          "model model.unsplit() gives"
                          + ("; this one is torch's FlopCounterMode, which Lightning's model summary runs when a "
                             "LightningModule sets example_input_array: Trainer(enable_model_summary=False) skips it"
                             if counting else ""))


class _RemoteCall(torch.autograd.Function):
    """The cut. Inputs: the call's tensors (and an anchor that keeps the cloud part trainable)."""

    @staticmethod
    def forward(ctx: Any, scheduler: Scheduler, call: Call, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(inputs[: call.n_leaves])
        outputs = scheduler.forward(call, leaves, list(ctx.needs_input_grad[2: 2 + call.n_leaves]))
        ctx.scheduler, ctx.call = scheduler, call
        ctx.set_materialize_grads(False)  # an output the loss leaves out gets None: the cloud backpropagates the rest
        ctx.mark_non_differentiable(*[t for t, g in zip(outputs, call.parts[0].out_grad) if not g])
        return tuple(outputs)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        raise ConfigError(_TRANSFORMS)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        refuse_transforms(grads)  # autograd.grad(is_grads_batched=True) hands batched gradients
        if torch.is_grad_enabled():  # create_graph=True: the cloud's part of the gradient would carry no graph
            raise ConfigError("backward(create_graph=True) / autograd.grad(create_graph=True) through a split model: "
                              "the gradient that comes back from the cloud is a number, not a graph, so a gradient "
                              "of it (a gradient penalty, second-order methods) would silently leave the cloud half "
                              "out. A penalty whose gradient does not pass through the cut is computed as unsplit "
                              "(the gradient of an edge layer's own output; in a U-shape, of the loss with respect "
                              "to the head's parameters or the logits); one through the cloud half needs this model "
                              "trained unsplit")
        call: Call = ctx.call
        # Whether the engine accumulates into the anchor, the cloud half's stand-in: not under
        # backward(inputs=...) naming edge tensors only, nor autograd.grad, and then, as unsplit,
        # the cloud half's parameters get nothing.
        params = torch._C._will_engine_execute_node(ctx.next_functions[-1][0])
        if not params and (call.streamed or call.stash is not None):
            raise ConfigError("backward(inputs=...) naming no cloud parameter, or autograd.grad, through a split "
                              "model with steps in flight or delayed gradients (Schedule(window>1)): the cloud has "
                              "backpropagated into its parameters already; call loss.backward()")
        try:
            input_grads = ctx.scheduler.backward(call, grads, params=params)
        except BaseException:  # Ctrl-C while the cloud backpropagates: its parameters may hold gradients
            if params and call.backpropagated:  # which opt.zero_grad() must clear, as unsplit
                call.cloud_half.backward_reached(call.trainable, None)
            raise
        if params:
            call.cloud_half.backward_reached(call.trainable, call.unreached)
        extra = len(ctx.needs_input_grad) - 2 - call.n_leaves
        return (None, None, *input_grads, *([None] * extra))


class CacheRefs:
    """Key/value caches of a generation as the cloud knows them: by number, each freed in the
    cloud when the edge's cache object goes.

    Args:
        queue: puts an operation on the next message (:meth:`.outbox.Outbox.queue`).
        closed: whether the session is closed (then nothing is left to free).
    """

    def __init__(self, queue: Callable[[Operation], None], closed: Callable[[], bool]) -> None:
        self.queue, self.closed = queue, closed
        #: The cache indices of the cloud's decoder layers, whose entries here hold their shapes (:mod:`.cloud_kv`).
        self.layers: list[int] = []
        self._numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next = 0

    def ref(self, cache: Any, path: Any, new_tokens: int | None = None) -> CacheRef:
        """The number of a key/value cache the cloud keeps for it; freed there when ``cache`` goes,
        and changed there as the generation changes it (see :func:`_mirror_changes`). A cache the
        cloud has not seen must hold no more than the ``new_tokens`` this call's edge layers wrote."""
        number = self._numbers.get(cache)
        if number is None:
            _refuse_other_kinds(cache)
            _refuse_unseen_tokens(cache, new_tokens)
            number = self._follow(cache)
        else:
            cloud_kv.refuse_edits(cache)
        return CacheRef(number)

    def _follow(self, cache: Any, made: bool = True) -> int:
        self._next += 1
        number = self._numbers[cache] = self._next
        weakref.finalize(cache, _free, weakref.ref(self), number)
        _mirror_changes(cache, number, self)
        if made and getattr(cache, "layer_class_to_replicate", None) is not None:
            # built without a model config (DynamicCache()): every layer keeps all its tokens, no
            # sliding window, and the cloud's part must too (its caches are built with the config)
            self.queue(ChangeCache(id=number, kind="whole"))
        return number

    def copied(self, copy: Any, source: int) -> None:
        """``copy`` is ``copy.deepcopy`` of cache ``source`` (a prompt's cache reused for several
        continuations): the cloud copies its part of it too, as it is now."""
        number = self._follow(copy, made=False)
        self.queue(ChangeCache(id=number, kind="copy", source=source))
        cloud_kv.mark(copy, self.layers)

    def free(self, number: int) -> None:
        """Cache ``number`` is gone on the edge: free the cloud's."""
        if not self.closed():
            self.queue(FreeCache(id=number))


#: transformers' cache methods that change a cache in place, and the change each is sent as.
_CHANGES = {"reorder_cache": "reorder", "batch_select_indices": "select", "batch_repeat_interleave": "repeat",
            "crop": "crop", "reset": "reset"}
#: Each cache the cloud keeps a part of: its number there, and who sends its changes.
_SENDERS: weakref.WeakKeyDictionary[Any, tuple[int, CacheRefs]] = weakref.WeakKeyDictionary()


def _refuse_unseen_tokens(cache: Any, new_tokens: int | None) -> None:
    """A cache new to the cloud that holds keys and values the edge's layers did not just write (a
    cache filled elsewhere: by peft's prefix tuning, built from tensors, copied other than by
    ``copy.deepcopy``): the cloud's layers would start from nothing where unsplit they read them."""
    held = [layer.keys.shape[-2] for layer in getattr(cache, "layers", [])
            if isinstance(getattr(layer, "keys", None), torch.Tensor) and layer.keys.dim() > 1]
    if held and (new_tokens is None or max(held) > new_tokens):
        raise ConfigError(f"a key/value cache that already holds {max(held)} tokens reached the cloud half, which "
                          "never saw them (a cache filled before this call: prefix tuning's virtual tokens, one "
                          "built from tensors or copied other than by copy.deepcopy); its layers' part of the cache "
                          "would start empty. Start generations from an empty cache (or a copy.deepcopy of one the "
                          "split model filled), or use the unsplit model (model.unsplit())")


def _mirror_changes(cache: Any, number: int, refs: CacheRefs) -> None:
    """Beam search reorders the cache at every token (``reorder_cache``), and other generation
    modes select, repeat or crop it: the cloud layers' part of it is in the cloud, so each change
    made here is also sent (with the next message, before the next forward reads the cache). The
    cache becomes an instance of a subclass of its class that does so; ``copy.deepcopy`` of it is
    followed as a cache of its own, which the cloud copies from this one."""
    _refuse_other_kinds(cache)
    _SENDERS[cache] = (number, refs)
    cls = type(cache)
    if getattr(cls, "__splitft_sends_changes__", False) or not any(hasattr(cls, m) for m in _CHANGES):
        return
    try:
        cache.__class__ = _sending_changes(cls)
    except TypeError:
        raise ConfigError(f"a {cls.__name__} key/value cache cannot be followed by the cloud when the generation "
                          "reorders it; use transformers' DynamicCache") from None


def _refuse_other_kinds(cache: Any) -> None:
    """The cloud keeps its layers' keys and values in a ``DynamicCache``; a cache of another kind
    (a ``StaticCache``, ``cache_implementation="static"``) sizes its masks for what it keeps, which
    the cloud's would not match."""
    try:
        from transformers import DynamicCache
    except ImportError:  # a cache of the script's own: the cloud refuses what it cannot hold
        return
    if type(cache).__name__ == "EncoderDecoderCache":
        raise ConfigError("an EncoderDecoderCache reaches the cloud layers (the decoder of T5, BART or Whisper makes "
                          "one whenever use_cache is on, in training too): the cloud keeps its layers' keys and values "
                          "in a DynamicCache of self-attention only. Cut inside the encoder, or pass use_cache=False "
                          "(model.config.use_cache = False; generate with the unsplit model, model.unsplit()): a "
                          "decoder cut hands the cloud the encoder's output, whose gradient comes back summed, a few "
                          "bits from the unsplit one (docs/wrapping.md)")
    if not isinstance(cache, DynamicCache):
        raise ConfigError(f"generation through the split keeps the cloud layers' keys and values in a DynamicCache, "
                          f"not a {type(cache).__name__}; generate with the default cache (no cache_implementation) "
                          "or with the unsplit model (model.unsplit())")


def _sending_changes(cls: type) -> type:
    """``cls`` whose in-place changes are also queued for the cloud (same name: a repr reads as before)."""
    made = _SENDING_CLASSES.get(cls)
    if made is None:
        methods = {method: _sending(getattr(cls, method), method, kind) for method, kind in _CHANGES.items()
                   if callable(getattr(cls, method, None))}
        made = _SENDING_CLASSES[cls] = type(cls.__name__, (cls,), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__, "__splitft_sends_changes__": True,
            "__deepcopy__": _deepcopy, "__copy__": _refused_copy, "__reduce_ex__": _refused_save, **methods})
    return made


def _deepcopy(self: Any, memo: dict) -> Any:
    """``copy.deepcopy`` of a followed cache: its values copied as deepcopy copies them, and the
    cloud's part copied from the original's, as it is now."""
    copied = object.__new__(type(self))
    memo[id(self)] = copied
    copied.__dict__.update(copy.deepcopy(self.__dict__, memo))
    sender = _SENDERS.get(self)
    if sender is not None:
        sender[1].copied(copied, sender[0])
    return copied


def _refused_save(self: Any, protocol: Any) -> Any:
    raise ConfigError("saving (pickling) a key/value cache the cloud keeps part of: its cloud layers' keys and values "
                      "stay in the cloud; save the prompt and compute its cache again, or use the unsplit model")


def _refused_copy(self: Any) -> Any:
    raise ConfigError("copy.copy of a key/value cache the cloud keeps part of: the copy would share the edge "
                      "layers' entries with the original, and the cloud's part would not follow; copy it with "
                      "copy.deepcopy")


_SENDING_CLASSES: dict[type, type] = {}


def _sending(original: Callable[..., Any], method: str, kind: str) -> Callable[..., None]:
    def change(self: Any, *args: Any) -> None:
        if kind == "crop":
            crop_held(self, args[0], original)
        else:
            original(self, *args)
        sender = _SENDERS.get(self)
        if sender is None:
            return
        number, queue = sender[0], sender[1].queue
        cloud_kv.mark(self, sender[1].layers)
        if kind == "reset":
            queue(ChangeCache(id=number, kind=kind))
            return
        arg = args[0]
        if kind in ("reorder", "select"):
            indices = torch.as_tensor(arg)
            if indices.dtype == torch.bool:
                indices = indices.nonzero()
            queue(ChangeCache(id=number, kind=kind, indices=[int(i) for i in indices.reshape(-1).tolist()]))
        else:
            queue(ChangeCache(id=number, kind=kind, count=int(arg)))

    change.__name__ = change.__qualname__ = method
    return change


def _free(refs: weakref.ref[CacheRefs], number: int) -> None:
    owner = refs()
    if owner is not None:
        owner.free(number)


class RemoteCaller:
    """Calls of the cloud half: the forward's sample ids and stashed weights until the call that
    uses them, then the call through the cut.

    Args:
        scheduler: runs each call's messages.
        cloud_half: told of each backward that reached the cut.
        caches: numbers the key/value caches a call passes.
        freeze_edge: no input of a call needs a gradient, so none crosses back.
    """

    def __init__(self, scheduler: Scheduler, cloud_half: CloudHalf, caches: CacheRefs, *,
                 freeze_edge: bool = False) -> None:
        self.scheduler, self.cloud_half, self.caches = scheduler, cloud_half, caches
        self.freeze_edge = bool(freeze_edge)
        self._anchor = torch.zeros((), requires_grad=True)
        self._sample_ids: np.ndarray | None = None
        self._stash: list | None = None  # delayed gradients: the weights this step's edge forward ran with

    def refuse_input_gradients(self, args: tuple, kwargs: dict) -> None:
        """With ``freeze_edge`` no gradient crosses back from the cloud: a model input that requires
        one (a saliency map, FGSM's ``x.grad``) would silently get none. Refused at the forward."""
        if self.freeze_edge and torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad for t in trees.leaves((args, kwargs))):
            raise ConfigError("an input of the model requires a gradient, and this split model sends none back from "
                              "the cloud (split(..., freeze_edge=True), or progressive freezing once every edge layer "
                              "froze), so its .grad would stay None where the unsplit model computes it. Split "
                              "without freeze_edge and freeze the edge's layers by hand (requires_grad_(False)): the "
                              "input's gradient then crosses back")

    def forward_with(self, sample_ids: Any) -> None:
        """The forward under way passes ``sample_ids`` (None when it ends, or passes none)."""
        self._sample_ids = sample_ids_array(sample_ids)

    def stash(self, model: torch.nn.Module, skip: Iterable[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Delayed gradients: copies of ``model``'s weights for this step's forward to run with,
        kept for its call (see :func:`~.streaming.stash_weights`)."""
        self._stash, copies = stash_weights(model, skip)
        return copies

    def __call__(self, args: tuple, kwargs: dict, target: Any = None, *, train: bool,
                 trainable: frozenset[str], modes: tuple[str, ...] = (), again: torch.Tensor | None = None,
                 drawn_since: torch.Tensor | None = None, generator_kept: torch.Tensor | None = None) -> Any:
        """The cloud half's output for ``args``/``kwargs`` (plain split: the loss, with ``target``)."""
        refuse_transforms()
        refuse_foreign_contexts()
        self.cloud_half.hidden = False  # an optimizer step that raised left them hidden
        caches: list = []
        first = args[0] if args else None
        new_tokens = first.shape[-2] if isinstance(first, torch.Tensor) and first.dim() > 2 else None
        if kwargs or not all(isinstance(a, torch.Tensor) for a in args):  # tensors alone hold no cache to name
            def named(cache: Any, path: Any) -> CacheRef:
                caches.append(cache)
                return self.caches.ref(cache, path, new_tokens)

            args, kwargs = trees.rebuild((args, kwargs), named, is_leaf=is_cache, other=lambda node, path: node)
        grad = torch.is_grad_enabled()
        leaves, skeleton = distinct(*flatten((list(args), kwargs, target)))
        if self.freeze_edge:  # no input needs a gradient, so none crosses back
            leaves = [t.detach() for t in leaves]
        stash, self._stash = self._stash, None
        attached = leaves
        if stash is not None and grad:  # the edge's graph stays apart; the scheduler backpropagates it
            leaves = [t.detach().requires_grad_() if t.requires_grad else t for t in leaves]
        call = Call(skeleton, len(leaves), train=train, grad=grad, sample_ids=self._sample_ids,
                    stash=stash if grad else None, leaves=attached if stash is not None else [],
                    autocast=autocast_dtype(next((t.device.type for t in leaves if t.is_floating_point()), "cpu")),
                    cloud_half=self.cloud_half, trainable=trainable, modes=modes, again=again,
                    drawn_since=drawn_since, generator_kept=generator_kept)
        inputs = [*leaves, self._anchor] if grad else leaves
        outputs = _RemoteCall.apply(self.scheduler, call, *inputs)
        if caches and new_tokens is not None and isinstance(first, torch.Tensor):
            for cache in caches:  # the cloud layers' entries hold the tokens they were given, in shape
                cloud_kv.grow(cache, self.caches.layers, first.shape[0], new_tokens, first.dtype, first.device)
        return unflatten(call.out_skeleton, list(outputs))


__all__ = ["CacheRefs", "RemoteCaller"]
