"""The codecs' fast paths agree with plain, obviously correct references.

The per-step path uses tricks (packing in machine words, one division for two, sum-based
finiteness checks, table lookups); each is pinned here against the slow formula it replaces,
at sizes and layouts the small layout tests do not reach. Nothing here measures time.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressors import CodecContext, CompressionError, _wire, bitpack, make_codec
from compressors.delta import row_checksums
from compressors.lowrank import orthonormalize
from compressors.quant import SCALE_EPS, channel_scales, dequantize, quantize, quantize_parts

CTX = CodecContext()


def reference_pack(values: np.ndarray, bits: int) -> np.ndarray:
    """The documented stream, built bit plane by bit plane (slow, plainly right)."""
    v = np.asarray(values, dtype=np.int64).reshape(-1)
    planes = (v[:, None] >> np.arange(bits)) & 1
    return np.packbits(planes.astype(np.uint8).reshape(-1), bitorder="little")


@pytest.mark.parametrize("bits", range(1, 17))
@pytest.mark.parametrize("n", [8 * 1024, 8 * 1024 + 3, 4099])
def test_pack_matches_reference_at_size(bits: int, n: int) -> None:
    v = np.random.default_rng(n + bits).integers(0, 1 << bits, n)
    packed = bitpack.pack(v, bits)
    np.testing.assert_array_equal(packed, reference_pack(v, bits))
    out = bitpack.unpack(packed, bits, n)
    assert out.dtype == (np.uint8 if bits <= 8 else np.uint16)
    np.testing.assert_array_equal(out, v)


@pytest.mark.parametrize("bits", [1, 2, 4, 8, 3, 12])
@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.uint16, np.int64])
def test_pack_takes_any_integer_dtype_and_layout(bits: int, dtype: type) -> None:
    if np.iinfo(dtype).max < (1 << bits) - 1:
        pytest.skip("dtype too narrow for this width")
    grid = np.random.default_rng(bits).integers(0, 1 << bits, (37, 11)).astype(dtype)
    view = grid.T  # not contiguous
    np.testing.assert_array_equal(bitpack.pack(view, bits), reference_pack(view, bits))
    if np.iinfo(dtype).max >= 1 << bits:  # the range check survives the dtype shortcuts
        bad = view.copy()
        bad[3, 2] = 1 << bits
        with pytest.raises(CompressionError):
            bitpack.pack(bad, bits)


def test_pack_does_not_alias_or_modify_its_input() -> None:
    v = np.arange(64, dtype=np.uint8) % 16
    keep = v.copy()
    out = bitpack.pack(v, 4)
    bitpack.unpack(out, 4, 64)[:] = 0
    np.testing.assert_array_equal(v, keep)
    assert not np.shares_memory(bitpack.pack(v, 8), v)


@pytest.mark.parametrize("bits", [2, 3, 4, 8, 11, 16])
@pytest.mark.parametrize("shape,axis", [((16, 8, 4, 4), 1), ((5, 7, 3), 2), ((9,), None)])
def test_quantize_matches_the_documented_formula(bits: int, shape: tuple[int, ...], axis: int | None) -> None:
    g = torch.Generator().manual_seed(bits)
    x = torch.randn(shape, generator=g) * 3
    x.view(-1)[::7] = torch.round(x.view(-1)[::7] * 4) / 4  # ties and repeated values
    packed, scale = quantize(x, bits, axis)
    half = 1 << (bits - 1)
    view = [1] * len(shape)
    if axis is not None:
        view[axis] = shape[axis]
    denom = torch.from_numpy(scale.astype(np.float32)).reshape(view) + SCALE_EPS
    codes = torch.round(x / denom * half).clamp(-half, half - 1).to(torch.int64) + half
    np.testing.assert_array_equal(bitpack.unpack(packed, bits, x.numel()), codes.reshape(-1).numpy())
    y = dequantize(packed, scale, bits, shape, axis)
    assert torch.equal(y, (codes - half).to(torch.float32) * (denom / half))


def test_channel_scales_round_up_to_fp16() -> None:
    want = np.array([1.0, 1.0001, 0.1, 0.0, 65504.0, 6e-8, 3e-5], dtype=np.float32)
    s = channel_scales(-torch.from_numpy(want).reshape(1, -1), 1)
    assert (s.astype(np.float32) >= want).all()
    down = np.nextafter(s, np.float16(0))
    assert ((down.astype(np.float32) < want) | (s == 0)).all()  # the smallest fp16 that covers


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_all_finite(dtype: torch.dtype) -> None:
    x = torch.randn(1000).to(dtype)
    assert _wire.all_finite(x) and _wire.all_finite(x[:0])
    for bad in (float("inf"), float("-inf"), float("nan")):
        y = x.clone()
        y[17] = bad
        assert not _wire.all_finite(y)
    big = torch.full((1000,), torch.finfo(dtype).max, dtype=dtype)  # finite, but its sum is not
    assert _wire.all_finite(big)
    mixed = big.clone()
    mixed[::2] = -mixed[::2]
    mixed[5] = float("nan")
    assert not _wire.all_finite(mixed)


def test_fp16_overflow_still_detected_when_the_half_sum_would_overflow() -> None:
    codec = make_codec("fp16")
    ok = torch.full((4096,), 60000.0)  # each fits fp16, their sum does not
    assert torch.equal(codec.decode(codec.encode(ok, CTX), CTX), ok)
    bad = ok.clone()
    bad[100] = 70000.0
    with pytest.raises(CompressionError, match="overflow"):
        codec.encode(bad, CTX)
    passthrough = ok.clone()
    passthrough[3] = float("inf")  # not an overflow of the codec: inf in, inf out
    assert torch.isinf(codec.decode(codec.encode(passthrough, CTX), CTX)[3])


@pytest.mark.parametrize("n", [1, 8, 13, 4097])
def test_binary_decode_table_matches_unpackbits(n: int) -> None:
    codec = make_codec("binary:take_sign=true")
    x = torch.randn(n, generator=torch.Generator().manual_seed(n))
    x[0] = -0.0
    p = codec.encode(x, CTX)
    bits = np.unpackbits(p.arrays["bits"], count=n, bitorder="little")
    assert bits[0] == 1  # sign(-0) = +1
    want = torch.from_numpy(bits.astype(np.float32) * 2 - 1)
    assert torch.equal(codec.decode(p, CTX), want)


@pytest.mark.parametrize("bits,shape,axis", [(4, (16, 8, 4, 4), 1), (2, (5, 7, 3), 2), (11, (9,), None)])
def test_quantize_parts_dequantize_without_unpacking(bits: int, shape: tuple[int, ...], axis: int | None) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(bits))
    packed, scale, q, step = quantize_parts(x, bits, axis)
    assert torch.equal(q * step, dequantize(packed, scale, bits, shape, axis))


def test_acsgd_row_checksum_catches_flips_and_pads_odd_rows() -> None:
    rows = np.random.default_rng(0).standard_normal((6, 37)).astype(np.float16)  # 74 bytes a row
    base = row_checksums(rows)
    assert base.dtype == np.uint64 and base.shape == (6,)
    assert np.array_equal(row_checksums(rows.copy()), base)
    raw = rows.view(np.uint8)
    for row, byte, bit in [(0, 0, 0), (2, 73, 7), (5, 40, 3), (3, 1, 7)]:
        flipped = raw.copy()
        flipped[row, byte] ^= 1 << bit
        changed = row_checksums(flipped.view(np.float16)) != base
        assert changed.tolist() == [r == row for r in range(6)]
    # sign flips of several values of one row never cancel out
    signs = rows.copy()
    signs[1, [1, 3, 5, 7, 9, 11]] *= -1
    assert (row_checksums(signs) != base).tolist() == [False, True, False, False, False, False]
    assert row_checksums(rows[:0]).shape == (0,)


def test_acsgd_row_checksum_is_the_documented_sum() -> None:
    """Both ends must agree across machines and library versions: pin it in plain Python."""
    mask = (1 << 64) - 1

    def weight(j: int) -> int:  # splitmix64 of position j + 1, high 32 bits, made odd
        z = ((j + 1) * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return ((z ^ (z >> 31)) >> 32) | 1

    rows = np.random.default_rng(1).standard_normal((3, 11)).astype(np.float16)
    for row, got in zip(rows, row_checksums(rows)):
        data = row.tobytes() + b"\0" * (-row.nbytes % 4)
        words = [int.from_bytes(data[i:i + 4], "little") for i in range(0, len(data), 4)]
        assert int(got) == sum(weight(j) * w for j, w in enumerate(words)) & mask


def test_rank_one_orthonormalize_is_the_sign_fixed_householder_column() -> None:
    a = torch.randn(6, 9, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    a[2] = 0  # a zero column: Householder QR leaves e1, with R = 0
    q, r = torch.linalg.qr(a)
    signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
    want = q * torch.where(signs == 0, torch.ones_like(signs), signs).unsqueeze(-2)
    torch.testing.assert_close(orthonormalize(a), want)
    torch.testing.assert_close(orthonormalize(a.float()), want.float())


def test_dequantize_refuses_non_finite_scales() -> None:
    packed, scale = quantize(torch.randn(4, 3), 4, 1)
    scale[1] = np.float16(np.inf)
    with pytest.raises(CompressionError, match="non-finite"):
        dequantize(packed, scale, 4, (4, 3), 1)
