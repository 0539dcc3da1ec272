"""B-SL: binarized edge layers and the 1-bit codec for their +-1 smashed data.

When the edge ends in a sign activation its output is +-1, so one bit per element carries it
exactly: 32x less than fp32 on the forward link. The building blocks for such an edge model are
here too (sign with a straight-through gradient, binary-weight Linear and Conv2d), because the
codec is only lossless for what they produce.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import _wire, bitpack
from ._device import download, upload, use_torch
from .base import Codec, CodecContext, Payload, tensor_meta
from .errors import CompressionError
from .registry import register


class _SignSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return torch.where(x >= 0, 1.0, -1.0).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * (x.abs() <= 1).to(grad.dtype)


def sign_ste(x: torch.Tensor) -> torch.Tensor:
    """sign(x) with sign(0) = +1, and the straight-through gradient 1{|x| <= 1}.

    The true derivative of sign is zero almost everywhere; passing the gradient through where
    |x| <= 1 (the derivative of a hard tanh) is what lets binarized layers train.
    """
    return _SignSTE.apply(x)


class BinaryActivation(nn.Module):
    """The sign activation of a binarized network (put it after BatchNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sign_ste(x)


class BinaryLinear(nn.Linear):
    """A Linear layer whose forward uses sign(latent weight); the latent fp32 weight trains.

    Keep the latent weights in [-1, 1] (:meth:`clip_` after each optimizer step, or
    :func:`keep_latent_weights_clipped`): beyond that range the straight-through gradient is zero
    and a weight would be stuck. The bias, if any, stays real.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, sign_ste(self.weight), self.bias)

    @torch.no_grad()
    def clip_(self) -> None:
        self.weight.clamp_(-1.0, 1.0)


class BinaryConv2d(nn.Conv2d):
    """A Conv2d layer whose forward uses sign(latent weight); see :class:`BinaryLinear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._conv_forward(x, sign_ste(self.weight), self.bias)

    @torch.no_grad()
    def clip_(self) -> None:
        self.weight.clamp_(-1.0, 1.0)


def clip_latent_weights_(model: nn.Module) -> None:
    """Clamp the latent weights of every binary layer in ``model`` to [-1, 1]."""
    for module in model.modules():
        if isinstance(module, (BinaryLinear, BinaryConv2d)):
            module.clip_()


def keep_latent_weights_clipped(optimizer: torch.optim.Optimizer, model: nn.Module) -> Any:
    """Clip ``model``'s binary layers after every ``optimizer.step()``; returns the hook handle."""
    return optimizer.register_step_post_hook(lambda *_: clip_latent_weights_(model))


#: Row b holds the +-1 values that byte b encodes, bit i (LSB first) as element i.
_SIGNS_OF_BYTE = np.where(
    np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little") == 1, 1.0, -1.0
).astype(np.float32)


@register
class Binary(Codec):
    """One bit per element for +-1 tensors: 32x smaller than fp32, lossless.

    Anything other than +-1 raises, since silently binarizing real activations would hide a
    modelling mistake; ``take_sign=true`` binarizes on purpose (sign(0) = +1). ``flip_eps``
    enables randomized response: each bit is flipped with probability 1 / (1 + e^eps), drawn
    from the codec's own seeded generator, which gives eps-local differential privacy per bit.
    The gradient passes straight through, to the 8-bit fixpoint gradient codec by default.
    """

    name = "binary"
    default_grad_codec = "fixpoint:bits=8"
    negotiable_options = frozenset({"take_sign", "flip_eps"})

    def __init__(self, *, take_sign: bool = False, flip_eps: float | None = None, seed: int = 0) -> None:
        super().__init__(seed=seed)
        if not isinstance(take_sign, bool):
            raise CompressionError(f"binary option take_sign must be true or false, got {take_sign!r}")
        if flip_eps is not None and (
            not isinstance(flip_eps, (int, float)) or isinstance(flip_eps, bool)
            or not math.isfinite(flip_eps) or flip_eps <= 0
        ):
            raise CompressionError(
                f"binary option flip_eps must be a finite number > 0 (privacy budget per bit), got {flip_eps!r}"
            )
        self.take_sign = take_sign
        self.flip_eps = None if flip_eps is None else float(flip_eps)
        self._gen = torch.Generator().manual_seed(self.seed)

    @property
    def flip_probability(self) -> float:
        """Probability that randomized response flips a bit (0 when it is off)."""
        return 0.0 if self.flip_eps is None else 1.0 / (1.0 + math.exp(self.flip_eps))

    def encode(self, x: torch.Tensor, ctx: CodecContext) -> Payload:
        _wire.require_float(self.name, x)
        flat = x.detach().reshape(-1)
        if flat.dtype in (torch.float16, torch.bfloat16) and not use_torch(flat.device):
            # numpy has no bfloat16 and compares float16 in software; signs and +-1 survive the cast
            flat = flat.float()
        if not self.take_sign and flat.numel():
            # every |x| is 1 exactly when the smallest and the largest are (NaN fails both)
            lo, hi = torch.aminmax(flat.abs())
            if not (lo.item() == 1 and hi.item() == 1):
                bad = ~((flat == 1) | (flat == -1))
                sample = flat[bad][:3].tolist()
                raise CompressionError(
                    f"binary codes +-1 tensors, got {int(bad.sum())} other values (e.g. {sample}); "
                    "end the edge model with compressors.binary.BinaryActivation, or use 'binary:take_sign=true'"
                )
        if use_torch(flat.device):  # packed where the tensor lives; only the bits cross
            packed = download(bitpack.pack_tensor(flat >= 0, 1))
        else:  # numpy compares several times faster than torch here, which builds its bool tensor slowly
            packed = np.packbits(flat.numpy() >= 0, bitorder="little")
        if self.flip_eps is not None:  # drawn on the host, from the seeded generator, on every device
            flips = (torch.rand(flat.numel(), generator=self._gen) < self.flip_probability).numpy()
            packed ^= np.packbits(flips, bitorder="little")
        return Payload(self.name, self.version, {"bits": packed}, tensor_meta(x))

    def _read(self, payload: Payload) -> tuple[tuple[int, ...], torch.dtype, np.ndarray]:
        self.check(payload)
        shape = _wire.meta_shape(payload)
        dtype = _wire.meta_float_dtype(payload)
        packed = _wire.array(payload, "bits", np.uint8, ((math.prod(shape) + 7) // 8,))
        return shape, dtype, packed

    def decode_cost(self, payload: Payload, ctx: CodecContext) -> int:
        """The bytes as gather indices (intp), eight float32 signs per byte, then the output
        dtype: a float64 tensor decodes to over 100 times the bytes that travelled."""
        shape, dtype, packed = self._read(payload)
        n = math.prod(shape)
        if use_torch(ctx.device):  # the bit planes' int32 temporaries, summed step by step, then the output
            return packed.size + 4 * 4 * n + bitpack.unpack_tensor_nbytes(n, 1) + n * dtype.itemsize
        return packed.size * (8 + 8 * 4) + n * dtype.itemsize

    def decode(self, payload: Payload, ctx: CodecContext) -> torch.Tensor:
        shape, dtype, packed = self._read(payload)
        n = math.prod(shape)
        if use_torch(ctx.device):
            bits = bitpack.unpack_tensor(upload(packed, ctx.device), 1, n)
            return bits.to(dtype).mul_(2).sub_(1).reshape(shape)
        # one table row per byte value: its eight +-1 values in one gather, no unpack-then-scale
        signs = np.take(_SIGNS_OF_BYTE, packed, axis=0).reshape(-1)[:n]
        return torch.from_numpy(signs).to(dtype).reshape(shape)

    def state_dict(self) -> dict[str, Any]:
        """The randomized-response generator, so a resumed run does not replay old flips."""
        return {"rng": self._gen.get_state()} if self.flip_eps is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"rng"}
        if unknown:
            raise CompressionError(f"binary state has unknown keys {sorted(unknown)}; expected at most ['rng']")
        if "rng" in state:
            try:
                self._gen.set_state(state["rng"])
            except (RuntimeError, TypeError) as exc:
                raise CompressionError(f"binary state 'rng' is not a torch generator state: {exc}") from None
