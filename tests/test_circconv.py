"""C3-SL: the FFT form is circular convolution, decode is the adjoint of encode, no sample lost."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compressors import CodecContext, CompressionError, DesyncError, make_codec
from compressors.circconv import bind, make_keys, unbind

CTX = CodecContext()


def direct_bind(keys: np.ndarray, z: np.ndarray) -> np.ndarray:
    """O(R*D^2) reference: V[n] = sum_i sum_m k_i[m] z_i[(n - m) mod D]."""
    g, r, d = z.shape
    v = np.zeros((g, d))
    for gi in range(g):
        for i in range(r):
            for n in range(d):
                v[gi, n] += sum(keys[i, m] * z[gi, i, (n - m) % d] for m in range(d))
    return v


def direct_unbind(keys: np.ndarray, v: np.ndarray) -> np.ndarray:
    """O(R*D^2) reference: z_i[n] = sum_m k_i[m] V[(n + m) mod D] (circular correlation)."""
    g, d = v.shape
    r = keys.shape[0]
    z = np.zeros((g, r, d))
    for gi in range(g):
        for i in range(r):
            for n in range(d):
                z[gi, i, n] = sum(keys[i, m] * v[gi, (n + m) % d] for m in range(d))
    return z


@pytest.mark.parametrize("d", [1, 2, 7, 16, 33])
def test_fft_form_equals_direct_circular_convolution(d: int) -> None:
    keys = make_keys(3, d, seed=5)
    z = torch.randn(2, 3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d))
    np.testing.assert_allclose(bind(keys, z).numpy(), direct_bind(keys.numpy(), z.numpy()), atol=1e-12)
    v = torch.randn(2, d, dtype=torch.float64, generator=torch.Generator().manual_seed(d + 1))
    np.testing.assert_allclose(unbind(keys, v).numpy(), direct_unbind(keys.numpy(), v.numpy()), atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(g=st.integers(1, 3), r=st.integers(1, 5), d=st.integers(1, 70), seed=st.integers(0, 2**31))
def test_unbind_is_the_adjoint_of_bind(g: int, r: int, d: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    keys = make_keys(r, d, seed)
    x = torch.randn(g, r, d, generator=gen, dtype=torch.float64)
    y = torch.randn(g, d, generator=gen, dtype=torch.float64)
    lhs = (bind(keys, x) * y).sum()
    rhs = (x * unbind(keys, y)).sum()
    assert abs(lhs - rhs) <= 1e-10 * (1 + abs(lhs))


def test_codec_adjoints_match_autograd_of_decode_after_encode() -> None:
    x = torch.randn(10, 4, 6, dtype=torch.float64)
    enc, dec = make_codec("c3sl:r=4", seed=9), make_codec("c3sl:r=4", seed=9)
    p = enc.encode(x, CTX)
    upstream = torch.randn(10, 4, 6, dtype=torch.float64)
    # autograd through the same linear maps: decode(encode(x))
    keys = enc.keys(24)
    leaf = x.clone().requires_grad_(True)
    z = torch.cat([leaf.reshape(10, 24), leaf.new_zeros(2, 24)]).reshape(3, 4, 24)
    out = unbind(keys, bind(keys, z)).reshape(12, 24)[:10].reshape(10, 4, 6)
    torch.testing.assert_close(out.detach(), dec.decode(p, CTX))
    (out * upstream).sum().backward()
    sent_back = dec.decode_adjoint(upstream, p, CTX)
    assert sent_back.shape == (3, 24)  # R times smaller than the activation gradient
    torch.testing.assert_close(enc.encode_adjoint(sent_back, p, CTX), leaf.grad)


@pytest.mark.parametrize("b", [1, 3, 4, 5, 10])
def test_padding_keeps_every_sample(b: int) -> None:
    r = 4
    x = torch.randn(b, 2, 512, generator=torch.Generator().manual_seed(b))
    codec = make_codec(f"c3sl:r={r}")
    p = codec.encode(x, CTX)
    groups = -(-b // r)
    assert p.arrays["v"].shape == (groups, 1024) and p.meta["shape"][0] == b
    y = codec.decode(p, CTX)
    assert y.shape == x.shape
    # decoding equals what an explicitly zero-padded batch decodes to, truncated
    padded = torch.cat([x, torch.zeros(groups * r - b, 2, 512)])
    torch.testing.assert_close(y, codec.decode(codec.encode(padded, CTX), CTX)[:b])
    # and no sample is silently dropped: each sample's own signal is in its reconstruction
    cos = torch.nn.functional.cosine_similarity(y.reshape(b, -1), x.reshape(b, -1))
    assert (cos > 0.2).all()


def test_reconstruction_noise_matches_the_reference_numbers() -> None:
    # COMPRESSORS.md: at R=4, relative error about 2 and cosine about 0.45 (D large)
    x = torch.randn(64, 2048, generator=torch.Generator().manual_seed(0))
    codec = make_codec("c3sl:r=4")
    y = codec.decode(codec.encode(x, CTX), CTX)
    cos = torch.nn.functional.cosine_similarity(y, x).mean().item()
    rel = ((y - x).norm(dim=1) / x.norm(dim=1)).mean().item()
    assert 0.35 < cos < 0.55 and 1.5 < rel < 2.5


def test_keys_are_unit_norm_private_and_seeded() -> None:
    torch.manual_seed(0)
    a = make_keys(4, 100, seed=1)
    torch.manual_seed(123)  # the global RNG must not matter
    b = make_keys(4, 100, seed=1)
    assert torch.equal(a, b) and not torch.equal(a, make_keys(4, 100, seed=2))
    torch.testing.assert_close(a.norm(dim=1), torch.ones(4, dtype=torch.float64))
    x = torch.randn(4, 10)
    state = torch.random.get_rng_state()
    make_codec("c3sl", seed=3).encode(x, CTX)
    assert torch.equal(state, torch.random.get_rng_state())


def test_differently_seeded_ends_are_detected() -> None:
    p = make_codec("c3sl", seed=1).encode(torch.randn(4, 10), CTX)
    with pytest.raises(DesyncError, match="seed"):
        make_codec("c3sl", seed=2).decode(p, CTX)
    with pytest.raises(CompressionError, match="r=4"):
        make_codec("c3sl:r=2", seed=1).decode(p, CTX)


def test_gradient_shapes_are_checked() -> None:
    codec = make_codec("c3sl")
    p = codec.encode(torch.randn(8, 10), CTX)
    with pytest.raises(CompressionError, match="bound vectors"):
        codec.encode_adjoint(torch.randn(8, 10), p, CTX)
    with pytest.raises(CompressionError):
        codec.decode_adjoint(torch.randn(2, 10), p, CTX)


@pytest.mark.parametrize("bad", ["c3sl:r=0", "c3sl:r=2.5", "c3sl:r=true"])
def test_settings_validated(bad: str) -> None:
    with pytest.raises(CompressionError):
        make_codec(bad)


def test_ratio_r16() -> None:
    x = torch.randn(64, 2048)
    p = make_codec("c3sl:r=16").encode(x, CTX)
    ratio = x.numel() * 4 / p.nbytes
    assert ratio >= 15.9, ratio


def test_a_hostile_shape_does_not_size_the_keys() -> None:
    codec = make_codec("c3sl")
    p = codec.encode(torch.randn(4, 10), CTX)
    p.meta["shape"] = [4, 1 << 38]
    with pytest.raises(CompressionError, match="'v'"):
        codec.decode(p, CTX)
