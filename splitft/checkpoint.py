"""Checkpoints with no code in them: tensors in a safetensors file, everything else in JSON.

A checkpoint is two files: ``<stem>.json`` and ``<stem>-<hash>.safetensors``. Each is written to
a temporary name, flushed, and moved into place with ``os.replace``; the JSON goes last and names
its tensor file with its size and SHA-256. So a checkpoint exists exactly when its JSON does,
overwriting one is atomic too (the old JSON keeps naming the old tensor file until the new JSON
replaces it), and a reader can tell a torn or altered tensor file from a good one. Neither file is
ever unpickled: loading one cannot run code, which is why it is safe to keep checkpoints next to
data that came over the network.

State that mixes tensors and plain values (an optimizer's ``state_dict()``, codec state, RNG
state) is flattened by :func:`flatten_state`: every tensor or numpy array goes into the tensor
file under its path (``optimizer/state/0/exp_avg``), and the JSON keeps the tree with a marker in
its place. Dicts with non-string keys (optimizer state is keyed by parameter index) and tuples
keep their types through tagged JSON forms.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as load_tensors
from safetensors.torch import save as save_tensors

from . import tree as trees
from .errors import CheckpointError
from .tree import KeyPath

log = logging.getLogger(__name__)

FORMAT = "splitft-checkpoint"
FORMAT_VERSION = 1

_TENSOR, _ARRAY, _TUPLE, _ITEMS = "$tensor", "$ndarray", "$tuple", "$items"


# ---------------------------------------------------------------- trees of tensors and plain values


def flatten_state(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``tree`` into named tensors and a JSON-able skeleton that refers to them."""
    tensors: dict[str, torch.Tensor] = {}

    def store(node: torch.Tensor | np.ndarray, path: KeyPath) -> dict[str, str]:
        name = base = "/".join(str(key) for key in path) or "_"
        n = 1
        while name in tensors:
            n += 1
            name = f"{base}#{n}"
        if isinstance(node, torch.Tensor):
            # A copy of our own: safetensors refuses tensors that share storage (tied weights),
            # and the live tensor may change while the file is being written.
            tensors[name] = node.detach().cpu().contiguous().clone()
            return {_TENSOR: name}
        tensors[name] = torch.from_numpy(np.ascontiguousarray(node).copy())
        return {_ARRAY: name}

    def scalar(node: Any, path: KeyPath) -> Any:
        if isinstance(node, (np.integer, np.floating, np.bool_)):
            return node.item()
        raise CheckpointError(f"cannot store a {type(node).__name__} at {'/'.join(map(str, path))!r} in a "
                              "checkpoint (only tensors, arrays, numbers, strings, lists, tuples and dicts)")

    skeleton = trees.rebuild(tree, store, is_leaf=lambda node: isinstance(node, (torch.Tensor, np.ndarray)),
                             other=scalar, pack=_to_json)
    return tensors, skeleton


def _to_json(original: Any, rebuilt: Any, path: KeyPath) -> Any:
    """JSON forms for what JSON lacks: tuples, and dicts whose keys are not plain strings."""
    if isinstance(rebuilt, tuple):
        return {_TUPLE: list(rebuilt)}
    if isinstance(rebuilt, dict) and not all(isinstance(k, str) and not k.startswith("$") for k in rebuilt):
        for k in rebuilt:
            if not isinstance(k, (str, int)) or isinstance(k, bool):
                raise CheckpointError(f"cannot store a dict key of type {type(k).__name__} at "
                                      f"{'/'.join(map(str, path))!r} in a checkpoint")
        return {_ITEMS: [[k, v] for k, v in rebuilt.items()]}
    return rebuilt


def unflatten_state(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Inverse of :func:`flatten_state`."""
    def load(marker: dict, path: KeyPath) -> Any:
        if _TENSOR in marker:
            return _named(tensors, marker[_TENSOR])
        return _named(tensors, marker[_ARRAY]).numpy()

    return trees.rebuild(skeleton, load, is_leaf=_is_marker, other=lambda node, path: node, pack=_from_json)


def _is_marker(node: Any) -> bool:
    return isinstance(node, dict) and len(node) == 1 and (_TENSOR in node or _ARRAY in node)


def _from_json(original: Any, rebuilt: Any, path: KeyPath) -> Any:
    if isinstance(rebuilt, dict) and set(rebuilt) == {_TUPLE}:
        return tuple(rebuilt[_TUPLE])
    if isinstance(rebuilt, dict) and set(rebuilt) == {_ITEMS}:
        return {k: v for k, v in rebuilt[_ITEMS]}
    return rebuilt


def _named(tensors: dict[str, torch.Tensor], name: Any) -> torch.Tensor:
    if not isinstance(name, str) or name not in tensors:
        raise CheckpointError(f"the checkpoint's JSON refers to tensor {name!r}, which its tensor file lacks")
    return tensors[name]


# ---------------------------------------------------------------- one checkpoint: two files


def _write_atomic(path: Path, data: bytes, fsync: bool) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def write_checkpoint(stem: str | os.PathLike, tree: Any, meta: dict[str, Any], *, fsync: bool = True) -> Path:
    """Write ``tree`` (tensors and plain values) and ``meta`` (plain values) atomically.

    Returns the JSON path, whose existence marks the checkpoint as complete.
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    tensors, skeleton = flatten_state(tree)
    try:
        blob = save_tensors(tensors)
    except Exception as exc:  # safetensors raises several kinds; all mean "cannot serialise this"
        raise CheckpointError(f"cannot serialise the checkpoint tensors: {exc}") from exc
    digest = hashlib.sha256(blob).hexdigest()
    tensor_path = stem.with_name(f"{stem.name}-{digest[:12]}.safetensors")
    json_path = stem.with_name(stem.name + ".json")
    document = {
        "format": FORMAT, "version": FORMAT_VERSION, "written": time.time(),
        "tensors": {"file": tensor_path.name, "bytes": len(blob), "sha256": digest},
        "meta": meta, "state": skeleton,
    }
    try:
        text = json.dumps(document, allow_nan=True).encode()
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata is not plain JSON: {exc}") from exc
    try:
        _write_atomic(tensor_path, blob, fsync)
        _write_atomic(json_path, text, fsync)  # last: the commit marker
        if fsync:
            dir_fd = os.open(stem.parent, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint {json_path}: {exc}") from exc
    for old in _tensor_files(stem):
        if old != tensor_path:
            old.unlink(missing_ok=True)
    return json_path


def _tensor_files(stem: Path) -> list[Path]:
    pattern = re.compile(re.escape(stem.name) + r"-[0-9a-f]{12}\.safetensors")
    return [p for p in stem.parent.glob(f"{glob.escape(stem.name)}-*.safetensors") if pattern.fullmatch(p.name)]


def remove_checkpoint(stem: str | os.PathLike) -> None:
    """Delete a checkpoint: its JSON first, so it vanishes at once, then its tensor files."""
    stem = Path(stem)
    stem.with_name(stem.name + ".json").unlink(missing_ok=True)
    for path in _tensor_files(stem):
        path.unlink(missing_ok=True)


def _json_path(stem_or_json: str | os.PathLike) -> Path:
    path = Path(stem_or_json)
    return path if path.suffix == ".json" else path.with_name(path.name + ".json")


def _read_document(json_path: Path) -> dict[str, Any]:
    try:
        document = json.loads(json_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"no checkpoint at {json_path}") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{json_path} is not a readable checkpoint: {exc}") from exc
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise CheckpointError(f"{json_path} is not a splitft checkpoint")
    return document


def read_meta(stem_or_json: str | os.PathLike) -> dict[str, Any]:
    """The ``meta`` of a checkpoint alone, without reading its tensors (to check a token first)."""
    return _read_document(_json_path(stem_or_json)).get("meta") or {}


def read_checkpoint(stem_or_json: str | os.PathLike) -> tuple[Any, dict[str, Any]]:
    """``(tree, meta)`` of a checkpoint written by :func:`write_checkpoint`, verified."""
    json_path = _json_path(stem_or_json)
    document = _read_document(json_path)
    if document.get("version") != FORMAT_VERSION:
        raise CheckpointError(f"{json_path} has format version {document.get('version')!r}; this splitft "
                              f"reads version {FORMAT_VERSION}")
    info = document.get("tensors") or {}
    tensor_path = json_path.with_name(str(info.get("file", "")))
    if tensor_path.parent != json_path.parent:
        raise CheckpointError(f"{json_path} names a tensor file outside its folder")
    try:
        blob = tensor_path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {tensor_path}: {exc}") from exc
    if len(blob) != info.get("bytes") or hashlib.sha256(blob).hexdigest() != info.get("sha256"):
        raise CheckpointError(f"{tensor_path} does not match the size/SHA-256 its JSON records (damaged?)")
    try:
        tensors = load_tensors(blob)
    except Exception as exc:
        raise CheckpointError(f"{tensor_path} is not a valid safetensors file: {exc}") from exc
    return unflatten_state(document.get("state"), tensors), document.get("meta") or {}


# ---------------------------------------------------------------- a folder of checkpoints per session

_SESSION = re.compile(r"[0-9a-f]{16}")


class CheckpointStore:
    """Checkpoints of many sessions: ``ROOT/<session>/seq-<n>.json`` (+ tensor file) each.

    Checkpoints are named by the last request sequence number they include, which is what a
    resuming edge asks for. The newest ``keep`` regular checkpoints of a session are kept, plus
    its newest *pinned* one (``pin-<n>``: written because the edge saved its own checkpoint, so
    an edge restarted from that file finds the matching cloud half however long ago it was).

    The folder is bounded: :meth:`remove` deletes a session's regular checkpoints when it ends
    (its pinned one stays for the edge that saved it), and a save that would take the whole
    folder over ``max_bytes`` is refused.
    """

    def __init__(self, root: str | os.PathLike, *, keep: int = 2, fsync: bool = True,
                 max_bytes: int | None = None) -> None:
        if keep < 1:
            raise CheckpointError(f"keep must be at least 1, got {keep}")
        self.root = Path(root)
        self.keep = keep
        self.fsync = fsync
        self.max_bytes = max_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._sizes = {folder.name: _folder_nbytes(folder) for folder in self.root.iterdir()
                       if folder.is_dir() and _SESSION.fullmatch(folder.name)}

    def nbytes(self) -> int:
        """What the folder holds (kept up to date by this store's own saves and removals)."""
        return sum(self._sizes.values())

    def full(self) -> bool:
        return self.max_bytes is not None and self.nbytes() >= self.max_bytes

    def remove(self, session: str, *, keep_pinned: bool = True) -> None:
        """Delete ``session``'s checkpoints (all but its pinned one, unless ``keep_pinned`` is off)."""
        folder = self._folder(session)
        if not folder.is_dir():
            return
        for kind in ("seq",) + (() if keep_pinned else ("pin",)):
            for number in self._numbers(folder, kind):
                remove_checkpoint(folder / f"{kind}-{number:012d}")
        try:
            folder.rmdir()  # only when nothing is left in it
        except OSError:
            pass
        self._update(session)

    def _update(self, session: str) -> None:
        folder = self.root / session
        if folder.is_dir():
            self._sizes[session] = _folder_nbytes(folder)
        else:
            self._sizes.pop(session, None)

    def _folder(self, session: str) -> Path:
        if not isinstance(session, str) or not _SESSION.fullmatch(session):
            raise CheckpointError(f"session ids are 16 hex digits, got {str(session)[:40]!r}")
        return self.root / session

    def save(self, session: str, seq: int, tree: Any, meta: dict[str, Any], *, pinned: bool = False) -> Path:
        folder = self._folder(session)
        kind = "pin" if pinned else "seq"
        if self.max_bytes is not None:
            tensors, _ = flatten_state(tree)
            need = sum(t.numel() * t.element_size() for t in tensors.values())
            if self.nbytes() + need > self.max_bytes:
                raise CheckpointError(f"the checkpoint folder holds {self.nbytes()} bytes; this checkpoint of "
                                      f"{need} more would pass its cap of {self.max_bytes} (--checkpoint-max-mb)")
        try:
            path = write_checkpoint(folder / f"{kind}-{seq:012d}", tree, meta, fsync=self.fsync)
            for old in self._numbers(folder, kind)[: -(1 if pinned else self.keep)]:
                remove_checkpoint(folder / f"{kind}-{old:012d}")
        finally:
            self._update(session)
        return path

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


def _folder_nbytes(folder: Path) -> int:
    total = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            try:
                total += entry.stat(follow_symlinks=False).st_size
            except OSError:  # removed meanwhile
                pass
    return total


__all__ = ["CheckpointStore", "flatten_state", "read_checkpoint", "read_meta", "remove_checkpoint", "unflatten_state",
           "write_checkpoint"]
