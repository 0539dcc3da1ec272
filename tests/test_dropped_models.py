"""A split model the script drops without close(), as a sweep forgets each trial's: collected like
any object, its session ends (the cloud hears why) and its heartbeat thread stops, so a sweep of
many trials runs as long as the unsplit one. Against a real cloud process."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import torch
from torch import nn

import splitft
from tests.conftest import start_cloud, stop
from tests.models import mlp
from tests.test_faults import _data

MLP = "tests.models:mlp"


def _heartbeats() -> int:
    """Heartbeat threads alive in this process (other tests' sessions may hold some)."""
    return sum(thread.name == "splitft-heartbeat" for thread in threading.enumerate())


def _trial(address: str) -> tuple[weakref.ref, weakref.ref]:
    model = splitft.split(mlp(), 2, factory=MLP, connect=address)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = _data(1)[0]
    model.remote_loss(nn.CrossEntropyLoss())(model(x), y).backward()
    opt.step()
    return weakref.ref(model), weakref.ref(opt)


def test_a_dropped_split_model_ends_its_session_and_its_heartbeat(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--sessions-per-peer", "3")
    try:
        heartbeats = _heartbeats()
        for _ in range(5):  # more trials than the cloud holds sessions at once
            model, opt = _trial(address)
            gc.collect()
            assert model() is None and opt() is None
        deadline = time.monotonic() + 10
        while err.text.count("dropped without close()") < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert err.text.count("the split model was dropped without close()") == 5, err.text
        while _heartbeats() > heartbeats and time.monotonic() < deadline:  # each ends at its next wake
            time.sleep(0.05)
        assert _heartbeats() <= heartbeats
    finally:
        stop(proc)
