"""Bit packing and the n-bit fixpoint codec: exact bytes, exact sizes, the error bound."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressors import CodecContext, CompressionError, make_codec
from compressors import bitpack
from compressors.quant import quantize, dequantize, channel_axis

CTX = CodecContext()


def reference_pack(values: np.ndarray, bits: int) -> bytes:
    """The documented layout, one bit at a time: value i at stream bits [i*b, (i+1)*b), LSB first."""
    out = bytearray((len(values) * bits + 7) // 8)
    for i, v in enumerate(values):
        for t in range(bits):
            k = i * bits + t
            out[k // 8] |= ((int(v) >> t) & 1) << (k % 8)
    return bytes(out)


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("n", [0, 1, 2, 7, 8, 9, 15, 17, 100])
def test_pack_matches_documented_layout(bits: int, n: int) -> None:
    v = np.random.default_rng(bits * 1000 + n).integers(0, 1 << bits, n)
    packed = bitpack.pack(v, bits)
    assert packed.dtype == np.uint8 and packed.size == bitpack.packed_nbytes(n, bits) == -(-n * bits // 8)
    assert packed.tobytes() == reference_pack(v, bits)
    np.testing.assert_array_equal(bitpack.unpack(packed, bits, n), v)


@settings(max_examples=60, deadline=None)
@given(bits=st.integers(1, 16), data=st.data())
def test_pack_roundtrip_property(bits: int, data: st.DataObject) -> None:
    v = np.array(data.draw(st.lists(st.integers(0, (1 << bits) - 1), max_size=300)), dtype=np.int64)
    np.testing.assert_array_equal(bitpack.unpack(bitpack.pack(v, bits), bits, v.size), v)


def test_pack_refuses_bad_input() -> None:
    with pytest.raises(CompressionError):
        bitpack.pack(np.array([4]), 2)
    with pytest.raises(CompressionError):
        bitpack.pack(np.array([-1]), 3)
    with pytest.raises(CompressionError):
        bitpack.pack(np.array([0.5]), 3)
    with pytest.raises(CompressionError):
        bitpack.pack(np.array([1]), 17)
    with pytest.raises(CompressionError):
        bitpack.unpack(np.zeros(3, np.uint8), 4, 7)  # 7 x 4 bits need 4 bytes


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 7, 8, 11, 16])
@pytest.mark.parametrize("shape", [(64, 32, 8, 8), (3, 5, 7), (9, 1), (13,)])
def test_fixpoint_size_and_error_bound(bits: int, shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(bits)
    # channels of very different magnitude: per-channel scales must keep small ones accurate
    x = torch.randn(shape, generator=g)
    if len(shape) >= 2:
        x = x * torch.logspace(-3, 2, shape[1]).reshape([1, -1] + [1] * (len(shape) - 2))
    codec = make_codec(f"fixpoint:bits={bits}")
    p = codec.encode(x, CTX)
    channels = shape[1] if len(shape) >= 2 else 1
    assert p.arrays["q"].nbytes == -(-x.numel() * bits // 8)
    assert p.arrays["scale"].dtype == np.float16 and p.arrays["scale"].shape == (channels,)
    assert p.nbytes == -(-x.numel() * bits // 8) + 2 * channels
    y = codec.decode(p, CTX)
    scale = torch.from_numpy(p.arrays["scale"].astype(np.float32))
    view = [1, -1] + [1] * (len(shape) - 2) if len(shape) >= 2 else [1]
    s = scale.reshape(view)
    # every element is within one step of its channel's scale (the scale covers max|x|)
    assert (s >= x.abs()).all()
    # float32 arithmetic on codes up to 2^(b-1) is exact to about 2^(b-23) of a step
    slack = (s + 1e-6) / 2 ** (bits - 1) * 2.0 ** (bits - 22)
    assert ((x - y).abs() <= s / 2 ** (bits - 1) + slack).all()
    # away from the clipped top code the error is half a step of (s + 1e-6) / 2^(b-1)
    inner = (x.abs() < s * (1 - 2.0 ** -(bits - 1))).expand_as(x)
    half_step = ((s + 1e-6) / 2**bits + slack).expand_as(x)
    assert ((x - y).abs()[inner] <= half_step[inner]).all()


def test_fixpoint_is_deterministic_round_to_nearest() -> None:
    # scale 1 (exact in fp16): x * 2^(b-1) / (1 + 1e-6) rounds to the nearest code
    x = torch.tensor([[1.0, 0.0, -1.0, 0.26, -0.24, 0.5]]).T  # 6 samples, 1 channel
    codec = make_codec("fixpoint:bits=3")
    p = codec.encode(x, CTX)
    codes = bitpack.unpack(p.arrays["q"], 3, 6).astype(int) - 4
    assert codes.tolist() == [3, 0, -4, 1, -1, 2]


def test_fixpoint_zero_and_empty_channels() -> None:
    x = torch.zeros(4, 3, 5)
    x[:, 1] = torch.arange(20.0).reshape(4, 5)
    codec = make_codec("fixpoint:bits=4")
    y = codec.decode(codec.encode(x, CTX), CTX)
    assert torch.equal(y[:, 0], torch.zeros(4, 5)) and torch.equal(y[:, 2], torch.zeros(4, 5))
    e = torch.zeros(0, 3, 2)
    assert codec.decode(codec.encode(e, CTX), CTX).shape == e.shape


def test_fixpoint_channel_dim_option() -> None:
    x = torch.randn(2, 6, 10)
    p = make_codec("fixpoint:channel_dim=-1").encode(x, CTX)
    assert p.arrays["scale"].shape == (10,)
    assert channel_axis(3, -1) == 2 and channel_axis(1, 5) is None
    with pytest.raises(CompressionError, match="out of range"):
        make_codec("fixpoint:channel_dim=3").encode(x, CTX)


@pytest.mark.parametrize("bad", ["fixpoint:bits=1", "fixpoint:bits=17", "fixpoint:bits=4.5",
                                 "fixpoint:bits=true", "fixpoint:channel_dim=x"])
def test_fixpoint_settings_validated(bad: str) -> None:
    with pytest.raises(CompressionError):
        make_codec(bad)


def test_fixpoint_refuses_values_it_cannot_scale() -> None:
    codec = make_codec("fixpoint")
    with pytest.raises(CompressionError, match="non-finite"):
        codec.encode(torch.tensor([[1.0, float("nan")]]), CTX)
    with pytest.raises(CompressionError, match="overflows fp16"):
        codec.encode(torch.tensor([[1e6, 1.0]]), CTX)


def test_fixpoint_rejects_tampered_payload() -> None:
    codec = make_codec("fixpoint:bits=4")
    p = codec.encode(torch.randn(4, 3), CTX)
    p.arrays["q"] = p.arrays["q"][:-1]
    with pytest.raises(CompressionError, match="'q'"):
        codec.decode(p, CTX)


def test_quantize_helpers_roundtrip_bit_identically() -> None:
    x = torch.randn(8, 4, 3)
    packed, scale = quantize(x, 5, 1)
    a = dequantize(packed, scale, 5, (8, 4, 3), 1)
    b = dequantize(packed.copy(), scale.copy(), 5, (8, 4, 3), 1)
    assert a.dtype == torch.float32 and torch.equal(a, b)
