"""AC-SGD as a chain stage: each sample crosses as its change since it last crossed, coded by
whatever codec comes after (``hadamard>delta>quant:bits=2``).

Both ends keep a float16 row per training sample of what the receiver last decoded for it. The
sender hands ``x - m[id]`` to the next codec, decodes its own payload as the receiver will, and
both set ``m[id] = fp16(m[id] + decoded)`` with the same float32 arithmetic, so the rows stay
bit-identical and the quantization error does not pile up: it is sent again, smaller, next time.
With ``warmup=0`` (the default here, unlike ``acsgd``'s full-precision first epoch) a sample's
first send is the next codec applied to the sample itself, so a short fine-tune gains from its
first step; later sends carry only what changed plus the error left last time. A batch holding
first sends is coded with ``CodecContext.first`` set, so the next codec may spend more bits on
it (``quant:first_bits``). The next codec's decode must be reproducible bit for bit on both
ends (the quantizers' are: a table lookup and a product per value); rotate outside the delta
(``hadamard>delta>...``) to keep it so.

Every training payload carries each sample's step count and a checksum of its updated row, and
the receiver raises :class:`DesyncError` (touching nothing) when either disagrees, as ``acsgd``
does; a resend with ``CodecContext.resync`` sends the rows in full and resets both ends.
Evaluation sends go to the next codec as they are and touch no row.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import torch

from . import _wire
from ._buffers import SampleRows, check_ids, row_count
from ._device import target, use_torch
from ._rows import gather, merge, split, store
from .base import Codec, CodecContext, Payload, tensor_meta
from .chain import Stage, nest, unnest
from .errors import CompressionError, DesyncError
from .quant import FP16_MAX
from .registry import register


@register
class Delta(Stage):
    """Sends each training sample's change since its last send, through the next codec.

    Options: ``warmup`` (0): sends per sample in full precision before deltas start (0: the first
    send is the next codec applied to the sample itself); ``capacity`` (0): number of sample ids,
    0 to grow the rows as ids come. Needs ``CodecContext.sample_ids`` when training; the rows
    take (largest id + 1) x (2 D + 8) bytes on each end, D values per sample, bounded by
    ``Bounds.max_ids`` for a peer. The gradient passes through to the next codec's adjoint.
    """

    name = "delta"
    needs_sample_ids = True
    negotiable_options = frozenset({"warmup", "capacity"})
    bounded_by = {"capacity": "max_ids", "warmup": "max_warmup"}

    def __init__(self, *, warmup: int = 0, capacity: int = 0, seed: int = 0) -> None:
        super().__init__(seed=seed)
        for opt, value in (("warmup", warmup), ("capacity", capacity)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise CompressionError(f"delta option {opt} must be an int >= 0, got {value!r}")
        self.warmup, self.capacity = warmup, capacity
        self.rows = SampleRows(self.name, capacity)
        self.needs_sample_ids = True

    def wrap(self, inner: Codec) -> None:
        if inner.needs_sample_ids:
            raise CompressionError(f"delta cannot wrap {inner.name!r}, which keeps state per sample itself: the "
                                   "sender decodes its own payload to stay in step, which would advance that state twice")
        super().wrap(inner)
        self.needs_sample_ids = True

    def _device(self, device: torch.device | str | None) -> torch.device | None:
        return torch.empty(0, device=target(device)).device if use_torch(device) else None

    # -- encode ----------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        if x.dim() == 0:
            raise CompressionError("delta codes a batch of samples; got a 0-D tensor (add a batch dim)")
        if not ctx.train:
            return nest(self, {}, {**tensor_meta(x), "mode": "eval"}, self.inner.encode(x, ctx))
        shape = tuple(x.shape)
        b, d = row_count(shape)
        ids = check_ids(ctx.sample_ids, b, "CodecContext.sample_ids", self.name)
        if not _wire.all_finite(x):
            raise CompressionError("delta got non-finite activations (inf or NaN); they would poison both ends' rows")
        dev = self._device(x.device)
        buf = self.rows.ensure(ids, d, self.bounds, dev)
        steps = self.rows.steps[ids].copy()
        full = np.ones(b, dtype=bool) if ctx.resync else steps < self.warmup
        x_full, z_keep = split(x.detach().reshape(b, d), full)
        m = gather(buf, ids[~full], dev)
        change = (z_keep.to(torch.float32) - m).reshape(-1, *shape[1:])
        first = bool((steps[~full] == 0).any())  # a sample the receiver holds nothing of yet
        inner = self.inner.encode(change, dataclasses.replace(ctx, first=first))
        decoded = self.inner.decode(inner, CodecContext(ctx.role, ctx.train, ctx.step, None, False, dev))
        updated = self._updated(m, decoded)
        rows = merge(full, x_full.to(torch.float16), updated, torch.float16)
        check = self.rows.checksums(rows)
        store(buf, ids, rows, dev)
        self.rows.steps[ids] += 1
        arrays = {"ids": ids, "steps": steps, "check": check, "full": np.packbits(full, bitorder="little"),
                  "x": _wire.wire_float(x_full.reshape(-1, *shape[1:]))}
        return nest(self, arrays, {**tensor_meta(x), "mode": "train"}, inner)

    def _updated(self, m: torch.Tensor, decoded: torch.Tensor) -> torch.Tensor:
        """fp16(m + decoded change), the one computation both ends must do alike; refuses rows
        beyond float16's range."""
        if tuple(decoded.shape[:1]) != (m.shape[0],) or decoded.numel() != m.numel():
            raise CompressionError(f"delta payload: the next codec decoded shape {tuple(decoded.shape)} for "
                                   f"{m.shape[0]} changes of {m.shape[1]} values")
        total = decoded.to(device=m.device, dtype=torch.float32).reshape(m.shape) + m
        if total.numel() and not bool(total.abs().amax() < 65520.0):
            raise CompressionError(f"delta keeps fp16 rows, and a row reaches beyond {FP16_MAX:g} (or is not finite); "
                                   "normalise the activations or use another codec")
        return total.to(torch.float16)

    # -- decode ----------------------------------------------------------------------------

    def _train_parts(self, arrays: dict[str, Any], meta: dict[str, Any]
                     ) -> tuple[tuple[int, ...], torch.dtype, np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        own = Payload(self.name, self.version, arrays, meta)
        shape, dtype = _wire.meta_shape(own), _wire.meta_float_dtype(own)
        if not shape:
            raise CompressionError("delta payload names a 0-D shape; delta codes batches")
        b = shape[0]
        ids = check_ids(_wire.array(own, "ids", np.int64, (b,)), b, "payload ids", self.name)
        steps = _wire.array(own, "steps", np.int64, (b,))
        check = _wire.array(own, "check", np.uint64, (b,))
        full = np.unpackbits(_wire.array(own, "full", np.uint8, ((b + 7) // 8,)), count=b, bitorder="little").astype(bool)
        x_full = _wire.array(own, "x", _wire.wire_float_dtype(dtype), (int(full.sum()), *shape[1:]))
        return shape, dtype, ids, steps, check, full, x_full

    def _mode(self, payload: Payload) -> tuple[dict[str, Any], dict[str, Any], Payload, str]:
        arrays, meta, inner = unnest(self, payload)
        mode = _wire.meta_str(Payload(self.name, self.version, arrays, meta), "mode", ("train", "eval"))
        if mode == "eval" and arrays:
            raise CompressionError(f"delta evaluation payload carries arrays of its own ({sorted(arrays)}); it has none")
        return arrays, meta, inner, mode

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        arrays, meta, inner, mode = self._mode(payload)
        if mode == "eval":
            own = Payload(self.name, self.version, arrays, meta)
            y = self.inner.decode(inner, ctx)
            if tuple(y.shape) != _wire.meta_shape(own):
                raise CompressionError(f"delta payload: the next codec decoded shape {tuple(y.shape)}, expected "
                                       f"{_wire.meta_shape(own)}")
            return y.to(_wire.meta_float_dtype(own))
        shape, dtype, ids, steps, check, full, x_arr = self._train_parts(arrays, meta)
        if ctx.sample_ids is not None and not np.array_equal(np.asarray(ctx.sample_ids), ids):
            raise CompressionError("delta payload carries other sample ids than CodecContext.sample_ids on this end")
        b, d = row_count(shape)
        dev = self._device(ctx.device)
        buf = self.rows.ensure(ids, d, self.bounds, dev)
        behind = ~full & (self.rows.steps[ids] != steps)
        if behind.any():
            bad = ids[behind]
            raise DesyncError(
                f"delta rows out of step for {bad.size} sample(s) (e.g. id {bad[0]}: step {self.rows.steps[bad[0]]} "
                f"here, {steps[behind][0]} at the sender): a message was lost, repeated or reordered; the sender must "
                "resend these samples in full (CodecContext(resync=True))", ids=bad.tolist(), reason="steps")
        x_full = _wire.tensor(x_arr, dev).reshape(-1, d)
        m = gather(buf, ids[~full], dev)
        updated = self._updated(m, self.inner.decode(inner, ctx))
        rows = merge(full, x_full.to(torch.float16), updated, torch.float16)
        wrong = self.rows.checksums(rows) != check
        if wrong.any():
            bad = ids[wrong]
            raise DesyncError(f"delta row checksum differs for {bad.size} sample(s) (e.g. id {bad[0]}) although the "
                              "step counts agree: the two ends' rows diverged; resend them in full",
                              ids=bad.tolist(), reason="checksum")
        store(buf, ids, rows, dev)
        self.rows.steps[ids] = steps + 1
        return merge(full, x_full, updated, dtype).reshape(shape)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The next codec's decode, and for training: the growth of the rows to the largest id
        named, the rows gathered, their sum with the change, the merged rows and their
        checksum, the output in its dtype."""
        arrays, meta, inner, mode = self._mode(payload)
        cost = self.inner.decode_cost(inner, ctx)
        if mode == "eval":
            own = Payload(self.name, self.version, arrays, meta)
            return cost + math.prod(_wire.meta_shape(own)) * _wire.meta_float_dtype(own).itemsize
        shape, dtype, ids, _, _, full, x_arr = self._train_parts(arrays, meta)
        b, d = row_count(shape)
        n_keep = b - int(full.sum())
        kept = n_keep * d * (4 + 4 + 4 + 2)
        merged = 2 * b * d * 2 + self.rows.checksum_nbytes(b, d) + 2 * b * d * dtype.itemsize + 64 * b
        return cost + self.rows.growth_nbytes(ids, d, self.bounds) + int(x_arr.nbytes) * 3 + kept + merged

    def decode_flops(self, payload: Payload, ctx: CodecContext) -> int:
        return self.decode_cost(payload, ctx)

    def decode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """Straight through, as AC-SGD's: the gradient of a sample is not a change."""
        return grad

    def encode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        return grad

    def encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """The change and the update per value, the checksum, and the next codec's encode twice
        (the sender decodes its own payload; a decode does about what an encode does)."""
        return 16 * math.prod(shape) + 2 * self.inner.encode_flops(shape, dtype)

    def own_held_nbytes(self) -> int:
        return self.rows.nbytes()

    def own_state_dict(self) -> dict[str, Any]:
        return self.rows.state_dict()

    def own_load_state_dict(self, state: dict[str, Any]) -> None:
        self.rows.load_state_dict(state)
