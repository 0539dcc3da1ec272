"""The shape and dtype of a plain split's ``model(x)``: the cloud half's output's, worked out here.

A plain split's ``model(x)`` returns the activation at the cut, and the cloud computes the
output later, with the loss. A script reads the output's shape as unsplit (``total +=
out.size(0)``, ``n_classes = out.shape[-1]``, ``out.view(-1, out.size(-1))`` before a loss), so
answering with the activation's would be a silently different number. The cloud half's modules
are here as a twin of values (:class:`~splitft.cut.Chain`); running a copy of it on torch's fake
tensors (shapes and dtypes, no values, no generator draws) gives the output's without a round
trip and without touching the twin, once per activation shape and autocast region.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
from torch import nn

from ..cut import Chain
from ..devices import autocast_region
from ..errors import ConfigError


class OutputShapes:
    """What the cloud half returns for an activation, as a tensor on the ``meta`` device."""

    def __init__(self, chain: Chain) -> None:
        self._chain = chain
        self._fake: tuple[Any, Chain] | None = None  # (the fake mode, the copy of the chain it holds)
        self._known: dict[tuple, torch.Tensor] = {}

    def like(self, activation: torch.Tensor, autocast: tuple[str | None, str | None], asked: str) -> torch.Tensor:
        """A ``meta`` tensor of the output's shape, strides and dtype for ``activation``, computed
        under the autocast dtypes (on the CPU, on CUDA) that ``model(x)`` ran under; ``asked``
        names the script's question for the refusal where it cannot be answered."""
        key = (tuple(activation.shape), activation.stride(), activation.dtype, activation.device, autocast)
        known = self._known.get(key)
        if known is None:
            known = self._known[key] = self._infer(activation, autocast, asked)
        return known

    def _infer(self, activation: torch.Tensor, autocast: tuple[str | None, str | None], asked: str) -> torch.Tensor:
        try:
            mode, chain = self._fake_chain()
            regions = [autocast_region(dtype, torch.device(kind))
                       for kind, dtype in zip(("cpu", "cuda"), autocast, strict=True)]
            given = mode.from_tensor(activation.detach())
            with contextlib.ExitStack() as stack, torch.no_grad():
                for region in regions:
                    stack.enter_context(region)
                stack.enter_context(mode)
                out = chain(given)
        except Exception as error:  # noqa: BLE001 — any failure to work it out is the same refusal
            raise ConfigError(
                f"{asked} on what a plain split's model(x) returns: unsplit, that is the model's output, which the "
                f"cloud computes later, with the loss; its shape could not be worked out on the edge "
                f"({type(error).__name__}: {str(error)[:200]}). Read it from model.predict(x), or cut a U-shape "
                "(rejoin=), whose model(x) is the whole model's output") from error
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"{asked} on what a plain split's model(x) returns: unsplit, that is the model's "
                              f"output, a {type(out).__name__}, not a tensor (logits, aux = model(x) unpacks it). "
                              "A plain split's remote loss takes one output: cut a U-shape (rejoin=), whose model(x) "
                              "is the whole model's output, to compute on its parts")
        return torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")

    def _fake_chain(self) -> tuple[Any, Chain]:
        """A copy of the twin whose every parameter and buffer is a fake tensor (made once)."""
        if self._fake is None:
            from torch._subclasses.fake_tensor import FakeTensorMode  # imports torch's compiler stack: ~2 s, once

            mode = FakeTensorMode()
            memo: dict[int, Any] = {}
            for module in self._chain.stages.modules():
                for name, tensor in [*module._parameters.items(), *module._buffers.items()]:
                    if tensor is not None and id(tensor) not in memo:
                        fake = mode.from_tensor(tensor.detach())
                        memo[id(tensor)] = nn.Parameter(fake, tensor.requires_grad) if name in module._parameters \
                            else fake
            stages = copy.deepcopy(self._chain.stages, memo)
            chain = Chain(list(zip(self._chain.names, stages, strict=True)), whole=self._chain.whole)
            self._fake = mode, chain.eval()  # shapes as in evaluation: no batch-size check of training
        return self._fake


__all__ = ["OutputShapes"]
