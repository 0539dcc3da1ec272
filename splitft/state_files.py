"""Checkpoints with no code in them: tensors in a safetensors file, everything else in JSON.

A checkpoint is two files: ``<stem>.json`` and ``<stem>-<hash>.safetensors``. Each is written to
a temporary name, flushed, and moved into place with ``os.replace``; the JSON goes last and names
its tensor file with its size and SHA-256. So a checkpoint exists exactly when its JSON does,
overwriting one is atomic too (the old JSON keeps naming the old tensor file until the new JSON
replaces it), and a reader can tell a torn or altered tensor file from a good one. Neither file is
ever unpickled: loading one cannot run code, which is why it is safe to keep checkpoints next to
data that came over the network.

The tensor file is written from the tensors' own memory (host tensors are not copied; the caller
keeps them unchanged until :func:`write_checkpoint` returns) and hashed as it is read back in
chunks, and a reader hashes the file the same way before safetensors maps it: a checkpoint costs
about its own size in memory once, however large it is.

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
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from .wire import tree as trees
from .errors import CheckpointError
from .wire.tree import KeyPath

log = logging.getLogger(__name__)

FORMAT = "splitft-checkpoint"
FORMAT_VERSION = 1

_TENSOR, _ARRAY, _TUPLE, _ITEMS = "$tensor", "$ndarray", "$tuple", "$items"


# ---------------------------------------------------------------- trees of tensors and plain values



def _sha256(f: Any) -> str:
    """The SHA-256 of an open binary file, read in chunks (``hashlib.file_digest`` is Python 3.11+)."""
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()

def flatten_state(tree: Any) -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``tree`` into named host tensors and a JSON-able skeleton that refers to them.

    The tensors are the tree's own where they can be (a contiguous host tensor, a writable
    array): what is flattened must not change until it is written. A tensor that shares its
    storage with one before it (tied weights, which safetensors refuses) is copied.
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def own(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach().cpu().contiguous()
        storage = tensor.untyped_storage().data_ptr()
        if storage in storages and tensor.numel():
            tensor = tensor.clone()
        storages.add(tensor.untyped_storage().data_ptr())
        return tensor

    def store(node: torch.Tensor | np.ndarray, path: KeyPath) -> dict[str, str]:
        name = base = "/".join(str(key) for key in path) or "_"
        n = 1
        while name in tensors:
            n += 1
            name = f"{base}#{n}"
        if isinstance(node, torch.Tensor):
            tensors[name] = own(node)
            return {_TENSOR: name}
        array = np.ascontiguousarray(node)
        tensors[name] = own(torch.from_numpy(array if array.flags.writeable else array.copy()))
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


def state_nbytes(tree: Any) -> int:
    """The bytes of the tensors and arrays in ``tree``: what a checkpoint of it writes, about."""
    leaves = trees.leaves(tree, is_leaf=lambda node: isinstance(node, (torch.Tensor, np.ndarray)))
    return sum(leaf.numel() * leaf.element_size() if isinstance(leaf, torch.Tensor) else int(leaf.nbytes)
               for leaf in leaves)


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


def _write_tensors(stem: Path, tensors: dict[str, torch.Tensor], fsync: bool) -> tuple[Path, int, str]:
    """The tensor file, written straight from the tensors' memory under a temporary name, then
    moved to its name with its hash in it; returns (path, bytes, SHA-256)."""
    tmp = stem.with_name(f".{stem.name}.{os.getpid()}.{threading.get_ident()}.safetensors.tmp")
    try:
        try:
            save_file(tensors, tmp)
        except (TypeError, ValueError, RuntimeError) as exc:  # what safetensors raises for what it cannot store
            raise CheckpointError(f"cannot serialise the checkpoint tensors: {exc}") from exc
        with open(tmp, "rb") as f:
            digest = _sha256(f)
            if fsync:
                os.fsync(f.fileno())
        path = stem.with_name(f"{stem.name}-{digest[:12]}.safetensors")
        os.replace(tmp, path)
        return path, path.stat().st_size, digest
    except OSError as exc:
        raise CheckpointError(f"cannot write checkpoint tensors for {stem}: {exc}") from exc
    finally:
        tmp.unlink(missing_ok=True)


def write_checkpoint(stem: str | os.PathLike, tree: Any, meta: dict[str, Any], *, fsync: bool = True) -> Path:
    """Write ``tree`` (tensors and plain values) and ``meta`` (plain values) atomically.

    The tree's host tensors are written from their own memory: nothing may change them until
    this returns. Returns the JSON path, whose existence marks the checkpoint as complete.
    """
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    tensors, skeleton = flatten_state(tree)
    json_path = stem.with_name(stem.name + ".json")
    document: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION, "written": time.time(), "tensors": None,
                                "meta": meta, "state": skeleton}
    try:
        json.dumps(document, allow_nan=True)  # refused before any file is written
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"checkpoint metadata is not plain JSON: {exc}") from exc
    tensor_path, size, digest = _write_tensors(stem, tensors, fsync)
    document["tensors"] = {"file": tensor_path.name, "bytes": size, "sha256": digest}
    text = json.dumps(document, allow_nan=True).encode()
    try:
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
    if tensor_path.parent != json_path.parent or not tensor_path.name:
        raise CheckpointError(f"{json_path} names a tensor file outside its folder")
    try:
        with open(tensor_path, "rb") as f:
            size, digest = os.fstat(f.fileno()).st_size, _sha256(f)
    except OSError as exc:
        raise CheckpointError(f"cannot read {tensor_path}: {exc}") from exc
    if size != info.get("bytes") or digest != info.get("sha256"):
        raise CheckpointError(f"{tensor_path} does not match the size/SHA-256 its JSON records (damaged?)")
    try:
        tensors = load_file(tensor_path)
    except Exception as exc:
        raise CheckpointError(f"{tensor_path} is not a valid safetensors file: {exc}") from exc
    return unflatten_state(document.get("state"), tensors), document.get("meta") or {}


__all__ = ["flatten_state", "read_checkpoint", "read_meta", "remove_checkpoint", "state_nbytes", "unflatten_state",
           "write_checkpoint"]
