"""What a receiver lets an untrusted peer ask of its codecs, and what a payload may cost it.

Every option of every codec is classified (negotiable or local-only) and the costly ones are
capped by :class:`compressors.Bounds`; ``check_spec`` refuses the rest with a typed error.
``decode_cost`` prices a payload from its metadata before it is decoded, and is an upper bound
on what decoding allocates; caches are per instance and bounded, and ``held_nbytes`` says what
an instance holds. The regression cases are requests and payloads found to be hostile.
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compressors
from compressors import (
    Bounds,
    Codec,
    CodecContext,
    CompressionError,
    Payload,
    PolicyError,
    UnknownCodecError,
    check_spec,
    make_codec,
)
from compressors._device import portable_kernels
from compressors.circconv import KEY_SIZES
from compressors.lowrank import WARM_SHAPES
from compressors.policy import bound_names
from splitft.app import allocator
from tests.conftest import ROOT
from tests.test_codec_properties import _mutate
from tests.test_registry_walk import CASES, EXTRA_SPECS, ctx_for, make_input, over_the_wire

GiB = 1 << 30
TRAIN = CodecContext(train=True)


def fastest_seconds(fn, repeat: int = 3) -> float:
    """The quickest of a few runs: the machine is shared, so one run may be descheduled."""
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


# ---------------------------------------------------------------- classification


@pytest.mark.parametrize("name", compressors.names())
def test_every_option_is_classified_and_every_bound_is_real(name: str) -> None:
    cls = compressors.codec_class(name)
    options = set(cls.options())
    assert cls.negotiable_options | cls.local_options == options
    assert not cls.negotiable_options & cls.local_options
    assert set(cls.bounded_by) <= cls.negotiable_options
    assert set(cls.bounded_by.values()) <= bound_names()
    assert bound_names() == {f.name for f in dataclasses.fields(Bounds)}


def test_costly_and_local_options_are_declared_where_the_attacks_were() -> None:
    assert compressors.codec_class("acsgd").local_options == {"path"}
    assert compressors.codec_class("acsgd").bounded_by == {"capacity": "max_ids", "warmup": "max_warmup"}
    assert compressors.codec_class("lowrank").bounded_by == {"rank": "max_rank", "iters": "max_iters"}
    assert compressors.codec_class("c3sl").bounded_by == {"r": "max_r"}


def test_registration_refuses_an_unclassified_or_misbound_option() -> None:
    class Unclassified(Codec):
        """A codec whose author forgot to classify its option."""

        name = "policy-test-unclassified"

        def __init__(self, *, size: int = 1, seed: int = 0) -> None:
            super().__init__(seed=seed)

        def encode(self, x, ctx):  # pragma: no cover - never built
            raise NotImplementedError

        def decode(self, payload, ctx):  # pragma: no cover - never built
            raise NotImplementedError

    with pytest.raises(CompressionError, match="not classified.*negotiable_options.*local_options"):
        compressors.register(Unclassified)

    class BadBound(Unclassified):
        """Bounded by a field that Bounds does not have."""

        name = "policy-test-badbound"
        negotiable_options = frozenset({"size"})
        bounded_by = {"size": "max_size"}

    with pytest.raises(CompressionError, match="not a Bounds field"):
        compressors.register(BadBound)
    assert not {"policy-test-unclassified", "policy-test-badbound"} & set(compressors.names())


# ---------------------------------------------------------------- Bounds


def test_bounds_defaults_are_frozen_and_validated() -> None:
    b = Bounds()
    assert (b.max_rank, b.max_iters, b.max_r, b.max_ids, b.max_warmup, b.max_spec_chars) == (
        64, 16, 64, 1 << 22, 100, 256)
    with pytest.raises(dataclasses.FrozenInstanceError):
        b.max_rank = 1_000_000  # type: ignore[misc]
    assert Bounds(max_warmup=0).max_warmup == 0
    for field in bound_names():
        for bad in (-1, True, 1.5, "8", None):
            with pytest.raises(CompressionError, match=f"Bounds.{field}"):
                Bounds(**{field: bad})
    with pytest.raises(CompressionError, match="Bounds.max_rank must be an int >= 1"):
        Bounds(max_rank=0)


# ---------------------------------------------------------------- check_spec: acceptance

_VALUE = r"(?:-?\d[\w.+-]*|true|false)"  # concrete values, not placeholders such as r=R
_NAME = r"(?:identity|fp16|fixpoint|lowrank|c3sl|binary|acsgd|quant|hadamard|outliers|delta)"
_STAGE = rf"{_NAME}(?::[a-z_]+={_VALUE}(?:,[a-z_]+={_VALUE})*)?"
SPEC_TEXT = re.compile(rf"\b{_STAGE}(?:>{_STAGE})*\b")


def documented_specs() -> list[str]:
    """Every concrete spec written in the README, docs, scripts and examples."""
    sources = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "docs").rglob("*.csv")),
               *sorted((ROOT / "scripts").glob("*.py")), *sorted((ROOT / "examples").rglob("*.py"))]
    attacks = {"hostile_load.py"}  # sends, on purpose, the specs a cloud must refuse
    found = set()
    for path in sources:
        if path.name not in attacks:
            found.update(SPEC_TEXT.findall(path.read_text(encoding="utf-8")))
    return sorted(found)


def test_documented_specs_are_found() -> None:
    specs = documented_specs()
    assert {"c3sl:r=16", "lowrank:rank=4", "acsgd:bits=2", "fixpoint:bits=8"} <= set(specs)


@pytest.mark.parametrize("spec", sorted({*compressors.names(), *EXTRA_SPECS, *documented_specs(),
                                         *(compressors.default_grad_spec(n) for n in compressors.names()),
                                         "lowrank:rank=4,iters=1", "acsgd:capacity=2000", "acsgd:warmup=0"}))
def test_every_spec_in_use_passes_the_default_bounds(spec: str) -> None:
    make_codec(spec)
    assert check_spec(spec, Bounds()) == compressors.canonical_spec(spec)
    make_codec(spec, bounds=Bounds())


def test_check_spec_returns_the_canonical_form() -> None:
    assert check_spec(" lowrank:iters=1, rank=4 ", Bounds()) == "lowrank:iters=1,rank=4"
    assert check_spec("c3sl:r=64", Bounds()) == "c3sl:r=64"  # a bound is inclusive
    assert check_spec("fp16", Bounds(), allowed=["fp16", "identity"]) == "fp16"
    assert check_spec("lowrank:iters=400000", Bounds(max_iters=400_000)) == "lowrank:iters=400000"


# ---------------------------------------------------------------- check_spec: refusals


@pytest.mark.parametrize("spec,codec,option,value,bound", [
    ("acsgd:capacity=300000000", "acsgd", "capacity", 300_000_000, "max_ids"),
    ("acsgd:warmup=1000000", "acsgd", "warmup", 1_000_000, "max_warmup"),
    ("lowrank:rank=1,iters=400000", "lowrank", "iters", 400_000, "max_iters"),
    ("lowrank:rank=100000", "lowrank", "rank", 100_000, "max_rank"),
    ("lowrank:rank=1e9", "lowrank", "rank", 1e9, "max_rank"),
    ("c3sl:r=1000000", "c3sl", "r", 1_000_000, "max_r"),
])
def test_options_beyond_their_bound_are_refused_naming_all_four(spec, codec, option, value, bound) -> None:
    with pytest.raises(PolicyError) as info:
        check_spec(spec, Bounds())
    err = info.value
    assert (err.codec, err.option, err.value, err.bound) == (codec, option, value, bound)
    text = str(err)
    assert codec in text and f"{option}=" in text and str(value) in text
    assert f"{bound}={getattr(Bounds(), bound)}" in text
    with pytest.raises(PolicyError):
        make_codec(spec, bounds=Bounds())


def test_a_local_path_from_a_peer_is_refused_and_no_file_is_made(tmp_path: Path) -> None:
    target = tmp_path / "where-the-edge-says" / "x.npy"
    spec = f"acsgd:path={target},capacity=2000"
    refusal = "option path names a local resource and is never accepted from a peer"
    with pytest.raises(PolicyError, match=refusal) as info:
        check_spec(spec, Bounds())
    assert (info.value.codec, info.value.option) == ("acsgd", "path")
    # named first even when another option is also out of bounds
    with pytest.raises(PolicyError, match="option path names a local resource"):
        check_spec(f"acsgd:capacity=300000000,path={target}", Bounds())
    with pytest.raises(PolicyError):
        make_codec(spec, bounds=Bounds())
    assert not target.parent.exists()
    # this end's own configuration may still name a file
    local = make_codec(f"acsgd:capacity=4,path={target}")
    local.decode(make_codec("acsgd:capacity=4").encode(torch.ones(2, 3), CodecContext(sample_ids=np.arange(2))),
                 CodecContext(sample_ids=np.arange(2)))
    assert target.exists()


def test_names_outside_the_allowed_set_are_refused_listing_the_allowed() -> None:
    with pytest.raises(PolicyError, match="codec 'c3sl' is not allowed on this end; allowed: fixpoint, fp16, identity"):
        check_spec("c3sl:r=4", Bounds(), allowed=("identity", "fp16", "fixpoint"))
    with pytest.raises(PolicyError) as info:
        check_spec("c3sl:r=4", Bounds(), allowed=["fp16"])
    assert (info.value.codec, info.value.option, info.value.bound) == ("c3sl", "", "")
    with pytest.raises(PolicyError, match=r"allowed: \(none\)"):
        check_spec("identity", Bounds(), allowed=())


def test_other_spec_errors_keep_their_types() -> None:
    with pytest.raises(UnknownCodecError):
        check_spec("lowrnak:rank=2", Bounds())
    with pytest.raises(CompressionError, match="has no option") as info:
        check_spec("lowrank:depth=3", Bounds())
    assert not isinstance(info.value, PolicyError)
    for bad in ("lowrank:rank=0", "c3sl:r=true", "acsgd:capacity=-5", "fixpoint:bits=17", ""):
        with pytest.raises(CompressionError):
            check_spec(bad, Bounds())
    with pytest.raises(PolicyError, match="max_spec_chars=256"):
        check_spec("fixpoint:" + ",".join(["bits=8"] * 60), Bounds())
    with pytest.raises(CompressionError, match="compressors.Bounds"):
        check_spec("fp16", None)  # type: ignore[arg-type]


# ---------------------------------------------------------------- decode_cost over the walk


@pytest.mark.parametrize("spec,shape,dtype,strided", CASES)
def test_decode_cost_bounds_the_decoded_tensor(spec: str, shape, dtype, strided: bool) -> None:
    x = make_input(spec, shape, dtype, strided)
    enc, dec = make_codec(spec, seed=7), make_codec(spec, seed=7)
    ctx = ctx_for(spec, x)
    wire = over_the_wire(enc.encode(x, ctx))
    held = dec.held_nbytes()
    cost, flops = dec.decode_cost(wire, ctx), dec.decode_flops(wire, ctx)
    assert isinstance(cost, int) and isinstance(flops, int)
    assert dec.held_nbytes() == held, "pricing a payload must not change what the codec holds"
    y = dec.decode(wire, ctx)
    assert cost >= y.element_size() * y.nelement()
    assert flops >= y.nelement()
    # growth of the codec's state on decode is part of the price
    assert cost >= dec.held_nbytes() - held


@pytest.mark.parametrize("spec", compressors.names() + ["outliers:k=2>hadamard>delta>quant:bits=2"])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_decode_cost_of_mutated_payloads_raises_only_compression_errors(spec: str, data: st.DataObject) -> None:
    x = make_input(spec, (5, 3, 4, 4), torch.float32, strided=False)
    ctx = ctx_for(spec, x)
    bad = _mutate(make_codec(spec, seed=1).encode(x, ctx), data)
    dec = make_codec(spec, seed=1, bounds=Bounds())
    try:
        cost = dec.decode_cost(bad, TRAIN)
    except CompressionError:
        return
    assert isinstance(cost, int) and cost >= 0
    if cost > 256 << 20:
        return  # priced beyond any budget: a runtime refuses it unseen
    try:
        y = dec.decode(bad, TRAIN)
    except CompressionError:
        return
    assert cost >= y.element_size() * y.nelement()


class _Halves(Codec):
    """A codec that relies on the default price: float16 values of the tensor in the metadata."""

    name = "policy-test-halves"

    def encode(self, x, ctx):  # pragma: no cover - only decoding is priced here
        raise NotImplementedError

    def decode(self, payload, ctx):
        return torch.from_numpy(payload.arrays["x"].copy()).to(getattr(torch, payload.meta["dtype"]))


def test_the_default_price_reads_shape_and_dtype_and_validates_them() -> None:
    codec = _Halves()
    p = Payload(codec.name, 1, {"x": np.zeros((8, 16), dtype=np.float16)}, {"shape": [8, 16], "dtype": "float64"})
    cost = codec.decode_cost(p, TRAIN)
    assert cost >= codec.decode(p, TRAIN).nbytes and cost == 8 * 16 * (2 + 8 + 4)
    assert codec.decode_flops(p, TRAIN) == cost and codec.held_nbytes() == 0
    for meta in ({"shape": "x", "dtype": "float32"}, {"shape": [-1], "dtype": "float32"},
                 {"shape": [1 << 41], "dtype": "float32"}, {"shape": [8, 16], "dtype": "int64"},
                 {"shape": [8, 16], "dtype": "__class__"}, {"shape": [8, 16]}):
        with pytest.raises(CompressionError):
            codec.decode_cost(Payload(codec.name, 1, p.arrays, meta), TRAIN)
    with pytest.raises(CompressionError, match="cannot decode"):
        codec.decode_cost(Payload("fp16", 1, p.arrays, p.meta), TRAIN)


# ---------------------------------------------------------------- decode_cost: hostile payloads


def lowrank_rank1_of(n: int) -> Payload:
    """Two n-long fp16 factors naming an n x n matrix (the product is n^2 values)."""
    factor = np.ones((1, n, 1), dtype=np.float16)
    return Payload("lowrank", 1, {"P": factor, "Q": factor.copy()},
                   {"shape": [1, n, n], "dtype": "float32", "mode": "lowrank", "rank": 1})


def test_rank1_factors_of_32768_are_priced_beyond_a_gib_quickly() -> None:
    p = lowrank_rank1_of(32768)
    assert p.nbytes == 131072
    codec = make_codec("lowrank:rank=1", bounds=Bounds())
    assert codec.decode_cost(p, TRAIN) > GiB
    assert codec.decode_flops(p, TRAIN) > 2 * 32768 ** 2
    assert fastest_seconds(lambda: codec.decode_cost(p, TRAIN)) < 0.05


@pytest.mark.parametrize("spec, shape", [
    ("lowrank:iters=16,rank=64", (8, 128, 96)),
    ("lowrank:rank=4", (8, 128, 96)),
    ("lowrank:iters=3,rank=8,fp16=false", (4, 64, 300)),
    ("lowrank:rank=4", (64, 32)),  # not a batch of matrices: it travels raw
    ("identity", (64, 32)),
])
def test_encode_flops_bounds_the_arithmetic_torch_counts_in_encode(spec: str, shape: tuple) -> None:
    """The cloud encodes with the codec an edge named (a gradient through lowrank:iters=16,rank=64):
    what that costs is known from the shape before the tensor exists, and it is an upper bound."""
    from torch.utils.flop_counter import FlopCounterMode

    codec = make_codec(spec)
    with FlopCounterMode(display=False) as counted:
        codec.encode(torch.randn(*shape), TRAIN)
    priced = codec.encode_flops(shape, torch.float32)
    assert counted.get_total_flops() <= priced <= 2 * counted.get_total_flops() + 8 * math.prod(shape)


def test_encode_flops_grow_with_the_options_a_peer_asks_for() -> None:
    shape = (256, 256, 256)  # the 64 MiB gradient of a probe that stalled a cloud
    cheap, costly = (make_codec(s).encode_flops(shape, torch.float32)
                     for s in ("lowrank:rank=4", "lowrank:iters=16,rank=64"))
    assert costly > 100 * cheap and costly > 5 * 10**10


def test_a_payload_claiming_more_rank_than_agreed_is_refused() -> None:
    x = torch.randn(2, 16, 24)
    p = make_codec("lowrank:rank=4").encode(x, TRAIN)
    low = make_codec("lowrank:rank=2")
    with pytest.raises(CompressionError, match="'rank'"):
        low.decode_cost(p, TRAIN)
    with pytest.raises(CompressionError, match="'rank'"):
        low.decode(p, TRAIN)


def test_decode_cost_matches_small_decodes_before_it_is_trusted_for_large() -> None:
    codec = make_codec("lowrank:rank=1")
    small = lowrank_rank1_of(64)
    assert codec.decode_cost(small, TRAIN) >= 64 * 64 * 4
    torch.testing.assert_close(codec.decode(small, TRAIN), torch.ones(1, 64, 64))


@pytest.mark.parametrize("spec", ["fixpoint:bits=2", "binary"])
def test_float64_metadata_on_few_bit_codes_is_priced_at_its_expansion(spec: str) -> None:
    n = 1 << 27  # 16 MiB of 1-bit codes, 32 MiB of 2-bit ones
    name = spec.partition(":")[0]
    if name == "binary":
        p = Payload(name, 1, {"bits": np.zeros(n // 8, dtype=np.uint8)}, {"shape": [n], "dtype": "float64"})
    else:
        p = Payload(name, 1, {"q": np.zeros(n // 4, dtype=np.uint8), "scale": np.ones(1, dtype=np.float16)},
                    {"shape": [n], "dtype": "float64", "bits": 2, "axis": None})
    codec = make_codec(spec, bounds=Bounds())
    cost = codec.decode_cost(p, TRAIN)
    assert cost > GiB
    assert cost / p.nbytes >= 75  # what the wire carried is no measure of what decoding costs
    assert fastest_seconds(lambda: codec.decode_cost(p, TRAIN)) < 0.05
    # the same shape in float32 is priced lower: the output dtype is read from the metadata
    p32 = Payload(p.codec, p.version, p.arrays, {**p.meta, "dtype": "float32"})
    assert codec.decode_cost(p32, TRAIN) < cost


def test_c3sl_keys_for_a_huge_row_are_priced_before_they_are_built() -> None:
    d = 1 << 22
    p = Payload("c3sl", 1, {"v": np.zeros((1, d), dtype=np.float32)},
                {"shape": [64, d], "dtype": "float32", "r": 64, "key_crc": 0})
    codec = make_codec("c3sl:r=64", bounds=Bounds())
    assert codec.decode_cost(p, TRAIN) > 64 * d * 8  # the keys alone are 2 GiB
    assert fastest_seconds(lambda: codec.decode_cost(p, TRAIN)) < 0.05
    assert codec.held_nbytes() == 0, "pricing built no keys"


# ---------------------------------------------------------------- AC-SGD sample ids


def acsgd_forward_naming(sample_id: int, d: int = 1) -> Payload:
    """A training forward of one sample (full precision: its first send) with the given id."""
    sender = make_codec("acsgd")
    p = sender.encode(torch.ones(1, d), CodecContext(sample_ids=np.array([0])))
    return Payload(p.codec, p.version, {**p.arrays, "ids": np.array([sample_id], dtype=np.int64)}, p.meta)


def test_one_small_forward_naming_a_huge_sample_id() -> None:
    p = acsgd_forward_naming(399_999_999)
    assert p.nbytes < 100
    # a codec built for a peer refuses it, before and at decode, holding nothing
    guarded = make_codec("acsgd", bounds=Bounds())
    for price_or_decode in (guarded.decode_cost, guarded.decode):
        with pytest.raises(CompressionError, match="sample id 399999999 is beyond this end's bound max_ids=4194304"):
            price_or_decode(p, TRAIN)
    assert guarded.held_nbytes() == 0
    # without bounds, the price says what the decode would grow to (about 3.7 GiB): a runtime
    # comparing it with its budget refuses the payload
    trusting = make_codec("acsgd")
    assert trusting.decode_cost(p, TRAIN) > 3 * GiB
    assert fastest_seconds(lambda: trusting.decode_cost(p, TRAIN)) < 0.05
    assert trusting.held_nbytes() == 0


def test_max_ids_is_a_count_of_ids() -> None:
    codec = make_codec("acsgd", bounds=Bounds(max_ids=100))
    codec.decode(acsgd_forward_naming(99), TRAIN)
    with pytest.raises(CompressionError, match="max_ids=100"):
        codec.decode(acsgd_forward_naming(100), TRAIN)
    with pytest.raises(CompressionError, match="max_ids=100"):  # the codec's own sends too
        codec.encode(torch.ones(1, 1), CodecContext(sample_ids=np.array([100])))


def test_acsgd_price_includes_buffer_growth_and_held_bytes_follow_it() -> None:
    d, ids = 48, np.arange(0, 64, dtype=np.int64)
    enc, dec = make_codec("acsgd:warmup=0"), make_codec("acsgd:warmup=0")
    x = torch.randn(64, d)
    p = over_the_wire(enc.encode(x, CodecContext(sample_ids=ids)))
    assert dec.held_nbytes() == 0
    cost = dec.decode_cost(p, TRAIN)
    dec.decode(p, CodecContext(sample_ids=ids))
    held = dec.held_nbytes()
    assert held >= 64 * (2 * d + 8)
    assert cost >= held + x.nbytes
    # ids the buffers already cover add nothing; a larger id adds its growth
    p2 = over_the_wire(enc.encode(x, CodecContext(sample_ids=ids)))
    assert cost - dec.decode_cost(p2, TRAIN) >= 64 * (2 * d + 8)
    far = acsgd_forward_naming(10_000, d)
    assert dec.decode_cost(far, TRAIN) >= 10_001 * (2 * d + 8)


# ---------------------------------------------------------------- held memory and caches


def test_c3sl_key_cache_keeps_only_the_latest_row_sizes() -> None:
    r, sizes = 4, range(1000, 1020)
    enc, dec = make_codec(f"c3sl:r={r}"), make_codec(f"c3sl:r={r}")
    held = []
    for d in sizes:  # a new row size per message
        dec.decode(enc.encode(torch.randn(r, d), TRAIN), TRAIN)
        held.append(dec.held_nbytes())
    most = KEY_SIZES * (r * max(sizes) * 8 + 4 * r * (max(sizes) // 2 + 1) * 16)
    assert 0 < held[-1] <= most
    assert held[-1] <= held[KEY_SIZES] * 1.05, "held bytes stop growing once the cache is full"


def test_lowrank_warm_starts_are_bounded() -> None:
    codec = make_codec("lowrank:rank=2")
    for h in range(16, 16 + 3 * WARM_SHAPES):
        codec.encode(torch.randn(2, 16, h), TRAIN)
    assert len(codec.state_dict()) == WARM_SHAPES
    assert 0 < codec.held_nbytes() <= WARM_SHAPES * (16 + 3 * WARM_SHAPES) * 2 * 4


@pytest.mark.parametrize("name", ["identity", "fp16", "fixpoint", "binary"])
def test_stateless_codecs_hold_nothing(name: str) -> None:
    codec = make_codec(name)
    x = make_input(name, (4, 6, 5), torch.float32, strided=False)
    codec.decode(codec.encode(x, ctx_for(name, x)), ctx_for(name, x))
    assert codec.held_nbytes() == 0


def module_containers() -> dict[str, int]:
    """Sizes of every dict, list, set and cache at module level in the codec package."""
    sizes = {}
    for mod_name, mod in sorted(sys.modules.items()):
        if mod_name != "compressors" and not mod_name.startswith("compressors."):
            continue
        for attr, value in vars(mod).items():
            if hasattr(value, "cache_info"):
                sizes[f"{mod_name}.{attr}"] = value.cache_info().currsize
            elif isinstance(value, (dict, list, set)) and not attr.startswith("__"):
                sizes[f"{mod_name}.{attr}"] = len(value)
    return sizes


def test_no_module_level_cache_grows_with_traffic() -> None:
    before = module_containers()
    for d in range(100, 140):  # 40 AC-SGD codecs of different row sizes, and the other families
        enc, dec = make_codec("acsgd:warmup=0"), make_codec("acsgd:warmup=0")
        ids = np.arange(3)
        dec.decode(enc.encode(torch.randn(3, d), CodecContext(sample_ids=ids)), CodecContext(sample_ids=ids))
        for spec in ("c3sl:r=2", "lowrank:rank=1", "fixpoint:bits=3", "binary:take_sign=true"):
            codec = make_codec(spec)
            codec.decode(codec.encode(torch.randn(2, 3, d), TRAIN), TRAIN)
    gc.collect()
    assert module_containers() == before


# ---------------------------------------------------------------- decode_cost against measured peaks


def _release_free_memory() -> bool:
    """Hand freed heap pages back to the kernel, so a decode that reuses them shows in the
    resident set (glibc only; elsewhere the measurement would see too little)."""
    gc.collect()
    try:
        return bool(ctypes.CDLL("libc.so.6").malloc_trim(0) or True)
    except (OSError, AttributeError):
        return False


def _rss_peak_reset() -> int | None:
    """Reset this process's peak resident set to its current one; its value, or None."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmHWM")
    except OSError:
        return None


def _status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"/proc/self/status has no {field}")


#: Not proportional to the tensors: allocator bookkeeping and library workspaces (BLAS, FFT).
#: ``decode_cost`` counts tensors and arrays; a runtime's budget leaves this much spare.
WORKSPACE_SLACK = 4 << 20


@pytest.mark.parametrize("spec", ["identity", "fp16", "fixpoint:bits=3", "fixpoint:bits=8", "binary",
                                  "lowrank:rank=1", "lowrank:rank=4", "c3sl:r=4", "acsgd", "acsgd:warmup=0",
                                  "acsgd:eval_bits=8", "quant:bits=2", "quant:bits=8,levels=uniform,tile=64",
                                  "hadamard>quant:bits=2", "outliers:k=4>hadamard>delta>quant:bits=2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_decode_cost_bounds_the_measured_peak(spec: str, dtype: torch.dtype) -> None:
    assert_decode_peak_priced(spec, dtype)


@pytest.mark.parametrize("spec", ["fixpoint:bits=3", "fixpoint:bits=8", "binary"])
def test_decode_cost_bounds_the_measured_peak_of_the_device_kernels(spec: str) -> None:
    """The torch kernels an accelerator runs (bit planes, signs), measured on the CPU."""
    assert_decode_peak_priced(spec, torch.float32, portable=True)


def assert_decode_peak_priced(spec: str, dtype: torch.dtype, portable: bool = False) -> None:
    """Decode a 4 Mi-value payload of ``spec`` and compare the process's measured peak with the
    codec's ``decode_cost`` (``portable``: through the device kernels)."""
    if _rss_peak_reset() is None or not _release_free_memory():
        pytest.skip("needs Linux /proc/self/clear_refs and glibc malloc_trim to measure a peak")
    # Each buffer of 1 MiB or more mapped on its own: what the decode allocates. In a heap the
    # decode's buffers would land in holes (up to a third over the live tensors) that depend on the
    # tests that ran first and on the address layout, as glibc's default threshold rises with
    # what this process freed before.
    allocator.tune(mmap_threshold=1 << 20)
    with portable_kernels(portable):
        x = make_input(spec, (64, 64, 1024), dtype, strided=False)  # 4 Mi values
        enc, dec, warm = make_codec(spec), make_codec(spec), make_codec(spec)
        ctx = ctx_for(spec, x, train="eval_bits" not in spec)
        wire = over_the_wire(enc.encode(x, ctx))
        del x, enc
        cost = dec.decode_cost(wire, ctx)
        warm.decode(wire, ctx)  # code pages and one-off library state are not the decode's cost
        del warm
        _release_free_memory()
        base = _rss_peak_reset()
        y = dec.decode(wire, ctx)
        peak = _status_bytes("VmHWM") - base
    del y
    assert peak <= cost + WORKSPACE_SLACK, (
        f"decode of {spec} peaked at {peak / 2**20:.1f} MiB, priced {cost / 2**20:.1f} MiB")
