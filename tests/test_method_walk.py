"""Every public method of ``nn.Module`` and ``torch.optim.Optimizer``, called on a split model or
its optimizer, is mirrored to the cloud half, local by nature, or refused with a message that
names the fix — none acts on the edge half alone in silence. A method torch adds later fails
the first test until it is classified here."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft.edge.placeholders import CloudTensor
from splitft.errors import CutError, SplitFTError
from tests.models import mlp
from tests.test_faults import MLP, _data, assert_same

NOT_METHODS = {"T_destination", "dump_patches", "call_super_init"}

#: Mirrored: the cloud half does the same. Checked below; train/eval by name in test_script_corpus (a BatchNorm
#: in the cloud), state_dict/load_state_dict in test_module_contract, forward everywhere.
MODULE_MIRRORED = {"zero_grad", "requires_grad_", "train", "eval", "state_dict", "load_state_dict", "forward", "apply",
                   "compile"}  # compile: the edge's code around the remote call (test_script_refusals)
#: Local by nature: views that report the unsplit model (cloud parameters as meta placeholders),
#: hooks around the split model's own forward/backward, what is added to the split model itself,
#: and device moves (where the cloud half runs is the cloud's choice).
MODULE_LOCAL = {"parameters", "named_parameters", "buffers", "named_buffers", "children", "named_children",
                "modules", "named_modules", "get_submodule", "get_parameter", "get_buffer", "extra_repr",
                "get_extra_state", "set_extra_state", "register_forward_hook", "register_forward_pre_hook",
                "register_full_backward_hook", "register_full_backward_pre_hook", "register_backward_hook",
                "add_module", "register_module", "register_parameter", "register_buffer", "to", "cpu", "cuda",
                "xpu", "ipu", "mtia", "float", "type", "share_memory", "to_empty"}
#: Refused with the fix (they would change the cloud half without it following).
MODULE_REFUSED = {
    "set_submodule": lambda m: m.set_submodule("model.2", nn.Linear(16, 16)),
    "half": lambda m: m.half(),
    "double": lambda m: m.double(),
    "bfloat16": lambda m: m.bfloat16(),
    "register_state_dict_pre_hook": lambda m: m.register_state_dict_pre_hook(lambda *a: None),
    "register_state_dict_post_hook": lambda m: m.register_state_dict_post_hook(lambda *a: None),
    "register_load_state_dict_pre_hook": lambda m: m.register_load_state_dict_pre_hook(lambda *a: None),
    "register_load_state_dict_post_hook": lambda m: m.register_load_state_dict_post_hook(lambda *a: None),
}

OPTIMIZER_MIRRORED = {"step", "zero_grad", "add_param_group", "load_state_dict"}
#: state_dict holds the edge half's moments (loading moments back is refused); hooks run on the edge around
#: the step, as they would unsplit.
OPTIMIZER_LOCAL = {"state_dict", "register_step_pre_hook", "register_step_post_hook", "register_state_dict_pre_hook",
                   "register_state_dict_post_hook", "register_load_state_dict_pre_hook",
                   "register_load_state_dict_post_hook", "profile_hook_step"}


def _public(cls: type) -> set[str]:
    """torch's own public attributes (other libraries add some to nn.Module at import)."""
    return {n for n in dir(cls) if not n.startswith("_")
            and getattr(getattr(cls, n), "__module__", "torch").startswith("torch")} - NOT_METHODS


def test_every_public_method_is_classified_once():
    module = [MODULE_MIRRORED, MODULE_LOCAL, set(MODULE_REFUSED)]
    assert set().union(*module) == _public(nn.Module)
    assert sum(map(len, module)) == len(_public(nn.Module))
    assert OPTIMIZER_MIRRORED | OPTIMIZER_LOCAL == _public(torch.optim.Optimizer)
    assert not OPTIMIZER_MIRRORED & OPTIMIZER_LOCAL


@pytest.fixture
def split_mlp(inproc_cloud):
    net = mlp()
    model = splitft.split(net, 2, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    yield model, net
    model.close()


@pytest.mark.parametrize("name", sorted(MODULE_REFUSED))
def test_a_refused_module_method_raises_naming_the_fix_and_changes_nothing(split_mlp, name):
    model, _ = split_mlp
    before = {n: (p.dtype, p.device) for n, p in model.named_parameters()}
    with pytest.raises(SplitFTError) as caught:
        MODULE_REFUSED[name](model)
    assert len(str(caught.value)) > 40  # says what to do instead
    assert {n: (p.dtype, p.device) for n, p in model.named_parameters()} == before
    assert isinstance(model.model[2], nn.Linear) and isinstance(model.model[2].weight, CloudTensor)


def test_views_report_the_unsplit_model_with_the_cloud_half_as_placeholders(split_mlp):
    model, net = split_mlp
    local = mlp()
    named = dict(model.named_parameters())  # under the unsplit names, no wrapper prefix
    assert {n: p.shape for n, p in named.items()} == {n: p.shape for n, p in local.named_parameters()}
    assert [n for n, _ in model.named_modules()] == [n for n, _ in local.named_modules()]
    assert [n for n, _ in model.named_children()] == [n for n, _ in local.named_children()]
    assert dict(model.named_modules())[""] is net  # the root is the user's own module, as unsplit
    assert {n for n, p in named.items() if isinstance(p, CloudTensor)} == {n for n, _ in model.named_cloud_parameters()}
    assert {id(p) for p in model.edge_parameters()} == {id(p) for p in net[0].parameters()}
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in local.parameters())
    assert isinstance(model.get_parameter("model.4.weight"), CloudTensor) and model.get_submodule("model.4") is net[4]
    model.to("cpu").float()  # device moves and same-dtype casts: the edge's, placeholders untouched
    assert isinstance(net[4].weight, CloudTensor) and not isinstance(net[0].weight, CloudTensor)
    # a placeholder answers the edge half's device, where the unsplit model's values were
    assert net[4].weight.device == net[0].weight.device == torch.device("cpu")
    # a plain split's forward returns the cut's activation, where a hook would look for the logits
    calls = []
    handle = model.register_forward_hook(lambda mod, args, out: calls.append(out.shape))
    x, _ = _data(1)[0]
    with pytest.raises(CutError, match=r"a forward hook on 'the split model'.*model\.predict\(x\)"):
        model(x)
    handle.remove()
    assert calls == [] and model(x).shape == (16, 3)  # the shape the unsplit model's output has
    # print(model): where each cloud layer runs, then its settings as unsplit
    assert "(4): Linear(runs in the cloud: 4, in_features=16, out_features=3, bias=True)" in repr(model)


def _pair(inproc_cloud, script, rejoin=4):
    local = mlp()
    script(local, local, nn.CrossEntropyLoss())
    net = mlp()
    model = splitft.split(net, 2, rejoin, factory=MLP, connect=inproc_cloud.connect, faults=splitft.Faults(heartbeat=0))
    with model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        script(model, net, crit)
        return model.state_dict(), local.state_dict()


MIRRORED_SCRIPTS = {
    "zero_grad": lambda model, net, crit, opt, x, y: (crit(model(x), y).backward(), model.zero_grad(),
                                                      crit(model(x[:4]), y[:4]).backward(), opt.step()),
    "requires_grad_": lambda model, net, crit, opt, x, y: (model.requires_grad_(False), net[0].requires_grad_(True),
                                                           crit(model(x), y).backward(), opt.step()),
    # fn runs on every module, the cloud half's ghosts too: what it does to their tensors reaches the cloud
    "apply": lambda model, net, crit, opt, x, y: (
        model.apply(lambda m: (nn.init.zeros_(m.bias), m.weight.data.fill_(0.05)) if isinstance(m, nn.Linear) else None),
        crit(model(x), y).backward(), opt.step()),
    "optimizer.add_param_group": lambda model, net, crit, opt, x, y: (
        opt.add_param_group({"params": list(net[2].parameters()), "lr": 0.05}), crit(model(x), y).backward(),
        opt.step()),
    "optimizer.load_state_dict": lambda model, net, crit, opt, x, y: (
        opt.load_state_dict({**opt.state_dict(), "param_groups": [{**g, "lr": 0.3} for g in opt.state_dict()["param_groups"]]}),
        crit(model(x), y).backward(), opt.step()),
}


@pytest.mark.parametrize("name", sorted(MIRRORED_SCRIPTS))
def test_a_mirrored_method_does_the_same_to_the_cloud_half(inproc_cloud, name):
    x, y = _data(1)[0]

    def script(model, net, crit):
        params = model.parameters() if name != "optimizer.add_param_group" else \
            [p for n, p in model.named_parameters() if not n.startswith("2.")]
        opt = torch.optim.SGD(params, lr=0.1)
        MIRRORED_SCRIPTS[name](model, net, crit, opt, x, y)
        opt.step()  # a second step: the mirrored state carries on

    split, local = _pair(inproc_cloud, script)
    assert_same(split, local)


class _Classifier(nn.Sequential):
    """A user's model with a method of its own named like the split model's."""

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).argmax(-1)


def test_a_method_of_the_users_model_named_like_the_split_models_is_named_in_a_warning_at_split(inproc_cloud):
    """``model.predict`` on the split model is the split model's (the whole model's output), not a
    method of the same name on the user's class: split() says so, pointing at ``model.wrapped``."""
    with pytest.warns(splitft.errors.HiddenAttributeWarning, match=r"_Classifier has 'predict'.*model\.wrapped\.predict") as caught:
        model = splitft.split(_Classifier(*mlp()), 2, factory=MLP, connect=inproc_cloud.connect)
    assert caught[0].filename == __file__  # where the script called split()
    with model:
        assert model.wrapped.predict.__func__ is _Classifier.predict
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a model without such a name splits without a word
        splitft.split(mlp(), 2, factory=MLP, connect=inproc_cloud.connect).close()
