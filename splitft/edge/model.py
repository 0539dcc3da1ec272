"""The model the user trains: the original one with its cloud part cut out, and the cut as an autograd function.

The user's loop stays ordinary PyTorch. The cut's forward hands what crosses to the schedule and
returns what the cloud sent back; its backward hands over the incoming gradient and returns the
gradient at the cut. Optimizer steps and ``zero_grad`` calls are mirrored (:mod:`.mirror`).
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from ..wire import tree as trees
from ..wire.coding import CacheRef, flatten, is_cache, sample_ids_array, unflatten
from ..wire.operations import FreeCache, LoadWeights, SetFrozen, SetLoss, SetModes
from ..cut import Chain, CutSpec
from .ghosts import standin_name, uninstall
from .standins import CutReached
from ..devices import autocast_dtype
from ..errors import ConfigError, SplitFTError
from ..metrics import JsonlWriter, Metrics
from . import mirror, optimizers, resume
from .cloud_half import CloudHalf
from .placeholders import CloudTensor
from .requests import EdgeSession
from .remote_loss import CutActivation, RemoteLoss, call_parts
from .schedule import Call, Scheduler
from .streaming import stash_weights


class _RemoteCall(torch.autograd.Function):
    """The cut. Inputs: the call's tensors (and an anchor that keeps the cloud part trainable)."""

    @staticmethod
    def forward(ctx: Any, scheduler: Scheduler, call: Call, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        leaves = list(inputs[: call.n_leaves])
        outputs = scheduler.forward(call, leaves, list(ctx.needs_input_grad[2: 2 + call.n_leaves]))
        ctx.scheduler, ctx.call = scheduler, call
        ctx.mark_non_differentiable(*[t for t, g in zip(outputs, call.parts[0].out_grad) if not g])
        return tuple(outputs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        if torch.is_grad_enabled():  # create_graph=True: the cloud's part of the gradient would carry no graph
            raise ConfigError("backward(create_graph=True) / autograd.grad(create_graph=True) through a split model: "
                              "the gradient that comes back from the cloud is a number, not a graph, so a gradient "
                              "of it (a gradient penalty, second-order methods) would silently leave the cloud half "
                              "out. Compute the penalty on edge modules only, or train this model unsplit")
        call: Call = ctx.call
        input_grads = ctx.scheduler.backward(call, grads)
        call.cloud_half.backward_reached(call.trainable, call.unreached)
        extra = len(ctx.needs_input_grad) - 2 - call.n_leaves
        return (None, None, *input_grads, *([None] * extra))


class SplitModel(nn.Module):
    """The user's model with its cloud part cut out. Train it like the original.

    It holds the original model (``.model``), whose cloud modules are *ghosts*: the same
    classes, names and parameter shapes, with placeholder parameters on the ``meta`` device (the
    values live in the cloud). ``parameters()`` therefore lists every parameter of the unsplit
    model, and whatever a script does to them reaches the cloud or raises
    (:mod:`.placeholders`): optimizers (their groups by name, their steps), ``p.grad`` (cleared,
    clipped, unscaled by torch's own functions), ``requires_grad_``, new values.
    ``edge_parameters()`` and ``cloud_parameters()`` tell which is where. Attribute lookups the split model does not answer
    go to the wrapped model (``model.config``), and ``forward`` has the wrapped model's signature.
    Plain splits return the activation at the cut from ``forward``; the loss comes from
    :meth:`remote_loss` and predictions from :meth:`predict`.
    """

    def __init__(self, model: nn.Module, spec: CutSpec, session: EdgeSession, scheduler: Scheduler,
                 metrics_path: str | os.PathLike | None = None, freeze_edge: bool = False,
                 cloud_half: CloudHalf | None = None) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.session = session
        self.scheduler = scheduler
        self.cloud_half = cloud_half if cloud_half is not None else CloudHalf(session.outbox.queue, _no_norms, [])
        self.cloud_half.model = weakref.ref(self)
        self.freeze_edge = bool(freeze_edge)
        self.optimizer: torch.optim.Optimizer | None = None
        self._anchor = torch.zeros((), requires_grad=True)
        self._stash: list | None = None  # delayed gradients: the weights this step's edge forward ran with
        self._sample_ids: np.ndarray | None = None
        self._writer = JsonlWriter(metrics_path) if metrics_path else None
        self._last_record = time.perf_counter()
        self._resume_optimizer: dict | None = None  # optimizer state from an edge checkpoint
        self._cloud: dict[str, nn.Parameter] = {}  # name in the unsplit model -> placeholder
        self._cloud_ids: dict[int, str] = {}
        self._frozen_sent: frozenset[str] | None = None
        self._trainable: frozenset[str] = frozenset()
        self._flipped_sent: list[str] = []
        self._cache_numbers: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
        self._next_cache = 0

    def _bind(self, chain: Chain) -> None:
        """Find the placeholders of the cloud half's parameters the cut installed (named as in the unsplit model)."""
        for name in chain.names:
            for key, param in self.model.get_submodule(name).named_parameters():
                if id(param) not in self._cloud_ids:
                    self._cloud[f"{name}.{key}"] = param
                    self._cloud_ids[id(param)] = f"{name}.{key}"
        self.cloud_half.params = dict(self._cloud)
        self.cloud_half.before_fetch = self._mirror_module_state
        self.cloud_half.device = next((p.device for p in self.edge_parameters()), torch.device("cpu"))
        self.__dict__["_cloud_modules"] = chain  # not a submodule: the real modules, for unsplit()
        self.__dict__["_ghosts"] = [(self.model.get_submodule(parent) if parent else self.model, child,
                                     self.model.get_submodule(name))
                                    for name in chain.names for parent, _, child in [name.rpartition(".")]]
        self._cloud_batchnorms = [(f"{name}.{key}" if key else name, module) for name in chain.names
                                  for key, module in self.model.get_submodule(name).named_modules()
                                  if isinstance(module, nn.modules.batchnorm._BatchNorm)]
        optimizers.install()

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("_"):
                raise
            return getattr(model, name)  # config, main_input_name, num_parameters, ...

    # ------------------------------------------------------------ what cannot reach the cloud half

    def apply(self, fn: Any) -> SplitModel:
        """``fn`` on every module, as on the unsplit model, the cloud half's ghosts first: what it
        does to their tensors reaches the cloud, and what cannot raises before ``fn`` touched
        anything else."""
        ghosts = {id(ghost) for _, _, ghost in self.__dict__["_ghosts"]}
        for _, _, ghost in self.__dict__["_ghosts"]:
            ghost.apply(fn)

        def rest(module: nn.Module) -> None:
            for child in module.children():
                if id(child) not in ghosts:
                    rest(child)
            fn(module)

        rest(self)
        return self

    def _check_ghosts(self) -> None:
        """Refuse a forward after a script replaced a module that runs in the cloud (a module walk
        swapping layers): the cloud would still run the one it has."""
        for parent, child, ghost in self.__dict__["_ghosts"]:
            if parent._modules.get(child) is not ghost:
                raise ConfigError(f"{standin_name(ghost)!r} runs in the cloud, but the model's forward would call "
                                  f"another module there: it was replaced after split(). Replace layers before "
                                  "split(), in the cloud's factory too")

    def __deepcopy__(self, memo: dict) -> Any:
        raise ConfigError("a split model cannot be copied: its cloud half's values live in the cloud, and its session "
                          "is one connection. For an EMA of the weights (AveragedModel, deepcopy + update), keep it "
                          "on the unsplit model before split(), or average the weights you fetch with "
                          "model.state_dict()")

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ConfigError("a split model cannot be pickled (torch.save(model)): save model.state_dict(), which fetches "
                          "the cloud half, or use model.save_checkpoint(path)")

    def set_submodule(self, target: str, module: nn.Module, strict: bool = False) -> None:
        name = target.removeprefix("model.")
        for cloud in self.__dict__["_cloud_modules"].names:
            if name == cloud or name.startswith(cloud + ".") or cloud.startswith(name + "."):
                raise ConfigError(f"set_submodule({target!r}) would replace (part of) {cloud!r}, which runs in the "
                                  "cloud; change the model before split()")
        super().set_submodule(target, module, strict)

    def _apply(self, fn: Any, recurse: bool = True) -> SplitModel:
        """``to()``, ``half()``, ...: refuse a cast the cloud half would not follow before anything is cast."""
        for dtype in {p.dtype for p in self._cloud.values()}:
            if fn(torch.empty(0, dtype=dtype)).dtype != dtype:
                raise ConfigError(f"casting the split model to another dtype would leave the cloud half in {dtype}; "
                                  "cast the model before split(), or run the cloud half in another dtype there")
        if not fn(torch.empty(1, 2, 3, 4)).is_contiguous() and any(p.dim() == 4 for p in self._cloud.values()):
            raise ConfigError("model.to(memory_format=...) would change the layout of the edge's tensors only: the "
                              "cloud half's convolutions would compute in another layout than the unsplit model's, "
                              "a few bits apart. Convert edge submodules you choose (model.model.<name>.to(...)) or "
                              "leave the layout as it is")
        result = super()._apply(fn, recurse)
        # The cloud gradients' handles report where the edge's tensors are, as the unsplit model's would.
        self.cloud_half.device = fn(torch.empty(0, device=self.cloud_half.device)).device
        return result

    def _refuse_state_hooks(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("state_dict hooks on a split model are not run by its state_dict/load_state_dict (which "
                          "fetch and push the cloud half); register them on the unsplit model")

    register_state_dict_pre_hook = _refuse_state_hooks  # type: ignore[assignment]
    register_state_dict_post_hook = _refuse_state_hooks  # type: ignore[assignment]
    register_load_state_dict_pre_hook = _refuse_state_hooks  # type: ignore[assignment]
    register_load_state_dict_post_hook = _refuse_state_hooks  # type: ignore[assignment]

    # ------------------------------------------------------------ where the parameters are

    def is_cloud(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a placeholder of this model's cloud parameters."""
        return isinstance(param, CloudTensor) and param._splitft_remote is self.cloud_half

    def cloud_parameters(self) -> Iterator[nn.Parameter]:
        """The cloud half's parameters, as placeholders on the ``meta`` device (no values)."""
        return iter(self._cloud.values())

    def named_cloud_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the unsplit model, placeholder) of each cloud parameter."""
        return iter(self._cloud.items())

    def edge_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters that live here, on the edge."""
        return (p for p in self.parameters() if not self.is_cloud(p))

    def edge_state_dict(self) -> dict[str, Any]:
        """The edge half's state (unsplit names, the cloud half's left out)."""
        cloud = self.__dict__["_cloud_modules"].qualified_state_dict().keys()
        return {k: v for k, v in self.model.state_dict().items() if k not in cloud}

    @property
    def metrics(self) -> Metrics:
        return self.session.metrics

    # ------------------------------------------------------------ forward

    def forward(self, *args: Any, sample_ids: Any = None, **kwargs: Any) -> Any:
        """Run the model's own forward; the cloud part runs remotely.

        ``sample_ids`` (one int per sample, stable across epochs) is for codecs that keep
        per-sample state, such as ``acsgd``.
        """
        self._sample_ids = sample_ids_array(sample_ids)
        self._check_ghosts()
        if self.spec.ushape:
            try:
                return self.model(*args, **kwargs)
            finally:
                self._sample_ids = None  # the wrapped model called directly (generate) has none
        try:
            if self.scheduler.options.delayed_gradients and self.training and torch.is_grad_enabled():
                self._stash, copies = stash_weights(self.model, self._cloud.values())
                torch.func.functional_call(self.model, copies, args, kwargs, strict=False)
            else:
                self.model(*args, **kwargs)
        except CutReached as cut:
            if len(cut.call_args) == 1 and not cut.call_kwargs:
                return cut.call_args[0]
            return CutActivation(cut.call_args, cut.call_kwargs)
        raise SplitFTError("the model's forward returned without reaching the cut; check the cut name")

    @torch.compiler.disable  # torch.compile(model) compiles the edge's code around it; the call itself runs as is
    def _remote(self, args: tuple, kwargs: dict, target: Any = None) -> Any:
        self._refuse_batch_statistics_of_micro_batches()
        self._mirror_module_state()
        self.cloud_half.hidden = False  # an optimizer step that raised left them hidden
        args, kwargs = trees.rebuild((args, kwargs), self._cache_ref, is_leaf=is_cache, other=lambda node, path: node)
        grad = torch.is_grad_enabled()
        leaves, skeleton = flatten((list(args), kwargs, target))
        if self.freeze_edge:  # no input needs a gradient, so none crosses back
            leaves = [t.detach() for t in leaves]
        stash, self._stash = self._stash, None
        attached = leaves
        if stash is not None and grad:  # the edge's graph stays apart; the scheduler backpropagates it
            leaves = [t.detach().requires_grad_() if t.requires_grad else t for t in leaves]
        call = Call(skeleton, len(leaves), train=self.training, grad=grad, sample_ids=self._sample_ids,
                    stash=stash if grad else None, leaves=attached if stash is not None else [],
                    autocast=autocast_dtype(next((t.device.type for t in leaves if t.is_floating_point()), "cpu")),
                    cloud_half=self.cloud_half, trainable=self._trainable)
        inputs = [*leaves, self._anchor] if grad else leaves
        outputs = _RemoteCall.apply(self.scheduler, call, *inputs)
        return unflatten(call.out_skeleton, list(outputs))

    def _cache_ref(self, cache: Any, path: Any) -> CacheRef:
        """The number of a key/value cache the cloud keeps for it; freed there when ``cache`` goes."""
        number = self._cache_numbers.get(cache)
        if number is None:
            self._next_cache += 1
            number = self._cache_numbers[cache] = self._next_cache
            weakref.finalize(cache, _free_cache, weakref.ref(self), number)
        return CacheRef(number)

    def _trunk(self, *args: Any, **kwargs: Any) -> Any:
        """U-shape: run the cloud's trunk on what the model passes to its first module."""
        return self._remote(args, kwargs)

    def predict(self, *args: Any, sample_ids: Any = None, **kwargs: Any) -> Any:
        """The whole model's output. In U-shape this is ``forward``; plain splits ask the cloud."""
        if self.spec.ushape:
            return self(*args, sample_ids=sample_ids, **kwargs)
        cut = self(*args, sample_ids=sample_ids, **kwargs)
        return self._remote(*call_parts(cut))

    # ------------------------------------------------------------ training

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Mirror ``optimizer`` in the cloud: same class, settings and parameter groups (by name),
        stepping and zeroing when it does.

        Optimizers holding the cloud half's parameters are attached by themselves the first time
        they step or zero their gradients; attaching explicitly does it at once. Returns the same
        optimizer, so ``opt = model.attach(torch.optim.Adam(...))`` reads well.
        """
        if self.optimizer is optimizer:
            return optimizer
        if self.optimizer is not None:
            raise ConfigError(f"this split model already mirrors a {type(self.optimizer).__name__}; the cloud half "
                              "steps with one optimizer: put every group in it (or give the others edge "
                              "parameters only, which stay local)")
        if any(state for p, state in optimizer.state.items() if self.is_cloud(p)):
            raise ConfigError("this optimizer already holds state for cloud parameters (loaded before it was "
                              "attached); attach it before loading its state_dict")
        optimizer_mirror = mirror.OptimizerMirror(self.session, optimizer, self._cloud_ids, self.cloud_half,
                                                  resume_state=self._resume_optimizer, on_step=self._stepped)
        optimizers.mirrored(optimizer, optimizer_mirror)
        self._resume_optimizer = None
        self.optimizer = optimizer
        return optimizer

    def _refuse_batch_statistics_of_micro_batches(self) -> None:
        """Micro-batches run the cloud half on pieces of the batch: a BatchNorm there that
        normalizes by batch statistics would use each piece's, and the step would not be the
        unsplit model's. Refused before anything is sent; in eval mode (running statistics) it is exact."""
        parts = self.scheduler.options.micro_batches
        if parts == 1:
            return
        for name, module in self._cloud_batchnorms:
            if module.training or not module.track_running_stats:
                raise ConfigError(f"micro_batches={parts} would run {name} ({type(module).__name__}) in the cloud on "
                                  "each micro-batch's statistics, not the batch's, so training would differ from "
                                  "the unsplit model. Use micro_batches=1 with this cut, or cut after the "
                                  "BatchNorm layers")

    def _mirror_module_state(self) -> None:
        """Tell the cloud what the script changed on its modules by name, when that changed: the
        parameters it froze (``requires_grad_(False)``) and the modules it put in the other mode."""
        frozen = frozenset(name for name, param in self._cloud.items() if not param.requires_grad)
        if frozen != self._frozen_sent:
            self.session.outbox.queue(SetFrozen(names=sorted(frozen)))
            self._frozen_sent = frozen
            self._trainable = frozenset(self._cloud) - frozen
        flipped = []
        for name in self.__dict__["_cloud_modules"].names:
            for key, module in self.model.get_submodule(name).named_modules():
                if module.training != self.training:
                    flipped.append(f"{name}.{key}" if key else name)
        if flipped != self._flipped_sent:
            self.session.outbox.queue(SetModes(names=flipped))
            self._flipped_sent = flipped

    def _stepped(self) -> None:
        self.metrics.steps += 1
        if self._writer is not None:
            now = time.perf_counter()
            privacy = getattr(self, "privacy", None)  # set by splitft.privacy.protect
            self._writer.write({"step": self.session.step, "seconds": now - self._last_record}
                               | self.metrics.snapshot()
                               | ({"privacy": privacy.snapshot()} if privacy is not None else {}))
            self._last_record = now

    def remote_loss(self, criterion: nn.Module) -> RemoteLoss:
        """Plain split: compute ``criterion`` in the cloud. Returns a callable ``crit(out, target)``."""
        if self.spec.ushape:
            raise ConfigError("in a U-shape split the loss stays on the edge: call your criterion directly")
        settings = mirror.loss_settings(criterion)
        self.session.outbox.queue(SetLoss(name=type(criterion).__name__, settings=settings))
        self.scheduler.loss_reduction = str(settings.get("reduction", "mean"))
        return RemoteLoss(self)

    # ------------------------------------------------------------ cloud state

    def sync(self) -> None:
        """Make the cloud apply every pending step now (they otherwise ride on the next message)."""
        self.scheduler.drain()
        self.session.sync()

    # ------------------------------------------------------------ both halves' gradients

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """Clip both halves' gradients by their global norm (``torch.nn.utils.clip_grad_norm_``
        over the whole model's parameters, which reaches the cloud's); returns that total norm."""
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clamp both halves' gradients to ``[-clip_value, clip_value]`` (``torch.nn.utils.clip_grad_value_``)."""
        torch.nn.utils.clip_grad_value_(self.parameters(), clip_value)

    # ------------------------------------------------------------ the whole model's state

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        """The whole model's state under the unsplit model's key names: the edge's tensors and the
        cloud half's (fetched), so ``torch.save(model.state_dict())`` loads into the unsplit model."""
        if args:
            raise ConfigError("state_dict() of a split model takes keyword arguments only")
        out = self.model.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        for key, value in self.cloud_state_dict().items():  # in place of the placeholders
            out[prefix + key] = value
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a whole model's state (the unsplit model's key names): the edge's part here, the
        cloud half's sent to the cloud (every one of its tensors is required)."""
        cloud_names = set(self.__dict__["_cloud_modules"].qualified_state_dict())
        cloud = {k: v for k, v in state_dict.items() if k in cloud_names}
        edge = {k: v for k, v in state_dict.items() if k not in cloud_names}
        if cloud.keys() != cloud_names and (strict or cloud):
            missing = sorted(cloud_names - cloud.keys())
            raise ConfigError(f"load_state_dict: the cloud half's tensors {missing[:5]} are missing; give all of "
                              "them, or none with strict=False")
        result = self.model.load_state_dict(edge, strict=False, assign=assign)
        missing = [k for k in result.missing_keys if k not in cloud_names]
        if strict and (missing or result.unexpected_keys):
            raise RuntimeError(f"Error(s) in loading state_dict for {type(self.model).__name__}: missing keys "
                               f"{missing[:5]}, unexpected keys {result.unexpected_keys[:5]}")
        if cloud:
            self.session.outbox.queue(LoadWeights(weights={k: torch.as_tensor(v).detach().cpu().numpy()
                                                           for k, v in cloud.items()}))
            self.session.sync()  # applied now, so a bad tensor is reported here
        return type(result)(missing, result.unexpected_keys)

    def unsplit(self) -> nn.Module:
        """The whole trained model, in one piece on the edge: the cloud half's modules back in place
        with the cloud's weights. Ends the session (the split model cannot train after this)."""
        modules = self.__dict__["_cloud_modules"]
        modules.load_qualified_state_dict(self.cloud_state_dict())
        self.close()
        self.cloud_half.has_grad.clear()
        return uninstall(self.model, modules)

    def save_pretrained(self, path: str | os.PathLike, state_dict: Mapping[str, Any] | None = None,
                        **kwargs: Any) -> Any:
        """``transformers`` and ``peft`` models: save the whole model (both halves; ``state_dict``
        when given, else fetched) with the wrapped model's ``save_pretrained``, so the files are
        those the unsplit model writes (a PEFT model's adapter files, say)."""
        save = getattr(self.model, "save_pretrained", None)
        if save is None:
            raise ConfigError(f"{type(self.model).__name__} has no save_pretrained; use torch.save(model.state_dict())")
        return save(path, state_dict=self.state_dict() if state_dict is None else state_dict, **kwargs)

    def cloud_state_dict(self) -> dict[str, torch.Tensor]:
        """The cloud part's current weights, named as in the original model."""
        self.scheduler.drain()
        state = self.session.sync(want_state=True) or {}
        return {k: torch.from_numpy(np.array(v)) for k, v in state.items()}

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Checkpoint both halves at this step boundary (call it after ``opt.step()``).

        The cloud writes its half (it must run with ``--checkpoint-dir``) and the edge writes
        ``PATH.json`` + ``PATH-<hash>.safetensors``: the edge part's weights, the attached
        optimizer's state, the codec state, the step id and the session's resume token (keep the
        files private: the token resumes the session). ``split(..., resume_from=PATH)`` continues
        from here.
        """
        self.scheduler.drain()
        resume.save(self, path)

    def close(self, reason: str = "done") -> None:
        if self._writer is not None:
            self._writer.close()
        try:
            if not self.session.closed and reason == "done":
                self.scheduler.drain()  # an error of a streamed step is raised, never lost
        finally:
            self.session.close(reason)

    def __enter__(self) -> SplitModel:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close("interrupted" if exc_type is KeyboardInterrupt else "done" if exc_type is None else "error")


def _no_norms(norm_type: float) -> list[float | None]:
    raise ConfigError("this split model fetches no gradient norms")


def _free_cache(split_ref: weakref.ref, number: int) -> None:
    split = split_ref()
    if split is not None and not split.session.closed:
        split.session.outbox.queue(FreeCache(id=number))


__all__ = ["CutActivation", "RemoteLoss", "SplitModel"]
