"""Loops written the way people write them: `model.zero_grad()`, gradient clipping by the global
norm or by value, accumulation with `set_to_none=False`. Split must equal local, parameter for
parameter, plain and U-shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from tests.models import mlp
from tests.test_faults import MLP, _data, assert_same

NORM, INF = 0.2, 0.05  # below most steps' gradient norms, so the clipping bites
STYLES = ["model_zero_grad_and_clip_norm", "clip_value_and_set_to_none", "clip_inf_norm_with_accumulation"]


def _loop(model, opt, crit, data, style: str, clip) -> list[float]:
    """One training script per style; ``clip(kind, value)`` clips the way the script's model can."""
    norms = []
    for i, (x, y) in enumerate(data):
        if style == "model_zero_grad_and_clip_norm":
            model.zero_grad()
            crit(model(x), y).backward()
            norms.append(float(clip("norm", NORM)))
            opt.step()
        elif style == "clip_value_and_set_to_none":
            crit(model(x), y).backward()
            clip("value", 0.05)
            opt.step()
            opt.zero_grad(set_to_none=False)
        else:
            for part in torch.chunk(torch.arange(len(y)), 2):
                (crit(model(x[part]), y[part]) / 2).backward()
            norms.append(float(clip("inf", INF)))
            opt.step()
            model.zero_grad(set_to_none=False)
    return norms


def _local(data, style):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)

    def clip(kind, value):
        if kind == "value":
            return nn.utils.clip_grad_value_(model.parameters(), value)
        return nn.utils.clip_grad_norm_(model.parameters(), value, norm_type=2.0 if kind == "norm" else float("inf"))

    norms = _loop(model, opt, nn.CrossEntropyLoss(), data, style, clip)
    return model.state_dict(), norms


def _split(connect, data, style, rejoin, use_free):
    model = splitft.split(mlp(), 2, rejoin, factory=MLP, connect=connect, faults=splitft.Faults(heartbeat=0))
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())

        def free(kind, value):  # torch's free functions over model.parameters(), as scripts write them
            if kind == "value":
                return nn.utils.clip_grad_value_(model.parameters(), value)
            return nn.utils.clip_grad_norm_(model.parameters(), value, norm_type=2.0 if kind == "norm" else float("inf"))

        def method(kind, value):
            if kind == "value":
                return model.clip_grad_value_(value)
            return model.clip_grad_norm_(value, norm_type=2.0 if kind == "norm" else float("inf"))

        norms = _loop(model, opt, crit, data, style, free if use_free else method)
        return {**model.edge_state_dict(), **model.cloud_state_dict()}, norms


@pytest.mark.parametrize("use_free", [True, False], ids=["torch.nn.utils", "model-method"])
@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("style", STYLES)
def test_ordinary_loops_train_exactly_as_locally(inproc_cloud, style, rejoin, use_free):
    data = _data(6)
    local, local_norms = _local(data, style)
    split, split_norms = _split(inproc_cloud.connect, data, style, rejoin, use_free)
    assert_same(split, local)
    torch.testing.assert_close(torch.tensor(split_norms), torch.tensor(local_norms))
    if local_norms:  # the clipping really clipped
        assert max(local_norms) > (NORM if style.endswith("norm") else INF)


def test_model_zero_grad_clears_the_cloud_half_too(inproc_cloud):
    """Without the mirrored zero_grad the cloud half would accumulate every step's gradient."""
    data = _data(4)
    model = splitft.split(mlp(), 2, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    with model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for x, y in data:
            model.zero_grad()
            crit(model(x), y).backward()
        last = model.clip_grad_norm_(float("inf"))
    reference = mlp()
    x, y = data[-1]
    nn.CrossEntropyLoss()(reference(x), y).backward()
    torch.testing.assert_close(last, nn.utils.get_total_norm([p.grad for p in reference.parameters()]))


@pytest.mark.parametrize("which", ["weights", "cloud", "edge"])
def test_clipping_some_parameters_clips_exactly_those_in_both_halves(inproc_cloud, which):
    """Scripts clip a subset too (the trainable ones, the weights): the cloud clips the same ones."""
    data = _data(3)

    def chosen(model, cloud_names):
        named = list(model.named_parameters())
        if which == "weights":
            return [p for n, p in named if n.endswith("weight")]
        return [p for n, p in named if (n.split(".")[0] in cloud_names) == (which == "cloud")]

    def run(model, opt, crit, cloud_names):
        norms = []
        for x, y in data:
            opt.zero_grad()
            crit(model(x), y).backward()
            norms.append(float(nn.utils.clip_grad_norm_(chosen(model, cloud_names), 0.05)))
            opt.step()
        return norms

    local = mlp()
    local_norms = run(local, torch.optim.SGD(local.parameters(), lr=0.5), nn.CrossEntropyLoss(), {"2", "3", "4"})
    model = splitft.split(mlp(), 2, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    with model:
        norms = run(model, torch.optim.SGD(model.parameters(), lr=0.5), model.remote_loss(nn.CrossEntropyLoss()),
                    {"2", "3", "4"})
        assert_same(model.state_dict(), local.state_dict())
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(local_norms))
    other = nn.Linear(2, 2)
    other(torch.ones(1, 2)).sum().backward()
    assert float(nn.utils.clip_grad_norm_(other.parameters(), 1.0)) > 0  # any other module: torch's own


def test_state_dict_round_trips_through_the_unsplit_model(inproc_cloud, tmp_path):
    data = _data(3)
    model = splitft.split(mlp(), 2, 4, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    with model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
        for x, y in data:
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        torch.save(model.state_dict(), tmp_path / "model.pt")
        trained = model.state_dict()
        unsplit = mlp(seed=9)
        unsplit.load_state_dict(torch.load(tmp_path / "model.pt", weights_only=True))  # our own file, not received
        assert_same(unsplit.state_dict(), trained)
        fresh = mlp(seed=5).state_dict()
        model.load_state_dict(fresh)  # both halves take it: the cloud's is pushed
        assert_same(model.state_dict(), fresh)


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_load_state_dict_loads_what_it_is_given_and_reports_the_rest_as_torch_does(inproc_cloud, rejoin):
    """A checkpoint without the head (strict=False, as for fine-tuning), one missing a key or
    holding one of another shape (strict: torch loads the rest, then raises RuntimeError): the
    split model ends where the unsplit one does, and says the same."""
    given = mlp(seed=5).state_dict()
    cases = [({k: v for k, v in given.items() if not k.startswith("2.")}, False),
             ({k: v for k, v in given.items() if k != "2.bias"}, True),
             ({**given, "2.weight": torch.zeros(2, 2), "0.bias": torch.zeros(5)}, True),
             ({**given, "9.weight": torch.zeros(1)}, False)]
    for state, strict in cases:
        local = mlp()
        try:
            expected, error = local.load_state_dict(state, strict=strict), None
        except RuntimeError as exc:
            expected, error = None, str(exc)
        model = splitft.split(mlp(), 2, rejoin, factory=MLP, connect=inproc_cloud.connect,
                              faults=splitft.Faults(heartbeat=0))
        with model:
            if error is None:
                assert model.load_state_dict(state, strict=strict) == expected
            else:
                with pytest.raises(RuntimeError) as raised:
                    model.load_state_dict(state, strict=strict)
                for key in ("2.bias", "2.weight", "0.bias"):
                    assert (key in str(raised.value)) == (f'"{key}"' in error or f"for {key}:" in error), key
            assert_same(model.state_dict(), local.state_dict())


class _Versioned(nn.Linear):
    """A layer whose checkpoints before version 2 kept its weight halved: its loader migrates them,
    as torch's BatchNorm does its own, by the version the checkpoint's metadata gives."""

    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:
        if local_metadata.get("version") is None or local_metadata["version"] < 2:
            state_dict[prefix + "weight"] = state_dict[prefix + "weight"] * 2
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def _versioned_mlp(seed: int = 0) -> nn.Sequential:
    model = mlp(seed)
    first = _Versioned(12, 16)
    with torch.no_grad():
        first.weight.copy_(model[0].weight)
        first.bias.copy_(model[0].bias)
    model[0] = first
    return model


def test_a_checkpoint_loads_with_each_modules_version_as_torch_reads_it(inproc_cloud):
    """A current checkpoint is not migrated as an old one: the versions in its metadata reach
    the edge's modules' loaders."""
    given = _versioned_mlp(seed=5).state_dict()
    local = _versioned_mlp()
    local.load_state_dict(given)
    assert torch.equal(local[0].weight, given["0.weight"])
    model = splitft.split(_versioned_mlp(), 2, factory=MLP, connect=inproc_cloud.connect,
                          faults=splitft.Faults(heartbeat=0))
    with model:
        model.load_state_dict(given)
        assert_same(model.state_dict(), local.state_dict())


def test_unsplit_gives_back_the_whole_trained_model(inproc_cloud):
    data = _data(3)
    model = splitft.split(mlp(), 2, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    for x, y in data:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    trained = model.state_dict()
    whole = model.unsplit()
    assert model.session.closed and type(whole[2]) is nn.Linear
    assert_same(whole.state_dict(), trained)
    # not some check of the placeholders
    with pytest.raises(splitft.errors.PeerGone, match=r"session is closed \(after model\.unsplit\(\), go on with "):
        model(data[0][0])
    x = data[0][0]
    torch.testing.assert_close(whole(x), _forward(trained, x))


def _forward(state, x):
    reference = mlp()
    reference.load_state_dict(state)
    return reference(x)


def test_save_pretrained_writes_the_whole_transformers_model(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.conftest import InprocCloud
    from tests.models import tiny_bert_pretrained

    cloud = InprocCloud(["tests.models:tiny_bert_pretrained"])
    try:
        model = splitft.split(tiny_bert_pretrained(), "bert.encoder.layer.1:3",
                              factory="tests.models:tiny_bert_pretrained", connect=cloud.connect,
                              faults=splitft.Faults(heartbeat=0))
        with model:
            model.save_pretrained(tmp_path / "saved")
            expected = model.state_dict()
        loaded = transformers.BertForSequenceClassification.from_pretrained(tmp_path / "saved")
        assert_same({k: v for k, v in loaded.state_dict().items() if k in expected}, expected)
        assert set(loaded.state_dict()) == set(expected)
    finally:
        cloud.close()


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_bf16_autocast_around_the_forward_reaches_the_cloud(inproc_cloud, rejoin):
    data = _data(4)

    def train(model, opt, crit):
        dtypes = []
        for x, y in data:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(x)
                loss = crit(out, y)
            dtypes.append(loss.dtype if rejoin is None else out.dtype)
            loss.backward()
            opt.step()
            opt.zero_grad()
        return dtypes

    local = mlp()
    local_dtypes = train(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss())
    model = splitft.split(mlp(), 2, rejoin, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    with model:
        opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        split_dtypes = train(model, opt, crit)
        weights = model.state_dict()
    assert split_dtypes == local_dtypes and (rejoin is None or local_dtypes[0] == torch.bfloat16)
    for name, value in local.state_dict().items():  # within bfloat16's precision
        torch.testing.assert_close(weights[name], value, rtol=1.6e-2, atol=1e-3)




@pytest.mark.parametrize("whole_step", ["step_after_one_more_backward", "clip_then_step"])
def test_unsplit_between_backward_and_step_keeps_the_gradients_accumulated_in_the_cloud(inproc_cloud, whole_step):
    """A loop that accumulates, unsplits mid-way (the split phase of a run ends at an epoch's end,
    not at an accumulation boundary) and steps the whole model: the cloud layers' gradients summed
    so far are the whole model's, as they are unsplit."""
    data = _data(3)
    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    model = splitft.split(mlp(), 2, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    for (x, y), (net, optimizer, loss_fn) in zip(data[:1] * 2, [(local, local_opt, nn.CrossEntropyLoss()),
                                                                 (model, opt, crit)]):
        loss_fn(net(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        loss_fn(net(data[1][0]), data[1][1]).backward()  # accumulating: no step yet
    whole = model.unsplit()
    for name, param in local.named_parameters():
        torch.testing.assert_close(whole.get_parameter(name).grad, param.grad, rtol=0, atol=0, msg=name)
    for net, optimizer in ((local, local_opt), (whole, opt)):
        if whole_step == "step_after_one_more_backward":
            nn.functional.cross_entropy(net(data[2][0]), data[2][1]).backward()
        else:
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.1)
        optimizer.step()
    assert_same(whole.state_dict(), local.state_dict())
