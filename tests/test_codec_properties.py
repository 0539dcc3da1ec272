"""Property tests: hostile payloads and random inputs never escape the codec error type.

A payload may come from an untrusted peer. Whatever is done to its header or arrays, decoding
either works or raises CompressionError; it never raises IndexError, RuntimeError, or
allocates without bound.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import compressors
from compressors import CodecContext, CompressionError, Payload, make_codec
from tests.test_registry_walk import ctx_for, make_input

#: Every codec, and chains whose payloads nest the next codec's (arrays under ">" names, meta["inner"]).
SPECS = compressors.names() + ["outliers:k=2>hadamard>delta>quant:bits=2", "hadamard>quant:bits=3,tile=4"]

meta_values = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 1 << 45), st.floats(allow_nan=True),
    st.text(max_size=8), st.lists(st.integers(-2, 40), max_size=5),
    st.sampled_from(["float32", "int64", "float16", "bogus", "train", "eval", "raw", "lowrank"]),
)


def _mutate(p: Payload, data: st.DataObject) -> Payload:
    meta = dict(p.meta)
    arrays = dict(p.arrays)
    kind = data.draw(st.sampled_from(["meta", "drop_meta", "truncate", "retype", "drop_array", "garbage"]))
    if kind == "meta" and meta:
        meta[data.draw(st.sampled_from(sorted(meta)))] = data.draw(meta_values)
    elif kind == "drop_meta" and meta:
        del meta[data.draw(st.sampled_from(sorted(meta)))]
    elif kind in ("truncate", "retype", "drop_array", "garbage") and arrays:
        key = data.draw(st.sampled_from(sorted(arrays)))
        a = arrays[key]
        if kind == "truncate":
            arrays[key] = a.reshape(-1)[: data.draw(st.integers(0, max(a.size - 1, 0)))]
        elif kind == "retype":
            arrays[key] = np.zeros(a.shape, dtype=data.draw(st.sampled_from(["float32", "int64", "uint8", "float64"])))
        elif kind == "drop_array":
            del arrays[key]
        else:
            raw = data.draw(st.binary(min_size=a.nbytes, max_size=a.nbytes))
            arrays[key] = np.frombuffer(raw, dtype=a.dtype).reshape(a.shape)
    return Payload(p.codec, p.version, arrays, meta)


@pytest.mark.parametrize("spec", SPECS)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_mutated_payloads_raise_only_compression_errors(spec: str, data: st.DataObject) -> None:
    x = make_input(spec, (5, 3, 4, 4), torch.float32, strided=False)
    enc, dec = make_codec(spec, seed=1), make_codec(spec, seed=1)
    ctx = ctx_for(spec, x)
    bad = _mutate(enc.encode(x, ctx), data)
    try:
        y = dec.decode(bad, CodecContext(train=True))
    except CompressionError:
        return
    assert isinstance(y, torch.Tensor)


@pytest.mark.parametrize("spec", ["fixpoint:bits=5", "lowrank:rank=2", "c3sl:r=3", "acsgd:warmup=0"])
@settings(max_examples=25, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=4).map(tuple),
       scale=st.floats(1e-3, 1e3), seed=st.integers(0, 1000))
def test_random_shapes_roundtrip(spec: str, shape: tuple[int, ...], scale: float, seed: int) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale
    enc, dec = make_codec(spec), make_codec(spec)
    ctx = ctx_for(spec, x)
    y = dec.decode(enc.encode(x, ctx), ctx)
    assert y.shape == x.shape and torch.isfinite(y).all()
