"""Torch calls on the cloud half's tensors computed in the cloud: large results stay there until
reduced, a result used after the cloud half changed is refused, and the cloud checks every
expression an edge sends before it computes anything (a real cloud process, real ZeroMQ)."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

import splitft
from splitft.edge.cloud_values import MOST_READ, CloudValue
from splitft.edge.placeholders import RemoteTensor
from splitft.errors import PlaceholderError, ProtocolError
from splitft.wire.expressions import MOST_NODES
from splitft.wire.operations import Compute
from tests.conftest import start_cloud, stop
from tests.models import mlp
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

MLP = "tests.models:mlp"
WIDE = 300  # a 300 x 300 layer: more values than an edge reads back at once


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MLP)
    yield address
    stop(proc)


def _wide_split(address: str) -> tuple[nn.Module, nn.Module]:
    net = mlp(width=WIDE)
    return splitft.split(net, 2, factory=splitft.Factory(MLP, {"width": WIDE}), connect=address), net


def test_a_large_result_stays_in_the_cloud_until_reduced_and_equals_the_local_one(cloud):
    local = mlp(width=WIDE)
    model, net = _wide_split(cloud)
    (x, y), = _data(1)
    with model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for m, c in ((local, nn.CrossEntropyLoss()), (model, crit)):
            c(m(x), y).backward()
        grad, expected = net[2].weight.grad, local[2].weight.grad
        assert grad.numel() > MOST_READ
        magnitude = grad.abs()
        assert isinstance(magnitude, CloudValue) and magnitude.shape == expected.shape
        scaled = magnitude * 2.0 + 1.0  # still in the cloud: three calls, one expression
        assert isinstance(scaled, CloudValue)
        largest = scaled.amax(dim=1)  # a row of 300: computed and read back now
        assert not isinstance(largest, CloudValue)
        assert torch.equal(largest, (expected.abs() * 2.0 + 1.0).amax(dim=1))
        assert torch.equal(torch.isfinite(grad).all(), torch.isfinite(expected).all())
        with pytest.raises(PlaceholderError, match=r"reading 90000 values computed in the cloud"):
            magnitude.tolist()


def test_a_max_norm_constraint_after_each_step_renorms_a_large_cloud_weight_in_the_cloud(cloud):
    """``w.data.renorm_(2, 0, c)`` after ``opt.step()`` (max-norm regularisation): computed in the
    cloud on the weight itself, which is larger than an edge reads back."""
    def train(model: nn.Module, net: nn.Module) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        crit = model.remote_loss(nn.CrossEntropyLoss()) if isinstance(model, splitft.SplitModel) else \
            nn.CrossEntropyLoss()
        for x, y in _data(3):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
            with torch.no_grad():
                net[2].weight.renorm_(2, 0, 0.05)

    local = mlp(width=WIDE)
    train(local, local)
    model, net = _wide_split(cloud)
    with model:
        train(model, net)
        assert net[2].weight.numel() > MOST_READ
        assert_bitwise(model.state_dict(), local.state_dict())
    assert float(local[2].weight.norm(dim=1).max()) <= 0.05 + 1e-6  # it constrained


def test_a_large_value_put_into_a_plain_tensors_data_is_refused_not_left_without_memory(cloud):
    """A DQN's hard target update into an unsplit target, ``tp.data = p.detach().clone()``, with
    a cloud weight too large to read back at once: the plain tensor took the value without
    memory (its next read crashed the process). Torch refuses the assignment now, before anything."""
    model, net = _wide_split(cloud)
    target = mlp(width=WIDE)
    with model:
        assert net[2].weight.numel() > MOST_READ
        with pytest.raises(RuntimeError, match="incompatible tensor type"):
            target[2].weight.data = net[2].weight.detach().clone()
        (x, y), = _data(1)
        model.remote_loss(nn.CrossEntropyLoss())(model(x), y).backward()
        with pytest.raises(RuntimeError, match="incompatible tensor type"):  # a gradient, the same
            target[2].weight.data = net[2].weight.grad
        assert torch.equal(target[2].weight, mlp(width=WIDE)[2].weight)  # still its own values


def test_a_large_result_used_after_the_cloud_half_changed_is_refused(cloud):
    model, net = _wide_split(cloud)
    (x, y), = _data(1)
    with model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        crit(model(x), y).backward()
        before = net[2].weight.grad.abs()
        opt.step()  # torch would have computed `before` from the gradient before the step
        with pytest.raises(PlaceholderError, match=r"used after they changed"):
            before.max()
        with pytest.raises(PlaceholderError, match=r"used after they changed"):
            net[2].weight.data.sub_(before)


def test_a_view_of_a_cloud_gradient_reads_as_its_values_and_refuses_a_write_or_a_stale_read(cloud):
    """``p.grad.view(-1)``: unsplit a view of the gradient's memory. It reads the gradient's values
    while the cloud half is as it was; a write into it (which unsplit changes the gradient) and a
    read after the next step (which unsplit sees the gradient of then) are refused."""
    net = mlp()
    with splitft.split(net, 2, factory=MLP, connect=cloud) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        (x, y), = _data(1)
        model.remote_loss(nn.CrossEntropyLoss())(model(x), y).backward()
        flat = net[2].weight.grad.view(-1)
        assert torch.equal(flat.view(net[2].weight.shape), net[2].weight.grad.clone())
        with pytest.raises(splitft.ConfigError, match=r"p.grad.view\(...\) \(the cloud half's '2.weight'\) was "
                                                      r"written in place.*Change the gradient itself"):
            flat.mul_(2)
        with torch.no_grad():
            transposed = net[2].weight.t()
        assert torch.equal(transposed.t(), net[2].weight.detach().clone())
        opt.step()
        for stale in (flat, transposed):
            with pytest.raises(splitft.ConfigError, match=r"is used after the cloud half changed"):
                stale.sum()


def test_a_call_inside_an_autocast_region_is_refused(cloud):
    """Autocast changes the dtype some functions compute in; the cloud computes outside the region."""
    model, net = _wide_split(cloud)
    with model, torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), \
            pytest.raises(PlaceholderError, match=r"inside an autocast region"):
        net[2].weight.prod()


def test_a_call_with_gradients_on_a_trainable_cloud_weight_is_refused(cloud):
    """The cloud computes values, not graphs: a penalty on a weight must not drop its gradient silently."""
    model, net = _wide_split(cloud)
    with model, pytest.raises(PlaceholderError, match=r"no gradient would flow back"):
        (net[2].weight ** 2).sum()


def test_data_assigned_to_a_cloud_weight_takes_its_values_and_is_the_weight_after(cloud):
    """``p.data = t``: unsplit ``p`` then holds ``t``'s memory, so ``t`` follows the training of
    ``p``. Split, the cloud takes ``t``'s values and ``t`` becomes ``p.data``; a ``t`` whose memory
    other tensors share (a part of a vector, ``w.data``) would tie ``p`` to them and is refused."""
    def run(model, net):
        t = torch.full((16, 16), 0.01)
        net[2].weight.data = t
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _data(1)[0]
        nn.functional.cross_entropy(model(x), y).backward() if model is net else \
            model.remote_loss(nn.CrossEntropyLoss())(model(x), y).backward()
        opt.step()
        return t.clone()

    local = mlp()
    expected = run(local, local)
    with splitft.split(net := mlp(), 2, factory=MLP, connect=cloud) as model:
        assert torch.equal(run(model, net), expected) and not torch.equal(expected, torch.full((16, 16), 0.01))
        assert_bitwise(model.state_dict(), local.state_dict())
        vector = torch.zeros(2 * 16 * 16)
        with pytest.raises(PlaceholderError, match=r"with t's memory held elsewhere too .* assign t.clone\(\)"):
            net[2].weight.data = vector[:256].view(16, 16)
        with pytest.raises(PlaceholderError):
            net[2].weight.data = net[4].weight.data  # another cloud weight: shapes differ, and they would share
        assert_bitwise(model.state_dict(), local.state_dict())


def test_an_edge_tensor_written_from_a_trainable_cloud_weight_with_gradients_on_refuses_a_backward_through_it(cloud):
    """``dst.copy_(p)`` with gradients on: unsplit ``dst`` then has a graph that leads to ``p``. It
    takes the weight's values, and needs a gradient as unsplit; a backward that reaches the weight
    through it is refused before the cloud half changes, one that does not reach it runs."""
    local = mlp()
    model = splitft.split(net := mlp(), 2, factory=MLP, connect=cloud)
    with model:
        copied, kept = torch.zeros(16, 16), torch.zeros(16, 16)
        assert copied.copy_(net[2].weight) is copied and kept.data.copy_(net[2].weight) is not kept
        assert torch.equal(copied.detach(), local[2].weight.detach()) and torch.equal(kept, copied.detach())
        assert copied.requires_grad and not copied.is_leaf and not kept.requires_grad
        x = torch.ones(3, 16, requires_grad=True)
        (x @ copied).sum().backward(inputs=[x])  # the weight's gradient is not asked for
        assert torch.equal(x.grad, torch.ones(3, 16) @ local[2].weight.detach().T)
        with pytest.raises(PlaceholderError, match=r"a gradient through cloud parameter '2.weight', read into an "
                                                   r"edge tensor written with gradients on"):
            (x @ copied).sum().backward()
        assert net[2].weight.grad is None


def test_an_edge_tensor_computed_from_cloud_weights_reads_them_unless_the_result_is_one_of_them(cloud):
    """A call that changes or makes only the edge's tensors runs here on the weights' values (an
    average kept by hand), a view of them too; one that would hand back the weight's memory
    (``p.numpy()``) or write it (``out=``, dropout in place) is refused, its draws undone. ``p.cpu()`` and
    ``p.to(p.device)`` are ``p`` itself, as unsplit; a copy elsewhere or in another dtype is refused."""
    local = mlp()
    model = splitft.split(net := mlp(), 2, factory=MLP, connect=cloud)
    with model, torch.no_grad():
        weight, expected = net[2].weight.detach(), local[2].weight.detach()
        average = torch.ones(16, 16)
        assert average.mul_(0.9).add_(weight, alpha=0.1) is average
        assert torch.equal(average, torch.ones(16, 16).mul_(0.9).add_(expected, alpha=0.1))
        assert torch.equal(nn.functional.linear(torch.ones(2, 16), weight), nn.functional.linear(torch.ones(2, 16), expected))
        assert weight.tolist() == expected.tolist()
        assert weight.cpu() is weight and weight.to(weight.device) is weight and weight.to(torch.float32) is weight
        # a view of the weight's values reads as unsplit, while the weight is as it was (:mod:`read_views`)
        assert torch.equal(torch.broadcast_tensors(torch.ones(16, 16), weight)[1], expected)
        copied = torch.zeros(16, 16)
        copied[:] = weight  # Tensor.__setitem__ returns None: a result that holds nothing of the weight's
        assert torch.equal(copied, expected)
        for refused in (lambda: weight.to(torch.float64), lambda: weight.numpy(), lambda: weight[0].tolist(),
                        lambda: torch.add(torch.ones(16, 16), 1, out=weight)):
            with pytest.raises(PlaceholderError, match=r"its values live in the cloud"):
                refused()
        state = torch.get_rng_state()
        with pytest.raises(PlaceholderError, match=r"its values live in the cloud"):
            nn.functional.dropout(weight, 0.5, inplace=True)
        assert torch.equal(torch.get_rng_state(), state)
    model, net = _wide_split(cloud)
    with model, torch.no_grad(), pytest.raises(PlaceholderError, match=r"reading 90000 values computed in the cloud"):
        torch.zeros(300, 300).add_(net[2].weight)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes (NaN equals NaN of the same bits), or the tensor where it has none to view."""
    try:
        t = t.detach() if t.layout == torch.strided else t.detach().to_dense()
        return t.contiguous().flatten().view(torch.uint8)
    except (RuntimeError, NotImplementedError):
        return t


def _same(a: Any, b: Any) -> bool:
    """Equal to the last bit, NaN where NaN, in the same structure."""
    flat_a, spec_a = tree_flatten(a)
    flat_b, spec_b = tree_flatten(b)
    if spec_a != spec_b:
        return False
    for x, y in zip(flat_a, flat_b):
        if isinstance(x, torch.Tensor) != isinstance(y, torch.Tensor):
            return False
        if isinstance(x, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype or x.layout != y.layout or not torch.equal(_bits(x), _bits(y)):
                return False
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not (isinstance(x, np.ndarray) and isinstance(y, np.ndarray) and x.tobytes() == y.tobytes()):
                return False
        elif not (x == y or (x != x and y != y)):  # NaN == NaN
            return False
    return True


def test_no_torch_function_on_a_cloud_weight_returns_what_it_would_not_return_unsplit(cloud):
    """Every function tensor subclasses can override, called on a cloud weight (under no_grad, with
    arguments of the types its schema names) and on the same weight unsplit: where the split call
    returns rather than raise a splitft error, it returns what the unsplit call returns, bitwise,
    and the weight in the cloud then holds what the unsplit weight holds."""
    pytest.importorskip("expecttest")
    from tests.test_placeholder_ops import METADATA, REFUSALS, _arguments, _name

    like = mlp()[2].weight.detach()
    model = splitft.split(net := mlp(), 2, factory=MLP, connect=cloud)
    diverged, returned = [], 0
    with model, torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        weight = net[2].weight.detach()
        for func in torch.overrides.get_testing_overrides():
            local = like.clone()
            built, mine = _arguments(func, local, like), _arguments(func, weight, like)
            described = _name(func).removesuffix(".__get__").removesuffix(".__set__").split(".")[-1]
            if built is None or mine is None or func in _NOT_COMPARED or described in METADATA | {"_cdata"}:
                continue  # shapes and flags: answered here, tested in test_placeholder_ops
            expected, again = (_call_seeded(func, *built) for _ in range(2))
            if expected is not _REFUSED_LOCALLY and not _same(expected, again):
                continue  # not deterministic on its own (torch.linalg.lstsq of a singular matrix)
            local = like.clone()  # the calls above may have changed it
            built = _arguments(func, local, like)
            expected = _call_seeded(func, *built)
            torch.manual_seed(0)
            try:
                got = func(*mine[0], **mine[1])
            except REFUSALS:
                got = _REFUSED_HERE
            except Exception:  # noqa: BLE001 — torch refused them too, before the placeholder saw the call
                got = _REFUSED_LOCALLY
            if got is _REFUSED_HERE:  # refused before anything changed
                same, after = True, like
            elif got is _REFUSED_LOCALLY:
                same, after = expected is _REFUSED_LOCALLY, local
            elif isinstance(got, RemoteTensor) and got is not weight:  # a placeholder: it refuses what reads it
                same, after = True, local
            else:
                returned += 1
                same = expected is not _REFUSED_LOCALLY and (
                    got is weight if expected is local else _same(got, expected))
                after = local
            if not same or not _same(torch.tensor(weight.tolist()), after):
                diverged.append(getattr(func, "__qualname__", None) or repr(func))
            weight.copy_(like)
    assert not diverged, f"split and unsplit differ after: {sorted(diverged)}"
    assert returned > 100, returned  # the test really computed: what the cloud computes, or reads


_REFUSED_LOCALLY, _REFUSED_HERE = object(), object()


def _call_seeded(func: Any, args: list, kwargs: dict) -> Any:
    torch.manual_seed(0)
    try:
        return func(*args, **kwargs)
    except Exception:  # noqa: BLE001 — torch refused these arguments
        return _REFUSED_LOCALLY


#: Native functions that these generic arguments (no running statistics, no weights) crash the
#: process with, on any tensor, split or not; what reads memory by the strides given (out of bounds
#: here) or packs a pointer; and the least squares of a singular system, which differs from one call
#: to the next on the same tensor.
_NOT_COMPARED = {torch.native_batch_norm, torch._native_batch_norm_legit, torch.quantized_lstm_cell,
                torch._reshape_alias_copy, torch.fbgemm_pack_gemm_matrix_fp16, torch.linalg.lstsq,
                # uninitialised memory: two local calls may reuse one block and read alike, by chance
                torch.empty_like, torch.Tensor.new_empty, torch.Tensor.new_empty_strided}


def _nested(depth: int) -> dict:
    node: dict = {"value": "2.bias"}
    for _ in range(depth):
        node = {"fn": "neg", "args": [node], "kwargs": {}}
    return node


@pytest.mark.parametrize("expression, refusal", [
    ({"fn": "__import__", "args": ["os"], "kwargs": {}}, r"not a function an expression may call"),
    ({"fn": "abs", "args": [{"value": "0.weight"}], "kwargs": {}}, r"no tensor of this half"),
    ({"fn": "abs", "args": [{"grad": "2.weight"}], "kwargs": {}}, r"has none here"),
    ({"fn": "mul", "args": [{"array": np.ones((2000, 1), np.float32), "dtype": "float32"},
                            {"array": np.ones((1, 2000), np.float32), "dtype": "float32"}], "kwargs": {}},
     r"larger than any it names"),
    ({"fn": "abs", "args": [{"value": "2.weight"}], "kwargs": {}}, r"read as at most 65536 elements"),
    ({"fn": "add", "args": [{"value": "2.weight"}, {"value": "4.weight"}], "kwargs": {}}, r"cannot be computed"),
    ({"fn": "neg", "args": [{"fn": "neg", "args": [{"value": "2.bias"}], "kwargs": {}}] * 2, "kwargs": {}},
     r"cannot be computed"),
    ({"fn": ["abs"], "args": [{"value": "2.bias"}], "kwargs": {}}, r"not a function an expression may call"),
    (_nested(20), r"16 deep"),
    ({"fn": "add", "args": [{"value": "2.bias"}] * (MOST_NODES + 1), "kwargs": {}}, r"at most 64 nodes"),
])
def test_the_cloud_checks_an_expression_before_it_computes_and_keeps_serving(cloud, expression, refusal):
    model, net = _wide_split(cloud)
    (x, y), = _data(1)
    with model:
        with pytest.raises(ProtocolError, match=refusal):
            model.session.sync_reply(evaluate=[expression])
        crit = model.remote_loss(nn.CrossEntropyLoss())
        crit(model(x), y).backward()  # the session goes on
        assert float(net[2].bias.grad.abs().max()) >= 0


def test_an_in_place_call_is_only_a_compute_operations_own(cloud):
    """An evaluation changes nothing, and a compute operation its own target only: an in-place call
    anywhere else in an expression (a weight zeroed inside a sum) is refused before any of it runs."""
    model, net = _wide_split(cloud)
    with model:
        before = model.cloud_state_dict()
        zeroing = {"fn": "mul_", "args": [{"value": "2.weight"}], "kwargs": {"other": 0.0}}
        for expression in (zeroing, {"fn": "sum", "args": [zeroing], "kwargs": {}}):
            with pytest.raises(ProtocolError, match=r"'mul_' changes its operand in place"):
                model.session.sync_reply(evaluate=[expression])
        model.cloud_half.compute(Compute(target={"value": "2.bias"}, fn="add_", args=[zeroing], kwargs={}))
        with pytest.raises(ProtocolError, match=r"'mul_' changes its operand in place"):
            model.sync()
        assert_bitwise(model.cloud_state_dict(), before)


@pytest.mark.parametrize("target, fn, refusal", [
    ({"grad": "2.bias", "new": True, "more": 1}, "copy_", r"no in-place call on a cloud gradient"),
    ({"value": "2.bias", "new": True}, "copy_", r"no in-place call on a cloud gradient"),
    ({"grad": "2.bias", "new": True}, "add_", r"no in-place call on a cloud gradient"),
    ({"grad": ["2.bias"], "new": True}, "copy_", r"named by a string"),
    ({"grad": "nothing", "new": True}, "copy_", r"no parameter of this half"),
])
def test_a_gradient_set_by_an_edge_is_checked_before_it_is_made(cloud, target, fn, refusal):
    """``p.grad = g`` travels as a compute that makes the gradient first: only ``copy_`` of a
    gradient, of a parameter of the half, of its shape; anything else is refused with nothing made."""
    model, net = _wide_split(cloud)
    with model:
        operand = {"array": np.ones(16, np.float32), "dtype": "float32"}
        model.cloud_half.compute(Compute(target=target, fn=fn, args=[operand], kwargs={}))
        with pytest.raises(ProtocolError, match=refusal):
            model.sync()
        model.cloud_half.compute(Compute(target={"grad": "2.bias", "new": True}, fn="copy_",
                                         args=[{"array": np.ones(3, np.float32), "dtype": "float32"}], kwargs={}))
        with pytest.raises(ProtocolError, match=r"cannot be computed"):
            model.sync()
        with pytest.raises(ProtocolError, match=r"has none here"):  # nothing was made
            model.session.sync_reply(evaluate=[{"fn": "abs", "args": [{"grad": "2.bias"}], "kwargs": {}}])


def test_an_edge_tensor_shaped_like_a_cloud_weight_reads_only_its_shape(cloud):
    """``vec.view_as(p)`` (torch's ``vector_to_parameters``), ``reshape_as``, ``expand_as`` and
    ``type_as`` of a cloud weight read its shape, dtype and device, which the placeholder has: they
    compute on the edge, with gradients on too, as unsplit; ``vector_to_parameters`` then meets
    the refusal of ``p.data = ...``, naming it."""
    model, net = _wide_split(cloud)
    weight = net[2].weight
    with model:
        sent = model.metrics.bytes[("up", "control")].messages
        vec = torch.arange(float(weight.numel()), requires_grad=True)
        shaped = [vec.view_as(weight), vec.reshape_as(weight), vec[:WIDE].expand_as(weight),
                  vec.double().type_as(weight)]
        assert model.metrics.bytes[("up", "control")].messages == sent  # nothing asked of the cloud
        for got in shaped:
            assert not isinstance(got, RemoteTensor) and got.grad_fn is not None and got.dtype == weight.dtype
            assert got.shape == weight.shape or got.shape == vec.shape
        assert torch.equal(shaped[0], vec.detach().view(weight.shape))
        with pytest.raises(PlaceholderError, match=r"p\.data = t on cloud parameter '2\.weight'.* as "
                                                   r"vector_to_parameters assigns"):
            torch.nn.utils.vector_to_parameters(torch.zeros(weight.numel()), [weight])


def _changed_in_place(model, net, crit, when: str) -> None:
    """Two steps; the third changes a cloud weight in place at ``when``, as a buggy script might."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(_data(4)):
        out = model(x)
        if i == 2 and when == "before the loss":
            with torch.no_grad():
                net[2].weight.mul_(0.5)
        loss = crit(out, y)
        if i == 2 and when == "before the backward":
            with torch.no_grad():
                net[2].weight.mul_(0.5)
        loss.backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("rejoin, when, error, message", [
    (None, "before the loss", splitft.errors.ConfigError, r"cloud half's weights .* changed between model\(x\)"),
    (None, "before the backward", splitft.errors.ModelError, r"modified by an inplace operation"),
    (4, "before the loss", splitft.errors.ModelError, r"modified by an inplace operation"),
], ids=["plain, before its loss", "plain, before its backward", "ushape, before its backward"])
def test_a_cloud_weight_changed_between_its_forward_and_backward_is_refused_as_torch_refuses(cloud, rejoin, when,
                                                                                             error, message):
    """Torch refuses a backward through a weight changed in place since the forward saved it; the
    split must not train on silently (a plain split would run its forward with the new weight)."""
    local = mlp()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation"):
        _changed_in_place(local, local, nn.CrossEntropyLoss(), when)
    net = mlp()
    model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)
    with model, pytest.raises(error, match=message):
        _changed_in_place(model, net, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()),
                          when)


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_bias_changed_between_forward_and_backward_trains_as_unsplit(cloud, rejoin):
    """A layer's bias is not saved for its backward: torch lets the change through, and so does the split."""
    def script(model, net, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in _data(3):
            loss = crit(model(x), y)
            with torch.no_grad():
                net[2].bias.add_(0.01)
            loss.backward()
            opt.step()
            opt.zero_grad()

    local = mlp()
    script(local, local, nn.CrossEntropyLoss())
    net = mlp()
    model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)
    with model:
        script(model, net, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()))
        state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in local.state_dict().items())


def test_a_tensor_moved_to_a_cloud_weights_dtype_reads_none_of_its_values(cloud):
    """``scale.to(p)`` (SAM's ``e_w = rho / norm * p.grad * scale.to(p)``) needs p's dtype and device
    only: it reads nothing, also of a weight too large to read back."""
    model, net = _wide_split(cloud)
    with model, torch.no_grad():
        weight = net[2].weight
        assert weight.numel() > 65536
        scale = torch.tensor(0.05, dtype=torch.float64)
        moved = scale.to(weight)
        assert moved.dtype == torch.float32 and moved.device == weight.device and torch.equal(moved, scale.float())
        kept = torch.tensor(2.0)
        assert kept.to(weight) is kept  # already there, as torch gives it back


def test_a_copy_of_a_large_cloud_weight_used_after_it_changed_names_what_restores_it(cloud):
    """SAM's ``old_p = p.data.clone()``, the weight perturbed, then ``p.copy_(old_p)``: of a weight
    too large to read back, the copy is an expression of the weight, refused once it changed;
    the refusal names what restores it (undoing the change, or copy.deepcopy(model.state_dict()))."""
    import copy

    model, net = _wide_split(cloud)
    with model, torch.no_grad():
        weight = net[2].weight
        backup = weight.data.clone()
        weight.add_(0.01)
        with pytest.raises(PlaceholderError, match=r"SAM's e_w, which the next backward changes.* "
                                                   r"copy\.deepcopy\(model\.state_dict\(\)\)"):
            weight.copy_(backup)
        kept = copy.deepcopy(model.state_dict())["2.weight"]
        weight.add_(0.01)
        weight.copy_(kept)  # what the refusal names restores it
        assert torch.equal(model.state_dict()["2.weight"], kept)

