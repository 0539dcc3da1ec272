"""Privacy you can measure: defences on what crosses the cut, and the accounting of what they spend.

    from splitft.privacy import Budget, Defences, Noise, protect

    model = splitft.split(net, "block3", connect=..., factory=...)
    protect(model, Defences(leak_loss=0.5,
                            activations=Noise(clip=1.0),
                            budget=Budget(epsilon=3, delta=1e-5, sample_rate=64 / 1437, epochs=10)))
    ...  # the usual loop; model.privacy.spent() is the epsilon spent so far

Attacks that measure leakage (distance correlation, model inversion, label leakage) live in
:mod:`splitft.privacy.attacks`; they are measurements, never part of training.
"""

from .accountant import PrivacyAccountant, calibrate, randomized_response_rdp
from .dcor import distance_correlation
from .defences import Budget, Defences, Noise, PrivacyBudgetExceeded, Protection, clip_and_noise, protect
from .hijack import Probe

__all__ = ["Budget", "Defences", "Noise", "PrivacyAccountant", "PrivacyBudgetExceeded", "Probe", "Protection", "calibrate",
           "clip_and_noise", "distance_correlation", "protect", "randomized_response_rdp"]
