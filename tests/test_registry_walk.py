"""Every registered codec, over shapes x layouts x dtypes: what the contract promises.

Shape and dtype survive decode; ``payload.nbytes`` is the real size of what travels; the payload
survives a trip through bytes + msgpack header; the same seed gives the same bytes; a payload
of one codec is refused by every other; the gradient path keeps shapes.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import torch

import compressors
from compressors import CodecContext, CompressionError, Payload, WIRE_DTYPES, make_codec

# Non-default settings worth walking too (every registered name is walked with its defaults).
EXTRA_SPECS = [
    "fixpoint:bits=3",
    "fixpoint:bits=16,channel_dim=-1",
    "lowrank:rank=1,iters=1",
    "lowrank:rank=2,fp16=false",
    "c3sl:r=3",
    "c3sl:r=1",
    "binary:take_sign=true",
    "binary:flip_eps=2.0",
    "acsgd:bits=2,warmup=0",
    "acsgd:eval_bits=0",
    "quant:bits=1",
    "quant:bits=4,tile=3",
    "quant:bits=3,levels=uniform,stochastic=true",
    "quant:bits=2,stochastic=true,eval_bits=8",
    "hadamard>quant:bits=2",
    "outliers:k=2>hadamard:block=2>quant:bits=3,tile=4",
    "hadamard>delta>quant:bits=2",
    "delta:warmup=1>fp16",
    "hadamard>lowrank:rank=1",
    "outliers:k=4>hadamard>delta>quant:bits=1,first_bits=2,eval_bits=8",
]
SPECS = compressors.names() + EXTRA_SPECS

SHAPES = [(7,), (1, 5), (3, 7), (4, 6, 5), (1, 3, 4), (5, 3, 4, 4), (2, 3, 5, 7), (6, 8, 16), (0, 3, 4)]
DTYPES = [torch.float32, torch.float64, torch.float16]


def make_input(spec: str, shape: tuple[int, ...], dtype: torch.dtype, strided: bool, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)

    def values(sh: tuple[int, ...]) -> torch.Tensor:
        v = (torch.randn(sh, generator=g) * 3).to(dtype)
        if spec == "binary" or spec.startswith("binary:flip"):
            v = torch.where(v >= 0, 1.0, -1.0).to(dtype)
        return v

    if not strided:
        return values(shape)
    # the same shape as a non-contiguous view: transposed storage, or every other element
    x = values(tuple(reversed(shape))).permute(*reversed(range(len(shape))))
    if x.is_contiguous():
        x = values((*shape[:-1], 2 * shape[-1]))[..., ::2]
    assert x.shape == shape and (x.numel() <= 1 or not x.is_contiguous())
    return x


def ctx_for(spec: str, x: torch.Tensor, train: bool = True) -> CodecContext:
    ids = np.arange(x.shape[0], dtype=np.int64) if make_codec(spec).needs_sample_ids and x.dim() else None
    return CodecContext(train=train, sample_ids=ids)


def over_the_wire(p: Payload) -> Payload:
    """What the receiver rebuilds: read-only arrays from raw bytes, meta through msgpack."""
    header = msgpack.packb({"codec": p.codec, "version": p.version, "meta": p.meta,
                            "arrays": [[k, a.dtype.str, list(a.shape)] for k, a in p.arrays.items()]},
                           use_bin_type=True)
    h = msgpack.unpackb(header, raw=False)
    frames = [a.tobytes() for a in p.arrays.values()]
    arrays = {k: np.frombuffer(f, dtype=np.dtype(dt)).reshape(shape)
              for (k, dt, shape), f in zip(h["arrays"], frames)}
    return Payload(h["codec"], h["version"], arrays, h["meta"])


CASES = [
    pytest.param(spec, shape, dtype, strided, id=f"{spec}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}-{'T' if strided else 'C'}")
    for spec in SPECS for shape in SHAPES for dtype in DTYPES for strided in (False, True)
    if not (strided and shape[0] == 0)
]


@pytest.mark.parametrize("spec,shape,dtype,strided", CASES)
def test_roundtrip_contract(spec: str, shape: tuple[int, ...], dtype: torch.dtype, strided: bool) -> None:
    x = make_input(spec, shape, dtype, strided)
    x_before = x.clone()
    enc, dec = make_codec(spec, seed=7), make_codec(spec, seed=7)
    ctx = ctx_for(spec, x)
    torch_rng, numpy_rng = torch.random.get_rng_state(), np.random.get_state()[1].copy()
    p = enc.encode(x, ctx)
    assert torch.equal(x, x_before), "encode must not modify its input"

    # every array is a plain wire dtype and nbytes is what its bytes really are
    assert all(isinstance(a, np.ndarray) and a.dtype.name in WIRE_DTYPES for a in p.arrays.values())
    assert p.nbytes == sum(len(a.tobytes()) for a in p.arrays.values())

    wire = over_the_wire(p)
    y = dec.decode(wire, ctx)
    assert y.shape == x.shape and y.dtype == x.dtype
    if x.numel():
        assert torch.isfinite(y).all()

    # gradient path: receiver maps dL/dy onto the payload, sender maps it onto x
    grad = torch.randn(y.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    g_sent = dec.decode_adjoint(grad, wire, ctx)
    g_codec = make_codec(compressors.default_grad_spec(spec), seed=7)
    g_ctx = CodecContext(role="gradient")
    g_back = g_codec.decode(over_the_wire(g_codec.encode(g_sent, g_ctx)), g_ctx)
    assert g_back.shape == g_sent.shape and g_back.dtype == g_sent.dtype
    gx = enc.encode_adjoint(g_back, p, ctx)
    assert gx.shape == x.shape and gx.dtype == x.dtype
    # randomness only ever comes from a codec's own seeded generator
    assert torch.equal(torch_rng, torch.random.get_rng_state())
    assert np.array_equal(numpy_rng, np.random.get_state()[1])


def test_walk_covers_every_family() -> None:
    assert {"identity", "fp16", "fixpoint", "lowrank", "c3sl", "binary", "acsgd"} <= set(compressors.names())
    assert all(name in compressors.names() for s in EXTRA_SPECS for name, _ in compressors.parse_chain(s))


@pytest.mark.parametrize("spec", SPECS)
def test_same_seed_same_bytes(spec: str) -> None:
    a, b = make_codec(spec, seed=3), make_codec(spec, seed=3)
    for step in range(3):  # stateful codecs must also evolve identically
        xs = make_input(spec, (6, 8, 16), torch.float32, strided=False, seed=step)
        pa, pb = a.encode(xs, ctx_for(spec, xs)), b.encode(xs, ctx_for(spec, xs))
        assert pa.meta == pb.meta
        assert sorted(pa.arrays) == sorted(pb.arrays)
        for k in pa.arrays:
            assert pa.arrays[k].tobytes() == pb.arrays[k].tobytes(), k


@pytest.mark.parametrize("spec", SPECS)
def test_payload_of_another_codec_is_refused(spec: str) -> None:
    x = make_input(spec, (4, 6, 5), torch.float32, strided=False)
    p = make_codec(spec).encode(x, ctx_for(spec, x))
    for other in compressors.names():
        if other == p.codec:
            continue
        with pytest.raises(CompressionError):
            make_codec(other).decode(p, ctx_for(other, x))
    stale = Payload(p.codec, p.version + 1, p.arrays, p.meta)
    with pytest.raises(CompressionError):
        make_codec(spec).decode(stale, ctx_for(spec, x))


@pytest.mark.parametrize("name", compressors.names())
def test_settings_and_state(name: str) -> None:
    cls = compressors.codec_class(name)
    codec = make_codec(name)
    assert cls.__doc__ and cls.__doc__.strip(), "every codec says why it exists"
    make_codec(compressors.default_grad_spec(name))  # its gradient codec is registered
    with pytest.raises(CompressionError):
        make_codec(f"{name}:no_such_option=1")
    state = codec.state_dict()
    make_codec(name).load_state_dict(state)
    repr(codec)


@pytest.mark.parametrize("spec", SPECS)
def test_meta_is_plain_data(spec: str) -> None:
    x = make_input(spec, (5, 3, 4, 4), torch.float32, strided=False)
    p = make_codec(spec).encode(x, ctx_for(spec, x))

    def plain(v: object) -> bool:
        if isinstance(v, dict):
            return all(isinstance(k, str) and plain(w) for k, w in v.items())
        if isinstance(v, list):
            return all(plain(w) for w in v)
        return v is None or type(v) in (bool, int, float, str)

    assert plain(p.meta), p.meta


@pytest.mark.parametrize("spec", [s for s in SPECS if s != "identity"])  # identity carries any dtype
def test_integer_input_is_refused(spec: str) -> None:
    x = torch.ones(4, 3, dtype=torch.int64)
    with pytest.raises(CompressionError):
        make_codec(spec).encode(x, ctx_for(spec, x))
