"""splitft: split learning and edge-cloud split fine-tuning for PyTorch.

Cut a model at a named module; the edge half trains on the device, the cloud half on a server,
exchanging activations and gradients over ZeroMQ through pluggable codecs::

    model = splitft.split(model, cut="block3", rejoin="head", connect="tcp://cloud:5555",
                          factory="splitft.models:digits_cnn")
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-3))
    ...  # the usual loop: out = model(x); loss = crit(out, y); loss.backward(); opt.step()
"""

from .cloud import CloudServer, CloudSession, serve_in_thread
from .coding import resolve_codecs
from .edge import CutActivation, RemoteLoss, SplitModel, split
from .errors import (CompressionError, ConfigError, CutError, DesyncError, HandshakeError, PeerGone,
                     ProtocolError, RemoteError, SplitFTError, TransportError, TransportTimeout)
from .metrics import Metrics
from .split import CutSpec, parse_cut

__version__ = "0.1.0"

__all__ = [
    "CloudServer", "CloudSession", "CompressionError", "ConfigError", "CutActivation", "CutError",
    "CutSpec", "DesyncError", "HandshakeError", "Metrics", "PeerGone", "ProtocolError", "RemoteError",
    "RemoteLoss", "SplitFTError", "SplitModel", "TransportError", "TransportTimeout", "parse_cut",
    "resolve_codecs", "serve_in_thread", "split",
]
