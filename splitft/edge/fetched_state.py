"""The cloud half's entries of ``model.state_dict()``: values fetched once, standing for live tensors.

Unsplit, ``model.state_dict()`` holds tensors that share the parameters' and buffers' memory: a
write into one changes the model, and one kept without a copy (``best = model.state_dict()``)
goes on reading the live weights as training moves them. Split, a cloud entry is the value the
cloud sent at that moment, so both would silently part from the unsplit run. Each is a
:class:`FetchedCloudState` instead: a plain tensor in every other respect (``torch.save``,
safetensors, ``copy.deepcopy`` and ``clone()`` see an ordinary tensor) that refuses, with a
:class:`~splitft.errors.ConfigError` naming the fix, a write into it and any read after the cloud
half may have changed, where unsplit it would read something else. What aliases it (``.detach()``,
``.data``, a view, ``copy.copy``) is one too; ``.numpy()`` gives a read-only copy, and DLPack is
refused. ``unsplit()`` makes each one still current the whole model's memory, as unsplit it was.

``opt.state_dict()`` is alike: unsplit, its entries are the optimizer's own moments (torch's
``load_state_dict`` even keeps them shared), so ``best = opt.state_dict()`` kept without a copy
and loaded after training changes nothing, where a fetched copy would rewind the cloud's moments.
Its cloud entries are :class:`FetchedCloudState` too, described by :data:`OPTIMIZER_STATE`.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import ConfigError
from ..wire import tree as trees

#: What reads nothing a training step changes: a stale entry still answers these as unsplit.
_HARMLESS = {getattr(torch.Tensor, name).__get__ for name in (
    "shape", "dtype", "device", "ndim", "layout", "requires_grad", "is_cuda", "is_cpu", "is_meta", "is_sparse")}
_HARMLESS |= {torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.nelement, torch.Tensor.__len__,
              torch.Tensor.__hash__, torch.Tensor.element_size, torch.Tensor.is_floating_point,
              torch.Tensor.is_complex, torch.Tensor.stride, torch.Tensor.is_contiguous}


#: What hands the values to numpy: a read-only copy here, where unsplit it is the model's memory.
_TO_NUMPY: set[Callable[..., Any]] = {torch.Tensor.numpy, torch.Tensor.__array__}


@dataclass(frozen=True)
class StateSource:
    """Which state dict an entry came from, in the words its refusals use."""

    call: str  # what the script called: "model.state_dict()"
    owner: str  # whose memory it shares unsplit: "the model"
    write_instead: str  # how to change the value instead, ``{name}`` the entry's name


MODEL_STATE = StateSource(
    "model.state_dict()", "the model",
    "Write to the model's tensor itself (with torch.no_grad(): model.get_parameter({name!r}).mul_(...), or "
    "get_buffer), or load a changed copy with model.load_state_dict(...)")
OPTIMIZER_STATE = StateSource(
    "opt.state_dict()", "the optimizer",
    "Load a changed copy with opt.load_state_dict(...); to give another optimizer the same state, load "
    "copy.deepcopy(opt.state_dict()) into it")


class FetchedCloudState(torch.Tensor):
    """The value of the cloud half's tensor ``name`` as fetched when the cloud half stood at
    ``moment`` (what ``now()`` returned then), an entry of the state dict ``source`` describes."""

    _splitft_name: str
    _splitft_moment: Hashable
    _splitft_now: Callable[[], Hashable]
    _splitft_source: StateSource
    _splitft_live = False  # the model's own memory since unsplit(): an ordinary tensor from then on

    @staticmethod
    def __new__(cls, value: torch.Tensor, name: str, now: Callable[[], Hashable],
                moment: Hashable | None = None, source: StateSource = MODEL_STATE) -> FetchedCloudState:
        made = torch.Tensor._make_subclass(cls, value)
        made._splitft_name = name
        made._splitft_now = now
        made._splitft_moment = now() if moment is None else moment
        made._splitft_source = source
        return made

    def same_moment(self, value: torch.Tensor) -> FetchedCloudState:
        """``value`` (an alias of this entry) as an entry of the same name, moment and source."""
        return FetchedCloudState(value, self._splitft_name, self._splitft_now, self._splitft_moment,
                                 self._splitft_source)

    def follow(self, tensor: torch.Tensor) -> None:
        """Become ``tensor``'s memory (the whole model's, after ``unsplit()``), as unsplit it was."""
        with torch._C.DisableTorchFunctionSubclass():
            self.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
        self._splitft_live = True

    def _refuse_stale(self) -> None:
        if not self._splitft_live and self._splitft_now() != self._splitft_moment:
            call = self._splitft_source.call
            raise ConfigError(
                f"a tensor of {call} (the cloud half's {self._splitft_name!r}) is used after the cloud half changed "
                "(a forward in training mode, a backward, an optimizer step, a load or unsplit() since): unsplit, "
                f"{call} shares {self._splitft_source.owner}'s memory, so it would hold the values of now; split, it "
                f"holds those fetched then. Take {call} again where you use it; to keep a moment's values (a best "
                f"checkpoint), keep copy.deepcopy({call}), which is a copy both ways")

    def _refuse_written(self) -> None:
        source = self._splitft_source
        raise ConfigError(
            f"a tensor of {source.call} (the cloud half's {self._splitft_name!r}) was written in place: unsplit that "
            f"changes {source.owner}'s own tensor, which it shares memory with; split, it is a copy fetched from the "
            "cloud. " + source.write_instead.format(name=self._splitft_name))

    @classmethod
    def __torch_function__(cls, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        fetched = [t for t in trees.leaves((args, kwargs)) if isinstance(t, FetchedCloudState) and not t._splitft_live]
        if not fetched:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func not in _HARMLESS:
            for t in fetched:
                t._refuse_stale()
        if func is torch.Tensor.__dlpack__:
            first = fetched[0]
            raise ConfigError(f"sharing the memory of a tensor of {first._splitft_source.call} (the cloud half's "
                              f"{first._splitft_name!r}) through DLPack: unsplit that is {first._splitft_source.owner}'s "
                              "own memory; split, a copy fetched from the cloud. Share a clone(), which is a copy both ways")
        if any(getattr(type(t), "_splitft_placeholder", False) for t in trees.leaves((args, kwargs))):
            return _beside_placeholders(func, args, kwargs, fetched)
        with torch._C.DisableTorchFunctionSubclass():
            if func in _TO_NUMPY:  # an array of the values that refuses writes: unsplit it is the model's memory
                array = func(*args, **kwargs).copy()
                array.flags.writeable = False
                return array
            versions = [t._version for t in fetched]
            out = func(*args, **kwargs)
            for t, version in zip(fetched, versions):
                if t._version != version:
                    t._refuse_written()
            return trees.rebuild(out, lambda r, path: _aliased(r, fetched), other=lambda node, path: node)

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]  # torch's: unannotated
        self._refuse_stale()
        with torch._C.DisableTorchFunctionSubclass():
            return repr(torch.Tensor._make_subclass(torch.Tensor, self))

    def __copy__(self) -> torch.Tensor:  # copy.copy(t): unsplit, another tensor over the same memory
        self._refuse_stale()
        with torch._C.DisableTorchFunctionSubclass():
            alias = self.detach()
        return alias if self._splitft_live else self.same_moment(alias)

    def __deepcopy__(self, memo: dict) -> torch.Tensor:
        self._refuse_stale()
        with torch._C.DisableTorchFunctionSubclass():
            copied = self.clone()
        memo[id(self)] = copied
        return copied

    def __reduce_ex__(self, protocol: Any) -> Any:  # torch.save, pickle: an ordinary tensor of the values
        self._refuse_stale()
        with torch._C.DisableTorchFunctionSubclass():
            return torch.Tensor._make_subclass(torch.Tensor, self).__reduce_ex__(protocol)


def _beside_placeholders(func: Callable, args: tuple, kwargs: dict, fetched: list[FetchedCloudState]) -> Any:
    """A call on fetched values and a cloud tensor's placeholder together (``torch.cat([p.grad.view(-1),
    q.grad])``, ``q.grad`` of a bias being its own flattening): the placeholder answers it, with
    the values as a plain tensor; a write into them is refused as any write is."""
    with torch._C.DisableTorchFunctionSubclass():
        plain = {id(t): t.detach() for t in fetched}  # the same memory and version counter
    versions = [t._version for t in fetched]
    args, kwargs = trees.rebuild((args, kwargs), lambda t, path: plain.get(id(t), t), other=lambda node, path: node)
    out = func(*args, **kwargs)
    for t, version in zip(fetched, versions):
        if t._version != version:
            t._refuse_written()
    return out


def _aliased(result: torch.Tensor, fetched: list[FetchedCloudState]) -> torch.Tensor:
    """``result`` as a fetched entry when it shares memory with one (a view, ``detach()``, a no-op
    ``.to()``), else as it is: a copy is the script's own."""
    if isinstance(result, FetchedCloudState) or not fetched or result.layout != torch.strided:
        return result
    pointer = result.untyped_storage().data_ptr()
    source = next((t for t in fetched if t.untyped_storage().data_ptr() == pointer), None)
    if source is None or type(result) is not torch.Tensor:
        return result
    return source.same_moment(result)


__all__ = ["MODEL_STATE", "OPTIMIZER_STATE", "FetchedCloudState", "StateSource"]
