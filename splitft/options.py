"""The settings of a split, as a few small typed objects that check themselves when built.

:func:`splitft.split`, the command line, the task runner and the tests build the same objects, so
a setting means the same everywhere, and a setting that cannot work fails where it is written,
not at the first training step. Each has a default that suits most runs::

    splitft.split(model, "block3", factory="splitft.app.models:digits_cnn", connect="tcp://cloud:5555",
                  codecs=Codecs("c3sl:r=4", bwd="fixpoint:bits=8"), schedule=Schedule(micro_batches=4),
                  faults=Faults(timeout=120))
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import transports

from .wire.coding import resolve_codecs
from .errors import ConfigError
from .factories import check_factory_name

KeySource = str | os.PathLike | bytes  # a key file from `splitft keys`, or Z85 bytes
Opener = Callable[[], transports.Connection]
#: The codec spec that leaves the choice to the edge, from its measured link.
AUTO = "auto"
#: The test accuracy ``auto`` may give up against identity by default (a fraction; see the
#: table in :mod:`splitft.edge.auto_codecs`): lossless and 4-bit fixed point, not low rank.
AUTO_BUDGET = 0.002


@dataclass(frozen=True)
class Codecs:
    """The codec of each direction across the cut, and the seed their randomness shares with the cloud.

    ``fwd`` encodes the activation edge → cloud and ``bwd`` its gradient (default: the ``fwd``
    codec's usual partner); ``ret`` and ``ret_bwd`` do the same for a U-shape trunk's output
    (default: like ``fwd``). Specs are checked against the registry here (``splitft codecs``
    lists them); :attr:`specs` holds all four, normalised. ``fwd="auto"`` leaves the directions not
    named to the edge, which measures its link before the hello and picks, within ``budget`` (the
    test accuracy it may give up), what the link needs (:mod:`splitft.edge.auto_codecs`). Where a
    ``Codecs`` is expected, a plain string such as ``"fp16"`` means ``Codecs(fwd="fp16")``.
    """

    fwd: str = "identity"
    bwd: str | None = None
    ret: str | None = None
    ret_bwd: str | None = None
    seed: int = 0
    budget: float = AUTO_BUDGET
    specs: dict[str, str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("fwd", "bwd", "ret", "ret_bwd"):
            value = getattr(self, name)
            if not (isinstance(value, str) or (value is None and name != "fwd")):
                raise ConfigError(f"codec {name} must be a spec such as 'fp16' or 'lowrank:rank=4', got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"seed must be an integer, got {self.seed!r}")
        if isinstance(self.budget, bool) or not isinstance(self.budget, (int, float)) or not 0 <= self.budget < 1:
            raise ConfigError(f"budget (the accuracy --codecs auto may give up, a fraction) must be in [0, 1), "
                              f"got {self.budget!r}")
        if self.auto:  # chosen when the edge has measured its link (splitft.edge.auto_codecs)
            object.__setattr__(self, "specs", {})
            return
        object.__setattr__(self, "specs", resolve_codecs(self.fwd, self.bwd, self.ret, self.ret_bwd))

    @property
    def auto(self) -> bool:
        """Whether the codecs are left to the edge to choose from its measured link (``"auto"``):
        every direction not named is chosen within :attr:`budget`."""
        return self.fwd == AUTO

    @classmethod
    def of(cls, value: str | Codecs | None) -> Codecs:
        """``value`` as Codecs: a spec string is the forward codec; None the defaults."""
        if isinstance(value, Codecs):
            return value
        if value is None:
            return cls()
        if isinstance(value, str):
            return cls(value)
        raise ConfigError(f"codecs must be a spec such as 'fp16' or Codecs(fwd=..., bwd=...), got {value!r}")


@dataclass(frozen=True)
class Link:
    """How the edge reaches its cloud.

    ``connect`` is the cloud's address (``tcp://host:port``, ``ipc://path``), an open transport
    connection, or a function that opens one. With an address or a function the edge reconnects
    after a fault; with an open connection it cannot. ``emulate`` runs the link as a slower
    network, e.g. ``"100mbit,20ms"`` (bandwidth and one-way delay; ``"up=...;down=..."`` for
    asymmetric links). ``cloud_key`` and ``key`` (CurveZMQ: the cloud's public key and this edge's
    secret key, both or neither) encrypt the link, and the cloud then admits the edge only if its
    public key is on the cloud's allow-list; they apply to an address only.
    """

    connect: str | transports.Connection | Opener
    emulate: str | transports.LinkSpec | None = None
    cloud_key: KeySource | None = None
    key: KeySource | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.connect, (str, transports.Connection)) and not callable(self.connect):
            raise ConfigError("connect= takes the cloud's address ('tcp://host:port'), an open transport "
                              f"connection, or a function that opens one; got {self.connect!r}")
        if (self.cloud_key is None) != (self.key is None):
            raise ConfigError("an encrypted link needs both cloud_key (the cloud's public key) and key (this "
                              "edge's secret key)")
        if self.cloud_key is not None and not isinstance(self.connect, str):
            raise ConfigError("cloud_key and key encrypt a link the edge opens to an address; give connect= the "
                              "address, or set the keys up on the connection you pass")
        try:
            spec = None if self.emulate is None else transports.LinkSpec.coerce(self.emulate)
        except transports.LinkSpecError as exc:
            raise ConfigError(str(exc)) from exc
        object.__setattr__(self, "emulate", spec)

    @property
    def reconnects(self) -> bool:
        """Whether the edge can open this link again after a fault."""
        return not isinstance(self.connect, transports.Connection)

    @classmethod
    def of(cls, value: str | transports.Connection | Opener | Link) -> Link:
        """``value`` as a Link: an address, a connection or an opener is a Link to it as it is."""
        return value if isinstance(value, Link) else cls(value)


@dataclass(frozen=True)
class Faults:
    """How long to wait, and how to keep a session through a failing link.

    ``timeout``: seconds to wait for any one reply before treating the link as failed (then the
    edge reconnects, resumes its session and re-sends what the cloud lost). ``reconnect_timeout``:
    seconds to keep trying to get the session back. ``heartbeat``: seconds of idleness after which
    the edge pings the cloud, keeping its session alive while the training loop is busy elsewhere
    (0: never).
    """

    timeout: float = 60.0
    reconnect_timeout: float = 60.0
    heartbeat: float = 10.0

    def __post_init__(self) -> None:
        for name, positive in (("timeout", True), ("reconnect_timeout", False), ("heartbeat", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                raise ConfigError(f"{name} is in seconds and must be a finite number "
                                  f"{'above' if positive else 'of at least'} 0, got {value!r}")
            object.__setattr__(self, name, float(value))


@dataclass(frozen=True)
class Schedule:
    """How a training step's messages are ordered.

    ``micro_batches``: cut each call into this many micro-batches, all sent before any reply is
    awaited, so the wire and the cloud work at the same time. The gradient is the full batch's up to
    rounding (the parts' sums are added in another order than one backward's: not bitwise);
    a BatchNorm layer of the cloud part in training mode would see micro-batches, so a call
    through one is refused (keep 1 for those). ``eager_backward`` (plain split): the cloud runs the backward right after
    the loss and sends the cut's gradient with it, one round trip per step instead of two; the edge
    scales it by the loss's incoming gradient and has the cloud scale its own the same way (a
    gradient other than ±2^k would round differently from the unsplit backward: the edge then
    sends a backward, and the cloud runs the graph it kept for it). It is not used when the cloud
    checkpoints sessions. ``window`` (a frozen edge in a plain split,
    :mod:`splitft.edge.streaming`): up to this many steps in flight before the edge waits for the
    oldest reply; the weights equal synchronous training's (1: synchronous). ``delayed_gradients``
    lets a trainable edge stream too, asynchronously: each step's cut gradient is applied one step
    late, to the edge weights that step ran with (kept per step in flight); it converges like
    synchronous training only approximately (README).
    """

    micro_batches: int = 1
    eager_backward: bool = True
    window: int = 1
    delayed_gradients: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.micro_batches, bool) or not isinstance(self.micro_batches, int) or self.micro_batches < 1:
            raise ConfigError(f"micro_batches must be a positive integer, got {self.micro_batches!r}")
        if not isinstance(self.eager_backward, bool):
            raise ConfigError(f"eager_backward is True or False, got {self.eager_backward!r}")
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 1:
            raise ConfigError(f"window (steps in flight) must be a positive integer, got {self.window!r}")
        if not isinstance(self.delayed_gradients, bool):
            raise ConfigError(f"delayed_gradients is True or False, got {self.delayed_gradients!r}")
        if self.delayed_gradients and self.window < 2:
            raise ConfigError("delayed_gradients streams a trainable edge's steps: give it window=2 or more")


@dataclass(frozen=True)
class Factory:
    """How the cloud builds its half, and how the edge makes sure it builds the same one.

    ``name``: ``"package.module:function"``, the factory both sides call (the cloud must list it
    as allowed), with ``kwargs``. ``weights``: ``"push"`` sends the cloud part's initial weights
    in the handshake; ``"factory"`` has the cloud start from its own and checks they are equal
    (a pre-trained model both sides load). ``check_cut`` (U-shape): at the first call, run the
    trunk once on the edge to make sure it reads nothing but what crosses the cut and its own
    weights (:mod:`splitft.edge.audit`); turn it off for a trunk that reads constants this factory
    builds too. Where a ``Factory`` is expected, a plain name means ``Factory(name)``.
    """

    name: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    weights: Literal["push", "factory"] = "push"
    check_cut: bool = True

    def __post_init__(self) -> None:
        check_factory_name(self.name)
        if not isinstance(self.kwargs, Mapping) or not all(isinstance(k, str) for k in self.kwargs):
            raise ConfigError(f"factory kwargs must be a dict with string keys, got {self.kwargs!r}")
        object.__setattr__(self, "kwargs", dict(self.kwargs))
        if self.weights not in ("push", "factory"):
            raise ConfigError(f"weights must be 'push' or 'factory', got {self.weights!r}")
        if not isinstance(self.check_cut, bool):
            raise ConfigError(f"check_cut is True or False, got {self.check_cut!r}")

    @classmethod
    def of(cls, value: str | Factory) -> Factory:
        """``value`` as a Factory: a name is that factory with no arguments, its weights pushed."""
        return value if isinstance(value, Factory) else cls(value)


__all__ = ["Codecs", "Factory", "Faults", "KeySource", "Link", "Opener", "Schedule"]
