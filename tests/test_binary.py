"""B-SL: exact 1-bit packing at any length, the straight-through sign, binary layers."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from compressors import CodecContext, CompressionError, make_codec
from compressors.binary import (
    BinaryActivation, BinaryConv2d, BinaryLinear, keep_latent_weights_clipped, sign_ste,
)

CTX = CodecContext()


def pm1(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    bits = torch.randint(0, 2, (n,), generator=torch.Generator().manual_seed(seed))
    return (bits * 2 - 1).to(dtype)


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000, 1000003])
def test_packing_is_exact_at_any_length(n: int) -> None:
    x = pm1(n, seed=n)
    codec = make_codec("binary")
    p = codec.encode(x, CTX)
    assert p.nbytes == math.ceil(n / 8) and p.arrays["bits"].dtype == np.uint8
    assert torch.equal(codec.decode(p, CTX), x)


def test_exact_bytes_of_the_layout() -> None:
    # +1 -> bit 1, -1 -> bit 0, element i at bit i % 8 of byte i // 8
    x = torch.tensor([1, -1, -1, 1, 1, 1, -1, -1, 1.0])
    p = make_codec("binary").encode(x, CTX)
    assert p.arrays["bits"].tobytes() == bytes([0b00111001, 0b00000001])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.bfloat16])
def test_dtype_and_shape_survive(dtype: torch.dtype) -> None:
    x = pm1(2 * 3 * 5, dtype=dtype).reshape(2, 3, 5)
    codec = make_codec("binary")
    y = codec.decode(codec.encode(x, CTX), CTX)
    assert y.dtype == dtype and torch.equal(y, x)


def test_non_binary_input_is_refused_unless_asked_to_take_the_sign() -> None:
    x = torch.tensor([[1.0, -1.0, 0.5, 0.0]])
    with pytest.raises(CompressionError, match="take_sign"):
        make_codec("binary").encode(x, CTX)
    codec = make_codec("binary:take_sign=true")
    assert codec.decode(codec.encode(x, CTX), CTX).tolist() == [[1.0, -1.0, 1.0, 1.0]]
    with pytest.raises(CompressionError):
        make_codec("binary").encode(torch.tensor([float("nan"), 1.0]), CTX)


def test_ratio_is_32x() -> None:
    x = pm1(64 * 2048).reshape(64, 2048)
    p = make_codec("binary").encode(x, CTX)
    assert x.numel() * 4 / p.nbytes == 32.0


def test_randomized_response_flips_at_the_right_rate_from_its_own_generator() -> None:
    x = torch.ones(200_000)
    eps = 1.0
    a, b = make_codec(f"binary:flip_eps={eps}", seed=4), make_codec(f"binary:flip_eps={eps}", seed=4)
    torch.manual_seed(0)
    ya = a.decode(a.encode(x, CTX), CTX)
    torch.manual_seed(1)  # the global RNG plays no part
    yb = b.decode(b.encode(x, CTX), CTX)
    assert torch.equal(ya, yb)
    rate = (ya == -1).float().mean().item()
    assert abs(rate - 1 / (1 + math.e)) < 0.005
    # the generator moves on, and its state is what a checkpoint carries
    state = a.state_dict()
    c = make_codec(f"binary:flip_eps={eps}", seed=4)
    c.load_state_dict(state)
    assert np.array_equal(c.encode(x, CTX).arrays["bits"], a.encode(x, CTX).arrays["bits"])
    assert not np.array_equal(a.encode(x, CTX).arrays["bits"], make_codec(f"binary:flip_eps={eps}", seed=4).encode(x, CTX).arrays["bits"])


@pytest.mark.parametrize("bad", ["binary:flip_eps=0", "binary:flip_eps=-1", "binary:flip_eps=inf",
                                 "binary:flip_eps=x", "binary:take_sign=1"])
def test_settings_validated(bad: str) -> None:
    with pytest.raises(CompressionError):
        make_codec(bad)


def test_sign_ste_forward_and_gradient() -> None:
    x = torch.tensor([-2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5], requires_grad=True)
    y = sign_ste(x)
    assert y.tolist() == [-1, -1, -1, 1, 1, 1, 1]
    y.backward(torch.arange(1.0, 8.0))
    # gradient passes where |x| <= 1, and is zero outside
    assert x.grad.tolist() == [0, 2, 3, 4, 5, 6, 0]
    assert BinaryActivation()(torch.tensor([0.0, -3.0])).tolist() == [1, -1]


def test_binary_layers_use_signed_weights_and_train_latent_ones() -> None:
    torch.manual_seed(0)
    lin = BinaryLinear(5, 3, bias=False)
    x = torch.randn(4, 5)
    torch.testing.assert_close(lin(x), x @ torch.where(lin.weight >= 0, 1.0, -1.0).T)
    conv = BinaryConv2d(2, 4, 3, padding=1)
    img = torch.randn(1, 2, 6, 6)
    ref = torch.nn.functional.conv2d(img, torch.where(conv.weight >= 0, 1.0, -1.0), conv.bias, padding=1)
    torch.testing.assert_close(conv(img), ref)

    model = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(4), BinaryActivation())
    out = model(img)
    assert set(out.unique().tolist()) <= {-1.0, 1.0}
    opt = torch.optim.SGD(model.parameters(), lr=10.0)  # a huge step pushes weights out of [-1, 1]
    handle = keep_latent_weights_clipped(opt, model)
    out.sum().backward()
    assert conv.weight.grad is not None and conv.weight.grad.abs().sum() > 0
    opt.step()
    assert conv.weight.abs().max() <= 1.0
    handle.remove()
    # the smashed data of such an edge goes through the codec losslessly
    codec = make_codec("binary")
    assert torch.equal(codec.decode(codec.encode(out.detach(), CTX), CTX), out.detach())
