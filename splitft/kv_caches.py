"""transformers' key/value caches as each half of a split model holds them.

Generating through a split keeps one cache in two parts: the edge's, with entries for its layers,
and the cloud's, with entries for its own; in each, the other half's layers hold nothing. A change
to the cache (a crop of speculative decoding's rejected drafts) must pass those by: the
transformers of Python 3.10 (5.20) crop every layer, an empty one too, and fail on it (later
versions pass it by).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def crop_held(cache: Any, tokens: int, whole: Callable[[Any, int], None]) -> None:
    """Drop ``tokens`` (0 or less: that many from the end) from each layer ``cache`` holds, or by
    ``whole`` (the cache's own crop) for a cache not kept as a list of layers."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        whole(cache, tokens)
        return
    for layer in layers:
        if getattr(layer, "is_initialized", True):
            layer.crop(tokens)
