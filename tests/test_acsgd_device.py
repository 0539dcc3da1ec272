"""AC-SGD coded on the tensor's own device: the same payloads, buffers and errors as on the host.

The device path (buffers as torch tensors, rows gathered, updated and checksummed where the
activations live) runs on the CPU under ``portable_kernels()`` and, where there is one, on a CUDA
GPU (``pytest -m cuda``). Every payload it makes must be byte-identical to the host path's, or
the two ends of a link (a CPU edge, a GPU cloud) would drift apart.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from compressors import CodecContext, CompressionError, DesyncError, Payload, make_codec
from compressors._device import portable_kernels
from compressors._rows import CHUNK_WORDS, hash_weights, row_checksums_tensor, row_words_of, weight_halves
from compressors.delta import ACSGD, row_checksums
from tests.test_codec_policy import assert_decode_peak_priced

CUDA = pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])
DEVICES = ["portable", CUDA]


class Where:
    """Where one pair of ends codes: ``host`` (numpy), ``portable`` (the torch kernels on the
    CPU) or ``cuda`` (activations on the GPU, decoded onto it)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind

    @contextlib.contextmanager
    def _kernels(self) -> Iterator[None]:
        with portable_kernels(self.kind == "portable"):
            yield

    def encode(self, codec: ACSGD, x: torch.Tensor, ctx: CodecContext) -> Payload:
        with self._kernels():
            return codec.encode(x.cuda() if self.kind == "cuda" else x, ctx)

    def decode(self, codec: ACSGD, p: Payload, ctx: CodecContext) -> torch.Tensor:
        with self._kernels():
            y = codec.decode(p, dataclasses.replace(ctx, device="cuda" if self.kind == "cuda" else None))
        assert y.device.type == ("cuda" if self.kind == "cuda" else "cpu")
        return y.cpu()

    def buffer_device(self) -> str | None:
        """The device type the buffer must be a tensor on (None: a numpy array)."""
        return {"host": None, "portable": "cpu", "cuda": "cuda"}[self.kind]


class Ends:
    """An edge (sender) and a cloud (receiver) codec coding at one place."""

    def __init__(self, spec: str, where: str) -> None:
        self.where = Where(where)
        self.edge: ACSGD = make_codec(spec)  # type: ignore[assignment]
        self.cloud: ACSGD = make_codec(spec)  # type: ignore[assignment]

    def step(self, x: torch.Tensor, ctx: CodecContext) -> tuple[Payload, torch.Tensor]:
        p = self.where.encode(self.edge, x, ctx)
        return p, self.where.decode(self.cloud, p, ctx)


@dataclasses.dataclass
class Step:
    """One batch: what every pair is given, and the ids its sender is asked to resync first."""

    x: torch.Tensor
    ctx: CodecContext
    resync_ids: tuple[int, ...] = ()


def schedule(shape: tuple[int, ...], dtype: torch.dtype, count: int = 10, seed: int = 0) -> list[Step]:
    """Slowly drifting activations of a growing pool of sample ids, with a full resync, a
    partial one (one id not in the batch) and evaluation batches along the way."""
    b, per = shape[0], shape[1:]
    g = torch.Generator().manual_seed(seed)
    base, drift = torch.randn(64, *per, generator=g) * 3, torch.randn(64, *per, generator=g)
    rng = np.random.default_rng(seed)
    steps = []
    for t in range(count):
        pool = 8 if t < 3 else 20 if t < 6 else 64  # ids beyond the buffer grow it
        ids = rng.permutation(pool)[:b].astype(np.int64)
        x = (base[ids] + 0.05 * t * drift[ids]).to(dtype)
        if t in (4, 8):
            steps.append(Step(x, CodecContext(train=False)))
        resync = (int(ids[0]), int(ids[-1]), 63) if t == 7 else ()
        steps.append(Step(x, CodecContext(train=True, sample_ids=ids, resync=t == 5), resync))
    return steps


def assert_same_payload(want: Payload, got: Payload) -> None:
    assert (got.codec, got.version, got.meta) == (want.codec, want.version, want.meta)
    assert sorted(got.arrays) == sorted(want.arrays)
    for key, a in want.arrays.items():
        b = got.arrays[key]
        assert (b.dtype, b.shape) == (a.dtype, a.shape), key
        assert b.tobytes() == a.tobytes(), f"array {key!r} differs"


def assert_same_state(a: ACSGD, b: ACSGD) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sorted(sa) == sorted(sb)
    for key in sa:
        assert sa[key].device.type == sb[key].device.type == "cpu"  # checkpoints are host tensors
        assert sa[key].dtype == sb[key].dtype and sa[key].numpy().tobytes() == sb[key].numpy().tobytes(), key


def run(pairs: list[Ends], steps: list[Step]) -> None:
    """Drive every pair through ``steps``; each must send and decode what the first does."""
    for s in steps:
        results = []
        for ends in pairs:
            if s.resync_ids:
                ends.edge.request_resync(s.resync_ids)
            results.append(ends.step(s.x, s.ctx))
        (want_p, want_y), *others = results
        assert want_y.dtype == s.x.dtype and want_y.shape == s.x.shape
        for p, y in others:
            assert_same_payload(want_p, p)
            assert torch.equal(y, want_y)
    for ends in pairs[1:]:
        assert_same_state(pairs[0].edge, ends.edge)
        assert_same_state(pairs[0].cloud, ends.cloud)
        assert ends.edge.pending_resync == pairs[0].edge.pending_resync


CASES = [("acsgd", (6, 4, 3, 3), torch.float32),
         ("acsgd:bits=3,warmup=2", (5, 5, 3), torch.float32),  # odd D, the general bit packing
         ("acsgd:bits=2,warmup=0,channel_dim=-1,eval_bits=0", (4, 7), torch.bfloat16),
         ("acsgd:bits=8,eval_bits=5", (3, 2, 9), torch.float16)]


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("spec,shape,dtype", CASES)
def test_device_path_sends_and_decodes_the_host_paths_bytes(spec: str, shape: tuple[int, ...],
                                                           dtype: torch.dtype, where: str) -> None:
    host, dev = Ends(spec, "host"), Ends(spec, where)
    run([host, dev], schedule(shape, dtype))
    assert dev.edge.pending_resync == [63]  # asked for, never in a batch since
    for codec in (dev.edge, dev.cloud):
        assert isinstance(codec._buf, torch.Tensor) and codec._buf.device.type == dev.where.buffer_device()
        assert codec.held_nbytes() >= codec._buf.numel() * 2
    assert isinstance(host.edge._buf, np.ndarray)


@pytest.mark.parametrize("where", DEVICES)
@pytest.mark.parametrize("d", [0, 1, 2, 3, 7, 64, 1001])
def test_device_row_checksums_equal_the_numpy_definition(d: int, where: str) -> None:
    device = torch.device("cuda" if where == "cuda" else "cpu")
    rng = np.random.default_rng(d)
    rows = rng.integers(0, 1 << 16, size=(9, d), dtype=np.uint16)
    rows[0] = 0xFFFF  # the largest halves: the partial sums at their largest
    rows[1] = 0
    rows[2, ::2] = 0x8000  # sign bits only (negative as int16)
    halves = weight_halves(hash_weights(row_words_of(d)), device)
    want = row_checksums(rows.view(np.float16))
    got = row_checksums_tensor(torch.from_numpy(rows.view(np.float16)).to(device), halves)
    assert got.dtype == np.uint64 and np.array_equal(got, want)
    # sums that wrap modulo 2^64 (long rows of the largest words), over several chunks of rows
    long_rows = np.full((2 * CHUNK_WORDS // (1 << 15) + 3, 1 << 16), 0xFFFF, dtype=np.uint16)
    long_rows[1::2] = rng.integers(0, 1 << 16, size=long_rows[1::2].shape, dtype=np.uint16)
    halves = weight_halves(hash_weights(row_words_of(1 << 16)), device)
    got = row_checksums_tensor(torch.from_numpy(long_rows.view(np.float16)).to(device), halves)
    assert np.array_equal(got, row_checksums(long_rows.view(np.float16)))


def test_device_row_checksums_refuse_mismatched_weights() -> None:
    rows = torch.zeros(2, 5, dtype=torch.float16)
    with pytest.raises(CompressionError, match="weight halves"):
        row_checksums_tensor(rows, weight_halves(hash_weights(4), torch.device("cpu")))


@pytest.mark.parametrize("where", DEVICES)
def test_desync_on_the_device_path_raises_and_touches_nothing(where: str) -> None:
    ends = Ends("acsgd", where)
    ids = np.arange(6, dtype=np.int64)
    steps = schedule((6, 4, 3), torch.float32, count=4)
    xs = [s.x for s in steps if s.ctx.train]
    ctx = CodecContext(train=True, sample_ids=ids)
    ends.step(xs[0], ctx)
    ends.where.encode(ends.edge, xs[1], ctx)  # lost on the way
    before = ends.cloud.state_dict()
    with pytest.raises(DesyncError) as err:
        ends.where.decode(ends.cloud, ends.where.encode(ends.edge, xs[2], ctx), ctx)
    assert err.value.reason == "steps" and sorted(err.value.ids) == ids.tolist()
    after = ends.cloud.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # diverged buffers at equal step counts: the device checksum catches the one row
    ends.step(xs[2], CodecContext(train=True, sample_ids=ids, resync=True))
    state = ends.cloud.state_dict()
    state["buffer"][4, 7] += 0.25
    ends.cloud.load_state_dict(state)
    before = ends.cloud.state_dict()
    with pytest.raises(DesyncError) as err:
        ends.step(xs[3], ctx)
    assert err.value.reason == "checksum" and err.value.ids == [4]
    after = ends.cloud.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def _moved(spec: str, source: Ends, where: str, warm: bool, warm_steps: list[Step]) -> Ends:
    """A pair at ``where`` resumed from ``source``'s checkpoints; ``warm``: it had run itself
    first, so the checkpoint lands in a buffer of the same shape it already holds."""
    moved = Ends(spec, where)
    for s in warm_steps if warm else ():
        moved.step(s.x, s.ctx)
    moved.edge.load_state_dict(source.edge.state_dict())
    moved.cloud.load_state_dict(source.cloud.state_dict())
    return moved


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("where", DEVICES)
def test_a_checkpoint_moves_between_host_and_device_paths(where: str, warm: bool) -> None:
    spec, steps = "acsgd:bits=3", schedule((5, 4, 3), torch.float32, count=12, seed=3)
    head, tail = steps[:7], steps[7:]
    for start, resume in (("host", where), (where, "host")):
        first = Ends(spec, start)
        for s in head:
            if s.resync_ids:
                first.edge.request_resync(s.resync_ids)
            first.step(s.x, s.ctx)
        moved = _moved(spec, first, resume, warm, head)
        run([first, moved], tail)
        # a checkpoint loads onto the host; the buffer moves to where the codec runs next
        assert isinstance(moved.cloud._buf, np.ndarray if resume == "host" else torch.Tensor)


def test_path_is_refused_where_the_codec_codes_on_a_device(tmp_path) -> None:
    codec = make_codec(f"acsgd:capacity=16,path={tmp_path / 'cloud.npy'}")
    sender = make_codec("acsgd:capacity=16")
    ids = np.arange(4, dtype=np.int64)
    p = sender.encode(torch.randn(4, 6), CodecContext(train=True, sample_ids=ids))
    on_meta = CodecContext(train=True, sample_ids=ids, device="meta")  # any device but the CPU
    for call in (codec.decode, codec.decode_cost):
        with pytest.raises(CompressionError, match="path"):
            call(p, on_meta)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_path_is_refused_on_cuda(tmp_path) -> None:
    codec = make_codec(f"acsgd:capacity=16,path={tmp_path / 'edge.npy'}")
    with pytest.raises(CompressionError, match="path"):
        codec.encode(torch.randn(4, 6, device="cuda"), CodecContext(train=True, sample_ids=np.arange(4)))


def test_a_memory_mapped_buffer_works_under_the_portable_kernels(tmp_path) -> None:
    spec = "acsgd:capacity=64,path={}"
    host = Ends("acsgd:capacity=64", "host")
    mapped = Ends(spec.format(tmp_path / "edge.npy"), "portable")
    mapped.cloud = make_codec(spec.format(tmp_path / "cloud.npy"))  # type: ignore[assignment]
    run([host, mapped], schedule((4, 5, 3), torch.float32))
    assert isinstance(mapped.edge._buf, np.memmap)
    saved = np.load(tmp_path / "cloud.npy", mmap_mode="r")
    assert saved.tobytes() == host.cloud.state_dict()["buffer"].numpy().tobytes()


@pytest.mark.parametrize("spec", ["acsgd", "acsgd:warmup=0", "acsgd:bits=3,warmup=0", "acsgd:eval_bits=4"])
def test_decode_cost_bounds_the_measured_peak_on_the_device_path(spec: str) -> None:
    """As ``test_codec_policy`` measures the host path: the device path's kernels (unpacking,
    the checksum's halves) on the CPU must stay within the price, too."""
    assert_decode_peak_priced(spec, torch.float32, portable=True)


def test_only_the_payload_crosses_to_the_host(monkeypatch) -> None:
    """Every device-to-host copy of the device path is counted (on the CPU, each ``.numpy()``
    of a tensor): an encode copies its payload, the per-channel maxima its scales come from and
    three partial sums per row for the checksums; a decode only the partial sums."""
    edge, cloud = make_codec("acsgd"), make_codec("acsgd")
    b, shape = 16, (16, 8, 24)
    ids = np.arange(b, dtype=np.int64)
    ctx = CodecContext(train=True, sample_ids=ids)
    gen = torch.Generator().manual_seed(0)
    copied: list[int] = []
    original = torch.Tensor.numpy

    def counting(self: torch.Tensor, *args, **kwargs) -> np.ndarray:
        copied.append(self.numel() * self.element_size())
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", counting)
    with portable_kernels():
        for step in range(3):  # the warm-up (rows in full), then deltas
            x = torch.randn(shape, generator=gen)
            copied.clear()
            p = edge.encode(x, ctx)
            assert sum(copied) <= p.nbytes + 4 * shape[1] + 16 * b
            if step:
                assert p.nbytes < x.numel()  # the deltas: far less than the activation crossed
            copied.clear()
            cloud.decode(p, ctx)
            assert sum(copied) <= 24 * b
