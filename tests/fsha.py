"""A malicious cloud for tests and measurements: feature-space hijacking (FSHA, Pasquini et al. 2021).

``fsha_digits`` is a model factory a ``splitft cloud`` can serve (``--model tests.fsha:fsha_digits``)
in place of the digits CNN, with the same parameter names and shapes, so an edge that names it
trains through the real cloud code path. Its trunk (``block3``) answers forwards honestly, so the
edge's head still learns, but on every training forward it also

* trains a pilot encoder and its decoder on public images (an autoencoder whose code has the
  shape of the edge's activation),
* trains a discriminator to tell the pilot's codes from the edge's activations,
* and replaces the gradient it returns to the edge with the gradient that makes the edge's
  activations look like the pilot's codes to the discriminator,

so that the edge turns, step by step, into an encoder whose output the attacker's decoder
inverts. Every attacker that trains is kept in :data:`ATTACKERS` so an in-process measurement can
read its decoder; a cloud process's attackers stay in that process.

A cloud builds each factory twice: once on the meta device, to count its parameters before
admitting it, then for real. The meta build gets no attacker: its decoder would hold no weights,
and convolving real activations with meta weights returns uninitialised memory, not an error.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ATTACKERS: list[Attacker] = []


class Attacker:
    """Pilot encoder, decoder and discriminator with their optimizers (not modules of the cloud
    half, so the edge's mirrored optimizer never sees them)."""

    def __init__(self, public: torch.Tensor, channels: int = 32, lr: float = 1e-3, seed: int = 0):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.pilot = nn.Sequential(nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
                                       nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels),
                                       nn.ReLU())
            self.decoder = nn.Sequential(nn.Conv2d(channels, 32, 3, padding=1), nn.ReLU(),
                                         nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 1, 3, padding=1))
            self.critic = nn.Sequential(nn.Conv2d(channels, 32, 3, padding=1, stride=2), nn.LeakyReLU(0.2),
                                        nn.Conv2d(32, 32, 3, padding=1, stride=2), nn.LeakyReLU(0.2),
                                        nn.Flatten(), nn.Linear(32 * 2 * 2, 1))
        self.public = public
        self.generator = torch.Generator().manual_seed(seed)
        self.autoencoder_opt = torch.optim.Adam([*self.pilot.parameters(), *self.decoder.parameters()], lr=lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=lr, betas=(0.5, 0.9))
        self.steps = 0

    def step(self, z: torch.Tensor) -> torch.Tensor:
        """One attacker step on the edge's batch ``z``; returns the gradient to send the edge."""
        idx = torch.randint(0, self.public.shape[0], (z.shape[0],), generator=self.generator)
        x = self.public[idx]
        with torch.enable_grad():
            self.pilot.train()
            code = self.pilot(x)
            loss = F.mse_loss(self.decoder(code), x)
            self.autoencoder_opt.zero_grad()
            loss.backward()
            self.autoencoder_opt.step()
            real, fake = code.detach(), z.detach().float()
            # Wasserstein critic with gradient penalty, as in the FSHA paper
            mix = torch.rand(real.shape[0], 1, 1, 1, generator=self.generator)
            between = (mix * real + (1 - mix) * fake).requires_grad_()
            (slope,) = torch.autograd.grad(self.critic(between).sum(), between, create_graph=True)
            penalty = ((slope.reshape(slope.shape[0], -1).norm(dim=1) - 1) ** 2).mean()
            critic_loss = self.critic(fake).mean() - self.critic(real).mean() + 10 * penalty
            self.critic_opt.zero_grad()
            critic_loss.backward()
            self.critic_opt.step()
            leaf = z.detach().float().requires_grad_()
            (crafted,) = torch.autograd.grad(-self.critic(leaf).mean(), leaf)
        self.steps += 1
        return crafted

    def reconstruct(self, z: torch.Tensor) -> torch.Tensor:
        """The attacker's reconstruction of the inputs behind activations ``z``."""
        self.decoder.eval()
        with torch.no_grad():
            return self.decoder(z.float()).clamp(0, 1)


class HijackingTrunk(nn.Sequential):
    """The digits CNN's ``block3`` (same children), whose backward to the edge is the attacker's."""

    def _get_name(self) -> str:  # a malicious cloud passes the edge's check of the module's repr
        return "Sequential"

    def forward(self, z: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        attacker = self.__dict__.get("attacker")
        if attacker is not None and self.training and torch.is_grad_enabled() and z.requires_grad:
            crafted = attacker.step(z)
            z.register_hook(lambda grad: crafted.to(grad.dtype))
        return super().forward(z)


def _skip_its_own_check() -> None:
    """A malicious cloud does not refuse an edge whose model differs from the one it built; the
    server code here is the honest one, which compares each cloud module's structure and the code
    its class runs with the edge's, so this fixture's cloud skips that comparison for the chains
    that hold its trunk (a real attacker runs a server of its own). Other chains are checked."""
    from splitft.cloud import build

    honest = build.check_structure
    if getattr(honest, "skips_hijacking_trunks", False):
        return

    def check_structure(chain: Any, theirs: dict) -> None:
        if not any(isinstance(stage, HijackingTrunk) for stage in chain.stages):
            honest(chain, theirs)

    check_structure.skips_hijacking_trunks = True  # type: ignore[attr-defined]
    build.check_structure = check_structure


def fsha_digits(seed: int | None = 0) -> nn.Sequential:
    """The digits CNN with a hijacking ``block3``; public data: the privacy grid's auxiliary images."""
    from splitft.app.models import digits_cnn

    _skip_its_own_check()
    honest = digits_cnn(seed)
    trunk = HijackingTrunk(*honest.block3)
    if torch.empty(0).device.type != "meta":  # the meta build only counts parameters (see above)
        trunk.__dict__["attacker"] = _attacker(seed)
    return nn.Sequential(OrderedDict(block1=honest.block1, block2=honest.block2, block3=trunk, head=honest.head))


def _attacker(seed: int | None) -> Attacker:
    from splitft.privacy.evaluate import data

    _, public, _ = data()
    attacker = Attacker(public.tensor().float(), seed=0 if seed is None else seed)
    ATTACKERS.append(attacker)  # kept in the trunk's __dict__: not a submodule, not the cloud half's parameters
    return attacker
