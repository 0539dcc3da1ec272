"""Turning the cloud's modules of a user's model into ghosts, and back.

:func:`install` swaps each cloud parameter and buffer for a placeholder *in place* (the objects the
script already holds become the placeholders) and keeps the values in a twin of the modules'
structure; each cloud module stays in the tree as a ghost whose forward is a stand-in
(:mod:`.standins`) and whose class refuses changes the cloud would not follow. :func:`uninstall`
gives every object its values back.
"""

from __future__ import annotations

import copy
import inspect
import itertools
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.nn.utils import parametrize

from ..code_reads import GENERATORS, CodeGuard
from ..config_reads import ConfigGuard, own_attributes_kept_by_forward
from ..numerics import NumericsGuard
from ..cut import Chain, CutSpec, _module, extract
from ..errors import ConfigError, CutError
from . import twin_closures, weight_refs
from .layer_refusals import refuse_ties, refuse_unsupported_layers
from .output_shapes import OutputShapes
from .ghost_casts import casts_refused
from .ghost_classes import TABLES, Ghost, ghost_class
from .ghost_hooks import (GLOBAL_HOOKS, HOOKS, STATE_HOOKS, library_hook, never_run, refuse_hooks, refused_hook,
                          refused_state_hook)
from .standins import CutPoint, TrunkEntry, TrunkFollower, Unreachable


def install(model: nn.Module, spec: CutSpec, remote: Callable[..., Any] | None = None, *,
            check: bool = True, placeholder: Placeholder | None = None) -> Chain:
    """Turn the cloud modules of ``model`` into ghosts; return their real twins as a Chain.

    Every parameter and buffer of the cloud modules becomes a placeholder *in place*: the very
    objects the model, its modules and anything built from them before the cut hold (an
    optimizer, a reference to a layer, an EMA's source) are the placeholders from now on, so none
    of them can go on computing with values the cloud no longer shares. ``placeholder(tensor,
    name)`` makes each one (default: an empty tensor on the ``meta`` device). The returned Chain
    holds the values, in a copy of the modules' structure (no tensor is copied), for the weights
    the edge pushes, the first call's trunk check and :func:`uninstall`.

    The cloud modules themselves stay in the tree as *ghosts* (see :func:`ghost`): their classes,
    submodules and parameter names are kept, so scripts that walk the model (optimizer groups by
    name, freezing a layer) see the cloud half where it was. ``remote`` is what the U-shape entry
    calls; plain splits stop at a :class:`CutPoint`. ``check`` (U-shape) runs the trunk once on the
    edge at the first call to make sure it reads nothing that does not cross the cut (see
    :mod:`splitft.edge.audit`).
    """
    stages = extract(model, spec)
    refuse_unsupported_layers(stages)
    tensors = _cloud_tensors(stages)
    refuse_ties(model, stages, tensors)
    refuse_hooks(stages, tensors, spec.ushape)
    make = placeholder or _meta_placeholder
    memo: dict[int, Any] = {}
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, tensor in tensors.items():
        twin = make(tensor, name)
        swapped.append((tensor, twin))
        memo[id(tensor)] = twin
    weight_refs.drop(stages.stages)
    failure = _swap_all(swapped)  # each object the model held is its placeholder now, its twin the values
    if failure is not None:
        weight_refs.restore(stages.stages)
        raise CutError(f"cannot turn the cloud half's tensors into placeholders ({failure}): something else holds "
                       "one of its parameters, such as the graph of a forward whose output is still alive (run it "
                       "under torch.no_grad(), or drop the output), a weight computed from them (the old "
                       "torch.nn.utils.weight_norm: use torch.nn.utils.parametrizations.weight_norm), or a weak "
                       "reference; split the model before any of these")
    modules = list(zip(stages.names, stages.stages))
    config, code, numerics = ConfigGuard(modules), CodeGuard(modules), NumericsGuard()

    def unchanged() -> None:
        config.check()
        code.check()
        numerics.check()

    try:
        chain = Chain([(name, _twin(module, memo)) for name, module in zip(stages.names, stages.stages)],
                      whole=stages.whole)
        twin_closures.rebind(memo)
    except Exception as exc:
        _swap_all(swapped)  # the model's own tensors back where they were: a failed split leaves it as it was
        weight_refs.restore(stages.stages)
        raise CutError(f"cannot make the edge's stand-ins of the cloud half's modules ({type(exc).__name__}: {exc})") from exc
    chain.swapped = swapped
    entry: TrunkEntry | None = None
    for i, (name, module) in enumerate(zip(stages.names, stages.stages)):
        if spec.ushape:
            if i == 0:
                if remote is None:
                    raise CutError("a U-shape cut needs a remote callable for its trunk")
                entry = TrunkEntry(chain.names, remote, _signature(module), chain if check else None, whole=chain.whole)
                if name == "layers.0" or name.endswith(".layers.0"):  # a TransformerEncoder's first layer?
                    above = name[:-len("layers.0")].rstrip(".")
                    holder = _module(model, above) if above else model
                    if isinstance(holder, nn.TransformerEncoder):
                        entry.encoder.append(holder)
                standin: nn.Module = entry
            else:
                assert entry is not None
                standin = TrunkFollower(name, entry, index=i)
        else:
            standin = CutPoint(name) if i == 0 else Unreachable(name)
        ghost(module, standin, never_run=never_run(spec.ushape, i), before=unchanged if i == 0 else None)
    return chain


def _ancestors(name: str) -> list[str]:
    """The dotted names of the modules above ``name`` (``"a.b.c"``: ``"a"``, ``"a.b"``)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


class Ghosts:
    """The cloud half's modules in the user's model, once :func:`install` made them ghosts: where
    they are, what a script may not do to them, and their real twins (:attr:`chain`, which holds
    the values, for :func:`uninstall`)."""

    def __init__(self, model: nn.Module, chain: Chain) -> None:
        self.chain = chain
        self.outputs = OutputShapes(chain)  # what a plain split's model(x) answers for its shape
        self._model = model
        # Each cloud module and each module that holds one, by its name in its parent, from the root
        # down: a holder replaced (``model.body = nn.Sequential(...)``) takes the cloud half out of the
        # forward; a cloud module replaced puts another module where the cloud runs its own.
        linked = sorted({prefix for name in chain.names for prefix in (*_ancestors(name), name)}, key=len)
        self._links = [(name, name in chain.names, model.get_submodule(parent) if parent else model, child,
                        model.get_submodule(name)) for name in linked for parent, _, child in [name.rpartition(".")]]
        # Every module of the cloud half by its unsplit name, found once: a ghost refuses new
        # children, so the walk a forward would make to read their modes finds the same ones.
        self._cloud_modules = [(f"{name}.{key}" if key else name, module) for name in chain.names
                         for key, module in model.get_submodule(name).named_modules()]
        self._batchnorms = [(name, module) for name, module in self._cloud_modules
                            if isinstance(module, nn.modules.batchnorm._BatchNorm)]
        # The objects the model held, placeholders since the cut, with the class each was made of.
        self._placeholders = [(placeholder, type(placeholder), twin) for placeholder, twin in chain.swapped]
        # Each torch Sequential that holds a cloud module, with its modules' names: what its forward runs.
        holders = {id(parent): parent for _, _, parent, _, _ in self._links}.values()
        self._sequences = [(held, frozenset(held._modules)) for held in holders
                           if isinstance(held, nn.Sequential) and type(held).forward is nn.Sequential.forward]

    def serve_state(self, fetch: Callable[[dict, str, str], dict]) -> None:
        """A cloud module's own ``state_dict()`` (``best = copy.deepcopy(net.head.state_dict())``)
        holds its entries' values, fetched by ``fetch(state, prefix, under)`` (the split model's,
        held weakly), as the split model's does; within another module's it is left to that one's."""
        method = weakref.WeakMethod(cast(Any, fetch))
        for name, module in self._cloud_modules:
            module.__dict__["_splitft_state"] = (method, f"{name}.")

    def flipped(self, training: bool) -> list[str]:
        """The cloud half's modules whose mode is not ``training`` (a layer put in ``eval()`` by name)."""
        return [name for name, module in self._cloud_modules if module.training != training]

    def cloud_modules(self) -> list[nn.Module]:
        """The cloud's modules as ghosts, with their submodules."""
        return [module for _, module in self._cloud_modules]

    def state_names(self) -> set[str]:
        """The cloud half's state keys, named as in the unsplit model."""
        return set(self.chain.qualified_state_dict())

    def check(self) -> None:
        """Refuse a forward after a script replaced a module that runs in the cloud (a module walk
        swapping layers): the cloud would still run the one it has."""
        for name, in_cloud, parent, child, module in self._links:
            if parent._modules.get(child) is module:
                continue
            if not in_cloud:
                raise ConfigError(f"{name!r} holds modules that run in the cloud, but it was replaced after split(): "
                                  "the model's forward would no longer reach them, and the cloud half's weights would "
                                  "go on standing for modules the model no longer has. Replace modules before split(), "
                                  "in the cloud's factory too (to compile, compile the split model: "
                                  "torch.compile(model) or model.compile())")
            raise ConfigError(f"{standin_name(module)!r} runs in the cloud, but the model's forward would call "
                              f"another module there: it was replaced after split(). Replace layers before "
                              "split(), in the cloud's factory too")
        self.refuse_swapped()
        if any(GLOBAL_HOOKS):
            raise ConfigError("a global module hook is registered (torch.nn.modules.module.register_module_forward_hook "
                              "and its kin, or a tool that uses them): it runs on every module's call, but the cloud "
                              "half's modules run in the cloud, where it would not; register hooks on edge modules")

    def refuse_modules_after_the_cut(self) -> None:
        """A plain split's cloud half ends the model's forward: a module added to a Sequential that
        holds a cloud module (``model.aux = nn.Linear(...)``, ``add_module``) runs after it unsplit,
        where split it would never run. Refused before the forward."""
        for sequence, names in self._sequences:
            if not sequence._modules.keys() <= names:
                added = next(name for name in sequence._modules if name not in names)
                raise ConfigError(f"module {added!r} was added to a Sequential that holds the cloud half after "
                                  "split(): its forward runs it after the cloud half, where a plain split's forward "
                                  "has ended (the cloud computes the loss there), so it would never run. Add it "
                                  "before split() (in the cloud's factory too), keep it outside the Sequential, or cut "
                                  "a U-shape (rejoin=) so the layers after the cloud half run on the edge")

    def refuse_swapped(self) -> None:
        """``torch.utils.swap_tensors(p, t)`` on a cloud tensor swaps its contents past every torch function a
        placeholder sees (the model's object would become an edge tensor the cloud never hears of): refused."""
        for placeholder, made, twin in self._placeholders:
            if type(placeholder) is not made:
                names = {id(t): f"{name}.{key}" for name, stage in zip(self.chain.names, self.chain.stages)
                         for key, t in (*stage.named_parameters(), *stage.named_buffers())}
                raise ConfigError(f"cloud tensor {names.get(id(twin), '?')!r} was swapped for another "
                                  "tensor (torch.utils.swap_tensors) after split(): the cloud half keeps its own, so "
                                  "training would silently differ from the unsplit model. Load new values with "
                                  "model.load_state_dict() or `with torch.no_grad(): p.copy_(t)`, or swap before split()")

    def refuse_hooks_above_the_cut(self, split_model: nn.Module) -> None:
        """A plain split: the model and the containers that hold the cut run their forwards on the
        edge only up to the cut, so a forward or backward hook on them would never see their output
        (the cloud computes it with the loss): refused at the forward, however it was registered,
        on ``split_model`` too (what ``split()`` returned, whose output is the cut's activation)."""
        holders = [("the split model", split_model), ("the model", self._model)] + [
            (name, module) for name, in_cloud, _, _, module in self._links if not in_cloud]
        for where, module in holders:
            for table in ("_forward_hooks", "_backward_hooks", "_backward_pre_hooks"):
                if any(not library_hook(h) for h in getattr(module, table).values()):
                    raise CutError(f"a {table.strip('_').replace('_', ' ')[:-1]} on {where!r}: a plain split runs its "
                                   "forward on the edge only up to the cut (the cloud computes the rest with the loss), "
                                   "so the hook would never see its output; register it on an edge module, use "
                                   "model.predict(x) for the output, or cut a U-shape (rejoin=)")

    def refuse_replacing(self, target: str) -> None:
        """``set_submodule(target)`` would replace (part of) a module that runs in the cloud."""
        name = target.removeprefix("model.")
        for cloud in self.chain.names:
            if name == cloud or name.startswith(cloud + ".") or cloud.startswith(name + "."):
                raise ConfigError(f"set_submodule({target!r}) would replace (part of) {cloud!r}, which runs in the "
                                  "cloud; change the model before split()")

    def refuse_batch_statistics(self, micro_batches: int) -> None:
        """Micro-batches run the cloud half on pieces of the batch: a BatchNorm there that
        normalizes by batch statistics would use each piece's, and the step would not be the
        unsplit model's. Refused before anything is sent; in eval mode (running statistics) it is exact."""
        if micro_batches == 1:
            return
        for name, module in self._batchnorms:
            if module.training or not module.track_running_stats:
                raise ConfigError(f"micro_batches={micro_batches} would run {name} ({type(module).__name__}) in the "
                                  "cloud on each micro-batch's statistics, not the batch's, so training would differ "
                                  "from the unsplit model. Use micro_batches=1 with this cut, or cut after the "
                                  "BatchNorm layers")


#: An attribute a cloud module's forward makes, which it did not have at the cut.
_NOT_YET = object()


def _twin(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A copy of ``module``'s tree of modules holding the tensors ``memo`` maps its own to. Only
    the modules are copied: every other attribute (a config, a dict the model's forward shares with
    the module, a plain tensor) is the same object, but functions over them (:mod:`.twin_closures`)."""
    if id(module) in memo:
        return memo[id(module)]
    twin = memo[id(module)] = object.__new__(type(module))  # not copy.copy: a parametrized layer refuses it
    state = twin.__dict__
    state.update(module.__dict__)
    state["_parameters"] = {k: memo.get(id(v), v) for k, v in module._parameters.items()}
    state["_buffers"] = {k: memo.get(id(v), v) for k, v in module._buffers.items()}
    state["_modules"] = {k: None if v is None else _twin(v, memo) for k, v in module._modules.items()}
    for key, value in module.__dict__.items():
        if key.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called")) and isinstance(value, dict):
            state[key] = copy.copy(value)  # hooks registered on one of the two later are not on both
    weight_refs.point_twin(twin)
    return twin


#: Makes the placeholder of a cloud tensor, given the tensor and its name in the unsplit model.
Placeholder = Callable[[torch.Tensor, str], torch.Tensor]


def _meta_placeholder(tensor: torch.Tensor, name: str) -> torch.Tensor:
    meta = torch.empty_like(tensor, device="meta")
    return nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta


def _cloud_tensors(stages: Chain) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of the cloud modules, once each, by its name in the unsplit model."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, module in zip(stages.names, stages.stages):
        for key, tensor in itertools.chain(module.named_parameters(prefix=name), module.named_buffers(prefix=name)):
            if id(tensor) not in seen:
                seen.add(id(tensor))
                found[key] = tensor
    return found


def ghost(module: nn.Module, standin: nn.Module, *, never_run: tuple[str, ...] = (),
          before: Callable[[], None] | None = None) -> nn.Module:
    """Make ``module`` (whose tensors are placeholders now) the edge's ghost of a cloud module.

    It keeps its class, submodules and parameter names; its forward is ``standin``'s.
    ``.to(device)`` leaves it alone (where the cloud half runs is the cloud's business); a cast
    to another dtype raises, since the cloud half would not follow. Hooks that would never run
    are refused when registered: any on its submodules (their code runs in the cloud), and the
    kinds ``never_run`` names on the module itself. ``before`` runs at each call, before the standin
    (the first cloud module's refuses a config setting the cloud's modules read that changed).
    """
    state = module.__dict__  # instance attributes, set past nn.Module.__setattr__ (standin is not a submodule)

    @torch.compiler.disable  # torch.compile(model) compiles the edge's layers; a ghost's call and checks run as they are
    def forward(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            before()
        if standin.training != module.training:  # a standin has no children: its own flag is its mode
            standin.train(module.training)
        return standin(*args, **kwargs)

    def extra_repr() -> str:  # print(model): where it runs, then its settings as its class prints them
        try:
            own = type(module).extra_repr(module)
        except Exception:  # noqa: BLE001 — a repr that reads values: where it runs says enough
            own = ""
        return ", ".join(filter(None, (standin.extra_repr(), own)))

    state.update(forward=forward, extra_repr=extra_repr, _splitft_standin=standin)
    for key, sub in module.named_modules():
        where = f"{standin_name(module)}.{key}" if key else standin_name(module)
        sub.__dict__["_apply"] = casts_refused(sub, where)
        sub.__dict__.update({hook: refused_hook(where, hook) for hook in (HOOKS if key else never_run)})
        if isinstance(sub, parametrize.ParametrizationList):  # reading a parametrized weight computes it
            sub.__dict__["forward"] = _refused_parametrized(where, [f"{where}.{n}" for n in sub._parameters])
        elif key:  # the cloud runs the ghost's module whole: one of its layers called alone would run here, on nothing
            sub.__dict__["forward"] = _refused_call(where, standin_name(module))
        sub.__dict__.update({hook: refused_state_hook(where, hook) for hook in STATE_HOOKS})
        sub.__dict__["_splitft_where"] = where
        for table in TABLES:  # add_module, register_buffer, Sequential.append write these directly
            sub.__dict__[table] = _FixedTable(sub.__dict__[table], where, table)
        for name, value in list(sub.__dict__.items()):
            if isinstance(value, GENERATORS):  # the twin keeps the generator itself
                sub.__dict__[name] = _CloudGenerator(where, name)
        # what its forward keeps as it runs (self.calls += 1) changes in the cloud alone: no stale copy here
        kept = {name: sub.__dict__.pop(name, _NOT_YET) for name in own_attributes_kept_by_forward(type(sub))
                if not isinstance(sub.__dict__.get(name), _CloudGenerator)  # (or that it makes: self.aux_loss = ...)
                and name not in sub._buffers and name not in sub._parameters}  # a buffer is read from the cloud
        if kept:
            sub.__dict__["_splitft_kept"] = kept
        sub.__class__ = ghost_class(type(sub))
    return module


class _CloudGenerator:
    """Stands on a ghost for a generator its module draws from (``self.gen = torch.Generator()``):
    the cloud's module draws from its own, so the edge's could only be read stale or seeded in vain."""

    def __init__(self, where: str, name: str) -> None:
        self._where, self._name = where, name

    def __getattr__(self, attribute: str) -> Any:
        raise CutError(f"{self._name!r} of {self._where!r} is the generator that module draws from in the cloud: "
                       f"{attribute} here would act on the edge's copy, not on the cloud's, which has drawn since (split "
                       "training would silently differ). Seed it where the model is built, which the cloud's factory runs too")

    def __repr__(self) -> str:
        return f"<the generator {self._name!r} of {self._where!r}, in the cloud>"


class _FixedTable(dict):
    """A ghost's table of children, parameters or buffers: what the cloud's module has, unchangeable.
    ``add_module``, ``register_buffer``, ``register_parameter`` and the containers' ``append``, ``insert``,
    ``extend`` and ``update`` write the table directly, past ``__setattr__``: each refuses, like setting
    an attribute (the cloud's module would not change with it)."""

    def __init__(self, entries: dict, where: str, table: str) -> None:
        super().__init__(entries)
        self.where, self.table = where, table

    def _refuse(self, *args: Any, **kwargs: Any) -> Any:
        kind = {"_modules": "submodules", "_parameters": "parameters", "_buffers": "buffers"}[self.table]
        named = args[0] if args and isinstance(args[0], str) else None
        swapped = "" if self.table == "_modules" or named is None or named not in self else (
            " (torch.func.functional_call with tensors for the cloud's parameters or buffers swaps them in for one "
            "forward: change the weights themselves, p.copy_(t) under torch.no_grad(), or cut so that the layers "
            "it swaps stay on the edge)")
        if self.table != "_modules" and named is not None and named not in self:
            swapped = f" (register_{kind[:-1]}({named!r}, ...), as a profiler that counts into every module does)"
        raise CutError(f"changing the {kind} of {self.where!r}{swapped}: that module runs in the cloud, built by the "
                       "factory, and would not change with it (split training would silently differ). Change the model "
                       "before split(), and the cloud's factory the same way; mid-training, change the values "
                       "instead (pruning as torch.nn.utils.prune would: w[w.abs() <= threshold] = 0 under "
                       "torch.no_grad(), and p.grad[mask] = 0 after each backward), or take the model whole with "
                       "model.unsplit()")

    def __setitem__(self, name: str, value: Any) -> None:
        if self.get(name, self) is not value:  # the same object again changes nothing (functional_call of its own)
            self._refuse(name, value)

    __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse


_GHOST_ATTRIBUTES = ("forward", "_apply", "extra_repr", "_splitft_standin", "_splitft_where", "_splitft_state",
                     "_splitft_notes", *HOOKS, *STATE_HOOKS)


def _refused_parametrized(where: str, originals: list[str]) -> Callable[..., Any]:
    layer, _, name = where.rpartition(".parametrizations.")
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CutError(f"reading {name!r} of {layer!r} on the edge: its parametrization computes it from the cloud "
                       "half's tensors as the layer runs, in the cloud (spectral_norm's power iteration updating "
                       f"its vectors). Read what it is computed from ({', '.join(originals)}, under torch.no_grad()), "
                       "or take the model whole with model.unsplit()")
    return refuse


def _refused_call(where: str, whole: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CutError(f"the model's forward called {where!r} on its own, a part of {whole!r}, which runs in the cloud "
                       f"whole at its own call (a forward that walks into its children, for block in {whole}: ...): "
                       f"cut at the parts instead ({where!r} and its siblings as the cut's modules), or call "
                       f"{whole!r} itself")
    return refuse


def standin_of(module: nn.Module) -> nn.Module | None:
    """The stand-in behind a ghost installed by :func:`install` (None for any other module)."""
    return module.__dict__.get("_splitft_standin")


def standin_name(module: nn.Module) -> str:
    standin = standin_of(module)
    names = getattr(standin, "cloud_names", None) or [getattr(standin, "cloud_name", "?")]
    return names[0]


def uninstall(model: nn.Module, chain: Chain) -> nn.Module:
    """Undo :func:`install`: the ghosts become the cloud modules again, with ``chain``'s values.

    The placeholders take their values back in place, so every reference a script holds (the
    model, a layer, an optimizer's parameters) is whole and trained again.
    """
    if _swap_all(chain.swapped) is not None:  # a placeholder still referenced elsewhere: put the twins in place
        for name, module in zip(chain.names, chain.stages):
            parent, _, child = name.rpartition(".")
            setattr(_module(model, parent), child, module)
        return model
    chain.swapped = []
    for name in chain.names:
        for sub in _module(model, name).modules():
            sub.__dict__.update({k: v for k, v in sub.__dict__.pop("_splitft_kept", {}).items()
                                 if v is not _NOT_YET})  # as they were at the cut
            for attribute in _GHOST_ATTRIBUTES:
                sub.__dict__.pop(attribute, None)
            for table in TABLES:
                sub.__dict__[table] = dict(sub.__dict__[table])
            if isinstance(sub, Ghost):
                object.__setattr__(sub, "__class__", type(sub).__mro__[2])  # the model's own class, behind Ghost
    weight_refs.restore(_module(model, name) for name in chain.names)
    return model


def _swap_all(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> str | None:
    """Swap the contents of each pair of tensors (all of them, or none); why it could not, or None."""
    done = 0
    try:
        for a, b in pairs:
            torch.utils.swap_tensors(a, b)
            done += 1
    except RuntimeError as exc:
        for a, b in pairs[:done]:
            torch.utils.swap_tensors(a, b)
        return str(exc)
    return None


def _signature(module: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


__all__ = ["Ghosts", "ghost", "install", "standin_name", "standin_of", "uninstall"]
