"""The one error type of the codec package."""


class CompressionError(ValueError):
    """A codec was misconfigured, or was handed a payload it cannot decode."""


class UnknownCodecError(CompressionError, KeyError):
    """A codec name that is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DesyncError(CompressionError):
    """Sender and receiver state disagree (a lost, repeated or reordered message)."""
