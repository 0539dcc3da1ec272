"""``split()``: cut a model, open its session with the cloud, and wire the edge's rooms together."""

from __future__ import annotations

import os
import secrets
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import nn

import transports

from .. import numerics
from ..wire import protocol
from ..cut import CutSpec, cut_text, extract, fingerprint, parse_cut, structure, value_hash
from ..devices import resolve_device
from ..errors import ConfigError, translated
from ..options import Codecs, Factory, Faults, Link, Opener, Schedule
from ..wire.protocol import Hello
from ..wire.coding import SlotCodecs
from . import auto_codecs, resume, taken_before
from .cloud_half import values_to_send
from .layer_refusals import refuse_unsupported_layers
from .facade import split_class
from .ghost_classes import Ghost
from .model import SplitModel
from .requests import EdgeSession
from .schedule import Scheduler
from .stage import CloudStage

T = TypeVar("T")


def split(model: nn.Module, cut: str | int, rejoin: str | int | None = None, *,
          factory: str | Factory, connect: str | transports.Connection | Opener | Link,
          codecs: str | Codecs = "identity", schedule: Schedule | None = None, faults: Faults | None = None,
          freeze_edge: bool = False, metrics_path: str | os.PathLike | None = None,
          resume_from: str | os.PathLike | None = None,
          device: str | torch.device | None = None) -> SplitModel:
    """Cut ``model`` and connect its cloud part; returns the edge's model to train.

    Args:
        model: the full model, built on the edge. Its cloud modules are replaced by stand-ins.
        cut: the first module that runs in the cloud (dotted name or Sequential index), or a
            slice ``"parent.i:j"`` of a container's children (U-shape).
        rejoin: for U-shape, the sibling of ``cut`` where the edge takes over again.
        factory: ``"package.module:function"`` that builds the same model in the cloud (which
            must list it as allowed), or a :class:`~splitft.options.Factory` with its arguments,
            where the cloud's initial weights come from, and the U-shape cut check.
        connect: the cloud's address (``tcp://host:port``, ``ipc://path``), an open transport
            connection, a function that opens one, or a :class:`~splitft.options.Link` (link
            emulation, CurveZMQ keys).
        codecs: the codec per direction, :class:`~splitft.options.Codecs`; a spec string such as
            ``"fp16"`` is the forward codec, its gradient partner going back.
        schedule: micro-batches and eager backward, :class:`~splitft.options.Schedule`.
        faults: reply timeout, reconnection time and heartbeat, :class:`~splitft.options.Faults`.
        freeze_edge: SFT's eliminated link: the edge's modules before the cut get no gradient,
            so no gradient crosses from the cloud at all (a U-shape head still trains); a model
            input that requires a gradient (``x.grad`` of a saliency map) is refused.
        metrics_path: append one JSON record of traffic and timings per optimizer step here.
        resume_from: an edge checkpoint written by :meth:`SplitModel.save_checkpoint`: load the
            edge's half from it and continue the session where both halves were saved.
        device: move the edge's half there (``"cuda"``, ``"cpu"``; default: leave it where it
            is). The cloud half's device is the cloud's choice (``splitft cloud --device``).
    """
    _refuse_split_again(model)
    edge_device = resolve_device(device) if device is not None else None  # a missing GPU fails before connecting
    factory, link, codecs = Factory.of(factory), Link.of(connect), Codecs.of(codecs)
    schedule = _given(schedule, Schedule, "schedule")
    faults = _given(faults, Faults, "faults")
    spec = parse_cut(model, cut, rejoin)
    saved = resume.read(resume_from) if resume_from is not None else None
    choice = None
    if codecs.auto and saved is not None:  # a resumed session goes on with the codecs it was saved with
        codecs = resume.saved_codecs(codecs, saved[1])
    elif codecs.auto:  # measured on a connection of its own, before the hello names the codecs
        codecs, choice = _auto(link, codecs, faults)
    hello = hello_for(model, spec, factory, codecs, push=saved is None)
    if saved is not None:
        resume.check_identity(hello, saved[1], resume_from)
    session, stage = connect_stage(link, codecs, faults, hello, saved, ushape=spec.ushape)
    scheduler = Scheduler(stage, session.outbox, session.lock, schedule, ushape=spec.ushape)
    model_class: Any = type(model)  # hashable: mypy reads nn.Module.__hash__ as the instances'
    try:
        split_model = split_class(model_class)(model, spec, session, stage, scheduler, check_cut=factory.check_cut,
                                               metrics_path=metrics_path, freeze_edge=freeze_edge)
    except BaseException:
        session.close("error")
        raise
    if choice is not None:
        session.metrics.notes["codecs_auto"] = choice.record()
    if saved is not None:
        tree, meta = saved
        resume.load_edge_half(split_model, session, tree, resume_from)
        split_model.mirror.resume(tree["optimizer"], meta["optimizer_id"])
        split_model.cloud_half.has_grad.update(resume.saved_cloud_grads(meta, split_model.cloud_half.params))
    if edge_device is not None:
        split_model.to(edge_device)
    taken_before.remember(split_model.ghosts.chain)
    # A split model the script drops without close() (a sweep's forgotten trial) ends its session
    # when it is collected, so its heartbeat and the cloud's session do not outlive it. Not at exit:
    # the process's end closes the link, and the cloud frees the session at its timeout.
    weakref.finalize(split_model, session.close, "the split model was dropped without close()").atexit = False
    return split_model


def _refuse_split_again(model: nn.Module) -> None:
    """A model split already (a trial loop splitting the same object again) is refused, naming
    what to do: its cloud modules stand in for another session's, which a new one cannot take."""
    if isinstance(model, SplitModel) or any(isinstance(m, Ghost) for m in model.modules()):
        raise ConfigError(
            "this model is split already: its cloud half's modules stand in for an earlier split()'s cloud, and "
            "split() takes a whole model. To go on training, keep using the split model that split() returned; to "
            "split it again (another trial, cut or cloud), take it back whole with unsplit() on that split model "
            "first (unsplit() before close(): after close() the cloud's weights are gone), or split a fresh model "
            "or a copy made before the first split()")


def connect_stage(link: Link, codecs: Codecs, faults: Faults, hello: Hello, saved: tuple[dict, dict] | None, *,
                  ushape: bool) -> tuple[EdgeSession, CloudStage]:
    """The session, opened (or resumed from the edge checkpoint ``saved``), and the stage over it."""
    connection, reconnect = open_link(link)
    session = EdgeSession(connection, codecs=codecs, faults=faults, reconnect=reconnect, follow=follow_link(link))
    try:
        stage = CloudStage(session, SlotCodecs(codecs.specs, codecs.seed), ushape=ushape)
        point = None
        if saved is not None:
            resume.restore_coding(stage, *saved)
            point = resume.resume_point(saved[1])
        session.open(hello, steps=stage, resume=point)
    except BaseException:
        session.drop()
        raise
    return session, stage


def _auto(link: Link, codecs: Codecs, faults: Faults) -> tuple[Codecs, auto_codecs.AutoChoice]:
    if isinstance(link.connect, transports.Connection):  # the one connection there is: probed as it is, then used
        return auto_codecs.resolve(link.connect, codecs, faults.timeout)
    connection, _ = open_link(link)
    try:
        return auto_codecs.resolve(connection, codecs, faults.timeout)
    finally:
        connection.close()


def _given(value: T | None, cls: type[T], name: str) -> T:
    if value is None:
        return cls()
    if not isinstance(value, cls):
        raise ConfigError(f"{name}= takes a splitft.{cls.__name__}(...), got {value!r}")
    return value


def hello_for(model: nn.Module, spec: CutSpec, factory: Factory, codecs: Codecs, *, push: bool = True) -> Hello:
    """The handshake: what the cloud must build, and how both ends code what crosses.

    ``push`` (a fresh session, not a resumed one) sends the cloud part's weights, or their hash
    when the cloud's factory makes its own.
    """
    cut_name, rejoin_name = cut_text(spec, model)
    chain = extract(model, spec)
    refuse_unsupported_layers(chain)  # before the handshake reads their values
    return Hello(
        protocol=protocol.PROTOCOL_VERSION, factory=factory.name, factory_kwargs=dict(factory.kwargs),
        cut=cut_name, rejoin=rejoin_name, fingerprint=fingerprint(chain), codecs=dict(codecs.specs),
        seed=codecs.seed, value_hash=value_hash(chain) if push and factory.weights == "factory" else None,
        weights={k: values_to_send(v) for k, v in chain.qualified_state_dict().items()}
        if push and factory.weights == "push" else None,
        client="splitft", nonce=secrets.token_hex(8), structure=structure(chain), numerics=numerics.settings(),
    )


def open_link(link: Link) -> tuple[transports.Connection, Callable[[], transports.Connection] | None]:
    """The open connection of ``link``, and how to open it again after a fault (None: it cannot be)."""
    target = link.connect
    if isinstance(target, str):
        with translated():
            options = _curve_options(link)

            def reconnect() -> transports.Connection:
                return transports.connect(target, link=link.emulate, **options)

            return reconnect(), reconnect
    if isinstance(target, transports.Connection):
        return transports.emulate(target, link.emulate), None
    opener = target

    def reopen() -> transports.Connection:
        return transports.emulate(opener(), link.emulate)

    return reopen(), reopen


def follow_link(link: Link) -> Callable[[str], transports.Connection] | None:
    """How to reach another rank of the cloud with ``link``'s settings (None: ``link`` is no address)."""
    if not isinstance(link.connect, str):
        return None
    with translated():
        options = _curve_options(link)

    def follow(address: str) -> transports.Connection:
        return transports.connect(address, link=link.emulate, **options)

    return follow


def _curve_options(link: Link) -> dict:
    if link.cloud_key is None:
        return {}
    assert link.key is not None  # Link refuses one key without the other
    public, secret = transports.load_secret_key(link.key)
    return {"server_key": transports.load_public_key(link.cloud_key), "public_key": public, "secret_key": secret}


__all__ = ["connect_stage", "follow_link", "hello_for", "open_link", "split"]
