"""torch.nn.utils functions that change a module's structure, refused by name on a cloud module.

A parametrization registered or removed on a module of the cloud half after ``split()``, or a
global pruning over layers some of which run in the cloud, reaches the edge's ghost only: the
cloud's module keeps what the factory built. Each was refused already, but from deep inside
torch (a placeholder's ``set_``, a computation on cloud weights with gradients on) with words that
named another fix. Once a model is split these functions are wrapped: a call that touches a cloud
module raises a :class:`~splitft.errors.CutError` naming the function and what to do, before
anything changed; any other call runs torch's function as before.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable
from typing import Any

from torch import nn
from torch.nn.utils import parametrize, prune

from ..errors import CutError

_INSTALLING = threading.Lock()


def _where(module: Any) -> str | None:
    """The name of the cloud module ``module`` stands for on the edge (None: an edge module)."""
    return getattr(module, "__dict__", {}).get("_splitft_where") if isinstance(module, nn.Module) else None


def _refused(what: str, where: str, fix: str) -> CutError:
    return CutError(f"{what} on {where!r} after split(): that module runs in the cloud, built by the factory, and "
                    f"would not change with it (split training would silently differ). {fix}")


_IN_FACTORY = "Do it in the factory too (the cloud builds the model with it) and before split()"


def _on_a_module(what: str, fix: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wraps a function of ``(module, tensor_name, ...)``: refused where the module is a cloud one."""
    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def refusing(module: nn.Module, tensor_name: str, *args: Any, **kwargs: Any) -> Any:
            if (where := _where(module)) is not None:
                raise _refused(f"{what} of {tensor_name!r}", where, fix)
            return original(module, tensor_name, *args, **kwargs)
        return refusing
    return wrap


def _global_prune(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def global_unstructured(parameters: Iterable[tuple[nn.Module, str]], *args: Any, **kwargs: Any) -> Any:
        parameters = list(parameters)
        cloud = next((where for module, _ in parameters if (where := _where(module)) is not None), None)
        if cloud is not None:
            raise _refused("prune.global_unstructured", cloud, "Prune before split() (and make it permanent with "
                           "prune.remove, in the factory too), or, mid-training, zero the values themselves: "
                           "w[w.abs() <= threshold] = 0 under torch.no_grad(), and p.grad[mask] = 0 after each "
                           "backward, the threshold taken over model.state_dict()'s weights.")
        return original(parameters, *args, **kwargs)
    return global_unstructured


_WRAPPED = ((parametrize, "register_parametrization", _on_a_module("registering a parametrization", _IN_FACTORY + ".")),
            (parametrize, "remove_parametrizations", _on_a_module(
                "removing the parametrization", _IN_FACTORY + ", or take the model whole with model.unsplit() and "
                "remove it there.")),
            (prune, "global_unstructured", _global_prune))


def install() -> None:
    """Wrap the functions above in their torch modules, once per process. A script that imported
    one by name before importing splitft holds torch's, which fails as it did."""
    with _INSTALLING:
        for owner, name, wrap in _WRAPPED:
            current = getattr(owner, name)
            if not hasattr(current, "__splitft_original__"):
                wrapped = wrap(current)
                wrapped.__splitft_original__ = current  # type: ignore[attr-defined]
                setattr(owner, name, wrapped)


__all__ = ["install"]
