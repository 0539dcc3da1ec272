"""splitft: split learning and edge-cloud split fine-tuning for PyTorch.

Cut a model at a named module; the edge half trains on the device, the cloud half on a server,
exchanging activations and gradients over ZeroMQ through pluggable codecs::

    model = splitft.split(model, cut="block3", rejoin="head", connect="tcp://cloud:5555",
                          factory="splitft.app.models:digits_cnn", codecs="fp16")
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    ...  # the usual loop: out = model(x); loss = crit(out, y); loss.backward(); opt.step()

Names are imported on first use, so ``python -m splitft`` can set up the process (thread wait
policy) before torch loads.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: The public face: what a script needs, by the module that defines it. Every other name lives
#: in its module (``splitft.errors`` holds every error class; ``splitft.cloud`` the cloud's rooms).
_EXPORTS = {
    "split": "edge", "SplitModel": "edge",
    "Codecs": "options", "Factory": "options", "Faults": "options", "Link": "options", "Schedule": "options",
    "SplitFTError": "errors", "ConfigError": "errors", "PlaceholderError": "errors", "CutError": "errors",
    "HandshakeError": "errors", "CapacityError": "errors", "RemoteError": "errors", "TransportError": "errors",
    "CloudServer": "cloud", "serve_in_thread": "cloud", "TensorBoard": "edge.tensorboard",
}

__all__ = sorted([*_EXPORTS, "errors"])

if TYPE_CHECKING:  # what the names below are, for type checkers; at run time they load on first use
    from . import errors
    from .cloud import CloudServer, serve_in_thread
    from .edge import SplitModel, split
    from .edge.tensorboard import TensorBoard
    from .errors import (CapacityError, ConfigError, CutError, HandshakeError, PlaceholderError, RemoteError,
                         SplitFTError, TransportError)
    from .options import Codecs, Factory, Faults, Link, Schedule


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module(".errors", __name__)
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'splitft' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | {"errors"})
