"""One edge's half sharded across the ranks that split its batch (``--split-batch --shard``).

A real 2-rank cloud (gloo, real processes) holding each half as FSDP2 shards must train an edge
exactly as a 1-process cloud does, with Adam/AdamW so that optimizer state is sharded too and
gradient clipping so that norms are gathered; each rank must report holding about half of the
half's parameters; weights the edge loads or reads cross whole. What cannot be sharded exactly
is refused with a typed error.
"""

from __future__ import annotations

import re

import pytest
import torch

import splitft
from splitft import Faults
from splitft.app.cli import main
from splitft.errors import ConfigError
from tests.conftest import stop
from tests.models import mlp
from tests.test_batch_split import MODELS, _cloud, _same, _train, _train_bert

HOLDS = re.compile(r"rank (\d+): holds ([\d,]+) of the half's ([\d,]+) parameter values")


def _adam(params) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


RUNS = {
    "plain split, loss in the cloud, Adam": lambda c: _train(c, mlp(), MODELS[0], 2, optimizer=_adam),
    "U-shape, AdamW": lambda c: _train(c, mlp(), MODELS[0], 2, 4, seed=1, optimizer=_adamw),
    "tiny BERT trunk, AdamW": _train_bert,
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("shard")
    out = {}
    for ranks in (1, 2):
        procs, address, errs = _cloud(tmp, ranks, "--shard")
        try:
            out[ranks] = {name: run(address) for name, run in RUNS.items()}
        except Exception as exc:
            raise AssertionError("\n".join(e.text for e in errs)) from exc
        finally:
            for p in procs:
                stop(p)
        out[f"{ranks}-log"] = "\n".join(e.text for e in errs)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(RUNS))
def test_a_half_sharded_over_two_ranks_trains_as_one_process(runs, name):
    one, two = runs[1][name], runs[2][name]
    _same(two["cloud"], one["cloud"])
    _same(two["edge"], one["edge"])
    torch.testing.assert_close(torch.tensor(two["losses"]), torch.tensor(one["losses"]), rtol=1e-5, atol=1e-6)
    assert "the half sharded across them" in runs["2-log"]


@pytest.mark.timeout(240)
def test_each_rank_holds_about_half_of_the_half(runs):
    """What each rank says it holds, once per session (after its first optimizer step)."""
    said: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    for rank, held, total in HOLDS.findall(runs["2-log"]):
        said[int(rank)].append((int(held.replace(",", "")), int(total.replace(",", ""))))
    assert len(said[0]) == len(said[1]) == len(RUNS), runs["2-log"]
    for (held0, total), (held1, total1) in zip(said[0], said[1]):
        assert total == total1 and held0 + held1 == total
        assert abs(held0 - total / 2) <= 0.1 * total, (held0, held1, total)


@pytest.fixture
def cloud(tmp_path):
    procs, address, errs = _cloud(tmp_path, 2, "--shard")
    try:
        yield address
    finally:
        for p in procs:
            stop(p)


@pytest.mark.timeout(120)
def test_weights_the_edge_loads_reach_every_shard_and_come_back_whole(cloud):
    model = splitft.split(mlp(), 2, factory=MODELS[0], connect=cloud, faults=Faults(timeout=60))
    with model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
        crit = model.remote_loss(torch.nn.CrossEntropyLoss())
        g = torch.Generator().manual_seed(7)
        loaded = {k: torch.randn(v.shape, generator=g) * 0.3 for k, v in model.state_dict().items()}
        model.load_state_dict(loaded)
        assert set(model.cloud_state_dict()) == {"2.weight", "2.bias", "4.weight", "4.bias"}
        _same(model.cloud_state_dict(), {k: loaded[k] for k in model.cloud_state_dict()})
        x = torch.randn(6, 12, generator=g)
        crit(model(x), x[:, :3].argmax(dim=1)).backward()
        opt.step()
        after = model.cloud_state_dict()
    reference = mlp()
    reference.load_state_dict(loaded)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=0.01)
    torch.nn.functional.cross_entropy(reference(x), x[:, :3].argmax(dim=1)).backward()
    ref_opt.step()
    _same(after, {k: v for k, v in reference.state_dict().items() if k in after})


@pytest.mark.timeout(120)
def test_a_batch_with_fewer_rows_than_ranks_is_refused_and_the_cloud_goes_on(cloud):
    model = splitft.split(mlp(), 2, factory=MODELS[0], connect=cloud, faults=Faults(timeout=60))
    with model:
        crit = model.remote_loss(torch.nn.CrossEntropyLoss())
        x = torch.randn(1, 12)
        with pytest.raises(ConfigError, match="--shard computes every batch on all 2 ranks.*at least 2"):
            crit(model(x), x[:, :3].argmax(dim=1))
        x = torch.randn(4, 12)
        crit(model(x), x[:, :3].argmax(dim=1)).backward()  # the ranks are still in step


def test_shard_without_split_batch_is_a_clear_command_line_error(capsys):
    assert main(["cloud", "--bind", "tcp://127.0.0.1:0", "--model", MODELS[0], "--shard"]) == 2
    assert "--shard shards the half that --split-batch splits" in capsys.readouterr().err


def test_a_half_whose_modules_share_a_parameter_is_refused_before_anything_is_sharded():
    from splitft.cloud.shard import shard_half
    from splitft.cut import Chain

    first, second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    second.weight = first.weight  # tied, as an embedding and an output layer often are
    with pytest.raises(ConfigError, match="share a parameter.*--split-batch alone"):
        shard_half(Chain([("embed", first), ("out", second)]), mesh=None)
    assert not isinstance(first.weight, torch.distributed.tensor.DTensor)


@pytest.mark.timeout(120)
def test_unsplit_between_a_backward_and_its_step_gathers_the_gradients_from_every_shard(cloud):
    model = splitft.split(mlp(), 2, factory=MODELS[0], connect=cloud, faults=Faults(timeout=60))
    model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    crit = model.remote_loss(torch.nn.CrossEntropyLoss())
    x = torch.randn(6, 12, generator=torch.Generator().manual_seed(7))
    crit(model(x), x[:, :3].argmax(dim=1)).backward()
    whole = model.unsplit()
    reference = mlp()
    torch.nn.functional.cross_entropy(reference(x), x[:, :3].argmax(dim=1)).backward()
    _same({name: p.grad for name, p in whole.named_parameters()},
          {name: p.grad for name, p in reference.named_parameters()})
