"""Cutting a model: which modules run in the cloud, and how the edge hands over to them.

A cut names the first module that runs in the cloud (a dotted name such as ``"layer2"`` or
``"encoder.layer.3"``, or an index into an ``nn.Sequential``).

* **plain split** (no ``rejoin``): the cloud runs everything from the cut to the end and computes
  the loss. Every container above the cut must be an ``nn.Sequential``, since that is the only
  forward that is known to be "call the children in order".
* **U-shape** (``rejoin`` names a later sibling, or ``cut="parent.3:6"`` slices a container):
  the cloud runs a run of consecutive siblings, the *trunk*, and the edge takes over again.

The model's own ``forward`` keeps running on the edge; the cloud's modules are replaced by small
stand-ins. In U-shape the first stand-in sends whatever the model passes to it (several tensors
may cross: hidden states and an attention mask, say) and returns what the cloud's trunk returned;
the following stand-ins return that same result. The cloud runs the trunk as a :class:`Chain`:
each module gets the previous one's output (its first element, for tuples) as first argument and
the remaining arguments of the first call unchanged, which is how Sequential, ModuleList loops
in transformers, and ResNet stages call their children.

What crosses must therefore account for everything the trunk reads. The stand-ins check it:
arguments that cannot cross (a cache object) are refused by name, later trunk modules must get
the first one's extra arguments, and at the first call the trunk is run once on the edge to
catch tensors it reads through any other channel (:mod:`splitft.audit`).
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import inspect
import itertools
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .audit import attribute_tensors, audit_trunk
from .coding import flatten, is_cache
from .errors import CutError
from .intermediate import hand_over


@dataclass(frozen=True)
class CutSpec:
    """Where the cloud part starts and, for U-shape, where the edge takes over again."""

    parent: str  # dotted name of the container of the first cloud module ("" for the root)
    start: int  # index of the first cloud module among the parent's children
    stop: int | None  # index of the first edge module after the trunk; None: plain split

    @property
    def ushape(self) -> bool:
        return self.stop is not None


def _join(parent: str, child: str) -> str:
    return f"{parent}.{child}" if parent else child


def _module(model: nn.Module, name: str) -> nn.Module:
    if not name:
        return model
    try:
        return model.get_submodule(name)
    except AttributeError:
        known = [n for n, _ in model.named_modules() if n]
        close = difflib.get_close_matches(name, known, n=3, cutoff=0.5)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        listing = ", ".join(n for n in known if "." not in n)
        raise CutError(f"the model has no module named {name!r}{hint} (top-level modules: {listing})") from None


def _child_index(model: nn.Module, parent: str, child: str) -> int:
    names = [n for n, _ in _module(model, parent).named_children()]
    if child not in names and child.lstrip("-").isdigit() and -len(names) <= int(child) < len(names):
        return int(child) % len(names)  # an index into a container whose children have names
    if child not in names:
        _module(model, _join(parent, child))  # raises with close matches
        raise CutError(f"{_join(parent, child)!r} is not a direct child of {parent or 'the model'!r}")
    return names.index(child)


def parse_cut(model: nn.Module, cut: str | int, rejoin: str | int | None = None) -> CutSpec:
    """Resolve user cut names against ``model``; errors name what exists."""
    cut = str(cut)
    if ":" in cut:
        if rejoin is not None:
            raise CutError(f"cut {cut!r} already gives the trunk as a slice; drop rejoin={rejoin!r}")
        where, _, stop_text = cut.partition(":")
        parent, _, start_name = where.rpartition(".")
        start = _child_index(model, parent, start_name)
        count = len(list(_module(model, parent).children()))
        try:
            stop = int(stop_text) if stop_text else count
        except ValueError:
            raise CutError(f"cut slice {cut!r}: the end after ':' must be an index, got {stop_text!r}") from None
        if not start < stop <= count:
            raise CutError(f"cut slice {cut!r} is empty or runs past the {count} children of {parent or 'the model'!r}")
        return CutSpec(parent, start, stop)
    parent, _, start_name = cut.rpartition(".")
    start = _child_index(model, parent, start_name)
    if rejoin is None:
        return CutSpec(parent, start, None)
    rejoin = str(rejoin)
    rparent, _, rname = rejoin.rpartition(".")
    if rparent != parent:
        raise CutError(
            f"rejoin {rejoin!r} must be a sibling of cut {cut!r} (both children of {parent or 'the model'!r})"
        )
    stop = _child_index(model, parent, rname)
    if stop <= start:
        raise CutError(f"rejoin {rejoin!r} must come after cut {cut!r} in {parent or 'the model'!r}")
    return CutSpec(parent, start, stop)


def cut_text(spec: CutSpec, model: nn.Module) -> tuple[str, str | None]:
    """The (cut, rejoin) names of a spec, as the handshake carries them; parse_cut reads them back."""
    names = [n for n, _ in _module(model, spec.parent).named_children()]
    cut = _join(spec.parent, names[spec.start])
    if spec.stop is None:
        return cut, None
    if spec.stop < len(names):
        return cut, _join(spec.parent, names[spec.stop])
    return f"{cut}:{spec.stop}", None  # the trunk runs to the end of its container: no module to rejoin at


def cloud_module_names(model: nn.Module, spec: CutSpec) -> list[str]:
    """Dotted names of the modules the cloud runs, in call order."""
    names = [n for n, _ in _module(model, spec.parent).named_children()]
    if spec.stop is not None:
        return [_join(spec.parent, n) for n in names[spec.start: spec.stop]]
    chain = [_join(spec.parent, n) for n in names[spec.start:]]
    path = spec.parent
    while True:
        container = _module(model, path)
        if not isinstance(container, nn.Sequential):
            raise CutError(
                f"a plain split needs every container above the cut to be an nn.Sequential, but "
                f"{path or 'the model'!r} is a {type(container).__name__}, whose forward may do more "
                "than call its children; cut it U-shape instead (give rejoin=, or cut='parent.i:j')"
            )
        if not path:
            return chain
        parent, _, child = path.rpartition(".")
        siblings = [n for n, _ in _module(model, parent).named_children()]
        chain += [_join(parent, n) for n in siblings[siblings.index(child) + 1:]]
        path = parent


def _stream(value: Any) -> Any:
    """What a module passes on to the next one in a chain: the first element of a tuple."""
    return value[0] if isinstance(value, (tuple, list)) else value


class Chain(nn.Module):
    """Modules called one after another, keeping their dotted names from the original model."""

    def __init__(self, named: list[tuple[str, nn.Module]]) -> None:
        super().__init__()
        self.names = [n for n, _ in named]
        self.stages = nn.ModuleList(m for _, m in named)
        #: (placeholder, twin holding the values) of each tensor :func:`install` turned into a placeholder.
        self.swapped: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, first: Any, *args: Any, **kwargs: Any) -> Any:
        out = first
        for i, stage in enumerate(self.stages):
            out = stage(out if i == 0 else _stream(out), *args, **kwargs)
        return out

    def qualified_state_dict(self) -> dict[str, torch.Tensor]:
        """State with the original model's names (``"block3.0.weight"``)."""
        return {
            f"{name}.{key}": value
            for name, stage in zip(self.names, self.stages)
            for key, value in stage.state_dict().items()
        }

    def qualified_parameters(self) -> dict[str, nn.Parameter]:
        """Parameters with the original model's names, each once (the edge's ghosts carry the same names)."""
        named: dict[str, nn.Parameter] = {}
        seen: set[int] = set()
        for name, stage in zip(self.names, self.stages):
            for key, param in stage.named_parameters():
                if id(param) not in seen:
                    seen.add(id(param))
                    named[f"{name}.{key}"] = param
        return named

    def qualified_modules(self) -> dict[str, nn.Module]:
        """Every module of the part (each stage and its submodules) under the original model's names."""
        return {f"{name}.{key}" if key else name: module
                for name, stage in zip(self.names, self.stages) for key, module in stage.named_modules()}

    def load_qualified_state_dict(self, state: dict[str, torch.Tensor], partial: bool = False) -> None:
        """Copy ``state`` into the part's tensors: all of them, or (``partial``) those it names."""
        expected = self.qualified_state_dict()
        missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
        if extra or (missing and not partial):
            raise CutError(f"cloud weights do not match the cut: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for key in state:
                target, source = expected[key], state[key]
                if tuple(source.shape) != tuple(target.shape):
                    raise CutError(f"weight {key!r}: expected shape {tuple(target.shape)}, got {tuple(source.shape)}")
                target.copy_(source)


def extract(model: nn.Module, spec: CutSpec) -> Chain:
    """The cloud part of ``model`` as a :class:`Chain` (shares the modules, copies nothing)."""
    return Chain([(name, _module(model, name)) for name in cloud_module_names(model, spec)])


def fingerprint(chain: Chain) -> str:
    """Hash of the cloud part's parameter/buffer names, shapes and dtypes: same architecture?"""
    digest = hashlib.sha256()
    for key, value in sorted(chain.qualified_state_dict().items()):
        digest.update(f"{key}:{tuple(value.shape)}:{value.dtype};".encode())
    return digest.hexdigest()[:16]


def structure(chain: Chain) -> dict[str, str]:
    """A hash of each cloud module's ``repr``: its layers and their settings (a dropout's ``p``,
    a norm's ``eps``), which the parameter fingerprint does not see, by the module's name."""
    return {name: hashlib.sha256(repr(stage).encode()).hexdigest()[:16] for name, stage in zip(chain.names, chain.stages)}


def check_structure(chain: Chain, theirs: dict) -> None:
    """Refuse a cloud half whose modules differ from the ones the edge cut (``theirs``: its :func:`structure`)."""
    for name, digest in structure(chain).items():
        if theirs.get(name) != digest:
            shown = repr(chain.stages[chain.names.index(name)])
            raise CutError(f"the cloud's {name!r} differs from the edge's model (a layer replaced or a setting such "
                           f"as a dropout's p changed on one side): the cloud builds {shown[:400]}. Make the same "
                           "change in the cloud's factory, or leave the model as the factory builds it")


def value_hash(chain: Chain) -> str:
    """Hash of the cloud part's values: do both sides start from the same weights?"""
    digest = hashlib.sha256()
    for key, value in sorted(chain.qualified_state_dict().items()):
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


# ---------------------------------------------------------------- edge-side stand-ins


class CutReached(Exception):
    """Raised by the plain-split stand-in to stop the edge forward at the cut."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        super().__init__("forward reached the cut")
        self.call_args = args
        self.call_kwargs = kwargs


class CutPoint(nn.Module):
    """Plain split: where the edge's forward ends. Hands its inputs to the caller."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.cloud_name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise CutReached(args, kwargs)

    def extra_repr(self) -> str:
        return f"runs in the cloud: {self.cloud_name}"


class Unreachable(nn.Module):
    """Plain split: a cloud module after the cut. The edge must never call it."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.cloud_name = name

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise CutError(f"the edge's forward called {self.cloud_name!r}, which runs in the cloud after the cut")

    def extra_repr(self) -> str:
        return f"runs in the cloud: {self.cloud_name}"


class TrunkEntry(nn.Module):
    """U-shape: the first trunk module. Calls ``remote`` with its inputs, returns the trunk output.

    Before the first call crosses, it checks what would cross: values that cannot (a cache
    object, say) are refused with the argument's name, and, when ``probe`` is given, the trunk
    is run once on the edge to make sure it reads nothing that does not cross
    (:func:`splitft.audit.audit_trunk`). The probe is then dropped, so the edge keeps no copy of
    the cloud's weights.
    """

    def __init__(self, names: list[str], remote: Callable[..., Any], signature: inspect.Signature | None = None,
                 probe: Chain | None = None) -> None:
        super().__init__()
        self.cloud_names = names
        self._remote = remote
        self._signature = signature
        self._probe = [probe] if probe is not None else []  # a list: not a submodule, not a parameter
        self._attributes = attribute_tensors(probe) if probe is not None else []
        self.last: Any = None  # the trunk's output
        self.handed: Any = None  # what the trunk module the forward called last handed back to it
        self.call_rest: tuple[tuple, dict] = ((), {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.last = self.handed = None
        caching = False
        for label, value in _labelled(args, kwargs, self._signature):
            if is_cache(value):  # a key/value cache stays in the cloud: its number crosses
                caching = True
            else:
                flatten(value, where=f"{label} of {self.cloud_names[0]!r}")  # raises naming what cannot cross
        if self._probe and not caching:  # (checked at the first call without a cache, which it would fill)
            probe = self._probe.pop()
            audit_trunk(probe, args, kwargs, names=self.cloud_names, attributes=self._attributes,
                        training=self.training)
            self._attributes = []
        # Kept for the followers' check; a cache only by a weak reference, so that it is freed (in the
        # cloud too) when the model that made it lets it go.
        self.call_rest = (args[1:], {k: _WeakCache(weakref.ref(v)) if is_cache(v) else v for k, v in kwargs.items()})
        self.last = self._remote(*args, **kwargs)
        # An inner module's output is not what the cloud returns: the forward may pass it on, not read it.
        self.handed = self.last if len(self.cloud_names) == 1 else hand_over(self.last, self.cloud_names[0],
                                                                             self.cloud_names)
        return self.handed

    def extra_repr(self) -> str:
        return f"runs in the cloud: {', '.join(self.cloud_names)}"


class TrunkFollower(nn.Module):
    """U-shape: a later trunk module. The trunk already ran; pass its output on.

    The cloud feeds every trunk module the previous one's output and the *first* module's other
    arguments, so this checks the model's forward really does that; anything else would make
    the cloud compute something different from the model.
    """

    def __init__(self, name: str, entry: TrunkEntry, *, last: bool = True) -> None:
        super().__init__()
        self.cloud_name = name
        self.is_last = last
        self._entry = [entry]  # a list, so the entry is not registered twice as a submodule

    def forward(self, first: Any, *args: Any, **kwargs: Any) -> Any:
        entry = self._entry[0]
        handed = entry.handed
        if handed is None or (first is not handed and first is not _stream(handed)):
            raise CutError(
                f"the model's forward does not feed {self.cloud_name!r} with the previous trunk "
                "module's output, so the trunk cannot run as one chain in the cloud; choose a cut "
                "whose modules are called one after another"
            )
        entry_args, entry_kwargs = entry.call_rest
        difference = _difference(entry_args, entry_kwargs, args, kwargs)
        if difference:
            raise CutError(
                f"the model's forward calls {self.cloud_name!r} with other arguments than the first "
                f"trunk module {entry.cloud_names[0]!r} ({difference}); the cloud gives every trunk module "
                "the first one's arguments, so it would compute something else. Choose a trunk whose "
                "modules share their extra arguments (or a trunk of one module)"
            )
        entry.handed = entry.last if self.is_last else hand_over(entry.last, self.cloud_name, entry.cloud_names)
        return entry.handed

    def extra_repr(self) -> str:
        return f"runs in the cloud: {self.cloud_name}"


def _labelled(args: tuple, kwargs: dict, signature: inspect.Signature | None) -> list[tuple[str, Any]]:
    """(human name, value) of each argument, named after the module's parameters when possible."""
    names: list[str] = []
    if signature is not None:
        positional = [p.name for p in signature.parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        names = [f"argument {i + 1} ({positional[i]})" for i in range(min(len(args), len(positional)))]
    names += [f"argument {i + 1}" for i in range(len(names), len(args))]
    return [*zip(names, args), *((f"keyword argument {k!r}", v) for k, v in kwargs.items())]


@dataclass(frozen=True)
class _WeakCache:
    ref: weakref.ref


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _WeakCache):
        return a.ref() is b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (tuple, list)) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if a is b:
        return True
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:  # noqa: BLE001 — an object whose == does not give a truth value: not the same
        return False


def _difference(args_a: tuple, kwargs_a: dict, args_b: tuple, kwargs_b: dict) -> str:
    """What differs between two calls' extra arguments, in words; '' when nothing does."""
    if len(args_a) != len(args_b):
        return f"{len(args_b) + 1} positional arguments instead of {len(args_a) + 1}"
    for i, (a, b) in enumerate(zip(args_a, args_b)):
        if not _same(a, b):
            return f"argument {i + 2} differs"
    if kwargs_a.keys() != kwargs_b.keys():
        return f"keyword arguments {sorted(kwargs_b)} instead of {sorted(kwargs_a)}"
    for key in kwargs_a:
        if not _same(kwargs_a[key], kwargs_b[key]):
            return f"keyword argument {key!r} differs"
    return ""


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
    :mod:`splitft.audit`).
    """
    stages = extract(model, spec)
    tensors = _cloud_tensors(stages)
    _refuse_ties(model, stages, tensors)
    make = placeholder or _meta_placeholder
    memo: dict[int, Any] = {}
    swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
    for name, tensor in tensors.items():
        twin = make(tensor, name)
        swapped.append((tensor, twin))
        memo[id(tensor)] = twin
    failure = _swap_all(swapped)  # each object the model held is its placeholder now, its twin the values
    if failure is not None:
        raise CutError(f"cannot turn the cloud half's tensors into placeholders ({failure}); split the model before "
                       "anything keeps a weak reference to its parameters")
    chain = Chain([(name, _twin(module, memo)) for name, module in zip(stages.names, stages.stages)])
    chain.swapped = swapped
    entry: TrunkEntry | None = None
    for i, (name, module) in enumerate(zip(stages.names, stages.stages)):
        if spec.ushape:
            if i == 0:
                if remote is None:
                    raise CutError("a U-shape cut needs a remote callable for its trunk")
                entry = TrunkEntry(chain.names, remote, _signature(module), chain if check else None)
                standin: nn.Module = entry
            else:
                assert entry is not None
                standin = TrunkFollower(name, entry, last=i == len(stages.names) - 1)
        else:
            standin = CutPoint(name) if i == 0 else Unreachable(name)
        # A plain split's first ghost runs its pre-hooks (then stops the forward), the others run nothing.
        never = () if spec.ushape else _HOOKS[1:] if i == 0 else _HOOKS
        ghost(module, standin, never_run=never)
    return chain


def _twin(module: nn.Module, memo: dict[int, Any]) -> nn.Module:
    """A copy of ``module``'s tree of modules holding the tensors ``memo`` maps its own to.

    Only the modules are copied: every other attribute (a config, a dict the model's forward
    shares with the module, a plain tensor) is the same object, as it was for the original.
    """
    if id(module) in memo:
        return memo[id(module)]
    twin = memo[id(module)] = copy.copy(module)
    state = twin.__dict__
    state["_parameters"] = {k: memo.get(id(v), v) for k, v in module._parameters.items()}
    state["_buffers"] = {k: memo.get(id(v), v) for k, v in module._buffers.items()}
    state["_modules"] = {k: None if v is None else _twin(v, memo) for k, v in module._modules.items()}
    for key, value in module.__dict__.items():
        if key.endswith(("hooks", "hooks_with_kwargs", "hooks_always_called")) and isinstance(value, dict):
            state[key] = copy.copy(value)  # hooks registered on one of the two later are not on both
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


def _refuse_ties(model: nn.Module, stages: Chain, tensors: dict[str, torch.Tensor]) -> None:
    """A tensor the edge's modules share with the cloud's (tied weights across the cut) would be
    trained twice, apart: refused before anything is cut."""
    cloud = {id(t): name for name, t in tensors.items()}
    prefixes = tuple(f"{name}." for name in stages.names)
    for key, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                       model.named_buffers(remove_duplicate=False)):
        if id(tensor) in cloud and not key.startswith(prefixes):
            raise CutError(f"{key!r} runs on the edge but is the same tensor as {cloud[id(tensor)]!r}, which runs in "
                           "the cloud (tied weights across the cut); the two halves would train it apart. Cut so "
                           "that both modules are on the same side")


def ghost(module: nn.Module, standin: nn.Module, *, never_run: tuple[str, ...] = ()) -> nn.Module:
    """Make ``module`` (whose tensors are placeholders now) the edge's ghost of a cloud module.

    It keeps its class, submodules and parameter names; its forward is ``standin``'s.
    ``.to(device)`` leaves it alone (where the cloud half runs is the cloud's business); a cast
    to another dtype raises, since the cloud half would not follow. Hooks that would never run
    are refused when registered: any on its submodules (their code runs in the cloud), and the
    kinds ``never_run`` names on the module itself.
    """
    state = module.__dict__  # instance attributes, set past nn.Module.__setattr__ (standin is not a submodule)

    def forward(*args: Any, **kwargs: Any) -> Any:
        standin.train(module.training)
        return standin(*args, **kwargs)

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        for dtype in {t.dtype for t in itertools.chain(module.parameters(), module.buffers())}:
            if fn(torch.empty(0, dtype=dtype)).dtype != dtype:
                raise CutError(f"casting the model to another dtype would cast {standin_name(module)!r}, which runs "
                               "in the cloud and does not follow; cast the model before split()")
        return module

    state.update(forward=forward, _apply=apply, extra_repr=standin.extra_repr, _splitft_standin=standin)
    for key, sub in module.named_modules():
        where = f"{standin_name(module)}.{key}" if key else standin_name(module)
        sub.__dict__.update({hook: _refused_hook(where, hook) for hook in (_HOOKS if key else never_run)})
        sub.__dict__["_load_from_state_dict"] = _quiet_load(sub._load_from_state_dict)
        sub.__dict__["_splitft_where"] = where
        sub.__class__ = ghost_class(type(sub))
    return module


def ghost_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` for a ghost: the same name and behaviour, but changing its attributes or children
    (``m.p = 0.0``, a layer replaced by a module walk, PEFT injecting adapters) raises, since the
    cloud's module would not change with it; and it is called plainly (a layer that checkpoints
    itself leaves that to the cloud, which computes the same values either way)."""
    if issubclass(cls, _Ghost):
        return cls
    made = _GHOST_CLASSES.get(cls)
    if made is None:
        made = _GHOST_CLASSES[cls] = type(cls.__name__, (_Ghost, cls), {"__module__": cls.__module__,
                                                                       "__qualname__": cls.__qualname__})
    return made


class _Ghost(nn.Module):
    """The mixin of :func:`ghost_class`."""

    __call__ = nn.Module.__call__

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _SETTABLE or (name.startswith("_") and name not in ("_parameters", "_buffers", "_modules")):
            super().__setattr__(name, value)
            return
        raise CutError(f"setting {name!r} of {self.__dict__.get('_splitft_where', '?')!r}: that module runs in the "
                       "cloud, built by the factory, and would not change with it (split training would silently "
                       "differ). Change the model before split(), and the cloud's factory the same way")

    def __delattr__(self, name: str) -> None:
        if name.startswith("_"):
            super().__delattr__(name)
            return
        self.__setattr__(name, None)  # refused like a change


#: What a script may set on a ghost: its mode (mirrored with each forward) and the flags with which
#: ``gradient_checkpointing_enable()`` marks every layer (the cloud's computes the same values).
_SETTABLE = {"training", "gradient_checkpointing"}
_GHOST_CLASSES: dict[type, type] = {}


def _quiet_load(load: Callable[..., Any]) -> Callable[..., Any]:
    """Loading a ghost's state reaches the cloud (a placeholder's ``copy_``); torch would warn that
    copying into a ``meta`` tensor does nothing, which is not so here."""
    def quiet(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*copying from a non-meta parameter")
            return load(*args, **kwargs)
    return quiet


_HOOKS = ("register_forward_pre_hook", "register_forward_hook", "register_full_backward_hook",
          "register_full_backward_pre_hook", "register_backward_hook")
_GHOST_ATTRIBUTES = ("forward", "_apply", "extra_repr", "_splitft_standin", "_load_from_state_dict", "_splitft_where",
                     *_HOOKS)


def _refused_hook(where: str, hook: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise CutError(f"{hook} on {where!r}: that module runs in the cloud, so the hook would never run; "
                       "register it before split() on a module that stays on the edge, or cut elsewhere")
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
            for attribute in _GHOST_ATTRIBUTES:
                sub.__dict__.pop(attribute, None)
            if isinstance(sub, _Ghost):
                sub.__class__ = sub.__class__.__mro__[2]  # the model's own class, behind _Ghost
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
