"""The one error type of the codec package."""

from __future__ import annotations

from collections.abc import Iterable


class CompressionError(ValueError):
    """A codec was misconfigured, or was handed a payload it cannot decode."""


class UnknownCodecError(CompressionError, KeyError):
    """A codec name that is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class DesyncError(CompressionError):
    """Sender and receiver state disagree (a lost, repeated or reordered message).

    ``ids`` are the samples whose state disagrees (empty when unknown) and ``reason`` a short
    tag ("steps", "checksum"). The fix is to resend those samples in full precision: see
    ``compressors.delta.ACSGD`` for how a runtime drives that.
    """

    def __init__(self, message: str, ids: Iterable[int] = (), reason: str = "") -> None:
        super().__init__(message)
        self.ids: list[int] = [int(i) for i in ids]
        self.reason = reason
