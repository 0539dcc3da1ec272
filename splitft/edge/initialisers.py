"""torch's initialisers that read what they draw, on a cloud half's parameter.

torch lets a tensor subclass own only some of ``torch.nn.init`` (``normal_``, ``uniform_``,
``constant_``, ``kaiming_uniform_``: :mod:`.placeholders` runs those on fresh values here and pushes
them). The others reach the placeholder as tensor operations, and the ones that read what they
drew (``trunc_normal_`` rejects draws outside its bounds, ``orthogonal_`` takes a QR of them,
``eye_``, ``dirac_`` and ``sparse_`` write through an index) were refused, though the values they
make depend on nothing the cloud holds. So, once a model is split, these functions in
``torch.nn.init`` are wrapped: on a cloud placeholder, torch's own function runs on a fresh tensor
of its shape and dtype on the edge half's device, with the call's arguments and generator (it draws
what the unsplit model's would), and the result is pushed to the cloud; on any other tensor,
torch's function runs as before. A script that imported one by name before importing splitft
holds torch's, which a placeholder still refuses.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch

from .made_here import new_values
from .placeholders import CloudTensor

#: The initialisers wrapped, by name in ``torch.nn.init``.
READING = ("trunc_normal_", "orthogonal_", "eye_", "dirac_", "sparse_")
_INSTALLING = threading.Lock()


def _on_placeholders(original: Callable[..., Any]) -> Callable[..., Any]:
    on_placeholder = new_values(original, no_grad=True)  # as placeholders run torch's own initialisers

    @functools.wraps(original)
    def init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if isinstance(tensor, CloudTensor):
            return on_placeholder(tensor, *args, **kwargs)
        return original(tensor, *args, **kwargs)

    init.__splitft_original__ = original  # type: ignore[attr-defined]
    return init


def install() -> None:
    """Wrap :data:`READING` in ``torch.nn.init``, once per process."""
    with _INSTALLING:
        for name in READING:
            current = getattr(torch.nn.init, name, None)
            if current is not None and not hasattr(current, "__splitft_original__"):
                setattr(torch.nn.init, name, _on_placeholders(current))


__all__ = ["READING", "install"]
