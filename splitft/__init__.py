"""splitft: split learning and edge-cloud split fine-tuning for PyTorch.

Cut a model at a named module; the edge half trains on the device, the cloud half on a server,
exchanging activations and gradients over ZeroMQ through pluggable codecs::

    model = splitft.split(model, cut="block3", rejoin="head", connect="tcp://cloud:5555",
                          factory="splitft.models:digits_cnn", codecs="fp16")
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
    ...  # the usual loop: out = model(x); loss = crit(out, y); loss.backward(); opt.step()

Names are imported on first use, so ``python -m splitft`` can set up the process (thread wait
policy) before torch loads.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "CloudServer": "cloud", "CloudSession": "cloud", "serve_in_thread": "cloud",
    "resolve_codecs": "coding",
    "CutActivation": "edge", "EdgeSession": "edge", "RemoteLoss": "edge", "SplitModel": "edge", "split": "edge",
    "Codecs": "options", "Factory": "options", "Faults": "options", "Link": "options", "Schedule": "options",
    "CompressionError": "errors", "ConfigError": "errors", "CutError": "errors", "DesyncError": "errors",
    "HandshakeError": "errors", "PeerGone": "errors", "ProtocolError": "errors", "RemoteError": "errors",
    "SplitFTError": "errors", "TransportError": "errors", "TransportTimeout": "errors",
    "AuthError": "errors", "CapacityError": "errors", "CheckpointError": "errors", "ModelError": "errors",
    "RedirectError": "errors", "ResumeError": "errors", "SessionLost": "errors", "TooLarge": "errors",
    "CheckpointStore": "checkpoint_store", "read_checkpoint": "checkpoint", "write_checkpoint": "checkpoint",
    "Limits": "limits",
    "Metrics": "metrics",
    "CutSpec": "cut", "parse_cut": "cut",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'splitft' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
