"""Layers the cloud half cannot hold, refused by ``split()`` before the model is touched."""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from ..code_reads import other_generators
from ..cut import Chain
from ..errors import CutError
from ..global_writes import globals_written
from .ghost_classes import ghost_class

#: torch's old weight reparametrizations: a forward pre-hook computes the weight from its parts.
_HOOKED_NORMS = (WeightNorm, SpectralNorm)


def refuse_unsupported_layers(stages: Chain) -> None:
    """Layers the cloud half cannot hold, refused before the model is touched: an embedding with
    ``sparse=True`` (its gradient would be a sparse tensor, which neither crosses the cut nor reads
    as one on the edge), a layer pruned by ``torch.nn.utils.prune`` (its ``weight`` is computed
    from ``weight_orig`` by a hook, a graph that holds the parameter), and so one with torch's old
    ``weight_norm`` or ``spectral_norm`` (the parametrizations of the same name run in the cloud), and
    a sparse parameter or buffer (weights travel as dense arrays)."""
    for name, stage in zip(stages.names, stages.stages):
        for key, module in stage.named_modules():
            where = f"{name}.{key}" if key else name
            if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.sparse:
                raise CutError(f"{where!r} ({type(module).__name__}(sparse=True)) would run in the cloud, whose "
                               "gradients are dense tensors: build it with sparse=False (and a dense optimizer in "
                               "place of SparseAdam), or cut so that it stays on the edge")
            pruned = [hook for hook in module._forward_pre_hooks.values() if isinstance(hook, prune.BasePruningMethod)]
            if pruned:
                raise CutError(f"{where!r} is pruned with torch.nn.utils.prune ({pruned[0]._tensor_name} is computed "
                               f"from {pruned[0]._tensor_name}_orig by a hook), which the cloud half cannot hold: make "
                               f"the pruning permanent with prune.remove(module, {pruned[0]._tensor_name!r}) before "
                               "split() and in the factory, or cut so that the layer stays on the edge")
            drawn = None if type(module).__module__.startswith("torch.") else other_generators(type(module))
            drawn = drawn or next(filter(None, map(_helper_draws, module.__dict__.values())), None)
            if drawn is not None:
                raise CutError(f"{where!r} ({type(module).__name__}) draws from a generator of its own process as it "
                               f"runs ({drawn}: Python's random or NumPy's global generator), which in the cloud's "
                               "process is another, where torch's generator is carried across the cut: its draws "
                               "would differ from the unsplit model's. Draw with torch (torch.rand(()) < p, "
                               "torch.randint), or cut so that the layer stays on the edge")
            _refuse_global_writes(where, module)
            hooked = [type(h).__name__ for h in module._forward_pre_hooks.values() if isinstance(h, _HOOKED_NORMS)]
            if hooked:
                how = "weight_norm" if hooked[0] == "WeightNorm" else "spectral_norm"
                raise CutError(f"{where!r} has torch.nn.utils.{how}, the old one that computes the weight in a "
                               "forward pre-hook, which a cloud layer cannot run: build the model (and the cloud's "
                               f"factory) with torch.nn.utils.parametrizations.{how}, which the cloud half runs")
            sparse = next((k for k, t in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]
                           if t is not None and t.layout != torch.strided), None)
            if sparse is not None:
                raise CutError(f"{where}.{sparse} is a sparse tensor (a fixed graph's adjacency for torch.sparse.mm), "
                               "which the cloud half cannot hold: its weights travel as dense arrays. Keep it dense "
                               "(torch.mm computes the same product), or cut so that the layer stays on the edge")
            _refuse_unstandable(where, module)


def _refuse_global_writes(where: str, module: nn.Module) -> None:
    """A layer whose forward writes module-level values (``global CALLS; CALLS += 1``,
    ``LOG.append(x)``): in the cloud those are the cloud process's, and the script's would silently
    keep what they hold now."""
    written = () if type(module).__module__.startswith("torch.") else globals_written(type(module))
    if written:
        names = ", ".join(written)
        raise CutError(f"{where!r} ({type(module).__name__}) writes {names} as it runs (a module-level value it "
                       "rebinds or changes in place): in the cloud half that would be the cloud process's copy, and "
                       "this process's would silently keep what it holds now, where unsplit it follows the layer. "
                       "Keep what the layer counts or collects on the layer as a buffer (self.register_buffer(...), "
                       "updated in place: the split model reads it back from the cloud), gather it on the edge from "
                       "the model's outputs, or cut so that the layer stays on the edge")


def _helper_draws(value: object) -> str | None:
    """Where a plain object of the script's own class that a module holds (a stochastic-depth
    helper, ``self.dropper.drop()``) draws from a generator of its process, or None."""
    cls = type(value)
    if isinstance(value, (nn.Module, torch.Tensor)) or cls.__module__ in ("builtins", "random") \
            or cls.__module__.split(".")[0] in ("torch", "numpy", "transformers", "peft"):
        return None
    drawn = other_generators(cls)
    return f"{cls.__name__}: {drawn}" if drawn is not None else None


def _refuse_unstandable(where: str, module: nn.Module) -> None:
    """A cloud module the edge cannot stand in for, refused before anything is changed: a
    TorchScript module (its tensors are not the Python module's), or one whose class cannot take
    the stand-in class (a base with ``__slots__``, such as ``abc.ABC``, listed before nn.Module)."""
    if isinstance(module, torch.jit.ScriptModule):
        raise CutError(f"{where!r} is a TorchScript module (torch.jit.script or torch.jit.trace), whose tensors the edge "
                       "cannot turn into stand-ins of the cloud's: split the model as written in Python (script it "
                       "after training), or cut so that it stays on the edge")
    cls = type(module)
    try:
        probe = object.__new__(cls)
        object.__setattr__(probe, "__class__", ghost_class(cls))
    except TypeError:
        base = next((b for b in cls.__mro__ if "__slots__" in vars(b) and not issubclass(b, nn.Module)
                     and b is not object), None)
        owner = next((c for c in cls.__mro__ if base in c.__bases__), cls)
        slotted = base.__name__ if base is not None else "a base with __slots__"
        raise CutError(f"{where!r} ({cls.__name__}) cannot be stood in for on the edge: its class lists {slotted} before "
                       f"nn.Module among its bases (class {owner.__name__}({slotted}, nn.Module)), which gives its "
                       f"objects a layout the edge's stand-in class cannot take. List nn.Module first ({slotted} "
                       "second behaves alike), or cut so that the layer stays on the edge") from None


def refuse_ties(model: nn.Module, stages: Chain, tensors: dict[str, torch.Tensor]) -> None:
    """A tensor the edge's modules share with the cloud's (tied weights across the cut), or share
    memory with (a weight made as a view of another, ``dec.weight = nn.Parameter(enc.weight.t())``;
    ``.data`` assigned from another), would be trained twice, apart: refused before anything is cut."""
    cloud = {id(t): name for name, t in tensors.items()}
    memory = {_memory(t): name for name, t in tensors.items() if _memory(t)}
    prefixes = tuple(f"{name}." for name in stages.names)
    for key, tensor in itertools.chain(model.named_parameters(remove_duplicate=False),
                                       model.named_buffers(remove_duplicate=False)):
        other = cloud.get(id(tensor)) or memory.get(_memory(tensor) or -1)
        if other is not None and not key.startswith(prefixes):
            raise CutError(f"{key!r} runs on the edge but is the same tensor as {other!r}, or shares its memory, and "
                           f"{other!r} runs in the cloud (tied weights across the cut); the two halves would train "
                           "it apart. Cut so that both modules are on the same side")


def _memory(tensor: torch.Tensor) -> int:
    """Where ``tensor``'s values start in memory (0 for none: a meta tensor, an empty one)."""
    if tensor.device.type == "meta" or tensor.layout != torch.strided:
        return 0
    storage = tensor.untyped_storage()
    return storage.data_ptr() if storage.nbytes() else 0


__all__ = ["refuse_ties", "refuse_unsupported_layers"]
