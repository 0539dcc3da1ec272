"""Idioms a split model cannot mirror raise a splitft error naming the fix, before anything
diverges; idioms whose shape the script corpus cannot express (an optimizer built before the cut,
an import made before splitft, a compiled or checkpointed edge block) train exactly.

Every test runs against a real cloud process. A refused idiom runs after a few ordinary steps
taken the same way unsplit: the error comes, and the split model's state is still bitwise the
unsplit model's at that point, so the refusal lost nothing and let nothing diverge.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

import splitft
from splitft.errors import ConfigError, CutError, HandshakeError, ModelError, PlaceholderError, UnfinishedForwardError
from tests.conftest import ROOT, start_cloud, stop
from tests.models import (activated_recurrent, checkpointed_mlp, counting_mlp, deep_supervised, global_writer_mlp, layer_stack, lookup_mlp, mlp,
                          mlp_batchnorm, mlp_dropout, noisy_mlp, old_norm_mlp, parametrized_mlp, pruned_mlp,
                          abc_mlp, aux_loss_net, inplace_relu_mlp, positive_rows_mlp, random_skip_mlp, recurrent_net)
from tests.test_faults import _data
from tests.test_script_corpus import assert_bitwise

MLP = "tests.models:mlp"
DIGITS = "splitft.app.models:digits_cnn"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MLP,
                                     "--model", DIGITS, "--model", "tests.models:deep_supervised",
                                     "--model", "tests.models:mlp_dropout", "--model", "tests.models:checkpointed_mlp",
                                     "--model", "tests.models:mlp_batchnorm", "--model", "tests.models:noisy_mlp",
                                     "--model", "tests.models:counting_mlp", "--model", "tests.models:parametrized_mlp",
                                     "--model", "tests.models:layer_stack", "--model", "tests.models:lookup_mlp",
                                     "--model", "tests.models:pruned_mlp", "--model", "tests.models:old_norm_mlp",
                                     "--model", "tests.models:recurrent_net", "--model", "tests.models:activated_recurrent", "--model", "tests.models:random_skip_mlp",
                                     "--model", "tests.models:inplace_relu_mlp", "--model", "tests.models:aux_loss_net",
                                     "--model", "tests.models:positive_rows_mlp",
                                     "--model", "tests.models:transposed_front_end",
                                     "--model", "tests.models:repeated_state_decoder",
                                     "--model", "tests.models:padded_text_encoder",
                                     "--model", "tests.models:packed_tagger",
                                     "--model", "tests.models:global_writer_mlp",
                                     "--model", "tests.models:channels_last_cnn")
    yield address
    stop(proc)


def _refused_by_split(cloud: str, net: nn.Module, factory: str | splitft.Factory, match: str) -> None:
    """``split(net, 2)`` raises a ``CutError`` matching ``match`` and leaves ``net`` as it was (no placeholders)."""
    with pytest.raises(CutError, match=match):
        splitft.split(net, 2, factory=factory, connect=cloud)
    assert all(type(t) in (torch.Tensor, nn.Parameter) for t in (*net.parameters(), *net.buffers()))


def _steps(model, opt, crit, data) -> None:
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def _loss_outside_autocast(model):
    x, y = _data(1)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x)
    return model.remote_loss(nn.CrossEntropyLoss())(out, y)  # unsplit, the loss of a bfloat16 output


def _loss_in_another_mode(model):
    x, y = _data(1)[0]
    out = model(x)  # in eval mode, as the test puts it
    model.train()
    return model.remote_loss(nn.CrossEntropyLoss())(out, y)


def _loss_after_a_cloud_layer_changed(model, net):
    x, y = _data(1)[0]
    out = model(x)
    net[3].p = 0.25  # the dropout's rate, after model(x) ran the cloud half (unsplit) with the old one
    return model.remote_loss(nn.CrossEntropyLoss())(out, y)


#: Each: (what the script does after two ordinary steps, the error, what its message says).
class _Doubled(nn.Linear):
    """A layer class a script swaps in by assigning ``__class__`` (as some conversion helpers do)."""

    def forward(self, x):
        return super().forward(x) * 2


def _edge_bias_tied_after_split(model, net, opt):
    net[0].bias = net[2].bias
    model(_data(1)[0][0])


REFUSED: dict[str, tuple[Callable, type, str]] = {
    "a state_dict post-hook on a cloud layer (to rename or rescale its entries)": (
        lambda model, net, opt: net[2].register_state_dict_post_hook(lambda module, sd, prefix, local: None),
        CutError, r"register_state_dict_post_hook on '2': that module's state is the cloud's"),
    "a load_state_dict pre-hook on a cloud layer (to migrate old checkpoints)": (
        lambda model, net, opt: net[4].register_load_state_dict_pre_hook(lambda *args: None),
        CutError, r"register_load_state_dict_pre_hook on '4'"),
    "parameters counted by their memory (data_ptr)": (
        lambda model, net, opt: {p.data_ptr(): p.numel() for p in model.parameters()}, PlaceholderError,
        r"data_ptr\(\) of cloud parameter '2.weight': its memory is in the cloud.*model.parameters\(\)"),
    "a storage read under no_grad": (
        lambda model, net, opt: torch.no_grad()(lambda: [p.untyped_storage() for p in model.parameters()])(),
        PlaceholderError, r"untyped_storage\(\) of cloud parameter '2.weight'"),
    "an edge bias tied to a cloud bias after split()": (
        _edge_bias_tied_after_split, PlaceholderError, r"cloud parameter '2.bias' with gradients on.*tied after split"),
    "a running sum of a weight": (
        lambda model, net, opt: [p.data.cumsum_(0) for p in model.parameters()], PlaceholderError, r"before split"),
    "parameters flattened to one vector": (
        lambda model, net, opt: torch.nn.utils.parameters_to_vector(model.parameters()), PlaceholderError,
        r"cloud parameter '2.weight'"),
    "a cloud layer replaced by a module walk": (
        lambda model, net, opt: ([setattr(m, "3", nn.GELU()) for m in model.modules() if isinstance(m, nn.Sequential)],
                                 model(_data(1)[0][0])), ConfigError, r"'3' runs in the cloud.*replaced"),
    "a layer replaced by index, as in an nn.Sequential": (
        lambda model, net, opt: model.__setitem__(2, nn.Linear(16, 16)), ConfigError, r"cannot be added, replaced"),
    "a layer appended to the split nn.Sequential": (
        lambda model, net, opt: model.append(nn.Softmax(-1)), ConfigError, r"cannot be added, replaced"),
    "a remote loss outside the autocast region of its model(x)": (
        lambda model, net, opt: _loss_outside_autocast(model), ConfigError,
        r"the autocast changed between model\(x\) and its remote loss"),
    "a remote loss in another mode than its model(x)": (
        lambda model, net, opt: _loss_in_another_mode(model), ConfigError,
        r"the mode \(model\.train\(\) / model\.eval\(\)\) changed between model\(x\) and its remote loss"),
    "a remote loss after a cloud layer's setting changed since its model(x)": (
        lambda model, net, opt: _loss_after_a_cloud_layer_changed(model, net), ConfigError,
        r"a setting of a cloud layer .* changed between model\(x\) and its remote loss"),
    "a dropout's p deleted on a cloud layer": (
        lambda model, net, opt: delattr(net[3], "p"), CutError, r"deleting 'p' of '3'"),
    "a cloud layer's class swapped for a subclass that changes its forward": (
        lambda model, net, opt: setattr(net[2], "__class__", _Doubled), CutError,
        r"changing the class of '2' to _Doubled: .*would keep its class and code"),
    "a cloud dropout's class swapped for nn.Identity (dropout turned off by hand)": (
        lambda model, net, opt: setattr(net[3], "__class__", nn.Identity), CutError,
        r"changing the class of '3' to Identity"),
    "a module set as a cloud layer's attribute": (
        lambda model, net, opt: setattr(net[3], "p", nn.Identity()), CutError,
        r"setting 'p' of '3'.*peft's merge_and_unload\(\).*model\.unsplit\(\) first"),
    "a training forward whose activation is dropped (statistics recomputed by model(x) alone)": (
        lambda model, net, opt: (model.train(), [model(x) for x, _ in _data(2)]), UnfinishedForwardError,
        r"a model\(x\) in training mode had not reached the cloud half.*model\.predict\(x\)"),
    "a forward hook on a cloud layer's submodule": (
        lambda model, net, opt: net[2].register_forward_hook(lambda *a: None), CutError, r"would never run"),
    "a parameter group's parameters edited after the first step": (
        lambda model, net, opt: (opt.param_groups[0]["params"].append(torch.zeros(1, requires_grad=True)), opt.step()),
        ConfigError, r"parameter groups changed"),
    "optimizer state of one cloud parameter dropped (a reset of some moments only)": (
        lambda model, net, opt: (opt.state.pop(net[2].weight), opt.step()), ConfigError,
        r"state was reset for some of the cloud half's parameters only"),
    "optimizer state written for a cloud parameter": (
        lambda model, net, opt: (opt.state[net[2].weight].update(momentum_buffer=torch.zeros(net[2].weight.shape)),
                                 opt.step()), ConfigError, r"written for a cloud parameter"),
    "a learning rate set as a tensor": (
        lambda model, net, opt: (opt.param_groups[0].update(lr=torch.tensor(0.05)), opt.step()), ConfigError,
        r"lr is a tensor"),
    "a copy of the model for an EMA": (lambda model, net, opt: copy.deepcopy(model), ConfigError, r"EMA"),
    "the model saved whole (torch.save(model))": (
        lambda model, net, opt: torch.save(model, io.BytesIO()), ConfigError,
        r"cannot be pickled.*model\.unsplit\(\) gives the whole trained model"),
    "a copy of the trained model kept": (
        lambda model, net, opt: copy.deepcopy(model), ConfigError, r"cannot be copied.*model\.unsplit\(\)"),
    "LBFGS over the whole model, which holds cloud parameters (temperature scaling over a wrapper)": (
        lambda model, net, opt: torch.optim.LBFGS(model.parameters()).step(lambda: torch.tensor(0.0)), ConfigError,
        r"LBFGS steps by calling a closure.*One over edge parameters only stays local.*LBFGS\(\[T\]\)"),
    "a shallow copy of the model (copy.copy), refused as a copy, not as pickling": (
        lambda model, net, opt: copy.copy(model), ConfigError, r"cannot be copied.*model\.unsplit\(\)"),
    "a cloud parameter cast by assigning .data": (
        lambda model, net, opt: [setattr(p, "data", p.data.double()) for p in net[2].parameters()], PlaceholderError,
        r"p.data = t on cloud parameter '2.weight' with t of torch.float64.*\(p's: torch.float32.*Cast or resize"),
    "torch.optim.swa_utils.AveragedModel": (
        lambda model, net, opt: torch.optim.swa_utils.AveragedModel(model), ConfigError, r"EMA"),
    "the optimizer's moments reset by walking its state": (
        lambda model, net, opt: [entry["momentum_buffer"].zero_() for entry in opt.state.values()],
        PlaceholderError, r"optimizer state of cloud parameter '2.weight'"),
    "an accuracy computed from what a plain split's model(x) returns": (
        lambda model, net, opt: (model(_data(1)[0][0]).argmax(1) == _data(1)[0][1]).float().mean(), ConfigError,
        r"argmax on what a plain split's model\(x\) returns: the activation at the cut.*model.predict"),
    "a loss term made from a plain split's model(x) (label smoothing by hand)": (
        lambda model, net, opt: (lambda out: model.remote_loss(nn.CrossEntropyLoss())(out, _data(1)[0][1])
                                 - 0.1 * out.log_softmax(-1).mean())(model(_data(1)[0][0])),
        ConfigError, r"log_softmax on what a plain split's model\(x\) returns"),
    "mixup: two remote losses of one model(x) backpropagated together": (
        lambda model, net, opt: (lambda out, crit, x, y: (0.7 * crit(out, y) + 0.3 * crit(out, y.flip(0))).backward())(
            model(_data(1)[0][0]), model.remote_loss(nn.CrossEntropyLoss()), *_data(1)[0]),
        ConfigError, r"two remote losses computed from one model\(x\) are backpropagated together"),
    "the first cloud layer called on its own (a head run on features by hand)": (
        lambda model, net, opt: net[2](torch.ones(1, 16)), CutError, r"'2' runs in the cloud and was called outside"),
    "a cloud layer past the cut called on its own": (
        lambda model, net, opt: net[4](torch.ones(1, 16)), CutError, r"'4', which runs in the cloud"),
    "the wrapped model called past the split model": (
        lambda model, net, opt: net(torch.ones(1, 12)), CutError, r"called outside the split model's forward"),
    "a loss of one's own as the remote loss (distillation against a teacher's logits)": (
        lambda model, net, opt: model.remote_loss(
            lambda out, teacher: torch.nn.functional.kl_div(out.log_softmax(-1), teacher.softmax(-1),
                                                            reduction="batchmean")),
        ConfigError, r"torch\.nn losses by name .*; <lambda> is not one\. For a loss of your own.*model\.predict\(x\).*U-shape"),
    "an L2 penalty on every weight added to the loss": (
        lambda model, net, opt: 1e-3 * sum(p.pow(2).sum() for p in model.parameters()), PlaceholderError,
        r"cloud parameter '2\.weight' with gradients on.*optimizer's weight_decay, or its gradient added after "
        r"backward"),
    "a cloud weight swapped for a fresh tensor (torch.utils.swap_tensors), then a forward": (
        lambda model, net, opt: (torch.utils.swap_tensors(net[2].bias, nn.Parameter(torch.zeros(16))),
                                 model(_data(1)[0][0])), ConfigError, r"'2\.bias' was swapped.*swap_tensors"),
    "a cloud weight swapped for a fresh tensor (torch.utils.swap_tensors), then an optimizer step": (
        lambda model, net, opt: (torch.utils.swap_tensors(net[2].weight, nn.Parameter(torch.zeros(16, 16))),
                                 opt.step()), ConfigError, r"'2\.weight' was swapped"),
    "a checkpoint loaded with assign=True (the optimizer built before it keeps the old parameters)": (
        lambda model, net, opt: model.load_state_dict({k: v + 1 for k, v in mlp_dropout(seed=3).state_dict().items()},
                                                      assign=True), ConfigError, r"assign=True.*'2\.bias'"),
    "a gradient hook on a cloud weight registered after split()": (
        lambda model, net, opt: net[2].weight.register_hook(lambda g: g * 0.5), PlaceholderError,
        r"a gradient hook on cloud parameter '2\.weight'.*would not run"),
    "a post-accumulate gradient hook on a cloud weight registered after split()": (
        lambda model, net, opt: net[2].bias.register_post_accumulate_grad_hook(lambda p: None), PlaceholderError,
        r"a gradient hook on cloud parameter '2\.bias'"),
    "a module set on the split Sequential, which its forward runs last (model.aux = nn.Linear(...))": (
        lambda model, net, opt: (setattr(model, "aux", nn.Linear(3, 3)), model(_data(1)[0][0])), ConfigError,
        r"module 'aux' was added to a Sequential that holds the cloud half.*never run.*rejoin="),
    "a module added to the model that was split (net.add_module('5', ...))": (
        lambda model, net, opt: (net.add_module("5", nn.Softmax(-1)), model(_data(1)[0][0])), ConfigError,
        r"module '5' was added to a Sequential that holds the cloud half"),
    "a gradient penalty (create_graph=True)": (
        lambda model, net, opt: torch.autograd.grad(model.remote_loss(nn.CrossEntropyLoss())(
            model(_data(1)[0][0]), _data(1)[0][1]), list(net[0].parameters()), create_graph=True),
        ConfigError, r"create_graph.*A penalty whose gradient does not pass through the cut is computed as unsplit"),
    "the cloud half's gradients asked of torch.autograd.grad (MAML's inner step by hand)": (
        lambda model, net, opt: torch.autograd.grad(model.remote_loss(nn.CrossEntropyLoss())(
            model(_data(1)[0][0]), _data(1)[0][1]), list(model.parameters())),
        PlaceholderError, r"torch\.autograd\.grad\(\.\.\.\) naming cloud parameter '2\.weight'.*Call loss\.backward\(\) "
                          r"and read"),
    "a backward restricted to a cloud layer (loss.backward(inputs=[...]))": (
        lambda model, net, opt: model.remote_loss(nn.CrossEntropyLoss())(
            model(_data(1)[0][0]), _data(1)[0][1]).backward(inputs=[net[2].weight]),
        PlaceholderError, r"backward\(inputs=\.\.\.\) naming cloud parameter '2\.weight'"),
    "a clone of a cloud weight computed with gradients on (unsplit, a graph to the weight)": (
        lambda model, net, opt: (net[2].weight.clone() * 2).sum(), PlaceholderError,
        r"computed from the cloud half's tensors with gradients on.*p\.clone\(\)\.detach\(\)"),
    "a forward hook on what split() returned (a plain split's model(x) is the cut's activation)": (
        lambda model, net, opt: (model.register_forward_hook(lambda m, i, o: None), model(_data(1)[0][0])), CutError,
        r"a forward hook on 'the split model'.*model\.predict\(x\)"),
    "a backward hook on what split() returned": (
        lambda model, net, opt: (model.register_full_backward_hook(lambda m, gi, go: None), model(_data(1)[0][0])),
        CutError, r"a backward hook on 'the split model'"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_an_idiom_that_cannot_be_mirrored_raises_before_anything_diverges(cloud, name):
    """The error comes before anything reaches the cloud half: its weights are still the unsplit
    model's (a loop over all parameters may have changed edge ones before it met a cloud one)."""
    action, error, message = REFUSED[name]
    data = _data(2)
    local = mlp_dropout().eval()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9), nn.CrossEntropyLoss(), data)
    net = mlp_dropout()
    model = splitft.split(net, 2, factory="tests.models:mlp_dropout", connect=cloud)
    with model:
        model.eval()  # the dropout off: both runs are deterministic
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _steps(model, opt, model.remote_loss(nn.CrossEntropyLoss()), data)
        with pytest.raises(error, match=message):
            action(model, net, opt)
        cloud_names = [n for n, _ in model.named_cloud_parameters()]
        assert_bitwise({n: v for n, v in model.cloud_state_dict().items() if n in cloud_names},
                       {n: v for n, v in local.state_dict().items() if n in cloud_names})


def test_a_patch_of_the_class_a_cloud_layer_reports_is_the_models_class_patch_and_is_refused(cloud):
    """``type(layer)`` of a cloud layer is its ghost class. A script that patches it means the
    layer's own class: the patch goes there (unsplit it reaches the edge's layers of that class
    too), and the cloud's process, which runs the class it imported, has the next forward refused."""
    net = mlp()
    model = splitft.split(net, 2, factory=MLP, connect=cloud)
    original = nn.Linear.forward
    with model:
        try:
            type(net[2]).forward = lambda self, x: original(self, x) * 2
            assert nn.Linear.forward is not original and type(net[0]).forward is nn.Linear.forward
            with pytest.raises(ConfigError, match=r"Linear\.forward was replaced after split\(\)"):
                model(_data(1)[0][0])
        finally:
            type(net[2]).forward = original
        assert nn.Linear.forward is original
        model(_data(1)[0][0])  # put back: the forward runs again


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_what_a_cloud_layers_forward_keeps_as_it_runs_trains_exactly_and_is_refused_when_read_or_set(cloud, rejoin):
    """``self.calls += 1`` in a cloud layer's forward changes the cloud's layer alone: the count the
    layer keeps trains as unsplit (its warm-up ends at the same step), and the edge, which has no
    current value, refuses a read (it would be stale) and a write (it would not reach the cloud)."""
    data = _data(5)
    local = counting_mlp()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
    net = counting_mlp()
    model = splitft.split(net, 2, rejoin, factory="tests.models:counting_mlp", connect=cloud)
    with model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), crit, data)
        with pytest.raises(CutError, match=r"'calls' of '2' is kept by that module's forward"):
            print(net[2].calls)
        with pytest.raises(CutError, match=r"setting 'calls' of '2': that module's forward keeps it"):
            net[2].calls = 0
        assert_bitwise(model.state_dict(), local.state_dict())
        assert local[2].calls == 5 and "calls" in vars(model.unsplit()[2])  # whole again, as it was at the cut


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_count_a_cloud_layers_forward_keeps_in_a_buffer_is_read_back(cloud, rejoin):
    """The same count kept in a buffer (``self.calls += 1`` on a registered tensor), as the refusals
    advise: the cloud half's state, which the edge reads as unsplit, and which trains bitwise."""
    data = _data(5)
    local = counting_mlp(buffer=True)
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
    net = counting_mlp(buffer=True)
    factory = splitft.Factory("tests.models:counting_mlp", {"buffer": True})
    with splitft.split(net, 2, rejoin, factory=factory, connect=cloud) as model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), crit, data)
        assert int(net[2].calls) == int(local[2].calls) == 5
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_note_no_cloud_layer_reads_is_kept_on_a_cloud_module_and_a_setting_it_reads_is_sent(cloud, rejoin):
    """SAM's second pass with batch norm's statistics held (``bn.backup_momentum = bn.momentum;
    bn.momentum = 0``, then put back from the note): the note is an attribute no code of the cloud
    half reads, kept on the edge's module for the script; the momentum is sent. A new attribute a
    cloud layer's code does read (``training``-like names, ``weight``) is still refused."""
    data = _data(3)

    def hold_statistics(model, hold: bool) -> None:
        for m in model.modules():
            if isinstance(m, nn.BatchNorm1d):
                if hold:
                    m.backup_momentum = m.momentum
                    m.momentum = 0
                else:
                    m.momentum = m.backup_momentum
                    del m.backup_momentum

    def train(model, crit) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            crit(model(x), y).backward()
            hold_statistics(model, True)
            crit(model(x), y).backward()
            hold_statistics(model, False)
            opt.step()
            opt.zero_grad()

    local = mlp_batchnorm()
    train(local, nn.CrossEntropyLoss())
    net = mlp_batchnorm()
    with splitft.split(net, 2, rejoin, factory="tests.models:mlp_batchnorm", connect=cloud) as model:
        train(model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()))
        assert_bitwise(model.state_dict(), local.state_dict())
        with pytest.raises(CutError, match=r"setting 'running_var' of '3'"):
            net[3].running_var = 1.0
        with pytest.raises(CutError, match=r"setting 'num_features' of '3'"):
            net[3].num_features = 8
        net[3].tag = "statistics held by SAM"
        whole = model.unsplit()
        assert whole[3].tag == "statistics held by SAM" and not any(k.startswith("_splitft") for k in vars(whole[3]))


def test_an_optimizer_built_before_split_trains_the_cloud_half(cloud):
    """It holds the very parameter objects that split() turned into placeholders."""
    data = _data(5)
    local = mlp()
    _steps(local, torch.optim.AdamW(local.parameters(), lr=1e-2), nn.CrossEntropyLoss(), data)
    net = mlp()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=100)
    model = splitft.split(net, 2, 4, factory=MLP, connect=cloud)
    with model:
        for x, y in data:
            opt.zero_grad()
            nn.CrossEntropyLoss()(model(x), y).backward()
            opt.step()
            sched.step()
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())
    assert model.session.metrics.steps == len(data)


def test_a_plain_splits_model_x_answers_the_outputs_shape_and_gives_the_activation_when_asked(cloud):
    x, _ = _data(1)[0]
    net = mlp()
    with torch.no_grad():
        expected, activation = net(x), net[1](net[0](x))
    model = splitft.split(net, 2, factory=MLP, connect=cloud)
    with model:
        out = model(x)
        rng = torch.get_rng_state()
        # what scripts read as unsplit: a batch's size, the classes' number, the output's layout
        assert out.shape == expected.shape and out.size(-1) == 3 and out.size(0) == len(out) == len(x)
        assert (out.dim(), out.numel(), torch.numel(out), out.stride()) == (2, expected.numel(), expected.numel(),
                                                                             expected.stride())
        assert out.dtype == expected.dtype and out.is_floating_point() and out.is_contiguous()
        assert out.device == expected.device and out.requires_grad
        assert torch.equal(torch.get_rng_state(), rng)  # worked out without a draw
        assert torch.equal(out.activation, activation)
        assert model.predict(x).shape == (len(x), 3)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).dtype == torch.bfloat16  # the cloud's last Linear computes in bfloat16, as unsplit
        assert model(x[:3]).shape == (3, 3)


def test_the_output_shape_of_a_plain_split_that_cannot_be_worked_out_is_refused(cloud):
    x, _ = _data(1)[0]
    model = splitft.split(positive_rows_mlp(), 2, factory="tests.models:positive_rows_mlp", connect=cloud)
    with model:
        model.eval()
        out = model(x)
        with pytest.raises(ConfigError, match=r"out.shape on what a plain split's model\(x\) returns.*model.predict"):
            out.shape  # noqa: B018  # how many rows the cloud keeps depends on its values
        assert model.predict(x).shape == positive_rows_mlp()(x).shape


@pytest.mark.parametrize("make", [mlp, mlp_batchnorm, mlp_dropout], ids=["mlp", "batch norm", "dropout"])
def test_two_remote_losses_of_one_model_x_in_two_passes_or_one_only_backpropagated_train_bitwise(cloud, make):
    """What is refused is one pass through two losses of one forward; a second loss computed for
    logging (also under no_grad), or each loss backpropagated on its own (two passes, as unsplit),
    trains exactly. Unsplit, the cloud half ran once for all of them: its batch norm statistics
    moved once and its dropout drew one set of masks, and so they do here."""
    data = _data(3)

    def script(model, crit, opt) -> list[float]:
        torch.manual_seed(0)
        logged = []
        for x, y in data:
            opt.zero_grad()
            out = model(x)
            loss, metric = crit(out, y), crit(out, y.flip(0))
            with torch.no_grad():
                logged += [metric.item(), crit(out, y.roll(1)).item()]
            loss.backward(retain_graph=True)
            (0.5 * crit(out, y.flip(0))).backward()
            opt.step()
        return logged + [float(v) for v in torch.get_rng_state()[:64]]

    local = make()
    expected = script(local, nn.CrossEntropyLoss(), torch.optim.SGD(local.parameters(), lr=0.1, momentum=0.9))
    model = splitft.split(make(), 2, factory=f"tests.models:{make.__name__}", connect=cloud)
    with model:
        got = script(model, model.remote_loss(nn.CrossEntropyLoss()),
                     torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
        assert_bitwise(model.state_dict(), local.state_dict())  # batch norm's running statistics included
    assert got == expected  # the losses logged, and where the script's generator ended


def test_a_layer_referenced_before_split_is_the_ghost_and_its_parameters_the_placeholders(cloud):
    net = mlp()
    layer, weight = net[2], net[2].weight
    model = splitft.split(net, 2, factory=MLP, connect=cloud)
    with model:
        assert model.model[2] is layer and weight is model.model[2].weight and model.is_cloud(weight)
        with pytest.raises(PlaceholderError):
            weight.sum()
        trained = model.unsplit()
    # unsplit gives every object its values back: the references work again, with the trained weights
    assert trained is net and not weight.is_meta and torch.equal(weight, trained.state_dict()["2.weight"])
    assert torch.isfinite(layer(torch.ones(1, 16))).all()


@pytest.mark.parametrize("how", ["weight_norm", "spectral_norm", "orthogonal"])
@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "U-shape"])
def test_a_parametrized_cloud_layer_trains_as_unsplit(cloud, how, rejoin):
    """torch.nn.utils.parametrizations on a cloud layer run in the cloud (spectral_norm's power
    iteration updating its vectors there): training, evaluation and unsplit() give the unsplit
    model's values bit for bit."""
    data = _data(4)
    x = data[3][0]
    local = parametrized_mlp(how=how)
    _steps(local, torch.optim.Adam(local.parameters(), lr=0.01), nn.CrossEntropyLoss(), data[:3])
    with torch.no_grad():
        expected = local.eval()(x)
    net = parametrized_mlp(how=how)
    factory = splitft.Factory("tests.models:parametrized_mlp", {"how": how})
    model = splitft.split(*((net, 2) if rejoin is None else (net, 2, rejoin)), factory=factory, connect=cloud)
    crit = model.remote_loss(nn.CrossEntropyLoss()) if rejoin is None else nn.CrossEntropyLoss()
    _steps(model, torch.optim.Adam(model.parameters(), lr=0.01), crit, data[:3])
    model.eval()
    with torch.no_grad():
        got = model.predict(x) if rejoin is None else model(x)
    trained = model.unsplit()
    assert torch.equal(got, expected)
    assert_bitwise(trained.state_dict(), local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 6], ids=["plain", "U-shape"])
def test_recurrent_cloud_layers_train_as_unsplit(cloud, rejoin):
    """A GRU and an LSTM in the cloud half: torch's RNNs keep weak references to their weights,
    which the cut drops (they would keep the weights from becoming placeholders) and unsplit()
    gives back, so a weight set anew afterwards is still noticed."""
    data = _data(4)
    x = data[3][0]
    local = recurrent_net()
    _steps(local, torch.optim.Adam(local.parameters(), lr=0.01), nn.CrossEntropyLoss(), data[:3])
    net = recurrent_net()
    model = splitft.split(*((net, 2) if rejoin is None else (net, 2, rejoin)), factory="tests.models:recurrent_net",
                          connect=cloud)
    crit = model.remote_loss(nn.CrossEntropyLoss()) if rejoin is None else nn.CrossEntropyLoss()
    _steps(model, torch.optim.Adam(model.parameters(), lr=0.01), crit, data[:3])
    with torch.no_grad():
        got = model.predict(x) if rejoin is None else model(x)
        expected = local(x)
    trained = model.unsplit()
    assert torch.equal(got, expected)
    assert_bitwise(trained.state_dict(), local.state_dict())
    for whole in (local, trained):
        whole[2].weight_hh_l1 = nn.Parameter(torch.zeros_like(whole[2].weight_hh_l1))
    with torch.no_grad():
        assert torch.equal(trained(x), local(x))


def test_initialising_a_part_of_a_cloud_weight_through_an_index_is_mirrored_and_reading_it_refused(cloud):
    """An LSTM's forget-gate biases set to 1 (``p.data[n//4:n//2].fill_(1.0)``), a block of a weight
    drawn anew through a strided view, torch's initialisers on a row: new values for a part, made
    here on the same view of a fresh tensor (the draws in the order torch draws for that view) and
    written through the index; reading the part is refused; with gradients on, torch's error."""
    def initialise(net) -> None:
        torch.manual_seed(5)
        for name, p in net[4].named_parameters():
            if name.startswith("bias"):
                n = p.size(0)
                p.data[n // 4:n // 2].fill_(1.0)
        net[2].weight_hh_l0.data[:, :3].normal_(0, 0.02)  # not contiguous: torch's draws follow the view
        with torch.no_grad():
            nn.init.constant_(net[2].bias_hh_l1[2:5], 0.5)
            net[4].weight_ih_l0[0].zero_()

    data = _data(3)
    local = recurrent_net()
    initialise(local)
    drawn = torch.get_rng_state()
    _steps(local, torch.optim.Adam(local.parameters(), lr=0.01), nn.CrossEntropyLoss(), data)
    with splitft.split(recurrent_net(), 2, factory="tests.models:recurrent_net", connect=cloud) as model:
        initialise(model)
        assert torch.equal(torch.get_rng_state(), drawn)
        with pytest.raises(PlaceholderError, match=r"sum on an indexed part of .*lstm|sum on an indexed part"):
            model[4].bias_ih_l0.data[:4].sum()
        with pytest.raises(RuntimeError, match="a view of a leaf Variable that requires grad"):
            model[4].bias_ih_l0[:4].fill_(0.0)
        _steps(model, torch.optim.Adam(model.parameters(), lr=0.01), model.remote_loss(nn.CrossEntropyLoss()), data)
        assert_bitwise(model.state_dict(), local.state_dict())


class _Symmetric(nn.Module):
    def forward(self, w):
        return w.triu() + w.triu(1).T


def test_a_parametrization_or_a_global_pruning_on_a_cloud_layer_after_split_is_refused_by_name(cloud):
    """torch's parametrizations (weight_norm, orthogonal, a script's own) registered on a cloud
    layer after ``split()``, one removed there, and a global pruning over edge and cloud layers
    are refused naming what was done and where to do it, before anything changed: training goes
    on bitwise as unsplit."""
    from torch.nn.utils import parametrize, prune

    data = _data(3)
    local = mlp()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
    net = mlp()
    with splitft.split(net, 2, factory=MLP, connect=cloud) as model:
        for register in (lambda: nn.utils.parametrizations.weight_norm(net[2]),
                         lambda: nn.utils.parametrizations.orthogonal(net[4]),
                         lambda: parametrize.register_parametrization(net[4], "weight", _Symmetric())):
            with pytest.raises(CutError, match=r"registering a parametrization of 'weight' on '[24]' after split\(\): "
                                               r"that module runs in the cloud.* in the factory too"):
                register()
        with pytest.raises(CutError, match=r"prune\.global_unstructured on '2' after split\(\).* zero the values"):
            prune.global_unstructured([(net[0], "weight"), (net[2], "weight")], pruning_method=prune.L1Unstructured,
                                      amount=0.3)
        assert not any(parametrize.is_parametrized(m) or prune.is_pruned(m) for m in net)
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(nn.CrossEntropyLoss()), data)
        assert_bitwise(model.state_dict(), local.state_dict())
    prune.global_unstructured([(net[0], "weight")], pruning_method=prune.L1Unstructured, amount=0.3)
    assert prune.is_pruned(net[0])  # an edge module's pruning is torch's

    net = parametrized_mlp(how="weight_norm")
    with splitft.split(net, 2, factory=splitft.Factory("tests.models:parametrized_mlp", {"how": "weight_norm"}),
                       connect=cloud):
        with pytest.raises(CutError, match=r"removing the parametrization of 'weight' on '2' after split\(\).*"
                                           r"model\.unsplit\(\)"):
            parametrize.remove_parametrizations(net[2], "weight")
        assert parametrize.is_parametrized(net[2], "weight")


def test_reading_a_parametrized_cloud_weight_on_the_edge_is_refused_naming_what_it_is_computed_from(cloud):
    """``layer.weight`` of a parametrized layer runs its parametrization, which reads (and for
    spectral_norm in training, updates) the cloud's tensors."""
    net = parametrized_mlp(how="weight_norm")
    with splitft.split(net, 2, factory=splitft.Factory("tests.models:parametrized_mlp", {"how": "weight_norm"}),
                       connect=cloud):
        with pytest.raises(CutError, match=r"reading 'weight' of '2' on the edge: .*\(2\.parametrizations\.weight"
                                           r"\.original0, 2\.parametrizations\.weight\.original1, under"):
            net[2].weight
        with torch.no_grad():
            assert net[2].parametrizations.weight.original0.shape == (16, 1)


@pytest.mark.parametrize("how", ["weight_norm", "spectral_norm"])
def test_torchs_old_hook_based_norm_on_a_cloud_layer_is_refused_by_split_naming_the_parametrization(cloud, how):
    """``torch.nn.utils.weight_norm`` computes the weight in a forward pre-hook, outside the layer's
    forward that the cloud runs; the parametrization of the same name runs in the cloud."""
    net = old_norm_mlp(how=how)
    _refused_by_split(cloud, net, splitft.Factory("tests.models:old_norm_mlp", {"how": how}),
                      rf"'2' has torch\.nn\.utils\.{how}, the old one .* "
                      rf"torch\.nn\.utils\.parametrizations\.{how}, which the cloud half runs")


def test_a_cloud_layer_that_draws_from_pythons_random_is_refused_by_split(cloud):
    """Stochastic depth written with ``random.random()``: torch's generator crosses the cut, Python's
    and NumPy's do not (the cloud's process has its own), so its draws would differ."""
    net = random_skip_mlp()
    _refused_by_split(cloud, net, "tests.models:random_skip_mlp",
                      r"'3' \(RandomSkip\) draws from a generator of its own process as it runs "
                      r"\(random\.random: .* Draw with torch")


def test_a_cloud_layer_whose_helper_object_draws_from_pythons_random_is_refused_by_split(cloud):
    net = random_skip_mlp(helper=True)
    _refused_by_split(cloud, net, splitft.Factory("tests.models:random_skip_mlp", {"helper": True}),
                      r"'3' \(HelpedSkip\) draws from a generator of its own process as it runs "
                      r"\(Skipper: random\.random: ")


def test_a_cloud_layer_that_draws_from_numpys_generator_through_a_name_it_imported_is_refused_by_split(cloud):
    net = random_skip_mlp(numpy=True)
    _refused_by_split(cloud, net, splitft.Factory("tests.models:random_skip_mlp", {"numpy": True}),
                      r"'3' \(NumpyNoise\) draws from a generator of its own process as it runs \(_numpy_normal: ")


@pytest.mark.parametrize("layer, name", [("count", r"GlobalCounter\) writes tests\.models\.CALLS"),
                                         ("collect", r"GlobalCollector\) writes tests\.models\.SEEN")])
def test_a_cloud_layer_that_writes_a_module_level_value_as_it_runs_is_refused_by_split(cloud, layer, name):
    """``global CALLS; CALLS += 1`` in a cloud layer's forward, or ``SEEN.append(...)`` in a method it
    calls: in the cloud they change the cloud process's, and the script's would keep what it holds."""
    net = global_writer_mlp(kind=layer)
    _refused_by_split(cloud, net, splitft.Factory("tests.models:global_writer_mlp", {"kind": layer}),
                      rf"'3' \({name} as it runs .* as a buffer")


def test_a_cloud_layer_whose_own_list_shares_a_module_level_name_trains_as_unsplit(cloud):
    data = _data(3)
    local = global_writer_mlp(kind="local")
    _steps(local, torch.optim.Adam(local.parameters(), lr=1e-2), nn.CrossEntropyLoss(), data)
    net = global_writer_mlp(kind="local")
    with splitft.split(net, 2, factory=splitft.Factory("tests.models:global_writer_mlp", {"kind": "local"}),
                       connect=cloud) as model:
        _steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), model.remote_loss(nn.CrossEntropyLoss()), data)
        assert_bitwise(model.unsplit().state_dict(), local.state_dict())


@pytest.mark.parametrize("value", [torch.tensor(0.25), np.float32(0.25)], ids=["a 0-d tensor", "a numpy float32"])
def test_a_cloud_layers_setting_set_to_a_number_that_is_no_python_number_names_the_conversion(cloud, value):
    """A drop rate from ``torch.linspace`` or ``np.linspace(dtype=float32)``: the cloud takes settings
    as plain values; the refusal says to convert it, and the converted one is set in the cloud."""
    net = mlp_dropout()
    with splitft.split(net, 2, factory="tests.models:mlp_dropout", connect=cloud):
        with pytest.raises(CutError, match=r"setting 'p' of '3' to a .*: the cloud's copy of the layer takes the "
                                           r"settings its code reads as plain values .* \(float\(v\)"):
            net[3].p = value
        net[3].p = float(value)
        assert net[3].p == 0.25


@pytest.mark.parametrize("training", [True, False], ids=["training", "evaluation"])
def test_a_cloud_module_that_changes_what_it_receives_in_place_is_refused(cloud, training):
    """``nn.ReLU(inplace=True)`` first in the cloud half: unsplit it changes the edge's tensor, which
    the model's forward may read again; the cloud has its own copy. Refused by the cloud, in
    training (where torch itself refused the change of a leaf, unclearly) and in evaluation (where
    nothing was said)."""
    (x, y), = _data(1)
    with splitft.split(inplace_relu_mlp(), 1, factory="tests.models:inplace_relu_mlp", connect=cloud) as model:
        model.train(training)
        with torch.set_grad_enabled(training), pytest.raises(
                ConfigError, match=r"a cloud module changes a tensor it receives from the edge in place"):
            model.remote_loss(nn.CrossEntropyLoss())(model(x), y)


@pytest.mark.parametrize("how", ["hooked activation", "input at a first-layer cut"])
def test_what_crossed_a_plain_cut_changed_in_place_before_its_loss_is_refused(cloud, how):
    """Unsplit, ``model(x)`` computed the output before the script changed what it had read (a hook's
    kept activation normalized for a log, the input itself); split, the cloud half runs at the
    loss, and ran on the changed values, silently."""
    (x, y), = _data(1)
    kept = {}
    with splitft.split(mlp(), 2 if how == "hooked activation" else 0, factory=MLP, connect=cloud) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        if how == "hooked activation":
            model[1].register_forward_hook(lambda module, args, out: kept.__setitem__("h", out))
        with torch.no_grad():
            out = model(x)
            (kept["h"] if how == "hooked activation" else x).mul_(0.5)
            with pytest.raises(ConfigError, match=r"what crossed the cut at model\(x\) was changed in place since"):
                crit(out, y)
            assert crit(model(x), y).isfinite()  # a loss right after its model(x) goes on


@pytest.mark.parametrize("factory,shape", [("transposed_front_end", (4, 8, 40)), ("repeated_state_decoder", (4, 12, 3))],
                         ids=["transposed activation", "transposed gradient"])
def test_a_tensor_crossing_the_cut_in_another_layout_arrives_in_it_and_trains_as_unsplit(cloud, factory, shape):
    """A Conv1d's output transposed before a trunk that sums over time; a decoder LSTM whose input's
    gradient comes out transposed for the edge's backward (through ``repeat``) to sum: each side
    rounds by the layout it gets, which crosses with the tensor, as unsplit."""
    import tests.models as models

    make = getattr(models, factory)
    cut, rejoin = ("pool", "norm") if factory == "transposed_front_end" else ("dec", "out")
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0))

    def train(model) -> list[float]:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        losses = []
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss))
        return losses

    local = make()
    expected = train(local)
    with splitft.split(make(), cut, rejoin, factory=f"tests.models:{factory}", connect=cloud) as model:
        assert train(model) == expected
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("transform", ["jacrev", "vmap of grad", "jvp", "forward_ad"])
def test_a_torch_func_transform_or_forward_ad_through_the_split_model_is_refused_by_name(cloud, transform):
    from torch.func import grad, jacrev, jvp, vmap

    x, y = _data(1)[0]
    with splitft.split(mlp(), 2, 4, factory=MLP, connect=cloud) as model:
        def per_sample_loss(xi, yi):
            return nn.functional.cross_entropy(model(xi[None]), yi[None])

        with pytest.raises(ConfigError, match=r"a torch.func transform .* or forward-mode AD .* through a split model"):
            if transform == "jacrev":
                jacrev(model)(x)
            elif transform == "vmap of grad":
                vmap(grad(per_sample_loss))(x, y)
            elif transform == "jvp":
                jvp(model, (x,), (torch.ones_like(x),))
            else:
                with torch.autograd.forward_ad.dual_level():
                    model(torch.autograd.forward_ad.make_dual(x, torch.ones_like(x)))
        nn.functional.cross_entropy(model(x), y).backward()  # and the session goes on


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("how", ["torch.func.grad", "is_grads_batched"])
def test_an_input_gradient_by_a_transform_or_a_batched_backward_is_refused_by_name_and_training_goes_on(
        cloud, rejoin, how):
    """A saliency map by torch.func.grad of the remote loss (which read the generator's state as a
    tensor the transform hides), or autograd.grad(is_grads_batched=True): refused as the other
    transforms are, not with vmap's errors from inside, and the next step trains as unsplit."""
    data = _data(3)

    def train(model, crit, probe):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(data):
            if i == 1 and probe:
                xr = x.clone().requires_grad_()
                with pytest.raises(ConfigError, match=r"a torch.func transform .*a batched backward"):
                    if how == "torch.func.grad":
                        torch.func.grad(lambda inp: crit(model(inp), y))(x)
                    else:
                        torch.autograd.grad(crit(model(xr), y), xr, grad_outputs=torch.ones(2), is_grads_batched=True)
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        return model.state_dict()

    local = train(mlp(), nn.CrossEntropyLoss(), probe=False)
    with splitft.split(mlp(), 2, rejoin, factory=MLP, connect=cloud) as model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        assert_bitwise(train(model, crit, probe=True), local)


@pytest.mark.parametrize("cut", ["encoder.layers.0:1", "encoder.layers.1:2"])
def test_a_transformer_encoders_nested_tensor_path_across_the_cut_is_refused_and_trains_without_it(cloud, cut):
    """nn.TransformerEncoder's fast path in evaluation computes its layers on a nested tensor made
    from the padding mask: with its first layer in the cloud, the edge's encoder (seeing
    placeholders) would not make it and the cloud's layers would round otherwise, silently; with the
    first on the edge, the nested tensor would reach the cut. Refused; with the path off, as unsplit."""
    from tests.models import padded_text_encoder

    gen = torch.Generator().manual_seed(0)
    x = torch.randint(1, 30, (4, 7), generator=gen)
    pad = torch.arange(7)[None] >= torch.tensor([7, 3, 5, 2])[:, None]
    with splitft.split(padded_text_encoder(), cut, factory="tests.models:padded_text_encoder",
                       connect=cloud) as model:
        model.eval()
        with torch.no_grad(), pytest.raises(CutError, match=r"nested tensor.*encoder.use_nested_tensor = False"):
            model(x, pad)
        local = padded_text_encoder().eval()
        local.encoder.use_nested_tensor = model.encoder.use_nested_tensor = False
        with torch.no_grad():
            assert torch.equal(model(x, pad), local(x, pad))


def test_a_packed_sequence_handed_to_a_cloud_rnn_is_refused_naming_it(cloud):
    from tests.models import packed_tagger

    x = torch.randn(3, 5, 4, generator=torch.Generator().manual_seed(0))
    with splitft.split(packed_tagger(), "lstm", "head", factory="tests.models:packed_tagger", connect=cloud) as model:
        with pytest.raises(CutError, match=r"hands 'lstm' a PackedSequence .* on the same side"):
            model(x, torch.tensor([5, 2, 4]))


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_dispatch_mode_around_the_split_model_is_refused(cloud, rejoin):
    """A TorchDispatchMode (a numerics emulation rounding matmuls, an operation counter) around the
    forward: unsplit the whole model computes under it, the cloud half outside it."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    class Counting(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    x, y = _data(1)[0]
    cut = (2,) if rejoin is None else (2, rejoin)
    with splitft.split(mlp(), *cut, factory=MLP, connect=cloud) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss()) if rejoin is None else nn.CrossEntropyLoss()
        with Counting(), pytest.raises(ConfigError, match="a TorchDispatchMode is active around the split model"):
            crit(model(x), y)
        with FlopCounterMode(display=False), pytest.raises(ConfigError, match=r"FlopCounterMode, which Lightning's "
                                                                              r"model summary runs"):
            crit(model(x), y)
        crit(model(x), y).backward()  # outside it, as before


def test_a_cloud_weights_values_as_numpy_are_refused_naming_the_copy_that_reads_them(cloud):
    """TensorBoard's add_histogram(name, p) calls p.detach().cpu().numpy(): an array over the
    tensor's memory, which is in the cloud. Refused, naming the copy that reads the values."""
    local = mlp()
    with splitft.split(net := mlp(), 2, factory=MLP, connect=cloud) as model:
        with pytest.raises(PlaceholderError, match=r"NumPy array shares the tensor's memory.*t\.detach\(\)\.clone\(\)"):
            net[2].weight.detach().cpu().numpy()
        assert (net[2].weight.detach().clone().numpy() == local[2].weight.detach().numpy()).all()
        with pytest.raises(CutError, match=r"register_buffer\('total_ops', \.\.\.\), as a profiler"):
            net[2].register_buffer("total_ops", torch.zeros(1))


def test_a_u_shape_teachers_forward_between_a_plain_students_forward_and_loss_is_refused_as_a_draw(cloud):
    """A U-shape teacher's first forward (its trunk checked once on the edge) between a plain
    student's model(x) and its loss, both with dropout in the cloud: refused as the draw in between
    it is, not as a fault of the teacher's trunk (the check's own extra run is no read of the script's)."""
    x, y = _data(1)[0]
    with splitft.split(mlp_dropout(), 2, factory="tests.models:mlp_dropout", connect=cloud) as student, \
            splitft.split(mlp_dropout(), 2, 4, factory="tests.models:mlp_dropout", connect=cloud) as teacher:
        crit = student.remote_loss(nn.CrossEntropyLoss())
        crit(student(x), y).backward()  # the student's half is known to draw
        out = student(x)
        teacher(x)
        with pytest.raises(ConfigError, match=r"drew random numbers between model\(x\) and its remote loss \(another"):
            crit(out, y)


def test_functional_call_with_cloud_parameters_is_refused_naming_it(cloud):
    """A weight-perturbed forward (``functional_call`` with tensors for cloud parameters): the cloud
    would run its own weights. Refused, naming the call and what does reach the cloud."""
    x, _ = _data(1)[0]
    with splitft.split(mlp(), 2, 4, factory=MLP, connect=cloud) as model:
        perturbed = {name: torch.zeros(p.shape) for name, p in model.named_parameters() if name.startswith("2.")}
        with pytest.raises(CutError, match=r"torch.func.functional_call .* p.copy_\(t\) under torch.no_grad\(\)"):
            torch.func.functional_call(model, perturbed, (x,))


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("compile_with", ["trace", "script"])
def test_torchscript_of_a_split_model_is_refused_naming_unsplit(cloud, rejoin, compile_with):
    x, _ = _data(1)[0]
    cut = (2,) if rejoin is None else (2, rejoin)
    with splitft.split(mlp(), *cut, factory=MLP, connect=cloud) as model:
        with pytest.raises(ConfigError, match=r"torch.jit.trace / torch.jit.script of a split model.*model.unsplit"):
            torch.jit.trace(model, x) if compile_with == "trace" else torch.jit.script(model)
        model.eval()
        assert model.predict(x).shape == (len(x), 3)


def test_a_trunk_block_that_appends_to_a_list_it_is_handed_is_refused(cloud):
    """Blocks appending auxiliary losses to a list the forward hands them: the cloud's blocks append
    to its copy of the list, which the edge's forward would sum without them. Refused by the cloud."""
    (x, y), = _data(1)
    with splitft.split(aux_loss_net(), "blocks.0:2", factory="tests.models:aux_loss_net", connect=cloud) as model:
        with pytest.raises(ConfigError, match=r"or a list or dict it receives \(an auxiliary loss appended\)"):
            model(x)


def test_a_state_dict_hook_on_a_cloud_layer_from_before_split_is_refused_by_split(cloud):
    """A load pre-hook migrating old checkpoints of layer 2: the cloud half's state loads without it."""
    net = mlp()
    net[2].register_load_state_dict_pre_hook(lambda module, state_dict, prefix, *rest: None)
    _refused_by_split(cloud, net, MLP, r"'2' has a state-dict hook \(registered before split\(\)\)")


def test_a_process_wide_optimizer_hook_sees_the_scripts_steps_only(cloud):
    """A step counter (or a gradient guard) registered for every optimizer: the split model's first
    step, which learns the optimizer's state layout by a dry run, adds no step of its own."""
    def count(runs: list):
        handle = register_optimizer_step_post_hook(lambda opt, args, kwargs: runs.append(1))
        try:
            yield
        finally:
            handle.remove()

    data = _data(2)
    local, split_runs, local_runs = mlp(), [], []
    for _ in count(local_runs):
        _steps(local, torch.optim.Adam(local.parameters(), lr=0.01), nn.CrossEntropyLoss(), data)
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        for _ in count(split_runs):
            _steps(model, torch.optim.Adam(model.parameters(), lr=0.01), model.remote_loss(nn.CrossEntropyLoss()),
                   data)
        assert_bitwise(model.state_dict(), local.state_dict())
    assert len(split_runs) == len(local_runs) == 2


def test_a_grad_scaler_stepping_a_fused_optimizer_over_the_cloud_half_is_refused_before_the_step(cloud):
    """A fused step takes the scale and the overflow flag from GradScaler instead of unscaled
    gradients; the cloud's copy of the optimizer would not see them."""
    x, y = _data(1)[0]
    local = mlp()
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01, fused=True)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 12)
        scaler.scale(model.remote_loss(nn.CrossEntropyLoss())(model(x), y)).backward()
        with pytest.raises(ConfigError, match=r"GradScaler stepping a Adam\(fused=True\) over the cloud half"):
            scaler.step(opt)
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_pruned_cloud_layer_is_refused_by_split_which_leaves_the_model_as_it_was(cloud):
    net = pruned_mlp()
    before = {n: t.clone() for n, t in net.state_dict().items()}
    _refused_by_split(cloud, net, "tests.models:pruned_mlp",
                      r"'2' is pruned with torch.nn.utils.prune.*prune.remove\(module, 'weight'\)")
    assert_bitwise(net.state_dict(), before)


def test_split_while_a_forwards_graph_holds_the_weights_says_so_and_leaves_the_model_as_it_was(cloud):
    net = mlp()
    out = net(_data(1)[0][0])  # its graph holds every weight until it is dropped
    before = {n: t.clone() for n, t in net.state_dict().items()}
    with pytest.raises(CutError, match=r"the graph of a forward whose output is still alive"):
        splitft.split(net, 2, factory=MLP, connect=cloud)
    assert_bitwise(net.state_dict(), before)
    out.sum().backward()
    assert all(p.grad is not None for p in net.parameters())


def test_a_single_cloud_value_reads_as_a_python_number_as_unsplit(cloud):
    """``int(bn.num_batches_tracked)`` in a log line, ``if bn.num_batches_tracked:``, a count used
    as an index: each the number ``.item()`` reads."""
    data = _data(2)
    local = mlp_batchnorm()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
    net = mlp_batchnorm()
    with splitft.split(net, 2, factory="tests.models:mlp_batchnorm", connect=cloud) as model:
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(nn.CrossEntropyLoss()), data)
        count, expected = net[3].num_batches_tracked, local[3].num_batches_tracked
        assert (int(count), float(count), bool(count), [0, 1, 2][count]) == \
               (int(expected), float(expected), bool(expected), [0, 1, 2][expected]) == (2, 2.0, True, 2)
        assert type(int(count)) is int and type(float(count)) is float


def test_a_refusal_names_a_cloud_buffer_as_a_buffer_and_a_parameter_as_a_parameter(cloud):
    net = mlp_batchnorm()
    model = splitft.split(net, 2, factory="tests.models:mlp_batchnorm", connect=cloud)
    with model:
        with pytest.raises(PlaceholderError, match=r"on cloud buffer '3.running_mean'"):
            net[3].running_mean.cumsum_(0)
        with pytest.raises(PlaceholderError, match=r"on cloud parameter '3.weight'"):
            net[3].weight.data.cumsum_(0)
        with pytest.raises(CutError, match=r"setting 'running_mean' of '3'.*TENT.*track_running_stats = False alone"):
            net[3].running_mean = None  # TENT's configure_model


def test_a_change_made_before_split_that_the_factory_does_not_make_is_refused_at_the_handshake(cloud):
    net = mlp()
    net[3] = nn.GELU()  # a module walk replacing activations, before the cut: the cloud's factory builds ReLU
    with pytest.raises(HandshakeError, match=r"the cloud's '3' differs from the edge's model"):
        splitft.split(net, 2, factory=MLP, connect=cloud)
    dropout = mlp_dropout()
    dropout[3].p = 0.0
    with pytest.raises(HandshakeError, match=r"Dropout\(p=0.5"):
        splitft.split(dropout, 2, factory="tests.models:mlp_dropout", connect=cloud)


def test_edge_code_between_two_trunk_modules_is_refused_where_the_trunk_returns_a_tuple(cloud):
    """``rnn(tanh(a(x)))`` with ``a``..``rnn`` in the cloud: the tanh would run in the cloud before
    the GRU; what ``a`` hands the forward is the GRU's tuple, which torch refuses with a bare TypeError."""
    model = splitft.split(activated_recurrent(), "a", "head", factory="tests.models:activated_recurrent",
                          connect=cloud)
    with model, pytest.raises(CutError, match=r"failed \(tanh\(\).*not tuple\) on what 'a' returned: that inner "
                                              r"module of the trunk 'a'..'rnn'.*Cut so that 'a' ends the trunk"):
        model(torch.randn(8, 5, 6))


def test_an_auxiliary_head_on_an_inner_trunk_layer_is_refused_at_the_first_forward(cloud):
    """Deep supervision: the aux head reads l2's output, but the cloud runs l2 and l3 and returns l3's."""
    net = deep_supervised()
    model = splitft.split(net, "l2", "head", factory="tests.models:deep_supervised", connect=cloud)
    with model:
        with pytest.raises(CutError, match=r"output of 'l2', an inner module of the trunk 'l2'..'l3'.*rejoin"):
            model(torch.ones(4, 12))
    net = deep_supervised()  # a trunk of l2 alone: its output is what the aux head should read, and does
    local = deep_supervised()
    model = splitft.split(net, "l2", "l3", factory="tests.models:deep_supervised", connect=cloud)
    with model:
        out, aux = model(torch.ones(4, 12))
    expected, expected_aux = local(torch.ones(4, 12))
    assert torch.equal(out, expected) and torch.equal(aux, expected_aux)


_OUT_OF_ORDER = r".*LayerDrop: set the model's layerdrop to 0"
#: What a forward does to the trunk layers.0..3 of a layer stack: the attribute of the stack that
#: makes it do so, its value, and the refusal.
TRUNK_CALLS = {
    "skips a layer (LayerDrop)": ("plan", [0, 1, 3],
                                  r"skipped 'layers.2' \(called 'layers.3' after 'layers.1'\)" + _OUT_OF_ORDER),
    "repeats a layer": ("plan", [0, 1, 1, 2, 3],
                        r"called 'layers.1' again or out of order, after 'layers.1'" + _OUT_OF_ORDER),
    "reorders layers": ("plan", [0, 2, 1, 3], r"skipped 'layers.1'" + _OUT_OF_ORDER),
    "starts past the first layer": ("plan", [1, 2, 3],
                                    r"called 'layers.1' outside a run of the trunk, which starts at 'layers.0'"),
    "switches grad mode per layer (bottom layers frozen by no graph)": (
        "around", lambda i: torch.set_grad_enabled(i != 1), r"'layers.1' under another grad mode or autocast"),
    "switches autocast per layer": (
        "around", lambda i: torch.autocast("cpu", dtype=torch.bfloat16, enabled=i == 0),
        r"'layers.1' under another grad mode or autocast"),
    "changes a shared setting between layers": (
        "between", lambda i, settings: settings.__setitem__("scale", 1.0 / (i + 1)),
        r"'layers.1' with other arguments .*changed in place since"),
}


@pytest.mark.parametrize("name", sorted(TRUNK_CALLS))
def test_a_forward_that_runs_trunk_layers_otherwise_than_the_cloud_is_refused_in_that_forward(cloud, name):
    """The cloud runs the whole trunk at the first module's call, each layer once and in order, under
    what that call ran under and with its arguments as they were then: a forward that then calls its
    layers otherwise computed something else, and is refused before its output is used; nothing
    changed in the cloud half, so training goes on as unsplit."""
    where, what, message = TRUNK_CALLS[name]
    data = _data(3)
    local = layer_stack()
    opt_local = torch.optim.SGD(local.parameters(), lr=0.1)
    net = layer_stack()
    with splitft.split(net, "layers.0:4", factory="tests.models:layer_stack", connect=cloud) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for m, o in ((local, opt_local), (model, opt)):
            _steps(m, o, nn.CrossEntropyLoss(), data[:2])  # each layer once, in order: as unsplit
        setattr(net, where, what)
        with pytest.raises(CutError, match=message):
            model(data[2][0])
        setattr(net, where, None)
        assert_bitwise(model.state_dict(), local.state_dict())
        for m, o in ((local, opt_local), (model, opt)):  # the refused run left nothing to refuse again
            _steps(m, o, nn.CrossEntropyLoss(), data[2:])
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_draw_between_trunk_layers_whose_dropout_draws_in_the_cloud_is_refused_for_good(cloud):
    """HF-style LayerDrop draws ``torch.rand`` per layer even at layerdrop=0: unsplit those draws fall
    between the layers' dropout masks, split the cloud drew every mask at the first module's call.
    Refused at the second layer; the cloud half drew its masks already, so every later request is
    refused too."""
    net = layer_stack(p=0.1)
    with splitft.split(net, "layers.0:4", factory=splitft.Factory("tests.models:layer_stack", {"p": 0.1}),
                       connect=cloud) as model:
        x = _data(1)[0][0]
        model(x)  # no draws between: as unsplit
        net.between = lambda i, settings: torch.rand(())
        with pytest.raises(CutError, match=r"drew random numbers on the edge before calling 'layers.1'"):
            model(x)
        net.between = None
        with pytest.raises(UnfinishedForwardError, match=r"refuses every request from now on"):
            model.state_dict()


def test_a_trunk_called_with_its_hidden_state_by_keyword_is_refused_naming_the_positional_call(cloud):
    net = layer_stack()
    net.by_keyword = True
    with splitft.split(net, "layers.0:4", factory="tests.models:layer_stack", connect=cloud) as model:
        with pytest.raises(CutError, match=r"'layers.0' with keyword arguments only \(h, settings\).*positionally"):
            model(_data(1)[0][0])


def test_a_batch_too_large_for_the_trunk_raises_out_of_memory_as_unsplit_and_a_smaller_one_trains(cloud):
    """An out-of-memory retry loop: the first call's cut check meets the model's own error, which it
    passes on as it is (not as a fault of the cut), and checks the cut again with the smaller batch."""
    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _data(1)[0]
        size = len(x)
        while True:
            try:
                return _steps(model, opt, nn.CrossEntropyLoss(), [(x[:size], y[:size])])
            except torch.OutOfMemoryError:
                size //= 2

    local = layer_stack(most=8)
    train(local)
    with splitft.split(layer_stack(most=8), "layers.0:4", factory=splitft.Factory("tests.models:layer_stack",
                                                                                  {"most": 8}), connect=cloud) as model:
        train(model)
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("rejoin", [None, "4"], ids=["plain", "ushape"])
def test_an_aux_loss_a_cloud_module_keeps_on_itself_is_refused_where_hasattr_would_hide_it(tmp_path, rejoin):
    """``sum(m.aux_loss for m in model.modules() if hasattr(m, "aux_loss"))``: the attribute is
    made by the cloud module's forward, in the cloud; on the edge it was missing, so hasattr()
    said no and the loss silently went without its auxiliary term. Refused by name (not as an
    AttributeError, which hasattr and getattr(m, name, 0) swallow), naming the fix; unsplit()
    gives the module back as it was."""
    from tests.models import aux_loss_mlp

    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", "tests.models:aux_loss_mlp")
    try:
        model = splitft.split(aux_loss_mlp(), "2", rejoin, factory="tests.models:aux_loss_mlp", connect=address)
        with model:
            x, y = _data(1)[0]
            out = model(x) if rejoin else model.predict(x)
            assert out.shape == (len(x), 3)
            with pytest.raises(CutError, match=r"'aux_loss' of '2' is kept by that module's forward.*return out, aux"):
                [m.aux_loss for m in model.modules() if hasattr(m, "aux_loss")]
            with pytest.raises(CutError, match="return out, aux"):
                getattr(model[2], "aux_loss", 0.0)
            whole = model.unsplit()
        assert not hasattr(whole[2], "aux_loss") and whole(x).shape == (len(x), 3) and hasattr(whole[2], "aux_loss")
    finally:
        stop(proc)


@pytest.mark.parametrize("rejoin", [None, "3"], ids=["plain", "ushape"])
def test_hooks_a_model_registers_as_it_is_built_run_once_on_the_module_the_edge_runs_them_for(tmp_path, rejoin):
    """Hooks registered in the model's own construction are in the cloud's factory-built copy
    too; on the modules whose hooks the edge runs on its stand-ins (a trunk's forward pre-hooks
    and forward hooks, a plain split's first cloud module's pre-hooks) they ran twice."""
    from tests.models import self_hooked_mlp

    data = _data(3)
    hooked = {"forward_hook": rejoin is not None}  # a plain split's edge runs no forward hook of a cloud module
    local = self_hooked_mlp(**hooked)
    factory = "tests.models:self_hooked_mlp"
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", factory)
    try:
        with splitft.split(self_hooked_mlp(**hooked), "2", rejoin, factory=splitft.Factory(factory, hooked),
                           connect=address) as model:
            crit = model.remote_loss(nn.CrossEntropyLoss()) if rejoin is None else nn.CrossEntropyLoss()
            _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), crit, data)
            _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
            assert_bitwise(model.state_dict(), local.state_dict())
    finally:
        stop(proc)


@pytest.mark.parametrize("rejoin", [None, "4"], ids=["plain", "ushape"])
def test_fx_tracing_or_exporting_a_split_model_is_refused_naming_unsplit_and_training_goes_on(cloud, rejoin):
    x, y = _data(1)[0]
    local = mlp()
    with splitft.split(mlp(), "2", rejoin, factory=MLP, connect=cloud) as model:
        with pytest.raises(ConfigError, match=r"torch\.fx\.symbolic_trace / torch\.export.*model\.unsplit\(\)"):
            torch.fx.symbolic_trace(model)
        with pytest.raises(PlaceholderError, match=r"to export the model .*model\.unsplit\(\) gives"):
            torch.export.export(model, (x,))
        crit = model.remote_loss(nn.CrossEntropyLoss()) if rejoin is None else nn.CrossEntropyLoss()
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), crit, [(x, y)])
        _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), [(x, y)])
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_named_tuple_returned_by_a_cloud_module_is_refused_rather_than_arriving_as_a_plain_tuple(tmp_path):
    """``out.logits`` of a named tuple the trunk returns: it crossed as a plain tuple, so the
    edge's read of a field failed far from the cut, and ``hasattr(out, "logits")`` said no."""
    from tests.models import scored_mlp

    x = _data(1)[0][0]
    assert scored_mlp()(x).shape == (len(x), 3)
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", "tests.models:scored_mlp")
    try:
        with splitft.split(scored_mlp(), "2", "3", factory="tests.models:scored_mlp", connect=address) as model:
            with pytest.raises(ConfigError, match=r"a named tuple \(Scored\).*out\.logits would fail.*dict of its"):
                model(x)
    finally:
        stop(proc)


def test_a_u_shape_forward_from_a_second_thread_during_a_run_of_the_trunk_is_refused_naming_threads(cloud):
    """A validation thread beside training: its call of the trunk's first module while the
    training thread's run of the trunk is under way is refused by name, and that run goes on."""
    import threading

    (x, y), = _data(1)
    local = layer_stack()
    expected = local(x)
    net = layer_stack()
    with splitft.split(net, "layers.0:4", factory="tests.models:layer_stack", connect=cloud) as model:
        mid_run, other_done = threading.Event(), threading.Event()
        refused: list[BaseException] = []

        def validate() -> None:
            mid_run.wait(30)
            try:
                model(x)
            except CutError as exc:
                refused.append(exc)
            finally:
                other_done.set()

        def between(i: int, settings: dict) -> None:
            if i == 2 and threading.current_thread() is threading.main_thread() and not mid_run.is_set():
                mid_run.set()
                other_done.wait(30)

        net.between = between
        thread = threading.Thread(target=validate)
        thread.start()
        out = model(x)
        thread.join(30)
        assert refused and "called from two threads at once" in str(refused[0])
        assert torch.equal(out, expected)
        assert torch.equal(model(x), expected)  # and after


def test_a_forked_dataloader_worker_that_calls_the_split_model_is_refused_not_left_hanging(cloud):
    """Pseudo-labels in a ``collate_fn`` under ``num_workers > 0`` (fork): the worker holds a copy
    of the session's connection, whose replies go to the parent; it waited forever. Refused by
    name in the worker, raised in the loop; the parent's session goes on."""
    if "fork" not in torch.multiprocessing.get_all_start_methods():
        pytest.skip("no fork on this platform")
    (x, y), = _data(1)
    with splitft.split(mlp(), "1", "4", factory=MLP, connect=cloud) as model:
        model(x)

        def pseudo_labelled(rows):
            batch = torch.stack(rows)
            with torch.no_grad():
                return batch, model(batch).argmax(1)

        loader = torch.utils.data.DataLoader(list(x), batch_size=4, num_workers=1, collate_fn=pseudo_labelled,
                                             multiprocessing_context="fork", timeout=60)
        with pytest.raises(ConfigError, match=r"was forked from it \(a DataLoader worker"):
            next(iter(loader))
        assert model(x).shape == (len(x), 3)


def test_a_nan_batch_skipped_by_its_loss_trains_as_unsplit_with_dropout_in_the_cloud(cloud):
    """``if not torch.isfinite(loss): continue``: unsplit, a batch with a NaN input gives a NaN
    loss after the cloud half's dropout drew. The cloud computes on it as well (it refused it,
    and a script that caught the refusal went on one draw behind)."""
    from tests.models import mlp_dropout

    def train(model, crit) -> list[float]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for i, (x, y) in enumerate(_data(4)):
            if i == 1:
                x = x.clone()
                x[0, 0] = float("nan")
            loss = crit(model(x), y)
            if not torch.isfinite(loss):
                continue
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    torch.manual_seed(5)
    local = mlp_dropout()
    expected = train(local, nn.CrossEntropyLoss())
    expected_rng = torch.get_rng_state()
    torch.manual_seed(5)
    with splitft.split(mlp_dropout(), "2", factory="tests.models:mlp_dropout", connect=cloud) as model:
        assert train(model, model.remote_loss(nn.CrossEntropyLoss())) == expected
        assert torch.equal(torch.get_rng_state(), expected_rng)
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_batch_refused_as_too_large_before_it_left_keeps_the_optimizer_step_it_would_have_carried(tmp_path):
    """The cloud accepts messages up to its --max-message-mb; a forward over that is refused before
    it is sent. The operations queued for it (the last optimizer step) wait for the next message
    instead of being dropped, and the request number is the next request's: a script that catches
    the refusal and goes on with smaller batches trains as the unsplit model, which computed the
    large batch's loss and threw it away."""
    data = _data(4)
    big_x, big_y = torch.cat([x for x, _ in data] * 40), torch.cat([y for _, y in data] * 40)

    def train(model, crit) -> None:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        for i, (x, y) in enumerate(data):
            if i == 2:
                try:
                    crit(model(big_x), big_y)  # a loss to log, too large to send
                except splitft.errors.TooLarge:
                    pass
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    local = mlp()
    train(local, nn.CrossEntropyLoss())
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", MLP, "--max-message-mb", "0.02")
    try:
        with splitft.split(mlp(), "2", factory=MLP, connect=address) as model:
            with pytest.raises(splitft.errors.TooLarge):
                model.remote_loss(nn.CrossEntropyLoss())(model(big_x), big_y)
            train(model, model.remote_loss(nn.CrossEntropyLoss()))
            assert_bitwise(model.state_dict(), local.state_dict())
    finally:
        stop(proc)


@pytest.mark.parametrize("norm", [False, True], ids=["no batch norm", "batch norm"])
def test_a_checkpoint_per_trunk_layer_trains_exactly_or_is_refused_where_recomputation_moves_statistics(cloud,
                                                                                                       norm):
    """Unsplit, each layer's checkpoint recomputes it in the backward: exact for the split where
    that changes nothing, refused where batch norm would move its statistics a second time."""
    data = _data(2)
    local = layer_stack(norm=norm)
    local.checkpointed = net_checkpointed = "non-reentrant"
    net = layer_stack(norm=norm)
    net.checkpointed = net_checkpointed
    factory = splitft.Factory("tests.models:layer_stack", {"norm": norm})
    with splitft.split(net, "layers.0:4", factory=factory, connect=cloud) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if norm:
            with pytest.raises(CutError, match=r"'layers.1' in another torch.utils.checkpoint region"):
                _steps(model, opt, nn.CrossEntropyLoss(), data)
            return
        _steps(model, opt, nn.CrossEntropyLoss(), data)
        _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_reentrant_checkpoint_per_trunk_layer_is_refused_naming_the_non_reentrant_one(cloud):
    net = layer_stack()
    net.checkpointed = "reentrant"
    with splitft.split(net, "layers.0:4", factory="tests.models:layer_stack", connect=cloud) as model:
        with pytest.raises(CutError, match=r"detaches the output of 'layers.2'.*checkpoint with use_reentrant=False"):
            _steps(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.CrossEntropyLoss(), _data(1))


def test_a_forward_that_walks_into_a_cloud_modules_children_is_refused(cloud):
    """``for block in stage: h = block(h)`` over a module the cloud runs whole: its children would
    run on the edge, on placeholders."""
    net = deep_supervised()
    with splitft.split(net, "l2", "l3", factory="tests.models:deep_supervised", connect=cloud):
        with pytest.raises(CutError, match=r"called 'l2.0' on its own, a part of 'l2'.*cut at the parts"):
            net.l2[0](torch.ones(4, 16))


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_trunk_left_after_its_first_module_is_refused_where_the_cloud_ran_more_than_unsplit(cloud, training):
    """``net[2](h)`` alone (a feature logged under no_grad) runs the whole trunk 2..3 in the cloud:
    in training mode the batch norm's statistics moved, so the next request refuses; in eval mode
    nothing changed and training goes on as unsplit."""
    data = _data(3)
    local = mlp_batchnorm()
    opt_local = torch.optim.SGD(local.parameters(), lr=0.1)
    net = mlp_batchnorm()
    with splitft.split(net, 2, 4, factory="tests.models:mlp_batchnorm", connect=cloud) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            for m, o in ((local, opt_local), (model, opt)):
                _steps(m, o, nn.CrossEntropyLoss(), [(x, y)])
            model.train(training)
            with torch.no_grad():
                net[2](torch.relu(net[0](x)))
            model.train()
            if training:
                with pytest.raises(UnfinishedForwardError, match=r"trunk '2'..'3' in training mode was left unfinished \(called up "
                                                   r"to '2', not '3'\).*batch-norm statistics"):
                    model.state_dict()
                return
            assert_bitwise(model.state_dict(), local.state_dict())


def _written(sd, model, opt, crit, data):
    with torch.no_grad():
        sd["2.weight"].mul_(0.5)  # unsplit: halves the model's weight, whose memory the entry shares


def _written_through_a_view(sd, model, opt, crit, data):
    sd["2.bias"].detach()[0] = 1.0


def _kept_and_loaded(sd, model, opt, crit, data):
    _steps(model, opt, crit, data)
    model.load_state_dict(sd)  # unsplit: sd followed the live weights, so this loads them onto themselves


def _kept_and_saved(sd, model, opt, crit, data):
    _steps(model, opt, crit, data)
    torch.save(sd, io.BytesIO())  # unsplit: saves the weights of now


STATE_DICT_MISUSE = {"written in place": (_written, "was written in place"),
                     "written through a view": (_written_through_a_view, "was written in place"),
                     "written through copy.copy": (lambda sd, *rest: copy.copy(sd["2.bias"]).zero_(),
                                                   "was written in place"),
                     "shared through DLPack": (lambda sd, *rest: torch.from_dlpack(sd["2.bias"]),
                                               "through DLPack"),
                     "kept, trained, loaded": (_kept_and_loaded, "used after the cloud half changed"),
                     "kept, trained, saved": (_kept_and_saved, "used after the cloud half changed")}


@pytest.mark.parametrize("name", sorted(STATE_DICT_MISUSE))
def test_a_cloud_entry_of_state_dict_refuses_a_write_and_a_read_after_the_cloud_changed(cloud, name):
    """Unsplit, state_dict() shares the model's memory: a write changes the model, a kept dict follows
    training. Split, its cloud entries are fetched copies: both are refused before the cloud half parts."""
    action, message = STATE_DICT_MISUSE[name]
    data = _data(3)
    local = mlp()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data[:2])
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, opt, crit, data[:1])
        sd = model.state_dict()
        with pytest.raises(ConfigError, match=message + r".*(model.get_parameter|copy.deepcopy|clone)"):
            action(sd, model, opt, crit, data[1:2])
        if "trained" not in name:
            _steps(model, opt, crit, data[1:2])
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_state_dict_taken_before_an_evaluation_saves_after_it(cloud, rejoin):
    """A validation in eval mode changes nothing a state dict holds: one taken before it is still
    the model's (the batch norm's statistics would have moved in training mode)."""
    x = _data(1)[0][0]
    local = mlp_batchnorm()
    with splitft.split(mlp_batchnorm(), 2, rejoin, factory="tests.models:mlp_batchnorm", connect=cloud) as model:
        for m in (local, model):
            sd = m.state_dict()
            m.eval()
            with torch.no_grad():
                m.predict(x) if m is model else m(x)
            m.train()
            buffer = io.BytesIO()
            torch.save(sd, buffer)
            saved = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
            assert_bitwise(saved, local.state_dict())


def test_a_state_dict_kept_across_unsplit_is_the_whole_models_and_one_loaded_elsewhere_stays_checked(cloud):
    """unsplit() makes a current fetched entry the whole model's memory, as unsplit it always was
    (one taken before the last step stays refused); a dict one split model fetched and another
    loaded still stands for the first one's tensors."""
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as teacher, \
            splitft.split(mlp(seed=1), 2, factory=splitft.Factory(MLP, {"seed": 1}), connect=cloud) as student:
        sd = teacher.state_dict()
        student.load_state_dict(sd)  # the student starts from the teacher
        with torch.no_grad():
            teacher.get_parameter("2.weight").mul_(0.5)
        with pytest.raises(ConfigError, match="used after the cloud half changed"):
            sd["2.weight"].sum()
        stale = student.state_dict()
        _steps(student, torch.optim.SGD(student.parameters(), lr=0.1), student.remote_loss(nn.CrossEntropyLoss()),
               _data(1))
        sd = student.state_dict()
        whole = student.unsplit()
        with pytest.raises(ConfigError, match=r"used after the cloud half changed"):
            torch.save(stale, io.BytesIO())
        assert torch.equal(sd["2.weight"], whole[2].weight)  # the whole model's memory now, as unsplit
        with torch.no_grad():
            whole[2].weight.mul_(0.5)
            sd["2.bias"].zero_()
        assert torch.equal(sd["2.weight"], whole[2].weight) and not whole[2].bias.any()


class _Holder(nn.Module):
    """A Lightning-style module: the model it trains is an attribute, beside a layer of its own."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(5)
            self.extra = nn.Linear(2, 2)


@pytest.mark.parametrize("strict", [True, False])
def test_a_split_model_inside_another_module_saves_and_loads_with_it(cloud, strict):
    """torch's load of the holder walks into the split model, which loads what its state_dict() wrote."""
    def run(model, crit):
        holder, data = _Holder(model), _data(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _steps(model, opt, crit, data[:1])
        buffer = io.BytesIO()
        torch.save(holder.state_dict(), buffer)
        _steps(model, opt, crit, data[1:2])
        result = holder.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=True), strict=strict)
        assert result.missing_keys == [] and result.unexpected_keys == []
        _steps(model, opt, crit, data[2:])
        return {k: v.clone() for k, v in holder.state_dict().items()}

    expected = run(mlp(), nn.CrossEntropyLoss())
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        assert_bitwise(run(model, model.remote_loss(nn.CrossEntropyLoss())), expected)


def test_a_cloud_entry_of_state_dict_reads_into_numpy_as_a_copy_that_refuses_writes(cloud):
    """Flower's get_parameters, ``[v.cpu().numpy() for v in net.state_dict().values()]``: the values,
    in an array that refuses the write which unsplit would change the model with."""
    local = mlp()
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        arrays = {k: v.cpu().numpy() for k, v in model.state_dict().items()}
        assert {k: a.tolist() for k, a in arrays.items()} == {k: v.numpy().tolist() for k, v in local.state_dict().items()}
        with pytest.raises(ValueError, match="read-only"):
            arrays["2.weight"][0, 0] = 1.0
        assert not np.asarray(model.state_dict()["2.bias"]).flags.writeable
        assert_bitwise(model.state_dict(), local.state_dict())


def test_state_dict_kept_as_a_copy_or_with_its_variables_trains_as_unsplit(cloud):
    """copy.deepcopy(state_dict()) keeps a moment (a best checkpoint, loaded back later); keep_vars
    gives the model's own tensors (the cloud's placeholders), so freezing through it is mirrored;
    a fresh state_dict() saves with torch.save and loads with weights_only into the unsplit model."""
    def script(model, crit):
        for key, value in model.state_dict(keep_vars=True).items():
            if key.startswith("2."):
                value.requires_grad = False
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        _steps(model, opt, crit, data[:1])
        best = copy.deepcopy(model.state_dict())
        _steps(model, opt, crit, data[1:])
        model.load_state_dict(best)
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        return torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)

    data = _data(3)
    local = mlp()
    expected = script(local, nn.CrossEntropyLoss())
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        saved = script(model, model.remote_loss(nn.CrossEntropyLoss()))
        assert_bitwise(model.state_dict(), local.state_dict())
    assert_bitwise(saved, expected)
    assert all(type(v) is torch.Tensor for v in saved.values())


@pytest.mark.parametrize("rejoin", [None, 3], ids=["plain", "ushape"])
def test_a_sparse_embedding_in_the_cloud_half_is_refused_by_split_which_leaves_the_model_as_it_was(cloud, rejoin):
    net = lookup_mlp(layer="embedding")
    before = {k: v.clone() for k, v in net.state_dict().items()}
    with pytest.raises(CutError, match=r"'1' \(Embedding\(sparse=True\)\) would run in the cloud.*sparse=False"):
        splitft.split(net, 1, rejoin, factory=splitft.Factory("tests.models:lookup_mlp", {"layer": "embedding"}),
                      connect=cloud)
    assert_bitwise(net.state_dict(), before)
    assert type(net[1].weight) is nn.Parameter


def test_a_sparse_gradient_made_in_the_cloud_is_a_model_error_naming_it(cloud):
    """A layer of the user's own whose code asks for a sparse gradient: the cloud's backward says so."""
    ids, y = torch.randint(0, 20, (8, 4)), torch.randint(0, 3, (8,))
    with splitft.split(lookup_mlp(), 1, factory="tests.models:lookup_mlp", connect=cloud) as model:
        with pytest.raises(ModelError, match=r"sparse_coo gradient.*sparse=False"):
            model.remote_loss(nn.CrossEntropyLoss())(model(ids), y).backward()


def test_a_forward_hook_on_the_last_trunk_layer_sees_its_real_output(cloud):
    x, y = _data(1)[0]
    local, seen_local = mlp(), []
    local[3].register_forward_hook(lambda m, a, out: seen_local.append(out))
    local(x)
    net, seen = mlp(), []
    model = splitft.split(net, 2, 4, factory=MLP, connect=cloud)
    with model:
        net[3].register_forward_hook(lambda m, a, out: seen.append(out))
        model(x)
    assert torch.equal(seen[0], seen_local[0])


#: Hooks a script registered before ``split()`` on what then runs in the cloud: (plain, U-shape).
HOOKS_BEFORE_SPLIT: dict[str, Callable[[nn.Module], object]] = {
    "a forward hook on a cloud layer": lambda net: net[2].register_forward_hook(lambda m, a, out: out * 2),
    "a forward hook on the next cloud layer": lambda net: net[3].register_forward_hook(lambda m, a, out: out * 2),
    "a full backward hook": lambda net: net[2].register_full_backward_hook(lambda m, gi, go: (gi[0] * 0.5,)),
    "a backward pre-hook": lambda net: net[3].register_full_backward_pre_hook(lambda m, go: (go[0] * 0.5,)),
    "a gradient hook on a cloud weight": lambda net: net[2].weight.register_hook(lambda g: g * 0.5),
    "a post-accumulate hook on a cloud weight": lambda net: net[2].weight.register_post_accumulate_grad_hook(
        lambda p: p.grad.mul_(0.5)),
}


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("name", sorted(HOOKS_BEFORE_SPLIT))
def test_a_hook_registered_before_split_on_the_cloud_half_is_refused_by_split(cloud, name, rejoin):
    """It would never run in the cloud (a U-shape trunk's forward hooks do run on the edge: one on
    the trunk's last layer is kept, see above): training would silently differ. The split is
    refused before it changed the model, which still trains on its own."""
    net = mlp()
    HOOKS_BEFORE_SPLIT[name](net)
    if rejoin and name == "a forward hook on the next cloud layer":
        pytest.skip("net[3] ends a U-shape trunk: its forward hook sees the trunk's real output")
    if rejoin and name == "a forward hook on a cloud layer":  # it runs on the edge, and reads an inner output
        model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)
        with model, pytest.raises(CutError, match=r"\(or a forward hook on '2'\) .*output of '2', an inner module "
                                                  r"of the trunk.*a hook: onto the trunk's last module"):
            model(_data(1)[0][0])
        return
    with pytest.raises(CutError, match=r"hook.*(never run|cloud)"):
        splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)
    assert not net[2].weight.is_meta and torch.isfinite(net(_data(1)[0][0])).all()


def test_a_backward_hook_on_a_trunk_layer_is_refused_when_registered(cloud):
    """The U-shape trunk's backward runs in the cloud: a module backward hook would see the edge's
    stand-ins (it changed the cloud half's gradients where the unsplit one changes the edge's)."""
    model = splitft.split(mlp(), 2, 4, factory=MLP, connect=cloud)
    with model:
        for register in ("register_full_backward_hook", "register_full_backward_pre_hook", "register_backward_hook"):
            with pytest.raises(CutError, match=register):
                getattr(model.model[2], register)(lambda *args: None)


def test_a_global_module_hook_is_refused_at_the_forward(cloud):
    """``register_module_forward_hook`` runs on every module's call, the cloud half's too when unsplit."""
    x, y = _data(1)[0]
    model = splitft.split(mlp(), 2, factory=MLP, connect=cloud)
    with model:
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, a, out: None)
        try:
            with pytest.raises(ConfigError, match=r"global module hook"):
                model(x)
        finally:
            handle.remove()
        model(x)  # removed: the forward runs again


#: In-place changes to a cloud container that torch makes past ``__setattr__`` (they write the
#: module's tables of children, parameters and buffers directly).
CONTAINER_CHANGES: dict[str, Callable[[nn.Module], object]] = {
    "Sequential.append": lambda net: net.block2.append(nn.Tanh()),
    "Sequential.insert": lambda net: net.block2.insert(1, nn.Tanh()),
    "Sequential.extend": lambda net: net.block2.extend([nn.Tanh()]),
    "add_module": lambda net: net.block2.add_module("extra", nn.Tanh()),
    "register_module over a layer": lambda net: net.block2.register_module("2", nn.GELU()),
    "register_buffer": lambda net: net.block2[1].register_buffer("extra", torch.zeros(1)),
    "register_parameter": lambda net: net.block2[1].register_parameter("scale", nn.Parameter(torch.ones(1))),
    "SyncBatchNorm.convert_sync_batchnorm": lambda net: nn.SyncBatchNorm.convert_sync_batchnorm(net),
}


@pytest.mark.parametrize("name", sorted(CONTAINER_CHANGES))
def test_a_cloud_container_changed_in_place_is_refused_and_training_stays_exact(cloud, name):
    """``Sequential.append`` on a cloud block used to change the edge's copy only: the cloud went
    on running the factory's block while the script believed it extended (silent divergence)."""
    from splitft.app.models import digits_cnn

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    local = digits_cnn()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9), nn.CrossEntropyLoss(), data)
    net = digits_cnn()
    model = splitft.split(net, "block2", factory=DIGITS, connect=cloud)
    with model:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        crit = model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, opt, crit, data[:1])
        with pytest.raises(CutError, match=r"'block2.*runs in the cloud"):
            CONTAINER_CHANGES[name](net)
        _steps(model, opt, crit, data[1:])
        assert_bitwise(model.state_dict(), local.state_dict())


def test_channels_last_is_refused_when_the_cloud_half_convolves(cloud):
    from splitft.app.models import digits_cnn

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    local = digits_cnn()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.05), nn.CrossEntropyLoss(), data)
    net = digits_cnn()
    model = splitft.split(net, "block3", factory=DIGITS, connect=cloud)
    with model:
        with pytest.raises(ConfigError, match="memory_format"):
            model.to(memory_format=torch.channels_last)
        assert all(p.is_contiguous() for p in model.edge_parameters())
        # a cloud module converted on its own, or through a container or a walk over the modules:
        # the cloud's convolution would go on in its layout, unseen
        for convert in (lambda: net.block3.to(memory_format=torch.channels_last),
                        lambda: net.block3[0].to(memory_format=torch.channels_last),
                        lambda: net[2:].to(memory_format=torch.channels_last),
                        lambda: net.apply(lambda m: m.to(memory_format=torch.channels_last)
                                          if m is net.block3[0] else m)):
            with pytest.raises(CutError, match=r"'block3(.0)?' to another memory format"):
                convert()
        net.block3.to("cpu")  # a move is the cloud's business: left alone, as the whole model's
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.05), model.remote_loss(nn.CrossEntropyLoss()), data)
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("factory", [DIGITS, "tests.models:channels_last_cnn"], ids=["as built", "converted too"])
def test_a_model_converted_to_channels_last_before_split_trains_as_unsplit_or_is_refused(cloud, factory):
    """``model.to(memory_format=torch.channels_last)`` before ``split()`` (timm's ``--channels-last``):
    the cloud half's convolutions then sum in the weights' layout, so a factory that builds the model
    as it was is refused at the handshake, and one that converts it too trains bitwise."""
    from splitft.app.models import digits_cnn

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    local = digits_cnn().to(memory_format=torch.channels_last)
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.05, momentum=0.9), nn.CrossEntropyLoss(), data)
    net = digits_cnn().to(memory_format=torch.channels_last)
    if factory == DIGITS:
        with pytest.raises(HandshakeError, match=r"memory layouts .* needs the factory to convert it too"):
            splitft.split(net, "block3", factory=factory, connect=cloud)
        return
    with splitft.split(net, "block3", factory=factory, connect=cloud) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), crit, data)
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("where", ["edge layers converted", "input converted"])
def test_an_activation_at_the_cut_in_channels_last_crosses_in_its_layout_and_trains_as_unsplit(cloud, where):
    """Edge layers converted one by one (as the refusal of ``model.to(memory_format=...)`` allows),
    or a channels_last input, make the activation at the cut channels_last: unsplit, the cloud
    half's convolutions compute in that layout, and so they do split (the activation crosses as
    its bytes lie, and its gradient comes back in the layout the cloud's backward made)."""
    from splitft.app.models import digits_cnn

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]
    if where == "input converted":
        data = [(x.to(memory_format=torch.channels_last), y) for x, y in data]

    def convert(net: nn.Module) -> None:
        if where == "edge layers converted":
            net.block1.to(memory_format=torch.channels_last)
            net.block2.to(memory_format=torch.channels_last)

    local = digits_cnn()
    convert(local)
    probe = copy.deepcopy(local).eval()
    assert probe.block2(probe.block1(data[0][0])).is_contiguous(memory_format=torch.channels_last)
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.05), nn.CrossEntropyLoss(), data)
    net = digits_cnn()
    with splitft.split(net, "block3", factory=DIGITS, connect=cloud) as model:
        convert(net)
        crit = model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, torch.optim.SGD(model.parameters(), lr=0.05), crit, data)
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("compile_stem", [False, True], ids=["checkpointed", "checkpointed-and-compiled"])
def test_a_checkpointed_or_compiled_edge_block_trains_exactly(cloud, compile_stem):
    data = _data(3)
    local = checkpointed_mlp(compile_stem)
    _steps(local, torch.optim.Adam(local.parameters(), lr=1e-2), nn.CrossEntropyLoss(), data)
    net = checkpointed_mlp(compile_stem)
    model = splitft.split(net, "body.2:4", factory="tests.models:checkpointed_mlp", connect=cloud)
    with model:
        _steps(model, torch.optim.Adam(model.parameters(), lr=1e-2), nn.CrossEntropyLoss(), data)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("how", ["model.body = ...", "net.body = ...", "net.body = torch.compile(net.body)"])
def test_a_module_holding_cloud_layers_replaced_after_split_is_refused_at_the_next_forward(cloud, how):
    """``body`` holds the layers that run in the cloud: a new ``body`` takes them out of the
    forward (and a compiled one out of reach of the cut), while the cloud half would go on
    standing for them in ``state_dict()``."""
    data = _data(3)
    local = checkpointed_mlp()
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data[:2])
    net = checkpointed_mlp()
    model = splitft.split(net, "body.2:4", factory="tests.models:checkpointed_mlp", connect=cloud)
    with model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        _steps(model, opt, nn.CrossEntropyLoss(), data[:2])
        fresh = mlp(seed=1)
        if how == "model.body = ...":
            model.body = fresh
        elif how == "net.body = ...":
            net.body = fresh
        else:
            net.body = torch.compile(net.body, backend="aot_eager")
        with pytest.raises(ConfigError, match=r"'body' holds modules that run in the cloud, but it was replaced"):
            _steps(model, opt, nn.CrossEntropyLoss(), data[2:])
        assert_bitwise(model.cloud_state_dict(), {n: v for n, v in local.state_dict().items()
                                                  if n in model.cloud_state_dict()})


_TOUCHES = {"torch": (lambda gen: gen.manual_seed(123), lambda gen: gen.get_state()),
            "random": (lambda gen: gen.seed(123), lambda gen: gen.getstate()),
            "numpy": (lambda gen: gen.bit_generator.state, lambda gen: gen.standard_normal())}


@pytest.mark.parametrize("kind", ["torch", "random", "numpy"])
@pytest.mark.parametrize("touch", [0, 1], ids=["reseeded", "its state read (to restore it later)"])
def test_a_generator_a_cloud_layer_draws_from_trains_exactly_and_is_refused_when_touched(cloud, kind, touch):
    """``NoisyLinear`` draws its noise from a generator of its own (torch's, Python's, NumPy's):
    built the same by the factory, the cloud's draws exactly as the unsplit layer does; seeded or
    read on the edge, the edge's copy would be touched, not the cloud's (which has drawn since)."""
    data = _data(4)
    local = noisy_mlp(kind=kind)
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
    net = noisy_mlp(kind=kind)
    model = splitft.split(net, 2, factory=splitft.Factory("tests.models:noisy_mlp", {"kind": kind}), connect=cloud)
    with model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        crit = model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, opt, crit, data[:2])
        with pytest.raises(CutError, match=r"'noise' of '2' is the generator that module draws from in the cloud"):
            _TOUCHES[kind][touch](net[2].noise)
        _steps(model, opt, crit, data[2:])
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("how", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_split_model_trains_exactly(cloud, rejoin, how):
    """The edge's code is compiled around the remote call, which runs as it is."""
    data = _data(3)
    local = mlp()
    _steps(torch.compile(local, backend="aot_eager"), torch.optim.Adam(local.parameters(), lr=1e-2),
           nn.CrossEntropyLoss(), data)
    model = splitft.split(mlp(), 2, rejoin, factory=MLP, connect=cloud)
    with model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        if how == "model.compile()":
            model.compile(backend="aot_eager")
            compiled = model
        else:
            compiled = torch.compile(model, backend="aot_eager")
        _steps(compiled, torch.optim.Adam(model.parameters(), lr=1e-2), crit, data)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_compiling_a_split_model_traces_none_of_splitft_s_checks(cloud, rejoin):
    """torch.compile(model) compiles the edge's layers and steps over splitft's own checks (the
    settings guard, the stand-ins at the cut): traced, they break the graph at every torch flag
    they read, and Dynamo warns about each as if the script had a bug."""
    warn_once = getattr(torch._dynamo.utils, "warn_once_cache", set())
    warn_once.clear()  # Dynamo warns once a process: an earlier compile must not hide this one's
    model = splitft.split(mlp(), 2, rejoin, factory=MLP, connect=cloud)
    with model, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        _steps(torch.compile(model, backend="aot_eager"), torch.optim.Adam(model.parameters(), lr=1e-2), crit,
               _data(2))
    dynamo = [str(w.message).splitlines()[0] for w in caught
              if "_dynamo" in w.filename and w.category is UserWarning]  # not its notes on the interpreter
    assert not dynamo, dynamo


USER_SCRIPT = """
from torch.nn.utils import clip_grad_norm_  # at the top, before splitft: the most common style
import sys
import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook
import splitft
from tests.models import mlp
from tests.test_faults import _data

def train(model, opt, crit):
    for x, y in _data(5):
        opt.zero_grad()
        crit(model(x), y).backward()
        clip_grad_norm_(model.parameters(), 0.25)
        opt.step()

local = mlp()
train(local, torch.optim.Adam(local.parameters(), lr=1e-2), nn.CrossEntropyLoss())
model = splitft.split(mlp(), 2, factory="tests.models:mlp", connect=sys.argv[1])
with model:
    train(model, torch.optim.Adam(model.parameters(), lr=1e-2), model.remote_loss(nn.CrossEntropyLoss()))
    state = model.state_dict()
print(all(torch.equal(state[k], v) for k, v in local.state_dict().items()))
"""


def test_clip_grad_norm_imported_before_splitft_clips_both_halves_bitwise(cloud, tmp_path):
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(USER_SCRIPT))
    result = subprocess.run([sys.executable, str(script), cloud], cwd=ROOT, capture_output=True, text=True,
                            timeout=240, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin"})
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "True"


def test_a_second_backward_through_one_forward_is_refused_in_a_u_shape_and_mirrored_in_a_plain_split(cloud):
    """``backward(retain_graph=True)`` then another backward of the same forward: a plain split's
    cloud computed the loss's backward with the forward and repeats its share; a U-shape trunk's
    graph is freed in the cloud after the first, so the second is refused before it is sent."""
    x, y = _data(1)[0]
    local = mlp()
    out = local(x)
    loss = nn.functional.cross_entropy(out, y)
    loss.backward(retain_graph=True)
    loss.backward()
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as plain:
        loss = plain.remote_loss(nn.CrossEntropyLoss())(plain(x), y)
        loss.backward(retain_graph=True)
        loss.backward()
        plain.attach(torch.optim.SGD(plain.parameters(), lr=0.0))
        grads = {n: p.grad.clone() for n, p in plain.named_parameters() if not plain.cloud_half.owns(p)}
        assert len(grads) == 2 and all(torch.equal(g, dict(local.named_parameters())[n].grad)
                                       for n, g in grads.items())
    with splitft.split(mlp(), 2, 4, factory=MLP, connect=cloud) as ushape:
        loss = nn.functional.cross_entropy(ushape(x), y)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="second backward through the same forward") as refused:
            loss.backward()  # a RuntimeError, as torch's for a freed graph: an except RuntimeError catches both
        assert isinstance(refused.value, ConfigError)


def test_a_second_backward_after_one_without_retain_graph_is_refused_before_anything_is_sent(cloud):
    """Unsplit, torch refuses a second backward through a graph the first freed; split, the cloud
    gave the first's gradients away uncopied (``apply.last``): refused on the edge before anything
    is sent, and the session trains on as the unsplit model does."""
    data = _data(2)
    local = mlp()
    out = local(data[0][0])
    loss = nn.functional.cross_entropy(out, data[0][1])
    loss.backward()
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    local_opt.step()
    local_opt.zero_grad()
    _steps(local, local_opt, nn.CrossEntropyLoss(), data[1:])
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(nn.CrossEntropyLoss())
        loss = crit(model(data[0][0]), data[0][1])
        loss.backward()
        with pytest.raises(ConfigError, match="the first without retain_graph=True"):
            loss.backward()
        opt.step()
        opt.zero_grad()
        _steps(model, opt, crit, data[1:])
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), local.state_dict().values()))


def test_a_draw_between_model_x_and_its_remote_loss_is_refused_where_the_cloud_half_draws_too(cloud):
    """Unsplit, the cloud half's dropout draws at model(x), before what the script draws next; split,
    it runs at the loss. Where it draws, a draw in between is refused: before anything is sent once
    the edge knows it draws, at the first such loss otherwise; where it draws nothing (eval mode),
    the loss is computed as unsplit."""
    data = _data(3)

    def drawing_step(model, crit, opt, x, y):
        opt.zero_grad()
        out = model(x)
        weight = 1 + torch.rand(1)  # a random loss weight, drawn after the forward
        (crit(out, y) * weight).backward()
        opt.step()

    net = mlp_dropout()
    model = splitft.split(net, 2, factory="tests.models:mlp_dropout", connect=cloud)
    with model:
        opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(nn.CrossEntropyLoss())
        with pytest.raises(ConfigError, match=r"drew random numbers between model\(x\) and its remote loss"):
            drawing_step(model, crit, opt, *data[0])  # the first forward: refused once the cloud said it drew

    torch.manual_seed(0)
    local = mlp_dropout()
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    _steps(local, opt, nn.CrossEntropyLoss(), data[:1])
    local.eval()
    for x, y in data[1:]:
        drawing_step(local, nn.CrossEntropyLoss(), opt, x, y)
    torch.manual_seed(0)
    net = mlp_dropout()
    model = splitft.split(net, 2, factory="tests.models:mlp_dropout", connect=cloud)
    with model:
        opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(nn.CrossEntropyLoss())
        _steps(model, opt, crit, data[:1])  # the edge learns that the cloud half draws in training
        before, generator = model.cloud_state_dict(), torch.get_rng_state()
        with pytest.raises(ConfigError, match=r"drew random numbers between model\(x\) and its remote loss"):
            drawing_step(model, crit, opt, *data[1])
        assert_bitwise(model.cloud_state_dict(), before)  # refused before anything reached the cloud
        torch.set_rng_state(generator)  # the refused step's own draw, undone
        model.eval()  # no dropout: a draw in between changes nothing of the cloud half's
        for x, y in data[1:]:
            drawing_step(model, crit, opt, x, y)
        assert_bitwise(model.state_dict(), local.state_dict())


def _checkpointed_steps(model, crit, data, reentrant: bool, early_stop: bool = True) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            out = torch.utils.checkpoint.checkpoint(model, x.requires_grad_(reentrant), use_reentrant=reentrant)
            crit(out, y).backward()
        opt.step()


@pytest.mark.parametrize("build, reentrant, early_stop, plain_refusal", [
    (mlp_dropout, False, True, None),
    (mlp_dropout, False, False, None),  # the recomputation reaches the cut: it is no forward of its own
    (mlp_batchnorm, False, True, r"recomputed during backward .* keeps running statistics \(BatchNorm1d\)"),
    (mlp_dropout, True, True, r"ran with gradients off and whose output was made to require them after it"),
], ids=["dropout", "dropout, no early stop", "batch norm", "reentrant"])
def test_a_checkpoint_around_the_whole_split_model_trains_exactly_or_is_refused(cloud, build, reentrant, early_stop,
                                                                                plain_refusal):
    """``checkpoint(model, x)``: unsplit, the backward runs the whole model's forward again. A
    U-shape's recomputation runs the cloud half again too, exactly. A plain split's reaches the
    edge's layers alone, which is exact where running the cloud half again changes nothing (the
    checkpoint draws the same dropout masks and puts the generator back); where it would update
    batch-norm statistics a second time, or where the reentrant checkpoint's gradient could not
    reach the edge (model(x) ran with gradients off), it is refused in the first step's backward."""
    factory, data = f"tests.models:{build.__name__}", _data(3)
    torch.manual_seed(0)
    local = build()
    _checkpointed_steps(local, nn.CrossEntropyLoss(), data, reentrant, early_stop)
    for rejoin in (4, None):
        torch.manual_seed(0)
        net = build()
        with splitft.split(net, 2, rejoin, factory=factory, connect=cloud) as model:
            crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
            if rejoin or plain_refusal is None:
                _checkpointed_steps(model, crit, data, reentrant, early_stop)
                assert_bitwise(model.state_dict(), local.state_dict())
                continue
            weights = dict(model.named_parameters())
            before = {n: v.clone() for n, v in model.state_dict().items() if n in weights}
            with pytest.raises(ConfigError, match=plain_refusal):
                _checkpointed_steps(model, crit, data[:1], reentrant, early_stop)
            # no step was taken (a recomputation is refused in the first backward, once the
            # cloud half ran its one forward at the loss)
            assert_bitwise({n: v for n, v in model.state_dict().items() if n in weights}, before)


def test_a_loss_computed_with_gradients_on_from_a_model_x_made_without_them_builds_no_graph(cloud):
    """``with torch.no_grad(): out = model(x)`` and the loss outside it (an evaluation loss):
    unsplit, the cloud half ran in the no-grad region, so the loss carries no graph; split, the
    cloud runs at the loss, under the forward's setting, and gives the same value and no graph."""
    data = _data(3)

    def script(model, crit):
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
        for x, y in data:
            with torch.no_grad():
                out = model(x)
            loss = crit(out, y)
            losses.append((loss.item(), loss.requires_grad))
            _steps(model, opt, crit, [(x, y)])
        return losses

    torch.manual_seed(0)
    local = mlp_batchnorm()
    expected = script(local, nn.CrossEntropyLoss())
    torch.manual_seed(0)
    with splitft.split(mlp_batchnorm(), 2, factory="tests.models:mlp_batchnorm", connect=cloud) as model:
        assert script(model, model.remote_loss(nn.CrossEntropyLoss())) == expected
        assert_bitwise(model.state_dict(), local.state_dict())
    assert not any(requires for _, requires in expected)


def _forked_forward(model, crit, opt, x, y, i):
    with torch.random.fork_rng(devices=[]):  # e.g. to keep a data pipeline's draws apart from the model's
        out = model(x)
    crit(out, y).backward()


def _put_back_through_torch_random(model, crit, opt, x, y, i):
    start = torch.get_rng_state()
    out = model(x)
    torch.random.set_rng_state(start)  # torch.random's own name for torch.set_rng_state
    crit(out, y).backward()


def _reseeded_before_the_loss(model, crit, opt, x, y, i):
    out = model(x)
    torch.manual_seed(100 + i)
    (crit(out, y) * (1 + torch.rand(1))).backward()  # a random loss weight, from the new seed


def _drawn_in_the_fork(model, crit, opt, x, y, i):
    with torch.random.fork_rng(devices=[]):
        out = model(x)
        weight = 1 + torch.rand(1)  # unsplit, after the cloud half's masks
    (crit(out, y) * weight).backward()


def _drawn_then_reseeded(model, crit, opt, x, y, i):
    out = model(x)
    torch.rand(3)
    torch.manual_seed(100 + i)
    crit(out, y).backward()


@pytest.mark.parametrize("step, refused", [(_forked_forward, False), (_reseeded_before_the_loss, False),
                                           (_put_back_through_torch_random, False),
                                           (_drawn_in_the_fork, True), (_drawn_then_reseeded, True)],
                         ids=["fork_rng around model(x)", "reseeded before the loss",
                              "put back by torch.random.set_rng_state", "drawn inside the fork",
                              "drawn, then reseeded"])
def test_a_generator_set_between_model_x_and_its_loss_stays_as_the_script_set_it(cloud, step, refused):
    """Unsplit, the cloud half's dropout draws at model(x); split, at the loss, from the state
    model(x) saw. Set in between (fork_rng's exit puts it back, manual_seed), the generator then
    holds what the script set, not what follows the half's draws; a draw before the set would have
    come after the half's masks, and is refused as any draw in between is."""
    data = _data(3)

    def script(model, crit):
        opt, after = torch.optim.SGD(model.parameters(), lr=0.1), []
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            step(model, crit, opt, x, y, i)
            opt.step()
            after.append(torch.rand(2))  # where the generator went on from
        return after

    torch.manual_seed(0)
    local = mlp_dropout()
    expected = script(local, nn.CrossEntropyLoss())
    torch.manual_seed(0)
    with splitft.split(mlp_dropout(), 2, factory="tests.models:mlp_dropout", connect=cloud) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        if refused:
            with pytest.raises(ConfigError, match=r"drew random numbers between model\(x\) and its remote loss"):
                script(model, crit)
            return
        got = script(model, crit)
        assert_bitwise(model.state_dict(), local.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _frozen_at_the_third_step(model, net, crit, data, before_the_loss: bool):
    """Freezes a cloud weight in the third step, after ``model(x)``, before its loss or its backward."""
    opt, no_grad = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), []
    for i, (x, y) in enumerate(data):
        out = model(x)
        if i == 2 and before_the_loss:
            net[2].weight.requires_grad_(False)
        loss = crit(out, y)
        if i == 2:
            net[2].weight.requires_grad_(False)
        loss.backward()
        no_grad.append(net[2].weight.grad is None)
        opt.step()
        opt.zero_grad()
        net[2].weight.requires_grad_(True)
    return no_grad


@pytest.mark.parametrize("rejoin, before_the_loss", [(None, False), (4, False), (4, True), (None, True)],
                         ids=["plain, before the backward", "ushape, before the backward",
                              "ushape, before the loss", "plain, before the loss"])
def test_a_cloud_weight_frozen_after_its_forward_gets_no_gradient_as_unsplit(cloud, rejoin, before_the_loss):
    """Torch asks ``requires_grad`` at the backward: a weight frozen after the forward that used it
    gets no gradient. The edge tells the cloud its frozen set before each backward, so the cloud's
    gradient (computed with the loss, or in its backward) is left out as unsplit. A plain split's
    cloud half runs at the loss, so a flag flipped between model(x) and its loss is refused there."""
    data = _data(4)
    local = mlp()
    expected = _frozen_at_the_third_step(local, local, nn.CrossEntropyLoss(), data, before_the_loss)
    assert expected == [False, False, True, False]
    net = mlp()
    with splitft.split(net, 2, rejoin, factory=MLP, connect=cloud) as model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        if rejoin is None and before_the_loss:
            with pytest.raises(ConfigError, match=r"requires_grad of a cloud parameter .* changed between model\(x\)"):
                _frozen_at_the_third_step(model, net, crit, data, before_the_loss)
            return
        assert _frozen_at_the_third_step(model, net, crit, data, before_the_loss) == expected
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("register", [
    lambda net, seen: net.register_forward_hook(lambda m, args, out: seen.append(out.norm())),
    lambda net, seen: net.register_full_backward_hook(lambda m, grad_in, grad_out: seen.append(grad_out[0].norm())),
    lambda net, seen: net.register_full_backward_pre_hook(lambda m, grad_out: seen.append(grad_out[0].norm())),
], ids=["forward hook", "full backward hook", "full backward pre-hook"])
def test_a_hook_on_the_model_above_a_plain_cut_is_refused_and_a_u_shapes_sees_the_output(cloud, register):
    """Unsplit, a hook on the model sees its output (the logits) or their gradient. A plain split's
    edge runs the model's forward only up to the cut, so the hook never ran (it logged nothing,
    silently): refused at the forward. A U-shape's forward completes on the edge: its hook sees what
    it sees unsplit."""
    data = _data(3)
    local, expected = mlp(), []
    register(local, expected)
    _steps(local, torch.optim.SGD(local.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
    net, seen = mlp(), []
    with splitft.split(net, 2, 4, factory=MLP, connect=cloud) as ushape:
        register(net, seen)
        _steps(ushape, torch.optim.SGD(ushape.parameters(), lr=0.1), nn.CrossEntropyLoss(), data)
    assert len(seen) == len(expected) == 3 and all(torch.equal(a, b) for a, b in zip(seen, expected))
    net = mlp()
    with splitft.split(net, 2, factory=MLP, connect=cloud) as plain:
        register(net, [])
        with pytest.raises(CutError, match=r"hook on 'the model': a plain split runs its forward on the edge only up"):
            plain(data[0][0])


@pytest.mark.parametrize("scripted, message", [
    (False, r"'2' \(SlottedLinear\) cannot be stood in for on the edge: its class lists ABC before nn.Module among "
            r"its bases \(class SlottedBase\(ABC, nn.Module\)\)"),
    (True, r"'2' is a TorchScript module"),
], ids=["abc-first", "scripted"])
def test_a_cloud_layer_the_edge_cannot_stand_in_for_is_refused_by_split_which_leaves_the_model_as_it_was(
        cloud, scripted, message):
    net = abc_mlp(scripted=scripted)
    x, y = _data(1)[0]
    before = {n: t.clone() for n, t in net.state_dict().items()}
    with pytest.raises(CutError, match=message):
        splitft.split(net, 2, factory=splitft.Factory("tests.models:abc_mlp", kwargs={"scripted": scripted}),
                      connect=cloud)
    assert_bitwise(net.state_dict(), before)
    nn.CrossEntropyLoss()(net(x), y).backward()  # the model is whole: it trains on as it was
    assert all(p.grad is not None for p in net.parameters())


def test_splitting_a_model_split_already_is_refused_naming_unsplit_and_after_unsplit_it_splits_again(cloud):
    """A trial loop that splits the same object each trial: the second split() meets the first's
    stand-ins, refused by name (not a handshake about patched code); unsplit() makes it whole again."""
    net = mlp()
    x, y = _data(1)[0]
    first = splitft.split(net, 2, factory=MLP, connect=cloud)
    with pytest.raises(ConfigError, match=r"this model is split already.*unsplit\(\) on that split model"):
        splitft.split(net, 2, factory=MLP, connect=cloud)
    with pytest.raises(ConfigError, match="this model is split already"):
        splitft.split(first, 2, factory=MLP, connect=cloud)
    whole = first.unsplit()
    with splitft.split(whole, 2, factory=MLP, connect=cloud) as again:
        again.remote_loss(nn.CrossEntropyLoss())(again(x), y).backward()
