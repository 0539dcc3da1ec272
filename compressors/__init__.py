"""Pure tensor codecs for split-learning traffic. Imports torch and numpy only; knows no sockets.

Importing the package registers every built-in codec; ``make_codec("name:opt=value")`` builds one.

One file per family: ``identity``; ``quant`` (``fp16``, ``fixpoint``); ``lowrank`` (SFT factors);
``circconv`` (``c3sl``); ``binary`` (B-SL, with its binarized layers); ``delta`` (``acsgd``).
``bitpack`` packs b-bit codes for any codec that needs it.
"""

from . import binary, circconv, delta, identity, lowrank, quant  # noqa: F401  (registration side effects)
from .base import Codec, CodecContext, Payload, WIRE_DTYPES
from .errors import CompressionError, DesyncError, UnknownCodecError
from .registry import (
    canonical_spec,
    codec_class,
    default_grad_spec,
    make_codec,
    names,
    parse_spec,
    register,
)

__all__ = [
    "Codec", "CodecContext", "CompressionError", "DesyncError", "Payload", "UnknownCodecError",
    "WIRE_DTYPES", "canonical_spec", "codec_class", "default_grad_spec", "make_codec", "names",
    "parse_spec", "register",
]
