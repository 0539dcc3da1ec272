"""Privacy spent over a run, by opacus's RDP accountant, with randomized response composed in.

Every Gaussian release (noisy activations, noisy label gradients) goes to
:class:`opacus.accountants.RDPAccountant` as one step of the sampled Gaussian mechanism: a
noise multiplier and a sample rate. When nothing else is released, :meth:`PrivacyAccountant.epsilon`
is exactly that accountant's ``get_epsilon(delta)``.

B-SL's randomized response (the ``binary`` codec's ``flip_eps``: each bit flipped with
probability 1 / (1 + e^eps)) is not a Gaussian mechanism, so opacus has no history entry for it.
It joins the same Rényi-DP sum by this rule, written down so that it can be checked:

* one bit is binary randomized response, whose Rényi divergence of order a is exactly
  ``log(p e^((a-1)eps) + q e^(-(a-1)eps)) / (a-1)``, p = e^eps / (1 + e^eps), q = 1 - p;
* a sample's activation of D bits is D such bits (a different input may change every bit), so
  its order-a divergence is D times that;
* with shuffled epochs each sample crosses once per epoch, so after ``steps`` training forwards
  at sample rate r a sample has crossed ceil(steps * r) times, and the divergences add up that
  many times. No amplification by subsampling is claimed for this part.

The total order-a divergence (Gaussian part from opacus's ``compute_rdp``, plus the above) is turned
into (eps, delta) with opacus's ``get_privacy_spent``, over the same orders as the accountant.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from ..errors import ConfigError

ORDERS: list[float] = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))  # as RDPAccountant's


def _opacus() -> Any:
    try:
        from opacus.accountants import RDPAccountant
        from opacus.accountants.analysis import rdp as analysis
    except ImportError:
        raise ConfigError("privacy accounting needs opacus: pip install -c constraints.txt -e '.[privacy]'") from None
    return RDPAccountant, analysis


@contextmanager
def _quiet() -> Iterator[None]:
    """opacus warns when the best order is at the end of its range; the bound is still valid."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Optimal order is the")
        yield


def randomized_response_rdp(eps_bit: float, bits: int, orders: list[float] = ORDERS) -> np.ndarray:
    """Order-a Rényi divergence of one release of ``bits`` bits each flipped with eps-randomized response."""
    a = np.asarray(orders, dtype=np.float64)
    log_p = -np.logaddexp(0.0, -eps_bit)  # log(e^eps / (1 + e^eps))
    log_q = -np.logaddexp(0.0, eps_bit)
    per_bit = np.logaddexp(log_p + (a - 1) * eps_bit, log_q - (a - 1) * eps_bit) / (a - 1)
    return bits * np.minimum(per_bit, eps_bit)  # eps-DP also bounds every order by eps


class PrivacyAccountant:
    """What one run has spent: Gaussian steps (opacus) and randomized-response releases.

    ``step`` records a training forward's Gaussian release; ``randomized_response_step`` a
    training forward whose activation crossed through randomized response. ``epsilon_if`` says
    what the total would be after one more such step, so a run can refuse it before sending.
    """

    def __init__(self, delta: float) -> None:
        if not (isinstance(delta, (int, float)) and 0 < delta < 1):
            raise ConfigError(f"delta must be a number in (0, 1), got {delta!r} (1/N² for N samples is usual)")
        rdp_accountant, _ = _opacus()
        self.delta = float(delta)
        self.gaussian = rdp_accountant()
        self.rr_steps: dict[tuple[float, int, float], int] = {}  # (eps per bit, bits, sample rate) -> forwards
        self._unit: dict[tuple[float, float], np.ndarray] = {}

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """One training forward released a Gaussian-noised value of each sampled example."""
        self.gaussian.step(noise_multiplier=float(noise_multiplier), sample_rate=float(sample_rate))

    def randomized_response_step(self, *, eps_bit: float, bits: int, sample_rate: float) -> None:
        """One training forward sent the batch's activations (``bits`` per sample) through randomized response."""
        key = (float(eps_bit), int(bits), float(sample_rate))
        self.rr_steps[key] = self.rr_steps.get(key, 0) + 1

    @property
    def steps(self) -> int:
        """Training forwards recorded (Gaussian steps, or randomized-response ones when there are none)."""
        gaussian = sum(n for _, _, n in self.gaussian.history)
        return gaussian or sum(self.rr_steps.values())

    def _gaussian_rdp(self, sigma: float, rate: float) -> np.ndarray:
        """One step's order-a divergences (cached: a run repeats the same few settings)."""
        key = (float(sigma), float(rate))
        if key not in self._unit:
            _, analysis = _opacus()
            self._unit[key] = np.asarray(analysis.compute_rdp(q=rate, noise_multiplier=sigma, steps=1, orders=ORDERS))
        return self._unit[key]

    def rdp(self, extra_gaussian: tuple[float, float] | None = None,
            extra_rr: tuple[float, int, float] | None = None) -> np.ndarray:
        """Total order-a Rényi divergence over :data:`ORDERS` (with one more step of each ``extra``)."""
        gaussian = [(s, q, n) for s, q, n in self.gaussian.history]
        if extra_gaussian is not None:
            gaussian.append((*extra_gaussian, 1))
        rr = dict(self.rr_steps)
        if extra_rr is not None:
            key = (float(extra_rr[0]), int(extra_rr[1]), float(extra_rr[2]))
            rr[key] = rr.get(key, 0) + 1
        total = np.zeros(len(ORDERS))
        for sigma, rate, n in gaussian:  # compute_rdp(steps=n) is n times one step's, as opacus computes it
            total = total + self._gaussian_rdp(sigma, rate) * n
        for (eps_bit, bits, rate), n in rr.items():
            releases = math.ceil(n * rate - 1e-9)
            total = total + releases * randomized_response_rdp(eps_bit, bits)
        return total

    def epsilon(self, delta: float | None = None) -> float:
        """Epsilon spent so far at ``delta`` (the accountant's own delta by default)."""
        delta = self.delta if delta is None else float(delta)
        with _quiet():
            if not self.rr_steps:
                return float(self.gaussian.get_epsilon(delta))
            return self._convert(self.rdp(), delta)

    def _convert(self, rdp: np.ndarray, delta: float) -> float:
        _, analysis = _opacus()
        with _quiet():
            eps, _ = analysis.get_privacy_spent(orders=ORDERS, rdp=rdp, delta=delta)
        return float(eps)

    def epsilon_if(self, *, noise_multiplier: float | None = None, sample_rate: float = 1.0,
                   rr: tuple[float, int] | None = None) -> float:
        """Epsilon after one more training forward with these releases (nothing is recorded)."""
        return self._convert(self.rdp(
            extra_gaussian=None if noise_multiplier is None else (noise_multiplier, sample_rate),
            extra_rr=None if rr is None else (rr[0], rr[1], sample_rate)), self.delta)


def calibrate(*, epsilon: float, delta: float, sample_rate: float, steps: int,
              rr: tuple[float, int] | None = None) -> float:
    """The noise multiplier that spends (``epsilon``, ``delta``) in ``steps`` training forwards.

    Without randomized response this is opacus's ``get_noise_multiplier``; with it (``rr`` = eps
    per bit, bits per sample) the same bisection runs on the total that :class:`PrivacyAccountant`
    reports, so the Gaussian part gets what randomized response leaves of the budget.
    """
    _opacus()
    if rr is None:
        from opacus.accountants.utils import get_noise_multiplier

        try:
            with _quiet():
                return float(get_noise_multiplier(target_epsilon=epsilon, target_delta=delta,
                                                  sample_rate=sample_rate, steps=steps, accountant="rdp"))
        except ValueError as exc:
            raise ConfigError(f"no noise reaches epsilon={epsilon} at delta={delta} over {steps} steps: {exc}") from None

    def total(sigma: float) -> float:
        accountant = PrivacyAccountant(delta)
        accountant.gaussian.history = [(sigma, sample_rate, steps)]
        accountant.rr_steps = {(float(rr[0]), int(rr[1]), float(sample_rate)): steps}
        return accountant.epsilon()

    floor = total(1e6)
    if floor >= epsilon:
        raise ConfigError(
            f"randomized response alone (eps={rr[0]} per bit, {rr[1]} bits per sample) spends epsilon={floor:.3g} "
            f"over {steps} steps, more than the budget's {epsilon}: lower flip_eps, or give a larger budget"
        )
    low, high = 0.0, 10.0
    while total(high) > epsilon:
        low, high = high, 2 * high
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (low, mid) if total(mid) <= epsilon else (mid, high)
    return high
