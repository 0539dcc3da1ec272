"""A live session moving between two independent clouds (FedFly): its state leaves one, arrives at the other.

No folder is shared: the state travels through the edge, which holds the session's token.

- **Leaving** (``leave``, answered with a ``handoff``): the cloud holding the session answers with
  its snapshot, the same a checkpoint holds (:func:`.snapshots.snapshot`: the half's weights and
  gradients, the optimizer's state, the step count, the codecs' and generators' state), as arrays
  and a tree of plain values (no code), with a MAC over all of it keyed by the session's token.
  The session stays, unchanged, until the edge says goodbye once the other cloud has taken it: a
  handoff lost on the way is asked for again (the same request, answered anew while nothing came
  after it), and a session the other cloud refuses simply goes on here.
- **Arriving** (``arrive``: the session's hello, its resume filled in, and the handoff's state):
  the other cloud checks, before it builds anything, that the state's arrays are at most
  ``max_move_bytes`` (``--max-move-mb``) and the session memory budget, that the state is that
  session's (its meta names the hello's session and token, and the MAC, keyed by the token the
  hello presents, matches), that a live session here with that id, if any, has that token and no
  request under way, and that it has room for a session (admission, as for a hello); the hello
  itself is checked as any (version, model, codecs within policy). The session is then rebuilt
  like one restored from a checkpoint, as a priced job, and the edge welcomed at the request and
  step it left at. A session coming back to a cloud that still holds it (its goodbye was lost)
  replaces the copy left here.

Only what the edge could set anyway travels: the half is its own session's copy (a shared half
does not move), so a state that does not fit the model is a :class:`~splitft.errors.CheckpointError`,
a forged one a :class:`~splitft.errors.ResumeError`; nothing received is unpickled.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ..errors import CapacityError, CheckpointError, ProtocolError, ResumeError
from ..state_files import flatten_state, unflatten_state
from ..wire.protocol import Arrive, Handoff, Hello, Leave, Message
from ..wire.records import build_checked
from .blame import blame, short
from .build import hello_identity
from .costs import Pace, Price
from .jobs import Job
from .limits import mib
from .session import CloudSession
from .snapshots import Sessions, restore, snapshot

log = logging.getLogger(__name__)

_SESSION_ID = re.compile(r"[0-9a-f]{16}")
_NUMBERS = ("seq", "steps", "optimizer_id")


def mac(token: str, meta: dict, skeleton: Any, arrays: dict[str, np.ndarray]) -> str:
    """HMAC-SHA256, keyed by the session's token, over the meta, the skeleton and every array."""
    digest = hmac.new(token.encode(), json.dumps([meta, skeleton], sort_keys=True).encode(), hashlib.sha256)
    for name in sorted(arrays):
        array = arrays[name]
        digest.update(json.dumps([name, str(array.dtype), list(array.shape)]).encode())
        digest.update(np.ascontiguousarray(array).data)
    return digest.hexdigest()


def asked_again(msg: Message, last_seq: int) -> bool:
    """Whether ``msg`` repeats the session's last request and is a ``leave``: answered anew rather
    than from the reply cache, which may not have room for a whole state (nothing changed since)."""
    return isinstance(msg, Leave) and msg.seq == last_seq


def leave(session: CloudSession, msg: Leave) -> Job:
    """The session's state for the cloud it moves to, as a priced job (its hashing is linear in the
    state, so a large one runs on a worker); the session stays here until the edge's goodbye."""
    def work() -> Handoff:
        tree, meta = snapshot(session)
        meta["seq"] = msg.seq  # the new cloud goes on after this request
        tensors, skeleton = flatten_state(tree)
        arrays: dict[str, np.ndarray] = {}
        for name, tensor in tensors.items():
            if tensor.dtype == torch.bfloat16:
                raise CheckpointError(f"{name} is bfloat16, which cannot cross the wire; such a session cannot move")
            arrays[name] = tensor.numpy()
        meta, skeleton = json.loads(json.dumps(meta)), json.loads(json.dumps(skeleton))  # as the wire gives them
        return Handoff(state={"meta": meta, "skeleton": skeleton, "tensors": arrays,
                              "mac": mac(session.token, meta, skeleton, arrays)})

    def then(handoff: Handoff) -> Handoff:
        log.info("session %s handed over its state to move at request %d (step %d), %s; it stays here until the "
                 "edge says goodbye", session.id, msg.seq, handoff.state["meta"]["steps"],
                 mib(sum(a.nbytes for a in handoff.state["tensors"].values())))
        return handoff

    return Job(session.id, session.seat.origin, Price(checkpoint_bytes=session.held_bytes()), work=work, then=then,
               pace=Pace(), off_thread=session.half.shared is None)


def arrive(server: Sessions, peer: bytes, msg: Arrive, welcome: Callable[[Hello, CloudSession, str], Any]) -> Job:
    """The job that rebuilds and binds a session moving here (checked first), its result ``welcome``'s."""
    with blame(ProtocolError, "arrive.hello is not a hello"):
        hello = build_checked(Hello, dict(msg.hello), "arrive.hello")
    sid, token = _resume_of(hello)
    meta, skeleton, arrays = _state_of(msg.state, server.limits.max_move_bytes, server.limits.session_memory_bytes)
    given = msg.state.get("mac")
    if not (isinstance(given, str) and meta.get("session") == sid and isinstance(meta.get("token"), str)
            and hmac.compare_digest(meta["token"], token)
            and hmac.compare_digest(given, mac(token, meta, skeleton, arrays))):
        raise ResumeError(f"this state is not session {sid}'s: its token or MAC does not match the hello's token")
    if meta.get("hello") != json.loads(json.dumps(hello_identity(hello))):
        raise ResumeError(f"session {sid}'s state serves a different model, cut or codecs than this hello asks for")
    stale = server.by_id.get(sid)  # the session left here before and its goodbye was lost: the state is newer
    if stale is not None and (server.jobs.busy(sid) or not hmac.compare_digest(stale.token, token)):
        raise ResumeError(f"session {sid} is already live on this cloud; resume it with a hello instead")
    for key in _NUMBERS:
        if not (isinstance(meta.get(key), int) and not isinstance(meta[key], bool) and meta[key] >= 0):
            raise ProtocolError(f"the moved state's meta needs {key} as an int >= 0, got {short(meta.get(key))}")
    server.admit(peer)
    nbytes = sum(a.nbytes for a in arrays.values())

    def load() -> CloudSession:
        with blame(CheckpointError, f"session {sid}'s moved state does not fit its model"):
            tensors = {name: torch.from_numpy(np.array(a)) for name, a in arrays.items()}  # own, writable copies
            tree = unflatten_state(skeleton, tensors)
            if not isinstance(tree, dict):
                raise CheckpointError("the moved state is not a map")
            session = restore(hello, tree, meta, server.factories, server.limits, server.policy, server.placement)
            _check_optimizer_state(session)
        return session

    def bind(session: CloudSession) -> CloudSession:
        if stale is not None and server.by_id.get(sid) is stale:
            server.forget(stale, f"ended after {stale.mirrored.steps} steps: it moved away and came back")
        server.bind(peer, session)
        server.event(f"session {sid} moved here from another cloud at request {session.replies.last_seq} "
                     f"(step {session.mirrored.steps}, {mib(nbytes)} of state)")
        return welcome(hello, session, "moved here")

    return Job(sid, server.listener.origin(peer), Price(checkpoint_bytes=nbytes), work=load, then=bind,
                      pace=Pace())


def _resume_of(hello: Hello) -> tuple[str, str]:
    r = hello.resume
    sid, token = (r.get("session"), r.get("token")) if isinstance(r, dict) else (None, None)
    if not (isinstance(sid, str) and _SESSION_ID.fullmatch(sid) and isinstance(token, str) and token):
        raise ProtocolError("arrive.hello.resume needs the moving session's id (16 hex digits) and token")
    return sid, token


def _state_of(state: dict, max_bytes: int, session_bytes: int) -> tuple[dict, Any, dict[str, np.ndarray]]:
    """The state's meta, skeleton and arrays, its size refused before anything is built from it."""
    meta, skeleton, arrays = state.get("meta"), state.get("skeleton"), state.get("tensors")
    if not (isinstance(meta, dict) and isinstance(arrays, dict) and isinstance(skeleton, dict)
            and all(isinstance(k, str) and isinstance(a, np.ndarray) for k, a in arrays.items())):
        raise ProtocolError("a moved state is a map of meta (map), skeleton (map), tensors (name → array) and mac")
    nbytes = sum(a.nbytes for a in arrays.values())
    most = min(max_bytes, session_bytes)
    if nbytes > most:
        raise CapacityError(f"a moved session's state of {mib(nbytes)} arrived; this cloud takes at most {mib(most)} "
                            "(--max-move-mb, --session-memory-mb)")
    return meta, skeleton, arrays


def _check_optimizer_state(session: CloudSession) -> None:
    """Each optimizer state tensor the size of its parameter, so a forged one fails here, not mid-step."""
    optimizer = session.mirrored.own_optimizer
    if optimizer is None:
        return
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                raise CheckpointError(f"the moved optimizer state {key!r} has shape {list(value.shape)}, its "
                                      f"parameter {list(param.shape)}")


__all__ = ["arrive", "asked_again", "leave", "mac"]
