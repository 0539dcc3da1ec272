"""Errors of the transport package (it knows nothing of the rest of splitft)."""


class TransportError(ConnectionError):
    """Frames could not be sent or received."""


class TransportTimeout(TransportError, TimeoutError):
    """Nothing arrived within the receive timeout."""


class TransportClosed(TransportError):
    """The transport was closed (locally, or its peer went away for good)."""


class LinkSpecError(ValueError):
    """A link description (bandwidth, delay) that cannot be read; the message shows valid forms."""


class TransportRefused(TransportError):
    """The peer refused the link during its handshake (CurveZMQ: unknown key, wrong server key)."""


class TransportDisconnected(TransportError):
    """The established connection dropped (the peer died or the network went away)."""
