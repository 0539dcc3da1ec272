"""The one walker of nested values that coding, checkpoints, the cut and its audit share."""

from __future__ import annotations

import pytest
import torch

from splitft.wire import tree


def test_flatten_then_unflatten_gives_the_tree_back_with_the_same_tensors():
    a, b, c = torch.ones(2), torch.zeros(3), torch.arange(4)
    value = ([a, None, 3], {"mask": b, "deep": ({"x": c, "s": "text"}, 1.5)}, True)
    leaves, skeleton = tree.flatten(value)
    assert [id(t) for t in leaves] == [id(a), id(b), id(c)]
    back = tree.unflatten(skeleton, leaves)
    assert back[0][0] is a and back[1]["mask"] is b and back[1]["deep"][0]["x"] is c
    assert back[0][1:] == [None, 3] and back[1]["deep"][0]["s"] == "text" and back[2] is True
    assert type(back[1]["deep"]) is tuple and type(back[0]) is list


def test_unflatten_can_transform_each_value_it_puts_back():
    leaves, skeleton = tree.flatten({"a": torch.ones(1), "b": [torch.ones(1)]})
    back = tree.unflatten(skeleton, leaves, lambda marker, value: value * (marker.index + 2))
    assert back["a"].item() == 2 and back["b"][0].item() == 3


def test_a_value_that_is_no_leaf_container_or_plain_value_is_named_by_its_path():
    seen = []

    def other(node, path):
        seen.append(tree.path_text(path))
        return "replaced"

    out = tree.rebuild({"args": [1, object()]}, lambda node, path: node, other=other)
    assert seen == ["['args'][1]"] and out == {"args": [1, "replaced"]}
    with pytest.raises(TypeError, match=r"\['k'\]\[0\]"):
        tree.flatten({"k": [object()]})


def test_pack_sees_every_container_after_its_children():
    order = []

    def pack(original, rebuilt, path):
        order.append(tree.path_text(path))
        return {"$tuple": list(rebuilt)} if isinstance(rebuilt, tuple) else rebuilt

    out = tree.rebuild({"t": (1, (2,))}, lambda node, path: node, pack=pack)
    assert out == {"t": {"$tuple": [1, {"$tuple": [2]}]}}
    assert order == ["['t'][1]", "['t']", ""]


def test_leaves_stops_at_the_depth_asked_for_and_skips_other_values():
    a, b = torch.ones(1), torch.ones(2)
    held = [a, {"k": [[b]]}, object()]
    assert [t is a for t in tree.leaves(held, max_depth=2)] == [True]
    assert [id(t) for t in tree.leaves(held)] == [id(a), id(b)]
