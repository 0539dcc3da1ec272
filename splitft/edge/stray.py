"""A plain split's ``model(x)`` whose activation never reaches the cloud half.

Unsplit, ``model(x)`` runs the whole model: in training mode the cloud half's batch norm updates
its running statistics and its dropout draws from the generator. Split, the cloud half runs when
the activation reaches it (a remote loss, ``model.predict``), so an activation left on the edge (a
forward whose output is dropped; batch-norm statistics recomputed with forwards alone, as
``torch.optim.swa_utils.update_bn`` does) would leave the cloud half as it was, and training would
go on silently apart; one whose loss comes after another forward or request would run the cloud
half out of order. Such a forward is refused at the next forward or request, naming the fix, when
it could have changed the cloud half: in training mode, with a cloud layer that keeps running
statistics or one that draws random numbers.

A U-shape trunk has the converse case: its first module's call runs the whole trunk in the cloud,
so a run the forward leaves unfinished (the first module called alone) ran modules that unsplit
would not have; it is refused at the next request on the same terms
(:meth:`TrunkEntry.refuse_unfinished <splitft.edge.standins.TrunkEntry.refuse_unfinished>`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError, UnfinishedForwardError
from . import generator_sets
from .standins import TrunkEntry

#: Where a plain split's ``model(x)`` keeps its :class:`_Crossing`.
_CROSSING = "_splitft_crossing"


class _Crossing:
    """Whether one ``model(x)``'s activation reached the cloud half (kept apart from the activation,
    which the script may drop once it did)."""

    crossed = False


def crossed(out: Any) -> None:
    """``out`` (a plain split's ``model(x)``) reached the cloud half, or the script took the
    activation itself (``out.activation``)."""
    crossing = getattr(out, "__dict__", {}).get(_CROSSING)
    if crossing is not None:
        crossing.crossed = True


def _may_draw(module: nn.Module) -> bool:
    """Whether a training-mode forward of ``module`` may draw random numbers, before its first
    forward said: dropout with a rate, or a layer whose code is not torch's."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return not type(module).__module__.startswith("torch.nn.")


def _keeps_statistics(module: nn.Module) -> bool:
    """Whether a training-mode forward of ``module`` may change what it holds: a norm's running
    statistics, or any persistent buffer of a layer whose code is not torch's."""
    if isinstance(module, nn.modules.batchnorm._NormBase):
        return module.track_running_stats and module.running_mean is not None
    if type(module).__module__.startswith("torch.nn."):
        return False
    return any(name not in module._non_persistent_buffers_set for name in module._buffers)


class StrayForwards:
    """The last plain-split ``model(x)`` made in training mode, until its activation crosses."""

    def __init__(self, cloud_modules: Callable[[], list[nn.Module]], draws: Callable[[], bool | None],
                 trunk: TrunkEntry | None = None, *, session: Any = None) -> None:
        self._cloud_modules = cloud_modules
        self._draws = draws  # whether the cloud half drew in its training-mode forwards (None: none yet)
        self._trunk = trunk
        self._session = session  # closed (or unsplit): its forwards are nothing to the cloud any more
        self._last: _Crossing | None = None
        self._thread = threading.get_ident()  # the script's: where the last model(x) was made
        generator_sets.check_reads(self.refuse_generator_read)

    def explain(self, exc: TypeError) -> None:
        """The trunk's word on a ``TypeError`` out of a U-shape's forward (:meth:`TrunkEntry.explain`)."""
        if self._trunk is not None:
            self._trunk.explain(exc)

    def made(self, out: Any, training: bool) -> None:
        """``model(x)`` returned ``out`` (after :meth:`check`). One recomputed inside a backward
        pass (a checkpoint's, past :meth:`refuse_recomputation`) is no forward of its own."""
        if torch._C._current_graph_task_id() != -1:
            return
        self._last = None
        if training and hasattr(out, "__dict__"):
            self._last = out.__dict__[_CROSSING] = _Crossing()
            self._thread = threading.get_ident()

    def check(self) -> None:
        """Refuse if the last training-mode ``model(x)`` has not reached the cloud half, where that
        forward could have changed it (asked only then: a step whose loss crossed pays nothing); in a
        U-shape split, a run of the trunk left unfinished."""
        if self._trunk is not None:
            self._trunk.refuse_unfinished(self._could_change)
        last, self._last = self._last, None
        if last is None or last.crossed or not self._could_change():
            return
        raise UnfinishedForwardError(
            "a model(x) in training mode had not reached the cloud half (by a remote loss or model.predict) before "
            "the next forward or request: unsplit, that forward ran the whole model at once, updating its "
            "batch-norm running statistics or drawing its dropout masks; split, the cloud half would run it later, "
            "out of order, or never, so training would silently differ from the unsplit model. Compute each loss "
            "right after its model(x); for the whole model's forward use model.predict(x) (it runs the cloud half "
            "in the model's mode, as model(x) does unsplit, e.g. to recompute batch-norm statistics); or call "
            "model.eval() first; or cut a U-shape (rejoin=), whose model(x) is the whole model's")

    def refuse_generator_read(self) -> None:
        """Refuse a read of the generator's state (``torch.get_rng_state``, ``torch.random.fork_rng``
        entering) between a plain split's training-mode ``model(x)`` and its remote loss, where the
        cloud half draws: unsplit its dropout drew at ``model(x)``, so the state read is after those
        draws; split they are drawn at the loss, and the state read (saved, restored) would not be."""
        last = self._last
        if last is None or last.crossed or threading.get_ident() != self._thread or getattr(self._session, "closed",
                                                                                               False):
            return
        draws = self._draws()
        if draws or (draws is None and any(m.training and _may_draw(m) for m in self._cloud_modules())):
            raise ConfigError(
                "the generator's state read (torch.get_rng_state, or torch.random.fork_rng entering) between a plain "
                "split's model(x) and its remote loss, while the cloud half draws random numbers (dropout): "
                "unsplit, those were drawn at model(x) and the state read comes after them; split, the cloud half "
                "draws at the loss, so the state read (kept, or put back by fork_rng) would not be the unsplit "
                "one. Read it before model(x) or after the loss (a teacher's forward under fork_rng before the "
                "student's model(x)), or cut a U-shape (rejoin=), whose model(x) runs the cloud half at once")

    def refuse_recomputation(self, training: bool) -> None:
        """Refuse a training-mode ``model(x)`` made inside a backward pass (a checkpoint around the
        split model recomputing it) where the cloud half keeps running statistics: unsplit, the
        recomputation runs the cloud half's forward a second time, updating them again; split, it
        reaches the edge's layers alone. Dropout needs nothing: the checkpoint draws the same masks
        and puts the generator back."""
        if not training or torch._C._current_graph_task_id() == -1:
            return
        kept = [m for m in self._cloud_modules() if m.training and _keeps_statistics(m)]
        if kept:
            raise ConfigError(
                "a plain split's model(x) recomputed during backward (torch.utils.checkpoint around the split "
                f"model) while a cloud layer keeps running statistics ({type(kept[0]).__name__}): unsplit, the "
                "recomputation runs the whole model again and updates them a second time; split, the cloud half "
                "is not run again, so training would silently differ. Checkpoint the edge's layers inside the "
                "model, or cut a U-shape (rejoin=), whose recomputation runs the cloud half too")

    def keeps_statistics(self) -> bool:
        """Whether a cloud layer in training mode keeps running statistics now."""
        return any(m.training and _keeps_statistics(m) for m in self._cloud_modules())

    def _could_change(self) -> bool:
        """Whether a training-mode forward of the cloud half may change it (its layers as in
        training: the script may have called ``model.eval()`` since, before the next forward)."""
        draws = self._draws()
        if draws:
            return True
        return any(_keeps_statistics(m) or (draws is None and _may_draw(m)) for m in self._cloud_modules())


__all__ = ["StrayForwards", "crossed"]
