"""Defences on what crosses the cut, installed on an already split model from outside the runtime.

``protect(split_model, Defences(...))`` adds hooks and nothing else; the edge and cloud runtimes
do not know about it, and the user's loop does not change:

* **leak loss** (NoPeek, B-SL): a tensor hook on the activation at the cut adds
  ``lambda * d dcor(x, z) / d z`` to the gradient coming back from the cloud. That is exactly the
  gradient of ``loss + lambda * dcor(x, z)`` with respect to the edge's parameters, so the edge
  trains on the penalised objective without the user writing it, and nothing extra crosses.
* **differential privacy on the activation**: a forward pre-hook on the cut's stand-in clips each
  sample's activation to an L2 norm and adds Gaussian noise before the codec sees it.
* **label protection (U-shape)**: a hook on the trunk output's gradient clips and noises, per
  sample, the gradient the edge returns to the cloud, which otherwise carries the labels.
* **adversarial training** against inversion: the edge trains a decoder of its own on each batch
  and adds the gradient that pushes the activation away from what it can decode
  (:mod:`splitft.privacy.adversary`); nothing extra crosses.
* **hijack probes** (U-shape): on random steps the gradient returned to the cloud is scaled, and
  the cloud's answer must scale with it, as any honest backward does
  (:mod:`splitft.privacy.hijack`); a cloud steering the edge stops training.
* **randomized response**: the ``binary`` codec's ``flip_eps`` flips bits inside the codec; the
  accountant counts it with the Gaussian releases (:mod:`splitft.privacy.accountant`).

The noise comes from a generator of the edge's own. It must not be the split's ``seed``: the
cloud knows that one, and noise the cloud can regenerate protects nothing.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..edge.ghosts import standin_of
from ..edge.standins import CutPoint, TrunkEntry
from ..errors import ConfigError, SplitFTError
from .accountant import PrivacyAccountant, calibrate
from .adversary import AdversarialDecoder
from .hijack import HijackDetector, Probe
from .dcor import distance_correlation

if TYPE_CHECKING:
    from ..edge.model import SplitModel

log = logging.getLogger(__name__)


class PrivacyBudgetExceeded(SplitFTError):
    """The next training step would spend more privacy than the budget allows; nothing was sent."""


@dataclass(frozen=True)
class Noise:
    """Per-sample L2 clipping to ``clip``, then Gaussian noise of standard deviation ``noise_multiplier * clip``.

    ``noise_multiplier=None`` lets :func:`protect` calibrate it from the :class:`Budget`.
    ``clip`` is in the units of what is clipped: pick it near the typical per-sample norm
    (larger clips nothing and adds noise in proportion; smaller throws signal away).
    """

    clip: float
    noise_multiplier: float | None = None

    def __post_init__(self) -> None:
        if not _positive(self.clip):
            raise ConfigError(f"Noise(clip=...) must be a finite number > 0, got {self.clip!r}")
        if self.noise_multiplier is not None and not _positive(self.noise_multiplier):
            raise ConfigError(f"Noise(noise_multiplier=...) must be a finite number > 0 or None (calibrated "
                              f"from the budget), got {self.noise_multiplier!r}")


@dataclass(frozen=True)
class Budget:
    """The (epsilon, delta) a run may spend, and how batches sample the training set.

    ``sample_rate`` is batch size / training set size. ``steps`` (or ``epochs``) is the planned
    number of training forwards, needed only to calibrate noise; training beyond the budget is
    refused either way. ``epsilon=math.inf`` tracks what is spent without refusing anything.
    """

    epsilon: float
    delta: float
    sample_rate: float
    steps: int | None = None
    epochs: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.epsilon, (int, float)) and not isinstance(self.epsilon, bool) and self.epsilon > 0):
            raise ConfigError(f"Budget(epsilon=...) must be a number > 0 (math.inf: track only), got {self.epsilon!r}")
        if not (isinstance(self.delta, (int, float)) and 0 < self.delta < 1):
            raise ConfigError(f"Budget(delta=...) must be in (0, 1), got {self.delta!r} (below 1/N for N samples)")
        if not (isinstance(self.sample_rate, (int, float)) and 0 < self.sample_rate <= 1):
            raise ConfigError(f"Budget(sample_rate=...) is batch size / training set size, in (0, 1]; "
                              f"got {self.sample_rate!r}")
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("give Budget(steps=...) or Budget(epochs=...), not both")
        if self.steps is not None and not (isinstance(self.steps, int) and self.steps > 0):
            raise ConfigError(f"Budget(steps=...) must be a positive int, got {self.steps!r}")
        if self.epochs is not None and not _positive(self.epochs):
            raise ConfigError(f"Budget(epochs=...) must be a number > 0, got {self.epochs!r}")

    @property
    def planned_steps(self) -> int | None:
        """Training forwards the noise is calibrated for: ``steps``, or ``epochs`` times the
        ceil(1 / sample_rate) batches an epoch takes (the last one partial)."""
        if self.steps is not None:
            return self.steps
        return None if self.epochs is None else math.ceil(self.epochs * math.ceil(1 / self.sample_rate - 1e-9))


@dataclass(frozen=True)
class Defences:
    """Which defences run on the edge, each off by default.

    Args:
        leak_loss: lambda, the weight of the distance correlation between each batch's input and
            the activation at the cut, added to the user's loss (0: off).
        activations: DP on the activation the edge sends (clipping + Gaussian noise).
        label_gradients: U-shape only: DP on the gradient the edge returns for the trunk's output.
        budget: the (epsilon, delta) to spend; needed with any noise, and it also accounts for
            the ``binary`` codec's randomized response when that is on.
        adversarial: weight of adversarial training against inversion: the edge trains its own
            decoder on each batch and its activations away from it (0: off).
        probe: U-shape only: check with scaled-gradient probes that the cloud's gradients are the
            backward of what the edge sent, and stop training with CloudMisbehaving when not.
        seed: seed of the edge's private noise generator; None draws one from the OS. Never
            reuse the split's ``seed``, which the cloud knows.
    """

    leak_loss: float = 0.0
    activations: Noise | None = None
    label_gradients: Noise | None = None
    budget: Budget | None = None
    seed: int | None = None
    adversarial: float = 0.0
    probe: Probe | None = None

    def __post_init__(self) -> None:
        for name in ("leak_loss", "adversarial"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ConfigError(f"Defences({name}=...) is a weight >= 0, got {value!r}")
        for name in ("activations", "label_gradients"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Noise):
                raise ConfigError(f"Defences({name}=...) takes a Noise(clip=..., noise_multiplier=...), got {value!r}")
            if value is not None and self.budget is None:
                raise ConfigError(f"Defences({name}=Noise(...)) needs budget=Budget(epsilon, delta, sample_rate) "
                                  "so that the privacy spent can be tracked")
            if value is not None and value.noise_multiplier is None and (
                    self.budget is None or self.budget.planned_steps is None or math.isinf(self.budget.epsilon)):
                raise ConfigError(f"Defences({name}=Noise(noise_multiplier=None)) is calibrated from the budget: give "
                                  "a finite Budget(epsilon=...) with steps=... or epochs=..., or a noise_multiplier")
        if self.probe is not None and not isinstance(self.probe, Probe):
            raise ConfigError(f"Defences(probe=...) takes a Probe(...), got {self.probe!r}")
        if self.budget is not None and not isinstance(self.budget, Budget):
            raise ConfigError(f"Defences(budget=...) takes a Budget(...), got {self.budget!r}")

    @property
    def any(self) -> bool:
        return (bool(self.leak_loss) or bool(self.adversarial) or self.activations is not None
                or self.label_gradients is not None or self.probe is not None)


def _positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def clip_and_noise(x: torch.Tensor, clip: float, noise_multiplier: float,
                   generator: torch.Generator) -> torch.Tensor:
    """Each sample (row of dim 0) scaled to L2 norm at most ``clip``, plus N(0, (noise_multiplier * clip)²).

    Differentiable in ``x`` (through the clipping); the noise is drawn on the CPU from
    ``generator`` so that a seed reproduces it on any device.
    """
    if x.dim() == 0:
        raise ConfigError("per-sample clipping needs a batch dimension; what crosses here is a scalar")
    norms = x.reshape(x.shape[0], -1).norm(dim=1)
    factor = (clip / norms.clamp(min=1e-12)).clamp(max=1.0)
    clipped = x * factor.reshape(-1, *([1] * (x.dim() - 1))).to(x.dtype)
    noise = torch.randn(x.shape, generator=generator, dtype=torch.float32)
    return clipped + (noise * (noise_multiplier * clip)).to(device=x.device, dtype=x.dtype)


Watcher = Callable[[str, torch.Tensor], None]


@dataclass
class _Call:
    """What one forward through the cut needs until its backward."""

    charged: bool
    inputs: torch.Tensor | None = None
    factor: float = 1.0  # the hijack probe's scale of the gradient returned (1: an ordinary step)
    sent_norm: float | None = None  # norm of the gradient returned to the cloud, once sent


@dataclass
class Protection:
    """The defences installed on one split model: hooks, the noise generator and the accountant.

    ``split_model.privacy`` after :func:`protect`. :meth:`spent` is the epsilon spent so far.
    """

    defences: Defences
    ushape: bool
    accountant: PrivacyAccountant | None
    generator: torch.Generator
    is_training: Callable[[], bool]
    rr: tuple[float, int] | None = None  # (eps per bit, bits per sample) once the first forward shows the bits
    rr_eps: float | None = None
    noise_multipliers: dict[str, float] = field(default_factory=dict)
    steps: int = 0  # training forwards through the cut
    last_leak: float | None = None  # distance correlation of the last batch whose leak loss was applied
    adversary: AdversarialDecoder | None = None
    detector: HijackDetector | None = None
    _input: torch.Tensor | None = None
    _pending: _Call | None = None
    _resolved: bool = False
    _owner: list[Any] = field(default_factory=list)  # the split model (a list: no module registration)
    _handles: list[Any] = field(default_factory=list)
    _watchers: list[Watcher] = field(default_factory=list)

    # ------------------------------------------------------------ reporting

    def spent(self) -> float:
        """Epsilon spent so far at the budget's delta (0 with no accounted mechanism)."""
        return self.accountant.epsilon() if self.accountant is not None else 0.0

    def snapshot(self) -> dict[str, Any]:
        """Plain-dict state for metrics records."""
        budget = self.defences.budget
        return {"epsilon": self.spent(), "delta": budget.delta if budget else None,
                "epsilon_budget": budget.epsilon if budget else None, "steps": self.steps,
                "noise_multipliers": dict(self.noise_multipliers), "randomized_response_eps": self.rr_eps,
                "leak_loss": self.defences.leak_loss, "last_distance_correlation": self.last_leak,
                "probe": self.detector.snapshot() if self.detector is not None else None}

    def watch(self, watcher: Watcher) -> Callable[[], None]:
        """Call ``watcher(kind, tensor)`` with what is handed to the codec after the defences:
        ``"activation"`` (edge → cloud) and ``"label_gradient"`` (U-shape, edge → cloud).
        For measurements (attacks as metrics); returns a function that stops watching."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    def remove(self) -> None:
        """Take every hook off; the split model then runs undefended."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for owner in self._owner:
            if getattr(owner, "privacy", None) is self:
                owner.privacy = None
        self._owner.clear()

    # ------------------------------------------------------------ the noise levels

    def _resolve(self, bits: int) -> None:
        """Noise multipliers, calibrated once the first forward shows the activation's size."""
        if self.rr_eps is not None:
            self.rr = (self.rr_eps, bits)
        mechanisms = {k: v for k, v in (("activations", self.defences.activations),
                                         ("label_gradients", self.defences.label_gradients)) if v is not None}
        fixed = {k: v.noise_multiplier for k, v in mechanisms.items() if v.noise_multiplier is not None}
        free = [k for k, v in mechanisms.items() if v.noise_multiplier is None]
        self.noise_multipliers = dict(fixed)
        if free:
            budget = self.defences.budget
            assert budget is not None and budget.planned_steps is not None
            target = calibrate(epsilon=budget.epsilon, delta=budget.delta, sample_rate=budget.sample_rate,
                               steps=budget.planned_steps, rr=self.rr)
            # Both releases of a step share its sampled batch: together they are one Gaussian
            # mechanism whose multiplier s satisfies 1/s² = sum of 1/s_i². The calibrated ones
            # share what the fixed ones leave.
            left = target ** -2 - sum(s ** -2 for s in fixed.values())
            if left <= 0:
                raise ConfigError(f"the fixed noise multipliers {fixed} already spend the whole budget; "
                                  "raise them or the budget")
            for name in free:
                self.noise_multipliers[name] = math.sqrt(len(free) / left)
        log.info("privacy: noise multipliers %s, randomized response %s", self.noise_multipliers, self.rr)

    @property
    def step_multiplier(self) -> float | None:
        """The one multiplier equivalent to a training step's Gaussian releases (None: none)."""
        if not self.noise_multipliers:
            return None
        return sum(s ** -2 for s in self.noise_multipliers.values()) ** -0.5

    # ------------------------------------------------------------ accounting

    def _charge(self) -> None:
        """Account for one training forward, refusing it first if it would exceed the budget."""
        self.steps += 1
        if self.accountant is None or (self.step_multiplier is None and self.rr is None):
            return
        budget = self.defences.budget
        assert budget is not None
        after = self.accountant.epsilon_if(noise_multiplier=self.step_multiplier, sample_rate=budget.sample_rate,
                                           rr=self.rr)
        if after > budget.epsilon * (1 + 1e-9):
            self.steps -= 1
            raise PrivacyBudgetExceeded(
                f"this training step would bring the privacy spent to epsilon={after:.4g} (delta={budget.delta:g}), "
                f"over the budget of {budget.epsilon:g}; {self.accountant.steps} steps were taken and spent "
                f"{self.accountant.epsilon():.4g}. Nothing was sent. Stop training here, or plan a new run "
                "with a larger budget, more noise, or fewer steps"
            )
        if self.step_multiplier is not None:
            self.accountant.step(noise_multiplier=self.step_multiplier, sample_rate=budget.sample_rate)
        if self.rr is not None:
            self.accountant.randomized_response_step(eps_bit=self.rr[0], bits=self.rr[1],
                                                     sample_rate=budget.sample_rate)

    # ------------------------------------------------------------ hooks

    def _notify(self, kind: str, tensor: torch.Tensor) -> None:
        for watcher in list(self._watchers):
            watcher(kind, tensor.detach())

    def _capture_input(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._input = next((v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)), None)

    def _before_cut(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not args or not isinstance(args[0], torch.Tensor):
            if self.defences.any or self.rr_eps is not None:
                raise ConfigError(f"the defences act on the activation crossing the cut, the first argument of the "
                                  f"first cloud module, but it is a {type(args[0]).__name__ if args else 'nothing'}")
            return None
        z = args[0]
        if z.dim() == 0:
            raise ConfigError("the activation crossing the cut has no batch dimension; per-sample defences need one")
        if not self._resolved:
            self._resolve(bits=z[0].numel() if z.shape[0] else z.numel())
            self._resolved = True
        charged = self.is_training() and torch.is_grad_enabled()
        if charged:
            self._charge()
        call = _Call(charged=charged, inputs=self._input)
        if self.detector is not None:
            self.detector.refuse_if_tripped()
            if charged and z.requires_grad:
                call.factor = self.detector.draw()
                z.register_hook(self._probe_hook(call))  # first: it sees the cloud's answer as it came
        if self.defences.leak_loss and charged and z.requires_grad and z.shape[0] >= 2 and call.inputs is not None:
            inputs = call.inputs.detach().reshape(z.shape[0], -1).float() if call.inputs.shape[0] == z.shape[0] else None
            if inputs is not None:
                z.register_hook(self._leak_hook(inputs, z.detach()))
        if self.adversary is not None and charged and z.requires_grad and call.inputs is not None \
                and call.inputs.shape[0] == z.shape[0]:
            z.register_hook(self.adversary.hook(call.inputs, z))
        if self.defences.activations is not None:
            z = clip_and_noise(z, self.defences.activations.clip, self.noise_multipliers["activations"],
                               self.generator)
        self._notify("activation", z)
        self._pending = call
        return (z, *args[1:]), kwargs

    def _probe_hook(self, call: _Call) -> Callable[[torch.Tensor], torch.Tensor]:
        detector = self.detector
        assert detector is not None

        def check_answer(grad: torch.Tensor) -> torch.Tensor:
            if call.sent_norm is not None:
                detector.check(call.factor, call.sent_norm, float(grad.detach().float().norm()))
            return grad / call.factor if call.factor != 1.0 else grad

        return check_answer

    def _leak_hook(self, inputs: torch.Tensor, z: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
        weight = float(self.defences.leak_loss)

        def add_leak_gradient(grad: torch.Tensor) -> torch.Tensor:
            with torch.enable_grad():
                leaf = z.detach().requires_grad_()
                value = distance_correlation(inputs, leaf)
                (extra,) = torch.autograd.grad(value, leaf)
            self.last_leak = float(value)
            return grad + weight * extra.to(grad.dtype)

        return add_leak_gradient

    def _after_trunk(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        noise = self.defences.label_gradients
        entry = standin_of(module)
        if isinstance(entry, TrunkEntry) and entry.last is not None:
            # A trunk of several modules hands the forward an inner output that carries no gradient;
            # the trunk's own output, which the last module hands on, is the one the edge answers.
            output = entry.last
        stream = output if isinstance(output, torch.Tensor) else (
            output[0] if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor) else None)
        if (noise is None and not self._watchers and self.detector is None) or stream is None \
                or not stream.requires_grad:
            return
        call = self._pending or _Call(charged=False)

        def protect_gradient(grad: torch.Tensor) -> torch.Tensor:
            if noise is None:  # only watched, or probed
                return self._probed(call, grad)
            if not call.charged:  # a backward through an uncounted forward: count it before it is sent
                self._charge()
                call.charged = True
            protected = clip_and_noise(grad, noise.clip, self.noise_multipliers["label_gradients"], self.generator)
            return self._probed(call, protected)

        stream.register_hook(protect_gradient)


    def _probed(self, call: _Call, grad: torch.Tensor) -> torch.Tensor:
        """The gradient as sent: scaled on a probed step, its norm kept for the check of the answer."""
        if call.factor != 1.0:
            grad = grad * call.factor
        if self.detector is not None:
            call.sent_norm = float(grad.detach().float().norm())
        self._notify("label_gradient", grad)
        return grad


def _standin(split_model: SplitModel) -> nn.Module:
    """The module that stands for the first cloud module in the user's model (installed by split())."""
    spec, model = split_model.spec, split_model.wrapped
    parent = model.get_submodule(spec.parent) if spec.parent else model
    children = list(parent.children())
    standin = children[spec.start] if spec.start < len(children) else None
    if standin is None or not isinstance(standin_of(standin), (CutPoint, TrunkEntry)):
        raise ConfigError(f"protect() expects a model returned by splitft.split(); the module at the cut is a "
                          f"{type(standin).__name__}, not the cut's stand-in")
    return standin


def _randomized_response_eps(split_model: SplitModel) -> float | None:
    """The forward codec's randomized-response eps per bit (``binary:flip_eps=...``), or None."""
    import compressors

    try:
        spec = split_model.session.codecs.specs["fwd"]
    except (AttributeError, KeyError):
        raise ConfigError("protect() cannot find this split model's forward codec (split_model.session.codecs."
                          "specs['fwd']), so it cannot tell whether randomized response must be accounted") from None
    name, options = compressors.parse_spec(spec)
    eps = options.get("flip_eps") if name == "binary" else None
    return None if eps is None else float(eps)


def protect(split_model: SplitModel, defences: Defences) -> Protection:
    """Install ``defences`` on a model returned by :func:`splitft.split`; returns the :class:`Protection`.

    Also kept as ``split_model.privacy``. Call it before training; the user's loop stays as it is.
    """
    if not isinstance(defences, Defences):
        raise ConfigError(f"protect() takes a Defences(...), got {defences!r}")
    if getattr(split_model, "privacy", None) is not None:
        raise ConfigError("this split model is already protected; call split_model.privacy.remove() first")
    ushape = bool(split_model.spec.ushape)
    if defences.label_gradients is not None and not ushape:
        raise ConfigError("label_gradients protects the gradient a U-shape edge returns to the cloud; in a plain "
                          "split the labels cross with the batch (cut U-shape with rejoin= to keep them on the edge)")
    if defences.probe is not None and not ushape:
        raise ConfigError("the hijack probe checks the gradient a U-shape edge returns to the cloud against the "
                          "cloud's answer; in a plain split the edge returns none (cut U-shape with rejoin=)")
    rr_eps = _randomized_response_eps(split_model)
    budget = defences.budget
    seed = defences.seed if defences.seed is not None else secrets.randbits(63)
    protection = Protection(
        defences=defences, ushape=ushape,
        accountant=PrivacyAccountant(budget.delta) if budget is not None else None,
        generator=torch.Generator().manual_seed(seed), is_training=lambda: bool(split_model.training),
        rr_eps=rr_eps,
    )
    if rr_eps is not None and budget is None:
        log.warning("the binary codec's randomized response is on but no Budget was given: it is not accounted")
        protection.rr_eps = None
    standin = _standin(split_model)
    if defences.probe is not None:  # a stream of its own: the noise stays as the seed makes it
        protection.detector = HijackDetector(defences.probe, torch.Generator().manual_seed(seed ^ 0x5EED))
    if defences.adversarial:
        protection.adversary = AdversarialDecoder(float(defences.adversarial), seed=seed % 2**31)
    if defences.leak_loss or defences.adversarial:
        protection._handles.append(split_model.wrapped.register_forward_pre_hook(protection._capture_input,
                                                                                with_kwargs=True))
    protection._handles.append(standin.register_forward_pre_hook(protection._before_cut, with_kwargs=True))
    if ushape:  # protects label gradients, or only shows them to watchers
        protection._handles.append(standin.register_forward_hook(protection._after_trunk, with_kwargs=True))
    protection._owner.append(split_model)
    split_model.privacy = protection
    return protection
