"""What the edges of a shared cloud half may set: the cloud's choice, made on its command line.

A shared half (``--shared-model``) is every edge's: whatever one edge sets there, every other edge
trains with. So the settings that shape it are not taken from the first edge that asks (which
could then refuse every later edge, or freeze the whole half) but decided by the cloud:

* ``--shared-optimizer NAME[:{json settings}]``: the half's one optimizer, built by the cloud. An
  edge's attached optimizer must be that class with those settings (every group's), and a
  learning rate at most the cloud's; each step's learning rate is one value in ``[0, lr]`` (a
  scheduler that decays it is fine, one that raises it is not), and a scheduler may change no
  other setting. Without the flag a shared half takes no optimizer: it serves forward calls only.
* ``--shared-frozen NAME,...``: the half's parameters that do not train (by their names in the
  unsplit model); an edge's frozen set must be the same.
* ``--server-lr LR``: split learning rates (SGLR). The half steps at ``LR`` whatever the edges'
  steps carry, and an edge's learning rate is its own half's alone (the client-side rate: its
  optimizer's, set by its script or ``splitft edge --lr``), neither bounded by the cloud's nor
  sent to the half. The other settings are checked as without it.

An edge that asks for anything else is refused with ``policy``, naming the flag; nothing it sent
is applied.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..wire import operations as o
from ..errors import ConfigError, PolicyError
from .blame import short

#: Settings that choose an implementation (the cloud's own, for its device), not the arithmetic.
_IMPLEMENTATION = frozenset({"foreach", "fused", "capturable", "differentiable"})


@dataclass(frozen=True)
class SharedPolicy:
    """The cloud's settings for shared halves (see the module docstring).

    Attributes:
        optimizer: a ``torch.optim`` class name; None: the half takes no optimizer.
        settings: its settings; ``lr`` is also the most any step may use.
        frozen: names (in the unsplit model) of the parameters that do not train.
        server_lr: the half's own learning rate (``--server-lr``), or None: the edges' steps set it.
    """

    optimizer: str | None = None
    settings: dict[str, Any] = field(default_factory=dict)
    frozen: frozenset[str] = frozenset()
    server_lr: float | None = None
    _defaults: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lr = self.server_lr
        if lr is not None and not (isinstance(lr, (int, float)) and not isinstance(lr, bool)
                                   and math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"--server-lr must be a finite learning rate >= 0, got {lr!r}")
        if lr is not None and self.optimizer is None:
            raise ConfigError("--server-lr is the shared half's learning rate: give its optimizer too "
                              "(--shared-optimizer NAME:{settings})")
        if lr is not None:
            object.__setattr__(self, "settings", {**self.settings, "lr": float(lr)})
        if self.optimizer is not None:  # an optimizer torch cannot build is refused when the cloud starts
            object.__setattr__(self, "_defaults", self._probe())

    @classmethod
    def parse(cls, optimizer: str | None, frozen: str | None, server_lr: float | None = None) -> SharedPolicy:
        """From ``--shared-optimizer NAME[:{json}]``, ``--shared-frozen NAME,...`` and ``--server-lr``."""
        settings: dict[str, Any] = {}
        name = optimizer
        if optimizer is not None and ":" in optimizer:
            name, text = optimizer.split(":", 1)
            try:
                settings = json.loads(text)
            except ValueError as exc:
                raise ConfigError(f"--shared-optimizer {optimizer!r}: the settings after ':' must be a JSON object "
                                  f"such as {{\"lr\": 0.01}} ({exc})") from None
            if not isinstance(settings, dict):
                raise ConfigError(f"--shared-optimizer {optimizer!r}: the settings must be a JSON object")
        names = frozenset(n.strip() for n in (frozen or "").split(",") if n.strip())
        return cls(name, settings, names, server_lr)

    # ------------------------------------------------------------ the optimizer

    def defaults(self) -> dict[str, Any]:
        """Every setting of the cloud's optimizer, its own defaults included (plain values)."""
        if self.optimizer is None:
            raise self._no_optimizer()
        return self._defaults

    def _probe(self) -> dict[str, Any]:
        cls = getattr(torch.optim, self.optimizer or "", None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            raise ConfigError(f"--shared-optimizer: {self.optimizer!r} is not a torch.optim optimizer")
        try:
            probe = cls([torch.zeros(1, requires_grad=True)], **self.settings)
        except Exception as exc:  # optimizers raise TypeError, ValueError for bad settings
            raise ConfigError(f"--shared-optimizer: cannot build {self.optimizer} with {self.settings}: {exc}") from None
        lr = probe.defaults.get("lr")
        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and math.isfinite(lr) and lr >= 0):
            raise ConfigError(f"--shared-optimizer: {self.optimizer} needs a finite learning rate 'lr', got {lr!r}")
        return {k: _plain(v) for k, v in probe.defaults.items()}

    def build(self, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
        """The half's optimizer: one group of every parameter, with the cloud's settings."""
        if self.optimizer is None:
            raise self._no_optimizer()
        return getattr(torch.optim, self.optimizer)(params, **self.settings)

    def check_attach(self, name: str, settings: dict, groups: list | None, names: Iterable[str]) -> None:
        """Refuse an edge's optimizer unless it is the cloud's.

        ``settings``/``groups`` are the edge's (:class:`~splitft.wire.operations.AttachOptimizer`);
        ``names`` are the half's parameters. Every group must have the cloud's settings (a
        learning rate at most the cloud's), and together the groups must hold every parameter that
        trains: the cloud's optimizer steps them all.
        """
        if self.optimizer is None:
            raise self._no_optimizer()
        if name != self.optimizer:
            raise PolicyError(f"this cloud half is shared and trains with {self.describe()} (--shared-optimizer); "
                              f"this edge attached {short(name)}")
        cloud = self.defaults()
        per_group = [settings] if groups is None else [{**settings, **g["settings"]} for g in groups]
        for group in per_group:
            for key, value in group.items():
                self._check_setting(key, value, cloud)
        if groups is not None:
            held = {n for g in groups for n in g["names"]}
            missing = sorted(set(names) - self.frozen - held)
            if missing:
                raise PolicyError(f"the shared half's optimizer (--shared-optimizer) steps every parameter that trains; "
                                  f"this edge's leaves out {short(missing)}: attach one over all of them, or ask "
                                  "the cloud's operator to freeze those (--shared-frozen)")

    def _check_setting(self, key: Any, value: Any, cloud: dict[str, Any]) -> None:
        if key in _IMPLEMENTATION:
            return
        if key not in cloud:
            raise PolicyError(f"{self.describe()} (--shared-optimizer) has no setting {short(key)}")
        if key == "lr":
            if self.server_lr is None:
                self.check_lr(value)
            elif not _number_or_none(value):
                raise PolicyError(f"a learning rate must be a number, got {short(value)}")
        elif _plain(value) != cloud[key]:
            raise PolicyError(f"this cloud half is shared and trains with {key}={cloud[key]!r} (--shared-optimizer "
                              f"{self.describe()}); this edge asks for {key}={short(value)}")

    def check_lr(self, lr: Any) -> float:
        """A learning rate an edge may step a shared half with: in ``[0, the cloud's lr]``."""
        most = self.defaults()["lr"]
        if not (isinstance(lr, (int, float)) and not isinstance(lr, bool) and 0 <= lr <= most):
            raise PolicyError(f"a shared half's learning rate is at most {most} (--shared-optimizer "
                              f"{self.describe()}); this edge's is {short(lr)}")
        return float(lr)

    def step_lr(self, op: o.Step) -> float | None:
        """The one learning rate a step sets on the shared optimizer (None: it keeps its own).

        Groups on the edge may not step at different rates (the half has one group), and a
        scheduler may change no setting but the learning rate.
        """
        rates = op.lrs if op.lrs is not None else [op.lr]
        if self.server_lr is not None:
            self._check_changes(op)
            return self.server_lr  # split rates: the edge's rate is its own half's
        if not (isinstance(rates, list) and rates and all(_number_or_none(r) for r in rates) and len(set(rates)) == 1):
            raise PolicyError(f"a shared half has one learning rate (--shared-optimizer {self.describe()}); this "
                              f"step's groups have {short(rates)}")
        self._check_changes(op)
        return None if rates[0] is None else self.check_lr(rates[0])

    def _check_changes(self, op: o.Step) -> None:
        cloud = self.defaults()
        for changes in op.changes or []:
            if not isinstance(changes, dict):
                raise PolicyError(f"a group's changed settings must be a map, got {short(changes)}")
            for key, value in changes.items():
                self._check_setting(key, value, cloud)

    # ------------------------------------------------------------ frozen parameters

    def freeze(self, named: dict[str, torch.nn.Parameter]) -> None:
        """Set the half's ``requires_grad`` from ``--shared-frozen`` (named: the half's parameters)."""
        unknown = sorted(self.frozen - set(named))
        if unknown:
            raise ConfigError(f"--shared-frozen names {short(unknown)}, which this cloud half does not have; its "
                              f"parameters are {short(sorted(named))}")
        for name, param in named.items():
            param.requires_grad_(name not in self.frozen)

    def check_frozen(self, names: list) -> None:
        """Refuse an edge's frozen set unless it is the cloud's."""
        asked = set(names)
        if asked != self.frozen:
            raise PolicyError(f"this cloud half is shared and its frozen parameters are the cloud's choice: "
                              f"{short(sorted(self.frozen)) if self.frozen else 'none'} (--shared-frozen); this "
                              f"edge freezes {short(sorted(asked))}")

    # ------------------------------------------------------------ messages

    def describe(self) -> str:
        if not self.optimizer:
            return "no optimizer"
        rates = ", its own rate (--server-lr)" if self.server_lr is not None else ""
        return f"{self.optimizer}({json.dumps(self.settings, sort_keys=True)}){rates}"

    def _no_optimizer(self) -> PolicyError:
        return PolicyError("this cloud half is shared: its optimizer is the cloud's choice, and this cloud sets none "
                           "(its operator may start it with --shared-optimizer NAME:{settings}); it serves forward "
                           "calls only")


def _plain(value: Any) -> Any:
    """Tuples as lists, as they cross the wire, so the cloud's settings compare with an edge's."""
    return [_plain(v) for v in value] if isinstance(value, (list, tuple)) else value


def _number_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


__all__ = ["SharedPolicy"]
