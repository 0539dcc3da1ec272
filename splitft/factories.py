"""Model factories: the ``"package.module:function"`` names that edge and cloud both build a model from.

The edge builds the whole model and the cloud its part, each by calling the same factory; the
handshake carries only its name. The cloud imports only names its operator allowed, and builds a
session's half from a hello in :mod:`splitft.cloud.build`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from torch import nn

from .errors import ConfigError


def check_factory_name(name: object) -> str:
    """``name`` if it is written ``"package.module:function"``; otherwise a ConfigError saying so."""
    module_name, sep, attr = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not sep or not module_name or not attr:
        raise ConfigError(f"a model factory is written 'package.module:function', got {name!r}")
    return name  # type: ignore[return-value]


def load_factory(name: str) -> Callable[..., nn.Module]:
    """Import ``"package.module:function"``. Only called for names the operator allowed."""
    module_name, _, attr = check_factory_name(name).partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"cannot import {module_name!r} for factory {name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"{module_name!r} has no callable {attr!r}")
    return factory


__all__ = ["check_factory_name", "load_factory"]
