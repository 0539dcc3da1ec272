"""Edge checkpoints: both halves saved at one step boundary, and a split that continues from them.

The edge writes its half (weights, optimizer state, codec state) next to what it needs to resume
its session (the session id, its resume token, request and step numbers, and the handshake's
identity); at the same moment the cloud writes a pinned checkpoint of its half. ``split(...,
resume_from=PATH)`` checks that the model, cut, codecs and seed asked for are the ones saved,
and continues the same session.

Each piece comes from the room that owns it, seen through the small protocols below: the session
(:class:`Session`), the stage's codecs and step count (:class:`Coding`), the mirror's optimizer
(:class:`Attached`) and the split model's edge half (:class:`EdgeHalf`).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..errors import CheckpointError, ConfigError
from ..options import Codecs
from ..state_files import read_checkpoint, write_checkpoint
from ..wire.coding import SlotCodecs
from ..wire.protocol import Hello

# What a resumed session must agree on with the one it continues (the cloud checks the same).
IDENTITY = ("factory", "factory_kwargs", "cut", "rejoin", "fingerprint", "codecs", "seed")
_NEEDED = ("session", "token", "seq", "step", "optimizer_id", "hello")
#: The directions a hello names a codec for, the forward one first.
_DIRECTIONS = ("fwd", "bwd", "ret", "ret_bwd")


@dataclass(frozen=True)
class ResumePoint:
    """Where an edge checkpoint left its session: its id, the token that resumes it, the number of
    the last request it sent and the optimizer step it had taken."""

    session: str
    token: str
    seq: int
    step: int


class Session(Protocol):
    """The session being checkpointed (:class:`~splitft.edge.requests.EdgeSession`)."""

    session_id: str | None
    token: str
    checkpoint_every: int

    @property
    def lock(self) -> threading.RLock: ...
    @property
    def hello(self) -> Hello | None: ...
    @property
    def last_seq(self) -> int: ...
    def sync(self, want_state: bool = False, checkpoint: bool = False, pin: bool = False) -> Any: ...
    def close(self, reason: str = "done") -> None: ...


class Coding(Protocol):
    """The codecs' state and the step count (:class:`~splitft.edge.stage.CloudStage`)."""

    codecs: SlotCodecs
    step: int


class Attached(Protocol):
    """The optimizer the cloud mirrors, and how many were attached (:class:`~splitft.edge.mirror.ModelMirror`)."""

    optimizer: torch.optim.Optimizer | None
    optimizer_id: int

    def follow_optimizer_state(self) -> None: ...
    def edge_optimizer_state(self) -> dict | None: ...


class EdgeHalf(Protocol):
    """The split model's own weights (:class:`~splitft.edge.model.SplitModel`)."""

    def edge_state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any: ...


def save(path: str | os.PathLike, session: Session, coding: Coding, attached: Attached,
         edge_state: Callable[[], dict[str, Any]], cloud_grads: Callable[[], list[str]]) -> None:
    """Checkpoint both halves at this step boundary (see :meth:`SplitModel.save_checkpoint`);
    ``cloud_grads`` names the cloud parameters that have a gradient now, which the cloud's
    checkpoint keeps: the resumed edge must know of them, or its next ``zero_grad`` clears none."""
    with session.lock:
        if session.checkpoint_every <= 0:
            raise CheckpointError("the cloud keeps no checkpoints, so this one could not be resumed; "
                                  "start the cloud with --checkpoint-dir")
        attached.follow_optimizer_state()  # a reset of its state rides on the sync, into the checkpoint
        session.sync(pin=True)
        # The cloud's checkpoint holds the state after that sync's operations, numbered one below
        # it; a resumed edge continues from that number, re-using the sync's.
        tree = {"weights": edge_state(), "optimizer": attached.edge_optimizer_state(),
                "codecs": coding.codecs.state_dict()}
        hello = session.hello
        assert hello is not None
        meta = {"kind": "edge", "session": session.session_id, "token": session.token, "seq": session.last_seq - 1,
                "step": coding.step, "optimizer_id": attached.optimizer_id, "cloud_grads": cloud_grads(),
                "hello": {k: getattr(hello, k) for k in IDENTITY}}
        write_checkpoint(path, tree, meta)


def read(path: str | os.PathLike) -> tuple[dict, dict]:
    """``(tree, meta)`` of an edge checkpoint; anything else is a CheckpointError."""
    tree, meta = read_checkpoint(path)
    if meta.get("kind") != "edge" or any(k not in meta for k in _NEEDED):
        raise CheckpointError(f"{path} is not an edge checkpoint (write one with model.save_checkpoint(path))")
    return tree, meta


def check_identity(hello: Hello, meta: dict[str, Any], path: str | os.PathLike | None) -> None:
    """Refuse to continue a session saved for another model, cut, codecs or seed."""
    identity = {k: getattr(hello, k) for k in meta["hello"]}
    if meta["hello"] != json.loads(json.dumps(identity)):
        raise ConfigError(f"the edge checkpoint {path} was written for a different model, cut, codecs or "
                          "seed than this split() asks for")


def saved_codecs(codecs: Codecs, meta: dict[str, Any]) -> Codecs:
    """``Codecs("auto")`` resumed: the directions it leaves open take the codecs the checkpoint was
    written with, not a new measurement of the link, which may choose others and so diverge from
    the run that was interrupted (named directions are kept and checked like any others)."""
    saved = meta["hello"].get("codecs")
    if not isinstance(saved, dict) or any(not isinstance(saved.get(k), str) for k in _DIRECTIONS):
        raise CheckpointError("the edge checkpoint does not name its codecs; name them (--fwd/--bwd)")
    return replace(codecs, fwd=saved["fwd"], **{k: saved[k] if getattr(codecs, k) is None else getattr(codecs, k)
                                                 for k in _DIRECTIONS[1:]})


def saved_cloud_grads(meta: dict[str, Any], names: Iterable[str]) -> set[str]:
    """Which of the cloud parameters ``names`` had a gradient when the checkpoint was written."""
    saved = meta.get("cloud_grads", [])
    return set(names).intersection(saved if isinstance(saved, list) else [])


def resume_point(meta: dict[str, Any]) -> ResumePoint:
    """Where the checkpoint's session goes on from."""
    return ResumePoint(meta["session"], meta["token"], meta["seq"], meta["step"])


def restore_coding(coding: Coding, tree: dict, meta: dict[str, Any]) -> None:
    """The codecs' state and the step count as they were saved (before the session resumes)."""
    coding.codecs.load_state_dict(tree["codecs"])
    coding.step = meta["step"]


def load_edge_half(split: EdgeHalf, session: Session, tree: dict, path: str | os.PathLike | None) -> None:
    """Put the saved edge weights back; a checkpoint of another model ends ``session``."""
    try:
        split.load_state_dict(tree["weights"], strict=False)
        missing = split.edge_state_dict().keys() - tree["weights"].keys()
        if missing or tree["weights"].keys() - split.edge_state_dict().keys():
            raise RuntimeError(f"its edge weights do not match this model's (missing {sorted(missing)[:5]})")
    except RuntimeError as exc:
        session.close("error")
        raise CheckpointError(f"the edge checkpoint {path} does not fit this model: {exc}") from exc


__all__ = ["IDENTITY", "ResumePoint", "check_identity", "load_edge_half", "read", "restore_coding", "resume_point",
           "save", "saved_cloud_grads"]
