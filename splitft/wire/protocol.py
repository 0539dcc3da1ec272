"""The wire protocol: typed, versioned messages as one msgpack header frame plus raw array frames.

Frame 0 is ``msgpack([PROTOCOL_VERSION, TYPE, field, field, ...])``: every field of the message, in
declaration order, by position. Positions rather than a map of names keep the header small and
make it cheap to read, which matters for the many small messages of a training step: a receiver
builds no dict of names per message. Any numpy array inside the fields is written as msgpack
extension type 1 holding ``[frame index, dtype, shape]`` and its bytes travel as their own frame,
so large arrays are never copied into the header and are sent zero-copy. Decoding validates
everything a hostile peer controls (types, dtypes, shapes, sizes, frame counts) before building
anything, and never executes code: no pickle, ever.

Requests carry ``seq``, a per-session sequence number (1, 2, ...), and replies echo it: the cloud
applies each number once and answers a repeat from its reply cache, so an edge may re-send a
request whose reply it never saw (``seq`` 0: unsequenced, never deduplicated).

The operations a request carries (``ops``) are :class:`~splitft.wire.operations.Operation` records
on the sending side, packed as their maps (``{"op": NAME, ...}``) when the message is encoded; a
receiver finds the maps, which :func:`splitft.wire.operations.from_wire` checks one by one.
"""

from __future__ import annotations

import gc
import math
import threading
from collections.abc import Collection
from typing import Any

import msgpack
import numpy as np

from compressors import WIRE_DTYPES, Payload

from ..errors import ProtocolError, TooLarge
# The messages, re-exported: callers name them as protocol.Forward, protocol.Hello, ...
from .messages import (MESSAGES, Ack, Arrive, Backward, Bye, Error, Forward, Handoff, Hello, InputGrads,  # noqa: F401
                       Leave, Message, Output, Ping, Pong, Probe, Probed, Redirect, Sync, Welcome)
from .operations import Operation, to_wire as operation_to_wire
from .records import _CACHE_LIMIT, _short, build_checked, record_fields

PROTOCOL_VERSION = 20  # 20: sync.want_grads, ack.grads (unsplit() between a backward and its step); 19: $same in a forward's value trees (a tensor passed in several places crosses once); 18: optimizer.version (a library's optimizer, transformers' Adafactor), complex arrays, the identity codec's strides; 17: change_cache.source, the copy, reset and whole kinds (copy.deepcopy and reset() of a cache the cloud keeps part of); 16: error.raised, error.rng (a cloud model's error raised as the Python exception it was; the draws of a forward that failed); 15: apply.last (an eager call's gradients handed over uncopied); 14: the compute operation, sync.evaluate and ack.values (a script's torch calls on cloud gradients and weights, computed in the cloud); 13: flags also carry the public settings a cloud module's code reads (dropout's p, batch norm's momentum); 12: flags also carry dicts, lists and sets changed in place (and the structure hash holds them, the plain tensors cloud layers read, and where the code they run was defined); 11: hello.numerics (the edge's process-wide numeric settings), the change_cache and flags operations; 10: forward.rng, output.rng (the cloud half draws from the edge's generator), forward.again; 9: sync.want_optimizer_state, ack.optimizer_state, load_optimizer_state; 8: apply.pass_id, backward.pass_id (one backward pass summed before .grad); 7: a session that leaves stays until its bye (a lost handoff is asked again), backward.params; 6: a live session moves between clouds (leave, handoff, arrive), the edge probes the link (probe, probed); 5: gradients a backward did not reach, gradient norms per parameter, operations by parameter name; 4: fields by position; 3: parameter groups and frozen parameters by name; 2: numbered requests, typed operations, welcome.limits (docs/wire.md)
_ARRAY_EXT = 1
MAX_DIMS = 8
#: Most entries one list or map of a header may claim. msgpack allocates a container's slots as
#: soon as it reads its length, before its entries: without a cap, a few bytes claiming a long
#: list (nested, a thousand deep) reserve gigabytes. The longest real ones are a message's
#: operations (``--max-ops``) and a half's parameter names or state (tens of thousands of tensors
#: in the largest mixture-of-experts halves); the same cap bounds what an edge decodes. Measured:
#: the worst nesting of claims costs ~68 MiB at this cap, no more than at 16384, 27 MiB at 4096.
MAX_CONTAINER_LEN = 1 << 16
#: An array reference is ``[frame index, dtype, shape]``: tens of bytes.
MAX_EXT_LEN = 256
_CONTAINER_LIMITS = {"max_array_len": MAX_CONTAINER_LEN, "max_map_len": MAX_CONTAINER_LEN, "max_ext_len": MAX_EXT_LEN}


#: Field names per message type, in declaration order (the order they are encoded in).
_FIELD_NAMES = {cls: [name for name, *_ in record_fields(cls)[0]] for cls in MESSAGES.values()}


# ---------------------------------------------------------------- payloads inside bodies

TENSOR_KEY = "$t"


def payload_to_wire(payload: Payload, requires_grad: bool = False) -> dict:
    return {TENSOR_KEY: [payload.codec, payload.version, payload.meta, payload.arrays, requires_grad]}


def is_tensor_entry(value: Any) -> bool:
    return isinstance(value, dict) and TENSOR_KEY in value


def payload_from_wire(value: Any) -> tuple[Payload, bool]:
    """Inverse of :func:`payload_to_wire`, checking every field's type."""
    entry = value.get(TENSOR_KEY) if isinstance(value, dict) else None
    if not (isinstance(entry, list) and len(entry) == 5):
        raise ProtocolError(f"expected a tensor entry {{'{TENSOR_KEY}': [codec, version, meta, arrays, grad]}}, got {_short(value)}")
    codec, version, meta, arrays, grad = entry
    if not isinstance(codec, str) or not isinstance(version, int) or not isinstance(meta, dict) \
            or not isinstance(arrays, dict) or not isinstance(grad, bool):
        raise ProtocolError(f"malformed tensor entry: {_short(entry)}")
    for name, arr in arrays.items():
        if not isinstance(name, str) or not isinstance(arr, np.ndarray):
            raise ProtocolError(f"tensor entry array {name!r} is {type(arr).__name__}, expected an array frame")
    return Payload(codec, version, arrays, meta), grad


# ---------------------------------------------------------------- encoding


#: Allowed dtypes by value (a dict lookup is much cheaper per message than ``dtype.name``).
_WIRE_NAMES = {np.dtype(name): name for name in WIRE_DTYPES}
_WIRE_ITEMSIZE = {name: np.dtype(name).itemsize for name in WIRE_DTYPES}

#: Per message type: its field names, in declaration order (the order they are encoded in).
_FIELD_TUPLES = {cls: tuple(names) for cls, names in _FIELD_NAMES.items()}
#: Extension references already built, by (frame index, dtype name, shape); a few per model.
_REF_CACHE: dict[tuple, msgpack.ExtType] = {}


class _Encoder(threading.local):
    """One msgpack packer per thread, reused: building one costs as much as packing a header.

    ``arrays`` collects the arrays met while one header is packed; the packer resets itself
    after an error, so a failed encode leaves nothing behind.
    """

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.packer = msgpack.Packer(default=self.default, use_bin_type=True)

    def default(self, obj: Any) -> Any:
        if isinstance(obj, np.ndarray):
            name = _WIRE_NAMES.get(obj.dtype)  # native byte order only: the receiver reads native
            if name is None:
                raise ProtocolError(f"array dtype {obj.dtype} cannot go on the wire; allowed: {sorted(WIRE_DTYPES)}")
            arrays = self.arrays
            key = (len(arrays), name, obj.shape)
            ref = _REF_CACHE.get(key)
            if ref is None:
                if len(_REF_CACHE) >= _CACHE_LIMIT:
                    _REF_CACHE.clear()
                ref = _REF_CACHE[key] = msgpack.ExtType(_ARRAY_EXT, msgpack.packb([len(arrays), name, list(obj.shape)]))
            arrays.append(np.ascontiguousarray(obj))
            return ref
        if isinstance(obj, Operation):
            return operation_to_wire(obj)
        if isinstance(obj, tuple):
            return list(obj)
        if isinstance(obj, (np.integer, np.floating, np.bool_)):
            return obj.item()
        raise ProtocolError(f"cannot put a {type(obj).__name__} on the wire (only plain values and numpy arrays)")


_ENCODER = _Encoder()


def encode(message: Message) -> list:
    """Frames for ``message``: the header first, then one frame per array, in order of appearance."""
    cls = type(message)
    body = message.__dict__  # a record's attributes are its fields, set in order by __init__ ...
    values: Collection[Any]
    if tuple(body) == _FIELD_TUPLES[cls]:
        values = body.values()
    else:  # ... unless someone added one or reordered them: read them one by one
        values = [getattr(message, name) for name in _FIELD_TUPLES[cls]]
    encoder = _ENCODER
    arrays = encoder.arrays = []
    try:
        header = encoder.packer.pack([PROTOCOL_VERSION, cls.TYPE, *values])
    finally:
        encoder.arrays = []
    return [header, *arrays]


def decode(frames: list) -> Message:
    """Parse and validate frames into a message. Anything malformed raises :class:`ProtocolError`."""
    if not frames:
        raise ProtocolError("empty message: expected a header frame")
    arrays = len(frames) - 1
    used: set[int] = set()

    def ext_hook(code: int, data: bytes) -> Any:
        if code != _ARRAY_EXT:
            raise ProtocolError(f"unknown msgpack extension type {code}; only arrays (type {_ARRAY_EXT}) are allowed")
        index, dtype, shape, nbytes = _REFS_SEEN.get(data) or _array_ref(data)
        if not index < arrays or index in used:
            raise ProtocolError(f"array reference to frame {index!r}: out of range or used twice "
                                f"({arrays} array frames)")
        buf = memoryview(frames[index + 1])
        if nbytes != buf.nbytes:
            raise ProtocolError(f"array of shape {list(shape)} and dtype {dtype} needs {nbytes} bytes, "
                                f"its frame has {buf.nbytes}")
        used.add(index)
        # Positional arguments: numpy parses keywords slower than it builds the array.
        return np.frombuffer(buf, dtype) if len(shape) == 1 else np.ndarray(shape, dtype, buf)

    try:
        head = _unpack_header(frames[0], ext_hook)
    except ProtocolError:
        raise
    except MemoryError:
        raise TooLarge(f"a header frame of {memoryview(frames[0]).nbytes} bytes does not fit in memory once "
                       "parsed; send a smaller one") from None
    except Exception as exc:  # msgpack raises several types for garbage
        raise ProtocolError(f"header frame is not valid msgpack: {type(exc).__name__}: {exc}") from None
    if head.__class__ is not list or len(head) < 2:
        raise ProtocolError(_not_a_header(head))
    if head[0] != PROTOCOL_VERSION or head[0].__class__ is not int:
        raise ProtocolError(_other_version(head[0]))
    kind = head[1]
    cls = MESSAGES.get(kind) if kind.__class__ is str else None
    if cls is None:
        raise ProtocolError(f"unknown message type {_short(kind)}; known: {', '.join(sorted(MESSAGES))}")
    if len(used) != arrays:
        raise ProtocolError(f"{arrays} array frames arrived but the header references {len(used)}")
    del head[:2]
    return _build_fields(cls, head)


def _unpack_header(header: Any, ext_hook: Any) -> Any:
    """msgpack's parse of a header frame, within the per-container limits.

    A big header is parsed with the garbage collector paused: a parse builds nothing but new,
    acyclic containers, and collecting while hundreds of thousands of them appear is what made
    it slow (0.3 s for 256 KiB of empty lists, 0.02 s without). Small headers, every real one,
    skip the switch.
    """
    if len(header) < _PAUSE_GC_ABOVE or not gc.isenabled():
        return msgpack.unpackb(header, raw=False, ext_hook=ext_hook, strict_map_key=True, **_CONTAINER_LIMITS)
    gc.disable()
    try:
        return msgpack.unpackb(header, raw=False, ext_hook=ext_hook, strict_map_key=True, **_CONTAINER_LIMITS)
    finally:
        gc.enable()


_PAUSE_GC_ABOVE = 16 << 10


def _other_version(version: Any) -> str:
    return (f"the peer speaks protocol {_short(version)}, this side speaks {PROTOCOL_VERSION}; "
            "install the same splitft version on edge and cloud")


def _not_a_header(head: Any) -> str:
    if isinstance(head, dict) and head.get("v", PROTOCOL_VERSION) != PROTOCOL_VERSION:
        return _other_version(head["v"])  # protocol 3 and earlier: a map {v, t, b}
    return f"header must be an array [version, type, fields...]; got {_short(head)}"


def _build_fields(cls: type[Message], values: list) -> Message:
    """``cls(*values)`` once every positional field is checked against its type hint."""
    signature = (cls, *map(type, values))
    if signature in _PASSED_FIELDS:
        return cls(*values)
    names = _FIELD_TUPLES[cls]
    if len(values) != len(names):
        raise ProtocolError(f"{cls.TYPE} has {len(names)} fields, its header holds {len(values)}")
    message = build_checked(cls, dict(zip(names, values)), cls.TYPE)  # a new signature: check by name
    if len(_PASSED_FIELDS) >= _CACHE_LIMIT:
        _PASSED_FIELDS.clear()
    _PASSED_FIELDS.add(signature)
    return message


#: (class, value type per field) of headers that passed :func:`_build_fields`.
_PASSED_FIELDS: set[tuple] = set()


#: A checked array reference: (frame index, dtype, shape, bytes), what its bytes say.
_ArrayRef = tuple[int, np.dtype, tuple[int, ...], int]


#: Array references already parsed and checked, by their bytes (a few distinct ones per model).
#: The frame-dependent checks (index in range, used once, size of the frame) run every time.
_REFS_SEEN: dict[bytes, _ArrayRef] = {}


def _array_ref(data: bytes) -> _ArrayRef:
    """Parse and check an array reference's bytes: ``[frame index, dtype, shape]``."""
    try:
        index, dtype, shape = msgpack.unpackb(data, raw=False)
    except Exception as exc:
        raise ProtocolError(f"malformed array reference: {exc}") from None
    if not isinstance(index, int) or index < 0:
        raise ProtocolError(f"array reference to frame {index!r}: out of range")
    if not isinstance(dtype, str) or dtype not in WIRE_DTYPES:
        raise ProtocolError(f"array dtype {_short(dtype)} is not allowed; allowed: {', '.join(sorted(WIRE_DTYPES))}")
    if not (isinstance(shape, list) and len(shape) <= MAX_DIMS
            and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise ProtocolError(f"array shape {_short(shape)} must be a list of at most {MAX_DIMS} non-negative ints")
    ref = (index, _WIRE_DTYPE_OBJECTS[dtype], tuple(shape), math.prod(shape) * _WIRE_ITEMSIZE[dtype])
    if len(_REFS_SEEN) >= _CACHE_LIMIT:
        _REFS_SEEN.clear()
    _REFS_SEEN[bytes(data)] = ref
    return ref


_WIRE_DTYPE_OBJECTS = {name: np.dtype(name) for name in WIRE_DTYPES}
