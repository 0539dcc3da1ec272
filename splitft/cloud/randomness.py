"""A session's own random numbers: what its half's dropout draws.

Dropout draws from torch's global generator, which a cloud process shares among all its
sessions. Drawn from there, one edge's masks would depend on every other edge's traffic, and on
whichever session last resumed from a checkpoint (which used to restore the process's state). So
each session keeps a generator state of its own, seeded from the seed the edge sent in its hello,
and the half computes with that state swapped in: the same script against the same cloud gives
the same weights however many other edges the cloud serves, and a resumed session continues its
own stream.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch

#: Spreads (seed, stream) pairs apart: stream s of seed k is seeded with k * STRIDE + s.
STRIDE = 1_000_003


class SessionRandom:
    """The generator states one session's half computes with (the host's, and its device's)."""

    def __init__(self, seed: int, device: torch.device, stream: int = 0) -> None:
        self.device = device
        # Modulo 2**64, the generator's own range (where a negative seed already wraps to): any
        # int a hello may carry seeds it, and every seed that fitted before seeds it as before.
        self.seed = (int(seed) * STRIDE + int(stream)) % 2**64
        self.host = torch.Generator().manual_seed(self.seed).get_state()
        self.accelerator: torch.Tensor | None = None  # made on first use, seeded the same way

    def on(self, device: torch.device) -> SessionRandom:
        """The same stream for a half that moved to ``device`` (built on the host, then placed)."""
        moved = copy.copy(self)
        moved.device, moved.accelerator = device, None
        return moved

    @contextmanager
    def active(self) -> Iterator[None]:
        """Run the block on this session's states; the process's are as they were afterwards."""
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.set_rng_state(self.host)
            if cuda:
                if self.accelerator is None:
                    with torch.cuda.device(self.device):  # manual_seed seeds the current device
                        torch.cuda.manual_seed(self.seed)
                else:
                    torch.cuda.set_rng_state(self.accelerator, self.device)
            try:
                yield
            finally:
                self.host = torch.get_rng_state()
                if cuda:
                    self.accelerator = torch.cuda.get_rng_state(self.device)

    def state(self) -> dict[str, torch.Tensor]:
        """For a checkpoint."""
        return {"rng": self.host} | ({"cuda_rng": self.accelerator} if self.accelerator is not None else {})

    def load(self, tree: dict[str, torch.Tensor]) -> None:
        """From a checkpoint: the stream goes on where the checkpoint left it."""
        self.host = tree["rng"].clone()
        if "cuda_rng" in tree and self.device.type == "cuda":
            self.accelerator = tree["cuda_rng"].clone()


__all__ = ["SessionRandom"]
