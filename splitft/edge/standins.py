"""The edge's stand-ins for the cloud's modules: where the edge's forward hands over to the cloud.

A plain split stops the edge's forward at the cut (:class:`CutPoint` raises :class:`CutReached`
with what crosses; later cloud modules are :class:`Unreachable`). A U-shape trunk's first module
(:class:`TrunkEntry`) sends what the model passes to it and returns what the cloud's trunk
returned; the following ones (:class:`TrunkFollower`) check that the model's forward feeds them as
the cloud will, and pass the trunk's output along (an inner module's, which the edge never sees,
as a :class:`~splitft.edge.intermediate.TrunkIntermediate`).
"""

from __future__ import annotations

import inspect
import threading
import weakref
from contextvars import ContextVar
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .audit import attribute_tensors, audit_trunk, out_of_memory
from ..wire.coding import flatten, is_cache
from ..cut import Chain, stream
from ..errors import CutError, UnfinishedForwardError
from ..generator_state import host_state
from .intermediate import hand_over


#: Set while a split model's forward runs: the cut is where that forward stops; reached outside of
#: one, a cloud module was called directly.
FORWARDING: ContextVar[bool] = ContextVar("splitft_forwarding", default=False)


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
        if not FORWARDING.get():
            raise CutError(f"{self.cloud_name!r} runs in the cloud and was called outside the split model's forward "
                           "(on its own, or through the wrapped model): call the split model, model(x) for the "
                           "activation at the cut or model.predict(x) for the whole model's output")
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


_NESTED = ("the model's forward {why} (torch.nn.TransformerEncoder built with enable_nested_tensor=True, its "
           "default, evaluated with a src_key_padding_mask). Turn that path off where its layers are split, as "
           "for the unsplit model you compare with: encoder.use_nested_tensor = False (or "
           "torch.backends.mha.set_fastpath_enabled(False) around evaluation), or cut at the whole encoder")


def _nested_path(encoder: nn.TransformerEncoder, kwargs: dict) -> bool:
    """Whether ``encoder`` would turn its input into a nested tensor for its layers, unsplit (the
    conditions of its fast path that its first layer's placeholders do not decide otherwise)."""
    first = encoder.layers[0]
    return bool(getattr(encoder, "use_nested_tensor", False) and not first.training
                and kwargs.get("src_key_padding_mask") is not None and torch.backends.mha.get_fastpath_enabled()
                and not torch.is_autocast_enabled()
                and not (torch.is_grad_enabled() and any(p.requires_grad for p in first.parameters())))


class TrunkEntry(nn.Module):
    """U-shape: the first trunk module. Calls ``remote`` with its inputs, returns the trunk output.

    Before the first call crosses, it checks what would cross: values that cannot (a cache
    object, say) are refused with the argument's name, and, when ``probe`` is given, the trunk
    is run once on the edge to make sure it reads nothing that does not cross
    (:func:`splitft.edge.audit.audit_trunk`). The probe is then dropped, so the edge keeps no copy of
    the cloud's weights.
    """

    def __init__(self, names: list[str], remote: Callable[..., Any], signature: inspect.Signature | None = None,
                 probe: Chain | None = None, *, whole: bool = False) -> None:
        super().__init__()
        self.cloud_names = names
        self.whole = whole  # the cloud's chain hands each module the one before's output whole (see Chain)
        self._remote = remote
        self._signature = signature
        self._probe = [probe] if probe is not None else []  # a list: not a submodule, not a parameter
        self._attributes = attribute_tensors(probe) if probe is not None else []
        self.last: Any = None  # the trunk's output
        self.handed: Any = None  # what the trunk module the forward called last handed back to it
        self.call_rest: tuple[tuple, dict] = ((), {})
        #: In a run of the trunk not yet finished: the index of the trunk module the forward called last.
        self.reached: int | None = None
        self.run_thread: int | None = None  # the thread whose forward the run under way belongs to
        self._run_training = False  # whether that run was in training mode
        self.context: tuple = ()  # what the first module's call ran under (grad mode, autocast)
        #: Whether the trunk drew random numbers in its training-mode forwards (None: not known yet).
        self.draws: Callable[[], bool | None] = lambda: None
        self.rng_after: torch.Tensor | None = None  # the edge's generator after a drawing trunk ran
        #: Whether a trunk layer in training mode keeps running statistics (batch norm).
        self.keeps_statistics: Callable[[], bool] = lambda: False
        self.region: Any = None  # the torch.utils.checkpoint region the first module's call ran in
        #: The nn.TransformerEncoder whose first layer this trunk begins with (in a list: no submodule).
        self.encoder: list[nn.TransformerEncoder] = []

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        refuse_another_thread(self)
        self.run_thread = threading.get_ident()
        self.last = self.handed = None
        if not args and len(self.cloud_names) > 1:
            raise CutError(
                f"the model's forward calls the trunk's first module {self.cloud_names[0]!r} with keyword arguments "
                f"only ({', '.join(sorted(kwargs))}): the cloud runs the trunk as a chain, handing each module the "
                "previous one's output as its first positional argument. Pass the hidden state positionally "
                "(layer(h, mask=m)), or cut a trunk of one module")
        if self.encoder and _nested_path(self.encoder[0], kwargs):
            raise CutError(_NESTED.format(why="would compute its layers on a nested tensor made from the padding "
                                              "mask (its fast path, in evaluation), where the layers in the cloud "
                                              "would get the padded one, and round otherwise"))
        caching = False
        for label, value in _labelled(args, kwargs, self._signature):
            if is_cache(value):  # a key/value cache stays in the cloud: its number crosses
                caching = True
            else:  # raises naming what cannot cross
                if isinstance(value, nn.utils.rnn.PackedSequence):
                    raise CutError(f"the model's forward hands {self.cloud_names[0]!r} a PackedSequence ({label}), "
                                   "which crosses the cut as a plain tuple of its tensors, not as one: keep the "
                                   "packing and the recurrent layer that takes it on the same side (the layer on "
                                   "the edge, or pack and unpack inside a module of the trunk)")
                leaves, _ = flatten(value, where=f"{label} of {self.cloud_names[0]!r}")
                if any(leaf.is_nested for leaf in leaves):
                    raise CutError(_NESTED.format(why=f"hands {self.cloud_names[0]!r} a nested tensor ({label}), "
                                                      "which cannot cross the cut"))
        if self._probe and not caching:  # (checked at the first call without a cache, which it would fill)
            probe = self._probe.pop()
            try:
                audit_trunk(probe, args, kwargs, names=self.cloud_names, attributes=self._attributes,
                            training=self.training)
            except Exception as exc:
                if out_of_memory(exc):  # a smaller batch may follow: check the cut with it
                    self._probe.append(probe)
                raise
            self._attributes = []
        # Kept for the followers' check; a cache only by a weak reference, so that it is freed (in the
        # cloud too) when the model that made it lets it go.
        # Containers copied and tensors with their version: a follower's check sees what changed in place.
        self.call_rest = (_snapshot(args[1:]),
                          {k: _WeakCache(weakref.ref(v)) if is_cache(v) else _snapshot(v) for k, v in kwargs.items()})
        self.context, self.region = run_context(), checkpoint_region()
        self.last = self._remote(*args, **kwargs)
        self.reached, self._run_training = (0 if len(self.cloud_names) > 1 else None), self.training
        # Unsplit, a draw between trunk modules falls between their dropout masks; here they are all drawn now.
        self.rng_after = host_state() if self.reached == 0 and self.training and self.draws() else None
        if len(self.cloud_names) == 1:
            return self.finished()
        # An inner module's output is not what the cloud returns: the forward may pass it on, not read it.
        self.handed = hand_over(self.last, self.cloud_names[0], self.cloud_names)
        return self.handed

    def finished(self) -> Any:
        """The trunk's output, at the end of its run: kept no longer, nor the call's arguments, so
        the step's graph goes when the script lets it go (unsplit nothing holds it; a graph held
        keeps each weight's gradient accumulator, with the shape it had, past a resize)."""
        out, self.last, self.handed, self.call_rest = self.last, None, None, ((), {})
        return out

    def refuse_unfinished(self, could_change: Callable[[], bool]) -> None:
        """Refuse a run of the trunk the forward left unfinished, where it could have changed the
        cloud half: the first module's call ran the whole trunk in the cloud, while unsplit only the
        modules called would have run (their batch-norm statistics, their dropout draws). Asked
        before every request: once refused, always, the cloud half being apart from unsplit."""
        refuse_another_thread(self)  # another thread's run under way is not left unfinished
        reached = self.reached
        if reached is None or not (self._run_training and could_change()):
            self.reached = None
            return
        names = self.cloud_names
        raise UnfinishedForwardError(
            f"a run of the trunk {names[0]!r}..{names[-1]!r} in training mode was left unfinished (called up to "
            f"{names[reached]!r}, not {names[reached + 1]!r}): the first module's call runs the whole trunk in the "
            "cloud, so its batch-norm statistics or dropout draws moved as if every module had run, where unsplit "
            "only the modules called would have; the cloud half no longer matches the unsplit model, so this split "
            "session refuses every request from now on. Call the trunk's modules one after another to its end "
            "(a lone trunk module only in eval mode), and start again from a checkpoint")

    def explain(self, exc: TypeError) -> None:
        """A ``TypeError`` out of the model's forward mid-trunk, where an inner module handed it the
        trunk's output as a tuple in place of its own (a tensor): torch refuses the tuple before
        :class:`~splitft.edge.intermediate.TrunkIntermediate` can say why. Raised as what it is."""
        handed, reached, names = self.handed, self.reached, self.cloud_names
        if handed is None or reached is None or isinstance(handed, torch.Tensor):
            return
        raise CutError(f"the model's forward failed ({exc}) on what {names[reached]!r} returned: that inner module "
                       f"of the trunk {names[0]!r}..{names[-1]!r}, which runs in the cloud, hands on the trunk's "
                       f"output (a {type(handed).__name__}) in place of its own, since only the trunk's last output "
                       "comes back; the forward may pass it to the next trunk module, not compute with it. Cut so "
                       f"that {names[reached]!r} ends the trunk (rejoin at the module after it), or move what reads "
                       "it after the trunk") from exc

    def extra_repr(self) -> str:
        return f"runs in the cloud: {', '.join(self.cloud_names)}"


class TrunkFollower(nn.Module):
    """U-shape: a later trunk module. The trunk already ran; pass its output on.

    The cloud feeds every trunk module the previous one's output and the *first* module's other
    arguments, so this checks the model's forward really does that; anything else would make
    the cloud compute something different from the model.
    """

    def __init__(self, name: str, entry: TrunkEntry, index: int) -> None:
        super().__init__()
        self.cloud_name = name
        self.index = index  # its place in the trunk (the entry is 0)
        self.is_last = index == len(entry.cloud_names) - 1
        self._entry = [entry]  # a list, so the entry is not registered twice as a submodule

    def forward(self, first: Any, *args: Any, **kwargs: Any) -> Any:
        entry = self._entry[0]
        refuse_another_thread(entry)
        self._refuse_out_of_order(entry)
        if entry.rng_after is not None and not torch.equal(host_state(), entry.rng_after):
            raise CutError(
                f"the model's forward drew random numbers on the edge before calling {self.cloud_name!r} (a per-layer "
                "torch.rand, as LayerDrop draws even at layerdrop=0), while the trunk draws its dropout masks in the "
                "cloud, all at the first module's call: unsplit the draws interleave with the masks, here they would "
                "not. Draw before or after the trunk, or run the trunk without dropout")
        if checkpoint_region() is not entry.region and entry.training and entry.keeps_statistics():
            raise CutError(
                f"the model's forward calls {self.cloud_name!r} in another torch.utils.checkpoint region than the "
                f"trunk's first module {entry.cloud_names[0]!r} (a checkpoint per layer) while the trunk keeps "
                "batch-norm statistics in training: unsplit, the backward recomputes each region's layers, moving "
                "their statistics again; the cloud runs the trunk once. Checkpoint the whole model, or the edge's "
                "layers only")
        if run_context() != entry.context:
            raise CutError(
                f"the model's forward calls {self.cloud_name!r} under another grad mode or autocast than the trunk's "
                f"first module {entry.cloud_names[0]!r} (torch.set_grad_enabled, torch.no_grad or torch.autocast "
                "switched per layer): the cloud runs the whole trunk at the first module's call, under what that "
                "call ran under. Switch them around the whole trunk, or cut where they switch")
        handed = entry.handed
        if handed is not None and first is handed and not entry.whole and stream(handed) is not handed:
            raise CutError(
                f"the model's forward feeds {self.cloud_name!r} the whole tuple the previous trunk module returned, "
                "where the cloud's chain hands on its first element (as a loop over decoder layers takes their "
                "hidden states): the trunk would compute something else. Pass the first element on, or cut a "
                "trunk of one module")
        if handed is None or (first is not handed and first is not stream(handed)):
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
                f"trunk module {entry.cloud_names[0]!r} ({difference}, or changed in place since); the cloud gives "
                "every trunk module the first one's arguments, so it would compute something else. Choose a trunk "
                "whose modules share their extra arguments (or a trunk of one module)"
            )
        if self.is_last:
            entry.reached = None
            return entry.finished()
        entry.handed = hand_over(entry.last, self.cloud_name, entry.cloud_names)
        entry.reached = self.index
        return entry.handed

    def _refuse_out_of_order(self, entry: TrunkEntry) -> None:
        """The cloud ran every trunk module once, in order, at the first one's call: a forward that
        skips, repeats or reorders them (LayerDrop) computes something else."""
        reached, names = entry.reached, entry.cloud_names
        if reached == self.index - 1:
            return
        if reached is None:
            what = f"called {self.cloud_name!r} outside a run of the trunk, which starts at {names[0]!r}"
        elif reached >= self.index:
            what = f"called {self.cloud_name!r} again or out of order, after {names[reached]!r}"
        else:
            skipped = ", ".join(map(repr, names[reached + 1:self.index]))
            what = f"skipped {skipped} (called {self.cloud_name!r} after {names[reached]!r})"
        raise CutError(
            f"the model's forward {what}: the cloud runs the trunk {names[0]!r}..{names[-1]!r} as one chain, every "
            "module once and in order, at the first module's call (which has run), so it computed something else "
            "than this forward. A forward that skips, repeats or reorders trunk layers (LayerDrop: set the model's "
            "layerdrop to 0) cannot be cut there: choose a trunk the forward always runs whole, or a trunk of "
            "one module")

    def extra_repr(self) -> str:
        return f"runs in the cloud: {self.cloud_name}"


def refuse_another_thread(entry: TrunkEntry) -> None:
    """Refuse a trunk module's call from another thread than the forward whose run of the trunk
    is under way: the runs of two threads would interleave in the one chain the cloud runs."""
    if entry.reached is not None and entry.run_thread != threading.get_ident():
        raise CutError("the trunk of this U-shape split model was called from two threads at once (a validation "
                       "thread beside training, a pool of inference threads): the cloud runs the trunk as one chain "
                       "per forward, and their runs would interleave. Call the model from one thread at a time (a "
                       "threading.Lock around model(x)), or give each thread a split model of its own")


def checkpoint_region() -> Any:
    """The non-reentrant ``torch.utils.checkpoint`` region a call runs in (its saved-tensor hook;
    None: none), told apart by identity: each region hooks the tensors it saves with its own."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    return None if hooks is None else hooks[0]


def run_context() -> tuple:
    """What a module's call runs under that the cloud takes from the trunk's first call: the grad
    mode and each device's autocast (on, and to which dtype)."""
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            *((torch.is_autocast_enabled(device), torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")))


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


@dataclass(frozen=True)
class _Versioned:
    """A tensor argument as the first trunk module's call saw it: the object, and its version then."""

    tensor: torch.Tensor
    version: int


def _snapshot(value: Any) -> Any:
    """``value`` with its tuples, lists and dicts copied and its tensors versioned."""
    if isinstance(value, torch.Tensor):
        try:
            return _Versioned(value, value._version)
        except Exception:  # noqa: BLE001 — a tensor without a version of its own: compared as the object
            return value
    if isinstance(value, (tuple, list)) and type(value) in (tuple, list):
        return type(value)(_snapshot(v) for v in value)
    if type(value) is dict:
        return {k: _snapshot(v) for k, v in value.items()}
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, _WeakCache):
        return a.ref() is b
    if isinstance(a, _Versioned):
        return a.tensor is b and b._version == a.version
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


__all__ = ["CutPoint", "CutReached", "TrunkEntry", "TrunkFollower", "Unreachable"]
