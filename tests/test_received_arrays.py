"""Received arrays become tensors that compute as the sender's would: floats in memory aligned as
torch aligns its own, copied there when a frame lies elsewhere; integers and booleans used where
they lie when their element is aligned (no order of sums can differ there), unless small: a small
frame may lie in a receive buffer shared with other frames, so they get memory of their own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compressors import CodecContext, Payload, host_tensor, make_codec
from compressors._device import ALIGNMENT, SHARED_BELOW

LARGE = 2 * SHARED_BELOW  # bytes: a frame ZeroMQ gives memory of its own


def _lying_at(offset: int, nbytes: int, *, writeable: bool = True) -> np.ndarray:
    """``nbytes`` of zeros starting ``offset`` bytes past an ALIGNMENT boundary, as a frame would."""
    raw = np.zeros(nbytes + 2 * ALIGNMENT, np.uint8)
    start = (-raw.ctypes.data) % ALIGNMENT + offset
    view = raw[start:start + nbytes]
    view.flags.writeable = writeable
    return view


def _shares(t: torch.Tensor, a: np.ndarray) -> bool:
    return bool(np.shares_memory(t.numpy(), a))


def test_a_float_frame_off_alignment_is_copied_into_aligned_memory():
    a = _lying_at(8, LARGE).view(np.float32)  # where ZeroMQ puts a large frame: 8 bytes past 16
    a[...] = np.arange(a.size)
    t = host_tensor(a)
    assert t.data_ptr() % ALIGNMENT == 0 and not _shares(t, a)
    assert torch.equal(t, torch.arange(a.size, dtype=torch.float32))


def test_an_aligned_writable_float_frame_is_used_as_it_is():
    a = _lying_at(0, LARGE).view(np.float32)
    assert _shares(host_tensor(a), a)


def test_a_read_only_frame_is_copied_even_aligned():
    a = _lying_at(0, LARGE, writeable=False).view(np.float32)
    t = host_tensor(a)
    assert not _shares(t, a)
    t.add_(1)  # safe to write to
    assert float(t.sum()) == a.size


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.bool_])
def test_integers_off_alignment_are_used_where_they_lie(dtype):
    a = _lying_at(8, LARGE).view(dtype)  # token ids or masks: their sums are exact in any order
    a[...] = 1
    t = host_tensor(a)
    assert _shares(t, a) and t.dtype == torch.from_numpy(np.empty(0, dtype)).dtype
    assert int(t.sum()) == a.size


def test_integers_off_their_own_element_are_copied_to_it():
    a = _lying_at(4, LARGE).view(np.int64)  # 4 bytes past 8: no int64 may be read there
    a[...] = np.arange(a.size)
    t = host_tensor(a)
    assert not _shares(t, a) and t.data_ptr() % 8 == 0
    assert torch.equal(t, torch.arange(a.size))


@pytest.mark.parametrize("dtype", [np.int64, np.bool_])
def test_small_integers_get_memory_of_their_own_even_aligned(dtype):
    a = _lying_at(0, 64 * 8).view(dtype)  # labels: a frame that may share ZeroMQ's receive buffer
    a[...] = 1
    t = host_tensor(a)
    assert not _shares(t, a) and bool((t == 1).all())


def test_a_single_float_is_copied_by_its_element_not_into_torchs_allocator():
    a = _lying_at(4, 4).view(np.float32).reshape(())  # a loss: one value, no order of sums
    a[...] = 2.5
    t = host_tensor(a)
    assert not _shares(t, a) and t.item() == 2.5 and t.data_ptr() % 4 == 0


def test_a_bfloat16_tensor_decodes_into_aligned_memory_though_its_bits_are_integers():
    x = torch.randn(LARGE // 2, dtype=torch.bfloat16)
    codec = make_codec("identity")
    sent = codec.encode(x, CodecContext())
    bits = _lying_at(8, x.numel() * 2).view(np.uint16)  # the uint16 array it travels as, off alignment
    bits[...] = sent.arrays["x"]
    got = codec.decode(Payload(sent.codec, sent.version, {"x": bits}, sent.meta), CodecContext())
    assert got.dtype == torch.bfloat16 and got.data_ptr() % ALIGNMENT == 0
    assert torch.equal(got.view(torch.int16), x.view(torch.int16))
