"""The messages of the wire protocol, one typed record each (:mod:`.protocol` encodes them).

A message is a dataclass whose fields travel by position in declaration order; ``NUMBERED`` marks
the requests the cloud numbers, applies once and answers again from its reply cache. Adding a
message is a class here and its entry in :data:`MESSAGES` (and a row in docs/wire.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np


@dataclass
class Message:
    TYPE: ClassVar[str] = ""
    #: Requests the cloud numbers (``seq``), applies once and answers again from its reply cache.
    NUMBERED: ClassVar[bool] = False


@dataclass
class Hello(Message):
    """Edge → cloud: open a session. The cloud refuses unless every shared setting matches."""

    TYPE: ClassVar[str] = "hello"
    protocol: int
    factory: str
    cut: str
    rejoin: str | None
    fingerprint: str
    codecs: dict
    seed: int
    factory_kwargs: dict = field(default_factory=dict)
    value_hash: str | None = None
    weights: dict | None = None
    client: str = ""
    #: Resuming an earlier session: {"session", "token", "step", "seq", "log_from"} (see cloud.py).
    resume: dict | None = None
    #: Random per split(): a repeated hello (same nonce) gets the same session, not a fresh one.
    nonce: str = ""
    #: A hash of each cloud module's layers and settings, by name (see splitft.cut.structure).
    structure: dict = field(default_factory=dict)
    #: The edge's process-wide numeric settings (see splitft.numerics.settings).
    numerics: dict = field(default_factory=dict)


@dataclass
class Welcome(Message):
    """Cloud → edge: the session is open (or resumed at ``seq``/``steps``).

    ``token`` is the secret that resumes this session; ``checkpoint_every`` says after how many
    optimizer steps the cloud writes a checkpoint (0: none), so the edge knows how much it must
    keep to replay; ``limits`` tells the edge what the cloud accepts before it sends anything.
    """

    TYPE: ClassVar[str] = "welcome"
    session: str
    server: str = ""
    token: str = ""
    seq: int = 0
    steps: int = 0
    checkpoint_every: int = 0
    limits: dict = field(default_factory=dict)
    shared: bool = False  # the cloud half is shared with other edges: steps are sent at once


@dataclass
class Redirect(Message):
    """Cloud front door → edge, in answer to a ``hello``: the session lives on another rank.

    A cloud of several processes (``splitft cloud --workers N``, torchrun) places each new session
    on its least-loaded rank. The edge sends the same hello to ``address`` and talks to that rank
    directly from then on; it follows a redirect only from the address it was given, and at most
    one per handshake.
    """

    TYPE: ClassVar[str] = "redirect"
    address: str  # tcp://HOST:PORT or ipc://PATH of the rank
    rank: int


@dataclass
class Forward(Message):
    """Run the cloud part on ``args``/``kwargs`` (tensors as encoded payloads)."""

    TYPE: ClassVar[str] = "forward"
    NUMBERED: ClassVar[bool] = True
    call: int
    train: bool  # the cloud part runs in train mode (and stateful codecs may update)
    grad: bool  # build a graph: a Backward for this call may follow
    args: list
    kwargs: dict
    target: Any = None  # plain split: the labels; the cloud then returns the loss
    ops: list = field(default_factory=list)
    step: int = 0
    sample_ids: np.ndarray | None = None
    eager: bool = False  # plain split: run the backward now and send the cut's gradient with the loss
    autocast: str | None = None  # the edge's forward ran under autocast to this dtype: so does the cloud's
    #: The edge's host generator state (``torch.get_rng_state()``, uint8), when it changed since the
    #: cloud last had it: the half's dropout goes on drawing from it, as the unsplit model would.
    rng: np.ndarray | None = None
    #: These inputs already crossed, for an earlier loss of one ``model(x)``: the half runs again
    #: from ``rng`` and leaves no trace (its buffers and generator as they were), as unsplit it ran once.
    again: bool = False
    seq: int = 0


@dataclass
class Output(Message):
    """Cloud → edge: what the cloud part returned, and how long the cloud worked on it."""

    TYPE: ClassVar[str] = "output"
    call: int
    value: Any
    timings: dict = field(default_factory=dict)
    grads: list | None = None  # eager forward: gradients of the inputs, for an incoming gradient of 1
    #: Eager forward: the cloud parameters that required a gradient but that this call's graph
    #: does not reach (they get none); None when there are none.
    unreached: list | None = None
    #: The host generator state after the half's forward, when it drew random numbers (dropout):
    #: the edge goes on from it, as the unsplit model's next draw would.
    rng: np.ndarray | None = None
    seq: int = 0


@dataclass
class Backward(Message):
    """Edge → cloud: gradients of a forward call's outputs. ``params`` false: only the call's
    inputs' gradients are wanted (``backward(inputs=...)`` or ``autograd.grad`` on the edge), so
    the half's parameters accumulate nothing."""

    TYPE: ClassVar[str] = "backward"
    NUMBERED: ClassVar[bool] = True
    call: int
    grads: list
    ops: list = field(default_factory=list)
    seq: int = 0
    params: bool = True
    pass_id: int | None = None  # the edge's backward pass (see ApplyEager.pass_id)


@dataclass
class InputGrads(Message):
    """Cloud → edge: gradients of a forward call's inputs."""

    TYPE: ClassVar[str] = "input_grads"
    call: int
    grads: list
    timings: dict = field(default_factory=dict)
    #: The cloud parameters that required a gradient and still have none after this backward.
    unreached: list | None = None
    seq: int = 0


@dataclass
class Sync(Message):
    """Edge → cloud: apply pending operations (optimizer steps...) and answer with an Ack."""

    TYPE: ClassVar[str] = "sync"
    NUMBERED: ClassVar[bool] = True
    ops: list = field(default_factory=list)
    want_state: bool = False
    checkpoint: bool = False  # write a cloud checkpoint now
    pin: bool = False  # ... and keep it: the edge is saving its own checkpoint to match it
    grad_norm: float | None = None  # answer with the norm (of this type) of each cloud gradient
    grad_names: list | None = None  # ... of these parameters only (unsplit names); None: all
    want_optimizer_state: bool = False  # answer with the optimizer's state of each cloud parameter
    evaluate: list | None = None  # answer with the values of these expressions (splitft.wire.expressions)
    want_grads: bool = False  # answer with the cloud half's gradients (the edge's unsplit(), mid-accumulation)
    seq: int = 0


@dataclass
class Ack(Message):
    TYPE: ClassVar[str] = "ack"
    state: dict | None = None
    #: Per parameter of the half (or per one asked for), in order; None where it has no gradient.
    grad_norms: list | None = None
    #: The optimizer's state, parameter name → {state key → array} (bfloat16 as float32).
    optimizer_state: dict | None = None
    #: The values of the sync's ``evaluate`` expressions, in order (bfloat16 as float32, its name beside).
    values: list | None = None
    #: The half's gradients, parameter name → array (bfloat16 as float32), where a parameter has one.
    grads: dict | None = None
    seq: int = 0


@dataclass
class Leave(Message):
    """Edge → cloud: this session moves to another cloud: answer with its state (a ``handoff``)
    and end it here. Operations go first, in a ``sync``: a leave carries none."""

    TYPE: ClassVar[str] = "leave"
    NUMBERED: ClassVar[bool] = True
    seq: int = 0


@dataclass
class Handoff(Message):
    """Cloud → edge: a session's state for the cloud it moves to: ``{"meta": map, "skeleton": tree
    of plain values, "tensors": map name → array, "mac": str}``, the mac keyed by the session's token."""

    TYPE: ClassVar[str] = "handoff"
    state: dict
    seq: int = 0


@dataclass
class Arrive(Message):
    """Edge → cloud: continue here a session that left another cloud: the hello that opened it (as
    a map, its ``resume`` filled in) and the ``state`` of its handoff. Answered like a hello."""

    TYPE: ClassVar[str] = "arrive"
    hello: dict
    state: dict


@dataclass
class Error(Message):
    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    call: int = 0  # the request it answers, when known
    seq: int = 0
    #: ``model``: the Python exception the cloud half's code raised (``IndexError``), which the edge
    #: raises it as too (:data:`splitft.errors.RAISED_AS`); "" for any other.
    raised: str = ""
    #: The host generator state after a forward that drew random numbers (dropout) before it
    #: failed: the edge goes on from it, as the unsplit model's generator moved.
    rng: np.ndarray | None = None


@dataclass
class Bye(Message):
    """Either side: the session ends. Pending operations ride along so nothing is lost."""

    TYPE: ClassVar[str] = "bye"
    NUMBERED: ClassVar[bool] = True
    reason: str = ""
    ops: list = field(default_factory=list)
    seq: int = 0


@dataclass
class Ping(Message):
    """Edge → cloud while idle: keeps the session alive and checks that the cloud still answers."""

    TYPE: ClassVar[str] = "ping"


@dataclass
class Pong(Message):
    TYPE: ClassVar[str] = "pong"


@dataclass
class Probe(Message):
    """Edge → cloud, before its hello (``--codecs auto``): a measurement of the link.

    ``pad`` (uint8, an array frame) travels up; with ``echo`` the cloud sends the same bytes back,
    so the edge times each direction. No session is needed: the cloud answers every probe with a
    ``probed`` naming the codecs its policy allows, and refuses a pad beyond its probe cap.
    """

    TYPE: ClassVar[str] = "probe"
    pad: np.ndarray | None = None
    echo: bool = False


@dataclass
class Probed(Message):
    """Cloud → edge: a probe's answer; ``allowed`` maps a direction to the codec names its policy
    accepts there (a direction not named accepts every registered codec)."""

    TYPE: ClassVar[str] = "probed"
    pad: np.ndarray | None = None
    allowed: dict = field(default_factory=dict)


MESSAGES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (Hello, Welcome, Redirect, Forward, Output, Backward, InputGrads, Sync, Ack, Error, Bye, Ping, Pong,
                Leave, Handoff, Arrive,
                Probe, Probed)
}


__all__ = ["MESSAGES", "Message", "Hello", "Welcome", "Redirect", "Forward", "Output", "Backward", "InputGrads", "Sync", "Ack", "Leave", "Handoff", "Arrive", "Error", "Bye", "Ping", "Pong", "Probe", "Probed"]
