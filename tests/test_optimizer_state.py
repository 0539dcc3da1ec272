"""A split model's optimizer state is the unsplit one's: ``opt.state_dict()`` holds the cloud
half's entries (fetched from the cloud's copy), bitwise those the unsplit optimizer would hold,
and ``opt.load_state_dict`` of such a state dict continues training exactly, split (a new session)
or unsplit. The cloud checks a loaded state against what its optimizer keeps. Every test runs
against a real cloud process."""

from __future__ import annotations

import collections
import copy
import io
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

import splitft
from splitft.errors import ConfigError, SplitFTError
from splitft.wire.operations import AddParamGroup, AttachOptimizer, LoadOptimizerState
from tests.conftest import start_cloud, stop
from tests.models import mlp
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

MLP = "tests.models:mlp"

BUILDS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "Adam": lambda params: torch.optim.Adam(params, lr=0.01),
    "AdamW-amsgrad": lambda params: torch.optim.AdamW(params, lr=0.01, amsgrad=True, weight_decay=0.1),
    "SGD-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True),
    "Adagrad": lambda params: torch.optim.Adagrad(params, lr=0.05, initial_accumulator_value=0.1),
    "RMSprop-centered": lambda params: torch.optim.RMSprop(params, lr=0.01, centered=True, momentum=0.5),
    "NAdam": lambda params: torch.optim.NAdam(params, lr=0.01),
}


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MLP)
    yield address
    stop(proc)


def _train(model: nn.Module, opt: torch.optim.Optimizer, crit: nn.Module, data: list) -> None:
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def _split(cloud: str, rejoin: int | None) -> tuple[splitft.SplitModel, nn.Module]:
    model = splitft.split(mlp(), 2, rejoin, factory=MLP, connect=cloud)
    return model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())


def _assert_same_state(got: dict, expected: dict) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert got["state"].keys() == expected["state"].keys()
    for index, entry in expected["state"].items():
        assert got["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            assert got["state"][index][key].dtype == value.dtype and torch.equal(got["state"][index][key], value), \
                (index, key)


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_state_dict_saved_from_a_split_run_is_the_unsplit_one_and_resumes_both_bitwise(cloud, tmp_path, name,
                                                                                       rejoin):
    build, data = BUILDS[name], _data(4)
    local = mlp()
    local_opt = build(local.parameters())
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:2])
    expected_state = copy.deepcopy(local_opt.state_dict())
    _train(local, local_opt, nn.CrossEntropyLoss(), data[2:])

    model, crit = _split(cloud, rejoin)
    with model:
        opt = build(model.parameters())
        _train(model, opt, crit, data[:2])
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
    saved = torch.load(tmp_path / "checkpoint.pt")
    _assert_same_state(saved["optimizer"], expected_state)

    again, crit = _split(cloud, rejoin)  # a new session: the cloud's optimizer starts empty
    with again:
        again.load_state_dict(saved["model"])
        opt = build(again.parameters())
        opt.load_state_dict(copy.deepcopy(saved["optimizer"]))  # torch's load keeps the tensors it is given
        _train(again, opt, crit, data[2:])
        assert_bitwise(again.state_dict(), local.state_dict())
        _assert_same_state(opt.state_dict(), local_opt.state_dict())

    unsplit = mlp()
    unsplit.load_state_dict(saved["model"])
    unsplit_opt = build(unsplit.parameters())
    unsplit_opt.load_state_dict(saved["optimizer"])
    _train(unsplit, unsplit_opt, nn.CrossEntropyLoss(), data[2:])
    assert_bitwise(unsplit.state_dict(), local.state_dict())


def test_a_state_dict_of_the_unsplit_run_loads_into_the_split_one(cloud):
    """The other way: checkpointed unsplit, continued split."""
    data = _data(4)
    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:2])
    weights, state = copy.deepcopy(local.state_dict()), copy.deepcopy(local_opt.state_dict())
    _train(local, local_opt, nn.CrossEntropyLoss(), data[2:])
    model, crit = _split(cloud, None)
    with model:
        model.load_state_dict(weights)
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        opt.load_state_dict(state)
        _train(model, opt, crit, data[2:])
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_state_dict_keyed_by_parameter_names_loads_by_their_places_as_torch_loads_it(cloud, rejoin):
    """torch matches a saved entry to a parameter by its key's place in the saved groups' params,
    whatever the keys are: the names torch.distributed.checkpoint's state dicts use, or numbers
    of another optimizer's. The cloud half's entries were dropped where the keys were not 0..n-1."""
    data = _data(4)

    def keyed_by_name(model: nn.Module, state: dict) -> dict:
        names = [n for n, _ in model.named_parameters()]
        return {"state": {names[i]: entry for i, entry in state["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}

    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:2])
    saved = keyed_by_name(local, copy.deepcopy(local_opt.state_dict()))
    torch.optim.Adam(mlp().parameters(), lr=0.01).load_state_dict(copy.deepcopy(saved))  # torch takes it
    _train(local, local_opt, nn.CrossEntropyLoss(), data[2:])
    model, crit = _split(cloud, rejoin)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:2])
        opt.load_state_dict(keyed_by_name(model, copy.deepcopy(opt.state_dict())))
        assert sorted(opt.state_dict()["state"]) == list(range(6))
        _train(model, opt, crit, data[2:])
        assert_bitwise(model.state_dict(), local.state_dict())


def test_loading_an_empty_state_clears_the_cloud_halfs_moments_too(cloud):
    """torch's load leaves the optimizer holding exactly what it loaded: nothing, here."""
    data = _data(4)
    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:2])
    local_opt.load_state_dict({**local_opt.state_dict(), "state": {}})
    _train(local, local_opt, nn.CrossEntropyLoss(), data[2:])
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:2])
        opt.load_state_dict({**opt.state_dict(), "state": {}})
        _train(model, opt, crit, data[2:])
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_state_dict_that_does_not_fit_is_refused_before_anything_changed(cloud):
    data = _data(3)
    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train(local, local_opt, nn.CrossEntropyLoss(), data)
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:2])
        wrong = copy.deepcopy(opt.state_dict())
        wrong["state"][2]["exp_avg"] = torch.zeros(3, 3)  # 2.weight's moment, of another shape
        with pytest.raises(ConfigError, match=r"cloud parameter '2.weight' is not the state"):
            opt.load_state_dict(wrong)
        momentum = copy.deepcopy(opt.state_dict())
        momentum["state"][2] = {"momentum_buffer": torch.zeros(16, 16)}  # an SGD's
        with pytest.raises(ConfigError, match=r"not the state"):
            opt.load_state_dict(momentum)
        _train(model, opt, crit, data[2:])
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("entries, message", [
    ({"9.weight": {"step": np.zeros((), np.float32)}}, r"not a parameter of this session's optimizer"),
    ({"2.weight": {"step": np.zeros((), np.float32)}}, r"keys"),
    ({"2.weight": {"step": np.zeros((), np.float32), "exp_avg": np.zeros((3, 3), np.float32),
                   "exp_avg_sq": np.zeros((16, 16), np.float32)}}, r"shape"),
    ({"2.weight": {"step": np.zeros((), np.float32), "exp_avg": np.full((16, 16), np.nan, np.float32),
                   "exp_avg_sq": np.zeros((16, 16), np.float32)}}, r"NaN"),
    ({"2.weight": [1, 2]}, r"map parameter names to maps"),
])
def test_the_cloud_refuses_a_loaded_state_that_is_not_its_optimizers(cloud, entries, message):
    """What an edge sends is checked against the layout the cloud's optimizer keeps; a refused
    load leaves the state as it was."""
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, _data(1))
        before = model.session.optimizer_state()
        model.session.outbox.queue(LoadOptimizerState(entries=entries))
        with pytest.raises(SplitFTError, match=message):
            model.session.sync()
        after = model.session.optimizer_state()
        assert before.keys() == after.keys() and all(
            np.array_equal(before[n][k], after[n][k]) for n in before for k in before[n])


@pytest.mark.parametrize("saved_with, loaded_into", [
    (lambda params: torch.optim.Adam(params, lr=0.01, amsgrad=True), lambda params: torch.optim.Adam(params, lr=0.02)),
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), lambda params: torch.optim.SGD(params, lr=0.1)),
    (lambda params: torch.optim.Adam(params, lr=0.01, foreach=False), lambda params: torch.optim.Adam(params, lr=0.01)),
], ids=["Adam-amsgrad", "SGD-momentum", "Adam-foreach"])
def test_a_state_dict_whose_settings_change_what_the_optimizer_keeps_loads_as_torch_loads_it(
        cloud, saved_with, loaded_into):
    """torch's load takes the state dict's group settings with its state: an optimizer built without
    amsgrad (or momentum) loads one saved with it and steps with it from then on, keeping the state
    it brought; the split one does the same on both sides of the cut."""
    data = _data(4)
    saver = mlp()
    saver_opt = saved_with(saver.parameters())
    _train(saver, saver_opt, nn.CrossEntropyLoss(), data[:2])
    weights, state = copy.deepcopy(saver.state_dict()), copy.deepcopy(saver_opt.state_dict())
    local = mlp()
    local.load_state_dict(weights)
    local_opt = loaded_into(local.parameters())
    local_opt.load_state_dict(copy.deepcopy(state))
    _train(local, local_opt, nn.CrossEntropyLoss(), data[2:])
    model, crit = _split(cloud, None)
    with model:
        model.load_state_dict(weights)
        opt = loaded_into(model.parameters())
        opt.load_state_dict(copy.deepcopy(state))
        _train(model, opt, crit, data[2:])
        assert_bitwise(model.state_dict(), local.state_dict())
        _assert_same_state(opt.state_dict(), local_opt.state_dict())


@pytest.mark.parametrize("changes, message", [
    ([{"amsgrad": 1.0}], r"amsgrad must keep its type"),
    ([{"params": [0]}], r"cannot change the optimizer's 'params'"),
    ([{"nesterov": True}], r"cannot change the optimizer's 'nesterov'"),
    ([{}, {}], r"one map per parameter group \(1\)"),
])
def test_the_cloud_refuses_loaded_settings_that_are_not_its_optimizers(cloud, changes, message):
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, _data(1))
        before = model.session.optimizer_state()
        model.session.outbox.queue(LoadOptimizerState(entries={}, changes=changes))
        with pytest.raises(SplitFTError, match=message):
            model.session.sync()
        after = model.session.optimizer_state()
        assert before.keys() == after.keys()


def test_the_state_of_an_optimizer_whose_layout_is_not_known_ahead_saves_but_does_not_load(cloud):
    """ASGD reads a value on the host in its step, so the state it keeps cannot be learnt over meta
    tensors: the cloud could not check a loaded one. Saving works; loading is refused, with the fix,
    before anything changed."""
    data = _data(3)
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.ASGD(model.parameters(), lr=0.05)
        _train(model, opt, crit, data[:2])
        saved = copy.deepcopy(opt.state_dict())
        assert set(saved["state"]) == {0, 1, 2, 3, 4, 5} and saved["state"][2]["ax"].shape == (16, 16)
        with pytest.raises(ConfigError, match=r"not known ahead of its steps.*save_checkpoint"):
            opt.load_state_dict(saved)
        _train(model, opt, crit, data[2:])
        state = model.state_dict()
    local = mlp()
    local_opt = torch.optim.ASGD(local.parameters(), lr=0.05)
    _train(local, local_opt, nn.CrossEntropyLoss(), data)
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("name", ["Adam", "SGD-momentum", "Adagrad"])
def test_after_unsplit_the_same_optimizer_trains_the_whole_model_on_exactly(cloud, name, rejoin):
    """``unsplit()`` gives the optimizer the cloud's state for the parameters that come back:
    without it the cloud half's moments would start afresh (Adam) or raise (placeholders)."""
    build, data = BUILDS[name], _data(4)
    local = mlp()
    local_opt = build(local.parameters())
    _train(local, local_opt, nn.CrossEntropyLoss(), data)
    model, crit = _split(cloud, rejoin)
    opt = build(model.parameters())
    _train(model, opt, crit, data[:2])
    whole = model.unsplit()
    _train(whole, opt, nn.CrossEntropyLoss(), data[2:])
    assert_bitwise(whole.state_dict(), local.state_dict())
    _assert_same_state(opt.state_dict(), local_opt.state_dict())


#: How scripts reset an optimizer's moments between two phases of training.
RESETS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "cleared": lambda opt: opt.state.clear(),
    "a fresh dict": lambda opt: setattr(opt, "state", collections.defaultdict(dict)),
    "every entry popped": lambda opt: [opt.state.pop(p, None) for g in opt.param_groups for p in g["params"]],
}


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("reset", sorted(RESETS))
@pytest.mark.parametrize("name", ["Adam", "SGD-momentum", "ASGD"])
def test_a_state_the_script_resets_is_reset_in_the_cloud_too(cloud, name, rejoin, reset):
    """Unsplit, a reset optimizer starts every moment afresh at its next step: the cloud's copy
    drops the cloud half's too, so the state dict read right after the reset holds no entry, and
    training goes on bitwise (ASGD: a state whose layout is not known ahead resets as well)."""
    build = {**BUILDS, "ASGD": lambda params: torch.optim.ASGD(params, lr=0.05)}[name]
    data = _data(4)
    local = mlp()
    local_opt = build(local.parameters())
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:2])
    RESETS[reset](local_opt)
    expected = copy.deepcopy(local_opt.state_dict())
    _train(local, local_opt, nn.CrossEntropyLoss(), data[2:])
    model, crit = _split(cloud, rejoin)
    with model:
        opt = build(model.parameters())
        _train(model, opt, crit, data[:2])
        RESETS[reset](opt)
        _assert_same_state(opt.state_dict(), expected)
        _train(model, opt, crit, data[2:])
        assert_bitwise(model.state_dict(), local.state_dict())
        _assert_same_state(opt.state_dict(), local_opt.state_dict())


def test_a_state_reset_just_before_unsplit_comes_back_reset(cloud):
    """``unsplit()`` right after ``opt.state.clear()``: the optimizer holds no moment for the
    parameters that come back, as unsplit, rather than the cloud's from before the reset."""
    data = _data(4)
    local = mlp()
    local_opt = BUILDS["Adam"](local.parameters())
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:2])
    local_opt.state.clear()
    _train(local, local_opt, nn.CrossEntropyLoss(), data[2:])
    model, crit = _split(cloud, None)
    opt = BUILDS["Adam"](model.parameters())
    _train(model, opt, crit, data[:2])
    opt.state.clear()
    whole = model.unsplit()
    assert not opt.state
    _train(whole, opt, nn.CrossEntropyLoss(), data[2:])
    assert_bitwise(whole.state_dict(), local.state_dict())
    _assert_same_state(opt.state_dict(), local_opt.state_dict())


def test_a_reset_of_only_the_edge_halfs_moments_stays_on_the_edge(cloud):
    """A layer of the edge half re-initialised with its moments dropped (``opt.state.pop``): the
    cloud half's moments are untouched, as unsplit."""
    def run(model: nn.Module, net: nn.Module, crit: nn.Module) -> torch.optim.Optimizer:
        opt = BUILDS["Adam"](model.parameters())
        _train(model, opt, crit, data[:2])
        torch.manual_seed(5)
        net[0].reset_parameters()
        opt.state.pop(net[0].weight)
        opt.state.pop(net[0].bias)
        _train(model, opt, crit, data[2:])
        return opt

    data = _data(4)
    local = mlp()
    local_opt = run(local, local, nn.CrossEntropyLoss())
    net = mlp()
    model = splitft.split(net, 2, factory=MLP, connect=cloud)
    with model:
        opt = run(model, net, model.remote_loss(nn.CrossEntropyLoss()))
        assert_bitwise(model.state_dict(), local.state_dict())
        _assert_same_state(opt.state_dict(), local_opt.state_dict())


def _unfreezing(model: nn.Module, crit: nn.Module, data: list) -> torch.optim.Optimizer:
    """The head frozen for a step, then given to the optimizer in a group of its own."""
    head = model[4] if isinstance(model, nn.Sequential) else model.model[4]
    head.requires_grad_(False)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=0.01)
    _train(model, opt, crit, data[:1])
    head.requires_grad_(True)
    opt.add_param_group({"params": head.parameters(), "lr": 0.005, "amsgrad": True})
    _train(model, opt, crit, data[1:3])
    return opt


def test_a_group_added_mid_training_holds_the_unsplit_state_and_loads_into_a_new_session(cloud):
    data = _data(4)
    local = mlp()
    local_opt = _unfreezing(local, nn.CrossEntropyLoss(), data)
    model, crit = _split(cloud, None)
    with model:
        opt = _unfreezing(model, crit, data)
        saved, weights = copy.deepcopy(opt.state_dict()), model.state_dict()
        _assert_same_state(saved, local_opt.state_dict())
        assert saved["state"][4]["max_exp_avg_sq"].shape == (3, 16)  # the added group's own layout
    _train(local, local_opt, nn.CrossEntropyLoss(), data[3:])
    model, crit = _split(cloud, None)
    with model:
        model.load_state_dict(weights)
        params = [p for name, p in model.named_parameters() if not name.startswith("4.")]
        opt = torch.optim.Adam(params, lr=0.01)
        opt.add_param_group({"params": model.model[4].parameters(), "lr": 0.005, "amsgrad": True})
        opt.load_state_dict(saved)
        _train(model, opt, crit, data[3:])
        assert_bitwise(model.state_dict(), local.state_dict())
        _assert_same_state(opt.state_dict(), local_opt.state_dict())


@pytest.mark.parametrize("op, message", [
    (dict(index=5, names=["4.weight"], settings={}), r"parameter group 5 added where the optimizer has 1"),
    (dict(index=1, names=["2.weight"], settings={}), r"more than one parameter group"),
    (dict(index=1, names=["9.weight"], settings={}), r"no parameter '9.weight'"),
    (dict(index=1, names=[], settings={"lr": "fast"}), r"lr must keep its type"),
    (dict(index=1, names=[], settings={"params": [1]}), r"cannot change the optimizer's 'params'"),
    (dict(index=-1, names=[], settings={}), r"index must be an int of at least 0"),
])
def test_the_cloud_refuses_a_parameter_group_that_is_not_one_of_its_half(cloud, op, message):
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, _data(1))
        model.session.outbox.queue(AddParamGroup(**op))
        with pytest.raises(SplitFTError, match=message):
            model.session.sync()
        _train(model, opt, crit, _data(2)[1:])  # one group still, on both sides: training goes on


def test_groups_added_one_by_one_stop_at_the_most_an_optimizer_may_have(cloud):
    """Each added group is checked alone (its names against those the groups hold), so a thousand of
    them cost what one optimizer of a thousand groups costs; the next is refused, and nothing of it kept."""
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, _data(1))
        for index in range(1, 1024):
            model.session.outbox.queue(AddParamGroup(index=index, names=[], settings={}))
        model.session.sync()
        model.session.outbox.queue(AddParamGroup(index=1024, names=[], settings={}))
        with pytest.raises(SplitFTError, match=r"more than 1024 parameter groups"):
            model.session.sync()


def test_a_message_that_would_build_more_groups_than_an_optimizer_has_is_refused_whole(cloud):
    """torch builds an optimizer's groups in time quadratic in their number: a message whose
    attachments would build more than one optimizer's most (60 ms for 1024 here) is refused before
    any of it is applied."""
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, _data(1))
        model.session.sync()  # the attachment and the step ride on a message of their own
        groups = [{"names": ["2.weight", "2.bias", "4.weight", "4.bias"], "settings": {}}]
        groups += [{"names": [], "settings": {}} for _ in range(599)]
        for attachment in (10, 11):
            model.session.outbox.queue(AttachOptimizer(name="SGD", settings={"lr": 0.5}, id=attachment, groups=groups))
        with pytest.raises(SplitFTError, match=r"builds 1200 parameter groups; an optimizer has at most 1024"):
            model.session.sync()
        state = model.session.optimizer_state()  # still the Adam it had, with its moments
        assert state and all(set(entry) == {"step", "exp_avg", "exp_avg_sq"} for entry in state.values())
        _train(model, opt, crit, _data(2)[1:])


def _cloud_moment(sd: dict) -> torch.Tensor:
    return sd["state"][2]["exp_avg"]  # "2.weight": the first cloud parameter


def _kept_trained_loaded(opt: torch.optim.Optimizer, sd: dict, step: Callable[[], None]) -> None:
    step()
    opt.load_state_dict(sd)  # unsplit: sd is the optimizer's own state, so this loads it onto itself


def _kept_trained_saved(opt: torch.optim.Optimizer, sd: dict, step: Callable[[], None]) -> None:
    step()
    torch.save(sd, io.BytesIO())  # unsplit: saves the moments of now


def _written(opt: torch.optim.Optimizer, sd: dict, step: Callable[[], None]) -> None:
    _cloud_moment(sd).zero_()  # unsplit: zeroes the optimizer's own moment


def _shared_with_another(opt: torch.optim.Optimizer, sd: dict, step: Callable[[], None]) -> None:
    twin = mlp()
    other = torch.optim.Adam(twin.parameters(), lr=0.01)
    other.load_state_dict(sd)  # torch's load keeps the tensors: unsplit both optimizers share the moments
    nn.CrossEntropyLoss()(twin(_data(1)[0][0]), _data(1)[0][1]).backward()
    other.step()  # unsplit: moves the first optimizer's moments too


OPTIMIZER_STATE_MISUSE = {"kept, trained, loaded": (_kept_trained_loaded, "used after the cloud half changed"),
                          "kept, trained, saved": (_kept_trained_saved, "used after the cloud half changed"),
                          "written in place": (_written, "was written in place"),
                          "loaded into another that steps": (_shared_with_another, "was written in place")}


@pytest.mark.parametrize("name", sorted(OPTIMIZER_STATE_MISUSE))
def test_a_cloud_entry_of_opt_state_dict_refuses_a_write_and_a_read_after_a_step(cloud, name):
    """Unsplit, opt.state_dict() holds the optimizer's own moments: ``best = opt.state_dict()`` kept
    without a copy follows training, so loading it later changes nothing. Split, its cloud entries
    are fetched copies, which would rewind the cloud's moments: refused before anything parts, and
    training goes on exactly."""
    action, message = OPTIMIZER_STATE_MISUSE[name]
    data = _data(3)
    local = mlp()
    _train(local, torch.optim.Adam(local.parameters(), lr=0.01), nn.CrossEntropyLoss(), data)
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:1])
        sd = opt.state_dict()
        with pytest.raises(ConfigError, match=r"a tensor of opt\.state_dict\(\) \(the cloud half's '\w+ of "
                                              rf"2\.weight'\) (is )?{message}.*(copy\.deepcopy|opt\.load_state_dict)"):
            action(opt, sd, lambda: _train(model, opt, crit, data[1:2]))
        if name == "loaded into another that steps":
            return  # its step moved the edge half's moments first, shared as unsplit: this run is not local's
        _train(model, opt, crit, data[1 if "trained" not in name else 2:])
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_tensor_of_a_loaded_checkpoint_kept_by_reference_is_read_as_of_the_load_or_refused_after(cloud):
    """Unsplit, ``opt.load_state_dict(ck["optimizer"])`` keeps the checkpoint's tensors as the
    optimizer's state, so a script (or a framework's checkpoint handler) that kept a reference to
    one before the load reads the moments of now after training on. Split, that very tensor object
    stands for the cloud's: read at once it holds the loaded values; after a step, refused."""
    data = _data(3)
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:1])
        buffer = io.BytesIO()
        torch.save(copy.deepcopy(opt.state_dict()), buffer)
        ck = torch.load(io.BytesIO(buffer.getvalue()))
        kept = {i: dict(entry) for i, entry in ck["state"].items()}  # references to the checkpoint's tensors
        loaded = kept[2]["exp_avg"].clone()
        opt.load_state_dict(ck)
        assert torch.equal(kept[2]["exp_avg"], loaded)
        _train(model, opt, crit, data[1:2])
        with pytest.raises(ConfigError, match=r"the cloud half's 'exp_avg of 2\.weight'\) is used after the cloud "
                                              r"half changed"):
            kept[2]["exp_avg"].sum()
        assert torch.equal(kept[0]["exp_avg"], opt.state[next(model.parameters())]["exp_avg"])  # an edge one


def _same_both_ways(cloud: str, script: Callable[[nn.Module, nn.Module], torch.optim.Optimizer]) -> None:
    """``script(model, crit)`` (returning its optimizer) on the unsplit model and on a split one:
    the weights and the optimizer's state come out bitwise alike."""
    def run(split: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        model, crit = _split(cloud, None) if split else (mlp(), nn.CrossEntropyLoss())
        return model, script(model, crit)

    _runs_alike(run)


def _runs_alike(run: Callable[[bool], tuple[nn.Module, torch.optim.Optimizer]]) -> None:
    """``run(split)`` unsplit and split (returning the model and its optimizer): the weights and
    the optimizer's state come out bitwise alike."""
    runs = []
    for split in (False, True):
        model, opt = run(split)
        runs.append((model.state_dict(), copy.deepcopy(opt.state_dict())))
        if split:
            model.close()
    (local, local_opt), (split_sd, split_opt) = runs
    assert_bitwise(split_sd, local)
    _assert_same_state(split_opt, local_opt)


def test_a_copied_best_optimizer_state_loads_back_as_unsplit(cloud):
    """The best-checkpoint idiom done with a copy (``copy.deepcopy(opt.state_dict())``) rewinds
    both halves' moments, split as unsplit; one loaded back before any step changes nothing."""
    data = _data(4)

    def script(model: nn.Module, crit: nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:1])
        opt.load_state_dict(opt.state_dict())
        best = copy.deepcopy(opt.state_dict())
        _train(model, opt, crit, data[1:3])
        opt.load_state_dict(best)
        _train(model, opt, crit, data[3:])
        return opt

    _same_both_ways(cloud, script)


def test_an_optimizer_state_dict_kept_across_unsplit_is_the_whole_optimizers(cloud):
    """unsplit() makes a current fetched entry the optimizer's own tensor, as unsplit it always was:
    it follows the whole model's next step; one taken before the last step stays refused."""
    data = _data(3)
    model, crit = _split(cloud, None)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, crit, data[:1])
    stale = opt.state_dict()
    _train(model, opt, crit, data[1:2])
    sd = opt.state_dict()
    whole = model.unsplit()
    with pytest.raises(ConfigError, match="used after the cloud half changed"):
        _cloud_moment(stale).sum()
    assert _cloud_moment(sd) is not opt.state[whole[2].weight]["exp_avg"]
    _train(whole, opt, nn.CrossEntropyLoss(), data[2:])
    assert torch.equal(_cloud_moment(sd), opt.state[whole[2].weight]["exp_avg"])


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("name", ["Adam", "SGD-momentum", "Adagrad"])
def test_an_optimizer_that_stepped_before_split_goes_on_from_its_state(cloud, name, rejoin):
    """A few steps on the whole model, then split() with the same optimizer (a warm-up where the
    data first was): its moments for the cloud half go to the cloud's copy at its first step, as
    torch's own load would place them, and training goes on bitwise as unsplit."""
    data = _data(4)
    splitft.split(mlp(), 2, factory=MLP, connect=cloud).close()  # the warm-up's steps run splitft's step hook

    def run(split: bool) -> tuple[nn.Module, torch.optim.Optimizer]:
        net = mlp()
        opt = BUILDS[name](net.parameters())
        _train(net, opt, nn.CrossEntropyLoss(), data[:2])
        model, crit = _split_from(net, cloud, rejoin) if split else (net, nn.CrossEntropyLoss())
        _train(model, opt, crit, data[2:])
        assert not split or model.optimizer is opt  # found local in the warm-up; over the cloud half now
        return model, opt

    _runs_alike(run)


def test_an_entry_written_before_the_first_step_is_refused_as_the_scripts_own(cloud):
    """SAM's step keeps each weight before its perturbation in ``opt.state[p]["old_p"]``, written
    before the optimizer ever stepped (so before it was attached): the step that would carry it
    to the cloud's copy names what was written, not a load the script never made, and runs nothing."""
    data = _data(2)
    local = mlp()
    _train(local, torch.optim.SGD(local.parameters(), lr=0.05), nn.CrossEntropyLoss(), data[:1])
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        x, y = data[0]
        crit(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                opt.state[p]["old_p"] = p.detach().clone()
        with pytest.raises(ConfigError, match=r"this SGD holds an entry for cloud parameter '2.weight' .*written "
                                              r"before it was attached.*SAM.*a dict of the script's own"):
            opt.step()
        for p in model.parameters():
            del opt.state[p]
        opt.step()
        assert_bitwise(model.state_dict(), local.state_dict())


def _split_from(net: nn.Module, cloud: str, rejoin: int | None) -> tuple[splitft.SplitModel, nn.Module]:
    model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)  # the weights the warm-up left go along
    return model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())


def test_a_load_pre_hook_changes_what_both_halves_load(cloud):
    """``opt.register_load_state_dict_pre_hook`` (a checkpoint migrated as it loads: here the first
    moments halved) runs once per load, on the whole state dict, so the cloud half's entries load
    as it left them, as unsplit."""
    data = _data(3)
    calls = []

    def halve_moments(optimizer: torch.optim.Optimizer, sd: dict) -> dict:
        calls.append(1)
        state = {i: {k: v * 0.5 if k == "exp_avg" else v for k, v in entry.items()} for i, entry in sd["state"].items()}
        return {**sd, "state": state}

    def script(model: nn.Module, crit: nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:2])
        saved = copy.deepcopy(opt.state_dict())
        opt.register_load_state_dict_pre_hook(halve_moments)
        opt.load_state_dict(saved)
        _train(model, opt, crit, data[2:])
        return opt

    _same_both_ways(cloud, script)
    assert calls == [1, 1]


def test_a_step_that_raised_and_was_caught_leaves_the_cloud_gradients_to_the_script(cloud):
    """A step raising inside torch (amsgrad switched on mid-run: Adam's state lacks its key, a
    KeyError unsplit too), caught, the setting put back: the cloud's gradients must be there for
    the script's zero_grad again, or the next backward adds to the old ones."""
    data = _data(5)
    failures = []

    def script(model: nn.Module, crit: nn.Module) -> torch.optim.Optimizer:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.param_groups[0]["amsgrad"] = i == 2
            try:
                opt.step()
            except KeyError:
                failures.append(i)
                opt.param_groups[0]["amsgrad"] = False
        return opt

    _same_both_ways(cloud, script)
    assert failures == [2, 2]


def test_a_loaded_state_dict_follows_training_as_torchs_load_keeps_it(cloud):
    """Unsplit, torch's load keeps the loaded tensors as the optimizer's own: a resumed checkpoint's
    dict, saved again later, holds the moments of then. Split, its cloud entries stand for the
    cloud's: current right after the load, refused once a step moved them, followed after unsplit()."""
    data = _data(4)
    model, crit = _split(cloud, None)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, opt, crit, data[:1])
    ckpt = {"optimizer": copy.deepcopy(opt.state_dict())}
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    opt.load_state_dict(ckpt["optimizer"])
    torch.save(ckpt, io.BytesIO())  # current: saves as it is
    _train(model, opt, crit, data[1:2])
    with pytest.raises(ConfigError, match=r"opt\.state_dict\(\) \(the cloud half's 'step of 2\.weight'\) is used after"):
        torch.save(ckpt, io.BytesIO())
    loaded = copy.deepcopy(opt.state_dict())
    opt.load_state_dict(loaded)
    whole = model.unsplit()
    _train(whole, opt, nn.CrossEntropyLoss(), data[2:])  # two steps more, unsplit: the loaded dict follows
    assert torch.equal(loaded["state"][2]["exp_avg"], opt.state[whole[2].weight]["exp_avg"])
    assert loaded["state"][2]["step"] == 4


class _MyAdam(torch.optim.Adam):
    """A subclass of torch's Adam that adds nothing here; the cloud builds torch's classes only."""


class _SignSGD(torch.optim.Optimizer):
    """An optimizer of one's own (Lion, sign SGD): the cloud has no code of it."""

    def __init__(self, params, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


@pytest.mark.parametrize("build, message", [
    (lambda params: _MyAdam(params, lr=0.01),
     r"tests\.test_optimizer_state\._MyAdam is not one of them \(a subclass of torch\.optim\.Adam.*"
     r"use torch\.optim\.Adam itself"),
    (lambda params: torch.optim.Adam(params, lr=np.float32(0.01)),
     r"lr is np\.float32\(0\.01\): a numpy number computes in its own precision.*float\(\.\.\.\)"),
    (lambda params: _SignSGD(params),
     r"_SignSGD is not one of them \(an optimizer of its own.* a loop over the parameters under torch\.no_grad\(\)"),
], ids=["a subclass", "a numpy learning rate", "one of its own"])
def test_an_optimizer_the_cloud_cannot_rebuild_is_refused_naming_the_fix(cloud, build, message):
    model, _ = _split(cloud, None)
    with model, pytest.raises(ConfigError, match=message):
        model.attach(build(model.parameters()))


#: Settings a script changes mid-run to a value of another kind that the optimizer takes unsplit.
KIND_CHANGES: dict[str, tuple[Callable[[Any], torch.optim.Optimizer], str, Any]] = {
    "Adafactor's eps2 raised (eps is (None, 1e-3))": (lambda p: torch.optim.Adafactor(p, lr=0.01), "eps", (None, 1e-2)),
    "Adafactor's eps1 left to the dtype": (lambda p: torch.optim.Adafactor(p, lr=0.01, eps=(1e-8, 1e-3)), "eps",
                                           (None, 1e-3)),
    "Muon's lr adjustment named (it was None)": (lambda p: torch.optim.Muon([q for q in p if q.ndim == 2], lr=0.02),
                                                 "adjust_lr_fn", "match_rms_adamw"),
}


@pytest.mark.parametrize("name", sorted(KIND_CHANGES))
def test_a_setting_changed_mid_run_to_a_value_of_another_kind_trains_as_unsplit(cloud, name):
    build, key, value = KIND_CHANGES[name]
    data = _data(4)

    def run(model: nn.Module, crit: nn.Module) -> None:
        if "Muon" in name:
            for p in model.parameters():
                p.requires_grad_(p.ndim == 2)
        opt = build(list(model.parameters()))
        _train(model, opt, crit, data[:2])
        opt.param_groups[0][key] = value
        _train(model, opt, crit, data[2:])

    local = mlp()
    run(local, nn.CrossEntropyLoss())
    model, crit = _split(cloud, None)
    with model:
        run(model, crit)
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_setting_changed_to_a_kind_the_cloud_does_not_take_is_refused_before_either_half_steps(cloud):
    """``amsgrad = 1`` (an int for a flag): refused by the edge before its step, not by the cloud
    after the edge's half stepped (the halves a step apart)."""
    data = _data(3)
    model, crit = _split(cloud, None)
    with model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        _train(model, opt, crit, data[:1])
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt.param_groups[0]["amsgrad"] = 1
        opt.zero_grad()
        crit(model(data[1][0]), data[1][1]).backward()
        with pytest.raises(ConfigError, match=r"Adam's amsgrad changed from False to 1: .*nothing has stepped"):
            opt.step()
        assert_bitwise(model.state_dict(), before)
        opt.param_groups[0]["amsgrad"] = False
        opt.step()  # the same gradients, stepped as they would have been


def test_an_optimizer_whose_layout_is_not_known_ahead_warmed_up_before_split_is_refused_naming_the_warm_up(cloud):
    data = _data(3)
    net = mlp()
    opt = torch.optim.ASGD(net.parameters(), lr=0.05)
    _train(net, opt, nn.CrossEntropyLoss(), data[:2])
    model = splitft.split(net, 2, factory=MLP, connect=cloud)
    with model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        with pytest.raises(ConfigError, match=r"ASGD keeps is not known ahead.*stepped before split\(\).*warm up split"):
            _train(model, opt, crit, data[2:])
