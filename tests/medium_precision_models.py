"""A factory module that sets a process-wide numeric setting when the cloud imports it: where the
handshake's refusal tells an operator to put such a setting. Never imported by the edge's tests."""

from __future__ import annotations

import torch

from tests.models import mlp

torch.set_float32_matmul_precision("medium")

__all__ = ["mlp"]
