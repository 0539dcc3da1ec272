"""Pure tensor codecs for split-learning traffic. Imports torch and numpy only; knows no sockets.

Importing the package registers every built-in codec; ``make_codec("name:opt=value")`` builds one.

A spec or payload may come from a peer this end does not trust. ``check_spec(spec, Bounds())``
refuses codecs outside an allowed set, options naming local resources (files, memory maps) and
options beyond the receiver's :class:`Bounds`, raising :class:`PolicyError`;
``make_codec(spec, bounds=...)`` builds a codec that also enforces the bounds only payloads
reveal (AC-SGD sample ids). Before decoding a peer's payload, ``codec.decode_cost(payload, ctx)``
(bytes at peak) and ``codec.decode_flops(payload, ctx)`` price it from metadata alone,
``codec.encode_flops(shape, dtype)`` prices an encode before the tensor exists, and
``codec.held_nbytes()`` says what a codec holds in buffers and caches; caches are per instance
and bounded.

One file per family: ``identity``; ``quant`` (``fp16``, ``fixpoint``); ``scaled`` (``quant``: per-tile
scales and normal levels, for an LLM's hidden states); ``lowrank`` (SFT factors); ``circconv``
(``c3sl``); ``binary`` (B-SL, with its binarized layers); ``delta`` (``acsgd``); ``errbound`` (an
error bound per element instead of a bit width).

Codecs compose by spec (``outliers:k=4>hadamard>delta>quant:bits=2``): ``chain`` holds the stage
contract, and the stages are ``rotation`` (``hadamard``), ``outliers`` and ``delta_stage``
(``delta``: AC-SGD over whatever codec follows). ``bitpack`` packs b-bit codes for any codec that
needs it; ``policy`` holds :class:`Bounds` and the option classification every codec declares.
"""

from . import binary, circconv, delta, errbound, identity, lowrank, quant, scaled  # noqa: F401  (registration side effects)
from . import delta_stage, outliers, rotation  # noqa: F401  (chain stages, registered too)
from ._device import host_tensor
from ._wire import all_finite
from .base import Codec, CodecContext, Payload, WIRE_DTYPES
from .errors import CompressionError, DesyncError, PolicyError, UnknownCodecError
from .policy import Bounds
from .registry import (
    canonical_spec,
    check_spec,
    codec_class,
    default_grad_spec,
    make_codec,
    names,
    parse_chain,
    parse_spec,
    register,
)

__all__ = [
    "Bounds", "Codec", "CodecContext", "CompressionError", "DesyncError", "Payload", "PolicyError",
    "UnknownCodecError", "WIRE_DTYPES", "all_finite", "canonical_spec", "check_spec", "codec_class",
    "default_grad_spec", "host_tensor", "make_codec", "names", "parse_chain", "parse_spec", "register",
]
