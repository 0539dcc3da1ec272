"""Low-rank factorisation of each sample's activation (the SFT codec).

Each sample is a matrix M (L x H: tokens x hidden for a (B, L, H) tensor, C x (H*W) for an NCHW
one). The sender sends two thin factors P (L x r, orthonormal columns) and Q = M^T P (H x r), so
the receiver rebuilds M_hat = P Q^T = P P^T M, the projection of M on the span of P. With P held
fixed that map is linear and symmetric, so the gradient that needs to cross back is only
P^T G (r x H), which the sender turns into P P^T G with the P it sent.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from . import _wire
from ._cache import LRU
from .base import Codec, CodecContext, Payload, tensor_meta, to_numpy
from .errors import CompressionError
from .registry import register

_FACTOR_DTYPES = (np.dtype("float16"), np.dtype("float32"), np.dtype("float64"))
_ONE = torch.ones(())
#: Warm-start subspaces kept, one per (H, r) seen; an evicted one restarts from the seed.
WARM_SHAPES = 8


def matrix_view(shape: tuple[int, ...]) -> tuple[int, int, int] | None:
    """(B, L, H) for a batch of per-sample matrices, or None when a sample is not a matrix."""
    if len(shape) < 3:
        return None
    return shape[0], shape[1], math.prod(shape[2:])


def orthonormalize(a: torch.Tensor) -> torch.Tensor:
    """Orthonormal columns spanning ``a``'s (batched QR), with signs fixed so the result does not
    depend on the sign convention of the QR routine and warm starts do not flip from step to step."""
    if a.shape[-1] == 1:
        # One column: Q R with R > 0 is a / |a|, without LAPACK's per-matrix overhead. A zero
        # column gets e1, the column Householder QR gives it (R = 0 counts as positive).
        norm = torch.linalg.vector_norm(a, dim=-2, keepdim=True)
        q = a / norm
        zero = norm == 0
        if bool(zero.any()):
            e1 = torch.zeros_like(a)
            e1[..., 0, :] = 1
            q = torch.where(zero, e1, q)
        return q
    q, r = torch.linalg.qr(a)
    return q.mul_(torch.copysign(_ONE, torch.diagonal(r, dim1=-2, dim2=-1)).unsqueeze(-2))


@register
class LowRank(Codec):
    """Rank-r factors per sample: about L*H / (r*(L+H)) times fewer numbers, both directions.

    Factors come from ``iters`` power iterations started from a subspace kept from the previous
    training step (as in PowerSGD), so one or two iterations track the dominant directions that
    activations share across batches. A tensor whose samples are not matrices (fewer than 3
    dims), or where the factors would not be smaller than the tensor, travels raw; the payload
    says so (``meta["mode"] == "raw"``, with a ``reason``).

    Options: ``rank`` (upper bound; a sample of L x H gets min(rank, L, H)), ``iters`` (power
    iterations per encode), ``fp16`` (send factors in half precision, else in the input dtype).
    The gradient it sends back is P^T G, exact for the decode it did, so the default gradient
    codec is ``identity``.

    Costs: ``iters`` is work on the end that *encodes* (iters batched products of the whole
    tensor); the decoding end never runs power iterations. Decoding is one product of the
    factors, 2 * B * L * H * r operations for an output of B * L * H elements, with r at most
    this end's ``rank`` (a payload claiming more is refused), so decode work is the output size
    times a rank that :class:`~compressors.Bounds` caps.
    """

    name = "lowrank"
    default_grad_codec = "identity"
    negotiable_options = frozenset({"rank", "iters", "fp16"})
    bounded_by = {"rank": "max_rank", "iters": "max_iters"}

    def __init__(self, *, rank: int = 4, iters: int = 2, fp16: bool = True, seed: int = 0) -> None:
        super().__init__(seed=seed)
        for opt, value, lo in (("rank", rank, 1), ("iters", iters, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise CompressionError(f"lowrank option {opt} must be an int >= {lo}, got {value!r}")
        if not isinstance(fp16, bool):
            raise CompressionError(f"lowrank option fp16 must be true or false, got {fp16!r}")
        self.rank, self.iters, self.fp16 = rank, iters, fp16
        self._warm: LRU[tuple[int, int], torch.Tensor] = LRU(WARM_SHAPES)

    # -- sender ----------------------------------------------------------------------------

    def _warm_start(self, h: int, r: int) -> torch.Tensor:
        def fresh() -> torch.Tensor:
            # seeded per (H, r), so the start does not depend on the order shapes were seen in
            g = torch.Generator().manual_seed(self.seed)
            return orthonormalize(torch.randn(h, r, generator=g, dtype=torch.float64)).float()

        return self._warm.get((h, r), fresh)

    def _warm_on(self, h: int, r: int, device: torch.device) -> torch.Tensor:
        """The warm start for (H, r), moved to ``device`` (and kept there for the next batch)."""
        start = self._warm_start(h, r)
        if start.device != device:
            start = start.to(device)
            self._warm.put((h, r), start)
        return start

    def held_nbytes(self) -> int:
        """The warm-start subspaces (at most ``WARM_SHAPES`` of them, H x r float32 each)."""
        return self._warm.nbytes()

    def _raw(self, x: torch.Tensor, reason: str) -> Payload:
        meta = {**tensor_meta(x), "mode": "raw", "reason": reason}
        return Payload(self.name, self.version, {"x": _wire.wire_float(x)}, meta)

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        view = matrix_view(tuple(x.shape))
        if view is None:
            return self._raw(x, "a sample is not a matrix (needs 3 or more dims)")
        b, l, h = view
        r = min(self.rank, l, h)
        raw_dtype = _wire.wire_float_dtype(x.dtype)
        factor_dtype = np.dtype("float16") if self.fp16 else raw_dtype
        if b == 0 or r == 0 or (l + h) * r * factor_dtype.itemsize >= l * h * raw_dtype.itemsize:
            return self._raw(x, "no gain: factors would not be smaller than the tensor")

        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        m = x.detach().to(work).reshape(b, l, h)
        if not _wire.all_finite(m):
            raise CompressionError("lowrank got non-finite values (inf or NaN); they have no low-rank form")
        # Q is carried transposed (B, r, H): P^T M is a fast batched product, M^T P (a transposed
        # view of M on the left) is several times slower. The first product uses the shared
        # (H, r) start as one matrix for the whole batch.
        p = orthonormalize(m @ self._warm_on(h, r, m.device).to(work))
        for _ in range(self.iters - 1):
            # (Q^T M^T)^T: M on the right keeps the product fast, and the result is already in
            # the column-major layout LAPACK's QR works in
            p = orthonormalize(((p.transpose(1, 2) @ m) @ m.transpose(1, 2)).transpose(1, 2))
        # Q is computed from the P that is actually sent, so decode is exactly P P^T M (up to
        # the rounding of Q), the map whose adjoint both ends apply.
        p_wire = p.to(_torch_dtype(factor_dtype))
        qt_full = p_wire.to(work).transpose(1, 2) @ m
        q_wire = qt_full.transpose(1, 2).to(p_wire.dtype, memory_format=torch.contiguous_format)
        if not _wire.all_finite(q_wire):
            return self._raw(x, "fp16 overflow in the factors")
        if ctx.train:
            # One power step on the batch as a whole: the next batch starts from its subspace.
            nxt = orthonormalize(qt_full.sum(0).T.to(torch.float32))
            if _wire.all_finite(nxt):
                self._warm.put((h, r), nxt)
        meta = {**tensor_meta(x), "mode": "lowrank", "rank": r}
        return Payload(self.name, self.version, {"P": to_numpy(p_wire), "Q": to_numpy(q_wire)}, meta)

    def encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Per power iteration two products of the whole tensor with the r-column subspace
        (4 B L H r) and a QR of P (about 4 B L r^2), plus the passes of the casts and checks; a
        tensor that would travel raw costs those passes alone."""
        passes = super().encode_flops(shape, dtype)
        view = matrix_view(tuple(shape))
        if view is None:
            return passes
        b, l, h = view
        r = min(self.rank, l, h)
        raw = _wire.wire_float_dtype(dtype).itemsize if dtype.is_floating_point else 4
        factor = 2 if self.fp16 else raw
        if b == 0 or r == 0 or (l + h) * r * factor >= l * h * raw:
            return passes
        return passes + self.iters * (4 * b * l * h * r + 4 * b * l * r * r) + 4 * h * r * r

    # -- receiver --------------------------------------------------------------------------

    def _factors(self, payload: Payload) -> tuple[np.ndarray, np.ndarray, tuple[int, ...]]:
        """The payload's P and Q arrays (checked, not converted) and the encoded shape."""
        shape = _wire.meta_shape(payload)
        view = matrix_view(shape)
        if view is None:
            raise CompressionError(f"lowrank payload in factor mode for shape {list(shape)}, which is not a batch of matrices")
        b, l, h = view
        r = _wire.meta_int(payload, "rank", 1, max(min(l, h, self.rank), 1))
        p_dtype = getattr(payload.arrays.get("P"), "dtype", None)
        if p_dtype not in _FACTOR_DTYPES:
            raise CompressionError(f"lowrank payload factor P: expected one of float16/32/64, got {p_dtype}")
        p = _wire.array(payload, "P", p_dtype, (b, l, r))
        q = _wire.array(payload, "Q", p_dtype, (b, h, r))
        return p, q, shape

    @staticmethod
    def _work(factor: np.ndarray, device: torch.device | None = None) -> torch.Tensor:
        """A factor as a tensor in the precision the products run in (float32, or float64)."""
        work = torch.float64 if factor.dtype == np.float64 else torch.float32
        return _wire.tensor(factor, device).to(dtype=work)

    def _mode(self, payload: Payload) -> str:
        self.check(payload)
        return _wire.meta_str(payload, "mode", ("lowrank", "raw"))

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        mode = self._mode(payload)
        dtype = _wire.meta_float_dtype(payload)
        if mode == "raw":
            shape = _wire.meta_shape(payload)
            return _wire.tensor(_wire.array(payload, "x", _wire.wire_float_dtype(dtype), shape), ctx.device).to(dtype)
        p, q, shape = self._factors(payload)
        return _outer(self._work(p, ctx.device), self._work(q, ctx.device).transpose(1, 2)).reshape(shape).to(dtype)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """Raw: the copied array and the output. Factors: their copies in the working precision,
        the product P Q^T in it (B x L x H), and the output in its dtype; a rank-1 payload of two
        32768-long fp16 factors (131 KB) names an 8 GiB product."""
        mode = self._mode(payload)
        dtype = _wire.meta_float_dtype(payload)
        if mode == "raw":
            shape = _wire.meta_shape(payload)
            x = _wire.array(payload, "x", _wire.wire_float_dtype(dtype), shape)
            return int(x.nbytes) + math.prod(shape) * dtype.itemsize
        p, q, shape = self._factors(payload)
        work = 8 if p.dtype == np.float64 else 4
        factors = int(p.nbytes + q.nbytes) + (p.size + 2 * q.size) * work
        return factors + math.prod(shape) * (work + dtype.itemsize)

    def decode_flops(self, payload: Payload, ctx: CodecContext) -> int:
        """2 * B * L * H * r for the product of the factors, plus a pass per byte allocated."""
        cost = self.decode_cost(payload, ctx)
        if payload.meta.get("mode") == "raw":
            return cost
        p, _, shape = self._factors(payload)
        return 2 * math.prod(shape) * p.shape[-1] + cost

    def decode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """P^T G per sample (B x r x H): all of the gradient that the sender can use."""
        if self._mode(payload) == "raw":
            return grad
        p_arr, _, shape = self._factors(payload)
        if tuple(grad.shape) != shape:
            raise CompressionError(f"lowrank decode_adjoint: gradient of shape {list(grad.shape)}, expected {list(shape)}")
        b, l, h = matrix_view(shape)  # type: ignore[misc]
        p = self._work(p_arr, grad.device)
        return (p.transpose(1, 2) @ grad.detach().to(p.dtype).reshape(b, l, h)).to(grad.dtype)

    # -- sender, backward ------------------------------------------------------------------

    def encode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """P (P^T G): the gradient of the input, with the P that was sent."""
        if self._mode(payload) == "raw":
            return grad
        p_arr, _, shape = self._factors(payload)
        b, l, h = matrix_view(shape)  # type: ignore[misc]
        r = p_arr.shape[-1]
        if tuple(grad.shape) != (b, r, h):
            raise CompressionError(
                f"lowrank encode_adjoint: expected the receiver's P^T G of shape {[b, r, h]}, got {list(grad.shape)}"
            )
        p = self._work(p_arr, grad.device)
        return _outer(p, grad.detach().to(p.dtype)).reshape(shape).to(grad.dtype)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The warm-start subspaces, one per (H, r) seen: ``warm.<H>x<r>``."""
        return {f"warm.{h}x{r}": q.detach().to("cpu", copy=True) for (h, r), q in sorted(self._warm.items(), key=lambda kv: kv[0])}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        warm: LRU[tuple[int, int], torch.Tensor] = LRU(WARM_SHAPES)
        for key, value in state.items():
            try:
                h, r = (int(v) for v in key.removeprefix("warm.").split("x"))
            except ValueError:
                raise CompressionError(f"lowrank state key {key!r} is not of the form 'warm.<H>x<r>'") from None
            if not key.startswith("warm.") or not isinstance(value, torch.Tensor) or tuple(value.shape) != (h, r):
                raise CompressionError(f"lowrank state {key!r}: expected a tensor of shape ({h}, {r})")
            warm.put((h, r), value.detach().to(torch.float32).clone())
        self._warm = warm


def _outer(p: torch.Tensor, qt: torch.Tensor) -> torch.Tensor:
    """P Q^T for factors of shape (B, L, r) and (B, r, H). At rank 1 that is a broadcast product,
    the same numbers as the batched matmul without its per-matrix overhead."""
    return p * qt if p.shape[-1] == 1 else p @ qt


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return {np.dtype("float16"): torch.float16, np.dtype("float32"): torch.float32,
            np.dtype("float64"): torch.float64}[np.dtype(dtype)]
