"""The model the user trains: the original one with its cloud part cut out.

The user's loop stays ordinary PyTorch. A :class:`SplitModel` holds the wrapped model and the rooms
that each keep one part of the split's state: the session (:mod:`.requests`) and what waits to
ride on its next request (:mod:`.outbox`), the stage's codecs and step count (:mod:`.stage`), the
cloud half's tensors and gradients (:mod:`.cloud_half`) and modules (:mod:`.ghosts`), what the
cloud must repeat (:mod:`.mirror`), the calls through the cut (:mod:`.remote_call`).
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ..config_reads import ModuleFlags
from ..cut import CutSpec
from ..errors import ConfigError, HiddenAttributeWarning, PeerGone, SplitFTError
from ..metrics import Metrics
from . import cloud_kv, generator_sets, initialisers, module_surgery, move, optimizers, resume
from .cloud_half import CloudHalf
from .fetched_state import FetchedCloudState
from .ghosts import Ghosts, install, standin_of, uninstall
from .whole_state import forget_inner_keys, load_nested, load_whole_state, pending_cloud_grads, put_grads
from .mirror import ModelMirror, loss_module
from .optimizer_loads import local_value
from .module_tree import UnsplitTree, caller_level, hidden_attributes
from .placeholders import CloudTensor
from .remote_call import COMPILED_TO_TORCHSCRIPT, CacheRefs, RemoteCaller, refuse_foreign_contexts
from .remote_loss import CUT_CONTEXT, CutActivation, CutContext, CutTensor, RemoteLoss, call_parts, mean_denominator
from .requests import EdgeSession
from .schedule import Scheduler
from .stage import DRAWN_BETWEEN, CloudStage
from .stray import StrayForwards, crossed
from .standins import FORWARDING, CutReached, TrunkEntry
from .step_log import StepLog


class SplitModel(UnsplitTree):
    """The user's model with its cloud part cut out. Train it like the original.

    It holds the original model (``.wrapped``), whose cloud modules are *ghosts*: the same classes, names
    and parameter shapes, with placeholder parameters on the ``meta`` device (the values live in the
    cloud). ``parameters()`` therefore lists every parameter of the unsplit model, and whatever a script
    does to them reaches the cloud or raises (:mod:`.placeholders`): optimizers (their groups by name,
    their steps), ``p.grad`` (cleared, clipped, unscaled by torch's own functions), ``requires_grad_``,
    new values. ``edge_parameters()`` and ``cloud_parameters()`` tell which is where. Attribute lookups
    the split model does not answer go to the wrapped model (``model.config``), and ``forward`` has the
    wrapped model's signature. Plain splits return the activation at the cut from ``forward``; the loss
    comes from :meth:`remote_loss` and predictions from :meth:`predict`.

    Building one cuts ``model``: its cloud modules become ghosts (``check_cut``: a U-shape trunk is
    checked at its first call to read nothing that does not cross the cut).
    """

    def __init__(self, model: nn.Module, spec: CutSpec, session: EdgeSession, stage: CloudStage,
                 scheduler: Scheduler, *, check_cut: bool = True, metrics_path: str | os.PathLike | None = None,
                 freeze_edge: bool = False) -> None:
        super().__init__()
        self.model = model
        self.spec = spec
        self.session = session
        self.stage = stage
        self.scheduler = scheduler
        self.cloud_half = CloudHalf(session.outbox.queue, self._fetch_norms, self._fetch_values,
                                    lambda: session.outbox.version)
        self.mirror = ModelMirror(session, session.outbox, stage, self.cloud_half, on_step=self._stepped)
        scheduler.before_backward = self.mirror.frozen_state
        self.caller = RemoteCaller(scheduler, self.cloud_half, CacheRefs(session.outbox.queue, lambda: session.closed),
                                   freeze_edge=freeze_edge)
        self.step_log = StepLog(metrics_path) if metrics_path else None
        #: The privacy defences splitft.privacy.protect() attached (their spending is logged per step).
        self.privacy: Any = None
        cloud_half = self.cloud_half
        chain = install(model, spec, remote=self._trunk if spec.ushape else None, check=check_cut,
                        placeholder=lambda tensor, name: CloudTensor(tensor, name, cloud_half))
        self.caller.caches.layers = cloud_kv.decoder_layers(chain.stages)
        self.ghosts = Ghosts(model, chain)
        self.ghosts.serve_state(self._with_cloud_values)
        self.mirror.before_step = self.ghosts.refuse_swapped
        self._flags = ModuleFlags([(name, model.get_submodule(name)) for name in chain.names])
        entry = standin_of(model.get_submodule(chain.names[0])) if spec.ushape else None
        trunk = entry if isinstance(entry, TrunkEntry) else None
        self.strays = StrayForwards(self.ghosts.cloud_modules, stage.draws_in_training, trunk, session=session)
        if trunk is not None:
            trunk.draws, trunk.keeps_statistics = stage.draws_in_training, self.strays.keeps_statistics
        session.before_request = weakref.WeakMethod(self.strays.check)
        outbox = session.outbox
        #: Where the cloud half's state stands: what a fetched state_dict() entry was taken at.
        self._state_moment: Callable[[], tuple[int, int]] = lambda: (outbox.weights_version, outbox.runs)
        nn.Module.register_load_state_dict_post_hook(self, forget_inner_keys)
        self._fetched: weakref.WeakSet[FetchedCloudState] = weakref.WeakSet()  # for unsplit() to make them the model's
        cloud_half.bind(model, chain)
        cloud_half.device = next((p.device for p in self.edge_parameters()), torch.device("cpu"))
        optimizers.register(cloud_half, self.mirror)
        optimizers.install()
        initialisers.install()
        module_surgery.install()
        generator_sets.install()
        self.seal()
        hidden = hidden_attributes(self, SplitModel, model, handled=("save_pretrained",))
        if hidden:
            warnings.warn(f"{type(model).__name__} has {', '.join(map(repr, hidden))}, which the split model has too: "
                          f"on the split model, {hidden[0]!r} is the split model's; your model's is "
                          f"model.wrapped.{hidden[0]}", HiddenAttributeWarning, stacklevel=caller_level())

    def __getattr__(self, name: str) -> Any:
        wrapped = self.__dict__.get("_modules", {}).get("model")
        if name == "model" and wrapped is not None:
            # ``model.model`` is the wrapped model's own ``model`` where it has one (a transformers
            # causal LM's decoder, as unsplit: freezing ``model.model.parameters()`` freezes the
            # same ones); else the wrapped model itself.
            own = getattr(wrapped, "model", None)
            return own if isinstance(own, nn.Module) else wrapped
        try:
            return super().__getattr__(name)
        except AttributeError:
            if wrapped is None or name.startswith("__") or (name.startswith("_") and not hasattr(type(wrapped), name)):
                raise
            return getattr(wrapped, name)  # config, main_input_name, transformers' _supports_logits_to_keep, ...

    # ------------------------------------------------------------ what cannot reach the cloud half

    def __deepcopy__(self, memo: dict) -> Any:
        raise ConfigError("a split model cannot be copied: its cloud half's values live in the cloud, and its session is "
                          "one connection. For an EMA of the weights (AveragedModel, deepcopy + update), keep it on the "
                          "unsplit model before split(), or average the weights you fetch with model.state_dict(). To "
                          "quantize, export or keep the trained model, take it whole with model.unsplit() (ending the session)")

    def __copy__(self) -> Any:  # copy.copy(model): refused as copy.deepcopy is, not as pickling
        return self.__deepcopy__({})

    def __prepare_scriptable__(self) -> Any:  # what torch.jit.script asks of a module first
        raise ConfigError(COMPILED_TO_TORCHSCRIPT)

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ConfigError("a split model cannot be pickled (torch.save(model)): save model.state_dict(), which fetches the "
                          "cloud half, or use model.save_checkpoint(path); model.unsplit() gives the whole trained model")

    def set_submodule(self, target: str, module: nn.Module, strict: bool = False) -> None:
        self.ghosts.refuse_replacing(target)
        super().set_submodule(target, module, strict)

    def _apply(self, fn: Any, recurse: bool = True) -> SplitModel:
        """``to()``, ``half()``, ...: refuse a cast the cloud half would not follow before anything is cast."""
        cloud = self.cloud_half.params.values()
        for dtype in {p.dtype for p in cloud}:
            if fn(torch.empty(0, dtype=dtype)).dtype != dtype:
                raise ConfigError(f"casting the split model to another dtype would leave the cloud half in {dtype}; "
                                  "cast the model before split(), or run the cloud half in another dtype there")
        if not fn(torch.empty(1, 2, 3, 4)).is_contiguous() and any(p.dim() == 4 for p in cloud):
            raise ConfigError("model.to(memory_format=...) would change the layout of the edge's tensors only: the "
                              "cloud half's convolutions would compute in another layout than the unsplit model's, "
                              "a few bits apart. Convert edge submodules you choose (model.wrapped.<name>.to(...)), "
                              "the activation at the cut left in the default layout, or leave the layout as it is")
        result = super()._apply(fn, recurse)
        # The cloud gradients' handles report where the edge's tensors are, as the unsplit model's would.
        self.cloud_half.device = fn(torch.empty(0, device=self.cloud_half.device)).device
        return result

    def _refuse_state_hooks(self, *args: Any, **kwargs: Any) -> Any:
        raise ConfigError("state_dict hooks on a split model are not run by its state_dict/load_state_dict (which "
                          "fetch and push the cloud half); register them on the unsplit model")

    register_state_dict_pre_hook = _refuse_state_hooks
    register_state_dict_post_hook = _refuse_state_hooks
    register_load_state_dict_pre_hook = _refuse_state_hooks
    register_load_state_dict_post_hook = _refuse_state_hooks

    # ------------------------------------------------------------ where the parameters are

    def is_cloud(self, param: torch.Tensor) -> bool:
        """Whether ``param`` is a placeholder of this model's cloud parameters."""
        return self.cloud_half.owns(param)

    def cloud_parameters(self) -> Iterator[nn.Parameter]:
        """The cloud half's parameters, as placeholders on the ``meta`` device (no values)."""
        return iter(self.cloud_half.params.values())  # type: ignore[arg-type]  # CloudTensors that are parameters

    def named_cloud_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        """(name in the unsplit model, placeholder) of each cloud parameter."""
        return iter(self.cloud_half.params.items())  # type: ignore[arg-type]

    def edge_parameters(self) -> Iterator[nn.Parameter]:
        """The parameters that live here, on the edge."""
        return (p for p in self.parameters() if not self.is_cloud(p))

    def edge_state_dict(self) -> dict[str, Any]:
        """The edge half's state (unsplit names, the cloud half's left out)."""
        cloud = self.ghosts.state_names()
        return {k: v for k, v in self.wrapped.state_dict().items() if k not in cloud}

    @property
    def metrics(self) -> Metrics:
        return self.session.metrics

    # ------------------------------------------------------------ forward

    def forward(self, *args: Any, sample_ids: Any = None, **kwargs: Any) -> Any:
        """Run the model's own forward; the cloud part runs remotely.

        ``sample_ids`` (one int per sample, stable across epochs) is for codecs that keep
        per-sample state, such as ``acsgd``.
        """
        self._before_forward(sample_ids)
        self.caller.refuse_input_gradients(args, kwargs)
        if self.spec.ushape:
            try:
                return self.wrapped(*args, **kwargs)
            except TypeError as exc:
                self.strays.explain(exc)
                raise
            finally:
                self.caller.forward_with(None)  # the wrapped model called directly (generate) has none
        forwarding = FORWARDING.set(True)
        try:
            if self.scheduler.options.delayed_gradients and self.training and torch.is_grad_enabled():
                copies = self.caller.stash(self.wrapped, self.cloud_half.params.values())
                torch.func.functional_call(self.wrapped, copies, args, kwargs, strict=False)
            else:
                self.wrapped(*args, **kwargs)
        except CutReached as cut:
            return self._at_cut(cut)
        finally:
            FORWARDING.reset(forwarding)
        raise SplitFTError("the model's forward returned without reaching the cut; check the cut name")

    @torch.compiler.disable  # torch.compile(model) compiles the model's own code, not these checks of it
    def _before_forward(self, sample_ids: Any) -> None:
        """What ``model(x)`` checks before the model's forward runs (nothing changed that the cloud
        would not follow), and the ``sample_ids`` its call carries."""
        refuse_foreign_contexts()
        if self.session.closed:  # closed or unsplit: the model's tensors are no placeholders any more
            raise PeerGone("this split session is closed (after model.unsplit(), go on with the model it returned); "
                           "create a new one to keep training")
        self.caller.forward_with(sample_ids)
        self.ghosts.check()
        self.strays.check()
        if not self.spec.ushape:
            self.strays.refuse_recomputation(self.training)
            self.ghosts.refuse_hooks_above_the_cut(self)
            self.ghosts.refuse_modules_after_the_cut()

    @torch.compiler.disable  # as _remote: what reached the cut is handed over as it is
    def _at_cut(self, cut: CutReached) -> Any:
        """A plain split's ``model(x)``: what reached the cut, with what it ran under."""
        if len(cut.call_args) == 1 and not cut.call_kwargs:
            value = cut.call_args[0]
            out = CutTensor(value, self.ghosts.outputs) if isinstance(value, torch.Tensor) else value
        else:
            out = CutActivation(cut.call_args, cut.call_kwargs)
        self.strays.made(out, self.training)
        if isinstance(out, (CutTensor, CutActivation)):
            out.__dict__[CUT_CONTEXT] = CutContext.now(self.training, self.session.outbox.weights_version)
        return out

    @torch.compiler.disable  # torch.compile(model) compiles the edge's code around it; the call itself runs as is
    def _remote(self, args: tuple, kwargs: dict, target: Any = None, again: torch.Tensor | None = None,
                cut: CutContext | None = None) -> Any:
        """A call of the cloud half, once the cloud knows what the script changed on its modules
        (``again``, ``cut``: see :class:`~splitft.edge.remote_loss.CloudCall`)."""
        self.ghosts.refuse_batch_statistics(self.scheduler.options.micro_batches)
        if cut is not None:
            cut.refuse_changes(self.training, self.session.outbox.weights_version)
        modes = self._mirror_module_state()
        if self.training or modes:
            self.session.outbox.runs += 1
        drawn_since = generator_kept = None
        since = cut.generator_since() if again is None and cut is not None else "untouched"
        if cut is not None and since == "set":  # the half draws from the forward's state; the script's set stays
            generator_kept = cut.rng
        elif cut is not None and since == "drew":
            draws = self.stage.draws(self.training, modes)
            if draws:
                raise ConfigError(DRAWN_BETWEEN)
            if draws is None:  # its first forward in these modes: it starts where unsplit, and says if it drew
                drawn_since = cut.rng
        return self.caller(args, kwargs, target, train=self.training, trainable=self.mirror.trainable, modes=modes,
                           again=again, drawn_since=drawn_since, generator_kept=generator_kept)

    def _trunk(self, *args: Any, **kwargs: Any) -> Any:
        """U-shape: run the cloud's trunk on what the model passes to its first module."""
        return self._remote(args, kwargs)

    def predict(self, *args: Any, sample_ids: Any = None, **kwargs: Any) -> Any:
        """The whole model's output. In U-shape this is ``forward``; plain splits ask the cloud."""
        if self.spec.ushape:
            return self(*args, sample_ids=sample_ids, **kwargs)
        cut = self(*args, sample_ids=sample_ids, **kwargs)
        crossed(cut)
        return self._remote(*call_parts(cut))

    # ------------------------------------------------------------ training

    def attach(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Mirror ``optimizer`` in the cloud: same class, settings and parameter groups (by name),
        stepping and zeroing when it does.

        Optimizers holding the cloud half's parameters are attached by themselves the first time
        they step or zero their gradients; attaching explicitly does it at once. Returns the same
        optimizer, so ``opt = model.attach(torch.optim.Adam(...))`` reads well.
        """
        return self.mirror.attach(optimizer)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer the cloud mirrors (None before one is attached)."""
        return self.mirror.optimizer

    def _mirror_module_state(self) -> tuple[str, ...]:
        """Tell the cloud what the script changed on its modules by name (frozen parameters, modes);
        returns the modules whose mode is not the model's."""
        flipped = self.ghosts.flipped(self.training)
        flags = self._flags.changed()
        if flags:
            self.stage.flags_changed()
        self.mirror.module_state(flipped, flags)
        return tuple(flipped)

    def _fetch_norms(self, norm_type: float) -> list[float | None]:
        """The cloud's norm of each of its gradients (after what changed on its modules)."""
        self._mirror_module_state()
        return self.session.sync_reply(grad_norm=norm_type).grad_norms or []

    def _fetch_values(self, nodes: list) -> list:
        """The values of expressions over the cloud half's tensors (after what changed on its modules)."""
        self._mirror_module_state()
        return self.session.sync_reply(evaluate=nodes).values or []

    def _stepped(self) -> None:
        self.metrics.steps += 1
        if self.step_log is not None:
            self.step_log.write(self.stage.step, self.metrics, self.privacy)

    def remote_loss(self, criterion: nn.Module | Callable[..., torch.Tensor]) -> RemoteLoss:
        """Plain split: compute ``criterion`` (a torch.nn loss, or torch.nn.functional's of
        ``(input, target)``) in the cloud. Returns a callable ``crit(out, target)``."""
        if self.spec.ushape:
            raise ConfigError("in a U-shape split the loss stays on the edge: call your criterion directly")
        module = loss_module(criterion)
        self.scheduler.loss_is(self.mirror.loss(module), mean_denominator(module))
        return RemoteLoss(self._remote, before=lambda: self._loss_for_call(module),
                          criterion=module if module is criterion else None)

    def _loss_for_call(self, criterion: nn.Module) -> None:
        reduction = self.mirror.loss_for_call(criterion)
        if reduction is not None:
            self.scheduler.loss_is(reduction, mean_denominator(criterion))

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
        cloud half's (fetched), so ``torch.save(model.state_dict())`` loads into the unsplit model.

        The cloud half's entries are its values now, which refuse a write and a read once the cloud
        half changed (:mod:`.fetched_state`); with ``keep_vars`` they are the model's own
        parameters and buffers, as unsplit (the placeholders, which mirror what is done to them)."""
        if args:
            raise ConfigError("state_dict() of a split model takes keyword arguments only")
        out = self.wrapped.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        return out if keep_vars else self._with_cloud_values(out, prefix)

    def _with_cloud_values(self, out: Any, prefix: str, under: str = "") -> Any:
        """``out`` with the cloud half's entries (of module ``under``) fetched, in place of the placeholders."""
        moment = self._state_moment()
        for key, value in self.cloud_state_dict().items():
            if key.startswith(under):
                out[prefix + key[len(under):]] = entry = FetchedCloudState(value, key, self._state_moment, moment)
                self._fetched.add(entry)
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a model's state (the unsplit model's key names) as torch loads it: what is given
        loads, the edge's part here and the cloud half's in the cloud (checked there before any
        of it loads); missing and unexpected keys are reported, and with ``strict`` raised once
        the rest is loaded, as is a tensor of another shape, with torch's ``RuntimeError``."""
        return load_whole_state(self.wrapped, state_dict, strict, assign, cloud_names=self.ghosts.state_names(),
                                cloud_params=set(self.cloud_half.params), session=self.session,
                                moment=self._state_moment, chain=self.ghosts.chain)

    def _load_from_state_dict(self, state_dict: Mapping[str, Any], prefix: str, local_metadata: dict, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """A split model inside another module (``self.model = split(...)`` in a Lightning-style
        module): torch's load of that module reaches it here with the keys its ``state_dict()``
        wrote (``prefix`` + the unsplit names), which load as :meth:`load_state_dict` loads them.
        torch then walks into the wrapped model under ``prefix + "model."``, where nothing is:
        what that walk reports missing or unexpected is dropped after it (:mod:`.whole_state`)."""
        load_nested(self, state_dict, prefix, local_metadata, missing_keys, unexpected_keys, error_msgs)

    def unsplit(self) -> nn.Module:
        """The whole trained model, in one piece on the edge: the cloud half's modules back in place
        with the cloud's weights and the gradients summed there since the last step, and the attached
        optimizer holding the cloud's state for them, so training can go on unsplit, exactly. Ends
        the session (the split model cannot train after this)."""
        modules = self.ghosts.chain
        modules.load_qualified_state_dict(self.cloud_state_dict())
        grads = pending_cloud_grads(self.session, self.cloud_half.params, self.cloud_half.has_grad)
        optimizer = self.mirror.optimizer_mirror
        moments = None  # a shared half's optimizer is every edge's: its moments start afresh here
        if optimizer is not None and not self.session.shared:
            optimizer.follow_state()  # a reset of the state reaches the cloud's copy before it is fetched
            moments = self.session.optimizer_state()
        self.close()
        self.cloud_half.has_grad.clear()
        whole = uninstall(self.wrapped, modules)
        put_grads(whole, grads)
        now = self._state_moment()
        self.session.outbox.runs += 1  # what state_dict() fetched before is the whole model's now, or stale
        tensors = dict(whole.state_dict(keep_vars=True))
        for entry in list(self._fetched):
            if entry._splitft_moment == now:
                entry.follow(tensors[entry._splitft_name])
        if optimizer is not None:
            optimizer.unsplit(moments)  # the optimizer steps the whole model on the edge from now on
        return whole

    def save_pretrained(self, path: str | os.PathLike, state_dict: Mapping[str, Any] | None = None,
                        **kwargs: Any) -> Any:
        """``transformers`` and ``peft`` models: save the whole model (both halves; ``state_dict``
        when given, else fetched) with the wrapped model's ``save_pretrained``, so the files are
        those the unsplit model writes (a PEFT model's adapter files, say)."""
        save = getattr(self.wrapped, "save_pretrained", None)
        if save is None:
            raise ConfigError(f"{type(self.wrapped).__name__} has no save_pretrained; use torch.save(model.state_dict())")
        return save(path, state_dict=self.state_dict() if state_dict is None else state_dict, **kwargs)

    def cloud_state_dict(self) -> dict[str, torch.Tensor]:
        """The cloud part's current weights, named as in the original model."""
        self.scheduler.drain()
        state = self.session.sync(want_state=True) or {}
        kept = self.wrapped.state_dict(keep_vars=True)  # the placeholders: their dtypes (bfloat16 travels as float32)
        return {k: local_value(v, kept.get(k)) for k, v in state.items()}

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Checkpoint both halves at this step boundary (call it after ``opt.step()``).

        The cloud writes its half (it must run with ``--checkpoint-dir``) and the edge writes
        ``PATH.json`` + ``PATH-<hash>.safetensors``: the edge part's weights, the attached
        optimizer's state of the edge's parameters, the codec state, the step id, which cloud
        parameters hold a gradient, and the session's resume token (keep the files private: the
        token resumes the session). ``split(..., resume_from=PATH)`` continues from here.
        """
        self.scheduler.drain()
        resume.save(path, self.session, self.stage, self.mirror, self.edge_state_dict,
                    lambda: sorted(self.cloud_half.has_grad))

    def move_to(self, address: str) -> None:
        """Move this session, mid-training, to the cloud at ``address`` (call it after ``opt.step()``):
        the cloud half's whole state travels from the cloud it is on to that one, through this edge,
        and training goes on there exactly as it would have (see :mod:`splitft.edge.move`)."""
        self.scheduler.drain()
        with self.session.lock:
            move.move(self.session, self.stage.step, address, self.session.route.follow)

    def close(self, reason: str = "done") -> None:
        if self.step_log is not None:
            self.step_log.close()
        try:
            if not self.session.closed and reason == "done":
                self.scheduler.drain()  # an error of a streamed step is raised, never lost
        finally:
            self.session.close(reason)

    def __enter__(self) -> SplitModel:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close("interrupted" if exc_type is KeyboardInterrupt else "done" if exc_type is None else "error")


__all__ = ["CutActivation", "RemoteLoss", "SplitModel"]
