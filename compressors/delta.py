"""AC-SGD: send each sample's activation as a few-bit change since the last time it was sent.

Both ends keep a buffer m[id] (fp16) of every training sample's last activation. The sender
quantizes z - m[id]; both ends add the same dequantized delta to their own copy, with the same
float32 arithmetic, so the two buffers stay bit-identical and quantization error does not pile
up: m[id] converges to z as the model settles. The price is state that must never diverge, so
every training payload carries each sample's step count and a checksum of its updated row, and
the receiver raises :class:`DesyncError` (touching nothing) when either disagrees.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from typing import Any, NamedTuple

import numpy as np
import torch

from . import _wire, bitpack
from ._cache import LRU, nbytes_of
from ._device import target, use_torch
from ._rows import (device_checksum_nbytes, fits_fp16 as _fits_fp16, gather, hash_weights as _hash_weights,
                    merge as _merge, move_nbytes, place, row_checksums, row_checksums_tensor, row_words,
                    row_words_of, split as _split, store, weight_halves)
from .base import Codec, CodecContext, Payload, tensor_meta
from .errors import CompressionError, DesyncError
from .quant import FP16_MAX, channel_axis, check_bits, dequantize, dequantize_nbytes, quantize, quantize_parts
from .registry import register

log = logging.getLogger(__name__)

#: Buffers that grow on demand stop at this many bytes, so a stray (or hostile) sample id
#: cannot make an end allocate without bound; beyond it, give ``capacity`` (and ``path``).
MAX_GROWN_BYTES = 4 << 30


class _TrainParts(NamedTuple):
    """A training payload's parts, checked against each other and its shape."""

    b: int
    d: int
    bits: int
    ids: np.ndarray
    steps: np.ndarray
    check: np.ndarray
    full: np.ndarray
    x_full: np.ndarray
    packed: np.ndarray
    scale: np.ndarray
    axis: int | None


@register
class ACSGD(Codec):
    """Activation deltas at ``bits`` bits per element, against per-sample buffers on both ends.

    Options:
      ``bits`` (4): bits per element of the delta, fixpoint with one fp16 scale per channel.
      ``warmup`` (1): how many times each sample is sent in full before its deltas start. Counted
        per sample id, so with every sample seen once per epoch, 1 means "the first epoch goes
        uncompressed" without the codec needing to know what an epoch is. 0 starts with deltas
        against a zero buffer.
      ``eval_bits`` (8): evaluation (``ctx.train`` False) sends the activation itself through the
        plain fixpoint quantizer at this width, or uncompressed when 0; buffers are not touched.
      ``capacity`` (0): number of sample ids (max id + 1); 0 grows the buffers as ids come.
      ``path`` (""): keep the buffer in a memory-mapped .npy file there (needs ``capacity``), for
        data sets whose buffers do not fit in memory.
      ``channel_dim`` (1): the dim that gets its own scale, as in ``fixpoint``.

    Training encodes need ``CodecContext.sample_ids``. A full-precision send (warm-up, or a
    resync) carries the activation in its own dtype; both buffers then hold its fp16 value.
    The gradient is not a delta: it goes straight through to the 8-bit fixpoint gradient codec.

    The buffer lives where the traffic is coded: a numpy array on the host, a torch tensor on
    the device of the activations an encode gets (or ``CodecContext.device`` for a decode), so
    only payloads cross PCIe; it moves there on first use (after a checkpoint is loaded, say).

    ``path`` names a file of this machine, so it is local-only: never accepted from a peer; the
    memory map is host memory, so a codec with ``path`` refuses to code on an accelerator.
    The buffers are (largest sample id + 1) x (2 D + 8) bytes, so a peer-facing codec
    (``make_codec(..., bounds=...)``) refuses ids at or beyond ``Bounds.max_ids``, and
    :meth:`decode_cost` counts the growth a payload's ids would cause.
    """

    name = "acsgd"
    #: 2: rows carry a 64-bit weighted-sum checksum ("check") instead of CRC-32 ("crc").
    version = 2
    default_grad_codec = "fixpoint:bits=8"
    needs_sample_ids = True
    negotiable_options = frozenset({"bits", "warmup", "eval_bits", "capacity", "channel_dim"})
    local_options = frozenset({"path"})
    bounded_by = {"capacity": "max_ids", "warmup": "max_warmup"}

    def __init__(self, *, bits: int = 4, warmup: int = 1, eval_bits: int = 8, capacity: int = 0,
                 path: str = "", channel_dim: int = 1, seed: int = 0) -> None:
        super().__init__(seed=seed)
        self.bits = check_bits(bits)
        if eval_bits != 0:
            check_bits(eval_bits)
        self.eval_bits = eval_bits
        for opt, value in (("warmup", warmup), ("capacity", capacity), ("channel_dim", channel_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or (opt != "channel_dim" and value < 0):
                raise CompressionError(f"acsgd option {opt} must be an int{' >= 0' if opt != 'channel_dim' else ''}, got {value!r}")
        if not isinstance(path, str):
            raise CompressionError(f"acsgd option path must be a file path string, got {path!r}")
        if path and capacity == 0:
            raise CompressionError("acsgd option path (a memory-mapped buffer) needs a fixed capacity: add capacity=<number of samples>")
        self.warmup, self.capacity, self.path, self.channel_dim = warmup, capacity, path, channel_dim
        self._buf: np.ndarray | torch.Tensor | None = None  # (ids, D) float16: host array or memmap, or device tensor
        self._steps = np.zeros(0, dtype=np.int64)  # sends applied per id
        self._resync: set[int] = set()
        self._weights: LRU[int, np.ndarray] = LRU(2)  # checksum weights per row size
        self._halves: LRU[tuple[int, str], torch.Tensor] = LRU(2)  # the same, split, on a device

    # -- buffers ---------------------------------------------------------------------------

    def _device(self, device: torch.device | str | None) -> torch.device | None:
        """Where a call on ``device`` codes: None for the host's numpy path, else the torch device."""
        if not use_torch(device):
            return None
        dev = torch.empty(0, device=target(device)).device  # "cuda" named as the tensors name it, "cuda:0"
        if self.path and dev.type != "cpu":
            raise CompressionError(
                f"acsgd option path keeps the buffer in a memory map in host memory, but this codec codes on {dev}; "
                "drop path (a fixed capacity still works) to keep the buffer on the device, or code on the CPU"
            )
        return dev

    def _allocate(self, rows: int, d: int, dev: torch.device | None = None) -> np.ndarray | torch.Tensor:
        if dev is not None and not self.path:
            try:
                return torch.zeros((rows, d), dtype=torch.float16, device=dev)
            except (MemoryError, torch.OutOfMemoryError):
                raise CompressionError(f"acsgd cannot hold buffers for {rows} samples x {d} values on {dev}") from None
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            return np.lib.format.open_memmap(self.path, mode="w+", dtype=np.float16, shape=(rows, d))
        try:
            return np.zeros((rows, d), dtype=np.float16)
        except MemoryError:
            raise CompressionError(
                f"acsgd cannot hold buffers for {rows} samples x {d} values in memory; give path=<file> and capacity"
            ) from None

    def _rows_for(self, ids: np.ndarray, d: int) -> int:
        """Rows the buffers must have to cover ``ids`` with rows of D values (their current rows
        when no growth is needed); raises, allocating nothing, for ids out of range."""
        if self._buf is not None and self._buf.shape[1] != d:
            raise CompressionError(
                f"acsgd buffers hold {self._buf.shape[1]} values per sample but this batch has {d}; "
                "every sample must have the same shape (pad sequences to one length)"
            )
        need = int(ids.max()) + 1 if ids.size else 0
        if self.bounds is not None and need > self.bounds.max_ids:
            raise CompressionError(
                f"acsgd sample id {need - 1} is beyond this end's bound max_ids={self.bounds.max_ids} "
                "(ids must be < max_ids); number samples 0..N-1, or raise Bounds.max_ids on this end"
            )
        have = 0 if self._buf is None else self._buf.shape[0]
        if self.capacity:
            if need > self.capacity:
                raise CompressionError(f"acsgd sample id {need - 1} is out of range: capacity={self.capacity}")
            need = self.capacity
        elif need * (2 * d + 8) > MAX_GROWN_BYTES:
            raise CompressionError(
                f"acsgd sample id {need - 1} would grow the buffers past {MAX_GROWN_BYTES >> 30} GiB; "
                "set capacity=<number of samples> (and path=<file> to keep them on disk)"
            )
        if self._buf is not None and need <= have:
            return have
        return need if self.capacity else max(need, min(2 * have, MAX_GROWN_BYTES // (2 * d + 8)))

    def _growth_nbytes(self, ids: np.ndarray, d: int) -> int:
        """Bytes :meth:`_ensure` would allocate for ``ids``: new buffer and step arrays, made
        before the old ones are released."""
        rows = self._rows_for(ids, d)
        if self._buf is not None and rows == self._buf.shape[0]:
            return 0
        return rows * (2 * d + 8)

    def _ensure(self, ids: np.ndarray, d: int, dev: torch.device | None = None) -> np.ndarray | torch.Tensor:
        """The buffer, where a call on ``dev`` codes (:meth:`_device`), after making sure it has
        rows of D values covering every id in ``ids``."""
        rows = self._rows_for(ids, d)
        if not self.path:  # a memory map stays one; the device path on the CPU works on a view of it
            self._buf = place(self._buf, dev)
        have = 0 if self._buf is None else self._buf.shape[0]
        if self._buf is not None and rows == have:
            return self._buf
        grown = self._allocate(rows, d, dev)
        if self._buf is not None:
            grown[:have] = self._buf
        self._buf = grown
        self._steps = np.concatenate([self._steps, np.zeros(rows - have, dtype=np.int64)])
        return grown

    def _check_ids(self, ids: Any, count: int, where: str) -> np.ndarray:
        if ids is None:
            raise CompressionError(
                f"acsgd needs {where} when training: one stable integer id per sample (its index in "
                "the data set), so both ends can find that sample's buffer; got none"
            )
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu" or ids.shape != (count,):
            raise CompressionError(
                f"acsgd {where} must be {count} integers (one per sample), got dtype {ids.dtype} shape {ids.shape}"
            )
        ids = ids.astype(np.int64)
        ordered = np.sort(ids)  # one sort answers both questions
        if ids.size and ordered[0] < 0:
            raise CompressionError(f"acsgd {where} must be >= 0, got {int(ordered[0])}")
        if (ordered[1:] == ordered[:-1]).any():
            raise CompressionError(f"acsgd {where} repeat within one batch; each sample may appear once per batch")
        return ids

    def request_resync(self, ids: Iterable[int]) -> None:
        """Send these samples in full precision the next time they are encoded for training.

        Call it on the sender with ``DesyncError.ids`` from the receiver; the full send resets
        the sample's buffer and step count on both ends.
        """
        self._resync.update(int(i) for i in ids)

    def held_nbytes(self) -> int:
        """The per-sample buffer (memory-mapped or not) and step counts, pending resync ids and
        the checksum weights."""
        return (nbytes_of(self._buf) + int(self._steps.nbytes) + 64 * len(self._resync)
                + self._weights.nbytes() + self._halves.nbytes())

    def _checksums(self, rows: np.ndarray) -> np.ndarray:
        n = row_words(rows)
        return row_checksums(rows, self._weights.get(n, lambda: _hash_weights(n)))

    def _device_checksums(self, rows: torch.Tensor) -> np.ndarray:
        """:meth:`_checksums` of fp16 rows summed on their device; the same values."""
        n, dev = row_words_of(rows.shape[1]), rows.device
        halves = self._halves.get((n, str(dev)), lambda: weight_halves(self._weights.get(n, lambda: _hash_weights(n)), dev))
        return row_checksums_tensor(rows, halves)

    @property
    def pending_resync(self) -> list[int]:
        """Sample ids that will go in full precision at their next training send."""
        return sorted(self._resync)

    # -- encode ----------------------------------------------------------------------------

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        if x.dim() == 0:
            raise CompressionError("acsgd codes a batch of samples; got a 0-D tensor (add a batch dim)")
        if not ctx.train:
            return self._encode_eval(x)
        b, shape = x.shape[0], tuple(x.shape)
        d = math.prod(shape[1:])
        ids = self._check_ids(ctx.sample_ids, b, "CodecContext.sample_ids")
        if not _wire.all_finite(x):
            raise CompressionError("acsgd got non-finite activations (inf or NaN); they would poison both buffers")
        dev = self._device(x.device)  # None: x is on the host, coded with numpy
        buf = self._ensure(ids, d, dev)
        steps = self._steps[ids].copy()
        full = steps < self.warmup
        if ctx.resync:
            full[:] = True
        elif self._resync:
            full |= np.isin(ids, np.fromiter(self._resync, dtype=np.int64))
        keep = ~full
        axis = channel_axis(len(shape), self.channel_dim)

        x_full, z_keep = _split(x.detach().reshape(b, d), full)
        m = gather(buf, ids[keep], dev)
        delta = (z_keep.to(torch.float32) - m).reshape(-1, *shape[1:])
        packed, scale, codes, step = quantize_parts(delta, self.bits, axis)
        # m + deQ(q) as _updated computes it from the payload, without unpacking the codes just
        # packed; range-checked in float32, rounded to the fp16 rows by _merge
        updated = codes.mul_(step).reshape(m.shape).add_(m)
        full16 = x_full.to(torch.float16)
        if not (_fits_fp16(updated) and _wire.all_finite(full16)):
            raise CompressionError(
                f"acsgd keeps fp16 buffers, and this activation reaches |x| = {x.abs().max().item():.3g} > {FP16_MAX:g}; "
                "normalise it or use another codec"
            )
        rows = _merge(full, full16, updated, torch.float16)
        check = self._checksums(rows.numpy()) if dev is None else self._device_checksums(rows)

        store(buf, ids, rows, dev)
        self._steps[ids] += 1
        self._resync.difference_update(ids.tolist())
        arrays = {
            "ids": ids, "steps": steps, "check": check, "full": np.packbits(full, bitorder="little"),
            "x": _wire.wire_float(x_full.reshape(-1, *shape[1:])), "q": packed, "scale": scale,
        }
        meta = {**tensor_meta(x), "mode": "train", "bits": self.bits, "axis": axis}
        return Payload(self.name, self.version, arrays, meta)

    def _encode_eval(self, x: torch.Tensor) -> Payload:
        meta: dict[str, Any] = {**tensor_meta(x), "mode": "eval", "bits": self.eval_bits}
        if self.eval_bits == 0:
            return Payload(self.name, self.version, {"x": _wire.wire_float(x)}, meta)
        axis = channel_axis(x.dim(), self.channel_dim)
        packed, scale = quantize(x, self.eval_bits, axis)
        return Payload(self.name, self.version, {"q": packed, "scale": scale}, {**meta, "axis": axis})

    @staticmethod
    def _updated(m: torch.Tensor, packed: np.ndarray, scale: np.ndarray, bits: int, axis: int | None,
                 shape: tuple[int, ...]) -> torch.Tensor:
        """fp16(m + deQ(q)) on m's device: the one computation both ends must do identically."""
        deq = dequantize(packed, scale, bits, shape, axis, m.device).reshape(m.shape)
        return deq.add_(m).to(torch.float16)

    # -- decode ----------------------------------------------------------------------------

    def _quantized(self, payload: Payload, shape: tuple[int, ...], bits: int) -> tuple[np.ndarray, np.ndarray, int | None]:
        axis = payload.meta.get("axis")
        if axis is not None:
            axis = _wire.meta_int(payload, "axis", 0, len(shape) - 1)
            if len(shape) < 2:
                raise CompressionError(f"acsgd payload: axis {axis} given for a {len(shape)}-D tensor")
        count = 1 if axis is None else shape[axis]
        scale = _wire.array(payload, "scale", np.float16, (count,))
        packed = _wire.array(payload, "q", np.uint8, (bitpack.packed_nbytes(math.prod(shape), bits),))
        return packed, scale, axis

    def _header(self, payload: Payload) -> tuple[str, tuple[int, ...], torch.dtype]:
        self.check(payload)
        mode = _wire.meta_str(payload, "mode", ("train", "eval"))
        shape = _wire.meta_shape(payload)
        dtype = _wire.meta_float_dtype(payload)
        if not shape:
            raise CompressionError("acsgd payload names a 0-D shape; acsgd codes batches")
        return mode, shape, dtype

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """Evaluation: as ``fixpoint`` (or the copied array). Training: the growth of the
        buffers to the largest sample id named, the rows gathered from them, the dequantized
        deltas, the updated fp16 rows and their checksum, and the output in its dtype."""
        mode, shape, dtype = self._header(payload)
        n, out = math.prod(shape), math.prod(shape) * dtype.itemsize
        if mode == "eval":
            bits = _wire.meta_int(payload, "bits", 0, 16)
            if bits == 0:
                return int(_wire.array(payload, "x", _wire.wire_float_dtype(dtype), shape).nbytes) + out
            if bits < 2:
                raise CompressionError(f"acsgd eval payload: bits {bits} is not 0 or 2..16")
            self._quantized(payload, shape, bits)
            return dequantize_nbytes(n, bits) + out + (bitpack.unpack_tensor_nbytes(n, bits) if use_torch(ctx.device) else 0)
        t = self._train_parts(payload, shape, dtype)
        b, d, n_keep = t.b, t.d, t.b - t.x_full.shape[0]
        # buffer rows gathered, in float32, the dequantized deltas, their sum back in fp16
        kept = n_keep * d * (2 + 4 + 2) + dequantize_nbytes(n_keep * d, t.bits)
        # the merged fp16 rows and a converted copy of one part, and the checksum's padded rows
        merged = 2 * n * 2 + b * (2 * d + 4)
        weights = 0 if row_words_of(d) in self._weights else 6 * 8 * row_words_of(d)
        dev = self._device(ctx.device)
        merged += 0 if self.path else move_nbytes(self._buf, dev)  # the buffer's move to where this decode runs
        if dev is not None:  # the payload's copies there, the torch kernels' temporaries
            merged += (t.packed.nbytes + bitpack.unpack_tensor_nbytes(n_keep * d, t.bits) + device_checksum_nbytes(b, d)
                       + 16 * row_words_of(d))
        # the output, and a converted copy of one part, plus the ids' sorted and cast copies
        return self._growth_nbytes(t.ids, d) + int(t.x_full.nbytes) + kept + merged + weights + 2 * out + 64 * b

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        mode, shape, dtype = self._header(payload)
        if mode == "eval":
            bits = _wire.meta_int(payload, "bits", 0, 16)
            if bits == 0:
                return _wire.tensor(_wire.array(payload, "x", _wire.wire_float_dtype(dtype), shape), ctx.device).to(dtype)
            if bits < 2:
                raise CompressionError(f"acsgd eval payload: bits {bits} is not 0 or 2..16")
            packed, scale, axis = self._quantized(payload, shape, bits)
            return dequantize(packed, scale, bits, shape, axis, ctx.device).to(dtype)
        return self._decode_train(payload, shape, dtype, ctx)

    def _train_parts(self, payload: Payload, shape: tuple[int, ...], dtype: torch.dtype) -> _TrainParts:
        b, d = shape[0], math.prod(shape[1:])
        bits = _wire.meta_int(payload, "bits", 2, 16)
        ids = self._check_ids(_wire.array(payload, "ids", np.int64, (b,)), b, "payload ids")
        steps = _wire.array(payload, "steps", np.int64, (b,))
        check = _wire.array(payload, "check", np.uint64, (b,))
        full = np.unpackbits(_wire.array(payload, "full", np.uint8, ((b + 7) // 8,)), count=b, bitorder="little").astype(bool)
        n_full = int(full.sum())
        x_full = _wire.array(payload, "x", _wire.wire_float_dtype(dtype), (n_full, *shape[1:]))
        packed, scale, axis = self._quantized(payload, (b - n_full, *shape[1:]), bits)
        return _TrainParts(b, d, bits, ids, steps, check, full, x_full, packed, scale, axis)

    def _decode_train(self, payload: Payload, shape: tuple[int, ...], dtype: torch.dtype,
                      ctx: CodecContext) -> torch.Tensor:
        b, d, bits, ids, steps, check, full, x_arr, packed, scale, axis = self._train_parts(payload, shape, dtype)
        if ctx.sample_ids is not None and not np.array_equal(np.asarray(ctx.sample_ids), ids):
            raise CompressionError("acsgd payload carries other sample ids than CodecContext.sample_ids on this end")
        keep = ~full
        n_full = x_arr.shape[0]
        delta_shape = (b - n_full, *shape[1:])
        dev = self._device(ctx.device)  # None: decoded on the host, with numpy

        buf = self._ensure(ids, d, dev)
        behind = keep & (self._steps[ids] != steps)
        if behind.any():
            bad = ids[behind]
            here, there = self._steps[bad[0]], steps[behind][0]
            raise DesyncError(
                f"acsgd buffers out of step for {bad.size} sample(s) (e.g. id {bad[0]}: step {here} here, "
                f"{there} at the sender): a message was lost, repeated or reordered; the sender must "
                "resend these samples in full (request_resync(ids) or CodecContext(resync=True))",
                ids=bad.tolist(), reason="steps",
            )
        x_full = _wire.tensor(x_arr, dev).reshape(n_full, d)
        m = gather(buf, ids[keep], dev)
        updated = self._updated(m, packed, scale, bits, axis, delta_shape)
        rows = _merge(full, x_full, updated, torch.float16)
        wrong = (self._checksums(rows.numpy()) if dev is None else self._device_checksums(rows)) != check
        if wrong.any():
            bad = ids[wrong]
            raise DesyncError(
                f"acsgd buffer checksum differs for {bad.size} sample(s) (e.g. id {bad[0]}) although the "
                "step counts agree: the two ends' buffers diverged (different checkpoints?); resend them in full",
                ids=bad.tolist(), reason="checksum",
            )

        store(buf, ids, rows, dev)
        self._steps[ids] = steps + 1
        # full rows decode to what was sent, the others to the fp16 buffer row
        return _merge(full, x_full, updated, dtype).reshape(shape)

    # -- state -----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """``buffer`` (ids x D, fp16), ``steps`` (per id) and ``resync`` (pending ids), all on
        the host wherever the codec runs, so a checkpoint written on a GPU resumes on a CPU.

        With ``path`` the buffer is a view of the memory map, not a copy.
        """
        if self._buf is None:
            return {"resync": torch.tensor(self.pending_resync, dtype=torch.int64)} if self._resync else {}
        if isinstance(self._buf, torch.Tensor):
            buf = self._buf.detach().to("cpu", copy=True)
        else:
            buf = torch.from_numpy(self._buf if self.path else self._buf.copy())
        return {"buffer": buf, "steps": torch.from_numpy(self._steps.copy()),
                "resync": torch.tensor(self.pending_resync, dtype=torch.int64)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"buffer", "steps", "resync"}
        if unknown:
            raise CompressionError(f"acsgd state has unknown keys {sorted(unknown)}; expected buffer, steps, resync")
        buf, steps = state.get("buffer"), state.get("steps")
        if (buf is None) != (steps is None):
            raise CompressionError("acsgd state needs both 'buffer' and 'steps', or neither")
        resync = state.get("resync", torch.zeros(0, dtype=torch.int64))
        if buf is None:
            self._buf, self._steps = None, np.zeros(0, dtype=np.int64)
        else:
            if not (isinstance(buf, torch.Tensor) and buf.dtype == torch.float16 and buf.dim() == 2):
                raise CompressionError("acsgd state 'buffer' must be a 2-D float16 tensor (ids x values per sample)")
            if not (isinstance(steps, torch.Tensor) and steps.dtype == torch.int64 and tuple(steps.shape) == (buf.shape[0],)):
                raise CompressionError(f"acsgd state 'steps' must be an int64 tensor of {buf.shape[0]} counts")
            if self.capacity and buf.shape[0] != self.capacity:
                raise CompressionError(f"acsgd state holds {buf.shape[0]} ids but this codec has capacity={self.capacity}")
            self._load_buffer(buf.detach())
            self._steps = steps.detach().cpu().numpy().astype(np.int64).copy()
        self._resync = {int(i) for i in torch.as_tensor(resync).tolist()}
        log.debug("acsgd state loaded: %d ids, %d pending resync", self._steps.size, len(self._resync))

    def _load_buffer(self, buf: torch.Tensor) -> None:
        """Copy a saved buffer into the one this codec holds when the shapes match (on its device;
        ``buf`` may be a view of this very memory map), else into a new host one, which moves to
        where the codec runs at its next call."""
        if isinstance(self._buf, torch.Tensor) and tuple(self._buf.shape) == tuple(buf.shape):
            self._buf.copy_(buf)
            return
        src = buf.cpu().numpy()
        if isinstance(self._buf, np.ndarray) and self._buf.shape == src.shape:
            target = self._buf
        else:
            target = self._allocate(*src.shape)
        target[:] = src
        self._buf = target
