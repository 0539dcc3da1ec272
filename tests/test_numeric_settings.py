"""Process-wide numeric settings a script sets on torch (matmul precision, deterministic kernels,
the default dtype, flushing denormals): in a split model they reach the edge's process only. The
handshake refuses an edge whose settings differ from the cloud's, and a setting changed after
split() is refused at the next forward, by name. Scripts written as users write them, against a
real cloud process."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import splitft
from splitft import numerics
from splitft.errors import ConfigError, HandshakeError
from tests.conftest import start_cloud, stop
from tests.models import mlp

MLP = "tests.models:mlp"
MEDIUM = "tests.medium_precision_models:mlp"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MLP)
    yield address
    stop(proc)


@contextmanager
def torch_setting(read: Callable[[], Any], write: Callable[[Any], None], value: Any) -> Iterator[None]:
    """A process-wide setting set for the block, as a script sets it, and set back after."""
    was = read()
    write(value)
    try:
        yield
    finally:
        write(was)


def attribute(owner: Any, name: str, value: Any) -> AbstractContextManager:
    """A backend flag set as scripts set it (``torch.backends.mkldnn.matmul.fp32_precision = ...``)."""
    return torch_setting(lambda: getattr(owner, name), lambda v: setattr(owner, name, v), value)


def matmul_precision(value: str) -> AbstractContextManager:
    return torch_setting(torch.get_float32_matmul_precision, torch.set_float32_matmul_precision, value)


def _batch(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(i)
    return torch.randn(8, 12, generator=g, dtype=torch.float32), torch.randint(0, 3, (8,), generator=g)


def _step(model, opt, i: int) -> None:
    x, y = _batch(i)
    loss = torch.nn.CrossEntropyLoss()
    (model.remote_loss(loss) if isinstance(model, splitft.SplitModel) else loss)(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _split(address: str, factory: str = MLP):
    return splitft.split(mlp(), "2", connect=address, factory=splitft.Factory(factory))


def _trained_locally(steps: int) -> dict[str, torch.Tensor]:
    local = mlp()
    opt = torch.optim.Adam(local.parameters(), lr=1e-2)
    for i in range(steps):
        _step(local, opt, i)
    return local.state_dict()


def _assert_same(split_state: dict, local_state: dict) -> None:
    assert set(split_state) == set(local_state)
    for name, value in local_state.items():
        assert torch.equal(split_state[name], value), name


@pytest.mark.parametrize("changed, named", [
    (lambda: matmul_precision("high"),
     r"torch\.get_float32_matmul_precision\(\) changed after split\(\) \(highest -> high\)"),
    (lambda: torch_setting(torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms, True),
     r"torch\.are_deterministic_algorithms_enabled\(\) changed after split\(\) \(False -> True\)"),
    (lambda: torch_setting(torch.get_default_dtype, torch.set_default_dtype, torch.float64),
     r"torch\.get_default_dtype\(\) changed after split\(\) \(torch\.float32 -> torch\.float64\)"),
    (lambda: torch.backends.mkldnn.flags(enabled=False),
     r"torch\.backends\.mkldnn\.enabled changed after split\(\) \(True -> False\)"),
    (lambda: attribute(torch.backends.mkldnn.conv, "fp32_precision", "tf32"),
     r"torch\.backends\.mkldnn\.conv\.fp32_precision changed after split\(\) \(ieee -> tf32\)"),
    (lambda: attribute(torch.backends.opt_einsum, "strategy", "greedy"),
     r"torch\.backends\.opt_einsum\.strategy changed after split\(\) \(auto -> greedy\)"),
    (lambda: sdpa_kernel(SDPBackend.MATH),
     r"torch\.backends\.cuda\.flash_sdp_enabled\(\) changed after split\(\) \(True -> False\) "
     r"\(torch\.nn\.attention\.sdpa_kernel"),
])
def test_a_setting_changed_after_split_is_refused_by_name_before_the_cloud_runs_and_set_back_trains_exactly(
        cloud, changed: Callable[[], AbstractContextManager], named: str):
    local = _trained_locally(3)
    model = _split(cloud)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        _step(model, opt, 0)
        _step(model, opt, 1)
        with changed(), pytest.raises(ConfigError, match=named):
            _step(model, opt, 2)
        _step(model, opt, 2)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_same(state, local)


@pytest.mark.parametrize("rejoin", [None, "4"])
def test_a_setting_changed_around_the_backward_alone_is_refused_there_and_set_back_trains_exactly(cloud, rejoin):
    """``with torch.backends.mkldnn.flags(enabled=False): loss.backward()``: unsplit the whole
    backward computes with the setting, the cloud half's too; split, the cloud's backward would
    not (a plain split's ran at the loss). Refused at the backward, in both shapes."""
    local = _trained_locally(3)
    model = splitft.split(mlp(), "2", rejoin, connect=cloud, factory=splitft.Factory(MLP))
    crit = torch.nn.CrossEntropyLoss()
    crit = model.remote_loss(crit) if rejoin is None else crit
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for i in range(3):
            x, y = _batch(i)
            loss = crit(model(x), y)
            if i == 1:
                with torch.backends.mkldnn.flags(enabled=False), pytest.raises(
                        ConfigError, match=r"torch\.backends\.mkldnn\.enabled changed after split\(\)"):
                    loss.backward(retain_graph=True)
                opt.zero_grad()  # the edge's layers after the trunk had their gradients before the refusal
            loss.backward()
            opt.step()
            opt.zero_grad()
        state = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_same(state, local)


def test_an_attention_kernel_picked_around_the_forward_is_refused_and_the_default_trains_exactly(tmp_path):
    """On the CPU, ``sdpa_kernel(SDPBackend.MATH)`` makes a causal LM's attention run another
    kernel than the default one, a few bits apart: around the forward of the split model, it
    would reach the edge's layers only."""
    pytest.importorskip("transformers")
    from tests.models import tiny_hf

    def step(model, opt, i: int) -> None:
        ids = torch.randint(1, 128, (2, 10), generator=torch.Generator().manual_seed(i))
        with (sdpa_kernel(SDPBackend.MATH) if math_kernel else nullcontext()):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()

    states = {}
    for math_kernel in (True, False):
        local = tiny_hf("llama")
        opt = torch.optim.AdamW(local.parameters(), lr=1e-2)
        for i in range(3):
            step(local, opt, i)
        states[math_kernel] = local.state_dict()
    assert any(not torch.equal(states[True][k], v) for k, v in states[False].items())  # the kernels differ
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", "tests.models:tiny_hf")
    try:
        model = splitft.split(tiny_hf("llama"), "model.layers.1:3", connect=address,
                              factory=splitft.Factory("tests.models:tiny_hf", {"kind": "llama"}))
        with model:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            math_kernel = True
            with pytest.raises(ConfigError, match=r"flash_sdp_enabled\(\) changed after split\(\).*sdpa_kernel"):
                step(model, opt, 0)
            math_kernel = False
            for i in range(3):
                step(model, opt, i)
            state = {k: v.clone() for k, v in model.state_dict().items()}
    finally:
        stop(proc)
    _assert_same(state, states[False])


def test_flushing_denormals_after_split_is_refused(cloud):
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU cannot flush denormals")
    model = _split(cloud)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        _step(model, opt, 0)
        torch.set_flush_denormal(True)
        try:
            with pytest.raises(ConfigError, match=r"torch\.set_flush_denormal changed after split\(\) \(False -> True\)"):
                _step(model, opt, 1)
        finally:
            torch.set_flush_denormal(False)
        _step(model, opt, 1)


def test_an_edge_whose_setting_the_cloud_does_not_share_is_refused_at_the_handshake(cloud):
    with matmul_precision("medium"):
        with pytest.raises(HandshakeError, match=r"the edge computes with torch\.get_float32_matmul_precision\(\) = "
                                                 r"medium and this cloud with highest.*module that defines the factory"):
            _split(cloud)


def test_a_cloud_whose_factory_module_sets_the_same_setting_accepts_the_edge_and_trains_as_the_unsplit_model(
        tmp_path):
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", MEDIUM)
    try:
        with matmul_precision("medium"):
            local = _trained_locally(3)
            model = _split(address, MEDIUM)
            with model:
                opt = torch.optim.Adam(model.parameters(), lr=1e-2)
                for i in range(3):
                    _step(model, opt, i)
                state = {k: v.clone() for k, v in model.state_dict().items()}
        _assert_same(state, local)
        # and the edge that left the setting alone is refused by that cloud, both values named
        with pytest.raises(HandshakeError, match=r"= highest and this cloud with medium"):
            _split(address, MEDIUM)
    finally:
        stop(proc)


def test_accelerator_settings_are_compared_only_for_a_half_on_that_accelerator():
    """Compared for a cloud half on CUDA only, and only when the edge can compute on CUDA too:
    without, it sends none, and the cloud's choice stands."""
    mine = numerics.settings(cuda=True)
    tf32 = "torch.backends.cuda.matmul.allow_tf32"
    if tf32 not in mine:
        pytest.skip("this torch has no such setting")
    theirs = dict(mine, **{tf32: str(mine[tf32] != "True")})
    numerics.check_hello(theirs, torch.device("cpu"))
    with pytest.raises(HandshakeError, match=r"allow_tf32"):
        numerics.check_hello(theirs, torch.device("cuda"))
    without_cuda = numerics.settings(cuda=False)
    assert tf32 not in without_cuda
    numerics.check_hello(without_cuda, torch.device("cuda"))


def test_an_edge_that_allows_tensorfloat32_trains_with_a_cloud_half_on_the_cpu_as_unsplit(cloud):
    """``torch.backends.cuda.matmul.allow_tf32 = True`` at the top of a script reads as a float32
    matmul precision of "high", which computes as "highest" off CUDA; a cloud half on CUDA still
    refuses it."""
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        assert torch.get_float32_matmul_precision() == "high"
        local = _trained_locally(3)
        model = _split(cloud)
        with model:
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            for i in range(3):
                _step(model, opt, i)
            state = {k: v.clone() for k, v in model.state_dict().items()}
        _assert_same(state, local)
        theirs = numerics.settings(cuda=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    assert torch.get_float32_matmul_precision() == "highest"
    numerics.check_hello(theirs, torch.device("cpu"))
    with pytest.raises(HandshakeError, match=r"get_float32_matmul_precision\(\) = high and this cloud with highest"):
        numerics.check_hello(theirs, torch.device("cuda"))


def test_hostile_settings_get_a_typed_refusal_and_unknown_ones_are_ignored():
    with pytest.raises(HandshakeError, match="must be a map"):
        numerics.check_hello(["torch.get_default_dtype()"], torch.device("cpu"))
    numerics.check_hello({"os.system('true')": "x", 7: 8}, torch.device("cpu"))
    with pytest.raises(HandshakeError) as refused:
        numerics.check_hello({"torch.get_default_dtype()": "x" * 10_000}, torch.device("cpu"))
    assert len(str(refused.value)) < 500
