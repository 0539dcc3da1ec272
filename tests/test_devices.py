"""Device placement and mixed precision (issue: the cloud half on an accelerator).

On every machine: device strings are checked at start-up; bf16 autocast on the edge runs the
cloud's half under the same autocast; a cloud half kept in bfloat16 trains within bf16's
tolerance of a float32 local run; every codec's device path (the torch kernels an accelerator
runs) writes the same payload bytes as its host path and copies only the payload to the host.
With a CUDA GPU (``pytest -m cuda``): the same with the cloud's half on the GPU.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
from torch import nn

import compressors
import splitft
from compressors import CodecContext
from compressors._device import portable_kernels
from splitft import Faults
from splitft.app.data import batches, load_digits
from splitft.devices import Placement, resolve_device, resolve_dtype
from splitft.errors import ConfigError
from splitft.app.models import digits_cnn
from tests.conftest import DIGITS, ROOT, InprocCloud, start_cloud, stop

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 8
BF16 = {"rtol": 2e-2, "atol": 2e-2}


# ---------------------------------------------------------------- device strings


@pytest.mark.parametrize("spec", ["gpu", "cuda:x", "cuda:-1", "tpu", "cpu:1", ""])
def test_malformed_device_strings_are_refused(spec):
    with pytest.raises(ConfigError, match="device"):
        resolve_device(spec)


def test_cpu_is_always_there_and_default_is_a_gpu_only_when_one_exists():
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("CPU") == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else ("mps" if torch.backends.mps.is_available() else "cpu")
    assert resolve_device(None).type == expected


def test_a_gpu_this_machine_lacks_is_a_clear_error():
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ConfigError, match=f"cuda:{count}"):
        resolve_device(f"cuda:{count}")
    if not torch.backends.mps.is_available():
        with pytest.raises(ConfigError, match="MPS"):
            resolve_device("mps")


def test_dtypes():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype(None) is None
    with pytest.raises(ConfigError, match="dtype"):
        resolve_dtype("int8")


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "splitft", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL)


def test_cloud_with_a_missing_device_exits_at_start_up_with_one_line():
    missing = f"cuda:{torch.cuda.device_count() if torch.cuda.is_available() else 0}"
    done = _run_cli("cloud", "--bind", "tcp://127.0.0.1:0", "--device", missing)
    assert done.returncode == 2
    assert missing in done.stderr and "Traceback" not in done.stderr
    assert "listening" not in done.stderr  # refused before the socket opened


def test_demo_with_a_missing_edge_device_exits_before_starting_a_cloud():
    done = _run_cli("demo", "--device", "cuda:99", "--epochs", "1")
    assert done.returncode == 2
    assert "cuda:99" in done.stderr and "Traceback" not in done.stderr


def test_split_refuses_a_missing_device_before_connecting():
    # nothing listens there: a device check that came after connecting would time out instead
    with pytest.raises(ConfigError, match="cuda:99"):
        splitft.split(digits_cnn(), "block3", factory=DIGITS, connect="tcp://127.0.0.1:9",
                      device="cuda:99", faults=Faults(timeout=1, reconnect_timeout=1))


# ---------------------------------------------------------------- mixed precision


@pytest.fixture(scope="module")
def digits():
    return load_digits()[0]


def _steps(model, opt, crit, data, autocast: torch.dtype | None = None) -> list[float]:
    losses = []
    it = batches(data, 32, shuffle=True, seed=3)
    for _ in range(STEPS):
        x, y, _ids = next(it)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            loss = crit(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def _local(data, autocast=None):
    model = digits_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = _steps(model, opt, nn.CrossEntropyLoss(), data, autocast)
    return model.state_dict(), losses


def _split(data, connect, rejoin=None, autocast=None):
    with splitft.split(digits_cnn(), "block3", rejoin, factory=DIGITS, connect=connect,
                       faults=Faults(timeout=60)) as model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        losses = _steps(model, opt, crit, data, autocast)
        return {**model.edge_state_dict(), **model.cloud_state_dict()}, losses


def _assert_close(local, split, **tolerance):
    (local_state, local_losses), (split_state, split_losses) = local, split
    assert set(split_state) == set(local_state)
    for name, value in local_state.items():
        assert split_state[name].dtype == value.dtype, name
        torch.testing.assert_close(split_state[name], value, msg=lambda m: f"{name}: {m}", **tolerance)
    torch.testing.assert_close(torch.tensor(split_losses), torch.tensor(local_losses), **tolerance)


@pytest.mark.parametrize("rejoin", [None, "head"], ids=["plain", "ushape"])
def test_bf16_autocast_split_equals_local(tmp_path, digits, rejoin):
    """The edge's forward under bf16 autocast: the cloud's half runs under it too, in its own process."""
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS, "--device", "cpu")
    try:
        split = _split(digits, address, rejoin, autocast=torch.bfloat16)
    finally:
        stop(proc)
    local = _local(digits, autocast=torch.bfloat16)
    _assert_close(local, split, **BF16)
    # and autocast really ran in the cloud: its half is far from a float32 run's (the same kernels
    # in the same order make it equal to the local bf16 run's in practice)
    plain = _local(digits)
    cloud = [k for k in split[0] if k.startswith(("block3", "head"))]
    assert any(not torch.allclose(split[0][k], plain[0][k], rtol=0, atol=1e-3) for k in cloud)


def test_cloud_half_kept_in_bfloat16_trains_within_bf16_tolerance(tmp_path, digits):
    """``splitft cloud --dtype bfloat16``: half the memory; the edge still sees float32 tensors."""
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS, "--device", "cpu",
                                     "--dtype", "bfloat16")
    try:
        assert err.wait_for("in bfloat16", 30), err.text
        split = _split(digits, address)
    finally:
        stop(proc)
    local = _local(digits)
    for name in split[0]:
        assert split[0][name].dtype == local[0][name].dtype, name  # the cloud answers in the edge's dtype
    _assert_close(local, split, rtol=5e-2, atol=5e-2)


def test_bfloat16_half_refuses_nothing_the_edge_sends_and_casts_back(digits):
    """In-process check of the cast boundaries: gradients at the cut keep the edge's dtype."""
    cloud = InprocCloud([DIGITS], placement=Placement("cpu", "bfloat16"))
    try:
        with splitft.split(digits_cnn(), "block3", "head", factory=DIGITS, connect=cloud.connect()) as model:
            x = digits.x[:8].requires_grad_()
            out = model(x)
            assert out.dtype == torch.float32
            out.sum().backward()
            assert x.grad is not None and x.grad.dtype == torch.float32 and torch.isfinite(x.grad).all()
            session = next(iter(cloud.server.by_id.values()))
            assert all(p.dtype == torch.bfloat16 for p in session.half.chain.parameters())
    finally:
        cloud.close()


# ---------------------------------------------------------------- codecs on the tensor's device

SPECS = ["identity", "fp16", "fixpoint:bits=2", "fixpoint:bits=3", "fixpoint:bits=4", "fixpoint:bits=8",
         "fixpoint:bits=11", "fixpoint:bits=16", "binary:take_sign=true", "binary:flip_eps=1.0,take_sign=true",
         "lowrank:rank=2", "lowrank:fp16=true,rank=3", "c3sl:r=2", "acsgd:bits=4"]


def _coding_rounds(spec: str, portable: bool, device: str = "cpu") -> list[tuple[dict, torch.Tensor]]:
    """Three training encodes and decodes (stateful codecs move on), the payloads and outputs."""
    sender, receiver = compressors.make_codec(spec, seed=5), compressors.make_codec(spec, seed=5)
    gen = torch.Generator().manual_seed(1)
    rounds = []
    with portable_kernels(portable):
        for step in range(3):
            x = torch.randn(6, 5, 8, generator=gen).to(device)
            ctx = CodecContext("activation", step=step, sample_ids=torch.arange(6).numpy(), device=device)
            payload = sender.encode(x, ctx)
            rounds.append(({k: a.tobytes() for k, a in payload.arrays.items()}, receiver.decode(payload, ctx).cpu()))
    return rounds


@pytest.mark.parametrize("spec", SPECS)
def test_device_path_writes_the_host_path_bytes(spec):
    host, device = _coding_rounds(spec, False), _coding_rounds(spec, True)
    for (host_arrays, host_out), (dev_arrays, dev_out) in zip(host, device):
        assert dev_arrays == host_arrays
        torch.testing.assert_close(dev_out, host_out, rtol=1e-6, atol=1e-6)


# identity and fp16 send the tensor itself; randomized response draws its flips from the seeded
# host generator; acsgd's own test (test_acsgd_device) allows for its checksums' partial sums
@pytest.mark.parametrize("spec", [s for s in SPECS if not s.startswith(("identity", "fp16", "acsgd"))
                                  and "flip" not in s])
def test_device_path_copies_only_the_payload_to_the_host(spec, monkeypatch):
    """Every device-to-host copy of the device path is counted: together no more than the payload
    (plus per-channel scales, computed from a max per channel); decoding copies nothing back."""
    codec = compressors.make_codec(spec, seed=5)
    x = torch.randn(32, 16, 24, generator=torch.Generator().manual_seed(0))
    with portable_kernels():
        codec.encode(x, CodecContext())  # keys and warm starts are built once, on first use
        copied: list[int] = []
        original = torch.Tensor.numpy

        def counting(self, *args, **kwargs):
            copied.append(self.numel() * self.element_size())
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "numpy", counting)
        payload = codec.encode(x, CodecContext())
        channels = 4 * x.shape[1]
        assert sum(copied) <= payload.nbytes + channels < x.numel() * x.element_size()
        copied.clear()
        codec.decode(payload, CodecContext(device="cpu"))
        assert sum(copied) <= channels


def test_checkpointed_codec_state_is_on_the_host():
    codec = compressors.make_codec("lowrank:rank=2", seed=0)
    with portable_kernels():
        codec.encode(torch.randn(4, 6, 8), CodecContext())
    assert codec.state_dict() and all(t.device.type == "cpu" for t in codec.state_dict().values())


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the benchmark would run")
def test_gpu_benchmark_exits_cleanly_without_a_gpu():
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_gpu.py")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU" in done.stdout


# ---------------------------------------------------------------- with a CUDA GPU


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("spec", SPECS)
def test_gpu_codec_equals_cpu_codec(spec):
    host, gpu = _coding_rounds(spec, False), _coding_rounds(spec, False, device="cuda")
    for (host_arrays, host_out), (gpu_arrays, gpu_out) in zip(host, gpu):
        if spec.startswith(("fixpoint", "binary", "identity", "fp16", "acsgd")):
            assert gpu_arrays == host_arrays  # exact integer/bit kernels
        torch.testing.assert_close(gpu_out, host_out, rtol=1e-3, atol=1e-3)


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("rejoin", [None, "head"], ids=["plain", "ushape"])
def test_split_with_the_cloud_on_a_gpu_equals_local(tmp_path, digits, rejoin):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS, "--device", "cuda")
    try:
        split = _split(digits, address, rejoin)
    finally:
        stop(proc)
    # the GPU's convolution kernels round differently from the CPU's
    _assert_close(_local(digits), split, rtol=1e-3, atol=1e-4)


def _half_of_the_steps(model, it) -> None:
    """STEPS // 2 of :func:`_local`'s steps (Adam, attached after a resume too), from ``it``."""
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    for _ in range(STEPS // 2):
        x, y, _ = next(it)
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("first,second", [("cuda", "cpu"), ("cpu", "cuda")])
def test_a_session_checkpointed_on_one_device_resumes_on_the_other(tmp_path, digits, first, second):
    folder = str(tmp_path / "ckpt")
    extra = ("--sessions", "0", "--model", DIGITS, "--checkpoint-dir", folder)
    proc, address, _ = start_cloud(tmp_path, *extra, "--device", first)
    it = batches(digits, 32, shuffle=True, seed=3)
    model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=address, faults=Faults(timeout=60))
    _half_of_the_steps(model, it)
    model.save_checkpoint(tmp_path / "edge")
    model.session.drop()
    stop(proc)
    proc, address, _ = start_cloud(tmp_path, *extra, "--device", second)
    try:
        with splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=address, faults=Faults(timeout=60),
                           resume_from=tmp_path / "edge") as model:
            _half_of_the_steps(model, it)
            state = {**model.edge_state_dict(), **model.cloud_state_dict()}
    finally:
        stop(proc)
    local_state, _ = _local(digits)
    for name, value in local_state.items():
        assert math.isfinite(float(state[name].float().abs().sum()))
        torch.testing.assert_close(state[name], value, rtol=1e-3, atol=1e-4, msg=lambda m: f"{name}: {m}")
