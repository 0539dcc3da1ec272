"""Moving framed messages between processes. Imports pyzmq, msgpack and numpy only."""

from .base import Connection, Frame, Listener, PeerId, frame_nbytes, message_nbytes
from .errors import TransportClosed, TransportError, TransportTimeout
from .inproc import InprocConnection, InprocListener
from .zmq import ZmqConnection, ZmqListener


def connect(address: str, **options) -> Connection:
    """Open the edge end of a link to ``address`` (tcp://HOST:PORT or ipc://PATH)."""
    return ZmqConnection(address, **options)


def listen(address: str, **options) -> Listener:
    """Open the cloud end of a link on ``address``; ``tcp://HOST:0`` picks a free port."""
    return ZmqListener(address, **options)


__all__ = [
    "Connection", "Frame", "InprocConnection", "InprocListener", "Listener", "PeerId",
    "TransportClosed", "TransportError", "TransportTimeout", "ZmqConnection", "ZmqListener",
    "connect", "frame_nbytes", "listen", "message_nbytes",
]
