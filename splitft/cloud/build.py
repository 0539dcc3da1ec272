"""Building a session's cloud half from a hello: the factory it names, its cost admitted first.

A hello is checked before anything is built (the protocol version, a canonical codec spec per
slot). The factory's size is counted on the ``meta`` device before anything is allocated, so a
request for a huge model is refused before its memory is taken; the half is then cut as the hello
says and checked against the edge's (parameter names and shapes, and each module's layers and
settings).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import compressors

from ..cut import Chain, check_structure, extract, fingerprint, parse_cut
from ..errors import CapacityError, CutError, HandshakeError
from ..wire.coding import SLOTS
from ..wire.protocol import PROTOCOL_VERSION, Hello
from .blame import short
from .budget import MODEL_STATE_FACTOR
from .limits import Limits


def hello_identity(hello: Hello) -> dict[str, Any]:
    """What a resumed session must agree on with the one it resumes."""
    return {"factory": hello.factory, "factory_kwargs": hello.factory_kwargs, "cut": hello.cut,
            "rejoin": hello.rejoin, "fingerprint": hello.fingerprint, "codecs": hello.codecs, "seed": hello.seed}


def check_version(hello: Hello) -> None:
    """The edge speaks this cloud's protocol."""
    if hello.protocol != PROTOCOL_VERSION:
        raise HandshakeError(f"the edge speaks protocol {hello.protocol}, this cloud speaks "
                             f"{PROTOCOL_VERSION}; install the same splitft version on both")


def check_codecs(codecs: Any) -> None:
    """The hello names a canonical codec spec for every slot."""
    if not isinstance(codecs, dict) or set(codecs) != set(SLOTS) \
            or not all(isinstance(v, str) for v in codecs.values()):
        raise HandshakeError(f"codecs must name a spec for each of {SLOTS}, got {codecs!r}")
    try:
        canonical = {slot: compressors.canonical_spec(spec) for slot, spec in codecs.items()}
    except compressors.CompressionError as exc:
        raise HandshakeError(f"edge asked for a codec this cloud cannot run: {exc}") from exc
    if canonical != codecs:
        raise HandshakeError(f"codec specs are not in canonical form: {codecs} (expected {canonical})")


def count_params(factory: Callable[..., nn.Module], kwargs: dict) -> int | None:
    """Parameters and buffers of the model ``factory`` builds, counted on the meta device.

    The meta device allocates nothing, so a request for a huge model is refused before its
    memory is taken. Factories that cannot build on it (they load files, say) return None.
    """
    try:
        with torch.device("meta"):
            probe = factory(**kwargs)
        return sum(t.numel() for t in (*probe.parameters(), *probe.buffers()))
    except Exception:  # noqa: BLE001 — only a probe; the real build reports errors properly
        return None


def check_factory_kwargs(kwargs: Any) -> None:
    """Factory arguments are a flat map of names to plain values: nothing a factory could be tricked by."""
    plain = (type(None), bool, int, float, str)
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) and k.isidentifier() for k in kwargs):
        raise HandshakeError(f"factory_kwargs must map argument names to values, got a {type(kwargs).__name__}")
    for name, value in kwargs.items():
        items = value if isinstance(value, list) else [value]
        if len(items) > 64 or not all(isinstance(v, plain) for v in items):
            raise HandshakeError(f"factory argument {name!r} must be a plain value (number, string, bool, "
                                 f"None) or a short list of them, got a {type(value).__name__}")


def build_chain(hello: Hello, factories: dict[str, Callable[..., nn.Module]], limits: Limits,
                admit: Callable[[int], None] | None = None) -> tuple[Chain, bool]:
    """Build the cloud half ``hello`` asks for; ``admit`` may refuse its estimated bytes first.

    Returns the cloud half and whether the cut is a U-shape.
    """
    check_factory_kwargs(hello.factory_kwargs)
    if hello.factory not in factories:
        raise HandshakeError(
            f"model factory {hello.factory!r} is not served here; this cloud serves: "
            f"{', '.join(sorted(factories)) or '(none)'} (start it with --model {hello.factory})"
        )
    factory = factories[hello.factory]
    count = count_params(factory, hello.factory_kwargs)
    if count is not None and count > limits.max_model_params:
        raise CapacityError(f"{hello.factory}({hello.factory_kwargs}) has {count} parameters; this cloud builds "
                            f"models of at most {limits.max_model_params}")
    if count is not None and admit is not None:
        admit(MODEL_STATE_FACTOR * 4 * count)  # float32 weights, a gradient and two optimizer moments
    try:
        model = factory(**hello.factory_kwargs)
    except MemoryError:
        raise CapacityError(f"{hello.factory}({short(hello.factory_kwargs)}) does not fit this machine's "
                            "memory") from None
    except Exception as exc:  # noqa: BLE001 — the operator's code, called with the edge's arguments
        # Whatever a factory raises for the values an edge chose (int('x'), a seed that overflows)
        # is the edge's to fix: a typed refusal, never an internal error.
        raise HandshakeError(f"factory {hello.factory!r} rejected its arguments "
                             f"{short(hello.factory_kwargs)}: {type(exc).__name__}: {exc}") from exc
    spec = parse_cut(model, hello.cut, hello.rejoin)
    chain = extract(model, spec)
    mine = fingerprint(chain)
    if mine != hello.fingerprint:
        raise HandshakeError(
            f"the cloud part of {hello.factory!r} cut at {hello.cut!r} differs between edge and cloud "
            f"(fingerprint of its parameters' names, shapes, dtypes, memory layouts and ties {hello.fingerprint} vs "
            f"{mine}); both sides must build the same architecture (same factory arguments, same code version) and lay "
            "its weights out alike (a model converted with .to(memory_format=torch.channels_last) before split() needs "
            "the factory to convert it too; weights tied before split(), layer.weight = other.weight, need the "
            "factory to tie them too)"
        )
    if hello.structure:
        try:
            check_structure(chain, hello.structure)
        except CutError as exc:
            raise HandshakeError(str(exc)) from None
    _leave_edge_hooks_to_the_edge(chain, spec.ushape)
    return chain, spec.ushape


def _leave_edge_hooks_to_the_edge(chain: Chain, ushape: bool) -> None:
    """Drop the hooks of the half's top modules that the edge runs on its stand-ins of them (a
    U-shape trunk's forward pre-hooks and forward hooks, a plain split's first module's forward
    pre-hooks): a model that registers them as it is built (in ``__init__``) has them in the
    factory's copy too, which would run each a second time."""
    for i, stage in enumerate(chain.stages):
        if ushape or i == 0:
            stage._forward_pre_hooks.clear()
            stage._forward_pre_hooks_with_kwargs.clear()
        if ushape:
            stage._forward_hooks.clear()
            stage._forward_hooks_with_kwargs.clear()
            stage._forward_hooks_always_called.clear()


__all__ = ["build_chain", "check_codecs", "check_factory_kwargs", "check_version", "count_params", "hello_identity"]
