"""Nested values: the one walker for the tuples, lists and dicts of leaves that splitft takes apart.

What crosses the cut (a call's arguments, what the cloud part returned), what goes into a
checkpoint (an optimizer's state, codec state) and where the cut audit looks for tensors (the
attributes of a module) are all small trees. The callers say what a leaf is and what it becomes;
this module walks, keeps the path to each node for error messages, and rebuilds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

KeyPath = tuple[Any, ...]  # the keys and indices from the root to a node
PLAIN = (type(None), bool, int, float, str)  # kept as they are by every walk


@dataclass(frozen=True, repr=False)
class Leaf:
    """Where a skeleton had a leaf: its index in the flat list of leaves."""

    index: int
    expand: tuple[int, ...] | None = None  # it crossed compacted: repeat it back to this shape (coding)

    def __repr__(self) -> str:
        # The dataclass's text, without its guard against recursion (a leaf holds no leaf): the
        # cloud writes the skeletons of every forward it prices, and the guard's calls cost most.
        return f"Leaf(index={self.index!r}, expand={self.expand!r})"


def is_tensor(node: Any) -> bool:
    return isinstance(node, torch.Tensor)


def _refuse(node: Any, path: KeyPath) -> Any:
    raise TypeError(f"a {type(node).__name__} at {path_text(path) or 'the root'} is not a leaf, a container "
                    "or a plain value")


def rebuild(tree: Any, leaf: Callable[[Any, KeyPath], Any], *, is_leaf: Callable[[Any], bool] = is_tensor,
            other: Callable[[Any, KeyPath], Any] = _refuse,
            pack: Callable[[Any, Any, KeyPath], Any] | None = None, named_tuples: bool = True) -> Any:
    """``tree`` with the same tuples, lists and dicts, and each leaf replaced by ``leaf(node, path)``.

    None, bool, int, float and str are kept; anything else becomes ``other(node, path)`` (by
    default a TypeError), and so does a named tuple unless ``named_tuples``. ``pack(original,
    rebuilt, path)``, when given, chooses how each rebuilt container is represented (a JSON form
    for tuples, say). Tuples and lists come back as plain tuples and lists, dicts as plain dicts.
    """
    def walk(node: Any, path: KeyPath) -> Any:
        if is_leaf(node):
            return leaf(node, path)
        if not named_tuples and isinstance(node, tuple) and hasattr(type(node), "_fields"):
            return other(node, path)
        if isinstance(node, tuple):
            out: Any = tuple(walk(v, (*path, i)) for i, v in enumerate(node))
        elif isinstance(node, list):
            out = [walk(v, (*path, i)) for i, v in enumerate(node)]
        elif isinstance(node, dict):
            out = {k: walk(v, (*path, k)) for k, v in node.items()}
        elif isinstance(node, PLAIN):
            return node
        else:
            return other(node, path)
        return out if pack is None else pack(node, out, path)

    try:
        return walk(tree, ())
    finally:
        # walk refers to itself through its closure: a cycle that would keep ``leaf`` (and what it
        # collected: a checkpoint's tensors, say) alive until the garbage collector ran.
        del walk


def leaves(tree: Any, *, is_leaf: Callable[[Any], bool] = is_tensor, max_depth: int | None = None) -> Iterator[Any]:
    """The leaves of ``tree`` in order; containers deeper than ``max_depth`` and other values are skipped."""
    stack: list[tuple[Any, int]] = [(tree, 0)]
    while stack:
        node, depth = stack.pop()
        if is_leaf(node):
            yield node
        elif max_depth is None or depth < max_depth:
            children = node.values() if isinstance(node, dict) else node if isinstance(node, (tuple, list)) else ()
            stack.extend((child, depth + 1) for child in reversed(list(children)))


def flatten(tree: Any, *, is_leaf: Callable[[Any], bool] = is_tensor,
            other: Callable[[Any, KeyPath], Any] = _refuse, named_tuples: bool = True) -> tuple[list[Any], Any]:
    """The leaves of ``tree`` in order, and a skeleton (:class:`Leaf` in their places) that rebuilds it."""
    found: list[Any] = []

    def take(node: Any, path: KeyPath) -> Leaf:
        found.append(node)
        return Leaf(len(found) - 1)

    return found, rebuild(tree, take, is_leaf=is_leaf, other=other, named_tuples=named_tuples)


def unflatten(skeleton: Any, values: list[Any], leaf: Callable[[Leaf, Any], Any] | None = None) -> Any:
    """Inverse of :func:`flatten`; ``leaf(marker, value)``, when given, transforms each value put back."""
    def put(marker: Leaf, path: KeyPath) -> Any:
        value = values[marker.index]
        return value if leaf is None else leaf(marker, value)

    return rebuild(skeleton, put, is_leaf=lambda node: isinstance(node, Leaf), other=lambda node, path: node)


def path_text(path: KeyPath) -> str:
    """``[0]['mask']``: a path as Python would index it."""
    return "".join(f"[{key!r}]" for key in path)


__all__ = ["Leaf", "PLAIN", "KeyPath", "flatten", "is_tensor", "leaves", "path_text", "rebuild", "unflatten"]
