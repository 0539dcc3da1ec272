"""Codecs for an LLM's outliers, and codecs that compose by spec.

``quant`` (per-tile scales, Lloyd-Max normal levels, stochastic rounding), the ``hadamard``,
``outliers`` and ``delta`` stages, and chains of them written as specs: what each promises
(error, exactness, unbiasedness, orthogonality, two ends in step) and what the receiver's policy
bounds in a chain.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import compressors
from compressors import Bounds, CodecContext, CompressionError, DesyncError, PolicyError, check_spec, make_codec
from tests.test_registry_walk import over_the_wire

TRAIN, EVAL = CodecContext(train=True), CodecContext(train=False)
#: Mean squared error of the Lloyd-Max quantizer of a unit normal, per bit width (Max, 1960).
LLOYD_MAX_MSE = {1: 0.3634, 2: 0.1175, 3: 0.03454, 4: 0.009497}


def roundtrip(spec: str, x: torch.Tensor, ctx: CodecContext = TRAIN, seed: int = 0) -> torch.Tensor:
    return make_codec(spec, seed=seed).decode(over_the_wire(make_codec(spec, seed=seed).encode(x, ctx)), ctx)


def gaussian(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def llm_like(seed: int = 0) -> torch.Tensor:
    """Hidden states with what a pre-trained LLM's have: two channels a hundred times the rest,
    and a first token of massive values."""
    x = gaussian(2, 64, 256, seed=seed)
    x[..., 7] *= 100.0
    x[..., 200] *= 60.0
    x[:, 0] *= 30.0
    return x


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    x, y = x.double(), y.double()
    return float((x - y).pow(2).sum() / x.pow(2).sum())


# ---------------------------------------------------------------- specs


def test_chains_parse_canonicalise_and_build_outside_in() -> None:
    spec = " outliers:k=2 > hadamard:block=64 >quant:tile=64,bits=3 "
    assert compressors.canonical_spec(spec) == "outliers:k=2>hadamard:block=64>quant:bits=3,tile=64"
    assert compressors.parse_chain("hadamard>quant:bits=2") == [("hadamard", {}), ("quant", {"bits": 2})]
    codec = make_codec(spec)
    assert codec.name == "outliers" and codec.inner.name == "hadamard" and codec.inner.inner.name == "quant"
    assert (codec.k, codec.inner.block, codec.inner.inner.bits) == (2, 64, 3)
    assert repr(codec).startswith("Outliers(k=2)>Hadamard(block=64)>Quant(bits=3")
    assert compressors.default_grad_spec(spec) == "quant:bits=4"  # the last codec's partner
    assert make_codec("hadamard>delta>quant").needs_sample_ids and not make_codec("hadamard>quant").needs_sample_ids
    with pytest.raises(CompressionError, match="parse_chain"):
        compressors.parse_spec("hadamard>quant")


@pytest.mark.parametrize("spec", ["fixpoint>quant", "quant>hadamard", "hadamard>>quant", "hadamard>"])
def test_only_stages_stand_before_another_codec(spec: str) -> None:
    for attempt in (lambda: make_codec(spec), lambda: check_spec(spec, Bounds())):
        with pytest.raises(CompressionError) as info:
            attempt()
        assert not isinstance(info.value, PolicyError)
    with pytest.raises(CompressionError, match="only delta, hadamard, outliers may stand before another codec"):
        make_codec("fixpoint>quant")


def test_a_peer_chain_is_bounded_stage_by_stage() -> None:
    assert check_spec("hadamard > quant:bits=2", Bounds(), allowed=["hadamard", "quant"]) == "hadamard>quant:bits=2"
    with pytest.raises(PolicyError, match="codec 'hadamard' is not allowed") as info:
        check_spec("hadamard>quant:bits=2", Bounds(), allowed=["quant"])
    assert info.value.codec == "hadamard"
    with pytest.raises(PolicyError, match="max_stages=2") as info:
        check_spec("outliers>hadamard>quant", Bounds(max_stages=2))
    assert (info.value.bound, info.value.value) == ("max_stages", 3)
    with pytest.raises(PolicyError) as info:
        make_codec("hadamard>delta:capacity=300000000>quant", bounds=Bounds())
    assert (info.value.codec, info.value.option, info.value.bound) == ("delta", "capacity", "max_ids")
    # a codec built for a peer hands its bounds to every stage: the delta refuses a far sample id
    codec = make_codec("hadamard>delta>quant", bounds=Bounds(max_ids=10))
    with pytest.raises(CompressionError, match="max_ids=10"):
        codec.encode(torch.ones(1, 8), CodecContext(sample_ids=np.array([10])))


# ---------------------------------------------------------------- quant


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_normal_levels_reach_the_lloyd_max_error(bits: int) -> None:
    x = gaussian(512, 1024)
    err = relative_error(x, roundtrip(f"quant:bits={bits}", x))
    assert err == pytest.approx(LLOYD_MAX_MSE[bits], rel=0.05)
    p = make_codec(f"quant:bits={bits}").encode(x, TRAIN)
    assert p.nbytes == x.numel() * bits // 8 + 512 * 2  # the codes, and a bfloat16 scale per row


def test_uniform_levels_never_clip_and_tiles_have_their_own_scales() -> None:
    x = gaussian(16, 100) * torch.logspace(-3, 3, 100)  # values of every size in each row
    y = roundtrip("quant:bits=8,levels=uniform,tile=10", x)
    tiles, err = x.reshape(16, 10, 10), (x - y).reshape(16, 10, 10)
    step = tiles.abs().amax(2, keepdim=True) * 2 / 255
    assert bool((err.abs() <= step * 0.5 * 1.01).all())
    one_scale = roundtrip("quant:bits=8,levels=uniform", x)
    assert relative_error(x[:, :50], y[:, :50]) < relative_error(x[:, :50], one_scale[:, :50]) / 100


def test_scales_keep_the_range_of_float32() -> None:
    for magnitude in (1e-30, 1e-7, 1.0, 1e30):
        x = gaussian(8, 64) * magnitude
        y = roundtrip("quant:bits=4", x)
        assert torch.isfinite(y).all() and relative_error(x, y) < 0.02
    assert not roundtrip("quant:bits=2", torch.zeros(3, 5)).any()


def test_stochastic_rounding_is_unbiased_and_seeded() -> None:
    x = torch.full((64, 64), 0.3) + gaussian(64, 64) * 0.01
    x[:, 0] = 2.0  # sets the row's scale so that 0.3 falls between two levels
    codec = make_codec("quant:bits=2,stochastic=true,levels=uniform", seed=5)
    mean = sum(codec.decode(codec.encode(x, TRAIN), TRAIN) for _ in range(50)) / 50
    nearest = roundtrip("quant:bits=2,levels=uniform", x)  # 0.3 rounds to the level 2/3
    assert abs(float((mean - x)[:, 1:].mean())) < 0.01 and float((nearest - x)[:, 1:].mean()) > 0.3
    a, b = (make_codec("quant:stochastic=true", seed=5).encode(x, TRAIN) for _ in range(2))
    assert a.arrays["q"].tobytes() == b.arrays["q"].tobytes()


def test_evaluation_may_cross_at_other_bits() -> None:
    codec = make_codec("quant:bits=2,eval_bits=8")
    x = gaussian(4, 32, 64)
    train, evaluation = codec.encode(x, TRAIN), codec.encode(x, EVAL)
    assert (train.meta["bits"], evaluation.meta["bits"], evaluation.meta["levels"]) == (2, 8, "uniform")
    assert relative_error(x, codec.decode(evaluation, EVAL)) < 1e-4 < relative_error(x, codec.decode(train, TRAIN))


# ---------------------------------------------------------------- hadamard and outliers


def test_the_rotation_is_orthogonal_and_spreads_an_outlier() -> None:
    codec = make_codec("hadamard", seed=3)
    for shape in [(4, 576), (3, 7), (2, 5, 64), (10,)]:
        x = gaussian(*shape, seed=1).double()
        p = codec.encode(x, TRAIN)
        rotated = torch.from_numpy(p.arrays[">x"])
        assert torch.allclose(rotated.norm(), x.norm()) and not torch.allclose(rotated, x)
        assert torch.allclose(codec.decode(over_the_wire(p), TRAIN), x, atol=1e-12)
        # the adjoint: <R x, g> = <x, R^T g>, and a gradient rotated and back is unchanged
        g = gaussian(*shape, seed=2).double()
        rg = codec.decode_adjoint(g, p, TRAIN)
        assert torch.allclose((rotated * g).sum(), (x * codec.encode_adjoint(g, p, TRAIN)).sum())
        assert torch.allclose(codec.encode_adjoint(rg, p, TRAIN), g, atol=1e-12)
    spike = torch.zeros(1, 576)
    spike[0, 100] = 64.0
    rotated = torch.from_numpy(codec.encode(spike, TRAIN).arrays[">x"])
    assert float(rotated.abs().max()) == pytest.approx(8.0)  # spread over the 64 channels of its block


def test_outlier_channels_cross_exactly_and_free_the_scales() -> None:
    x = llm_like()
    y = roundtrip("outliers:k=2>quant:bits=4", x)
    assert torch.equal(y[..., [7, 200]], x[..., [7, 200]].half().float())
    rest = [c for c in range(256) if c not in (7, 200)]
    alone = roundtrip("quant:bits=4", x)
    assert relative_error(x[..., rest], y[..., rest]) < relative_error(x[..., rest], alone[..., rest]) / 20


def test_rotation_and_outliers_make_two_bits_enough_for_llm_like_states() -> None:
    """Channel outliers and a massive first token: per-channel scales (fixpoint) and per-token
    scales with or without the rotation leave nothing of the ordinary values at 2 bits; with the
    outlier channels split off, they get the Lloyd-Max error of a normal variable."""
    x = llm_like()
    ordinary = [c for c in range(256) if c not in (7, 200)]

    def errors(spec: str) -> tuple[float, float]:
        y = roundtrip(spec, x)
        return relative_error(x, y), relative_error(x[:, 1:][..., ordinary], y[:, 1:][..., ordinary])

    best_all, best_ordinary = errors("outliers:k=2>hadamard>quant:bits=2")
    assert best_ordinary == pytest.approx(LLOYD_MAX_MSE[2], rel=0.1)
    for spec in ["fixpoint:bits=2,channel_dim=2", "quant:bits=2", "hadamard>quant:bits=2"]:
        every, ordinary_error = errors(spec)
        assert ordinary_error > 0.9 and every > 20 * best_all, spec


def test_a_linear_codec_after_the_rotation_keeps_its_adjoint() -> None:
    """hadamard>lowrank: the cloud sends P^T (R g), as small as the factors, and the edge maps it
    to R^-1 P P^T R g: the gradient of <decode(encode(x)), g> with P held, as for lowrank alone."""
    x, g = gaussian(2, 16, 32, seed=1), gaussian(2, 16, 32, seed=2)
    codec = make_codec("hadamard>lowrank:rank=2,fp16=false")
    p = codec.encode(x, TRAIN)
    sent = codec.decode_adjoint(g, p, TRAIN)
    assert sent.shape == (2, 2, 32)
    back = codec.encode_adjoint(sent, p, TRAIN)
    rows_r = torch.from_numpy(make_codec("hadamard").encode(torch.eye(32), TRAIN).arrays[">x"])  # R^T
    factors = torch.from_numpy(p.arrays[">P"])
    expected = (factors @ (factors.transpose(1, 2) @ (g @ rows_r))) @ rows_r.T
    assert torch.allclose(back, expected, atol=1e-5)


# ---------------------------------------------------------------- delta


SPEC = "hadamard>delta>quant:bits=2"


def ids_ctx(ids: np.ndarray, resync: bool = False) -> CodecContext:
    return CodecContext(train=True, sample_ids=ids, resync=resync)


def drifting(n: int = 16, t: int = 0) -> torch.Tensor:
    return gaussian(n, 8, 64, seed=1) + 0.02 * t * gaussian(n, 8, 64, seed=2)


def test_deltas_start_at_the_first_step_and_the_ends_stay_bit_identical() -> None:
    edge, cloud = make_codec(SPEC, seed=4), make_codec(SPEC, seed=4)
    ids = np.arange(16, dtype=np.int64)
    errors = []
    for t in range(4):
        x = drifting(t=t)
        p = edge.encode(x, ids_ctx(ids))
        assert p.arrays[">full"].tolist() == [0, 0] and p.arrays[">x"].shape[0] == 0  # never a full-precision send
        assert p.nbytes < x.numel() * 2 / 8 + 16 * 8 * 2 + 16 * 24 + 8
        errors.append(relative_error(x, cloud.decode(over_the_wire(p), ids_ctx(ids))))
        a, b = edge.state_dict()["inner"], cloud.state_dict()["inner"]
        assert a["buffer"].numpy().tobytes() == b["buffer"].numpy().tobytes() and torch.equal(a["steps"], b["steps"])
    assert errors[0] == pytest.approx(LLOYD_MAX_MSE[2], rel=0.1)  # the first send: the sample, quantized
    assert errors[-1] < errors[0] / 10  # each send carries what the last one missed


def test_a_lost_message_is_caught_and_a_full_resend_repairs_it() -> None:
    edge, cloud = make_codec(SPEC), make_codec(SPEC)
    ids = np.arange(16, dtype=np.int64)
    cloud.decode(edge.encode(drifting(t=0), ids_ctx(ids)), ids_ctx(ids))
    edge.encode(drifting(t=1), ids_ctx(ids))  # lost
    before = cloud.state_dict()
    with pytest.raises(DesyncError) as err:
        cloud.decode(edge.encode(drifting(t=2), ids_ctx(ids)), ids_ctx(ids))
    assert err.value.reason == "steps" and sorted(err.value.ids) == ids.tolist()
    assert torch.equal(before["inner"]["buffer"], cloud.state_dict()["inner"]["buffer"])
    x = drifting(t=2)
    y = cloud.decode(edge.encode(x, ids_ctx(ids, resync=True)), ids_ctx(ids))
    assert torch.allclose(y, x, atol=1e-6)
    cloud.decode(edge.encode(drifting(t=3), ids_ctx(ids)), ids_ctx(ids))  # and deltas flow again


def test_diverged_rows_fail_the_checksum_and_evaluation_touches_nothing() -> None:
    edge, cloud = make_codec(SPEC), make_codec(SPEC)
    ids = np.arange(16, dtype=np.int64)
    cloud.decode(edge.encode(drifting(t=0), ids_ctx(ids)), ids_ctx(ids))
    held = cloud.state_dict()
    x = drifting(t=5)
    assert cloud.decode(edge.encode(x, EVAL), EVAL).shape == x.shape
    assert all(torch.equal(held["inner"][k], cloud.state_dict()["inner"][k]) for k in held["inner"])
    held["inner"]["buffer"][3, 5] += 0.5  # e.g. a checkpoint from somewhere else
    cloud.load_state_dict(held)
    with pytest.raises(DesyncError) as err:
        cloud.decode(edge.encode(drifting(t=1), ids_ctx(ids)), ids_ctx(ids))
    assert err.value.reason == "checksum" and err.value.ids == [3]


def test_delta_warm_up_and_the_codecs_it_cannot_wrap() -> None:
    edge, cloud = make_codec("delta:warmup=1>quant"), make_codec("delta:warmup=1>quant")
    ids = np.arange(4, dtype=np.int64)
    x = gaussian(4, 10)
    first = edge.encode(x, ids_ctx(ids))
    assert first.arrays["x"].shape == (4, 10) and torch.equal(cloud.decode(first, ids_ctx(ids)), x)
    assert edge.encode(x, ids_ctx(ids)).arrays["x"].shape == (0, 10)
    with pytest.raises(CompressionError, match="keeps state per sample"):
        make_codec("delta>acsgd")
    with pytest.raises(CompressionError, match="sample_ids"):
        make_codec(SPEC).encode(x, TRAIN)


def test_the_price_of_a_chain_adds_its_stages() -> None:
    x = llm_like()
    spec = "outliers:k=2>hadamard>delta>quant:bits=2"
    edge, cloud = make_codec(spec), make_codec(spec)
    ctx = ids_ctx(np.arange(2, dtype=np.int64))
    p = over_the_wire(edge.encode(x, ctx))
    cost, flops = cloud.decode_cost(p, ctx), cloud.decode_flops(p, ctx)
    alone = make_codec("quant:bits=2")
    inner_cost = alone.decode_cost(over_the_wire(alone.encode(x, TRAIN)), TRAIN)
    held = cloud.held_nbytes()
    y = cloud.decode(p, ctx)
    assert cost > inner_cost + 3 * y.nbytes and flops > cost // 2
    assert cost >= cloud.held_nbytes() - held
    assert edge.encode_flops(tuple(x.shape), x.dtype) > 2 * alone.encode_flops(tuple(x.shape), x.dtype)
    assert math.isclose(cloud.held_nbytes(), edge.held_nbytes(), rel_tol=0.1)


def test_first_sends_may_take_more_bits_than_the_changes_after_them() -> None:
    spec = "hadamard>delta>quant:bits=1,first_bits=3"
    edge, cloud = make_codec(spec), make_codec(spec)
    ids = np.arange(16, dtype=np.int64)
    sizes, errors = [], []
    for t in range(3):
        x = drifting(t=t)
        p = edge.encode(x, ids_ctx(ids))
        sizes.append(p.arrays[">>q"].nbytes)
        errors.append(relative_error(x, cloud.decode(over_the_wire(p), ids_ctx(ids))))
    assert sizes == [16 * 8 * 64 * 3 // 8, 16 * 8 * 64 // 8, 16 * 8 * 64 // 8]
    assert errors[0] == pytest.approx(LLOYD_MAX_MSE[3], rel=0.1) and errors[2] < errors[0]
    # alone, or under no delta, first_bits changes nothing
    assert make_codec("quant:bits=1,first_bits=3").encode(drifting(), TRAIN).meta["bits"] == 1
