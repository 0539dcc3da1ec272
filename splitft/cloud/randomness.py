"""A session's own random numbers: what its half's dropout draws.

Dropout draws from torch's global generator, which a cloud process shares among all its
sessions. Drawn from there, one edge's masks would depend on every other edge's traffic, and on
whichever session last resumed from a checkpoint (which used to restore the process's state). So
each session keeps a generator state of its own and the half computes with that state swapped in.

The state is the edge's: a forward carries the edge's host generator state whenever it changed
since the cloud last had it (``forward.rng``), and a forward that drew sends the state it left
back (``output.rng``), which the edge goes on from. The host's generator thus runs through both
halves in the unsplit model's order, and a half with dropout draws the unsplit model's masks, bit
for bit, on a host half. Until an edge sends its state (and for an accelerator's draws) the stream
is seeded from the seed of the hello: the same script against the same cloud gives the same
weights however many other edges the cloud serves, and a resumed session continues its own stream.

Sessions may compute at the same time (a heavy request runs on a worker thread, :mod:`.jobs`),
and the process has one generator: a half that draws holds :data:`GENERATOR` while its state is
swapped in. Whether it draws is seen, per mode (training or evaluation), on its first forward in
that mode, which runs holding the lock: a half whose forward left the generator as it found it
draws nothing and from then on computes without the lock, beside the others (a forward that draws
after all, where its layers' draws depend on the data, is refused, and it takes the lock from then
on: :meth:`SessionRandom.active`). What is seen holds
for every session of the same half (``kind``: the same factory, arguments and cut), unless a
session runs some of its modules in the other mode or sets their flags, which it then learns for
itself, again at each change.
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ..errors import ModelError
from ..generator_state import host_state

#: Spreads (seed, stream) pairs apart: stream s of seed k is seeded with k * STRIDE + s.
STRIDE = 1_000_003
#: Held by a session while its states are the process's (re-entrant: a caller may take it first).
GENERATOR = threading.RLock()
#: Per kind of half: per mode (training?), whether its forward drew random numbers.
_SEEN: dict[Any, dict[bool, bool]] = {}


class SessionRandom:
    """The generator states one session's half computes with (the host's, and its device's)."""

    def __init__(self, seed: int, device: torch.device, stream: int = 0, kind: Any = None) -> None:
        self.device = device
        # Modulo 2**64, the generator's own range (where a negative seed already wraps to): any
        # int a hello may carry seeds it, and every seed that fitted before seeds it as before.
        self.seed = (int(seed) * STRIDE + int(stream)) % 2**64
        self.host = torch.Generator().manual_seed(self.seed).get_state()
        self.accelerator: torch.Tensor | None = None  # made on first use, seeded the same way
        # per mode (training?): whether the half drew, once seen; shared by the halves of one kind
        self.draws: dict[bool, bool] = _SEEN.setdefault(kind, {}) if kind is not None else {}
        self._of_kind = kind is not None
        self._flipped: list[Any] = []  # the modules in the other mode and the flags set when draws were learnt
        self._flags: dict[str, Any] = {}

    def on(self, device: torch.device) -> SessionRandom:
        """The same stream for a half that moved to ``device`` (built on the host, then placed)."""
        moved = copy.copy(self)
        moved.device, moved.accelerator = device, None
        return moved

    def configured(self, flipped: list[Any], flags: dict[str, Any]) -> None:
        """The half runs with ``flipped`` modules in the other mode and ``flags`` set (as the edge
        mirrored them). Once they differ from its kind's, or from what its draws were learnt with
        (a dropout put in eval mode, or its ``p`` set to 0, and back), what it draws is learnt
        again, for it alone: a half learnt not to draw would run a dropout turned back on off
        the process's generator rather than the edge's."""
        if flipped == self._flipped and flags == self._flags:
            return
        self.draws, self._of_kind = {}, False
        self._flipped, self._flags = list(flipped), copy.deepcopy(flags)

    def may_draw(self, train: bool) -> bool:
        """Whether a forward in this mode needs :data:`GENERATOR` (unknown counts as yes)."""
        return self.draws.get(train, True)

    @contextmanager
    def active(self, train: bool = True) -> Iterator[None]:
        """Run the block on this session's states; the process's are as they were afterwards.

        A half learnt not to draw runs on the process's generator, without the lock; if it drew
        after all (whether a layer draws can depend on its input: noise added to the rows a mask
        selects), those numbers were not the edge's: the forward is refused, and the half's
        forwards in this mode run on the session's states from then on. (Seen where no forward
        that draws held the lock as this one began or ended; one never waits for the lock.)"""
        if not self.may_draw(train):
            before = _process_state()
            yield
            after = _process_state() if before is not None else None
            if before is not None and after is not None and not torch.equal(before, after):
                self.draws[train] = True
                raise ModelError(DREW_UNEXPECTEDLY.format(mode="training" if train else "evaluation"))
            return
        with GENERATOR:
            host, accelerator = self.host, self.accelerator
            with self._swapped():
                yield
            drew = not (_same(host, self.host) and _same(accelerator, self.accelerator))
            self.draws[train] = drew or self.draws.get(train, False)  # one that drew once may draw again

    @contextmanager
    def _swapped(self) -> Iterator[None]:
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
                self.host = host_state()
                if cuda:
                    self.accelerator = torch.cuda.get_rng_state(self.device)

    def follow(self, state: torch.Tensor) -> None:
        """Go on from the edge's host generator state (checked by
        :func:`splitft.generator_state.checked_host_state`)."""
        self.host = state

    def state(self) -> dict[str, torch.Tensor]:
        """For a checkpoint."""
        return {"rng": self.host} | ({"cuda_rng": self.accelerator} if self.accelerator is not None else {})

    def load(self, tree: dict[str, torch.Tensor]) -> None:
        """From a checkpoint: the stream goes on where the checkpoint left it."""
        self.host = tree["rng"].clone()
        if "cuda_rng" in tree and self.device.type == "cuda":
            self.accelerator = tree["cuda_rng"].clone()


DREW_UNEXPECTEDLY = (
    "the cloud half drew random numbers in a forward in {mode} mode, where its forwards so far drew none (whether a "
    "layer draws depends on its input: noise added to the rows a mask selects, a label dropped only when labels "
    "are given); it ran on the cloud process's generator, not the edge's stream as unsplit, so its result was not "
    "used. Its forwards in this mode draw from the edge's stream from now on: run the step again (where its "
    "modules keep running statistics, they moved once in this forward)")


def half_kind(hello: Any) -> str:
    """Which half a hello asks for, whatever its codecs and seed: halves of one kind run one code."""
    return repr((hello.factory, sorted(hello.factory_kwargs.items()), hello.cut, hello.rejoin, hello.fingerprint))


def _process_state() -> torch.Tensor | None:
    """The process's own host generator state, where no half has swapped its state in; None while
    one has (a forward that draws, on a worker): a half that does not draw never waits for it."""
    if not GENERATOR.acquire(blocking=False):
        return None
    try:
        return host_state()
    finally:
        GENERATOR.release()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)


__all__ = ["DREW_UNEXPECTEDLY", "GENERATOR", "SessionRandom", "half_kind"]
