"""AC-SGD: two ends whose buffers stay bit-identical, and a desync that is caught and repaired."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressors import CodecContext, CompressionError, DesyncError, make_codec
from compressors.delta import ACSGD

N, B, SHAPE = 48, 8, (4, 3, 3)  # 48 samples, batches of 8, per-sample activation 4 x 3 x 3


def pair(spec: str = "acsgd") -> tuple[ACSGD, ACSGD]:
    """The edge (sender) and cloud (receiver) instances: each end owns one."""
    return make_codec(spec), make_codec(spec)  # type: ignore[return-value]


class Data:
    """Per-sample activations that drift slowly, as they do while a model trains."""

    def __init__(self, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.base = torch.randn(N, *SHAPE, generator=g) * torch.tensor([1.0, 5.0, 0.2, 2.0]).reshape(1, 4, 1, 1)
        self.drift = torch.randn(N, *SHAPE, generator=g)
        self.order = np.random.default_rng(seed)

    def at(self, ids: np.ndarray, t: int) -> torch.Tensor:
        idx = torch.from_numpy(ids)
        return self.base[idx] + 0.02 * t * self.drift[idx]

    def epoch(self) -> list[np.ndarray]:
        return np.split(self.order.permutation(N).astype(np.int64), N // B)


def train_ctx(ids: np.ndarray, resync: bool = False) -> CodecContext:
    return CodecContext(train=True, sample_ids=ids, resync=resync)


def assert_in_sync(a: ACSGD, b: ACSGD) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["buffer"].numpy().tobytes() == sb["buffer"].numpy().tobytes()
    assert torch.equal(sa["steps"], sb["steps"])


def deliver(edge: ACSGD, cloud: ACSGD, x: torch.Tensor, ids: np.ndarray, desyncs: list[DesyncError]) -> torch.Tensor:
    """What a runtime does: on DesyncError, resend the same batch with resync=True."""
    try:
        return cloud.decode(edge.encode(x, train_ctx(ids)), train_ctx(ids))
    except DesyncError as err:
        desyncs.append(err)
        return cloud.decode(edge.encode(x, train_ctx(ids, resync=True)), train_ctx(ids))


def test_buffers_stay_bit_identical_through_training() -> None:
    edge, cloud = pair()
    data, t = Data(), 0
    plain = make_codec("fixpoint:bits=4")
    for epoch in range(5):
        for ids in data.epoch():
            t += 1
            x = data.at(ids, t)
            p = edge.encode(x, train_ctx(ids))
            y = cloud.decode(p, train_ctx(ids))
            assert y.shape == x.shape and y.dtype == x.dtype
            if epoch == 0:
                assert np.unpackbits(p.arrays["full"]).sum() == B  # warm-up: all in full
                assert torch.equal(y, x)
            else:
                assert p.arrays["x"].shape[0] == 0  # all deltas
                # the receiver returns m[id], exactly the sender's copy of it
                sent = edge.state_dict()["buffer"][torch.from_numpy(ids)].float()
                assert torch.equal(y, sent.reshape(x.shape))
            if epoch == 4:
                # deltas of a slowly moving activation are far finer than quantizing it afresh
                fresh = plain.decode(plain.encode(x, CodecContext()), CodecContext())
                assert (y - x).norm() < 0.2 * (fresh - x).norm()
    assert_in_sync(edge, cloud)
    assert edge.state_dict()["steps"][:N].tolist() == [5] * N  # (grown buffers may hold spare rows)


def test_buffers_holding_negative_zeros_stay_bit_identical() -> None:
    """A hidden state's small negatives are -0 in the fp16 buffers; a delta that rounds to a code
    of 0 must add +0 on both ends (the sender's rounded -0 once kept -0 where the receiver's
    integer code made +0, so the checksums differed on the next step: MiniLM's states did it)."""
    edge, cloud = pair()
    ids = np.arange(B, dtype=np.int64)
    x = torch.randn(B, *SHAPE, generator=torch.Generator().manual_seed(1))
    for t in range(3):
        moved = x + 0.1 * t
        moved[:, :, 0, 0] = -1e-9  # -0 in fp16: the first step stores it, the next ones' deltas round to 0
        y = cloud.decode(edge.encode(moved, train_ctx(ids)), train_ctx(ids))
        assert y.shape == x.shape
        if t == 0:
            assert torch.signbit(cloud.state_dict()["buffer"][:B].reshape(B, *SHAPE)[:, :, 0, 0]).all()
        assert_in_sync(edge, cloud)


def test_evaluation_does_not_touch_the_buffers() -> None:
    edge, cloud = pair()
    data = Data()
    for ids in data.epoch():
        cloud.decode(edge.encode(data.at(ids, 0), train_ctx(ids)), train_ctx(ids))
    before = [c.state_dict() for c in (edge, cloud)]
    ids = np.arange(B, dtype=np.int64)
    x = data.at(ids, 50)
    ev = CodecContext(train=False)  # no sample ids needed
    p = edge.encode(x, ev)
    assert p.meta["mode"] == "eval" and "ids" not in p.arrays
    y = cloud.decode(p, ev)
    assert (y - x).abs().max() <= x.abs().max() / 2**7 * 1.001  # the plain 8-bit quantizer
    for c, old in zip((edge, cloud), before):
        new = c.state_dict()
        assert all(torch.equal(old[k], new[k]) for k in old)
    raw_edge, raw_cloud = pair("acsgd:eval_bits=0")
    assert torch.equal(raw_cloud.decode(raw_edge.encode(x, ev), ev), x)


def test_a_dropped_message_is_detected_and_repaired() -> None:
    edge, cloud = pair()
    data, t, desyncs = Data(1), 0, []
    dropped: set[int] = set()
    for epoch in range(4):
        for k, ids in enumerate(data.epoch()):
            t += 1
            x = data.at(ids, t)
            if epoch == 1 and k == 2:
                edge.encode(x, train_ctx(ids))  # encoded, then lost on the way
                dropped = set(ids.tolist())
                continue
            y = deliver(edge, cloud, x, ids, desyncs)
            assert y.shape == x.shape
    # every dropped sample was caught the next time it came, and nothing else was
    assert desyncs and all(e.reason == "steps" for e in desyncs)
    assert set().union(*(set(e.ids) for e in desyncs)) == dropped
    assert_in_sync(edge, cloud)


def test_a_failed_decode_leaves_the_receiver_untouched() -> None:
    edge, cloud = pair("acsgd:warmup=0")
    ids = np.arange(B, dtype=np.int64)
    data = Data()
    cloud.decode(edge.encode(data.at(ids, 0), train_ctx(ids)), train_ctx(ids))
    edge.encode(data.at(ids, 1), train_ctx(ids))  # lost
    p = edge.encode(data.at(ids, 2), train_ctx(ids))
    before = cloud.state_dict()
    with pytest.raises(DesyncError) as err:
        cloud.decode(p, train_ctx(ids))
    assert sorted(err.value.ids) == ids.tolist() and "step 1 here, 2 at the sender" in str(err.value)
    after = cloud.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_reordered_and_repeated_messages_are_detected() -> None:
    edge, cloud = pair()
    ids = np.arange(B, dtype=np.int64)
    data = Data()
    cloud.decode(edge.encode(data.at(ids, 0), train_ctx(ids)), train_ctx(ids))  # warm-up
    first = edge.encode(data.at(ids, 1), train_ctx(ids))
    second = edge.encode(data.at(ids, 2), train_ctx(ids))
    with pytest.raises(DesyncError):
        cloud.decode(second, train_ctx(ids))  # overtook the first
    cloud.decode(first, train_ctx(ids))  # in order, this one is fine
    with pytest.raises(DesyncError):
        cloud.decode(first, train_ctx(ids))  # a duplicate
    # repair: the receiver's error names the ids, the sender resends them in full
    third = data.at(ids, 3)
    with pytest.raises(DesyncError) as err:
        cloud.decode(edge.encode(third, train_ctx(ids)), train_ctx(ids))
    edge.request_resync(err.value.ids)
    assert edge.pending_resync == ids.tolist()
    y = cloud.decode(edge.encode(third, train_ctx(ids)), train_ctx(ids))
    assert torch.equal(y, third) and edge.pending_resync == []
    assert_in_sync(edge, cloud)
    # and deltas flow again
    p = edge.encode(data.at(ids, 4), train_ctx(ids))
    assert p.arrays["x"].shape[0] == 0
    cloud.decode(p, train_ctx(ids))
    assert_in_sync(edge, cloud)


def test_diverged_buffers_with_equal_steps_fail_the_checksum() -> None:
    edge, cloud = pair()
    ids = np.arange(B, dtype=np.int64)
    data = Data()
    cloud.decode(edge.encode(data.at(ids, 0), train_ctx(ids)), train_ctx(ids))
    state = cloud.state_dict()
    state["buffer"][3, 5] += 0.5  # e.g. a checkpoint from somewhere else
    cloud.load_state_dict(state)
    with pytest.raises(DesyncError) as err:
        cloud.decode(edge.encode(data.at(ids, 1), train_ctx(ids)), train_ctx(ids))
    assert err.value.reason == "checksum" and err.value.ids == [3]


def test_resync_of_some_samples_sends_a_mixed_batch() -> None:
    edge, cloud = pair()
    ids = np.arange(B, dtype=np.int64)
    data = Data()
    cloud.decode(edge.encode(data.at(ids, 0), train_ctx(ids)), train_ctx(ids))
    edge.request_resync([2, 5, 99])  # 99 is not in this batch: it stays pending
    x = data.at(ids, 1)
    p = edge.encode(x, train_ctx(ids))
    full = np.unpackbits(p.arrays["full"], count=B, bitorder="little").astype(bool)
    assert full.tolist() == [i in (2, 5) for i in range(B)] and p.arrays["x"].shape == (2, *SHAPE)
    y = cloud.decode(p, train_ctx(ids))
    assert torch.equal(y[[2, 5]], x[[2, 5]]) and not torch.equal(y, x)
    assert edge.pending_resync == [99]
    assert_in_sync(edge, cloud)


def test_sample_ids_are_required_and_checked() -> None:
    codec = make_codec("acsgd")
    x = torch.randn(3, 4)
    with pytest.raises(CompressionError, match="sample_ids"):
        codec.encode(x, CodecContext(train=True))
    for bad in (np.arange(2), np.array([0.0, 1.0, 2.0]), np.array([0, 1, 1]), np.array([0, -1, 2]),
                np.arange(6).reshape(3, 2)):
        with pytest.raises(CompressionError):
            codec.encode(x, CodecContext(train=True, sample_ids=bad))
    # torch ids and other integer dtypes are fine
    codec.encode(x, CodecContext(train=True, sample_ids=torch.tensor([4, 1, 0])))  # type: ignore[arg-type]
    codec.encode(x, CodecContext(train=True, sample_ids=np.array([7, 8, 9], dtype=np.int32)))
    with pytest.raises(CompressionError, match="non-finite"):
        codec.encode(torch.tensor([[float("nan"), 0, 0, 0]]), CodecContext(train=True, sample_ids=np.array([10])))
    with pytest.raises(CompressionError, match="fp16"):
        codec.encode(torch.tensor([[1e6, 0, 0, 0]]), CodecContext(train=True, sample_ids=np.array([11])))
    assert codec.state_dict()["steps"][10:12].tolist() == [0, 0]  # refused sends change nothing


def test_buffers_grow_or_respect_capacity() -> None:
    edge, cloud = pair()
    for top in (3, 40, 1000):
        ids = np.array([0, top], dtype=np.int64)
        cloud.decode(edge.encode(torch.randn(2, 5), train_ctx(ids)), train_ctx(ids))
    assert edge.state_dict()["buffer"].shape[0] >= 1001
    assert_in_sync(edge, cloud)
    fixed = make_codec("acsgd:capacity=10")
    with pytest.raises(CompressionError, match="capacity=10"):
        fixed.encode(torch.randn(1, 5), train_ctx(np.array([10])))
    with pytest.raises(CompressionError, match="same shape"):
        edge.encode(torch.randn(2, 6), train_ctx(np.array([1, 2])))


def test_state_dict_resumes_both_ends_in_sync() -> None:
    edge, cloud = pair()
    data = Data()
    for t, ids in enumerate(data.epoch() + data.epoch()):
        cloud.decode(edge.encode(data.at(ids, t), train_ctx(ids)), train_ctx(ids))
    edge2, cloud2 = pair()
    edge2.load_state_dict(edge.state_dict())
    cloud2.load_state_dict(cloud.state_dict())
    for t, ids in enumerate(data.epoch(), start=20):
        x = data.at(ids, t)
        y = cloud2.decode(edge2.encode(x, train_ctx(ids)), train_ctx(ids))
        assert torch.equal(y, cloud.decode(edge.encode(x, train_ctx(ids)), train_ctx(ids)))
    assert_in_sync(edge2, cloud2)
    with pytest.raises(CompressionError):
        cloud2.load_state_dict({"buffer": torch.zeros(3, 3)})


def test_memory_mapped_buffers(tmp_path) -> None:  # type: ignore[no-untyped-def]
    edge = make_codec(f"acsgd:capacity={N},path={tmp_path / 'edge.npy'}")
    cloud = make_codec(f"acsgd:capacity={N},path={tmp_path / 'cloud.npy'}")
    data = Data()
    for t, ids in enumerate(data.epoch() + data.epoch()):
        cloud.decode(edge.encode(data.at(ids, t), train_ctx(ids)), train_ctx(ids))
    assert_in_sync(edge, cloud)  # type: ignore[arg-type]
    on_disk = np.load(tmp_path / "cloud.npy", mmap_mode="r")
    assert on_disk.shape == (N, 36) and on_disk.dtype == np.float16
    assert np.array_equal(on_disk, cloud.state_dict()["buffer"].numpy())
    cloud.load_state_dict(cloud.state_dict())  # its buffer is a view of the map being loaded into
    assert_in_sync(edge, cloud)  # type: ignore[arg-type]
    with pytest.raises(CompressionError, match="capacity"):
        make_codec(f"acsgd:path={tmp_path / 'x.npy'}")


@pytest.mark.parametrize("bad", ["acsgd:bits=1", "acsgd:bits=17", "acsgd:warmup=-1", "acsgd:eval_bits=1",
                                 "acsgd:capacity=-5", "acsgd:capacity=2.5", "acsgd:path=1"])
def test_settings_validated(bad: str) -> None:
    with pytest.raises(CompressionError):
        make_codec(bad)


def test_ratio_at_the_digits_cut() -> None:
    edge, cloud = pair()  # 4 bits, one warm-up send
    ids = np.arange(64, dtype=np.int64)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 32, 8, 8, generator=g)
    cloud.decode(edge.encode(x, train_ctx(ids)), train_ctx(ids))
    p = edge.encode(x + 0.1 * torch.randn(64, 32, 8, 8, generator=g), train_ctx(ids))
    assert p.arrays["scale"].shape == (32,) and p.arrays["scale"].dtype == np.float16
    assert p.arrays["q"].nbytes == 64 * 2048 * 4 // 8
    ratio = x.numel() * 4 / p.nbytes
    assert ratio >= 7.5, ratio


def test_a_hostile_sample_id_cannot_grow_buffers_without_bound() -> None:
    edge, cloud = pair()
    ids = np.array([0, 1], dtype=np.int64)
    p = edge.encode(torch.randn(2, 2048), train_ctx(ids))
    p.arrays["ids"] = np.array([0, 1 << 40], dtype=np.int64)
    with pytest.raises(CompressionError, match="capacity"):
        cloud.decode(p, train_ctx(p.arrays["ids"]))
