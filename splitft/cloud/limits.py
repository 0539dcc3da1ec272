"""What one cloud accepts, so that hostile or broken edges cannot exhaust it.

Every limit is checked before the work or memory it guards is spent: a message's size before it
is decoded, what its tensors will take once decoded (expansion and dtype widening included)
before they are, a model's parameter count (built on the ``meta`` device, which allocates
nothing) before it is built for real, the number of sessions before a new one opens. What a
session holds — its model copy, codec buffers and caches, graphs awaiting their backward,
deferred gradients, cached replies — counts against one per-session budget and one total, so a
few hundred bytes can never make the cloud hold gigabytes. (What ZeroMQ buffers before a message
is handed over is outside these budgets: see :mod:`transports.zmq`.) The edge learns the message
limits in the handshake and checks its own messages before sending them.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from transports import message_nbytes

from ..errors import CapacityError, ConfigError, TooLarge

GiB = 1 << 30


def physical_memory_bytes() -> int:
    """This machine's memory (the default total budget is half of it)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # not every platform names these
        return 8 * GiB


@dataclass(frozen=True)
class Limits:
    """Bounds on what one cloud keeps and accepts.

    Attributes:
        max_message_bytes: biggest message (all frames) a request may be.
        max_frames: most frames in one message (each array is a frame).
        max_header_bytes: biggest header frame (frame 0, msgpack). Its parse builds Python objects
            of up to ~90 times its size (an empty map is 1 byte on the wire, 88 in memory), so it
            is bounded on its own, far below the array frames: real headers are a few KiB, and
            the worst one under the default takes ~70 MiB for ~50 ms while it is parsed.
        max_decoded_bytes: most bytes the tensors of one message may take once decoded
            (after repeating compacted side tensors and widening to the decoded dtype).
        max_ops: mirrored operations (step, zero_grad, ...) one message may carry.
        train_fraction: the share of an edge's backward requests the cloud trains on, its hardest
            batches by loss (:mod:`.selection`; 1: every one).
        max_move_bytes: the most state a session moving here from another cloud may bring
            (:mod:`.moves`).
        max_sessions: sessions open at once; a further hello is refused with ``capacity``.
        sessions_per_peer: sessions open at once from one origin: one network address, and on a
            CurveZMQ link also one edge key (with an allow-list, only the key: edges behind one
            address are told apart by their keys).
        session_memory_bytes: what one session may hold: its copy of the cloud half (weights,
            gradients, optimizer state), codec state, pending graphs, deferred gradients and
            cached replies.
        memory_bytes: what all sessions together may hold (0: half of this machine's memory).
        max_pending_calls: forward graphs per session awaiting their backward; the oldest is
            dropped beyond it.
        max_model_params: parameters (and buffers) a requested model may have.
        session_timeout: seconds without any message after which a session is freed (an edge
            keeps an idle session alive with heartbeats).
        handshake_timeout: seconds a session that has not trained yet may stay silent before
            it is freed (a hello that is never followed by work does not hold a place for long).
        evictable_after: seconds after its hello or its last training request (a forward,
            backward or operations that succeeded; pings and failed requests do not count) after
            which a session may be evicted when a new session, or another session's request,
            needs the room it holds (see :mod:`splitft.cloud.admission`).
        reply_cache: replies kept per session, to answer a repeated request without redoing it.
        max_error_chars: error replies are cut to this length (they may quote the request).
        checkpoint_bytes: what the checkpoint folder may hold in all; a session that would
            take it over is refused with ``capacity``.
        max_request_flops: the arithmetic one request may make the cloud do (decoding its
            tensors, the half's forward and backward, encoding what goes back), priced before
            any of it is done; a request over it is refused with ``capacity``.
        pin_bytes: what the pinned checkpoints (kept after their session ends, for an edge that
            saved its own) of one origin may hold; a pin beyond it is refused with ``capacity``.
        pin_seconds: how long a pinned checkpoint is kept after it was written.
    """

    max_message_bytes: int = GiB
    max_frames: int = 4096
    max_header_bytes: int = 256 << 10
    max_decoded_bytes: int = 2 * GiB
    max_ops: int = 1024
    max_sessions: int = 256
    sessions_per_peer: int = 64
    session_memory_bytes: int = 8 * GiB
    memory_bytes: int = field(default_factory=lambda: physical_memory_bytes() // 2)
    max_pending_calls: int = 64
    max_model_params: int = 2_000_000_000
    session_timeout: float = 300.0
    handshake_timeout: float = 30.0
    evictable_after: float = 30.0
    reply_cache: int = 8
    max_error_chars: int = 2000
    checkpoint_bytes: int = 64 * GiB
    max_request_flops: int = 10**13
    pin_bytes: int = 4 * GiB
    pin_seconds: float = 7 * 24 * 3600.0
    max_move_bytes: int = GiB
    train_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"limit {name} must be a positive number, got {value!r}")
        if self.train_fraction > 1:
            raise ConfigError(f"--train-fraction is a share of the batches, at most 1, got {self.train_fraction!r}")

    def check_frames(self, frames: Sequence[Any]) -> int:
        """Refuse a message by its size alone, before anything in it is parsed; returns its bytes."""
        if len(frames) > self.max_frames:
            raise TooLarge(f"a message of {len(frames)} frames arrived; this cloud accepts at most "
                           f"{self.max_frames} (one per array)")
        header = memoryview(frames[0]).nbytes if frames else 0
        if header > self.max_header_bytes:
            raise TooLarge(f"a header frame of {header} bytes arrived; this cloud parses at most "
                           f"{self.max_header_bytes} (--max-header-kb); arrays travel in frames of their own")
        size = message_nbytes(frames)
        if size > self.max_message_bytes:
            raise TooLarge(
                f"a message of {size} bytes arrived; this cloud accepts at most {self.max_message_bytes} "
                "(start it with a larger --max-message-mb, or send less: a compressing codec, smaller batches)"
            )
        return size

    def check_decoded(self, nbytes: int, what: str) -> None:
        """Refuse a message whose tensors would decode to more than one message may."""
        if nbytes > self.max_decoded_bytes:
            raise CapacityError(f"{what} would decode to {nbytes} bytes; this cloud decodes at most "
                                f"{self.max_decoded_bytes} per message (--max-decoded-mb)")

    def for_edge(self) -> dict[str, int]:
        """The limits an edge must respect, as the handshake carries them."""
        return {"max_message_bytes": int(self.max_message_bytes), "max_frames": int(self.max_frames),
                "max_header_bytes": int(self.max_header_bytes),
                "max_decoded_bytes": int(self.max_decoded_bytes), "max_ops": int(self.max_ops)}


def mib(nbytes: int) -> str:
    """``nbytes`` for people: ``"12.3 MiB"`` (``"3.0 KiB"``, ``"96 bytes"`` below a tenth of a MiB)."""
    if nbytes >= 2**20 // 10:
        return f"{nbytes / 2**20:.1f} MiB"
    return f"{nbytes / 2**10:.1f} KiB" if nbytes >= 2**10 else f"{nbytes} bytes"
