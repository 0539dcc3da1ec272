"""Low-rank codec: exact on rank-r input, the gradient is autograd's, raw when it does not pay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressors import CodecContext, CompressionError, make_codec
from compressors.lowrank import orthonormalize

CTX = CodecContext()


def rank_r(b: int, l: int, h: int, r: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, l, r, generator=g, dtype=torch.float64)
            @ torch.randn(b, r, h, generator=g, dtype=torch.float64)).to(dtype)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("r", [1, 3])
def test_exact_on_rank_r_input(r: int, dtype: torch.dtype, tol: float) -> None:
    x = rank_r(5, 12, 20, r, dtype=dtype)
    codec = make_codec(f"lowrank:rank={r},iters=1,fp16=false")
    p = codec.encode(x, CTX)
    assert p.meta["mode"] == "lowrank" and p.meta["rank"] == r
    assert p.arrays["P"].shape == (5, 12, r) and p.arrays["Q"].shape == (5, 20, r)
    y = codec.decode(p, CTX)
    assert (y - x).norm() / x.norm() < tol


def test_cnn_view_is_channels_by_pixels() -> None:
    x = rank_r(3, 8, 36, 2).reshape(3, 8, 6, 6)
    codec = make_codec("lowrank:rank=2,fp16=false")
    p = codec.encode(x, CTX)
    assert p.arrays["P"].shape == (3, 8, 2) and p.arrays["Q"].shape == (3, 36, 2)
    torch.testing.assert_close(codec.decode(p, CTX), x, rtol=1e-4, atol=1e-4)


def test_fp16_factors_are_close_and_half_the_bytes() -> None:
    x = rank_r(4, 16, 32, 2)
    codec = make_codec("lowrank:rank=2")
    p = codec.encode(x, CTX)
    assert p.arrays["P"].dtype == np.float16 and p.nbytes == 4 * (16 + 32) * 2 * 2
    y = codec.decode(p, CTX)
    assert (y - x).norm() / x.norm() < 3e-3


@pytest.mark.parametrize("fp16", [True, False])
def test_backward_equals_autograd_of_projection_with_p_fixed(fp16: bool) -> None:
    g = torch.Generator().manual_seed(3)
    m = torch.randn(4, 10, 14, generator=g)  # full rank: the projection really loses something
    enc, dec = make_codec(f"lowrank:rank=3,fp16={fp16}"), make_codec(f"lowrank:rank=3,fp16={fp16}")
    payload = enc.encode(m, CTX)
    y = dec.decode(payload, CTX)
    p = torch.from_numpy(payload.arrays["P"].astype(np.float32))

    # forward: what was decoded is the projection P P^T M (to fp16 rounding of Q)
    torch.testing.assert_close(y, p @ (p.transpose(1, 2) @ m), rtol=0, atol=2e-2 if fp16 else 1e-5)

    # backward: the two adjoints equal autograd through P P^T M with P a constant
    upstream = torch.randn(4, 10, 14, generator=g)
    leaf = m.clone().requires_grad_(True)
    (p @ (p.transpose(1, 2) @ leaf) * upstream).sum().backward()

    sent_back = dec.decode_adjoint(upstream, payload, CTX)
    assert sent_back.shape == (4, 3, 14)  # only P^T G crosses: r x H per sample
    grad_m = enc.encode_adjoint(sent_back, payload, CTX)
    torch.testing.assert_close(grad_m, leaf.grad, rtol=1e-5, atol=1e-5)


def test_raw_fallback_when_factors_do_not_pay() -> None:
    codec = make_codec("lowrank:rank=4")
    # 3x3 per sample at rank 3: (3+3)*3*2 bytes >= 3*3*4 bytes
    x = torch.randn(2, 3, 3)
    p = codec.encode(x, CTX)
    assert p.meta["mode"] == "raw" and "no gain" in p.meta["reason"] and set(p.arrays) == {"x"}
    assert torch.equal(codec.decode(p, CTX), x)
    g = torch.randn(2, 3, 3)
    assert torch.equal(codec.encode_adjoint(codec.decode_adjoint(g, p, CTX), p, CTX), g)
    # not a batch of matrices
    p2 = codec.encode(torch.randn(5, 7), CTX)
    assert p2.meta["mode"] == "raw" and "matrix" in p2.meta["reason"]
    # just past the threshold: 2x(16+16)*2 bytes < 16*16*4 bytes
    assert codec.encode(torch.randn(2, 16, 16), CTX).meta["mode"] == "lowrank"
    # same element size: the spec's (L+H)*r >= L*H rule
    same = make_codec("lowrank:rank=2,fp16=false")
    assert same.encode(torch.randn(2, 4, 4), CTX).meta["mode"] == "raw"  # (4+4)*2 >= 16
    assert same.encode(torch.randn(2, 5, 5), CTX).meta["mode"] == "lowrank"  # 20 < 25


def test_warm_start_improves_with_steps_and_lives_in_state() -> None:
    # activations sharing one dominant 4-dim hidden subspace plus noise
    g = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(96, 4, generator=g))[0]
    codec = make_codec("lowrank:rank=4,iters=1,fp16=false")
    errs = []
    for _ in range(6):
        x = torch.randn(8, 24, 4, generator=g) @ basis.T * 5 + 0.05 * torch.randn(8, 24, 96, generator=g)
        y = codec.decode(codec.encode(x, CTX), CTX)
        errs.append(float((y - x).norm() / x.norm()))
    assert errs[-1] < errs[0] and errs[-1] < 0.05
    state = codec.state_dict()
    assert list(state) == ["warm.96x4"] and state["warm.96x4"].shape == (96, 4)
    other = make_codec("lowrank:rank=4,iters=1,fp16=false")
    other.load_state_dict(state)
    x = torch.randn(8, 24, 96, generator=g)
    assert np.array_equal(other.encode(x, CTX).arrays["P"], codec.encode(x, CTX).arrays["P"])
    with pytest.raises(CompressionError):
        other.load_state_dict({"warm.96x4": torch.zeros(3, 3)})


def test_evaluation_does_not_move_the_warm_start() -> None:
    codec = make_codec("lowrank")
    codec.encode(torch.randn(2, 8, 16), CTX)
    before = codec.state_dict()
    codec.encode(torch.randn(2, 8, 16), CodecContext(train=False))
    after = codec.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_orthonormalize_fixes_signs() -> None:
    a = torch.randn(3, 7, 2, dtype=torch.float64)
    q = orthonormalize(a)
    torch.testing.assert_close(q.transpose(1, 2) @ q, torch.eye(2, dtype=torch.float64).expand(3, 2, 2))
    assert ((q.transpose(1, 2) @ a).diagonal(dim1=1, dim2=2) > 0).all()


@pytest.mark.parametrize("bad", ["lowrank:rank=0", "lowrank:iters=0", "lowrank:fp16=2", "lowrank:rank=1.5"])
def test_settings_validated(bad: str) -> None:
    with pytest.raises(CompressionError):
        make_codec(bad)


def test_tampered_and_mismatched_payloads() -> None:
    codec = make_codec("lowrank:rank=2")
    p = codec.encode(torch.randn(2, 8, 16), CTX)
    with pytest.raises(CompressionError, match="shape"):
        codec.encode_adjoint(torch.randn(2, 8, 16), p, CTX)  # the full gradient is not what crosses
    p.arrays["Q"] = p.arrays["Q"][:, :-1]
    with pytest.raises(CompressionError, match="'Q'"):
        codec.decode(p, CTX)
    with pytest.raises(CompressionError, match="non-finite"):
        codec.encode(torch.full((2, 8, 16), float("nan")), CTX)


def test_sft_ratio_at_bert_shape() -> None:
    x = torch.randn(2, 128, 768)
    p = make_codec("lowrank:rank=1").encode(x, CTX)
    ratio = x.numel() * 4 / p.nbytes
    assert ratio > 200  # 128*768*4 / ((128+768)*2): the spec's ~110x in equal dtypes, x2 for fp16
