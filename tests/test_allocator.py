"""The splitft commands tune glibc's allocator, and a threshold set in the environment wins."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

#: Allocates and frees an 8 MiB buffer 20 times after tune(): prints the minor page faults it took.
_FAULTS = """
import resource
from splitft.app import allocator
if not allocator.tune():
    print(-1); raise SystemExit
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    buffer = bytearray(8 << 20)
    del buffer
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(**env: str) -> int:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _FAULTS], env={**clean, **env}, cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True)
    return int(out.stdout.strip())


def test_a_threshold_set_in_the_environment_is_kept():
    mapped = _faults()  # ours: 8 MiB is above the 4 MiB mmap threshold, so each buffer is mapped and faulted in
    if mapped < 0:
        pytest.skip("not glibc")
    kept = _faults(MALLOC_MMAP_THRESHOLD_=str(64 << 20))  # the environment's: the heap keeps the buffer
    assert mapped > 20 * 1000 and kept < mapped / 10, (mapped, kept)
