"""Checking that a U-shape trunk reads nothing the cloud will not have.

The cloud runs the trunk from a fresh copy of the model, fed only with what crosses the cut. A
trunk is *accounted for* when every tensor it reads is one of these:

* a value the edge passes to the first trunk module (it crosses the cut),
* a parameter or buffer of the trunk (the cloud has its own),
* a tensor attribute the trunk's modules already had when the cut was made (the cloud's factory
  builds the same), or
* something the trunk computed from the above.

Anything else is a tensor the edge computed and the trunk reaches some other way: through a
closure, a shared object or dict the edge's forward writes to, a global. In the cloud it would be
missing or stale, and training would silently differ from local training. :func:`audit_trunk`
runs the trunk once on the edge, on copies of the values that cross, and watches every tensor
operation; a read of a tensor outside the list above is a :class:`~splitft.errors.CutError`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from ..wire import tree as trees
from ..wire.coding import flatten, unflatten
from ..errors import CutError
from ..generator_state import host_state_kept

log = logging.getLogger(__name__)

_SCAN_DEPTH = 3  # how deep into lists/tuples/dicts held as module attributes tensors are looked for


def attribute_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors held as plain attributes (not parameters or buffers) by ``module`` and its children.

    Taken when the cut is made: these are the ones the cloud's factory builds too.
    """
    found: list[torch.Tensor] = []
    for sub in module.modules():
        for name, value in vars(sub).items():
            if name not in ("_parameters", "_buffers", "_modules"):
                found.extend(trees.leaves(value, max_depth=_SCAN_DEPTH))
    return found


class _Watch(TorchFunctionMode):
    """Records tensor operations whose inputs are not known to be available in the cloud."""

    def __init__(self, known: set[int]) -> None:
        super().__init__()
        # Ids only, no references: a foreign tensor is alive for the whole run (something outside
        # holds it), so its id cannot be reused by an intermediate freed during the run.
        self.known = known
        self.foreign: list[str] = []

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        for value in trees.leaves((args, kwargs)):
            if id(value) not in self.known:
                self.known.add(id(value))  # report each tensor once
                name = getattr(func, "__qualname__", None) or getattr(func, "__name__", repr(func))
                self.foreign.append(f"{name}() read a {str(value.dtype).removeprefix('torch.')} tensor "
                                    f"of shape {tuple(value.shape)}")
        out = func(*args, **kwargs)
        self.known.update(id(value) for value in trees.leaves(out))
        return out


def audit_trunk(trunk: nn.Module, args: tuple, kwargs: dict, *, names: list[str],
                attributes: list[torch.Tensor], training: bool) -> None:
    """Run ``trunk(*args, **kwargs)`` on copies of what crosses; raise if it reads anything else.

    The run uses no gradient and a forked RNG, and puts the buffers back afterwards (running
    statistics move in train mode), so it changes neither the edge's random stream nor any state
    the trunk's weights are pushed from: split training still equals local training.
    """
    leaves, skeleton = flatten((list(args), kwargs))
    copies = [t.detach().clone() for t in leaves]
    c_args, c_kwargs = unflatten(skeleton, copies)
    known = {id(t) for t in copies}
    known.update(id(t) for t in trunk.parameters())
    known.update(id(t) for t in trunk.buffers())
    known.update(id(t) for t in attributes)
    buffers = {name: b.detach().clone() for name, b in trunk.named_buffers()}
    was_training = trunk.training
    watch = _Watch(known)
    try:
        trunk.train(training)
        with host_state_kept(), torch.no_grad(), watch:
            trunk(*c_args, **c_kwargs)
    except Exception as exc:
        if out_of_memory(exc):
            raise  # the batch, not the cut: unsplit the same forward runs out of memory too
        raise CutError(
            f"the trunk {_span(names)}, run as the cloud runs it (each module gets the previous one's "
            f"output and the other arguments of {names[0]!r}), fails: {type(exc).__name__}: {exc}. "
            "Choose a trunk whose modules are called one after another with the same extra arguments; what one "
            "returns is passed on whole in an nn.Sequential, else its first element if it is a tuple, and as it is "
            "otherwise (a dict the loop reads an entry of, r['h'], is not): a trunk of one module takes any output"
        ) from exc
    finally:
        trunk.train(was_training)
        with torch.no_grad():
            for name, b in trunk.named_buffers():
                b.copy_(buffers[name])  # undo running-statistics updates of this extra run
    if watch.foreign:
        listing = "; ".join(watch.foreign[:3]) + (f"; and {len(watch.foreign) - 3} more" if len(watch.foreign) > 3 else "")
        raise CutError(
            f"the trunk {_span(names)} reads tensors that do not cross "
            f"the cut: {listing}. They are neither arguments of {names[0]!r}, nor weights of the trunk, "
            "nor computed by it: the edge's forward hands them over some other way (a closure, a shared "
            "object or dict, an attribute set after the cut was made), and the cloud would not have them. "
            f"Pass them as arguments of {names[0]!r}, or cut elsewhere. If they are constants the cloud's "
            "factory builds too (a module-level tensor), pass check_cut=False to skip this check."
        )
    log.debug("trunk %s reads only what crosses the cut", names)


def out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` is a forward running out of memory (torch's error, or its message)."""
    return isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc)


def _span(names: list[str]) -> str:
    return f"{names[0]}..{names[-1]}" if len(names) > 1 else names[0]
