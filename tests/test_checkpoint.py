"""The checkpoint format: safetensors + JSON, round trips mixed state, refuses damaged files."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from splitft.state_files import flatten_state, read_checkpoint, unflatten_state, write_checkpoint
from splitft.cloud.checkpoint_folder import CheckpointStore
from splitft.errors import CheckpointError
from tests.conftest import ROOT
from tests.models import mlp


def _adam_state():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.01, betas=(0.8, 0.99))
    for _ in range(2):
        model(torch.randn(4, 12)).sum().backward()
        opt.step()
    return model, opt


def test_optimizer_state_round_trips_exactly(tmp_path):
    model, opt = _adam_state()
    tree = {"optimizer": opt.state_dict(), "codecs": {"fwd": {"buf": np.arange(5, dtype=np.int64), "n": 3}},
            "rng": torch.get_rng_state(), "pair": (1, "a"), "none": None}
    write_checkpoint(tmp_path / "ck", tree, {"step": 2}, fsync=False)
    back, meta = read_checkpoint(tmp_path / "ck")
    assert meta == {"step": 2}
    assert back["pair"] == (1, "a") and back["none"] is None
    np.testing.assert_array_equal(back["codecs"]["fwd"]["buf"], np.arange(5))
    fresh = torch.optim.Adam(mlp().parameters(), lr=0.5)
    fresh.load_state_dict(back["optimizer"])  # int keys, tuples (betas) and tensors all came back
    assert fresh.param_groups[0]["betas"] == (0.8, 0.99) and fresh.param_groups[0]["lr"] == 0.01
    for key, state in opt.state_dict()["state"].items():
        for name, value in state.items():
            torch.testing.assert_close(fresh.state_dict()["state"][key][name], value, rtol=0, atol=0)


def test_files_are_safetensors_and_json_only(tmp_path):
    write_checkpoint(tmp_path / "ck", {"w": torch.ones(3)}, {"a": 1}, fsync=False)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 2 and names[0] == "ck-" + names[0][3:] and names[0].endswith(".safetensors")
    assert names[1] == "ck.json"
    document = json.loads((tmp_path / "ck.json").read_text())
    assert document["format"] == "splitft-checkpoint" and document["state"] == {"w": {"$tensor": "w"}}


def test_a_damaged_tensor_file_is_refused(tmp_path):
    write_checkpoint(tmp_path / "ck", {"w": torch.ones(3)}, {}, fsync=False)
    (tensors,) = tmp_path.glob("*.safetensors")
    data = bytearray(tensors.read_bytes())
    data[-1] ^= 0xFF
    tensors.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        read_checkpoint(tmp_path / "ck")


def test_overwriting_keeps_one_complete_checkpoint(tmp_path):
    for value in (1.0, 2.0, 3.0):
        write_checkpoint(tmp_path / "ck", {"w": torch.full((3,), value)}, {"v": value}, fsync=False)
    assert len(list(tmp_path.glob("*.safetensors"))) == 1
    tree, meta = read_checkpoint(tmp_path / "ck")
    assert meta == {"v": 3.0} and torch.equal(tree["w"], torch.full((3,), 3.0))


def test_killed_mid_write_leaves_the_previous_checkpoint_readable(tmp_path):
    """A process SIGKILLed while writing leaves at most a temporary file behind."""
    write_checkpoint(tmp_path / "ck", {"w": torch.zeros(3)}, {"v": 0}, fsync=False)
    code = (f"import os, signal, sys; sys.path.insert(0, {str(ROOT)!r}); import torch, splitft.state_files as c\n"
            "real = c._write_atomic\n"
            "def dying(path, data, fsync):\n"
            "    if path.suffix == '.json': os.kill(os.getpid(), signal.SIGKILL)\n"
            "    real(path, data, fsync)\n"
            "c._write_atomic = dying\n"
            f"c.write_checkpoint({str(tmp_path / 'ck')!r}, {{'w': torch.ones(3)}}, {{'v': 1}}, fsync=False)\n")
    assert subprocess.run([sys.executable, "-c", code]).returncode == -9
    tree, meta = read_checkpoint(tmp_path / "ck")
    assert meta == {"v": 0} and torch.equal(tree["w"], torch.zeros(3))


def test_store_keeps_the_newest_and_the_pinned(tmp_path):
    store = CheckpointStore(tmp_path, keep=2, fsync=False)
    session = "0123456789abcdef"
    store.save(session, 3, {"x": torch.zeros(1)}, {}, pinned=True)
    for seq in (5, 7, 9):
        store.save(session, seq, {"x": torch.full((1,), float(seq))}, {})
    assert store.seqs(session) == [3, 7, 9]
    assert store.load(session, 9)[0]["x"].item() == 9.0
    with pytest.raises(CheckpointError, match="16 hex digits"):
        store.seqs("../../etc")


def test_flatten_refuses_what_json_cannot_hold():
    with pytest.raises(CheckpointError, match="object"):
        flatten_state({"x": object()})
    tensors, skeleton = flatten_state({3: {"$odd": torch.ones(1)}})
    assert torch.equal(unflatten_state(skeleton, tensors)[3]["$odd"], torch.ones(1))
