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
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .audit import attribute_tensors, audit_trunk
from .coding import flatten, is_cache
from .errors import CutError


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

    def load_qualified_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        expected = self.qualified_state_dict()
        if set(state) != set(expected):
            missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
            raise CutError(f"cloud weights do not match the cut: missing {missing[:5]}, unexpected {extra[:5]}")
        with torch.no_grad():
            for key, target in expected.items():
                source = state[key]
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
        self.last: Any = None
        self.call_rest: tuple[tuple, dict] = ((), {})

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.last = None
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
        return self.last

    def extra_repr(self) -> str:
        return f"runs in the cloud: {', '.join(self.cloud_names)}"


class TrunkFollower(nn.Module):
    """U-shape: a later trunk module. The trunk already ran; pass its output on.

    The cloud feeds every trunk module the previous one's output and the *first* module's other
    arguments, so this checks the model's forward really does that; anything else would make
    the cloud compute something different from the model.
    """

    def __init__(self, name: str, entry: TrunkEntry) -> None:
        super().__init__()
        self.cloud_name = name
        self._entry = [entry]  # a list, so the entry is not registered twice as a submodule

    def forward(self, first: Any, *args: Any, **kwargs: Any) -> Any:
        entry = self._entry[0]
        last = entry.last
        if last is None or (first is not last and first is not _stream(last)):
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
        return last

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
            check: bool = True) -> Chain:
    """Replace the cloud modules of ``model`` with stand-ins; return them as a Chain.

    ``remote`` is what the U-shape entry calls; plain splits stop at a :class:`CutPoint`.
    ``check`` (U-shape) runs the trunk once on the edge at the first call to make sure it reads
    nothing that does not cross the cut (see :mod:`splitft.audit`).

    Each stand-in is installed as a *ghost* of the module it replaces (see :func:`ghost`): the
    model's tree keeps its classes, submodules and parameter names, so scripts that walk it
    (optimizer groups by name, freezing a layer) see the cloud half where it was.
    """
    chain = extract(model, spec)
    entry: TrunkEntry | None = None
    memo: dict[int, Any] = {}  # one copy memo for all ghosts: modules shared between them stay shared
    for i, (name, original) in enumerate(zip(chain.names, chain.stages)):
        parent, _, child = name.rpartition(".")
        if spec.ushape:
            if i == 0:
                if remote is None:
                    raise CutError("a U-shape cut needs a remote callable for its trunk")
                entry = TrunkEntry(chain.names, remote, _signature(chain.stages[0]), chain if check else None)
                standin: nn.Module = entry
            else:
                assert entry is not None
                standin = TrunkFollower(name, entry)
        else:
            standin = CutPoint(name) if i == 0 else Unreachable(name)
        setattr(_module(model, parent), child, ghost(original, standin, memo))
    return chain


def ghost(module: nn.Module, standin: nn.Module, memo: dict[int, Any] | None = None) -> nn.Module:
    """A copy of ``module`` whose tensors live on the ``meta`` device and whose forward is ``standin``'s.

    It has the original's class, submodules and parameter names (and each parameter's
    ``requires_grad``), but no memory: the values are in the cloud. ``.to(device)`` leaves it
    alone (where the cloud half runs is the cloud's business); a cast to another dtype raises,
    since the cloud half would not follow.
    """
    memo = {} if memo is None else memo
    for tensor in itertools.chain(module.parameters(), module.buffers()):
        if id(tensor) not in memo:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    copied = copy.deepcopy(module, memo)
    state = copied.__dict__  # instance attributes, set past nn.Module.__setattr__ (standin is not a submodule)

    def forward(*args: Any, **kwargs: Any) -> Any:
        standin.train(copied.training)
        return standin(*args, **kwargs)

    def apply(fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
        for dtype in {t.dtype for t in itertools.chain(copied.parameters(), copied.buffers())}:
            if fn(torch.empty(0, dtype=dtype)).dtype != dtype:
                raise CutError(f"casting the model to another dtype would cast {standin_name(copied)!r}, which runs "
                               "in the cloud and does not follow; cast the model before split()")
        return copied

    state.update(forward=forward, _apply=apply, extra_repr=standin.extra_repr, _splitft_standin=standin)
    return copied


def standin_of(module: nn.Module) -> nn.Module | None:
    """The stand-in behind a ghost installed by :func:`install` (None for any other module)."""
    return module.__dict__.get("_splitft_standin")


def standin_name(module: nn.Module) -> str:
    standin = standin_of(module)
    names = getattr(standin, "cloud_names", None) or [getattr(standin, "cloud_name", "?")]
    return names[0]


def uninstall(model: nn.Module, chain: Chain) -> nn.Module:
    """Undo :func:`install`: put the cloud modules of ``chain`` back in place of their stand-ins."""
    for name, module in zip(chain.names, chain.stages):
        parent, _, child = name.rpartition(".")
        setattr(_module(model, parent), child, module)
    return model


def _signature(module: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None
