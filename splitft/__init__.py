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
from .checkpoint import CheckpointStore, read_checkpoint, write_checkpoint
from .errors import (AuthError, CapacityError, CheckpointError, CompressionError, ConfigError, CutError,
                     DesyncError, HandshakeError, ModelError, PeerGone, ProtocolError, RemoteError, ResumeError,
                     SessionLost, SplitFTError, TooLarge, TransportError, TransportTimeout)
from .limits import Limits
from .metrics import Metrics
from .split import CutSpec, parse_cut

__version__ = "0.1.0"

__all__ = [
    "AuthError", "CapacityError", "CheckpointError", "CheckpointStore", "CloudServer", "CloudSession",
    "CompressionError", "ConfigError", "CutActivation", "CutError", "CutSpec", "DesyncError", "HandshakeError",
    "Limits", "Metrics", "ModelError", "PeerGone", "ProtocolError", "RemoteError", "RemoteLoss", "ResumeError",
    "SessionLost", "SplitFTError", "SplitModel", "TooLarge", "TransportError", "TransportTimeout", "parse_cut",
    "read_checkpoint", "resolve_codecs", "serve_in_thread", "split", "write_checkpoint",
]
