"""What crosses the cut: side tensors that repeat cross once, and odd values are refused by name."""

from __future__ import annotations

import pytest
import torch

from compressors import CodecContext
from splitft.wire import protocol
from splitft.wire.coding import (SlotCodecs, Traffic, compact, distinct, flatten, from_wire, resolve_codecs,
                                 to_wire, unflatten)
from splitft.errors import ConfigError, ProtocolError


def _cross(tree, ctx=CodecContext("activation")):
    """Encode ``tree`` (stream first) on one end, through real frames, decode it on the other."""
    leaves, skeleton = flatten(tree)
    codecs = SlotCodecs(resolve_codecs("identity"), seed=0)
    traffic = Traffic()
    entries, _ = codecs.encode(leaves, 0, "fwd", ctx, [False] * len(leaves), traffic)
    message = protocol.decode(protocol.encode(protocol.Output(call=1, value=to_wire(skeleton, entries))))
    got, got_skeleton = from_wire(message.value)
    tensors, _ = SlotCodecs(resolve_codecs("identity"), seed=0).decode(got, 0, "fwd", ctx)
    return unflatten(got_skeleton, tensors), traffic


def test_a_broadcast_attention_mask_crosses_as_its_rows_and_comes_back_equal():
    padding = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    mask = padding[:, None, None, :].expand(2, 1, 4, 4).contiguous()  # (B, 1, L, L), as BERT builds it
    hidden = torch.randn(2, 4, 8)
    (got_hidden, got_mask), traffic = _cross((hidden, mask))
    assert torch.equal(got_hidden, hidden) and torch.equal(got_mask, mask)
    assert got_mask.is_contiguous() and got_mask.dtype == torch.bool
    assert traffic.raw == hidden.nbytes + mask.nbytes
    assert traffic.payload == hidden.nbytes + padding.nbytes


def test_compaction_is_bitwise_for_floats():
    x = torch.zeros(3, 4)
    x[1, 2] = -0.0  # equal to 0.0 by value, not by bits: must survive the trip
    assert compact(x) is None
    y = torch.full((3, 4), float("nan"))
    assert compact(y).shape == (1, 1)  # NaN payloads with the same bits do repeat
    (_, got), _ = _cross((torch.ones(1), x))
    assert torch.equal(got.view(torch.int32), x.view(torch.int32))


def test_a_vector_crosses_as_it_is():
    labels = torch.full((64,), 3)  # one value throughout, but a vector: compacting it would save its few bytes
    assert compact(labels) is not None
    (_, got), traffic = _cross((torch.randn(2, 4), labels))
    assert torch.equal(got, labels) and traffic.payload == traffic.raw


def test_gradients_and_the_stream_are_never_compacted():
    ones = torch.ones(4, 4)
    assert compact(ones) is not None
    (got, _), traffic = _cross((ones, ones.clone()), ctx=CodecContext("activation"))
    assert traffic.payload == ones.nbytes + 4  # the stream whole, the side tensor as one number
    _, traffic = _cross((ones, ones.clone()), ctx=CodecContext("gradient"))
    assert traffic.payload == 2 * ones.nbytes


@pytest.mark.parametrize("shape", [[3, 3], [2], [2, -1, 4], [1, 1, 1, 1, 1, 1, 1, 1, 1], "x", [2, 1 << 40]])
def test_hostile_expand_shapes_are_protocol_errors(shape):
    x = torch.ones(2, 1)
    codecs = SlotCodecs(resolve_codecs("identity"), seed=0)
    entries, _ = codecs.encode([x], None, None, CodecContext("gradient"), [False], Traffic())
    tree = {"$expand": [entries[0], shape]}
    with pytest.raises(ProtocolError):
        got, skeleton = from_wire(tree)
        unflatten(skeleton, [codecs.raw.decode(p, CodecContext()) for p, _ in got])


def test_a_tensor_in_several_places_of_a_call_crosses_once_and_is_one_object_on_arrival():
    h, mask = torch.randn(2, 3), torch.ones(4, 4)  # the mask crosses compacted, and is one object still
    leaves, skeleton = distinct(*flatten(([h, h, mask], {"context": h, "m": mask}, h)))
    assert len(leaves) == 2
    codecs = SlotCodecs(resolve_codecs("identity"), seed=0)
    entries, _ = codecs.encode(leaves, 0, "fwd", CodecContext("activation"), [True, False], Traffic())
    sent: set[int] = set()
    trees = [to_wire(part, entries, sent) for part in skeleton]
    assert trees[1]["context"] == {"$same": 0} and trees[2] == {"$same": 0}
    seen: dict = {}
    (args_entries, args_skel) = from_wire(trees[0], before=0)
    (kw_entries, kw_skel) = from_wire(trees[1], before=2)
    (_, target_skel) = from_wire(trees[2], before=2)
    tensors, _ = codecs.decode(args_entries, 0, "fwd", CodecContext("activation"))
    args = unflatten(args_skel, tensors, seen)
    kwargs = unflatten(kw_skel, [], seen, 2)
    target = unflatten(target_skel, [], seen, 2)
    assert args[0] is args[1] is kwargs["context"] is target and torch.equal(args[0], h)
    assert args[2] is kwargs["m"] and torch.equal(args[2], mask)


@pytest.mark.parametrize("tree, before", [({"$same": 0}, None), ({"$same": 0}, 0), ([{"$same": 1}], 1),
                                          ({"$same": True}, 1), ({"$same": -1}, 1), ({"$same": 0, "x": 1}, 1),
                                          ({"$same": "0"}, 1)])
def test_hostile_same_entries_are_protocol_errors(tree, before):
    """``$same`` names a tensor the call sent before this place, in a forward's trees only."""
    with pytest.raises(ProtocolError):
        from_wire(tree, before=before)


def test_a_value_that_cannot_cross_is_named():
    class Cache:
        pass

    with pytest.raises(ConfigError, match=r"kwargs\['past'\]\[1\] is a Cache, which cannot cross.*use_cache=False"):
        flatten({"past": [None, Cache()]}, where="kwargs")
