"""What crossed the link and where the time went.

Bytes are counted per direction (``up``: edge → cloud, ``down``: cloud → edge) and per kind
(activations, gradients, control): *raw* is what the tensors would take uncompressed, *payload*
what the codecs produced, *wire* what the transport really sent (headers included).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

DIRECTIONS = ("up", "down")
KINDS = ("activation", "gradient", "control")


@dataclass
class ByteCount:
    messages: int = 0
    raw: int = 0
    payload: int = 0
    wire: int = 0

    @property
    def ratio(self) -> float:
        """Raw over wire bytes: how many times smaller the traffic is than uncompressed."""
        return self.raw / self.wire if self.wire else float("nan")

    def __iadd__(self, other: "ByteCount") -> "ByteCount":
        self.messages += other.messages
        self.raw += other.raw
        self.payload += other.payload
        self.wire += other.wire
        return self


class Timed:
    """Adds a ``with`` block's seconds to ``seconds[name]``: a class rather than a generator, as
    every message of a step times a few stages."""

    __slots__ = ("seconds", "name", "start")

    def __init__(self, seconds: dict[str, float], name: str) -> None:
        self.seconds, self.name = seconds, name

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self.name] += time.perf_counter() - self.start


class Metrics:
    """Counters for one end of a link; cheap enough to stay on in every step."""

    def __init__(self) -> None:
        self.bytes: dict[tuple[str, str], ByteCount] = defaultdict(ByteCount)
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0
        #: What the run decided at its start and its records should carry (the codecs ``auto``
        #: chose, and from what), by name; plain JSON values.
        self.notes: dict[str, Any] = {}

    def count(self, direction: str, kind: str, *, raw: int = 0, payload: int = 0, wire: int,
              messages: int = 1) -> None:
        entry = self.bytes[(direction, kind)]
        entry.messages += messages
        entry.raw += raw
        entry.payload += payload
        entry.wire += wire

    def add_time(self, name: str, seconds: float) -> None:
        self.seconds[name] += seconds

    def timed(self, name: str) -> Timed:
        """A ``with`` block whose seconds add to ``name``."""
        return Timed(self.seconds, name)

    def direction(self, direction: str) -> ByteCount:
        total = ByteCount()
        for (d, _), count in self.bytes.items():
            if d == direction:
                total += count
        return total

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict totals: bytes per direction and kind, seconds per phase."""
        out: dict[str, Any] = {"steps": self.steps, "bytes": {}, "seconds": dict(self.seconds)}
        for d in DIRECTIONS:
            out["bytes"][d] = asdict(self.direction(d)) | {
                k: asdict(self.bytes[(d, k)]) for k in KINDS if (d, k) in self.bytes
            }
        if self.notes:
            out["notes"] = dict(self.notes)
        return out

    def breakdown(self, wall: float) -> dict[str, float]:
        """Split ``wall`` seconds of edge time into edge compute, codec, wire and cloud work."""
        s = self.seconds
        cloud = s.get("cloud_compute", 0.0) + s.get("cloud_codec", 0.0)
        wire = max(0.0, s.get("wait", 0.0) - cloud)
        codec = s.get("encode", 0.0) + s.get("decode", 0.0)
        edge = max(0.0, wall - s.get("wait", 0.0) - codec)
        return {"edge_compute": edge, "edge_codec": codec, "wire": wire,
                "cloud_compute": s.get("cloud_compute", 0.0), "cloud_codec": s.get("cloud_codec", 0.0)}


class JsonlWriter:
    """Appends one JSON object per line and flushes it, so a crash loses at most one record."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(record, sort_keys=True) + "\n")
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def format_report(metrics: Metrics, wall: float) -> str:
    """The human summary the CLI prints: bytes each way and where the time went."""
    lines = ["traffic            raw          wire   ratio  messages"]
    for d, label in (("up", "edge -> cloud"), ("down", "cloud -> edge")):
        c = metrics.direction(d)
        lines.append(f"  {label:13s} {human_bytes(c.raw):>12s} {human_bytes(c.wire):>12s} "
                     f"{c.ratio:6.2f}x {c.messages:8d}")
    parts = metrics.breakdown(wall)
    lines.append(f"time               {wall:8.2f} s total")
    for name, seconds in parts.items():
        share = 100 * seconds / wall if wall else 0.0
        lines.append(f"  {name.replace('_', ' '):15s} {seconds:8.2f} s  {share:5.1f}%")
    return "\n".join(lines)
