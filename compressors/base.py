"""The codec contract: what every compressor of cut traffic provides.

A codec turns one tensor into a :class:`Payload` (named numpy arrays plus small metadata) and
back. Payloads are what the transport carries, so a codec never sees a socket and a transport
never sees a codec.

The gradient that crosses the cut is the gradient with respect to *what was sent*. The receiver
maps the gradient of the decoded tensor back onto the payload (:meth:`Codec.decode_adjoint`) and
the sender maps it onto its input (:meth:`Codec.encode_adjoint`). Linear codecs (low-rank,
circular convolution) implement both as true adjoints, which makes their gradient as small as
their payload; non-linear ones (quantizers, binarization) keep the default straight-through
identity and leave the gradient to a gradient codec of its own.

A codec may be built from a spec a peer sent, and decode payloads a peer made, so the contract
also covers what that costs the receiving end:

- every option is classified (``negotiable_options`` / ``local_options``, and ``bounded_by``
  for the costly ones; see :mod:`compressors.policy`); ``__init__`` only validates settings and
  never allocates in proportion to them;
- :meth:`Codec.decode_cost` says, from a payload's metadata and array shapes alone, how many
  bytes decoding it would allocate at peak, and :meth:`Codec.decode_flops` how much arithmetic
  it would do, so a runtime can refuse a payload before paying for it, and
  :meth:`Codec.encode_flops` prices what encoding a tensor of a given shape would do (the
  receiver of a spec encodes with it too: the cloud encodes its gradients with the codec the
  edge named);
- caches belong to the instance and are bounded, and :meth:`Codec.held_nbytes` says what the
  instance holds now, so a runtime can count it against a per-session memory budget.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import torch

from ._device import download
from .errors import CompressionError

if TYPE_CHECKING:
    from .policy import Bounds

Role = Literal["activation", "gradient"]

#: Passes over its input an encoder that does a few operations per element makes, at most
#: (:meth:`Codec.encode_flops`' default).
ENCODE_PASSES = 8

# The dtypes a payload array may have on the wire: fixed-size, no objects, nothing executable.
WIRE_DTYPES = frozenset(
    ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "uint16",
     "uint32", "uint64", "bool", "complex64", "complex128"]
)


@dataclass
class Payload:
    """An encoded tensor: the codec that made it, named arrays and msgpack-able metadata."""

    codec: str
    version: int
    arrays: dict[str, np.ndarray]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of array data this payload puts on the wire (headers not included)."""
        return sum(int(a.nbytes) for a in self.arrays.values())


@dataclass(frozen=True)
class CodecContext:
    """What a codec may know about the tensor it is coding, beyond the tensor itself."""

    role: Role = "activation"
    train: bool = True
    step: int = 0
    sample_ids: np.ndarray | None = None
    #: Ask a stateful codec (AC-SGD) to send this batch in full precision and reset the state
    #: both ends keep for its samples; set after the receiver reported a :class:`DesyncError`.
    resync: bool = False
    #: Where a decode puts its tensor (and does its work): the receiver's compute device, so that
    #: only the payload crosses to it. None: the host.
    device: torch.device | str | None = None
    #: Set by a ``delta`` stage for the codec after it when the batch holds a sample's first send
    #: (nothing of it at the receiver yet): a quantizer may spend more bits on it (``first_bits``).
    first: bool = False


def to_numpy(x: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor (copied only when it must be: non-contiguous or on device)."""
    return download(x)


def tensor_meta(x: torch.Tensor) -> dict[str, Any]:
    """Shape and dtype of the original tensor, so decode can restore both."""
    return {"shape": list(x.shape), "dtype": str(x.dtype).removeprefix("torch.")}


def torch_dtype(name: str) -> torch.dtype:
    """The floating torch dtype named in a payload's metadata (validated, never eval'd)."""
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise CompressionError(f"payload names dtype {name!r}, which is not a torch dtype")
    return dtype


class Codec(ABC):
    """Base class of all codecs. Subclasses set ``name`` and implement encode and decode.

    Settings are keyword arguments of ``__init__``, validated there, and each is classified in
    ``negotiable_options`` or ``local_options`` (registration refuses an unclassified one).
    Mutable state (keys, buffers, warm-start factors) is exposed through :meth:`state_dict` so
    checkpoints can carry it. Randomness comes from ``seed``, which both ends of a link agree
    on at handshake.
    """

    name: ClassVar[str]
    version: ClassVar[int] = 1
    #: The gradient codec to pair with this one when the user names none.
    default_grad_codec: ClassVar[str] = "identity"
    #: True for codecs that may stand before another in a chain spec (``hadamard>quant``): they
    #: transform a tensor and hand it to the next codec (see :mod:`compressors.chain`).
    wraps: ClassVar[bool] = False
    #: True when training encodes need ``CodecContext.sample_ids`` (a stable id per sample), so a
    #: runtime can ask the user for them before the first step instead of failing inside it.
    needs_sample_ids: ClassVar[bool] = False
    #: Options both ends agree on, which a peer may ask for (subject to ``bounded_by``).
    negotiable_options: ClassVar[frozenset[str]] = frozenset()
    #: Options that name a resource of this machine (a file, a memory map, a device): set
    #: only by this end's own configuration, never accepted from a peer.
    local_options: ClassVar[frozenset[str]] = frozenset()
    #: Negotiable options that cost work or memory -> the :class:`~compressors.Bounds` field
    #: that caps them when the spec comes from a peer.
    bounded_by: ClassVar[Mapping[str, str]] = {}

    #: The bounds this instance enforces on what it decodes (e.g. the largest AC-SGD sample
    #: id), set by ``make_codec(..., bounds=...)`` for codecs that serve an untrusted peer;
    #: None for a codec built from this end's own configuration.
    bounds: Bounds | None = None

    def __init__(self, *, seed: int = 0) -> None:
        self.seed = int(seed)

    @abstractmethod
    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        """Compress ``x``. Must not keep references to ``x`` beyond the returned payload."""

    @abstractmethod
    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """Rebuild a tensor of the encoded shape and dtype from ``payload``."""

    def decode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """Receiver side: map the gradient of the decoded tensor to the gradient to send back."""
        return grad

    def encode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """Sender side: map the gradient that came back to the gradient of the encoded input."""
        return grad

    def state_dict(self) -> dict[str, Any]:
        """Mutable codec state (tensors and plain values). Stateless codecs return {}."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise CompressionError(f"codec {self.name!r} is stateless but got state keys {sorted(state)}")

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """An upper bound on the bytes :meth:`decode` would allocate at peak for ``payload``,
        counting the output in its decoded dtype, every intermediate, and state the decode
        would grow (buffers, caches).

        Computed from the payload's metadata and array shapes only, without decoding, so a
        receiver can refuse a payload whose cost exceeds its budget before paying for it (a
        few bytes of metadata can name a tensor of many GiB). Metadata it reads is validated:
        a malformed payload raises :class:`CompressionError`, as :meth:`decode` would.

        Counted are tensors and arrays, generously: the steps of a decode are summed rather
        than overlapped, since an allocator may not reuse what an earlier step freed. Not
        counted are a few MiB that do not grow with the payload (allocator bookkeeping, BLAS
        and FFT workspaces): a budget should leave that much spare.

        This default fits decoders that read the arrays once and produce the tensor named by
        ``meta["shape"]`` and ``meta["dtype"]`` through one float32 intermediate.
        """
        from . import _wire

        self.check(payload)
        shape = _wire.meta_shape(payload)
        dtype = _wire.meta_float_dtype(payload)
        return _wire.arrays_nbytes(payload) + math.prod(shape) * (dtype.itemsize + 4)

    def decode_flops(self, payload: Payload, ctx: CodecContext) -> int:
        """An upper bound on the arithmetic :meth:`decode` would do for ``payload`` (a
        multiply-add counts 2), from metadata and shapes only, like :meth:`decode_cost`.

        The default is the decode cost itself: decoders that do a few operations per element
        of their output and intermediates do about one per byte they allocate. Codecs whose
        decode work grows faster than its bytes (products of factors, FFTs) override it.
        """
        return self.decode_cost(payload, ctx)

    def encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """An upper bound on the arithmetic :meth:`encode` would do for a tensor of ``shape``
        and ``dtype`` (a multiply-add counts 2), before the tensor exists.

        A peer's spec names the codec this end encodes with (the cloud encodes gradients with
        the ``bwd`` codec the edge asked for), so what an option such as a rank or an iteration
        count costs must be known before the tensor is computed. The default fits encoders
        that make a few passes over the tensor; codecs whose work grows faster (products,
        power iterations, FFTs) override it.
        """
        return ENCODE_PASSES * math.prod(shape)

    def held_nbytes(self) -> int:
        """Bytes this instance holds now in buffers and caches (0 for stateless codecs), so a
        runtime can count a session's codecs against its memory budget."""
        return 0

    def check(self, payload: Payload) -> None:
        """Raise unless ``payload`` was made by this codec, at this version."""
        if payload.codec != self.name or payload.version != self.version:
            raise CompressionError(
                f"codec {self.name!r} v{self.version} cannot decode a payload of "
                f"{payload.codec!r} v{payload.version}; both ends must use the same codec"
            )

    @classmethod
    def options(cls) -> list[str]:
        """The keyword settings this codec takes (from its ``__init__`` signature)."""
        params = inspect.signature(cls.__init__).parameters.values()
        return [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.name != "seed"]

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.options() if hasattr(self, k))
        return f"{type(self).__name__}({opts})"
