"""Every ``torch.optim`` optimizer the cloud replays, built after ``split()`` with its defaults or
with other constructor options, trains the split model bitwise as it trains the unsplit one.

Some constructors read their parameters (Adagrad asks ``torch.is_complex(p)`` and makes a
``torch.full_like(p, initial_accumulator_value)`` accumulator for each): on a cloud placeholder
those answer from its shape, and the state made for a cloud parameter is recognised as the
constructor's own, which the cloud's copy of the optimizer makes too. State a script writes for a
cloud parameter afterwards is still refused, before anything diverges. Every test runs against a
real cloud process.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import splitft
from splitft.edge.placeholders import CloudState, RemoteTensor
from splitft.errors import ConfigError, PlaceholderError
from tests.conftest import start_cloud, stop
from tests.models import mlp
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

MLP = "tests.models:mlp"

#: (optimizer, constructor options): each one's defaults, then options other than the defaults.
OPTIMIZERS: list[tuple[str, dict[str, Any]]] = [
    (name, {}) for name in ("ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Muon", "NAdam",
                            "RAdam", "RMSprop", "Rprop", "SGD")
] + [
    ("Adagrad", {"initial_accumulator_value": 0.1, "lr_decay": 0.01, "weight_decay": 0.01, "eps": 1e-8}),
    ("Adagrad", {"initial_accumulator_value": 0.5, "foreach": True}),
    ("Adagrad", {"initial_accumulator_value": 0.5, "foreach": False, "maximize": True}),
    ("Adagrad", {"initial_accumulator_value": 0.5, "fused": True}),
    ("Adam", {"amsgrad": True, "weight_decay": 0.1, "foreach": False}),
    ("AdamW", {"fused": True, "betas": (0.8, 0.99)}),
    ("SGD", {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("RMSprop", {"centered": True, "momentum": 0.5, "alpha": 0.9}),
    ("Rprop", {"etas": (0.4, 1.3), "step_sizes": (1e-5, 1.0)}),
    ("ASGD", {"lambd": 1e-3, "t0": 2.0}),
    ("NAdam", {"decoupled_weight_decay": True, "weight_decay": 0.1, "momentum_decay": 0.01}),
    ("RAdam", {"decoupled_weight_decay": True, "weight_decay": 0.1}),
    ("Adamax", {"weight_decay": 0.1}),
    ("Adadelta", {"rho": 0.8, "lr": 0.5}),
    ("Adafactor", {"beta2_decay": -0.5, "weight_decay": 0.1}),
    ("Adafactor", {"eps": (None, 1.0)}),  # a setting holding None: it was left out, the cloud stepping with its own
]


def _id(case: tuple[str, dict[str, Any]]) -> str:
    name, options = case
    return name + "".join(f"-{k}={v}" for k, v in options.items())


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MLP)
    yield address
    stop(proc)


def _build(name: str, options: dict[str, Any], model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer as a script builds it; Muon takes matrices only (a script gives it those)."""
    params = [p for p in model.parameters() if p.ndim == 2] if name == "Muon" else model.parameters()
    return getattr(torch.optim, name)(params, **{"lr": 0.05, **options})


def _train(model: nn.Module, opt: torch.optim.Optimizer, crit: nn.Module, data: list, clear_first: bool = True) -> None:
    for x, y in data:
        if clear_first:
            opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        if not clear_first:
            opt.zero_grad()


def _split(cloud: str, rejoin: int | None = None) -> tuple[splitft.SplitModel, nn.Module, nn.Module]:
    net = mlp()
    model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)
    return model, net, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())


def _local(script: Callable[[nn.Module, nn.Module], Any]) -> dict[str, torch.Tensor]:
    local = mlp()
    script(local, nn.CrossEntropyLoss())
    return local.state_dict()


@pytest.mark.parametrize("case", OPTIMIZERS, ids=_id)
def test_an_optimizer_built_after_split_trains_bitwise_as_unsplit(cloud, case):
    name, options = case
    data = _data(3)
    expected = _local(lambda model, crit: _train(model, _build(name, options, model), crit, data))
    model, net, crit = _split(cloud)
    with model:
        _train(model, _build(name, options, model), crit, data)
        state = model.state_dict()
    assert_bitwise(state, expected)


@pytest.mark.parametrize("options", [{"lr": torch.tensor(0.05)}, {"betas": (torch.tensor(0.8), torch.tensor(0.99))}],
                         ids=["lr", "betas"])
def test_a_tensor_setting_given_to_the_constructor_is_refused_before_the_cloud_steps(cloud, options):
    """It used to be left out of what the cloud's copy was built with: that copy stepped with its
    own default learning rate, silently."""
    data = _data(2)
    model, net, crit = _split(cloud)
    with model:
        with pytest.raises(ConfigError, match=r"Adam's (lr is a tensor: torch steps with it in the tensor's own "
                                              r"precision|betas is \(tensor.*set it as Python numbers)"):
            _train(model, _build("Adam", options, model), crit, data)


@pytest.mark.parametrize("case", OPTIMIZERS, ids=_id)
def test_the_optimizer_state_lists_the_cloud_parameters_where_the_unsplit_one_does(cloud, case, tmp_path):
    """After steps, ``opt.state`` has an entry for every parameter the unsplit optimizer has one
    for, with the same keys, shapes and dtypes; the cloud half's are placeholders, so a script
    that walks the state (a reset of the moments) raises on them instead of skipping the cloud
    half. ``opt.state_dict()`` holds the cloud's values: it saves the unsplit optimizer's, bitwise."""
    name, options = case
    data = _data(2)
    local = mlp()
    local_opt = _build(name, options, local)
    _train(local, local_opt, nn.CrossEntropyLoss(), data)
    model, net, crit = _split(cloud)
    with model:
        opt = _build(name, options, model)
        _train(model, opt, crit, data)
        cloud_params = {id(p) for p in model.cloud_parameters()}
        for (pname, param), twin in zip(net.named_parameters(), local.parameters()):
            assert (param in opt.state) == (twin in local_opt.state), pname
            entry, expected = opt.state.get(param, {}), local_opt.state.get(twin, {})
            if id(param) not in cloud_params or not expected:
                continue
            if getattr(entry, "opaque", False):  # keys unknown here: every read raises
                with pytest.raises(PlaceholderError, match=r"optimizer state of cloud parameter .*read it from "
                                                           r"opt.state_dict\(\)\['state'\]"):
                    entry[next(iter(expected))]
                with pytest.raises(PlaceholderError):
                    list(entry.values())
                continue
            assert entry.keys() == expected.keys(), pname
            for key, value in expected.items():
                if isinstance(value, torch.Tensor):
                    got = entry[key]
                    assert isinstance(got, RemoteTensor), (pname, key)
                    assert (got.shape, got.dtype, got.device) == (value.shape, value.dtype, value.device), (pname, key)
                    with pytest.raises(PlaceholderError, match=r"optimizer state of cloud parameter|made like cloud"):
                        got.zero_()
        torch.save(opt.state_dict(), tmp_path / "opt.pt")
    saved, expected = torch.load(tmp_path / "opt.pt"), local_opt.state_dict()  # the cloud's entries fetched
    assert saved["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert saved["state"][index].keys() == entry.keys()
        assert all(torch.equal(saved["state"][index][key], value) and saved["state"][index][key].dtype == value.dtype
                   for key, value in entry.items() if isinstance(value, torch.Tensor)), index


def test_a_reset_of_the_moments_by_walking_the_state_raises_before_the_cloud_half_diverges(cloud):
    """The unsplit script zeroes every parameter's Adam moments; the split one meets the cloud
    half's entries and raises there: before this, they were missing from ``opt.state`` and the
    reset silently changed the edge half's alone."""
    model, net, crit = _split(cloud)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, _data(1))
        assert net[2].weight in opt.state and opt.state[net[2].weight]["step"].shape == ()
        with pytest.raises(PlaceholderError, match=r"optimizer state of cloud parameter '2.weight'"):
            for entry in opt.state.values():
                entry["exp_avg"].zero_()
        with pytest.raises(PlaceholderError, match=r"written for a cloud parameter"):
            opt.state[net[2].weight]["exp_avg"] = torch.zeros(net[2].weight.shape)


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_adagrads_initial_accumulator_reaches_the_clouds_optimizer(cloud, rejoin):
    """The cloud's copy starts from the accumulator the edge's constructor made: with another
    ``initial_accumulator_value`` the weights differ, and split still equals unsplit bitwise."""
    data = _data(3)

    def script(value: float) -> Callable[[nn.Module, nn.Module], None]:
        return lambda model, crit: _train(
            model, torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=value, lr_decay=0.05),
            crit, data)

    expected, default = _local(script(2.0)), _local(script(0.0))
    assert not torch.equal(expected["2.weight"], default["2.weight"])  # the setting matters to the cloud half
    model, net, crit = _split(cloud, rejoin)
    with model:
        opt = model.attach(torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=2.0,
                                               lr_decay=0.05))
        assert torch.is_complex(net[2].weight) is False and isinstance(opt.state[net[2].weight]["sum"], CloudState)
        _train(model, opt, crit, data)
        state = model.state_dict()
    assert_bitwise(state, expected)


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_an_adagrad_built_before_split_trains_bitwise_and_the_edge_keeps_no_cloud_accumulator(cloud, rejoin):
    """Built on the whole model, its accumulators for the cloud half are real tensors: being what
    the constructor makes, they are the cloud's copy's too, and give way to placeholders here."""
    data = _data(3)

    def build(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.3)

    expected = _local(lambda model, crit: _train(model, build(model), crit, data))
    net = mlp()
    opt = build(net)
    model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)
    with model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        _train(model, opt, crit, data)
        state = model.state_dict()
        assert isinstance(opt.state[net[2].weight]["sum"], RemoteTensor)
        assert not isinstance(opt.state[net[0].weight]["sum"], RemoteTensor)
    assert_bitwise(state, expected)


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.3, total_steps=4,
                                                                  cycle_momentum=False),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=3),
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0, factor=0.5),
    "LambdaLR": lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1 / (step + 1)),
}


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_a_scheduler_and_clipping_over_an_adagrad_built_after_split_train_bitwise(cloud, scheduler):
    data = _data(4)

    def script(model: nn.Module, crit: nn.Module) -> None:
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.1)
        sched = SCHEDULERS[scheduler](opt)
        for x, y in data:
            opt.zero_grad()
            loss = crit(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step(loss.item()) if scheduler == "ReduceLROnPlateau" else sched.step()

    expected = _local(script)
    model, net, crit = _split(cloud)
    with model:
        script(model, crit)
        state = model.state_dict()
    assert_bitwise(state, expected)


#: State written for a cloud parameter after two steps: (what the script does, the error, its message).
WRITTEN: dict[str, tuple[Callable[[torch.optim.Optimizer, nn.Module], Any], type, str]] = {
    "an accumulator replaced": (
        lambda opt, net: opt.state[net[2].weight].update(sum=torch.full_like(net[2].weight, 1.0)),
        ConfigError, r"written for a cloud parameter"),
    "an entry replaced by an empty one": (
        lambda opt, net: opt.state.__setitem__(net[2].weight, {}), ConfigError,
        r"state was reset for some of the cloud half's parameters only"),
    "an entry deleted": (lambda opt, net: opt.state.pop(net[2].weight), ConfigError,
                         r"state was reset for some of the cloud half's parameters only"),
    "every entry cleared": (lambda opt, net: opt.state.clear(), ConfigError,
                            r"state was reset.*constructor made the state its step reads"),
    "an accumulator changed in place": (
        lambda opt, net: opt.state[net[2].weight]["sum"].add_(1.0), PlaceholderError,
        r"made like cloud parameter '2.weight'"),
}


@pytest.mark.parametrize("name", sorted(WRITTEN))
def test_adagrad_state_written_for_a_cloud_parameter_after_a_step_is_refused(cloud, name):
    """The error comes before the step that would diverge: the weights are the unsplit run's of
    two steps."""
    data = _data(3)
    expected = _local(lambda model, crit: _train(model, torch.optim.Adagrad(model.parameters(), lr=0.05), crit,
                                                 data[:2]))
    change, error, message = WRITTEN[name]
    model, net, crit = _split(cloud)
    with model:
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05)
        _train(model, opt, crit, data[:2])
        with pytest.raises(error, match=message):
            change(opt, net)
            _train(model, opt, crit, data[2:])
        state = model.state_dict()
    assert_bitwise(state, expected)


def test_adagrad_state_written_for_a_cloud_parameter_before_it_attaches_is_refused(cloud):
    model, net, crit = _split(cloud)
    with model:
        opt = torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.1)
        opt.state[net[2].weight]["sum"] = torch.full_like(net[2].weight, 5.0)
        with pytest.raises(ConfigError, match=r"constructor did not make"):
            model.attach(opt)


def test_an_adagrad_built_after_split_resumes_from_an_edge_checkpoint_bitwise(tmp_path):
    """The edge checkpoint keeps the edge half's accumulators; the cloud's are in its own."""
    data = _data(6)

    def train(model: nn.Module, opt: torch.optim.Optimizer, crit: nn.Module, part: list) -> None:
        _train(model, opt, crit, part, clear_first=False)  # each step leaves no gradient behind

    def build(model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adagrad(model.parameters(), lr=0.05, initial_accumulator_value=0.2)

    expected = _local(lambda model, crit: train(model, build(model), crit, data))
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--checkpoint-dir",
                                     str(tmp_path / "ck"), "--no-fsync")
    try:
        first, _, crit = _split(address)
        opt = build(first)
        train(first, opt, crit, data[:3])
        first.save_checkpoint(tmp_path / "edge")
        train(first, opt, crit, data[3:4])  # lost with the edge that "crashes" now
        first.session.drop()
        second = splitft.split(mlp(seed=5), 2, factory=MLP, connect=address, resume_from=tmp_path / "edge")
        with second:
            train(second, build(second), second.remote_loss(nn.CrossEntropyLoss()), data[3:])
            state = second.state_dict()
    finally:
        stop(proc)
    assert_bitwise(state, expected)


def test_a_step_with_a_closure_trains_bitwise_and_lbfgs_is_refused_before_it_steps(cloud):
    """``opt.step(closure)`` runs the closure's forward and backward first, as the step would, but
    before the cloud half's gradients are hidden from the edge's step. LBFGS calls its closure
    again and again inside one step, which the cloud's copy cannot repeat: refused when attached."""
    data = _data(3)

    def script(model: nn.Module, crit: nn.Module) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for x, y in data:
            def closure() -> torch.Tensor:
                opt.zero_grad()
                loss = crit(model(x), y)
                loss.backward()
                return loss
            losses.append(opt.step(closure).item())
        return losses

    local = mlp()
    expected_losses = script(local, nn.CrossEntropyLoss())
    model, net, crit = _split(cloud)
    with model:
        losses = script(model, crit)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())
    assert losses == expected_losses
    model, net, crit = _split(cloud)
    with model:
        with pytest.raises(ConfigError, match=r"LBFGS steps by calling a closure"):
            model.attach(torch.optim.LBFGS(model.parameters()))
