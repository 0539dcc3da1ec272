"""Clipping a split model's gradients in both halves, as torch clips the unsplit model's.

``model.clip_grad_norm_`` / ``clip_grad_value_`` and torch's own functions given (some of) a
split model's parameters (routed by :mod:`splitft.edge.guards`) come here: the edge's gradients
are clipped in place and the cloud is told to do the same to the named cloud parameters.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from . import mirror

if TYPE_CHECKING:
    from .model import SplitModel


def clip_grad_norm_(model: SplitModel, params: list[torch.Tensor], max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """Clip ``params`` (edge ones and cloud placeholders) by their global norm; returns it.

    One round trip when cloud parameters are among them: the cloud reports the norm of each
    of their gradients, the edge computes the total, scales its own and sends the cloud the
    same factor (it rides on the next message).
    """
    norm_type = float(norm_type)
    edge, names, any_cloud = _cloud_names_in(model, params)
    grads = [p.grad for p in edge if p.grad is not None]
    norms = [torch.linalg.vector_norm(g.detach(), norm_type) for g in grads]
    device = grads[0].device if grads else torch.device("cpu")  # the edge's, where the total is returned
    if any_cloud:
        model._mirror_module_state()
        reply = model.session.sync_reply(grad_norm=norm_type, grad_names=names)
        norms += [torch.tensor(n, dtype=torch.float32, device=device) for n in reply.grad_norms or []]
    if not norms:
        return torch.tensor(0.0, device=device)
    total = torch.linalg.vector_norm(torch.stack(norms), norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite, so it cannot "
                           "be clipped; set error_if_nonfinite=False to clip anyway")
    factor = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for g in grads:
            g.mul_(factor.to(g.dtype))
    if any_cloud and math.isfinite(float(factor)):  # (a non-finite norm: the gradients are garbage on both
        model.session.queue(mirror.scale_grads_op(float(factor), names))  # sides; a loss scaler skips the step)
    return total


def clip_grad_value_(model: SplitModel, params: list[torch.Tensor], clip_value: float) -> None:
    """Clamp ``params``' gradients (edge ones and cloud placeholders) to ``[-clip_value, clip_value]``."""
    edge, names, any_cloud = _cloud_names_in(model, params)
    with torch.no_grad():
        for p in edge:
            if p.grad is not None:
                p.grad.clamp_(-clip_value, clip_value)
    if any_cloud:
        model.session.queue(mirror.clamp_grads_op(clip_value, names))


def _cloud_names_in(model: SplitModel, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[str] | None, bool]:
    """(edge parameters, names of the cloud ones or None for all, whether any is a cloud one)."""
    edge = [p for p in params if not model.is_cloud(p)]
    names = list(dict.fromkeys(model._cloud_ids[id(p)] for p in params if model.is_cloud(p)))
    return edge, (None if len(names) == len(model._cloud) else names), bool(names)
