"""How this process's allocator keeps and returns memory (glibc only; elsewhere nothing changes).

glibc's defaults are tuned for programs that allocate small objects. A training step allocates
and frees the same buffers every step (activations, gradients, received frames), and with the
defaults the heap's free top is given back to the system once it exceeds 128 KiB and faulted back
in at the next step: thousands of minor page faults a step at batch 256 of the digits CNN, in the
unsplit loop as in the split one. The other default, a threshold for using ``mmap`` that rises
to the largest buffer freed so far, moves with what the process happened to free first.

The ``splitft`` commands (a process of ours) set both: buffers under :data:`MMAP_THRESHOLD` come
from the heap and are reused from step to step, and up to :data:`TRIM_THRESHOLD` free at a heap's
top is kept for the next step, the rest returned (a cloud's memory falls back after a large
request). The mmap threshold is glibc's highest, not lower: a mapped buffer is zeroed and
faulted in page by page at every use, and with a 4 MiB threshold a transformer step whose
tensors were ~9 MiB took 479,000 minor faults and 28% more time than glibc's defaults
(``python scripts/bench_allocator.py``). :func:`splitft.split` leaves the allocator of a user's
process alone: it is the process's, not the library's; a script that wants the same sets
``MALLOC_TRIM_THRESHOLD_`` and ``MALLOC_MMAP_THRESHOLD_`` in its environment, or calls
:func:`tune`. A threshold set in the environment wins over ours: whoever started the process
chose it (a cloud whose large requests should stay mapped, a benchmark that gives every process
the same).
"""

from __future__ import annotations

import ctypes
import os

#: Buffers of this size or more are mapped on their own and returned when freed: glibc's highest
#: (half its 64 MiB heap size on 64-bit systems), the ceiling its default threshold rises to.
MMAP_THRESHOLD = 32 << 20
#: Free memory at a heap's top kept for reuse rather than returned to the system.
TRIM_THRESHOLD = 64 << 20

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune(mmap_threshold: int = MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> bool:
    """Set glibc's mmap and trim thresholds for this process, each unless the environment set it
    (``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TRIM_THRESHOLD_``); True when it could (glibc)."""
    try:
        libc = ctypes.CDLL(None)
        return all(bool(libc.mallopt(option, value)) for option, value, variable in (
            (_M_MMAP_THRESHOLD, mmap_threshold, "MALLOC_MMAP_THRESHOLD_"),
            (_M_TRIM_THRESHOLD, trim_threshold, "MALLOC_TRIM_THRESHOLD_")) if variable not in os.environ)
    except (OSError, AttributeError):  # not glibc
        return False


__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "tune"]
