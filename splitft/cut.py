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
catch tensors it reads through any other channel (:mod:`splitft.edge.audit`).
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from . import config_reads
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


def _children(module: nn.Module) -> list[str]:
    """The names of ``module``'s children, each place once, in order: ``nn.Sequential`` calls a
    module object put in two places (``act = nn.ReLU()`` reused) at both, where torch's
    ``named_children()`` lists it once, under its first name."""
    return [name for name, child in module._modules.items() if child is not None]


def _child_index(model: nn.Module, parent: str, child: str) -> int:
    names = _children(_module(model, parent))
    if child not in names and child.lstrip("-").isdigit() and -len(names) <= int(child) < len(names):
        return int(child) % len(names)  # an index into a container whose children have names
    if child not in names:
        _module(model, _join(parent, child))  # raises with close matches
        raise CutError(f"{_join(parent, child)!r} is not a direct child of {parent or 'the model'!r}")
    return names.index(child)


def _refuse_alias(model: nn.Module, parent: str) -> None:
    """A container reached through another name than its own (peft's ``PeftModel`` hands on
    attribute reads to the model it wraps): the model's parameters go by its own name, so the cut's
    names would not be theirs. Its own name is the one to cut at."""
    if not parent:
        return
    held = _module(model, parent)
    own = next((name for name, module in model.named_modules() if module is held), None)
    if own is not None and own != parent:
        raise CutError(f"{parent!r} reaches {own!r} by another name (an attribute the model hands on to the one it "
                       f"wraps, as peft's PeftModel does): the parameters go by {own!r}; cut there")


def parse_cut(model: nn.Module, cut: str | int, rejoin: str | int | None = None) -> CutSpec:
    """Resolve user cut names against ``model``; errors name what exists."""
    cut = str(cut)
    _refuse_alias(model, (cut.partition(":")[0]).rpartition(".")[0])
    if ":" in cut:
        if rejoin is not None:
            raise CutError(f"cut {cut!r} already gives the trunk as a slice; drop rejoin={rejoin!r}")
        where, _, stop_text = cut.partition(":")
        parent, _, start_name = where.rpartition(".")
        start = _child_index(model, parent, start_name)
        count = len(_children(_module(model, parent)))
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
    names = _children(_module(model, spec.parent))
    cut = _join(spec.parent, names[spec.start])
    if spec.stop is None:
        return cut, None
    if spec.stop < len(names):
        return cut, _join(spec.parent, names[spec.stop])
    return f"{cut}:{spec.stop}", None  # the trunk runs to the end of its container: no module to rejoin at


def cloud_module_names(model: nn.Module, spec: CutSpec) -> list[str]:
    """Dotted names of the modules the cloud runs, in call order."""
    names = _children(_module(model, spec.parent))
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
        siblings = _children(_module(model, parent))
        chain += [_join(parent, n) for n in siblings[siblings.index(child) + 1:]]
        path = parent


def stream(value: Any) -> Any:
    """What a module passes on to the next one in a chain: the first element of a tuple."""
    return value[0] if isinstance(value, (tuple, list)) else value


class Chain(nn.Module):
    """Modules called one after another, keeping their dotted names from the original model.

    ``whole``: each module takes the one before's output as it is, as ``nn.Sequential`` passes
    it (a GRU's ``(output, state)`` to the layer after it); else the first element of a tuple, as
    a model's loop over its decoder layers takes their hidden states.
    """

    def __init__(self, named: list[tuple[str, nn.Module]], *, whole: bool = False) -> None:
        super().__init__()
        self.names = [n for n, _ in named]
        self.stages = nn.ModuleList(m for _, m in named)
        self.whole = whole
        #: (placeholder, twin holding the values) of each tensor :func:`install` turned into a placeholder.
        self.swapped: list[tuple[torch.Tensor, torch.Tensor]] = []

    def forward(self, first: Any, *args: Any, **kwargs: Any) -> Any:
        out = first
        for i, stage in enumerate(self.stages):
            out = stage(out if i == 0 or self.whole else stream(out), *args, **kwargs)
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
    """The cloud part of ``model`` as a :class:`Chain` (shares the modules, copies nothing): its
    modules take what the one before returned whole where ``nn.Sequential``'s forward calls them
    (every container above a plain cut is one)."""
    parent = _module(model, spec.parent)
    whole = not spec.ushape or (isinstance(parent, nn.Sequential) and type(parent).forward is nn.Sequential.forward)
    names = cloud_module_names(model, spec)
    _refuse_reused(model, names)
    return Chain([(name, _module(model, name)) for name in names], whole=whole)


def _refuse_reused(model: nn.Module, cloud: list[str]) -> None:
    """Refuse a module object of the cloud half that the model also holds at another place (a
    layer instance put in two places, ``act = nn.ReLU()`` reused): the edge keeps a stand-in for
    each cloud module, which would stand in at the other place too, and the cloud half's modules are
    run one place at a time."""
    places: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        places.setdefault(id(module), []).append(name)
    for root in cloud:
        for inner, module in _module(model, root).named_modules(prefix=root, remove_duplicate=False):
            other = next((p for p in places[id(module)] if p != root and not p.startswith(root + ".")), None)
            if other is not None:
                raise CutError(
                    f"{inner!r}, which runs in the cloud, is the same module object as {other!r} (one instance put "
                    f"in two places, as `act = nn.ReLU()` reused in an nn.Sequential): the cloud half runs its "
                    "modules one place at a time, and the edge's stand-in of it would stand in at the other place "
                    "too. Give each place its own instance (nn.ReLU() in each), in the model and in the cloud's "
                    "factory")


def fingerprint(chain: Chain) -> str:
    """Hash of the cloud part's parameter/buffer names, shapes, dtypes and memory layouts (the
    strides of one that is not contiguous, as ``model.to(memory_format=torch.channels_last)`` leaves
    a convolution's weight, whose kernels then sum in another order), and which parameters are one
    (``head.weight = embed.weight``: tied in the model and not by the factory, the cloud would train
    two): same architecture?"""
    digest = hashlib.sha256()
    for key, value in sorted(chain.qualified_state_dict().items()):
        layout = "" if value.is_contiguous() else f":{value.stride()}"
        digest.update(f"{key}:{tuple(value.shape)}:{value.dtype}{layout};".encode())
    first: dict[int, str] = {}
    for name, stage in zip(chain.names, chain.stages):
        for key, param in stage.named_parameters(prefix=name, remove_duplicate=False):
            if first.setdefault(id(param), key) != key:
                digest.update(f"{key}={first[id(param)]};".encode())
    return digest.hexdigest()[:16]


def structure(chain: Chain) -> dict[str, str]:
    """A hash of each cloud module's ``repr`` and the config settings its code reads as it runs:
    its layers and their settings (a dropout's ``p``, a norm's ``eps``, the attention kernel),
    which the parameter fingerprint does not see, by the module's name."""
    return {name: hashlib.sha256(_described(name, stage).encode()).hexdigest()[:16]
            for name, stage in zip(chain.names, chain.stages)}


def _described(name: str, stage: nn.Module) -> str:
    settings = config_reads.values([(name, stage)])
    return repr(stage) + (f"\nconfig settings read: {settings}" if settings else "")


def check_structure(chain: Chain, theirs: dict) -> None:
    """Refuse a cloud half whose modules differ from the ones the edge cut (``theirs``: its :func:`structure`)."""
    for name, digest in structure(chain).items():
        if theirs.get(name) != digest:
            stage = chain.stages[chain.names.index(name)]
            shown = repr(stage)[:400]
            settings = config_reads.values([(name, stage)])
            raise CutError(f"the cloud's {name!r} differs from the edge's model (a layer replaced, a setting such "
                           "as a dropout's p changed on one side, a config setting it reads as it runs, such as "
                           "the attention implementation, or the code its layers run patched in the edge's process, "
                           "such as a class's forward replaced): the cloud builds it"
                           + (f" with the config settings {settings}, and" if settings else "") +
                           f" as {shown}. Make the same change in the cloud's factory, or leave the model as the "
                           "factory builds it")


def value_hash(chain: Chain) -> str:
    """Hash of the cloud part's values: do both sides start from the same weights?"""
    digest = hashlib.sha256()
    for key, value in sorted(chain.qualified_state_dict().items()):
        digest.update(key.encode())
        digest.update(value.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())  # bfloat16 too
    return digest.hexdigest()[:16]


__all__ = ["Chain", "CutSpec", "check_structure", "cloud_module_names", "cut_text", "extract", "fingerprint",
           "parse_cut", "stream", "structure", "value_hash"]
