"""Answers to an edge's link probes (``--codecs auto``): what a probe may cost, and what it learns.

A probe comes before any session, so it is answered without one, and it must cost the cloud no
more than it costs the sender: its pad is capped (:data:`PROBE_MAX_BYTES`), it is echoed only as
it came (never amplified), and nothing is kept. The answer names the codecs the cloud's policy
allows per direction, the same names a refused hello would list, so an edge choosing its codecs
picks only what will be admitted.
"""

from __future__ import annotations

import numpy as np

from ..errors import ProtocolError, TooLarge
from ..wire.protocol import Probe, Probed
from .codec_policy import Policy

#: The largest pad a probe may carry: enough to time a gigabit link to a few per cent.
PROBE_MAX_BYTES = 1 << 20


def answer(msg: Probe, policy: Policy) -> Probed:
    """The reply to ``msg``: its pad back if it asked for an echo, and the allowed codec names."""
    pad = msg.pad
    if pad is not None:
        if pad.dtype != np.uint8 or pad.ndim != 1:
            raise ProtocolError(f"a probe's pad is a 1-D uint8 array, got {pad.dtype} of shape {list(pad.shape)}")
        if pad.nbytes > PROBE_MAX_BYTES:
            raise TooLarge(f"a probe's pad of {pad.nbytes} bytes exceeds this cloud's cap of {PROBE_MAX_BYTES}")
    allowed = {slot: sorted(names) for slot, names in policy.codecs.items()}
    return Probed(pad=pad if msg.echo else None, allowed=allowed)


__all__ = ["PROBE_MAX_BYTES", "answer"]
