"""Which handler answers each message type: registered by type, one per type.

A server method marked ``@answers(Forward, Backward)`` answers those types; :func:`answer_table`
collects the marks over a server's class and its bases, so a subclass that overrides a marked
method answers with its own, and two methods marked for one type are refused when the table is
built. A type without a handler is not a request the cloud answers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from ..wire import protocol

#: The traffic kind a message type counts as, in a session's metrics (others: ``control``).
_KIND = {"forward": "activation", "output": "activation", "backward": "gradient", "input_grads": "gradient"}

M = TypeVar("M", bound=Callable[..., Any])
#: A message handler: ``(peer, message, seq)`` to the reply (a message, a priced job, or None).
Answer = Callable[[bytes, Any, int], Any]


def answers(*kinds: type[protocol.Message]) -> Callable[[M], M]:
    """Mark a server method as the handler of messages of ``kinds``."""
    def mark(method: M) -> M:
        method.answers = kinds  # type: ignore[attr-defined]
        return method
    return mark


def answer_names(server_class: type) -> dict[type[protocol.Message], str]:
    """Message type → the name of the method of ``server_class`` that answers it; two methods
    marked for one type are a :class:`TypeError`."""
    names: dict[type[protocol.Message], str] = {}
    for cls in reversed(server_class.__mro__):
        for name, member in vars(cls).items():
            for kind in getattr(member, "answers", ()):
                if names.get(kind, name) != name:
                    raise TypeError(f"{kind.__name__} messages have two handlers: {names[kind]} and {name}")
                names[kind] = name
    return names


def answer_table(server: object) -> dict[type[protocol.Message], Answer]:
    """Message type → the bound method of ``server`` that answers it."""
    return {kind: getattr(server, name) for kind, name in answer_names(type(server)).items()}


def traffic_kind(message_type: str) -> str:
    """What a message of ``message_type`` carries, for the metrics: activations, gradients or control."""
    return _KIND.get(message_type, "control")


__all__ = ["Answer", "answer_names", "answer_table", "answers", "traffic_kind"]
