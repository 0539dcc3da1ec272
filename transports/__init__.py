"""Moving framed messages between processes. Imports pyzmq, msgpack and numpy only."""

from .base import Connection, Frame, Listener, PeerId, frame_nbytes, message_nbytes
from .curve import generate_keypair, load_allowed_keys, load_public_key, load_secret_key
from .errors import (TransportClosed, TransportDisconnected, TransportError, TransportRefused,
                     TransportTimeout)
from .inproc import InprocConnection, InprocListener
from .zmq import ZmqConnection, ZmqListener


def connect(address: str, **options) -> Connection:
    """Open the edge end of a link to ``address`` (tcp://HOST:PORT or ipc://PATH).

    CurveZMQ: ``server_key=`` (the cloud's public key), ``public_key=`` and ``secret_key=`` (this
    edge's pair), all Z85 bytes; see :mod:`transports.curve` to read them from key files.
    """
    return ZmqConnection(address, **options)


def listen(address: str, **options) -> Listener:
    """Open the cloud end of a link on ``address``; ``tcp://HOST:0`` picks a free port.

    CurveZMQ: ``secret_key=`` (this cloud's secret key) and ``allowed_keys=`` (edge public keys).
    """
    return ZmqListener(address, **options)


__all__ = [
    "Connection", "Frame", "InprocConnection", "InprocListener", "Listener", "PeerId",
    "TransportClosed", "TransportDisconnected", "TransportError", "TransportRefused", "TransportTimeout",
    "ZmqConnection", "ZmqListener", "connect", "frame_nbytes", "generate_keypair", "listen",
    "load_allowed_keys", "load_public_key", "load_secret_key", "message_nbytes",
]
