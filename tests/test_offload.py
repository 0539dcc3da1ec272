"""``--offload-optimizer``: the cloud half's optimizer state lives on the host between steps, and a
step with it offloaded is the step without, bit for bit."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from splitft import split
from splitft.app.models import digits_cnn
from splitft.cloud import offload
from tests.conftest import DIGITS, start_cloud, stop


def test_the_state_is_held_in_host_copies_between_steps_and_the_steps_are_unchanged():
    torch.manual_seed(0)
    plain, offloaded = nn.Linear(32, 16), nn.Linear(32, 16)
    offloaded.load_state_dict(plain.state_dict())
    opt_a, opt_b = torch.optim.AdamW(plain.parameters(), lr=1e-2), torch.optim.AdamW(offloaded.parameters(), lr=1e-2)
    during: list[weakref.ref] = []  # the state the step computed on (addresses would be reused)
    opt_b.register_step_post_hook(lambda o, *_: during.extend(
        weakref.ref(v) for s in o.state.values() for k, v in s.items() if k != "step"))
    for _ in range(3):
        x = torch.randn(8, 32)
        for model, opt, moved in ((plain, opt_a, False), (offloaded, opt_b, True)):
            opt.zero_grad()
            model(x).square().mean().backward()
            with offload.stepping(opt, torch.device("cpu"), moved):
                opt.step()
        held = [v for s in opt_b.state.values() for k, v in s.items() if k != "step"]
        gc.collect()
        assert held and all(r() is None for r in during[-len(held):])  # the step's copies were let go
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), offloaded.parameters()))
    for (sa, sb) in zip(opt_a.state.values(), opt_b.state.values()):
        assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert offload.to_host(opt_b) == sum(v.nbytes for s in opt_b.state.values() for v in s.values())


def _train(address: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    with split(digits_cnn(), "block3", factory=DIGITS, connect=address) as model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-2))
        criterion = model.remote_loss(nn.CrossEntropyLoss())
        for _ in range(4):
            opt.zero_grad()
            criterion(model(torch.randn(16, 1, 8, 8, generator=g)), torch.randint(0, 10, (16,), generator=g)).backward()
            opt.step()
        return model.cloud_state_dict()


def test_a_cloud_with_offloaded_state_trains_as_one_without(tmp_path):
    weights = []
    for flags in ((), ("--offload-optimizer",)):
        proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS, *flags)
        try:
            weights.append(_train(address))
        finally:
            stop(proc)
    plain, moved = weights
    assert plain.keys() == moved.keys() and all(torch.equal(plain[k], moved[k]) for k in plain)
