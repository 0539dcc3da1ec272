"""The identity and fp16 codecs, the spec grammar and the registry's errors."""

from __future__ import annotations

import pytest
import torch

import compressors
from compressors import CodecContext, CompressionError

CTX = CodecContext()


def test_identity_is_exact_and_keeps_dtype():
    for dtype in (torch.float32, torch.float64, torch.int64):
        x = (torch.randn(5, 7) * 100).to(dtype)
        codec = compressors.make_codec("identity")
        payload = codec.encode(x, CTX)
        assert payload.nbytes == x.numel() * x.element_size()
        assert torch.equal(codec.decode(payload, CTX), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identity_keeps_a_layout_with_gaps_or_permuted_and_sends_a_sparse_slice_contiguous(dtype):
    """A transpose, channels_last, every other column, the real part of a complex tensor (as
    torch.fft's backward hands its input's gradient): rebuilt with the sender's strides, so what
    is computed from it sums in the sender's order. A narrow slice of a wide tensor (its values a
    small part of what it spans) travels contiguous."""
    codec = compressors.make_codec("identity")
    transposed = torch.randn(4, 16, 40).to(dtype).transpose(1, 2)
    channels_last = torch.randn(2, 3, 5, 5).to(dtype).to(memory_format=torch.channels_last)
    every_other = torch.randn(6, 8).to(dtype)[:, ::2]
    real_part = torch.view_as_real(torch.randn(4, 12, 9, dtype=torch.cfloat))[..., 0].to(dtype)
    for x in (transposed, channels_last, every_other, real_part):
        if not x.is_contiguous() or dtype == torch.float32:
            y = codec.decode(codec.encode(x, CTX), CTX)
            assert torch.equal(y, x) and y.stride() == x.stride() and y.dtype == dtype
    narrow = torch.randn(6, 80)[:, :3]
    y = codec.decode(codec.encode(narrow, CTX), CTX)
    assert torch.equal(y, narrow) and y.is_contiguous()


@pytest.mark.parametrize("strides", [[1, 1], [0, 1], [4, -1], [10**12, 1], [2], "21", [2, 1.0]])
def test_identity_refuses_strides_that_overlap_or_span_too_much(strides):
    codec = compressors.make_codec("identity")
    payload = codec.encode(torch.randn(6, 8)[:, ::2], CTX)
    assert payload.meta["strides"] == [8, 2]
    payload.meta["strides"] = strides
    with pytest.raises(CompressionError, match="'strides' must lay out the array's 2 dimensions"):
        codec.decode(payload, CTX)
    payload.meta = {"strides": [8, 2], "order": [1, 0]}
    with pytest.raises(CompressionError, match="'order' or 'strides'"):
        codec.decode(payload, CTX)


@pytest.mark.parametrize("order", [[0, 0, 1], [0, 1], [2, 1, True], "012", [0, 1, 3]])
def test_identity_refuses_an_order_that_is_no_permutation_of_the_arrays_dimensions(order):
    codec = compressors.make_codec("identity")
    payload = codec.encode(torch.randn(4, 16, 40).transpose(1, 2), CTX)
    payload.meta["order"] = order
    with pytest.raises(CompressionError, match="'order' must list the array's 3 dimensions"):
        codec.decode(payload, CTX)


def test_fp16_relative_error_is_within_half_precision():
    signs = torch.randint(0, 2, (1000,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    x = signs * torch.logspace(-4, 4, 1000, dtype=torch.float64)  # inside fp16's normal range
    codec = compressors.make_codec("fp16")
    payload = codec.encode(x, CTX)
    y = codec.decode(payload, CTX)
    assert y.dtype == torch.float64 and y.shape == x.shape
    assert payload.nbytes == 2 * x.numel()
    assert ((y - x).abs() <= x.abs() * 2.0**-11).all()


def test_fp16_overflow_raises_instead_of_sending_inf():
    with pytest.raises(CompressionError, match="overflow"):
        compressors.make_codec("fp16").encode(torch.tensor([1e6]), CTX)


def test_fp16_of_non_contiguous_input():
    x = torch.randn(8, 6).t()
    codec = compressors.make_codec("fp16")
    torch.testing.assert_close(codec.decode(codec.encode(x, CTX), CTX), x, atol=1e-2, rtol=1e-3)


def test_spec_grammar():
    assert compressors.parse_spec("c3sl:r=4,scale=0.5,fast=true,mode=x") == (
        "c3sl", {"r": 4, "scale": 0.5, "fast": True, "mode": "x"})
    with pytest.raises(CompressionError, match="key=value"):
        compressors.parse_spec("fixpoint:8")
    with pytest.raises(CompressionError, match="has no option"):
        compressors.make_codec("fp16:bits=3")
    assert compressors.canonical_spec(" fp16 ") == "fp16"


def test_unknown_codec_suggests_and_lists():
    with pytest.raises(compressors.UnknownCodecError) as info:
        compressors.make_codec("fp61")
    assert "did you mean 'fp16'" in str(info.value).lower()
    assert all(name in str(info.value) for name in compressors.names())


def test_payload_from_another_codec_is_refused():
    payload = compressors.make_codec("identity").encode(torch.ones(3), CTX)
    with pytest.raises(CompressionError, match="cannot decode"):
        compressors.make_codec("fp16").decode(payload, CTX)
