"""The classes of ghosts: a cloud module's class for the edge, which refuses what the cloud would not follow.

A ghost (:mod:`.ghosts`) keeps its class's name and behaviour through a subclass made for it here,
whose ``__setattr__`` refuses a change of its children, of an attribute its code does not read as a
plain value, or of its class, and keeps a setting its code reads (sent with the next forward). That
subclass stands for the model's own class to a script: it compares, hashes and is patched as it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from ..config_reads import MODE_ATTRIBUTES, attributes_named, flags_read, is_flag, same_setting
from ..errors import CutError


def ghost_class(cls: type[nn.Module]) -> type[nn.Module]:
    """``cls`` for a ghost: the same name and behaviour, but changing its children (a layer
    replaced by a module walk, PEFT injecting adapters) or an attribute its code does not read as
    a plain value raises, since the cloud's module would not change with it; a setting its code
    reads (``m.p = 0.0``, ``bn.momentum = None``) is kept here and sent with the next forward
    (:class:`~splitft.config_reads.ModuleFlags`). It is called plainly (a layer that checkpoints
    itself leaves that to the cloud, which computes the same values either way)."""
    if issubclass(cls, Ghost):
        return cls
    made = _CLASSES.get(cls)
    if made is None:
        meta = _METACLASSES.get(type(cls))
        if meta is None:
            meta = _METACLASSES[type(cls)] = type(type(cls).__name__, (_StandsForTheModelsClass, type(cls)), {})
        made = _CLASSES[cls] = meta(cls.__name__, (Ghost, cls), {"__module__": cls.__module__,
                                                                 "__qualname__": cls.__qualname__})
        type.__setattr__(made, "_splitft_built", True)
    return made


class _StandsForTheModelsClass(type):
    """Ghost classes' metaclass. ``type(layer)`` of a cloud layer is its ghost class, which a script
    means as the model's own class: it compares and hashes as that class (``type(m) == nn.Linear``
    in an init function, ``type(m) in (nn.Linear, nn.Conv2d)``, a dict by class), and a patch of it
    (``type(layer).forward = f``) goes there, where it reaches the edge's layers of that class as
    unsplit and where the code guard sees it. Only ``type(m) is nn.Linear`` tells them apart."""

    def __eq__(cls, other: object) -> bool:
        return other is cls or other is cls.__mro__[2]

    def __hash__(cls) -> int:
        return hash(cls.__mro__[2])

    def __setattr__(cls, name: str, value: Any) -> None:
        if _a_scripts_write(cls, name):
            setattr(cls.__mro__[2], name, value)
        else:
            super().__setattr__(name, value)

    def __delattr__(cls, name: str) -> None:
        if _a_scripts_write(cls, name):
            delattr(cls.__mro__[2], name)
        else:
            super().__delattr__(name)


def _a_scripts_write(cls: type, name: str) -> bool:
    """Whether a write of ``name`` on a ghost class is a script's: not a dunder, nor one made as the
    class was built (by a base's ``__init_subclass__``: transformers' checkpointing layers wrap ``forward``)."""
    return bool(cls.__dict__.get("_splitft_built")) and not name.startswith("__")


class Ghost(nn.Module):
    """The mixin of :func:`ghost_class`."""

    __call__ = nn.Module.__call__

    def __getattr__(self, name: str) -> Any:
        if name in self.__dict__.get("_splitft_kept", ()):
            raise CutError(f"{name!r} of {self.__dict__.get('_splitft_where', '?')!r} is kept by that module's "
                           "forward, which runs in the cloud and changes it there as it runs: the edge has no current value "
                           "(split training would silently read a stale one). Return it from the forward with its output "
                           "(a load-balancing loss: return out, aux), keep it as a buffer (register_buffer: the cloud "
                           "half's state, which the edge reads), or outside the layer")
        return super().__getattr__(name)

    def state_dict(self, *args: Any, destination: Any = None, prefix: str = "", keep_vars: bool = False) -> Any:
        out = super().state_dict(*args, destination=destination, prefix=prefix, keep_vars=keep_vars)
        served: tuple[Any, str] | None = self.__dict__.get("_splitft_state")
        if served is None or destination is not None or keep_vars or args:
            return out
        fetch = served[0]()  # its own call (not within a parent's): the values, fetched
        return out if fetch is None else fetch(out, prefix, served[1])

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__.get("_splitft_kept", ()):
            raise CutError(f"setting {name!r} of {self.__dict__.get('_splitft_where', '?')!r}: that module's forward "
                           "keeps it as it runs, in the cloud, which this value would not reach (split training would "
                           "silently differ). Set it before split(), where the cloud's factory builds the model too")
        if name == "__class__" and value is not type(self):
            raise CutError(f"changing the class of {self.__dict__.get('_splitft_where', '?')!r} to "
                           f"{getattr(value, '__name__', value)!s:.60}: that module runs in the cloud, built by the "
                           "factory, and would keep its class and code (split training would silently differ). "
                           "Change the model before split(), and the cloud's factory the same way")
        read = name in flags_read(self)
        setting = name in MODE_ATTRIBUTES or (is_flag(value) and read)
        if setting or (name.startswith("_") and name not in TABLES):
            if setting and not same_setting(self.__dict__.get(name), value):
                settings_changed()
            super().__setattr__(name, value)
            return
        if self._a_note_of_the_scripts(name, value):
            super().__setattr__(name, value)
            return
        if read and (isinstance(value, np.generic) or (isinstance(value, torch.Tensor) and value.dim() == 0)):
            raise CutError(f"setting {name!r} of {self.__dict__.get('_splitft_where', '?')!r} to a "
                           f"{type(value).__qualname__}: the cloud's copy of the layer takes the settings its code "
                           "reads as plain values (numbers, switches, names); set it as a Python number "
                           f"(float(v), int(v) or v.item())")
        statistics = (" (test-time adaptation such as TENT drops a batch norm's running statistics: in training "
                      "mode, track_running_stats = False alone normalises by the batch's statistics the same way, "
                      "and the cloud follows it)" if name in ("running_mean", "running_var") and value is None else "")
        raise CutError(f"setting {name!r} of {self.__dict__.get('_splitft_where', '?')!r}: that module runs in the "
                       "cloud, built by the factory, and would not change with it (split training would silently "
                       "differ). Change the model before split(), and the cloud's factory the same way; to change "
                       "the trained model (peft's merge_and_unload(), a layer swapped for export), take it whole "
                       f"with model.unsplit() first{statistics}")

    def _a_note_of_the_scripts(self, name: str, value: Any) -> bool:
        """A new attribute no code of a cloud layer reads (SAM's ``bn.backup_momentum = bn.momentum``,
        kept to be put back): the script's own note on the module, kept here, where only it reads it."""
        notes: set[str] = self.__dict__.setdefault("_splitft_notes", set())
        if name in notes:
            return True
        if name in self.__dict__ or hasattr(type(self), name) or isinstance(value, (nn.Module, torch.Tensor)) \
                or any(name in attributes_named(cls) for cls in list(_CLASSES)):
            return False
        notes.add(name)
        return True

    def __delattr__(self, name: str) -> None:
        if name in self.__dict__.get("_splitft_notes", ()):
            self.__dict__["_splitft_notes"].discard(name)
            super().__delattr__(name)
            return
        if name.startswith("_"):
            super().__delattr__(name)
            return
        raise CutError(f"deleting {name!r} of {self.__dict__.get('_splitft_where', '?')!r}: that module runs in the "
                       "cloud, built by the factory, and would keep it (split training would silently differ)")


_CLASSES: dict[type, type] = {}
_METACLASSES: dict[type, type] = {}

#: Changes of a cloud module's mode or of a setting its code reads, counted in every split model:
#: a plain split's ``model(x)`` ran its cloud half with the settings of its moment.
_SETTINGS_VERSION = [0]


def settings_changed() -> None:
    _SETTINGS_VERSION[0] += 1


def settings_version() -> int:
    """Moves whenever a script changes a cloud module's mode or a setting its code reads."""
    return _SETTINGS_VERSION[0]


#: A module's tables of children, parameters and buffers: a ghost's are fixed.
TABLES = ("_modules", "_parameters", "_buffers")


__all__ = ["TABLES", "Ghost", "ghost_class", "settings_changed", "settings_version"]
