"""C3-SL: R samples bound into one vector by circular convolution with fixed random keys.

Binding is linear, so the receiver's unbinding (circular correlation with the same keys) is
exactly its adjoint: the gradient that crosses back is the gradient with respect to the bound
vectors, R times smaller than the activation gradient, and the sender unbinds it with the
correlation it would have used to decode. Both ends derive the keys from the shared seed.
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch

from . import _wire
from ._cache import LRU, nbytes_of
from .base import Codec, CodecContext, Payload, tensor_meta
from .errors import CompressionError, DesyncError
from .registry import register


#: Row sizes whose keys an instance keeps (each R x D float64); others are rebuilt when seen.
KEY_SIZES = 4

#: What is cached per row size D: the keys, their checksum, their spectra per (dtype, conjugated, device).
_KeyEntry = tuple[torch.Tensor, int, dict[tuple[torch.dtype, bool, torch.device], torch.Tensor]]


def make_keys(r: int, d: int, seed: int) -> torch.Tensor:
    """R keys of length D: N(0, 1/D) entries, each key scaled to unit L2 norm (float64).

    Drawn from a generator seeded with ``seed`` alone, so they do not depend on what else the
    process drew, or on the order in which sizes were first seen.
    """
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(r, d, generator=g, dtype=torch.float64) / math.sqrt(max(d, 1))
    return keys / keys.norm(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)


def bind(keys: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """V_g = sum_i k_i (*) z_{g,i} (circular convolution), for z of shape (G, R, D) -> (G, D)."""
    d = z.shape[-1]
    return _bind(torch.fft.rfft(keys.to(z.dtype), n=d), z)


def unbind(keys: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """z_hat_{g,i} = k_i (x) V_g (circular correlation), for v of shape (G, D) -> (G, R, D).

    This is the adjoint of :func:`bind`: <bind(z), v> == <z, unbind(v)>.
    """
    d = v.shape[-1]
    return _unbind(torch.fft.rfft(keys.to(v.dtype), n=d).conj().resolve_conj(), v)


def _bind(spectrum: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    g, r, d = z.shape
    if g == 0 or d == 0:
        return z.new_zeros(g, d)
    return torch.fft.irfft(torch.fft.rfft(z, n=d).mul_(spectrum).sum(1), n=d)


def _unbind(conj_spectrum: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Unbinding with the keys' spectrum already conjugated (and materialised: a lazy conj view
    makes every product pay for it again)."""
    g, d = v.shape
    r = conj_spectrum.shape[0]
    if g == 0 or d == 0:
        return v.new_zeros(g, r, d)
    return torch.fft.irfft(torch.fft.rfft(v, n=d).unsqueeze(1) * conj_spectrum, n=d)


@register
class C3SL(Codec):
    """Circular-convolution batch compression: B samples travel as ceil(B/R) vectors, R x smaller
    in both directions, keys never sent (only the seed, agreed at handshake).

    Reconstruction is deliberately noisy (relative error about 2 at R=4); models train through
    it, and a sample's decoded value depends on the other samples of its group, so evaluate
    through the codec too. A batch that R does not divide is padded with zero rows, which add
    nothing to the bound vectors; the true count travels in the payload and no sample is lost.
    The payload carries a checksum of the keys, so ends seeded differently fail loudly.

    Keys and their spectra are cached per row size D for the ``KEY_SIZES`` most recent sizes
    only (R x D float64 each), so a peer sending a new row size per message cannot grow them.
    """

    name = "c3sl"
    default_grad_codec = "identity"
    negotiable_options = frozenset({"r"})
    bounded_by = {"r": "max_r"}

    def __init__(self, *, r: int = 4, seed: int = 0) -> None:
        super().__init__(seed=seed)
        if not isinstance(r, int) or isinstance(r, bool) or r < 1:
            raise CompressionError(f"c3sl option r (samples bound per vector) must be an int >= 1, got {r!r}")
        self.r = r
        # a D in use has at most four spectra per device: the working dtype is float32 or float64
        self._keys: LRU[int, _KeyEntry] = LRU(KEY_SIZES)

    def keys(self, d: int) -> torch.Tensor:
        """The R keys for samples of D elements (float64, cached per D)."""
        return self._key_entry(d)[0]

    def _key_entry(self, d: int) -> _KeyEntry:
        def build() -> _KeyEntry:
            keys = make_keys(self.r, d, self.seed)
            return keys, zlib.crc32(keys.numpy().tobytes()), {}

        return self._keys.get(d, build)

    def _spectrum(self, d: int, dtype: torch.dtype, device: torch.device, conj: bool = False) -> torch.Tensor:
        """The keys' rfft (conjugated for unbinding), cached per (D, dtype) with the keys."""
        keys, _, spectra = self._key_entry(d)
        key = (dtype, conj, torch.device(device))
        if key not in spectra:
            spectrum = torch.fft.rfft(keys.to(device=device, dtype=dtype), n=d) if d \
                else torch.zeros(self.r, 0, device=device)
            spectra[key] = spectrum.conj().resolve_conj() if conj else spectrum
        return spectra[key]

    def held_nbytes(self) -> int:
        """The cached keys and spectra: at most ``KEY_SIZES`` row sizes' worth."""
        return sum(nbytes_of(keys) + nbytes_of(list(spectra.values()))
                   for _, (keys, _crc, spectra) in self._keys.items())

    @staticmethod
    def _work(dtype: torch.dtype) -> torch.dtype:
        return torch.float64 if dtype == torch.float64 else torch.float32

    def _grouped(self, x: torch.Tensor, work: torch.dtype) -> torch.Tensor:
        """(B, ...) -> (G, R, D), zero rows appended to fill the last group."""
        b = x.shape[0]
        z = x.detach().to(work).reshape(b, math.prod(x.shape[1:]))
        groups = -(-b // self.r)
        pad = groups * self.r - b
        if pad:
            z = torch.cat([z, z.new_zeros(pad, z.shape[1])])
        return z.reshape(groups, self.r, z.shape[1])

    def _layout(self, payload: Payload, check_keys: bool = True) -> tuple[tuple[int, ...], int, int]:
        """(shape, groups, D) of a payload, after checking it was made with our r (and, unless
        ``check_keys`` is False, with our keys, which builds them for a new D)."""
        self.check(payload)
        shape = _wire.meta_shape(payload)
        if not shape:
            raise CompressionError("c3sl payload names a 0-D shape; c3sl codes batches")
        r = _wire.meta_int(payload, "r", 1, 1 << 30)
        if r != self.r:
            raise CompressionError(f"c3sl payload was bound with r={r}, this end has r={self.r}; both ends must agree")
        d = math.prod(shape[1:])
        groups = -(-shape[0] // self.r)
        # the array is checked before any key is built: a hostile shape must not size an allocation
        _wire.array(payload, "v", None, (groups, d))
        if not check_keys:
            return shape, groups, d
        crc = payload.meta.get("key_crc")
        if crc != self._key_entry(d)[1]:
            raise DesyncError(
                f"c3sl keys differ between the two ends (checksum {crc!r} vs {self._key_entry(d)[1]}): "
                "they were built with different seeds; agree on the seed at handshake"
            )
        return shape, groups, d

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        if x.dim() == 0:
            raise CompressionError("c3sl binds samples of a batch; got a 0-D tensor (add a batch dim)")
        work = self._work(x.dtype)
        z = self._grouped(x, work)
        d = z.shape[-1]
        v = _bind(self._spectrum(d, work, z.device), z).to(x.dtype)
        if x.dtype == torch.float16 and not _wire.all_finite(v) and _wire.all_finite(x):
            raise CompressionError("c3sl bound vectors overflow float16; send float32 activations")
        meta = {**tensor_meta(x), "r": self.r, "key_crc": self._key_entry(d)[1]}
        return Payload(self.name, self.version, {"v": _wire.wire_float(v)}, meta)

    def encode_flops(self, shape: tuple[int, ...], dtype: torch.dtype) -> int:
        """Real FFTs of length D (about 5 D log2 D each): R for the keys, one per row and one
        per bound vector; plus the passes over the tensor."""
        if not shape:
            return super().encode_flops(shape, dtype)
        d, groups = math.prod(shape[1:]), -(-shape[0] // self.r)
        transforms = self.r + groups * self.r + groups
        return transforms * 5 * d * max(d - 1, 1).bit_length() + super().encode_flops(shape, dtype)

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        shape, groups, d = self._layout(payload)
        dtype = _wire.meta_float_dtype(payload)
        v = _wire.tensor(_wire.array(payload, "v", _wire.wire_float_dtype(dtype), (groups, d)), ctx.device)
        work = self._work(dtype)
        z = _unbind(self._spectrum(d, work, v.device, conj=True), v.to(work))
        return z.reshape(groups * self.r, d)[: shape[0]].reshape(shape).to(dtype)

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """Keys for the payload's row size and their spectrum (counted even when cached), the
        bound vectors in the working precision and their spectrum, the R-times wider product
        spectrum, the unbound rows, and the output in its dtype."""
        shape, groups, d = self._layout(payload, check_keys=False)
        dtype = _wire.meta_float_dtype(payload)
        v = _wire.array(payload, "v", _wire.wire_float_dtype(dtype), (groups, d))
        ws, r, f = self._work(dtype).itemsize, self.r, d // 2 + 1
        keys = 4 * r * d * 8 + r * d * ws + 2 * r * f * 2 * ws
        bound = int(v.nbytes) + groups * d * ws + groups * f * 2 * ws
        unbound = 2 * groups * r * f * 2 * ws + groups * r * d * ws
        return keys + bound + unbound + math.prod(shape) * dtype.itemsize

    def decode_flops(self, payload: Payload, ctx: CodecContext) -> int:
        """Real FFTs of length D (about 5 D log2 D each): R for the keys, one per bound vector
        and R per group to unbind; plus a pass per byte allocated."""
        shape, groups, d = self._layout(payload, check_keys=False)
        transforms = self.r + groups + groups * self.r
        return transforms * 5 * d * max(d - 1, 1).bit_length() + self.decode_cost(payload, ctx)

    def decode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """dL/dV (ceil(B/R) x D): binding the gradient is the adjoint of unbinding."""
        shape, _, d = self._layout(payload)
        if tuple(grad.shape) != shape:
            raise CompressionError(f"c3sl decode_adjoint: gradient of shape {list(grad.shape)}, expected {list(shape)}")
        work = self._work(grad.dtype)
        return _bind(self._spectrum(d, work, grad.device), self._grouped(grad, work)).to(grad.dtype)

    def encode_adjoint(self, grad: torch.Tensor, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        """dL/dx per sample: unbinding dL/dV is the adjoint of binding; padding rows are dropped."""
        shape, groups, d = self._layout(payload)
        if tuple(grad.shape) != (groups, d):
            raise CompressionError(
                f"c3sl encode_adjoint: expected the gradient of the bound vectors, shape {[groups, d]}, got {list(grad.shape)}"
            )
        work = self._work(grad.dtype)
        z = _unbind(self._spectrum(d, work, grad.device, conj=True), grad.detach().to(work))
        return z.reshape(groups * self.r, d)[: shape[0]].reshape(shape).to(grad.dtype)

    def state_dict(self) -> dict[str, Any]:
        """Empty: the keys are a function of the seed, so the seed is all a checkpoint needs."""
        return {}
