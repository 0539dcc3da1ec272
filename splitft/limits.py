"""What one cloud accepts, so that hostile or broken edges cannot exhaust it.

Every limit is checked before the work or memory it guards is spent: a message's size before it
is decoded, a model's parameter count (built on the ``meta`` device, which allocates nothing)
before it is built for real, the number of sessions before a new one opens. The edge learns the
message limits in the handshake and checks its own messages before sending them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from transports import message_nbytes

from .errors import ConfigError, TooLarge


@dataclass(frozen=True)
class Limits:
    """Bounds on what one cloud keeps and accepts.

    Attributes:
        max_message_bytes: biggest message (all frames) a request may be.
        max_frames: most frames in one message (each array is a frame).
        max_sessions: sessions open at once; a further hello is refused with ``capacity``.
        max_pending_calls: forward graphs per session awaiting their backward; the oldest is
            dropped beyond it.
        max_model_params: parameters (and buffers) a requested model may have.
        session_timeout: seconds without any message after which a session is freed (an edge
            keeps an idle session alive with heartbeats).
        reply_cache: replies kept per session, to answer a repeated request without redoing it.
        max_error_chars: error replies are cut to this length (they may quote the request).
    """

    max_message_bytes: int = 1 << 30
    max_frames: int = 4096
    max_sessions: int = 256
    max_pending_calls: int = 64
    max_model_params: int = 2_000_000_000
    session_timeout: float = 300.0
    reply_cache: int = 8
    max_error_chars: int = 2000

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"limit {name} must be a positive number, got {value!r}")

    def check_frames(self, frames: Sequence[Any]) -> None:
        """Refuse a message by its size alone, before anything in it is parsed."""
        if len(frames) > self.max_frames:
            raise TooLarge(f"a message of {len(frames)} frames arrived; this cloud accepts at most "
                           f"{self.max_frames} (one per array)")
        size = message_nbytes(frames)
        if size > self.max_message_bytes:
            raise TooLarge(
                f"a message of {size} bytes arrived; this cloud accepts at most {self.max_message_bytes} "
                "(start it with a larger --max-message-mb, or send less: a compressing codec, smaller batches)"
            )

    def for_edge(self) -> dict[str, int]:
        """The limits an edge must respect, as the handshake carries them."""
        return {"max_message_bytes": int(self.max_message_bytes), "max_frames": int(self.max_frames)}
