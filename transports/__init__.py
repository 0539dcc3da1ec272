"""Moving framed messages between processes. Imports pyzmq, msgpack and numpy only."""

from .base import Connection, Frame, Listener, PeerId, frame_nbytes, message_nbytes
from .errors import LinkSpecError, TransportClosed, TransportError, TransportTimeout
from .inproc import InprocConnection, InprocListener
from .link import EmulatedConnection, LinkDirection, LinkEvent, LinkSchedule, LinkSpec, Transit, emulate
from .zmq import ZmqConnection, ZmqListener


def connect(address: str, *, link: LinkSpec | str | None = None, **options) -> Connection:
    """Open the edge end of a link to ``address`` (tcp://HOST:PORT or ipc://PATH).

    ``link`` (``"100mbit,20ms"``, a :class:`LinkSpec`, or None/``"loopback"``) slows the
    connection to an emulated network in both directions; the interface stays the same.
    """
    spec = None if link is None else LinkSpec.coerce(link)  # a bad spec fails before a socket opens
    return emulate(ZmqConnection(address, **options), spec)


def listen(address: str, **options) -> Listener:
    """Open the cloud end of a link on ``address``; ``tcp://HOST:0`` picks a free port."""
    return ZmqListener(address, **options)


__all__ = [
    "Connection", "EmulatedConnection", "Frame", "InprocConnection", "InprocListener", "LinkDirection",
    "LinkEvent", "LinkSchedule", "LinkSpec", "LinkSpecError", "Listener", "PeerId", "Transit",
    "TransportClosed", "TransportError", "TransportTimeout", "ZmqConnection", "ZmqListener",
    "connect", "emulate", "frame_nbytes", "listen", "message_nbytes",
]
