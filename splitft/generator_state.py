"""Torch's host generator state as it crosses the cut (``forward.rng``, ``output.rng``), checked.

Each side takes the other's state into its own generator: the edge's goes on in the cloud half's
dropout, the state the half left comes back. What arrives is bytes from a peer; a state whose read
position does not fit its words would make the Mersenne twister read past them, so it is refused
before any generator holds it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from .errors import ProtocolError

#: Bytes of torch's host generator state (``torch.get_rng_state()``).
HOST_STATE_BYTES = torch.get_rng_state().numel()
_MT_WORDS = 624  # the Mersenne twister's state, in 32-bit words


def host_state() -> torch.Tensor:
    """The host generator's state as splitft reads it: from the generator itself, past the names at
    which a script's reads are checked (:mod:`splitft.edge.generator_sets`)."""
    return torch.default_generator.get_state()


@contextlib.contextmanager
def host_state_kept() -> Iterator[None]:
    """The block's draws undone after it, as ``torch.random.fork_rng(devices=[])`` would, through the
    generator itself: splitft's own extra run is no read or set of the script's."""
    state = host_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(state)


def checked_host_state(value: Any, field: str) -> torch.Tensor:
    """``value`` (a peer's ``field``) as a host generator state of our own; :class:`ProtocolError`
    when it is not one torch's generator accepts (checked on a scratch generator)."""
    if not (isinstance(value, np.ndarray) and value.dtype == np.uint8 and value.shape == (HOST_STATE_BYTES,)):
        shape = getattr(value, "shape", None)
        raise ProtocolError(f"{field} must be {HOST_STATE_BYTES} bytes of a host generator state (uint8), "
                            f"got {type(value).__name__} {getattr(value, 'dtype', '')} {shape if shape else ''}")
    # Where the twister reads next: torch checks each bound alone, but only a position whose words
    # left and read add up (or the freshly seeded one) keeps its reads inside the state.
    left, position = int(value[8:12].view(np.int32)[0]), int(value[16:24].view(np.uint64)[0])
    if not (left + position == _MT_WORDS + 1 and 1 <= left <= _MT_WORDS or (left, position) == (1, 0)):
        raise ProtocolError(f"{field} is not a host generator state: position {position} with {left} words left")
    state = torch.from_numpy(value.copy())
    try:
        torch.Generator().set_state(state)
    except RuntimeError as exc:
        raise ProtocolError(f"{field} is not a host generator state: {exc}") from None
    return state


__all__ = ["HOST_STATE_BYTES", "checked_host_state"]
