"""Turning the values that cross the cut into wire entries, through the configured codecs.

What crosses is a small tree: the positional/keyword arguments of the cloud part, or what it
returned (a tensor, or a tuple such as ``(hidden_states, attentions)``). Its first tensor, the
*stream* (``args[0]`` going in, the output or its first element coming back), is the activation
that flows through the model, and goes through the codec of its slot. Every other tensor
(attention masks, labels, a loss value) crosses unchanged through ``identity``: a lossy codec on
a mask or a label would be a bug, not a saving. A side tensor that merely repeats along some
dimensions (a (B, 1, L, L) attention mask built from a (B, L) padding mask) crosses once and is
repeated on arrival (:func:`compact`), which is lossless.

Slots, named from the edge's point of view:

========  ===================================  =================================
slot      what                                 default
========  ===================================  =================================
fwd       activation at the cut, edge → cloud  identity
bwd       its gradient, cloud → edge           the fwd codec's gradient partner
ret       U-shape trunk output, cloud → edge   same as fwd
ret_bwd   its gradient, edge → cloud           the ret codec's gradient partner
========  ===================================  =================================
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import compressors
from compressors import Codec, CodecContext, Payload
from compressors.base import torch_dtype

from . import tree as trees
from ..errors import ConfigError, ProtocolError, translated
from .protocol import MAX_DIMS, TENSOR_KEY, is_tensor_entry, payload_from_wire, payload_to_wire
from .tree import Leaf as _Leaf  # the skeletons of flatten and of from_wire share one marker
from .tree import KeyPath, path_text

SLOTS = ("fwd", "bwd", "ret", "ret_bwd")
_TUPLE = "$tuple"
_EXPAND = "$expand"
_CACHE = "$cache"
_SAME = "$same"
MAX_CACHE_ID = (1 << 31) - 1


@dataclass(frozen=True)
class Same:
    """A place holding the call's ``index``-th tensor (over its args, kwargs and target), sent before
    (``attn(h, h, h)``): the cloud puts that one object there, as unsplit, so torch's attention takes
    its self-attention path and the places' gradients sum within the cloud's backward."""

    index: int


@dataclass(frozen=True)
class CacheRef:
    """A key/value cache kept in the cloud for this session (generation): only its number crosses,
    never the cache object (see :mod:`splitft.cloud.caches`)."""

    id: int


def is_cache(value: Any) -> bool:
    """A transformers-style key/value cache (``update`` per layer, ``get_seq_length``)."""
    return hasattr(value, "get_seq_length") and callable(getattr(value, "update", None))


def resolve_codecs(fwd: str = "identity", bwd: str | None = None, ret: str | None = None,
                   ret_bwd: str | None = None) -> dict[str, str]:
    """Fill in the default pairing and normalise every spec; bad specs raise ConfigError."""
    try:
        fwd_c = compressors.canonical_spec(fwd)
        bwd_c = compressors.canonical_spec(bwd or compressors.default_grad_spec(fwd_c))
        ret_c = compressors.canonical_spec(ret or fwd_c)
        ret_bwd_c = compressors.canonical_spec(ret_bwd or compressors.default_grad_spec(ret_c))
    except compressors.CompressionError as exc:
        raise ConfigError(str(exc)) from exc
    return {"fwd": fwd_c, "bwd": bwd_c, "ret": ret_c, "ret_bwd": ret_bwd_c}


def slot_seed(seed: int, slot: str) -> int:
    """Distinct, reproducible seeds per slot, so two slots never share keys."""
    return (int(seed) * 1_000_003 + zlib.crc32(slot.encode())) % (2**63)


# ---------------------------------------------------------------- trees


def flatten(tree: Any, where: str = "a value") -> tuple[list[torch.Tensor], Any]:
    """Tensors of a nested tuple/list/dict, in order, and a skeleton that rebuilds the tree.

    Anything else than tensors, None, bool, int, float, str and tuples/lists/dicts of them cannot
    cross the cut (there is no safe way to rebuild an arbitrary object from bytes); it raises a
    :class:`ConfigError` naming where in ``where`` it sits.
    """
    def refuse(node: Any, path: KeyPath) -> Any:
        if isinstance(node, CacheRef):
            return node
        raise ConfigError(_uncrossable(node, where + path_text(path)))

    return trees.flatten(tree, other=refuse, named_tuples=False)


def _uncrossable(node: Any, where: str) -> str:
    kind = type(node).__name__
    if isinstance(node, tuple):  # a named tuple: its fields would arrive as a plain tuple's
        field = (getattr(node, "_fields", None) or ("x",))[0]
        return (f"{where} is a named tuple ({kind}), which would cross the cut as a plain tuple, without its "
                f"field names (out.{field} would fail, hasattr() would say no): return a plain tuple or a dict of "
                "its fields instead")
    text = (f"{where} is a {kind}, which cannot cross the cut: only tensors, None, bool, int, float, "
            "str and tuples/lists/dicts of them can. If the cloud part does not need it, make it None "
            "on the edge; if a cloud module returns it, return a tuple or a dict of its fields")
    if "cache" in kind.lower():
        text += ("; a transformers cache keeps per-layer state that would have to live in the cloud: "
                 "call the model with use_cache=False")
    return text


def distinct(leaves: list[torch.Tensor], skeleton: Any) -> tuple[list[torch.Tensor], Any]:
    """Each tensor of a call once: a tensor given in several places crosses once, its skeleton's
    later places naming the first (:func:`to_wire` sends them as :class:`Same`)."""
    first: dict[int, int] = {}
    kept: list[torch.Tensor] = []
    for t in leaves:
        if first.setdefault(id(t), len(kept)) == len(kept):
            kept.append(t)
    if len(kept) == len(leaves):
        return leaves, skeleton
    where = [first[id(t)] for t in leaves]
    return kept, trees.rebuild(skeleton, lambda leaf, path: _Leaf(where[leaf.index], leaf.expand),
                               is_leaf=lambda node: isinstance(node, _Leaf), other=lambda node, path: node)


def unflatten(skeleton: Any, leaves: list[Any], seen: dict[int, Any] | None = None, base: int = 0) -> Any:
    """Inverse of :func:`flatten`; a leaf that crossed compacted is repeated back to its shape.

    A call's trees rebuilt one after the other (its args, kwargs and target) share ``seen``: what
    each put in place by its index over the call (``base``, the trees' leaves before this one), so
    a :class:`Same` gets that very object."""
    def put(node: Any, path: KeyPath) -> Any:
        if isinstance(node, Same):
            if seen is None or node.index not in seen:
                raise ProtocolError(f"{_SAME} names tensor {node.index}, which no earlier place of the call holds")
            return seen[node.index]
        value = leaves[node.index]
        value = value if node.expand is None else expand(value, node.expand)
        if seen is not None:
            seen[base + node.index] = value
        return value

    return trees.rebuild(skeleton, put, is_leaf=lambda node: isinstance(node, (_Leaf, Same)),
                         other=lambda node, path: node)


def stream_index(skeleton: Any) -> int | None:
    """Index of the stream tensor: the tree itself, or its first element, if that is a tensor."""
    if isinstance(skeleton, (tuple, list)) and skeleton:
        skeleton = skeleton[0]
    return skeleton.index if isinstance(skeleton, _Leaf) else None


def to_wire(skeleton: Any, entries: list[dict], sent: set[int] | None = None) -> Any:
    """Skeleton → msgpack-able tree, leaves replaced by payload entries, tuples tagged. A call's
    trees sent one after the other share ``sent``: a leaf sent before goes as ``{"$same": index}``."""
    if isinstance(skeleton, _Leaf):
        if sent is not None:
            if skeleton.index in sent:
                return {_SAME: skeleton.index}
            sent.add(skeleton.index)
        return entries[skeleton.index]
    if isinstance(skeleton, CacheRef):
        return {_CACHE: skeleton.id}
    if isinstance(skeleton, tuple):
        return {_TUPLE: [to_wire(v, entries, sent) for v in skeleton]}
    if isinstance(skeleton, list):
        return [to_wire(v, entries, sent) for v in skeleton]
    if isinstance(skeleton, dict):
        for key in skeleton:
            if not isinstance(key, str) or key.startswith("$"):
                raise ConfigError(f"dict keys crossing the cut must be strings not starting with '$', got {key!r}")
        return {k: to_wire(v, entries, sent) for k, v in skeleton.items()}
    return skeleton


def from_wire(tree: Any, depth: int = 0, *, before: int | None = None) -> tuple[list[tuple[Payload, bool]], Any]:
    """Wire tree → (payload entries in order, skeleton). Validates structure (hostile input).

    ``before``: the tree is one of a call's (its args, kwargs or target), after trees that held
    this many tensors; it may then name one of those, or one of its own before, by ``$same``
    (:class:`Same`). Elsewhere ``$same`` is refused."""
    entries: list[tuple[Payload, bool]] = []

    def walk(node: Any, depth: int) -> Any:
        if depth > 16:
            raise ProtocolError("value tree nested deeper than 16 levels")
        if is_tensor_entry(node):
            if len(node) != 1:
                raise ProtocolError(f"tensor entry has extra keys {sorted(set(node) - {TENSOR_KEY})}")
            entries.append(payload_from_wire(node))
            return _Leaf(len(entries) - 1)
        if isinstance(node, dict) and _EXPAND in node:
            inner = node[_EXPAND]
            if len(node) != 1 or not isinstance(inner, list) or len(inner) != 2 or not is_tensor_entry(inner[0]):
                raise ProtocolError(f"malformed {_EXPAND} entry: expected [tensor entry, shape]")
            shape = _shape(inner[1])
            payload, grad = payload_from_wire(inner[0])
            if grad:
                raise ProtocolError("a compacted tensor cannot ask for a gradient")
            entries.append((payload, grad))
            return _Leaf(len(entries) - 1, shape)
        if isinstance(node, dict) and _SAME in node:
            index = node[_SAME]
            if before is None or len(node) != 1 or not isinstance(index, int) or isinstance(index, bool) \
                    or not 0 <= index < before + len(entries):
                raise ProtocolError(f"malformed {_SAME} entry: expected the number of a tensor the call sent before")
            return Same(index)
        if isinstance(node, dict) and _CACHE in node:
            number = node[_CACHE]
            if len(node) != 1 or not isinstance(number, int) or isinstance(number, bool) \
                    or not 0 <= number <= MAX_CACHE_ID:
                raise ProtocolError(f"malformed {_CACHE} entry: expected a cache number")
            return CacheRef(number)
        if isinstance(node, dict) and _TUPLE in node:
            items = node[_TUPLE]
            if len(node) != 1 or not isinstance(items, list):
                raise ProtocolError("malformed tuple entry")
            return tuple(walk(v, depth + 1) for v in items)
        if isinstance(node, list):
            return [walk(v, depth + 1) for v in node]
        if isinstance(node, dict):
            return {k: walk(v, depth + 1) for k, v in node.items()}
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise ProtocolError(f"a {type(node).__name__} cannot appear in a value tree")

    try:
        return entries, walk(tree, depth)
    finally:
        # walk refers to itself through its closure: without this the cycle would keep the payloads
        # (views of the received frames, up to a message's size) until the garbage collector ran.
        del walk


def expansions(skeleton: Any) -> dict[int, tuple[int, ...]]:
    """Entry index → the shape a compacted entry repeats to, for every such leaf of ``skeleton``."""
    found: dict[int, tuple[int, ...]] = {}
    stack = [skeleton]  # a loop, not a nested function: one would refer to itself, a cycle per call
    while stack:
        node = stack.pop()
        if isinstance(node, _Leaf):
            if node.expand is not None:
                found[node.index] = node.expand
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
        elif isinstance(node, dict):
            stack.extend(node.values())
    return found


def _shape(value: Any) -> tuple[int, ...]:
    if not (isinstance(value, list) and len(value) <= MAX_DIMS
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in value)):
        raise ProtocolError(f"a shape must be a list of at most {MAX_DIMS} non-negative ints, got {value!r}")
    return tuple(value)


# ---------------------------------------------------------------- side tensors that repeat

MAX_EXPANDED_ELEMENTS = 1 << 28  # a compacted tensor may not unfold into more (a memory bomb guard)


def compact(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` cut to size 1 along every dimension it merely repeats; None when there is none.

    Side tensors are often broadcasts: a transformer's (B, 1, L, L) attention mask is a (B, L)
    padding mask repeated over the query positions. Sending one copy is lossless and, next to a
    compressed activation, the difference between a mask that costs more than the activation and
    one that costs nothing. Floats are compared bit for bit (so -0.0 and 0.0, or NaNs, never merge).
    """
    if x.dim() == 0 or x.numel() <= 1 or x.is_complex():
        return None
    bits = x.view(_SAME_WIDTH_INT[x.element_size()]) if x.is_floating_point() else x
    narrowed = False
    for dim in range(x.dim()):
        if bits.size(dim) > 1:
            first = bits.narrow(dim, 0, 1)
            if torch.equal(bits, first.expand_as(bits)):
                bits, x, narrowed = first, x.narrow(dim, 0, 1), True
    return x if narrowed else None


_SAME_WIDTH_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def expand(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Undo :func:`compact`: repeat ``x`` to ``shape`` (a fresh tensor, safe to write to)."""
    if x.dim() != len(shape) or any(n not in (1, m) for n, m in zip(x.shape, shape)):
        raise ProtocolError(f"a compacted tensor of shape {tuple(x.shape)} cannot be repeated to {shape}")
    if math.prod(shape) > MAX_EXPANDED_ELEMENTS:
        raise ProtocolError(f"a compacted tensor would unfold to {math.prod(shape)} elements "
                            f"(the limit is {MAX_EXPANDED_ELEMENTS})")
    return x.expand(shape).contiguous()


# ---------------------------------------------------------------- codecs per slot


@dataclass
class Coded:
    """One tensor that crossed: its payload (kept for the adjoints) and whether it is the stream."""

    payload: Payload
    stream: bool
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device = torch.device("cpu")  # where the tensor lived: its gradient is decoded there


@dataclass
class Traffic:
    raw: int = 0
    payload: int = 0

    def add(self, tensor: torch.Tensor, payload: Payload) -> None:
        self.raw += tensor.numel() * tensor.element_size()
        self.payload += payload.nbytes


def raw_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of an uncompressed tensor: what a gradient would cost before any adjoint shrinks it."""
    numel = 1
    for d in shape:
        numel *= d
    return numel * dtype.itemsize  # not an empty tensor built to ask it


class SlotCodecs:
    """The codec instances of one end of a link: one per slot, plus identity for side tensors.

    Edge and cloud each build one from the same specs and seed; an instance encodes on one end
    and its twin decodes on the other, so stateful codecs stay in step.
    """

    def __init__(self, specs: dict[str, str], seed: int, bounds: compressors.Bounds | None = None) -> None:
        missing = set(SLOTS) - set(specs)
        if missing:
            raise ConfigError(f"codec specs for slots {sorted(missing)} are missing")
        self.specs = dict(specs)
        with translated():
            self.slots: dict[str, Codec] = {
                slot: compressors.make_codec(specs[slot], seed=slot_seed(seed, slot), bounds=bounds)
                for slot in SLOTS
            }
        self.raw = compressors.make_codec("identity")
        # Those that may hold anything: a codec keeping Codec's own held_nbytes holds nothing, ever.
        self._holding = [codec for codec in self.slots.values() if type(codec).held_nbytes is not Codec.held_nbytes]

    def held_nbytes(self) -> int:
        """Bytes the codecs hold now (buffers, caches): counted against a session's memory."""
        return sum(codec.held_nbytes() for codec in self._holding) if self._holding else 0

    def decode_cost(self, entries: list[tuple[Payload, bool]], stream: int | None, slot: str | None,
                    ctx: CodecContext, expand_to: dict[int, tuple[int, ...]] | None = None) -> int:
        """Bytes that decoding ``entries`` (and repeating compacted ones) will allocate, at most.

        Read from the payloads' metadata alone, so a request can be refused before any of it is
        decoded.
        """
        total = 0
        with translated():
            for i, (payload, _grad) in enumerate(entries):
                codec = self._checked_codec(payload, i, slot, i == stream)
                total += codec.decode_cost(payload, ctx)
                if expand_to and i in expand_to:
                    itemsize = max([a.itemsize for a in payload.arrays.values()] or [8])
                    if isinstance(payload.meta, dict) and "dtype" in payload.meta:
                        itemsize = max(itemsize, torch_dtype(payload.meta["dtype"]).itemsize)
                    total += math.prod(expand_to[i]) * itemsize
        return total

    def decode_flops(self, entries: list[tuple[Payload, bool]], stream: int | None, slot: str | None,
                     ctx: CodecContext, expand_to: dict[int, tuple[int, ...]] | None = None) -> int:
        """Arithmetic that decoding ``entries`` (and repeating compacted ones) will do, at most,
        read from the payloads' metadata alone like :meth:`decode_cost`."""
        total = 0
        with translated():
            for i, (payload, _grad) in enumerate(entries):
                total += self._checked_codec(payload, i, slot, i == stream).decode_flops(payload, ctx)
                if expand_to and i in expand_to:
                    total += math.prod(expand_to[i])
        return total

    def encode_flops(self, tensors: list[tuple[tuple[int, ...], torch.dtype]], stream: int | None,
                     slot: str | None) -> int:
        """Arithmetic that encoding tensors of these (shape, dtype) will do, at most; the
        ``stream`` one through ``slot``'s codec, as :meth:`encode` would."""
        with translated():
            return sum(self._codec(slot, i == stream).encode_flops(shape, dtype)
                       for i, (shape, dtype) in enumerate(tensors))

    def _checked_codec(self, payload: Payload, i: int, slot: str | None, is_stream: bool) -> Codec:
        codec = self._codec(slot, is_stream)
        if payload.codec != codec.name:
            raise ProtocolError(f"tensor {i} was encoded with {payload.codec!r} but this session expects "
                                f"{codec.name!r} there")
        return codec

    def _codec(self, slot: str | None, stream: bool) -> Codec:
        return self.slots[slot] if stream and slot is not None else self.raw

    def encode(self, leaves: list[torch.Tensor], stream: int | None, slot: str | None,
               ctx: CodecContext, grads: list[bool], traffic: Traffic,
               raw: list[int] | None = None) -> tuple[list[dict], list[Coded]]:
        """Encode leaves; the stream one through ``slot``'s codec.

        ``raw`` overrides the uncompressed size counted per leaf (a gradient already shrunk by
        an adjoint still counts as the full gradient it stands for).
        """
        entries, coded = [], []
        with translated():
            for i, tensor in enumerate(leaves):
                if tensor.layout != torch.strided:
                    raise ConfigError(f"a {str(tensor.layout).removeprefix('torch.')} tensor crosses the cut: tensors "
                                      "cross as dense arrays; return t.to_dense(), or keep the layers that use it on "
                                      "one side of the cut")
                is_stream = i == stream
                # a vector (labels) repeats only as one value throughout: its few bytes are not worth
                # a check of three tensor operations, run cold each step
                small = None if is_stream or grads[i] or ctx.role != "activation" or tensor.dim() < 2 \
                    else compact(tensor.detach())
                whole = tensor.detach() if tensor.requires_grad else tensor
                payload = self._codec(slot, is_stream).encode(whole if small is None else small, ctx)
                traffic.add(tensor, payload)
                if raw is not None:
                    traffic.raw += raw[i] - tensor.numel() * tensor.element_size()
                entry = payload_to_wire(payload, grads[i])
                entries.append(entry if small is None else {_EXPAND: [entry, list(tensor.shape)]})
                coded.append(Coded(payload, is_stream, tuple(tensor.shape), tensor.dtype, tensor.device))
        return entries, coded

    def decode(self, entries: list[tuple[Payload, bool]], stream: int | None, slot: str | None,
               ctx: CodecContext) -> tuple[list[torch.Tensor], list[Coded]]:
        tensors, coded = [], []
        with translated():
            for i, (payload, _grad) in enumerate(entries):
                is_stream = i == stream
                codec = self._checked_codec(payload, i, slot, is_stream)
                tensor = codec.decode(payload, ctx)
                if ctx.device is not None and tensor.device != torch.device(ctx.device):
                    tensor = tensor.to(ctx.device)  # a codec that decodes on the host only
                tensors.append(tensor)
                coded.append(Coded(payload, is_stream, tuple(tensor.shape), tensor.dtype, tensor.device))
        return tensors, coded

    def grad_for_sender(self, grad: torch.Tensor, coded: Coded, slot: str | None, ctx: CodecContext) -> torch.Tensor:
        """Receiver side: gradient of a decoded tensor → gradient w.r.t. what was sent."""
        with translated():
            return self._codec(slot, coded.stream).decode_adjoint(grad, coded.payload, ctx)

    def grad_at_input(self, grad: torch.Tensor, coded: Coded, slot: str | None, ctx: CodecContext) -> torch.Tensor:
        """Sender side: gradient w.r.t. what was sent → gradient w.r.t. the tensor encoded."""
        with translated():
            grad = self._codec(slot, coded.stream).encode_adjoint(grad, coded.payload, ctx)
        if grad.shape != coded.shape:  # a reshape is a tensor operation, run cold each step: only where needed
            grad = grad.reshape(coded.shape)
        if grad.dtype != coded.dtype or grad.device != coded.device:
            grad = grad.to(device=coded.device, dtype=coded.dtype)
        return grad

    def state_dict(self) -> dict[str, Any]:
        return {slot: codec.state_dict() for slot, codec in self.slots.items()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with translated():
            for slot, codec in self.slots.items():
                codec.load_state_dict(state.get(slot, {}))


def sample_ids_array(ids: Any) -> np.ndarray | None:
    """Normalise user-given per-sample ids to an int64 array (None stays None)."""
    if ids is None:
        return None
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(f"sample_ids must be a 1-D sequence of integers, got shape {arr.shape} dtype {arr.dtype}")
    return arr.astype(np.int64, copy=False)


__all__ = ["SLOTS", "Same", "SlotCodecs", "Traffic", "distinct", "flatten", "unflatten", "resolve_codecs",
           "stream_index", "to_wire", "from_wire", "sample_ids_array"]
