"""A session's cloud half: its own copy or a part shared with other sessions, and its parameters.

A session computes with one :class:`~splitft.cut.Chain`. By default it is the session's own copy;
with ``shared_model`` every session that asks for the same model and cut trains one
:class:`SharedPart`, in the order requests arrive (sequential split learning), and each session
keeps its own gradient buffers, put in place only while it works (:meth:`Half.own_grads`), so
one edge's accumulated gradients never leak into another's step. The edge names parameters by
their names in the unsplit model; :class:`Half` answers for them (their gradients' norms, which
have none, the weights), and checks weights an edge pushes before any is loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch
from torch import nn

from ..cut import Chain, value_hash
from ..devices import Placement
from ..errors import CapacityError, HandshakeError, ProtocolError
from ..wire import operations as o
from ..wire.protocol import Hello
from .blame import blame, short
from .budget import model_nbytes, parameter_storages
from .build import hello_identity

if TYPE_CHECKING:
    from .shared_policy import SharedPolicy


class Contributions(Protocol):
    """A shared half's synchronous rounds, as an optimizer step reaches them (:mod:`.rounds`)."""

    def contribute(self, session_id: str, half: Half, op: o.Step) -> None: ...


@dataclass
class SharedPart:
    """A cloud part that several sessions train together (``shared_model``), and its optimizer."""

    chain: Chain
    ushape: bool
    optimizer: torch.optim.Optimizer | None = None
    optimizer_spec: tuple[str, str] | None = None
    updates: int = 0  # optimizer steps taken by any session; a graph older than this is stale
    sessions: int = 0
    initialized: bool = False  # the first edge's weights are in; later edges' pushed weights are ignored
    rounds: Contributions | None = None  # synchronous data-parallel rounds (:mod:`.rounds`), or None: arrival order
    policy: SharedPolicy | None = None  # what edges may set on it: the cloud's; None: no optimizer

    def join(self) -> None:
        """A session trains it from now on (its weights, if it pushed any, are in)."""
        self.initialized = True
        self.sessions += 1

    def leave(self) -> None:
        """A session ended; once nobody trains the part, the next edge may pick the optimizer."""
        self.sessions -= 1
        if self.sessions <= 0:
            self.optimizer, self.optimizer_spec = None, None

    def trains_in(self, rounds: Contributions) -> None:
        """From now on its steps are taken in synchronous rounds (:mod:`.rounds`)."""
        self.rounds = rounds

    def stepped(self) -> None:
        """Its optimizer took a step: graphs built before it are stale."""
        self.updates += 1

    def attach(self, build: Callable[[], torch.optim.Optimizer], spec: tuple[str, str]) -> None:
        """The cloud's optimizer for it, built by ``build()`` at the first attach only."""
        if self.optimizer is None:
            self.optimizer = build()
            self.optimizer_spec = spec


class SharedParts:
    """The parts a cloud's sessions share (``shared_model``): one per model and cut, at most
    :attr:`MOST`, each frozen as the cloud's policy says; ``joined`` is told of every hello for one
    (synchronous rounds give it seats)."""

    MOST = 16

    def __init__(self, policy: SharedPolicy, joined: Callable[[SharedPart], None] | None = None) -> None:
        self.policy, self.joined = policy, joined
        self.parts: dict[str, SharedPart] = {}

    def __len__(self) -> int:
        """Parts trained now."""
        return len(self.parts)

    def part_for(self, hello: Hello, build: Callable[[], tuple[Chain, bool]]) -> SharedPart:
        """The part ``hello`` asks for; ``build()`` makes it (the half, and whether it is a U-shape)
        when no session trains it yet."""
        key = json.dumps(hello_identity(hello) | {"codecs": None, "seed": None}, sort_keys=True, default=str)
        part = self.parts.get(key)
        if part is None:
            if len(self.parts) >= self.MOST:
                raise CapacityError(f"this cloud already trains {self.MOST} different shared cloud parts, its limit")
            chain, ushape = build()
            self.policy.freeze(chain.qualified_parameters())
            part = self.parts[key] = SharedPart(chain, ushape, policy=self.policy)
        if self.joined is not None:
            self.joined(part)
        return part


def load_initial(chain: Chain, hello: Hello) -> None:
    """Load the weights the edge pushed into a half just built, or check that the factory's equal
    the edge's."""
    with blame(HandshakeError, "the weights the edge pushed cannot be loaded"):
        if hello.weights is not None:  # checked in the half's dtypes before any is loaded
            chain.load_qualified_state_dict(cast_weights(chain, hello.weights, "the pushed weights"))
        elif hello.value_hash is not None and hello.value_hash != value_hash(chain):
            raise HandshakeError(
                "the cloud part's initial weights differ between edge and cloud; make the factory "
                "deterministic (load the same checkpoint, seed it) or let the edge push them (weights='push')"
            )


def tensors_from_wire(arrays: Any, what: str) -> dict[str, torch.Tensor]:
    """Named arrays an edge sent, as tensors (a :class:`ProtocolError` unless it is a map of arrays)."""
    if not isinstance(arrays, dict) or not all(isinstance(v, np.ndarray) for v in arrays.values()):
        raise ProtocolError(f"{what} must map names to arrays")
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def cast_weights(chain: Chain, arrays: Any, what: str, partial: bool = False) -> dict[str, torch.Tensor]:
    """Pushed weights, every one of the half's tensors (``partial``: some of them), each cast to
    its tensor's dtype and checked there (1e300 sent as float64 is Inf in float32): a
    :class:`ProtocolError` before anything is loaded, so a refused push changes nothing. What is
    not finite as sent loads as it is, as torch loads it (a causal mask of ``-inf``, an observer's
    range before any data)."""
    weights = tensors_from_wire(arrays, what)
    targets = chain.qualified_state_dict()
    missing, extra = sorted(set(targets) - set(weights)), sorted(set(weights) - set(targets))
    if extra or (missing and not partial):
        raise ProtocolError(f"{what} do not fit the cloud half: missing {short(missing)}, unexpected {short(extra)}")
    cast = {}
    for name in weights:
        target, value = targets[name], weights[name]
        if tuple(value.shape) != tuple(target.shape):
            raise ProtocolError(f"{what}: {name!r} has shape {tuple(value.shape)}; the cloud half's is "
                                f"{tuple(target.shape)}")
        if value.is_complex() and not target.is_complex():  # a cast would drop the imaginary part
            raise ProtocolError(f"{what}: {name!r} is complex; the cloud half's is {target.dtype}")
        with blame(ProtocolError, f"{what}: {name!r} cannot be cast to {target.dtype}"):
            cast[name] = value.to(target.dtype)
        if ((cast[name].is_floating_point() or cast[name].is_complex())
                and not torch.equal(torch.isfinite(cast[name]), torch.isfinite(value))):
            raise ProtocolError(f"{what}: {name!r} holds a value too large for the half's dtype {target.dtype} (it "
                                "would load as Inf)")
    return cast


class Half:
    """The half one session computes with, where it computes, and its parameters by unsplit name.

    Args:
        chain: the half (the shared part's, for a shared half), its initial weights loaded.
        ushape: whether the cut hands a trunk's output back to the edge.
        shared: the part it shares with other sessions, or None for a copy of its own.
        placement: the device (and dtype) it computes in; the half is placed there.
    """

    def __init__(self, chain: Chain, ushape: bool, shared: SharedPart | None, placement: Placement) -> None:
        self.chain, self.ushape, self.shared, self.placement = chain, ushape, shared, placement
        placement.place(chain)
        #: What this session's own copy holds when trained (0 for a shared half: no session's alone).
        self.model_bytes = model_nbytes(chain) if shared is None else 0
        self._grads: list[torch.Tensor | None] | None = None  # shared half: this session's gradients
        self._named: dict[str, nn.Parameter] | None = None
        self._names: dict[int, str] | None = None
        self._storages: frozenset[int] | None = None
        self._sharded = False

    def sharded(self, placement: Placement, model_bytes: int) -> None:
        """The half was cut into shards across ranks (:mod:`.shard`): it computes on
        ``placement``'s device now, and this rank holds ``model_bytes`` of it."""
        self.placement, self.model_bytes = placement, model_bytes
        self._named, self._names = None, None  # sharding made new parameter objects
        self._sharded = True  # whose shards are the process group's to place: never cached

    @property
    def is_sharded(self) -> bool:
        """Whether the half was cut into shards across ranks."""
        return self._sharded

    # ------------------------------------------------------------ parameters by name

    @property
    def named_params(self) -> dict[str, nn.Parameter]:
        """The half's parameters by unsplit name, in the order :meth:`grad_norms` answers for all."""
        if self._named is None:
            self._named = self.chain.qualified_parameters()
        return self._named

    def parameter_storages(self) -> frozenset[int] | None:
        """Where the parameters keep their values, found once (weights are loaded by copying into
        them); None for a sharded half, whose meter looks each time."""
        if self._sharded:
            return None
        if self._storages is None:
            self._storages = parameter_storages(self.chain)
        return self._storages

    def name_of(self, param: torch.Tensor) -> str:
        """A parameter's unsplit name."""
        if self._names is None:
            self._names = {id(p): n for n, p in self.named_params.items()}
        return self._names[id(param)]

    def parameters_named(self, names: list | None) -> list[nn.Parameter]:
        """The half's parameters called ``names`` (unsplit names), all of them for None."""
        if names is None:
            return list(self.named_params.values())
        known = self.named_params
        unknown = [n for n in names if not isinstance(n, str) or n not in known]
        if unknown:
            raise ProtocolError(f"the cloud half has no parameter {short(unknown[0])}")
        return [known[n] for n in dict.fromkeys(names)]

    # ------------------------------------------------------------ gradients

    def own_grads(self) -> AbstractContextManager[None]:
        """Shared half: put this session's gradient buffers in place for the duration (an own
        half's are in place: nothing to do, and no generator built per operation for it)."""
        return _IN_PLACE if self.shared is None else self._swapped_grads()

    @contextmanager
    def _swapped_grads(self) -> Iterator[None]:
        params = list(self.chain.parameters())
        for p, g in zip(params, self._grads or [None] * len(params)):
            p.grad = g
        try:
            yield
        finally:
            self._grads = [p.grad for p in params]
            for p in params:
                p.grad = None

    def grad_norms(self, norm_type: float, names: list | None = None) -> list[float | None]:
        """The ``norm_type`` norm of each parameter gradient of the half, or of the ``names``d
        parameters' (for clipping by the global norm); None for a parameter without a gradient."""
        check_norm_type(norm_type)
        params = self.parameters_named(names)
        with torch.no_grad(), self.own_grads():
            return [None if p.grad is None else float(torch.linalg.vector_norm(p.grad, norm_type)) for p in params]

    def grads(self) -> dict[str, np.ndarray]:
        """The parameters' gradients on the host (bfloat16 as float32), where there is one: what
        the edge's ``unsplit()`` between a backward and its step puts on the whole model."""
        with self.own_grads():
            return host_state({name: p.grad for name, p in self.named_params.items() if p.grad is not None})

    def unreached(self) -> list[str] | None:
        """After a backward: the parameters that require a gradient and still have none, so the
        edge knows exactly which ``p.grad`` exist there; None when there are none."""
        with self.own_grads():
            names = [name for name, p in self.named_params.items() if p.requires_grad and p.grad is None]
        return names or None


#: An own half's gradients are its parameters' own: nothing to put in place.
_IN_PLACE = nullcontext()


def check_norm_type(norm_type: float) -> None:
    """A gradient norm's type the edge may ask for: positive, or inf."""
    if not (norm_type == math.inf or (math.isfinite(norm_type) and norm_type > 0)):
        raise ProtocolError(f"a gradient norm's type must be positive, got {norm_type}")


def host_state(weights: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """A half's weights on the host (bfloat16, which numpy lacks, as float32)."""
    return {k: (v.float() if v.dtype == torch.bfloat16 else v).detach().cpu().numpy() for k, v in weights.items()}


__all__ = ["Contributions", "Half", "SharedPart", "SharedParts", "cast_weights", "check_norm_type", "host_state",
           "load_initial", "tensors_from_wire"]
