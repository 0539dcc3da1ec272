"""The optimizer classes a cloud builds for an edge, by the name the wire carries.

An edge names its optimizer's class and the cloud builds its own copy: the cloud runs no code an
edge sends, so the names are a closed list. ``torch.optim``'s classes go by their own names
(``"Adam"``); a few optimizers of well-kept libraries that scripts reach for go by a dotted name
(``"transformers.Adafactor"``: ``Trainer(optim="adafactor")``) and carry the library's version,
which the cloud's must equal: a step in another release is not the same arithmetic.
"""

from __future__ import annotations

import importlib
import importlib.metadata

import torch

from .errors import ConfigError

#: Optimizers of other libraries: wire name → (module, class, distribution whose version must match).
#: Each steps every parameter from its gradient and its own state alone, with no closure.
LIBRARY_OPTIMIZERS: dict[str, tuple[str, str, str]] = {
    "transformers.Adafactor": ("transformers.optimization", "Adafactor", "transformers"),
}


def wire_name(cls: type) -> str | None:
    """The name the cloud builds ``cls`` by, or None when it is not one it can build."""
    if cls.__module__.startswith("torch.optim") and getattr(torch.optim, cls.__name__, None) is cls:
        return cls.__name__
    for name, (module, attribute, _) in LIBRARY_OPTIMIZERS.items():
        if cls.__module__ == module and cls.__qualname__ == attribute:
            return name
    return None


def library_version(name: str) -> str | None:
    """The installed version of the library a wire name's optimizer comes from (None: torch.optim's)."""
    entry = LIBRARY_OPTIMIZERS.get(name)
    if entry is None:
        return None
    try:
        return importlib.metadata.version(entry[2])
    except importlib.metadata.PackageNotFoundError:
        return None


def optimizer_class(name: object, version: object = None) -> type[torch.optim.Optimizer]:
    """The class a wire name stands for, checked: a ``torch.optim`` optimizer, or one of
    :data:`LIBRARY_OPTIMIZERS` whose library is installed here at ``version``."""
    if not isinstance(name, str):
        raise ConfigError(f"an optimizer's name is a str, got {type(name).__name__}")
    entry = LIBRARY_OPTIMIZERS.get(name)
    if entry is None:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            known = ", ".join(LIBRARY_OPTIMIZERS)
            raise ConfigError(f"{name[:80]!r} is not a torch.optim optimizer nor one of {known}")
        return cls
    module, attribute, library = entry
    installed = library_version(name)
    if installed is None:
        raise ConfigError(f"this cloud cannot build {name}: {library} is not installed here")
    if installed != version:
        raise ConfigError(f"the edge steps {name} of {library} {str(version)[:40]}, this cloud has {installed}: "
                          f"a step in another release is not the same arithmetic; install {library}=={installed} on "
                          "the edge, or the edge's version here")
    found = getattr(importlib.import_module(module), attribute)
    assert issubclass(found, torch.optim.Optimizer), found
    return found


__all__ = ["LIBRARY_OPTIMIZERS", "library_version", "optimizer_class", "wire_name"]
