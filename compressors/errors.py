"""The error types of the codec package: one base, :class:`CompressionError`, and its kinds."""

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


class PolicyError(CompressionError):
    """A codec spec that a peer asked for and this end refuses to build.

    Raised by :func:`compressors.check_spec` when the spec names a codec outside the allowed
    set, an option that names a local resource (a file, a memory map), or an option beyond the
    receiver's :class:`compressors.Bounds`. ``codec``, ``option``, ``value`` and ``bound``
    say which (empty where they do not apply), so a runtime can report it without parsing text.
    """

    def __init__(self, message: str, *, codec: str = "", option: str = "", value: object = None,
                 bound: str = "") -> None:
        super().__init__(message)
        self.codec, self.option, self.value, self.bound = codec, option, value, bound
