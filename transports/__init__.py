"""Moving framed messages between processes. Imports pyzmq, msgpack and numpy only."""

from .base import Connection, Frame, Listener, PeerId, frame_nbytes, message_nbytes
from .curve import generate_keypair, load_allowed_keys, load_public_key, load_secret_key
from .errors import (LinkSpecError, TransportClosed, TransportDisconnected, TransportError, TransportRefused,
                     TransportTimeout)
from .inproc import InprocConnection, InprocListener
from .link import EmulatedConnection, LinkEvent, LinkSchedule, Transit, emulate
from .link_spec import LinkDirection, LinkSpec
from .zmq import ZmqConnection, ZmqListener


def connect(address: str, *, link: LinkSpec | str | None = None, **options) -> Connection:
    """Open the edge end of a link to ``address`` (tcp://HOST:PORT or ipc://PATH).

    ``link`` (``"100mbit,20ms"``, a :class:`LinkSpec`, or None/``"loopback"``) slows the
    connection to an emulated network in both directions; the interface stays the same.
    CurveZMQ: ``server_key=`` (the cloud's public key), ``public_key=`` and ``secret_key=`` (this
    edge's pair), all Z85 bytes; see :mod:`transports.curve` to read them from key files.
    """
    spec = None if link is None else LinkSpec.coerce(link)  # a bad spec fails before a socket opens
    return emulate(ZmqConnection(address, **options), spec)


def listen(address: str, **options) -> Listener:
    """Open the cloud end of a link on ``address``; ``tcp://HOST:0`` picks a free port.

    CurveZMQ: ``secret_key=`` (this cloud's secret key) and ``allowed_keys=`` (edge public keys).
    """
    return ZmqListener(address, **options)


__all__ = [
    "Connection", "EmulatedConnection", "Frame", "InprocConnection", "InprocListener", "LinkDirection",
    "LinkEvent", "LinkSchedule", "LinkSpec", "LinkSpecError", "Listener", "PeerId", "Transit",
    "TransportClosed", "TransportDisconnected", "TransportError", "TransportRefused", "TransportTimeout",
    "ZmqConnection", "ZmqListener", "connect", "emulate", "frame_nbytes", "generate_keypair", "listen",
    "load_allowed_keys", "load_public_key", "load_secret_key", "message_nbytes",
]
