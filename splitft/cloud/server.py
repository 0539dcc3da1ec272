"""The cloud server: sockets, the session registry, admission, and one answer per message.

The server loop never lets one edge's message stop it: every failure becomes a typed Error reply
and the loop goes on. Nor does one edge's heavy request hold it up: each request is priced before
its work starts (:mod:`~splitft.cloud.prices`), and work expected to take more than a slice,
checkpoints included, runs on a worker thread while the loop serves everyone else
(:mod:`~splitft.cloud.jobs`). Admission is where the cloud's policy and budgets meet a new session
(how many sessions, how many per origin, the codecs and options asked for, the model's memory,
room in the checkpoint folder); when the cloud is full, :mod:`~splitft.cloud.admission` decides
whom to evict. Sessions that hear nothing for ``Limits.session_timeout`` (or, before they trained,
``handshake_timeout``) are freed.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from typing import Any

import compressors
import transports

from ..devices import Placement
from ..errors import CapacityError, ConfigError, ProtocolError, SessionLost, SplitFTError
from ..factories import load_factory
from ..state_files import CheckpointError
from ..wire import protocol
from ..wire.protocol import (Ack, Arrive, Backward, Bye, Error, Forward, Hello, Leave, Ping, Pong, Probe, Probed,
                             Sync, Welcome)
from . import moves, prices, probes, snapshots, work
from .admission import Admission
from .blame import ErrorLog, error_reply
from .budget import MemoryBook
from .build import build_chain, check_codecs
from .checkpoint_folder import CheckpointStore
from .codec_policy import Policy
from .costs import Price, start_warm_up
from .dispatch import answer_table, answers, traffic_kind
from .half import SharedPart, SharedParts
from .jobs import LATER, Job, Jobs
from .limits import Limits
from .prices import state_nbytes
from .session import CloudSession
from .shared_policy import SharedPolicy

log = logging.getLogger(__name__)

#: Seconds between looks for checkpoints no session can use (expired pins, abandoned sessions).
TIDY_EVERY = 2.0

class CloudServer:
    """Serves cloud parts to edges over a :class:`transports.Listener`.

    Args:
        listener: where edges connect (``transports.listen("tcp://0.0.0.0:5555")``).
        factories: the model factories edges may ask for (``"package.module:function"``).
        max_sessions: stop after this many sessions have ended (0: serve until stopped).
        limits: bounds on messages, sessions and what each keeps (:class:`Limits`).
        checkpoint_dir: write checkpoints of every session there, so edges can resume after the
            cloud restarts (None: sessions survive only in memory).
        checkpoint_every: checkpoint at every N-th optimizer step (1: at every step, so a
            restart loses nothing; larger is cheaper and makes edges keep N steps to replay).
        keep_checkpoints: checkpoints kept per session.
        fsync: flush each checkpoint to disk (survives power loss, not only process death).
        shared_model: sessions asking for the same model and cut train one shared cloud part.
        shared_policy: its optimizer and frozen parameters, the cloud's choice
            (:class:`~splitft.cloud.shared_policy.SharedPolicy`; default: no optimizer, none frozen).
        policy: which codecs and codec options edges may ask for (:class:`Policy`).
        placement: the device (and dtype) every cloud half computes in (:class:`Placement`; default: the CPU).
        rounds: train shared halves in synchronous data-parallel rounds
            (:class:`~splitft.cloud.rounds.Rounds`; default: steps in arrival order).
        make_session: builds each new session, with :class:`CloudSession`'s arguments (default:
            :class:`CloudSession`; :mod:`.batch_split` gives sessions whose batches span ranks).
    """

    def __init__(self, listener: transports.Listener, factories: Iterable[str], *, max_sessions: int = 0,
                 on_event: Callable[[str], None] | None = None, limits: Limits | None = None,
                 checkpoint_dir: str | None = None, checkpoint_every: int = 1, keep_checkpoints: int = 2,
                 fsync: bool = True, shared_model: bool = False, policy: Policy | None = None,
                 placement: Placement | None = None, rounds: Any = None,
                 make_session: Callable[..., CloudSession] = CloudSession,
                 shared_policy: SharedPolicy | None = None) -> None:
        self.listener = listener
        self.factories = {name: load_factory(name) for name in factories}
        self.max_sessions = max_sessions
        self.limits = limits or Limits()
        if checkpoint_every < 1:
            raise ConfigError(f"checkpoint_every must be at least 1, got {checkpoint_every}")
        if shared_model and checkpoint_dir is not None:
            raise ConfigError("checkpoints restore one edge's session exactly; with a shared cloud part they "
                              "cannot (other edges move it on). Use one of shared_model / checkpoint_dir")
        self.checkpoints = CheckpointStore(checkpoint_dir, keep=keep_checkpoints, fsync=fsync,
                                           max_bytes=self.limits.checkpoint_bytes,
                                           pin_bytes=self.limits.pin_bytes, pin_seconds=self.limits.pin_seconds,
                                           orphan_seconds=self.limits.session_timeout) \
            if checkpoint_dir is not None else None
        self.jobs = Jobs(wake=listener.wake if getattr(listener, "supports_wake", False) else None)  # heavy work, off this thread
        start_warm_up()
        self.checkpoint_every = checkpoint_every
        self.checkpointing = work.Checkpointing(self.checkpoints, checkpoint_every)
        self.policy = policy or Policy()
        self.placement = placement or Placement()
        self.admission = Admission(self)
        self.book = MemoryBook(self.limits, reclaim=self.admission.reclaim)
        self.origins: dict[bytes, tuple[str, ...]] = {}  # peer → who stands behind it, for the per-origin caps
        #: Why the cloud freed the session a peer spoke for (expired, evicted), for its next request.
        self.gone: OrderedDict[bytes, str] = OrderedDict()
        self.shared_model = shared_model
        if shared_policy is not None and not shared_model:
            raise ConfigError("--shared-optimizer and --shared-frozen set a shared cloud half: add --shared-model")
        self.shared_policy = shared_policy or SharedPolicy()
        self.shared = SharedParts(self.shared_policy, rounds.admit if rounds is not None else None)
        self.rounds = rounds
        self.make_session = make_session
        if rounds is not None:
            rounds.bind(self)
        self.sessions: dict[bytes, CloudSession] = {}  # by the peer that speaks for it now
        self.by_id: dict[str, CloudSession] = {}
        self.ended = 0
        #: One summary per ended session (id, steps, requests, repeats answered from the cache,
        #: reason), newest last: what operators and load tests check for lost or repeated steps.
        self.finished: deque[dict[str, Any]] = deque(maxlen=10_000)
        self.stop_event = threading.Event()
        self._stop_reason = "the cloud stopped"
        self._on_event = on_event or (lambda text: log.info("%s", text))
        self._last_sweep = self._last_tidy = time.monotonic()
        self._errors = ErrorLog(log)
        self.answers = answer_table(self)

    def event(self, text: str) -> None:
        self._on_event(text)

    def serve(self, poll: float = 0.2) -> None:
        """Handle messages until stopped, or until ``max_sessions`` sessions have ended."""
        try:
            while not self.stop_event.is_set():
                if self.max_sessions and self.ended >= self.max_sessions and not self.sessions:
                    break
                self.expire()
                self._settle()
                try:
                    wait = self.jobs.poll(poll if self.rounds is None else self.rounds.tick(poll))
                    peer, frames = self.listener.recv(wait)
                except transports.TransportTimeout:
                    continue
                except transports.TransportClosed:
                    break
                self.handle(peer, frames)
        except KeyboardInterrupt:
            self.shutdown("the cloud was interrupted (Ctrl-C)")
            raise
        self.shutdown(self._stop_reason)

    # ------------------------------------------------------------ one message

    def handle(self, peer: bytes, frames: list) -> None:
        """Answer one message. Never raises for anything the peer sent."""
        msg: protocol.Message | None = None
        session = self.sessions.get(peer)
        try:
            if self.rounds is not None and self.rounds.hold(peer, frames, session):
                return  # the edge waits for its round; handled when the round closes
            if session is not None and self.jobs.hold(session.id, peer, frames, self.limits):
                return  # handled, in order, when the session's running request has answered
        except SplitFTError as exc:  # no room to keep it: refused at once
            self.send(peer, protocol.encode(self._error(exc, 0, 0)), "error")
            return
        seq, numbered = 0, False
        try:
            msg = self._decode(frames, session)
            if isinstance(msg, Hello) and (busy := snapshots.waits_for(self, msg)) is not None:
                self.jobs.hold(busy, peer, frames, self.limits)
                return  # an edge back on a new connection: resumed once the request under way has answered
            seq = getattr(msg, "seq", 0)
            if seq < 0:
                raise ProtocolError(f"request seq must be >= 0, got {seq}")
            if seq and session is not None and msg.NUMBERED:
                if not session.replies.is_new(seq) and not moves.asked_again(msg, session.replies.last_seq):
                    self.send(peer, *session.replies.again(seq))
                    return
                numbered = True
            reply = self._dispatch(peer, msg, seq)
            if session is None and isinstance(msg, Hello) and peer in self.sessions:
                self.sessions[peer].metrics.count("up", "control", wire=transports.message_nbytes(frames))
            if isinstance(reply, Job):  # priced work: done here if it is short, else on a worker
                reply = self.jobs.start(reply, (peer, session, msg, seq, numbered))
                if reply is LATER:
                    return  # answered by _settle when the worker is done
            if self.rounds is not None and self.rounds.defer(peer, session, reply, seq, numbered):
                return  # a backward answered with its round's mean cut gradient (all the round's are in)
        except (KeyboardInterrupt, SystemExit):
            raise
        except Exception as exc:  # noqa: BLE001 — a bad request must never stop the server
            reply, numbered = self._failed(peer, msg, exc, seq, numbered)
        if reply is not None:
            self.answer(peer, session, reply, seq, numbered)

    def _failed(self, peer: bytes, msg: protocol.Message | None, exc: Exception, seq: int,
                numbered: bool) -> tuple[Error, bool]:
        """The typed reply to a request that failed, and whether its number is used."""
        if not isinstance(exc, (SplitFTError, compressors.CompressionError)):
            self._errors.report(exc, peer)
        if isinstance(msg, Bye):  # the edge is leaving whatever we answer (a request lost to Ctrl-C, an op refused)
            self._end(peer, f"edge said goodbye ({msg.reason or 'no reason'}); its goodbye failed: {exc}")
        # nothing applied: the number stays free
        return self._error(exc, seq, getattr(msg, "call", 0)), numbered and not isinstance(exc, SessionLost)

    def _settle(self) -> None:
        """Answer the jobs that ended on workers, then what their edges sent meanwhile."""
        for job in self.jobs.finished():
            peer, session, msg, seq, numbered = job.context
            if job.key in self.by_id:
                self.by_id[job.key].seat.heard()
            try:
                if job.error is not None:
                    raise job.error
                reply = job.then(job.result)
            except Exception as exc:  # noqa: BLE001 — as in handle: every failure gets a typed reply
                reply, numbered = self._failed(peer, msg, exc, seq, numbered)
            if reply is not None:
                self.answer(peer, session, reply, seq, numbered)
            while (held := self.jobs.next_held(job.key)) is not None:
                self.handle(*held)

    def _decode(self, frames: list, session: CloudSession | None) -> protocol.Message:
        size = self.limits.check_frames(frames)
        try:
            msg = protocol.decode(frames)
        except RecursionError:
            raise ProtocolError("the message body is nested too deeply") from None
        if session is not None:
            session.seat.heard()
            session.metrics.count("up", traffic_kind(msg.TYPE), wire=size)
        return msg

    def _error(self, exc: BaseException, seq: int, call: Any) -> Error:
        return error_reply(exc, seq, call, self.limits.max_error_chars)

    def answer(self, peer: bytes, session: CloudSession | None, reply: protocol.Message, seq: int,
               numbered: bool) -> None:
        """Send ``reply`` (kept in the session's reply cache when its request was numbered)."""
        if seq and hasattr(reply, "seq"):
            reply.seq = seq
        try:
            out = protocol.encode(reply)
        except SplitFTError as exc:  # the cloud part returned something that cannot cross the wire
            reply = self._error(exc, seq, 0)
            out = protocol.encode(reply)
        self.send(peer, out, reply.TYPE)  # first: the edge waits for it, not for the bookkeeping
        if session is not None:
            held = session.held_bytes()  # read once: the reply cache's share changes as it keeps this reply
            held += session.replies.keep(seq, reply.TYPE, out, self.limits, held) if numbered else 0
            if session.id in self.by_id:
                self.book.set(session.id, held)

    def send(self, peer: bytes, frames: list, kind: str) -> None:
        """Send ``frames`` to ``peer``, counted in its session's metrics; a peer gone is logged."""
        session = self.sessions.get(peer)
        try:
            wire = self.listener.send(peer, frames)
        except transports.TransportError as exc:
            log.warning("cannot reply to peer %s: %s", peer.hex(), exc)
            return
        if session is not None:
            session.metrics.count("down", traffic_kind(kind), wire=wire)

    def _dispatch(self, peer: bytes, msg: protocol.Message, seq: int) -> protocol.Message | Job | None:
        handler = self.answers.get(type(msg))
        if handler is None:
            self._session_of(peer, msg)
            raise ProtocolError(f"a {msg.TYPE} message is not a request the cloud answers")
        return handler(peer, msg, seq)

    @answers(Ping)
    def _on_ping(self, peer: bytes, msg: Ping, seq: int) -> Pong:
        self._session_of(peer, msg)
        return Pong()

    @answers(Probe)
    def _on_probe(self, peer: bytes, msg: Probe, seq: int) -> Probed:
        return probes.answer(msg, self.policy)  # no session needed: an edge probes before its hello

    def _session_of(self, peer: bytes, msg: protocol.Message) -> CloudSession:
        session = self.sessions.get(peer)
        if session is None:
            why = self.gone.get(peer)
            raise SessionLost(f"no session for this connection (got {msg.TYPE}): "
                              + (f"this cloud freed it ({why}); " if why else "")
                              + "send a hello first, or a hello with a resume token if the cloud restarted")
        return session

    @answers(Forward, Backward, Sync, Bye)
    def _on_request(self, peer: bytes, msg: work.Request, seq: int) -> protocol.Message | Job:
        if isinstance(msg, Bye) and peer not in self.sessions:
            return Ack()  # nothing to end; answered so that every message gets a reply
        session = self._session_of(peer, msg)
        # A request that trains (a forward, a backward, a step) keeps its session from eviction once it
        # succeeded; a ping, or a request that failed, does not.
        trains = isinstance(msg, (Forward, Backward)) or prices.new_steps(msg.ops) > 0

        def worked(reply: protocol.Message) -> protocol.Message:  # on the serving thread, once it succeeded
            if trains:
                self.admission.worked(session.id)
            return reply

        if not isinstance(msg, Bye):
            return work.job(self.checkpointing, session, msg, seq, then=worked)
        reason = msg.reason or "edge said goodbye"

        def end(reply: protocol.Message) -> protocol.Message:  # once its operations are applied
            worked(reply)
            self._end(peer, reason)
            return reply

        return work.job(self.checkpointing, session, msg, seq, then=end)

    # ------------------------------------------------------------ sessions: open, admit, end

    @answers(Hello)
    def _on_hello(self, peer: bytes, msg: Hello, seq: int) -> protocol.Message | Job:
        if msg.resume is not None:
            found, verb = snapshots.resume(self, peer, msg), "resumed"
        elif msg.nonce and peer in self.sessions and self.sessions[peer].nonce == msg.nonce:
            found, verb = self.sessions[peer], "greeted again"  # the same hello again, not a new session
        else:
            return self._open(peer, msg)
        if isinstance(found, Job):  # restored from a checkpoint, by a worker if it is large
            restored = found.then
            found.then = lambda result: self._welcome(msg, restored(result), verb)
            return found
        return self._welcome(msg, found, verb)

    @answers(Leave)
    def _on_leave(self, peer: bytes, msg: Leave, seq: int) -> Job:
        return moves.leave(self._session_of(peer, msg), msg)

    @answers(Arrive)
    def _on_arrive(self, peer: bytes, msg: Arrive, seq: int) -> Job:
        return moves.arrive(self, peer, msg, self._welcome)

    def _open(self, peer: bytes, msg: Hello) -> Welcome | Job:
        """A new session for ``peer``, admitted, built and bound (and checkpointed, with a folder)."""
        if peer in self.sessions:
            self._end(peer, "replaced by a new hello")
        check_codecs(msg.codecs)
        self.policy.check(msg.codecs)
        self.admit(peer)
        origin = self.origins[peer][0]

        def admit_model(nbytes: int) -> None:
            self._admit_model(nbytes, origin)

        session = self.make_session(msg, self.factories, self.limits, shared=self._shared_part(msg, admit_model),
                                    policy=self.policy, admit=admit_model, placement=self.placement)
        self.book.check(session.id, 0, session.held_bytes(), "opening this session", origin=origin)
        self.bind(peer, session)
        if self.checkpoints is None:
            return self._welcome(msg, session, "opened")
        return Job(session.id, session.seat.origin, Price(checkpoint_bytes=state_nbytes(session)),  # before the welcome
                   work=lambda: snapshots.save(self.checkpoints, session, 0),
                   then=lambda _: self._welcome(msg, session, "opened"), pace=session.pricing.pace,
                   off_thread=session.off_thread and session.half.shared is None)

    def _welcome(self, msg: Hello, session: CloudSession, verb: str) -> Welcome:
        steps, last_seq = session.mirrored.steps, session.replies.last_seq
        self.event(f"session {session.id} {verb}: {msg.factory} cut at {msg.cut}"
                   f"{' rejoin ' + str(msg.rejoin) if msg.rejoin else ''}, codecs "
                   f"{msg.codecs.get('fwd')} / {msg.codecs.get('bwd')}"
                   + (f", at step {steps} (request {last_seq})" if verb == "resumed" else ""))
        return Welcome(session=session.id, server=f"splitft {protocol.PROTOCOL_VERSION}", token=session.token,
                       seq=last_seq, steps=steps,
                       checkpoint_every=self.checkpoint_every if self.checkpoints is not None else 0,
                       limits=self.limits.for_edge(), shared=session.half.shared is not None)

    def admit(self, peer: bytes) -> None:
        """Make room for a new session of ``peer`` (evicting idle sessions, or those of an origin
        holding more), or refuse it when the cloud, its origin or the checkpoint folder has none."""
        origins = self.listener.origins(peer)
        self.origins[peer] = origins
        self.admission.room_for_session(origins)
        if self.checkpoints is not None and self.checkpoints.full():
            raise CapacityError("the checkpoint folder is full (--checkpoint-max-mb); try again later")

    def _admit_model(self, nbytes: int, origin: str | None = None) -> None:
        """Before a model is built: does a trained copy of it fit the memory budgets?"""
        self.book.check("", 0, nbytes, "the requested model (weights, gradients, optimizer state)", origin=origin)

    def _shared_part(self, msg: Hello, admit_model: Callable[[int], None]) -> SharedPart | None:
        if not self.shared_model:
            return None
        return self.shared.part_for(msg, lambda: build_chain(msg, self.factories, self.limits, admit_model))

    def bind(self, peer: bytes, session: CloudSession) -> None:
        """``peer`` speaks for ``session`` from now on."""
        self.unbind(session)
        old = self.sessions.get(peer)
        if old is not None and old is not session:
            self._end(peer, "replaced by a new hello")
        self.sessions[peer] = session
        self.gone.pop(peer, None)
        self.by_id[session.id] = session
        origins = self.origins.get(peer) or self.listener.origins(peer)
        # a restored session trained before
        self.admission.opened(session.id, origins, trained=session.seat.trained)
        session.seat.bind(origins[0], self.book)
        self.book.set(session.id, session.held_bytes())

    def unbind(self, session: CloudSession) -> None:
        for peer, s in list(self.sessions.items()):
            if s is session:
                del self.sessions[peer]
                self.origins.pop(peer, None)
        self.by_id.pop(session.id, None)
        self.book.drop(session.id)

    def _end(self, peer: bytes, reason: str, discard: bool = True) -> None:
        session = self.sessions.pop(peer, None)
        if session is not None:
            self.forget(session, f"ended after {session.mirrored.steps} steps: {reason}", discard)

    def forget(self, session: CloudSession, text: str, discard: bool = True) -> None:
        """Free a session; with ``discard`` its regular checkpoints go too (a pinned one stays)."""
        replies = session.replies
        self.finished.append({"session": session.id, "steps": session.mirrored.steps, "requests": replies.last_seq,
                              "repeats": replies.duplicates, "reason": text})
        for peer in [p for p, s in self.sessions.items() if s is session]:  # still connected: tell it why, later
            self.gone[peer] = text
            while len(self.gone) > 4096:
                self.gone.popitem(last=False)
        trained = self.admission.trained(session.id)
        self.unbind(session)
        self.admission.forget(session.id)
        if session.half.shared is not None:
            session.half.shared.leave()
        if discard and self.checkpoints is not None and session.id not in self.by_id:
            try:
                self.checkpoints.remove(session.id)
            except (OSError, CheckpointError) as exc:
                log.warning("session %s: cannot delete its checkpoints: %s", session.id, exc)
        if trained:  # a hello that never trained does not count towards --sessions
            self.ended += 1
        self.event(f"session {session.id} {text}")

    def evict(self, session_id: str, text: str) -> None:
        """Free a session to make room for another (:mod:`.admission` chose it)."""
        if (session := self.by_id.get(session_id)) is None:
            self.admission.forget(session_id)
            return
        self.forget(session, text)

    def expire(self, now: float | None = None) -> None:
        """Free sessions that heard nothing for ``limits.session_timeout`` (checked once a second)."""
        now = time.monotonic() if now is None else now
        if now - self._last_sweep < 1.0 and now >= self._last_sweep:
            return
        self._last_sweep = now
        if self.checkpoints is not None and now - self._last_tidy >= TIDY_EVERY:
            self._last_tidy = now
            self.checkpoints.sweep(self.resumable())
        for session in list(self.by_id.values()):
            if self.jobs.busy(session.id):
                continue  # working for its edge: not idle
            idle = now - session.seat.last_seen
            if idle > self.limits.session_timeout:
                self.forget(session, f"expired after {idle:.0f} s without a message")
            elif not self.admission.trained(session.id) and idle > self.limits.handshake_timeout:
                self.forget(session, f"freed: no request for {idle:.0f} s after its hello")

    def resumable(self) -> set[str] | None:
        """The sessions whose regular checkpoints must stay: those alive here (None: the folder
        is shared with other processes, which keep their own)."""
        return set(self.by_id) | self.jobs.keys()

    def shutdown(self, reason: str) -> None:
        """Tell every connected edge the cloud is going away, then close the listener."""
        self.jobs.close()  # a checkpoint being written is finished first
        for peer in list(self.sessions):
            with contextlib.suppress(transports.TransportError):
                self.listener.send(peer, protocol.encode(Bye(reason=reason)))
            self._end(peer, reason, discard=False)  # a restarted cloud resumes them from their checkpoints
        self.listener.close()

    def stop(self, reason: str = "the cloud stopped") -> None:
        """Ask :meth:`serve` to return, telling the edges ``reason`` (thread- and signal-safe)."""
        self._stop_reason = reason
        self.stop_event.set()


def serve_in_thread(server: CloudServer) -> threading.Thread:
    """Run ``server.serve()`` on a daemon thread (in-process tests and simulations)."""
    thread = threading.Thread(target=server.serve, name="splitft-cloud", daemon=True)
    thread.start()
    return thread


__all__ = ["CloudServer", "serve_in_thread"]
