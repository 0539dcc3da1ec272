"""``errbound``: an error bound instead of a bit width; the bound holds on every element, on random
tensors and on tensors whose outliers would wreck a fixed-width quantizer's error."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from compressors import Bounds, CodecContext, CompressionError, check_spec, make_codec
from compressors.errbound import RAW
from tests.test_registry_walk import over_the_wire

CTX = CodecContext()


def _error(spec: str, x: torch.Tensor) -> tuple[float, float, dict]:
    codec = make_codec(spec)
    payload = codec.encode(x, CTX)
    y = make_codec(spec).decode(over_the_wire(payload), CTX)
    assert y.dtype == x.dtype and y.shape == x.shape
    return (y.double() - x.double()).abs().max().item(), codec.bound(x.double()), payload.arrays


def _outliers(shape: tuple[int, ...], dtype: torch.dtype, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    hits = torch.rand(shape, generator=g, dtype=torch.float64) < 0.002
    return torch.where(hits, x * scale, x).to(dtype)


@settings(max_examples=40, deadline=None)
@given(spec=st.sampled_from(["errbound", "errbound:abs=0.001", "errbound:abs=0.1", "errbound:rel=0.001",
                             "errbound:rel=0.05", "errbound:abs=0.01,rel=0.001"]),
       dtype=st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16]),
       shape=st.sampled_from([(3000,), (8, 77, 5), (2, 3, 9, 9), (1,), (0, 4)]),
       scale=st.sampled_from([1e-3, 1.0, 1e3]), outlier=st.sampled_from([1.0, 50.0, 1e4]),
       seed=st.integers(0, 2**16))
def test_the_bound_holds_on_every_element(spec, dtype, shape, scale, outlier, seed):
    if dtype in (torch.float16, torch.bfloat16):
        scale, outlier = min(scale, 1.0), min(outlier, 50.0)  # within the narrow dtypes' range
    x = (_outliers(shape, torch.float64, seed, outlier) * scale).to(dtype)
    if x.numel() == 0:
        codec = make_codec(spec)
        assert codec.decode(over_the_wire(codec.encode(x, CTX)), CTX).shape == x.shape
        return
    err, bound, _ = _error(spec, x)
    assert err <= bound, (spec, dtype, err, bound)


def test_outliers_cost_only_their_own_tiles():
    """An outlier under an absolute bound needs more than 16 bits: its tile travels raw, the
    others keep their few bits; fixed point's error on the same tensor grows with the outlier."""
    x = torch.randn(64, 4096)
    x[5, 7], x[40, 1000] = 3e4, -2e4
    err, bound, arrays = _error("errbound:abs=0.01", x)
    assert err <= bound == 0.01
    assert (arrays["bits"] == RAW).sum() == 2 and (arrays["bits"] <= 16).sum() == arrays["bits"].size - 2
    assert x.nbytes / sum(a.nbytes for a in arrays.values()) > 3
    fixed = make_codec("fixpoint:bits=8")
    y = fixed.decode(fixed.encode(x, CTX), CTX)
    assert (y - x).abs().max() > 100 * bound


def test_a_tighter_bound_costs_more_bits_and_zeros_cost_none():
    x = torch.randn(16, 1024)
    sizes = [sum(a.nbytes for a in make_codec(f"errbound:abs={b}").encode(x, CTX).arrays.values())
             for b in (0.1, 0.01, 0.001)]
    assert sizes[0] < sizes[1] < sizes[2]
    zeros = make_codec("errbound").encode(torch.zeros(16, 1024), CTX)
    assert (zeros.arrays["bits"] == 0).all() and zeros.arrays["q"].size == 0


def test_bad_bounds_and_forged_payloads_are_refused():
    for spec in ("errbound:abs=0", "errbound:rel=-1", "errbound:abs=inf", "errbound:rel=true", "errbound:bits=4"):
        with pytest.raises(CompressionError):
            make_codec(spec)
    assert check_spec("errbound:abs=0.001", Bounds()) == "errbound:abs=0.001"
    codec = make_codec("errbound")
    payload = codec.encode(torch.randn(4, 1024), CTX)
    payload.arrays["step"] = np.full_like(payload.arrays["step"], 1e308)
    with pytest.raises(CompressionError, match="range"):
        codec.decode(payload, CTX)
    with pytest.raises(CompressionError, match="non-finite"):
        codec.encode(torch.tensor([1.0, float("nan")]), CTX)


def test_a_split_trains_through_it_against_a_real_cloud(tmp_path):
    """The cloud admits the spec from a hello, prices and decodes its payloads, and the loss falls."""
    from splitft import split
    from splitft.app.models import digits_cnn
    from tests.conftest import DIGITS, start_cloud, stop

    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS)
    try:
        torch.manual_seed(0)
        x, y = torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))
        with split(digits_cnn(), "block3", factory=DIGITS, connect=address, codecs="errbound:rel=0.01") as model:
            opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-2))
            criterion = model.remote_loss(torch.nn.CrossEntropyLoss())
            losses = []
            for _ in range(8):
                opt.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.item())
            assert model.session.codecs.specs["fwd"] == "errbound:rel=0.01"
            assert model.metrics.bytes[("up", "activation")].ratio > 3
    finally:
        stop(proc)
    assert losses[-1] < losses[0] * 0.7, losses
