"""The cloud builds an edge's optimizer from a closed list of names: torch.optim's classes and a
few libraries' optimizers, the latter only at the edge's release of the library."""

from __future__ import annotations

import pytest
import torch

from splitft.errors import ConfigError
from splitft.optimizer_classes import LIBRARY_OPTIMIZERS, library_version, optimizer_class, wire_name


def test_torch_optimizers_go_by_their_own_names_and_nothing_else_of_torch_optim_does():
    assert wire_name(torch.optim.AdamW) == "AdamW"
    assert optimizer_class("AdamW") is torch.optim.AdamW
    for name in ("Optimizer", "lr_scheduler", "os", "__builtins__", "AdamW.__init__"):
        with pytest.raises(ConfigError, match="not a torch.optim optimizer"):
            optimizer_class(name)
    with pytest.raises(ConfigError, match="is a str"):
        optimizer_class(["Adam"])

    class Mine(torch.optim.SGD):
        pass

    assert wire_name(Mine) is None


def test_a_library_optimizer_is_built_only_at_the_edge_s_release_of_its_library():
    transformers = pytest.importorskip("transformers")
    from transformers.optimization import Adafactor

    name = wire_name(Adafactor)
    assert name == "transformers.Adafactor" and name in LIBRARY_OPTIMIZERS
    assert library_version(name) == transformers.__version__
    assert optimizer_class(name, transformers.__version__) is Adafactor
    for other in ("0.0.1", None, 5):
        with pytest.raises(ConfigError, match=f"this cloud has {transformers.__version__}"):
            optimizer_class(name, other)
