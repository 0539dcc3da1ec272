"""Edge checkpoints: both halves saved at one step boundary, and a split that continues from them.

The edge writes its half (weights, optimizer state, codec state) next to what it needs to resume
its session (the session id, its resume token, request and step numbers, and the handshake's
identity); at the same moment the cloud writes a pinned checkpoint of its half. ``split(...,
resume_from=PATH)`` checks that the model, cut, codecs and seed asked for are the ones saved,
and continues the same session.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from ..state_files import read_checkpoint, write_checkpoint
from ..errors import CheckpointError, ConfigError
from ..wire.protocol import Hello

if TYPE_CHECKING:
    from .model import SplitModel

# What a resumed session must agree on with the one it continues (the cloud checks the same).
IDENTITY = ("factory", "factory_kwargs", "cut", "rejoin", "fingerprint", "codecs", "seed")
_NEEDED = ("session", "token", "seq", "step", "optimizer_id", "hello")


def save(split: SplitModel, path: str | os.PathLike) -> None:
    """Checkpoint both halves at this step boundary (see :meth:`SplitModel.save_checkpoint`)."""
    session = split.session
    with session.lock:
        if session.checkpoint_every <= 0:
            raise CheckpointError("the cloud keeps no checkpoints, so this one could not be resumed; "
                                  "start the cloud with --checkpoint-dir")
        session.sync(pin=True)
        # The cloud's checkpoint holds the state after that sync's operations, numbered one below
        # it; a resumed edge continues from that number, re-using the sync's.
        optimizer = split.optimizer
        tree = {"weights": split.edge_state_dict(),
                "optimizer": optimizer.state_dict() if optimizer is not None else None,
                "codecs": session.codecs.state_dict()}
        assert session._hello is not None
        meta = {"kind": "edge", "session": session.session_id, "token": session.token, "seq": session._seq - 1,
                "step": session.step, "optimizer_id": session.optimizer_id,
                "hello": {k: getattr(session._hello, k) for k in IDENTITY}}
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


def load_edge_half(split: SplitModel, tree: dict, path: str | os.PathLike | None) -> None:
    """Put the saved edge weights back, and keep the optimizer state for :meth:`SplitModel.attach`."""
    try:
        split.load_state_dict(tree["weights"], strict=False)
        missing = split.edge_state_dict().keys() - tree["weights"].keys()
        if missing or tree["weights"].keys() - split.edge_state_dict().keys():
            raise RuntimeError(f"its edge weights do not match this model's (missing {sorted(missing)[:5]})")
    except RuntimeError as exc:
        split.session.close("error")
        raise CheckpointError(f"the edge checkpoint {path} does not fit this model: {exc}") from exc
    split._resume_optimizer = tree["optimizer"]


__all__ = ["IDENTITY", "check_identity", "load_edge_half", "read", "save"]
