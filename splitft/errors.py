"""One error hierarchy for splitft. Every message says what was expected, what came, and the fix.

The leaf packages have errors of their own (they may not import splitft); the runtime re-raises
them as the classes below at the boundary (:func:`translated`), so ``except SplitFTError`` is
enough for a user.
"""

from __future__ import annotations

from typing import Any, Literal

import compressors
import torch
import transports


class SplitFTError(Exception):
    """Base of everything splitft raises on purpose."""


class ConfigError(SplitFTError, ValueError):
    """Arguments that cannot work (an unknown option, a cut that does not exist, ...)."""


class CutError(ConfigError):
    """A model cannot be cut as asked."""


class PlaceholderError(ConfigError, RuntimeError):
    """A script touched the cloud half's tensors in a way that cannot reach the cloud (its values
    are not on the edge); raised before anything diverges, with the fix."""


class GraphFreedError(ConfigError, RuntimeError):
    """A second backward through a forward whose graph the cloud freed at the first. Also a
    ``RuntimeError``, as torch's own error for a freed graph is: a script's ``except RuntimeError``
    catches it as unsplit."""


class UnfinishedForwardError(SplitFTError):
    """A forward left unfinished where the unsplit model would have changed the cloud half
    (running statistics, dropout draws): a plain split's training-mode ``model(x)`` whose output
    never reached the cloud, or a U-shape trunk's run stopped midway. Raised at the next forward or
    request (a U-shape's at every one after it), and not a ``ValueError`` or ``RuntimeError``: a loop
    that skips a failed batch (``except (ValueError, RuntimeError): continue``) must not skip this
    and train on apart from the unsplit run."""


class ProtocolError(SplitFTError):
    """A message that does not follow the wire protocol."""


class HandshakeError(SplitFTError):
    """Edge and cloud disagree on something both must share (version, model, codecs, seed)."""


class RedirectError(HandshakeError):
    """The cloud sent this edge to another rank and the edge will not go: a second hop, an address
    that is not ``tcp://`` or ``ipc://``, or a link that can only reach the address it was given."""


class RemoteError(SplitFTError):
    """The peer reported an error; ``code`` says which kind."""

    def __init__(self, message: str, code: str = "internal") -> None:
        super().__init__(message)
        self.code = code


class PeerGone(SplitFTError):
    """The other side ended the session (it said goodbye, or was interrupted)."""


class CloudMisbehaving(SplitFTError):
    """The gradients the cloud returns do not behave as the backward of any model would (a probe
    of the edge's defences caught it steering the edge, e.g. feature-space hijacking); training
    stopped before the edge took another step from them."""


class TooLarge(ProtocolError):
    """A message is bigger than the receiver accepts (``--max-message-mb``)."""


class ModelError(SplitFTError):
    """The cloud part raised on the inputs an edge sent (wrong shapes, dtypes, targets...).

    Raised as the Python exception the cloud's code raised too (a ``ModelError`` that is also an
    ``IndexError``, see :data:`RAISED_AS`), so a script's ``except RuntimeError`` around a bad
    batch catches it as unsplit. ``rng``: where the cloud half's generator stream was left, when
    it drew before failing (the edge goes on from there)."""

    rng: Any = None


class CloudOutOfMemory(ModelError, torch.OutOfMemoryError):
    """The cloud half ran out of memory on the inputs an edge sent. Also torch's own error, as the
    unsplit model would raise it: a loop that halves its batch on ``torch.OutOfMemoryError`` (or
    finds its batch size so) catches this too."""


class CapacityError(SplitFTError):
    """The cloud serves as many sessions as it is allowed to; try again later or raise the limit."""


class SessionLost(ProtocolError):
    """The cloud has no session for this connection (it restarted, or the session expired).

    The edge answers it by resuming: a new hello with its resume token, then replaying what the
    cloud lost.
    """


class PolicyError(HandshakeError):
    """An edge asked for something the cloud's policy does not allow (a codec, an option, a bound)."""


class ResumeError(HandshakeError):
    """A session cannot be resumed: no checkpoint matches, or the resume token is wrong."""


class CheckpointError(SplitFTError):
    """A checkpoint cannot be written or read back."""


class CompressionError(SplitFTError, compressors.CompressionError):
    """A codec failed or was misconfigured."""


class DesyncError(CompressionError, compressors.DesyncError):
    """Codec state on the two ends disagrees."""


class TransportError(SplitFTError, transports.TransportError):
    """Frames could not be moved."""


class TransportTimeout(TransportError, transports.TransportTimeout):
    """No answer in time."""


class AuthError(TransportError, transports.TransportRefused):
    """The CURVE handshake failed: the cloud refused this edge's key, or the keys do not match."""


# Error codes that travel in Error messages, and the class the receiving side raises for each.
CODES: dict[str, type[SplitFTError]] = {
    "protocol": ProtocolError,
    "handshake": HandshakeError,
    "config": ConfigError,
    "compression": CompressionError,
    "desync": DesyncError,
    "shutdown": PeerGone,
    "too_large": TooLarge,
    "model": ModelError,
    "capacity": CapacityError,
    "session": SessionLost,
    "resume": ResumeError,
    "policy": PolicyError,
    "checkpoint": CheckpointError,
    "out_of_memory": CloudOutOfMemory,
}


def code_of(exc: BaseException) -> str:
    """The wire code for an exception raised while serving a request."""
    for code, cls in reversed(list(CODES.items())):
        if isinstance(exc, cls):
            return code
    if isinstance(exc, compressors.DesyncError):
        return "desync"
    if isinstance(exc, compressors.CompressionError):
        return "compression"
    return "internal"


def _raised_as(base: type[Exception]) -> type[ModelError]:
    return type(f"Model{base.__name__}", (ModelError, base), {"__module__": __name__, "__doc__": (
        f"The cloud half raised {base.__name__} on the inputs an edge sent: a ModelError, and the {base.__name__} "
        "the unsplit model would raise.")})


#: The Python exceptions a cloud model's error is raised as on the edge too, by name (``error.raised``).
RAISED_AS: dict[str, type[ModelError]] = {base.__name__: _raised_as(base) for base in (
    RuntimeError, NotImplementedError, IndexError, KeyError, ValueError, TypeError, AssertionError,
    ZeroDivisionError, OverflowError, FloatingPointError)}


def raised_name(exc: BaseException) -> str:
    """The name :data:`RAISED_AS` knows for what the cloud half's code raised under ``exc`` (a
    ``ModelError`` from it), the nearest of its classes; "" for none."""
    cause = exc.__cause__ if isinstance(exc, ModelError) and not isinstance(exc, CloudOutOfMemory) else None
    for cls in type(cause).__mro__ if isinstance(cause, Exception) else ():
        if cls.__module__ == "builtins" and cls.__name__ in RAISED_AS:
            return cls.__name__
    return ""


def from_code(code: str, message: str, raised: str = "", rng: Any = None) -> SplitFTError:
    cls = CODES.get(code)
    if cls is None or cls is RemoteError:
        return RemoteError(message, code)
    if cls is ModelError and isinstance(raised, str):
        cls = RAISED_AS.get(raised, ModelError)
    error = cls(message)
    if isinstance(error, ModelError):
        error.rng = rng
    return error


class HiddenAttributeWarning(UserWarning):
    """The model that was split has an attribute the split model has too (``predict``, ``metrics``):
    on the split model the name means the split model's; the model's own is ``model.wrapped.<name>``."""


class _Translated:
    """The context :func:`translated` returns: a class rather than a generator, since every codec
    call of a message enters one (a generator-based context costs several times as much)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> Literal[False]:
        if exc is None or isinstance(exc, SplitFTError):
            return False
        for leaf, ours in _TRANSLATIONS:
            if isinstance(exc, leaf):
                raise ours(str(exc)) from exc
        return False


_TRANSLATED = _Translated()
#: Leaf-package error → splitft's, the more specific first.
_TRANSLATIONS = ((transports.TransportTimeout, TransportTimeout), (transports.TransportRefused, AuthError),
                 (transports.TransportError, TransportError), (compressors.DesyncError, DesyncError),
                 (compressors.CompressionError, CompressionError))


def translated() -> _Translated:
    """Re-raise leaf-package errors as splitft errors, keeping the original as the cause."""
    return _TRANSLATED
