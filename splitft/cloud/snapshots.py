"""A session's checkpoints: what is written, how a session is rebuilt, and how an edge resumes.

With a checkpoint folder, a session writes a checkpoint when it opens and at every
``checkpoint_every``-th optimizer step, right after the step is applied. An edge that reconnects
(its hello carries a resume token, its last sequence number and the first one it can still
re-send) gets the newest state it can continue from, in memory or on disk, and re-sends the
requests after it. The token is checked on the checkpoint's small JSON before any tensor file is
read, so a forged resume costs the cloud no more than that; reading the tensors and rebuilding
the session is a priced job (:mod:`.jobs`), on a worker when it is large.

A checkpoint is written from the session's own tensors, without copies: the job that writes it
holds the session, so nothing changes them meanwhile. A *pinned* checkpoint (the edge saved its
own, and may come back to it after the session ended) counts against its origin's quota and
expires (:class:`~splitft.cloud.checkpoint_folder.CheckpointStore`); a pin the cloud cannot keep is refused
with a typed error, so the edge does not keep a checkpoint it could never resume.
"""

from __future__ import annotations

import hmac
import json
import logging
import re
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import torch
from torch import nn

import transports

from ..devices import Placement
from ..errors import CapacityError, CheckpointError, ProtocolError, ResumeError
from ..wire import operations as o
from ..wire.protocol import Hello
from .blame import blame, short
from .build import hello_identity
from .checkpoint_folder import CheckpointStore
from .codec_policy import Policy
from .costs import Pace, Price
from .handlers import attach_optimizer, set_flags, set_frozen, set_loss, set_modes
from .jobs import Job, Jobs
from .limits import Limits
from .session import CloudSession

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[0-9a-f]{16}")


class Sessions(Protocol):
    """What resuming a session needs of the server: where sessions and checkpoints are, what is
    busy, what a restored half is built with, and binding a session to the peer that asked."""

    @property
    def by_id(self) -> Mapping[str, CloudSession]: ...

    @property
    def checkpoints(self) -> CheckpointStore | None: ...

    @property
    def jobs(self) -> Jobs: ...

    @property
    def listener(self) -> transports.Listener: ...

    @property
    def factories(self) -> dict[str, Callable[..., nn.Module]]: ...

    @property
    def limits(self) -> Limits: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def placement(self) -> Placement: ...

    def admit(self, peer: bytes) -> None: ...

    def bind(self, peer: bytes, session: CloudSession) -> None: ...

    def forget(self, session: CloudSession, text: str, discard: bool = True) -> None: ...

    def unbind(self, session: CloudSession) -> None: ...

    def event(self, text: str) -> None: ...


def snapshot(session: CloudSession) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tree, meta)`` for a checkpoint: everything needed to continue from here exactly."""
    half, mirrored = session.half, session.mirrored
    if half.shared is not None:
        raise CheckpointError("sessions of a shared cloud part are not checkpointed")
    session.passes.flush()  # the gradients as the edge's last backward pass left them
    optimizer = mirrored.own_optimizer
    with torch.no_grad():
        tree = {
            "weights": half.chain.qualified_state_dict(),
            "grads": {n: p.grad for n, p in half.chain.named_parameters() if p.grad is not None},
            "optimizer": optimizer.state_dict() if optimizer is not None else None,
            "codecs": session.codecs.state_dict(),
            **session.random.state(),
        }
    spec = mirrored.optimizer_spec
    meta = {
        "kind": "cloud", "session": session.id, "token": session.token, "seq": session.replies.last_seq,
        "steps": mirrored.steps, "optimizer_id": mirrored.optimizer_id,
        "optimizer": ({"name": spec.name, "settings": spec.settings, "groups": spec.groups, "version": spec.version}
                      if spec is not None else None),
        "frozen": [n for n, p in half.chain.qualified_parameters().items() if not p.requires_grad],
        "flipped": [n for n, m in half.chain.qualified_modules().items() if any(m is f for f in mirrored.flipped)],
        "flags": mirrored.flags,
        "loss": o.to_wire(mirrored.loss_spec) if mirrored.loss_spec is not None else None,
        "hello": session.identity,
    }
    return tree, meta


def restore(hello: Hello, tree: dict[str, Any], meta: dict[str, Any], factories: dict[str, Callable[..., nn.Module]],
            limits: Limits | None = None, policy: Policy | None = None,
            placement: Placement | None = None) -> CloudSession:
    """The session a checkpoint describes, rebuilt from the factory and the stored state.

    Checkpoints hold host tensors, so one written by a cloud on a GPU resumes on a CPU and the
    other way round: everything is loaded onto ``placement``'s device.
    """
    session = CloudSession(hello, factories, limits, restoring=True, policy=policy, placement=placement,
                           known_as=(meta["session"], meta["token"]))
    session.replies.resumed_at(int(meta["seq"]))
    chain = session.half.chain
    with blame(CheckpointError, f"checkpoint of session {session.id} does not fit its model"):
        chain.load_qualified_state_dict(tree["weights"])
        params = dict(chain.named_parameters())
        for name, grad in tree["grads"].items():
            params[name].grad = grad.to(device=params[name].device, dtype=params[name].dtype, copy=True)
        if meta.get("loss"):
            loss = o.from_wire(meta["loss"])
            if not isinstance(loss, o.SetLoss):
                raise CheckpointError(f"checkpoint of session {session.id} names a loss that is not one")
            set_loss(session, loss)
        set_frozen(session, o.SetFrozen(names=list(meta.get("frozen", []))))
        set_modes(session, o.SetModes(names=list(meta.get("flipped", []))))
        if meta.get("flags"):
            set_flags(session, o.SetFlags(flags=meta["flags"]))
        if meta.get("optimizer"):
            spec = meta["optimizer"]
            attach_optimizer(session, o.AttachOptimizer(name=spec["name"], settings=spec["settings"],
                                                        groups=spec.get("groups"), version=spec.get("version")))
            if session.mirrored.own_optimizer is not None:
                session.mirrored.own_optimizer.load_state_dict(tree["optimizer"])
        session.mirrored.restored(int(meta["steps"]), int(meta.get("optimizer_id", 0)))
        session.codecs.load_state_dict(tree["codecs"])
        session.random.load(tree)
    return session


def save(store: CheckpointStore | None, session: CloudSession, seq: int, pinned: bool = False) -> CapacityError | None:
    """Checkpoint ``session`` as of request ``seq`` into ``store`` (None: the cloud keeps none). A
    failure is logged and training goes on; a pinned checkpoint the edge asked for and cannot have
    is returned, as the error to send it."""
    if store is None:
        return None
    tree, meta = snapshot(session)
    meta["seq"] = seq
    try:
        store.save(session.id, seq, tree, meta, pinned=pinned, origin=session.seat.origin)
    except CapacityError as exc:
        if pinned:
            return exc
        log.error("session %s: checkpoint at request %d refused: %s", session.id, seq, exc)
    except CheckpointError as exc:
        # Training goes on; an edge that later needs this checkpoint is told exactly what is missing.
        log.error("session %s: checkpoint at request %d failed: %s", session.id, seq, exc)
        if pinned:
            return CapacityError(f"the cloud could not keep this checkpoint: {exc}")
    return None


def _resume_request(msg: Hello) -> tuple[str, str, int, int, int]:
    r = msg.resume
    if not isinstance(r, dict):
        raise ProtocolError("hello.resume must be a map")
    sid, token = r.get("session"), r.get("token")
    values = [r.get(k) for k in ("step", "seq", "log_from")]
    numbers = [n for n in values if isinstance(n, int) and not isinstance(n, bool) and n >= 0]
    if not (isinstance(sid, str) and _SESSION_ID.fullmatch(sid) and isinstance(token, str) and len(numbers) == 3):
        raise ProtocolError("hello.resume needs session (16 hex digits), token, and step, seq, log_from "
                            f"(ints >= 0); got {short(r)}")
    step, seq, log_from = numbers
    return sid, token, step, seq, log_from


def waits_for(server: Sessions, msg: Hello) -> str | None:
    """The live session a resuming hello names, with its token, when that session is busy with a
    request: the hello then waits for it, and resumes the session as that request left it."""
    r = msg.resume
    sid, token = (r.get("session"), r.get("token")) if isinstance(r, dict) else (None, None)
    live = server.by_id.get(sid) if isinstance(sid, str) else None
    if live is None or not isinstance(token, str) or not server.jobs.busy(live.id):
        return None
    return live.id if hmac.compare_digest(live.token, token) else None


def resume(server: Sessions, peer: bytes, msg: Hello) -> CloudSession | Job:
    """The session a resuming hello asks for: the live one, or a job that rebuilds it from a
    checkpoint and binds it (its result is the session)."""
    sid, token, step, seq, log_from = _resume_request(msg)
    identity = hello_identity(msg)
    live = server.by_id.get(sid)
    if live is not None:
        if not hmac.compare_digest(live.token, token):
            raise ResumeError(f"wrong resume token for session {sid}")
        if live.identity != identity:
            raise ResumeError(f"session {sid} serves a different model, cut or codecs than this hello asks for")
        # The edge can re-send every request after the live session's last one and is not behind it.
        if log_from - 1 <= live.replies.last_seq <= seq:
            server.bind(peer, live)
            return live
    store, at = _checkpoint_to_resume(server, sid, token, identity, live, (step, seq, log_from))
    if live is None:
        server.admit(peer)

    def load() -> CloudSession:
        tree, meta = store.load(sid, at)
        return restore(msg, tree, meta, server.factories, server.limits, server.policy, server.placement)

    def bind(session: CloudSession) -> CloudSession:
        if live is not None and server.by_id.get(sid) is live:
            server.unbind(live)
        server.bind(peer, session)
        server.event(f"session {sid} restored from its checkpoint at request {session.replies.last_seq} "
                     f"(step {session.mirrored.steps})")
        return session

    return Job(sid, server.listener.origin(peer), Price(checkpoint_bytes=store.stored_nbytes(sid, at)),
               work=load, then=bind, pace=Pace())


def _checkpoint_to_resume(server: Sessions, sid: str, token: str, identity: dict[str, Any],
                          live: CloudSession | None, numbers: tuple[int, int, int]) -> tuple[CheckpointStore, int]:
    """The store and request number of the newest checkpoint the edge can continue from, its token
    and identity checked on its small JSON before any tensor file is read."""
    step, seq, log_from = numbers
    store = server.checkpoints
    stored = store.seqs(sid) if store is not None else []
    usable = [s for s in stored if log_from - 1 <= s <= seq]  # the newest the edge can continue from
    if store is None or not usable:
        have = [f"in memory at request {live.replies.last_seq}"] if live is not None else []
        have += [f"a checkpoint at request {s}" for s in stored]
        raise ResumeError(
            f"cannot resume session {sid}: the edge is at request {seq} (step {step}) and can re-send from "
            f"request {log_from}, but this cloud has {', '.join(have) or 'nothing of it'}"
            + ("" if store is not None else " (start the cloud with --checkpoint-dir)")
            + "; start a new session, or restart the edge from a checkpoint the cloud also has"
        )
    meta = store.meta(sid, usable[-1])
    if not hmac.compare_digest(str(meta.get("token", "")), token):
        raise ResumeError(f"wrong resume token for session {sid}")
    if meta.get("hello") != json.loads(json.dumps(identity)):
        raise ResumeError(f"session {sid} serves a different model, cut or codecs than this hello asks for")
    if server.jobs.busy(sid):
        raise CapacityError(f"session {sid} is busy with a request or being restored "
                            f"({server.jobs.since(sid):.1f} s so far); try again when it is done")
    return store, usable[-1]


__all__ = ["Sessions", "restore", "resume", "save", "snapshot", "waits_for"]
