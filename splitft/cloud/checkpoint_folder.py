"""A folder of checkpoints of many sessions, bounded: regular ones go with their session, pins expire.

``ROOT/<session>/seq-<n>.json`` (+ tensor file) each: checkpoints are named by the last request
sequence number they include, which is what a resuming edge asks for. The newest ``keep``
regular checkpoints of a session are kept, plus its newest *pinned* one (``pin-<n>``: written
because the edge saved its own checkpoint, so an edge restarted from that file finds the
matching cloud half after its session ended).

Nothing stays that no session can use:

- a session's regular checkpoints are deleted when it ends (:meth:`CheckpointStore.remove`), and
  those of sessions nobody resumed within ``orphan_seconds`` (after a crash, say) by
  :meth:`CheckpointStore.sweep`;
- a pin counts against its origin's quota (``pin_bytes``: a pin beyond it is refused with
  ``capacity``) and expires ``pin_seconds`` after it was written; pins together hold at most
  :data:`PIN_SHARE` of the folder, and the oldest pin of whichever origin holds the most makes
  room for a new one beyond that, so pins can never fill the folder for the live sessions;
- a save that would take the folder over ``max_bytes`` is refused.

What the folder holds is known from the files at start-up (a pin's origin and expiry from its
small JSON), so the bounds hold across restarts. Saves from several threads are safe: the
bookkeeping is under a lock, the writing is not.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..state_files import read_checkpoint, read_meta, remove_checkpoint, state_nbytes, write_checkpoint
from ..errors import CapacityError, CheckpointError
from .limits import mib

log = logging.getLogger(__name__)

_SESSION = re.compile(r"[0-9a-f]{16}")
#: The part of the folder pinned checkpoints may hold together.
PIN_SHARE = 0.5
#: Pins last this long unless the store is told otherwise (a week).
PIN_SECONDS = 7 * 24 * 3600.0


@dataclass
class Pin:
    """A session's pinned checkpoint: who asked for it, its size, when it goes."""

    seq: int
    origin: str
    nbytes: int
    expires: float  # wall-clock seconds (time.time()), so it holds across restarts


class CheckpointStore:
    """Checkpoints of many sessions under ``root``, within ``max_bytes`` (see the module doc)."""

    def __init__(self, root: str | os.PathLike, *, keep: int = 2, fsync: bool = True, max_bytes: int | None = None,
                 pin_bytes: int | None = None, pin_seconds: float = PIN_SECONDS,
                 orphan_seconds: float | None = None) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep, self.fsync, self.max_bytes = keep, fsync, max_bytes
        self.pin_bytes, self.pin_seconds, self.orphan_seconds = pin_bytes, pin_seconds, orphan_seconds
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._reserved = 0  # bytes of saves under way
        self._sizes: dict[str, int] = {}
        self._pins: dict[str, Pin] = {}
        self._started = time.time()
        for folder in self.root.iterdir():
            if folder.is_dir() and _SESSION.fullmatch(folder.name):
                _remove_dead_writers_files(folder)
                self._sizes[folder.name] = _folder_nbytes(folder)
                self._index_pin(folder.name)

    # ------------------------------------------------------------ what it holds

    def nbytes(self) -> int:
        """What the folder holds (kept up to date by this store's own saves and removals)."""
        return sum(self._sizes.values())

    def pinned_nbytes(self, origin: str | None = None) -> int:
        """What pinned checkpoints hold (of ``origin``'s, when given)."""
        return sum(p.nbytes for p in list(self._pins.values()) if origin is None or p.origin == origin)

    def full(self) -> bool:
        return self.max_bytes is not None and self.nbytes() >= self.max_bytes

    def _index_pin(self, session: str) -> None:
        """Learn a session's pin from its JSON (origin, expiry), as after a restart."""
        numbers = self._numbers(self.root / session, "pin")
        if not numbers:
            self._pins.pop(session, None)
            return
        stem = self.root / session / f"pin-{numbers[-1]:012d}"
        try:
            pin = read_meta(stem).get("pin") or {}
            written = stem.with_name(stem.name + ".json").stat().st_mtime
        except (CheckpointError, OSError):
            pin, written = {}, time.time()
        expires = pin.get("expires")
        self._pins[session] = Pin(numbers[-1], str(pin.get("origin", "")), _stem_nbytes(stem),
                                  float(expires) if isinstance(expires, (int, float)) else written + self.pin_seconds)

    # ------------------------------------------------------------ saving

    def save(self, session: str, seq: int, tree: Any, meta: dict[str, Any], *, pinned: bool = False,
             origin: str = "") -> Path:
        """Write a checkpoint of ``session``; a pin counts against ``origin``'s quota.

        Raises :class:`CapacityError` for a pin beyond its origin's quota and
        :class:`CheckpointError` for a save the folder has no room for.
        """
        folder = self._folder(session)
        kind = "pin" if pinned else "seq"
        need = state_nbytes(tree)
        with self._lock:
            if pinned:
                self._make_room_for_pin(session, origin, need)
                meta = {**meta, "pin": {"origin": origin, "expires": time.time() + self.pin_seconds}}
            if self.max_bytes is not None and self.nbytes() + self._reserved + need > self.max_bytes:
                raise CheckpointError(f"the checkpoint folder holds {mib(self.nbytes())}; this checkpoint of "
                                      f"{mib(need)} more would pass its cap of {mib(self.max_bytes)} "
                                      "(--checkpoint-max-mb)")
            self._reserved += need
        try:
            path = write_checkpoint(folder / f"{kind}-{seq:012d}", tree, meta, fsync=self.fsync)
            for old in self._numbers(folder, kind)[: -(1 if pinned else self.keep)]:
                remove_checkpoint(folder / f"{kind}-{old:012d}")
        finally:
            with self._lock:
                self._reserved -= need
                self._update(session, pins=pinned)
        return path

    def _make_room_for_pin(self, session: str, origin: str, need: int) -> None:
        """Refuse a pin beyond its origin's quota; evict others' oldest pins beyond the pins' share."""
        old = self._pins.get(session)
        replaced = old.nbytes if old is not None else 0  # a session's new pin replaces its last
        if self.pin_bytes is not None and self.pinned_nbytes(origin) - replaced + need > self.pin_bytes:
            raise CapacityError(
                f"this pinned checkpoint of {mib(need)} would take the pins of {origin or 'this origin'} to "
                f"{mib(self.pinned_nbytes(origin) - replaced + need)}, over its quota of {mib(self.pin_bytes)} "
                "(--pin-quota-mb); resume or end the sessions whose pins you no longer need, or wait for them to "
                f"expire ({self.pin_seconds / 3600:g} h after each was written)")
        if self.max_bytes is None:
            return
        share = int(PIN_SHARE * self.max_bytes)
        if need > share:
            raise CapacityError(f"a pinned checkpoint of {mib(need)} is larger than pins may hold in this cloud "
                                f"({mib(share)}); pin a smaller state")
        while self.pinned_nbytes() - replaced + need > share:
            victim = self._largest_holders_oldest_pin(exclude=session)
            if victim is None:
                break
            log.info("pinned checkpoint of session %s dropped to make room for a newer pin", victim)
            self._drop_pin(victim)

    def _largest_holders_oldest_pin(self, exclude: str) -> str | None:
        holders: dict[str, int] = {}
        for sid, pin in self._pins.items():
            if sid != exclude:
                holders[pin.origin] = holders.get(pin.origin, 0) + pin.nbytes
        if not holders:
            return None
        origin = max(holders, key=holders.__getitem__)
        return min((p.expires, sid) for sid, p in self._pins.items() if p.origin == origin and sid != exclude)[1]

    def _drop_pin(self, session: str) -> None:
        pin = self._pins.pop(session, None)
        if pin is not None:
            remove_checkpoint(self.root / session / f"pin-{pin.seq:012d}")
            self._tidy(session)

    # ------------------------------------------------------------ removing

    def remove(self, session: str, *, keep_pinned: bool = True) -> None:
        """Delete ``session``'s checkpoints (all but its pinned one, unless ``keep_pinned`` is off)."""
        folder = self._folder(session)
        if not folder.is_dir():
            return
        for kind in ("seq",) + (() if keep_pinned else ("pin",)):
            for number in self._numbers(folder, kind):
                remove_checkpoint(folder / f"{kind}-{number:012d}")
        with self._lock:
            self._tidy(session)

    def sweep(self, live: Collection[str] | None, now: float | None = None) -> None:
        """Delete what no session can use any more: pins past their expiry and, unless ``live``
        is None (the folder is shared with other processes), the regular checkpoints of sessions
        not in ``live`` whose newest file is older than ``orphan_seconds``."""
        now = time.time() if now is None else now
        with self._lock:
            for session in [sid for sid, pin in self._pins.items() if pin.expires <= now]:
                log.info("pinned checkpoint of session %s expired", session)
                self._drop_pin(session)
            if live is None or self.orphan_seconds is None:
                return
            for session in [sid for sid in self._sizes if sid not in live]:
                folder = self.root / session
                seqs = self._numbers(folder, "seq")
                newest = max([_mtime(folder / f"seq-{n:012d}.json") for n in seqs] + [self._started])
                if seqs and now - newest > self.orphan_seconds:
                    log.info("checkpoints of session %s: no edge resumed it; deleted", session)
                    for number in seqs:
                        remove_checkpoint(folder / f"seq-{number:012d}")
                    self._tidy(session)

    def _tidy(self, session: str) -> None:
        """After files of ``session`` went: drop its folder if empty and recount it (lock held)."""
        try:
            (self.root / session).rmdir()  # only when nothing is left in it
        except OSError:
            pass
        self._update(session, pins=True)

    def _update(self, session: str, pins: bool = False) -> None:
        folder = self.root / session
        if folder.is_dir():
            self._sizes[session] = _folder_nbytes(folder)
            if pins:
                self._index_pin(session)
        else:
            self._sizes.pop(session, None)
            self._pins.pop(session, None)

    # ------------------------------------------------------------ reading

    def _folder(self, session: str) -> Path:
        if not isinstance(session, str) or not _SESSION.fullmatch(session):
            raise CheckpointError(f"session ids are 16 hex digits, got {str(session)[:40]!r}")
        return self.root / session

    @staticmethod
    def _numbers(folder: Path, kind: str) -> list[int]:
        found = []
        for path in folder.glob(f"{kind}-*.json"):
            digits = path.stem.removeprefix(f"{kind}-")
            if digits.isdigit():
                found.append(int(digits))
        return sorted(found)

    def seqs(self, session: str) -> list[int]:
        """Sequence numbers of the complete checkpoints of ``session``, oldest first."""
        folder = self._folder(session)
        if not folder.is_dir():
            return []
        return sorted(set(self._numbers(folder, "seq")) | set(self._numbers(folder, "pin")))

    def _stem(self, session: str, seq: int) -> Path:
        folder = self._folder(session)
        for kind in ("seq", "pin"):
            if (folder / f"{kind}-{seq:012d}.json").exists():
                return folder / f"{kind}-{seq:012d}"
        raise CheckpointError(f"session {session} has no checkpoint at request {seq}")

    def load(self, session: str, seq: int) -> tuple[Any, dict[str, Any]]:
        return read_checkpoint(self._stem(session, seq))

    def meta(self, session: str, seq: int) -> dict[str, Any]:
        """A checkpoint's meta alone (its resume token, say), without reading its tensors."""
        return read_meta(self._stem(session, seq))

    def stored_nbytes(self, session: str, seq: int) -> int:
        """What loading a checkpoint reads (its files' sizes), without reading it."""
        return _stem_nbytes(self._stem(session, seq))


_TEMPORARY = re.compile(r"\..+?\.(\d+)(\.\d+)?(\.safetensors)?\.tmp")


def _remove_dead_writers_files(folder: Path) -> None:
    """Temporary files of writers that died mid-write (a crash): nobody will finish them. Called
    before this process writes any (a restarted cloud in a container often gets its old pid)."""
    for path in folder.glob(".*.tmp"):
        found = _TEMPORARY.fullmatch(path.name)
        if found is not None and (int(found.group(1)) == os.getpid() or not _alive(int(found.group(1)))):
            path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # it exists, but is not ours to signal
        return True
    return True


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _stem_nbytes(stem: Path) -> int:
    """The bytes of one checkpoint: its JSON and the tensor files next to it."""
    total = 0
    for path in [stem.with_name(stem.name + ".json"), *stem.parent.glob(f"{stem.name}-*.safetensors")]:
        try:
            total += path.stat().st_size
        except OSError:
            pass
    return total


def _folder_nbytes(folder: Path) -> int:
    total = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except OSError:  # removed meanwhile
                pass
    return total


__all__ = ["CheckpointStore", "PIN_SECONDS", "PIN_SHARE", "Pin"]
