"""Codecs that compose by spec: ``outliers:k=4>hadamard>delta>quant:bits=2``.

A chain lists stages in the order an encode applies them; decoding runs them backwards. Every
stage but the last is a :class:`Stage`: a codec that changes what it is given (rotates it, takes
its outlier channels off, subtracts what both ends already hold) and hands the result to the
codec after it, its ``inner``; the last one is any codec. So the frontier of bits against quality
can be searched by writing specs instead of classes, and each composition is a codec like any
other: it prices its decode, is bounded by the receiver's policy stage by stage, and passes the
codec contract.

A stage's payload carries its own arrays and metadata, and its inner codec's payload nested in
it: the inner arrays under their names prefixed with ``>`` (one per level of nesting) and the
inner codec, version and metadata under ``meta["inner"]``. A payload thus names every codec it
went through, and each level checks its own part.

A stage alone (``hadamard``) wraps ``identity``: lossless, and of little use but as a test.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from .base import Codec, CodecContext, Payload
from .errors import CompressionError
from .identity import Identity
from .registry import SEP


class Stage(Codec):
    """A codec that transforms a tensor and hands it to the codec after it in a chain.

    Subclasses implement :meth:`forward` (what the inner codec encodes, plus this stage's own
    arrays and metadata) and :meth:`backward` (the tensor, from what the inner codec decoded and
    this stage's own part). The defaults of the rest compose: costs and held bytes add the inner
    codec's to the stage's own (:meth:`own_decode_cost`, ...), adjoints pass the gradient through
    the stage unchanged to the inner codec's (override them for a transform that is not the
    identity to first order), state nests the inner codec's under ``"inner"``.
    """

    wraps: ClassVar[bool] = True

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.inner: Codec = Identity(seed=seed)

    def wrap(self, inner: Codec) -> None:
        """Make ``inner`` the codec after this stage (a chain is built outside in)."""
        self.inner = inner
        # instance-level: a chain needs sample ids when any of its stages does
        self.needs_sample_ids = type(self).needs_sample_ids or inner.needs_sample_ids

    # -- what a stage implements -----------------------------------------------------------

    def forward(self, x: torch.Tensor, ctx: CodecContext) -> tuple[torch.Tensor, dict[str, Any], dict[str, Any]]:
        """(tensor for the inner codec, own arrays, own metadata) for ``x``."""
        raise NotImplementedError

    def backward(self, y: torch.Tensor, arrays: dict[str, Any], meta: dict[str, Any], ctx: CodecContext) -> torch.Tensor:
        """The tensor, from ``y`` (what the inner codec decoded) and this stage's own part."""
        raise NotImplementedError

    def own_decode_cost(self, arrays: dict[str, Any], meta: dict[str, Any], inner: Payload, ctx: CodecContext) -> int:
        """Bytes :meth:`backward` allocates at peak beyond the inner decode (validating its part)."""
        raise NotImplementedError

    def own_decode_flops(self, arrays: dict[str, Any], meta: dict[str, Any], inner: Payload, ctx: CodecContext) -> int:
        """Arithmetic :meth:`backward` does; by default one operation per byte it allocates."""
        return self.own_decode_cost(arrays, meta, inner, ctx)

    def own_encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Arithmetic :meth:`forward` does for a tensor of ``shape``."""
        raise NotImplementedError

    # -- composition -----------------------------------------------------------------------

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        y, arrays, meta = self.forward(x, ctx)
        return nest(self, arrays, meta, self.inner.encode(y, ctx))

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        arrays, meta, inner = unnest(self, payload)
        return self.backward(self.inner.decode(inner, ctx), arrays, meta, ctx)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        arrays, meta, inner = unnest(self, payload)
        return self.inner.decode_cost(inner, ctx) + self.own_decode_cost(arrays, meta, inner, ctx)

    def decode_flops(self, payload: Payload, ctx: CodecContext) -> int:
        arrays, meta, inner = unnest(self, payload)
        return self.inner.decode_flops(inner, ctx) + self.own_decode_flops(arrays, meta, inner, ctx)

    def encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        return self.own_encode_flops(shape, dtype) + self.inner.encode_flops(shape, dtype)

    def decode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        return self.inner.decode_adjoint(grad, unnest(self, payload)[2], ctx)

    def encode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        return self.inner.encode_adjoint(grad, unnest(self, payload)[2], ctx)

    def held_nbytes(self) -> int:
        return self.own_held_nbytes() + self.inner.held_nbytes()

    def own_held_nbytes(self) -> int:
        """Bytes this stage holds itself (its inner codec's are added by :meth:`held_nbytes`)."""
        return 0

    def state_dict(self) -> dict[str, Any]:
        own, inner = self.own_state_dict(), self.inner.state_dict()
        return {**own, "inner": inner} if inner else own

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        inner = state.pop("inner", {})
        if not isinstance(inner, dict):
            raise CompressionError(f"codec {self.name!r}: state 'inner' must be the next codec's state, a dict")
        self.own_load_state_dict(state)
        self.inner.load_state_dict(inner)

    def own_state_dict(self) -> dict[str, Any]:
        return {}

    def own_load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise CompressionError(f"codec {self.name!r} keeps no state but got state keys {sorted(state)}")

    def __repr__(self) -> str:
        return f"{super().__repr__()}>{self.inner!r}"


def nest(stage: Codec, arrays: dict[str, Any], meta: dict[str, Any], inner: Payload) -> Payload:
    """One payload holding a stage's own part and its inner codec's payload."""
    nested = {SEP + k: a for k, a in inner.arrays.items()}
    return Payload(stage.name, stage.version, {**arrays, **nested},
                   {**meta, "inner": [inner.codec, inner.version, inner.meta]})


def unnest(stage: Codec, payload: Payload) -> tuple[dict[str, Any], dict[str, Any], Payload]:
    """(own arrays, own metadata, inner payload) of a stage's payload, checked for form only."""
    stage.check(payload)
    meta = dict(payload.meta)
    inner = meta.pop("inner", None)
    if not (isinstance(inner, list) and len(inner) == 3 and isinstance(inner[0], str)
            and isinstance(inner[1], int) and not isinstance(inner[1], bool) and isinstance(inner[2], dict)):
        raise CompressionError(f"{stage.name} payload meta 'inner' must be [codec, version, metadata] of the "
                               f"next codec in the chain, got {str(inner)[:80]}")
    own = {k: a for k, a in payload.arrays.items() if not k.startswith(SEP)}
    nested = {k[len(SEP):]: a for k, a in payload.arrays.items() if k.startswith(SEP)}
    return own, meta, Payload(inner[0], inner[1], nested, inner[2])
