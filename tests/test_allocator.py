"""The splitft commands tune glibc's allocator, and a threshold set in the environment wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

#: Allocates and frees a buffer of MiB given 20 times after tune(): prints the minor page faults
#: it took (a buffer mapped on its own is faulted in page by page each time, one the heap keeps once).
_FAULTS = """
import resource, sys
from splitft.app import allocator
if not allocator.tune():
    print(-1); raise SystemExit
size = int(sys.argv[1]) << 20
buffer = bytearray(size)  # the first: a heap grows once either way
del buffer
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    buffer = bytearray(size)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mebibytes: int, **env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _FAULTS, str(mebibytes)], env={**clean, **env}, cwd=ROOT,
                         capture_output=True, text=True, timeout=60, check=True)
    value = int(out.stdout.strip())
    if value < 0:
        pytest.skip("not glibc")
    return value


def test_buffers_a_step_reuses_stay_in_the_heap_and_only_the_largest_are_mapped():
    """A mapped buffer is zeroed and faulted in at every use (a transformer step with ~9 MiB
    tensors took 479,000 faults under a 4 MiB threshold), so only those over glibc's highest
    threshold are."""
    pages = (8 << 20) // 4096
    assert _faults(8) < pages, "an 8 MiB buffer freed and allocated again was faulted in again"
    assert _faults(48) > 20 * 1000, "a 48 MiB buffer was kept: a cloud's memory would not fall back"


def test_a_threshold_set_in_the_environment_is_kept():
    kept = _faults(8)
    mapped = _faults(8, MALLOC_MMAP_THRESHOLD_=str(1 << 20))  # the environment's: 8 MiB is mapped each time
    assert mapped > 20 * 1000 and kept < mapped / 10, (mapped, kept)
