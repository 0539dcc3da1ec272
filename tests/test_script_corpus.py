"""Training scripts in the styles people write, each run on the unsplit model and split against a
real cloud process (real ZeroMQ): the final full state_dict must be equal.

Each script gets ``model`` (what it trains: the unsplit model, or the split one) and ``net`` (the
module the user built and kept a reference to; for the split run it holds ghosts of the cloud
modules), and uses them only the way an ordinary script does.
"""

from __future__ import annotations

import copy
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import splitft
from splitft.errors import ConfigError, UnfinishedForwardError
from tests.conftest import start_cloud, stop
from tests.models import mlp, mlp_dropout
from tests.test_faults import _data, assert_same

MLP = "tests.models:mlp"
BATCH_LIMITED = "tests.models:batch_limited_mlp"
DIGITS = "splitft.app.models:digits_cnn"
MLP_DROPOUT = "tests.models:mlp_dropout"


def assert_bitwise(split: dict, local: dict) -> None:
    """The same keys, and every tensor equal to the last bit: the split run did the unsplit run's arithmetic."""
    assert set(split) == set(local)
    different = {k: float((split[k].double() - local[k].double()).abs().max()) for k in local
                 if not torch.equal(split[k], local[k])}
    assert not different, f"differ (largest difference per tensor): {different}"


def _layer(name: str) -> int:
    """The Sequential index of a parameter name."""
    return int(name.split(".")[0])


def groups_and_warmup(model, net, crit, data):
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=2e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        sched.step()


def layerwise_lr_decay(model, net, crit, data):
    groups: dict[int, list] = {}
    for name, param in model.named_parameters():
        groups.setdefault(_layer(name), []).append(param)
    opt = torch.optim.SGD([{"params": ps, "lr": 0.4 * 0.5 ** (4 - layer)} for layer, ps in groups.items()],
                          lr=0.1, momentum=0.9)
    for x, y in data:
        crit(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad(set_to_none=False)


def accumulation_zero_grad_and_clip(model, net, crit, data):
    """model.zero_grad(set_to_none=False), two micro-batches per step, clipping by the global norm."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    norms = []
    for x, y in data:
        model.zero_grad(set_to_none=False)
        for part in torch.chunk(torch.arange(len(y)), 2):
            (crit(model(x[part]), y[part]) / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.2)))
        opt.step()
    assert max(norms) > 0.2  # the clipping bites


def one_cycle_with_momentum(model, net, crit, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.5, total_steps=len(data))  # cycles momentum too
    for x, y in data:
        model.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        sched.step()


def freeze_by_name_mid_training(model, net, crit, data):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(data):
        if i == 2:
            for name, param in model.named_parameters():
                if _layer(name) == 2:  # a layer that runs in the cloud when split
                    param.requires_grad_(False)
        if i == 4:
            net[4].requires_grad_(False)  # by the module, through the user's own reference
            net[2].requires_grad_(True)
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def trainable_only_optimizer(model, net, crit, data):
    net[2].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], 0.3)
        opt.step()


def eval_between_steps(model, net, crit, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for x, y in data:
        model.train()
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        model.eval()
        with torch.inference_mode():
            model(x)
        with torch.no_grad():
            model(x)


def fp16_with_grad_scaler(model, net, crit, data):
    """Loss scaling starting far too high: the first steps overflow and are skipped."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 22, growth_interval=100)
    scales = []
    for x, y in data * 2:
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = crit(model(x), y)
        scaler.scale(loss).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    assert scales[-1] < 2.0 ** 22  # steps were skipped (and the weights checked to move: others were taken)


def zero_grad_by_hand_and_clip_through_grad_data(model, net, crit, data):
    """The old idioms: ``p.grad = None`` or ``del p.grad`` per parameter, ``p.grad.data.clamp_``
    (DQN-style clipping)."""
    opt = torch.optim.RMSprop(model.parameters(), lr=1e-2)
    for x, y in data:
        for i, p in enumerate(model.parameters()):
            if i % 2:
                p.grad = None
            else:
                del p.grad
        crit(model(x), y).backward()
        for p in model.parameters():
            p.grad.data.clamp_(-0.02, 0.02)
        opt.step()


def clip_in_two_steps_with_foreach(model, net, crit, data):
    """torch's newer split API (total norm, then clip with it), foreach kernels asked for, an inf norm."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    norms = []
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        torch.nn.utils.clip_grads_with_norm_(model.parameters(), 0.2, norm, foreach=True)
        norms.append(norm.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1, norm_type=float("inf")).item())
        opt.step()
    return norms  # bitwise the unsplit model's


def logs_each_layers_gradient_norm(model, net, crit, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    logged = []
    for x, y in data:
        opt.zero_grad(set_to_none=False)
        crit(model(x), y).backward()
        logged.append({n: p.grad.norm().item() for n, p in model.named_parameters()})
        opt.step()
    return logged


def averages_accumulated_gradients_by_hand(model, net, crit, data):
    """Two backward passes summed, then ``p.grad.div_(2)`` and ``mul_``: the gradients' own in-place math."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5)
    for x, y in data:
        opt.zero_grad()
        for part in torch.chunk(torch.arange(len(y)), 2):
            crit(model(x[part]), y[part]).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad.div_(2).mul_(1.5)
        opt.step()


def averages_with_in_place_operators(model, net, crit, data):
    """``p.grad /= accumulation`` and ``p.grad *= ...``: Python's in-place operators assign the
    gradient back to ``p.grad`` (the same tensor); that assignment used to be refused."""
    opt = torch.optim.SGD(model.parameters(), lr=0.2)
    for x, y in data:
        opt.zero_grad()
        for part in torch.chunk(torch.arange(len(y)), 3):
            crit(model(x[part]), y[part]).backward()
        for p in model.parameters():
            if p.grad is not None:
                p.grad /= 3
                p.grad *= 1.5
        opt.step()


def a_new_optimizer_for_each_stage(model, net, crit, data):
    """Stage one trains everything with Adam; stage two builds a new optimizer, SGD with momentum
    over the last layers only (the first one is dropped, its moments with it)."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(data):
        if i == 3:
            opt = torch.optim.SGD([*net[2].parameters(), *net[4].parameters()], lr=0.05, momentum=0.9)
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def reinitialises_with_initialisers_that_read_their_draws(model, net, crit, data):
    """``trunc_normal_`` (a ViT's init: it rejects draws outside its bounds), ``orthogonal_`` (a QR of
    its draws), ``eye_`` and ``sparse_``, by module walk and by index, from torch's generator and
    from one of the script's: on the cloud's layers they used to be refused."""
    torch.manual_seed(5)
    gen = torch.Generator().manual_seed(11)

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02, a=-0.03, b=0.03)

    model.apply(init)
    nn.init.orthogonal_(model[2].weight, generator=gen)
    nn.init.sparse_(model[4].weight, 0.5, std=0.05, generator=gen)
    nn.init.eye_(model[0].weight)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def learning_rate_set_by_hand_and_frozen_by_attribute(model, net, crit, data):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    for i, (x, y) in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * (0.5 ** i)
        if i == 3:
            for name, p in model.named_parameters():
                if _layer(name) == 2:
                    p.requires_grad = False  # the attribute, not requires_grad_()
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def one_optimizer_over_two_models(model, net, crit, data):
    """A second, local model (a probe) trained by the same optimizer as the (split) model."""
    probe = mlp(seed=7, width=8)
    opt = torch.optim.Adam([*model.parameters(), *probe.parameters()], lr=1e-2)
    for x, y in data:
        opt.zero_grad()
        (crit(model(x), y) + probe(x).pow(2).mean()).backward()
        torch.nn.utils.clip_grad_norm_([*model.parameters(), *probe.parameters()], 0.5)
        opt.step()
    return [p.detach().clone() for p in probe.parameters()]


def loads_a_cloud_layer_by_hand_mid_training(model, net, crit, data):
    """``load_state_dict`` of one layer and ``nn.init`` over a module walk: new values reach the cloud."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        if i == 2:
            net[2].load_state_dict({k: v * 0.5 for k, v in mlp(seed=3)[2].state_dict().items()})
            with torch.no_grad():
                for module in model.modules():
                    if isinstance(module, nn.Linear):
                        nn.init.zeros_(module.bias)
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def edge_gradients_alone_by_autograd_grad_and_restricted_backward(model, net, crit, data):
    """The first layer's gradient read with ``autograd.grad`` (a probe: nothing accumulates), and on
    odd steps a backward restricted to it with ``inputs=`` (the rest keep last step's gradients),
    no ``zero_grad`` between: the cloud half's parameters must accumulate exactly as unsplit."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    first = list(net[0].parameters())
    norms = []
    for i, (x, y) in enumerate(data):
        grads = torch.autograd.grad(crit(model(x), y), first)
        norms.append(torch.linalg.vector_norm(grads[0]).item())
        if i % 2:
            crit(model(x), y).backward(inputs=first)
        else:
            crit(model(x), y).backward()
        opt.step()
    return norms


def accumulates_over_three_with_a_weighted_loss(model, net, crit, data):
    """``loss / 3`` over three micro-batches, one of them weighted 0.7 more: the cloud's gradients,
    computed for a loss gradient of 1 and scaled after, would be an ulp from the unsplit model's
    (Adam's step makes an ulp show)."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in data:
        opt.zero_grad()
        for i, part in enumerate(torch.chunk(torch.arange(len(y)), 3)):
            (crit(model(x[part]), y[part]) / 3 * (0.7 if i == 1 else 1.0)).backward()
        opt.step()


def three_views_in_one_loss_accumulated_over_three_batches(model, net, crit, data):
    """One loss over three views of a batch (three forward calls, one backward), gradients kept over
    three batches: torch sums what one backward pass brings a parameter before adding it to
    ``p.grad``, so the cloud must too, in the engine's order."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(data):
        (crit(model(x), y) + crit(model(x * 0.5), y) + crit(model(-x), y)).backward()
        if i % 3 == 2:
            opt.step()
            opt.zero_grad()


def reinitialises_by_module_walk_and_by_index(model, net, crit, data):
    """A fresh start after building: torch's initialisers by module walk (random draws, and a
    counter that numbers the layers in the order the walk reaches them), then the head re-drawn
    the way transformers' _init_weights does, reached by index as in an nn.Sequential."""
    torch.manual_seed(3)
    layer = iter(range(10))

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.kaiming_uniform_(module.weight, a=5 ** 0.5) if next(layer) % 2 else nn.init.xavier_normal_(module.weight)
            with torch.no_grad():
                module.bias.fill_(0.01 * next(layer))

    model.apply(init)
    model[-1].weight.data.normal_(mean=0.0, std=0.02)
    model[len(model) - 1].bias.data.zero_()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def initialises_and_groups_layers_by_their_class(model, net, crit, data):
    """The forum's ``init_weights``: ``if type(m) == nn.Linear`` over ``model.apply``, biases zeroed
    where ``m.__class__ in (nn.Linear, nn.Conv2d)``, and weight decay per layer picked from a dict
    keyed by the layer's class, as a training config maps classes to settings."""
    def init_weights(m):
        if type(m) == nn.Linear:
            nn.init.constant_(m.weight, 0.05)
        if m.__class__ in (nn.Linear, nn.Conv2d):
            nn.init.zeros_(m.bias)

    model.apply(init_weights)
    decay_of = {nn.Linear: 0.1, nn.Conv2d: 0.05}
    groups: dict[float, list] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            groups.setdefault(decay_of.get(type(m), 0.0), []).append(p)
    opt = torch.optim.AdamW([{"params": ps, "weight_decay": wd} for wd, ps in groups.items()], lr=0.01)
    for x, y in data:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()


def keeps_buffers_of_its_own_where_each_weight_is(model, net, crit, data):
    """Buffers made where each weight is (``torch.zeros(p.shape, device=p.device)``, a gradient
    mask drawn ``device=p.device``), every weight moved to its own device first (``p.data =
    p.data.to(p.device)``, which changes nothing), and an Adagrad written by hand over them."""
    for p in model.parameters():
        p.data = p.data.to(p.device)
    draws = torch.Generator().manual_seed(0)
    masks = {n: (torch.rand(p.shape, generator=draws, device=p.device) > 0.2).float() for n, p in model.named_parameters()}
    sums = {n: torch.zeros(p.shape, device=p.device) for n, p in model.named_parameters()}
    for x, y in data:
        crit(model(x), y).backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.grad.mul_(masks[n])
                sums[n].add_(p.grad ** 2)
                p.sub_(0.1 * p.grad / (sums[n].sqrt() + 1e-8))
                p.grad = None


def moves_batches_and_class_weights_to_a_layers_device(model, net, crit, data):
    """``device = net[2].weight.device`` (a layer in the cloud half): the batches and the loss's class
    weights moved there, as a script that runs wherever its model was put does."""
    device = net[2].weight.device
    weighted = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0, 0.5]).to(device))
    if isinstance(crit, nn.CrossEntropyLoss):  # U-shape: the script's own loss
        crit = weighted
    else:  # plain split: the loss runs in the cloud, with the same weights
        crit = model.remote_loss(weighted)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in data:
        crit(model(x.to(device)), y.to(device)).backward()
        opt.step()
        opt.zero_grad()


def unfreezes_layers_as_it_goes_with_add_param_group(model, net, crit, data):
    net[0].requires_grad_(False)
    net[4].requires_grad_(False)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for i, (x, y) in enumerate(data):
        if i == 2:  # the head, at a lower rate (a cloud layer in a plain split, the edge's in a U-shape)
            net[4].requires_grad_(True)
            opt.add_param_group({"params": net[4].parameters(), "lr": 5e-3})
        if i == 4:  # then the first layer (the edge's), without weight decay
            net[0].requires_grad_(True)
            opt.add_param_group({"params": list(net[0].parameters()), "lr": 2e-3, "weight_decay": 0.0})
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    return [(g["lr"], g["weight_decay"], len(g["params"])) for g in opt.param_groups]


def scales_and_clips_gradients_in_an_optimizer_pre_hook(model, net, crit, data):
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def halve_then_clip(optimizer, args, kwargs):
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(0.5)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)

    opt.register_step_pre_hook(halve_then_clip)
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def warms_up_in_a_pre_hook_and_logs_gradient_norms_in_a_post_hook(model, net, crit, data):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    norms, taken = [], [0]

    def warm_up(optimizer, args, kwargs):
        taken[0] += 1
        for group in optimizer.param_groups:
            group["lr"] = 0.05 * min(1.0, taken[0] / 3)

    opt.register_step_pre_hook(warm_up)
    opt.register_step_post_hook(lambda optimizer, args, kwargs: norms.append(
        [p.grad.norm().item() for group in optimizer.param_groups for p in group["params"]]))
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    return norms


def a_head_at_its_own_rate_and_the_first_layer_frozen_picked_by_name(model, net, crit, data):
    for name, param in model.named_parameters():
        if name.split(".")[0] == "0":
            param.requires_grad = False
    head = [p for n, p in model.named_parameters() if n.startswith("4.")]
    body = [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("4.")]
    opt = torch.optim.SGD([{"params": body}, {"params": head, "lr": 0.3}], lr=0.05, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
    return ([n for n, _ in model.named_parameters()], [n for n, _ in model.named_modules()],
            [len(group["params"]) for group in opt.param_groups])


def restarts_adam_at_each_warm_restart(model, net, crit, data):
    """Warm restarts of the learning rate, and the optimizer's moments dropped at each one."""
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    sched = torch.optim.lr_scheduler.CosineAnnealingWarmRestarts(opt, T_0=2)
    for i, (x, y) in enumerate(data):
        if i and i % 2 == 0:
            opt.state.clear()
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        sched.step()


def deep_supervision_heads_on_the_layer_before_the_cut(model, net, crit, data):
    """Two auxiliary heads on the output of the last layer before the cut (caught by a forward
    hook), their losses added around the main one: the activation's gradient sums the heads' and
    the cloud's in the unsplit model's order, so the first layer's gradient is its own bitwise."""
    torch.manual_seed(9)
    heads = [nn.Linear(16, 3), nn.Linear(16, 3)]
    caught = {}
    handle = net[1].register_forward_hook(lambda module, args, out: caught.__setitem__("h", out))
    opt = torch.optim.SGD([*model.parameters(), *(p for head in heads for p in head.parameters())], lr=0.05)
    grads = []
    for x, y in data:
        out = model(x)
        h = caught["h"]
        loss = 0.3 * F.cross_entropy(heads[0](h), y) + crit(out, y) + 0.7 * F.cross_entropy(heads[1](h), y)
        loss.backward()
        grads.append(net[0].weight.grad.clone())
        opt.step()
        opt.zero_grad()
    handle.remove()
    return grads


def trains_with_a_focal_loss_of_its_own_on_the_whole_output(model, net, crit, data):
    """A loss the cloud cannot build by name (a focal loss written as a function), computed on the
    edge from the whole model's output: a plain split's ``model.predict(x)``, unsplit ``model(x)``."""
    forward = getattr(model, "predict", model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in data:
        logp = torch.nn.functional.log_softmax(forward(x), -1).gather(1, y[:, None]).squeeze(1)
        (-(1 - logp.exp()) ** 2 * logp).mean().backward()
        opt.step()
        opt.zero_grad()


def restores_a_best_state_kept_without_copies(model, net, crit, data):
    """Early stopping that keeps the live tensors instead of copies (``{n: p.data}``,
    ``state_dict(keep_vars=True)``): loading them back copies each weight onto itself, which
    changes nothing (split, it raised for a NumPy array)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            best = {name: p.data for name, p in model.named_parameters()}
            kept = model.state_dict(keep_vars=True)
    model.load_state_dict(best)
    model.load_state_dict(kept)


def trains_through_functional_call_with_its_own_parameters(model, net, crit, data):
    """``functional_call(model, dict(model.named_parameters()), (x,))``: the cloud's own tensors put
    back in their places change nothing, so the call is the model's forward, as unsplit."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = dict(model.named_parameters())
    for x, y in data:
        opt.zero_grad()
        crit(torch.func.functional_call(model, params, (x,)), y).backward()
        opt.step()


SCRIPTS = [a_head_at_its_own_rate_and_the_first_layer_frozen_picked_by_name,
           scales_and_clips_gradients_in_an_optimizer_pre_hook,
           warms_up_in_a_pre_hook_and_logs_gradient_norms_in_a_post_hook,
           initialises_and_groups_layers_by_their_class, keeps_buffers_of_its_own_where_each_weight_is,
           moves_batches_and_class_weights_to_a_layers_device,
           unfreezes_layers_as_it_goes_with_add_param_group, accumulation_zero_grad_and_clip, reinitialises_by_module_walk_and_by_index, accumulates_over_three_with_a_weighted_loss,
           three_views_in_one_loss_accumulated_over_three_batches, groups_and_warmup, layerwise_lr_decay, one_cycle_with_momentum, freeze_by_name_mid_training,
           trainable_only_optimizer, eval_between_steps, fp16_with_grad_scaler,
           zero_grad_by_hand_and_clip_through_grad_data, clip_in_two_steps_with_foreach, logs_each_layers_gradient_norm,
           averages_accumulated_gradients_by_hand, averages_with_in_place_operators, a_new_optimizer_for_each_stage,
           reinitialises_with_initialisers_that_read_their_draws,
           learning_rate_set_by_hand_and_frozen_by_attribute,
           one_optimizer_over_two_models, loads_a_cloud_layer_by_hand_mid_training,
           edge_gradients_alone_by_autograd_grad_and_restricted_backward, restarts_adam_at_each_warm_restart,
           deep_supervision_heads_on_the_layer_before_the_cut,
           trains_through_functional_call_with_its_own_parameters,
           trains_with_a_focal_loss_of_its_own_on_the_whole_output,
           restores_a_best_state_kept_without_copies]


def adds_a_head_by_attribute_and_counts_steps_in_a_buffer(model, net, crit, data):
    torch.manual_seed(5)
    model.aux = nn.Linear(3, 3)  # a head added to the model the script has, after it was built
    model.register_buffer("steps_seen", torch.zeros((), dtype=torch.long))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        crit(model.aux(model(x)), y).backward()
        opt.step()
        model.steps_seen += 1
    return [n for n, _ in model.named_parameters()], int(model.steps_seen)


def adds_a_head_with_add_module_and_trains_it_alone_at_the_end(model, net, crit, data):
    torch.manual_seed(6)
    model.add_module("probe", nn.Linear(3, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in data[:4]:
        opt.zero_grad()
        crit(model.probe(model(x)), y).backward()
        opt.step()
    del model.probe  # dropped again, as unsplit
    return sorted(model.state_dict())


@pytest.mark.parametrize("script", [adds_a_head_by_attribute_and_counts_steps_in_a_buffer,
                                    adds_a_head_with_add_module_and_trains_it_alone_at_the_end],
                         ids=lambda f: f.__name__)
def test_what_a_script_adds_to_the_split_model_is_in_the_model_it_split(cloud, script):
    """A head, a buffer set on the split model (U-shape: its output is the model's): in its
    parameters(), its state_dict() and its forward, as on the unsplit model."""
    data = _data(6)
    local = mlp()
    expected = script(local, local, nn.CrossEntropyLoss(), data)
    net = mlp()
    model = splitft.split(net, 2, 4, factory=MLP, connect=cloud)
    with model:
        got = script(model, net, nn.CrossEntropyLoss(), data)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())
    assert got == expected


# ---------------------------------------------------------------- what a script computes from cloud tensors


def skips_a_step_whose_gradients_are_not_finite(model, net, crit, data):
    """A NaN guard: the step of a batch whose loss overflowed is skipped, the batch counted."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    skipped = 0
    for i, (x, y) in enumerate(data):
        (crit(model(x), y) * (float("inf") if i == 2 else 1.0)).backward()
        if any(not torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None):
            opt.zero_grad()
            skipped += 1
            continue
        opt.step()
        opt.zero_grad()
    assert skipped == 1
    return skipped


def sign_sgd_with_weight_decay_added_to_the_gradient(model, net, crit, data):
    """signSGD, and L2 weight decay the old way: ``p.grad.add_(p.data, alpha=wd)`` before the step."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    for i, (x, y) in enumerate(data):
        crit(model(x), y).backward()
        for p in model.parameters():
            if i % 2:
                p.grad.sign_()
            else:
                p.grad.add_(p.data, alpha=1e-2)
        opt.step()
        opt.zero_grad()


def logs_the_largest_gradient_and_the_weight_norm(model, net, crit, data):
    """What a training log prints each step, read from every parameter."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    for x, y in data:
        crit(model(x), y).backward()
        logged.append(max(p.grad.abs().max().item() for p in model.parameters()))
        opt.step()
        opt.zero_grad()
        logged.append(float(torch.sqrt(sum((p.detach() ** 2).sum() for p in model.parameters()))))
    return logged


def prunes_by_magnitude_and_logs_sparsity_with_gradients_on(model, net, crit, data):
    """Magnitude pruning by hand after each step, and the log line that counts the zeros, written
    without torch.no_grad() (a comparison builds no graph, so torch computes it with gradients on)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    for x, y in data:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(p.abs() > p.abs().median())
        logged.append([int((p == 0).sum()) for p in model.parameters()])
        logged.append([bool(torch.isfinite(p).all()) and int(p.ne(0).count_nonzero()) for p in model.parameters()])
    return logged


def renormalises_rows_and_perturbs_weights_after_each_step(model, net, crit, data):
    """Max-norm regularisation of a layer's rows, and weight noise from the global generator."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    torch.manual_seed(3)
    for x, y in data:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            w = net[2].weight
            w.div_(w.norm(dim=1, keepdim=True).clamp_min(1.0))
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 1e-3)
            for p in model.parameters():
                p.data.mul_(0.999)  # weight decay by hand on .data


def steps_by_hand_as_old_tutorials_do(model, net, crit, data):
    """No optimizer: ``p.data -= lr * p.grad.data`` (Python sets ``p.data`` to what the in-place
    operator returned), ``p -= lr * p.grad`` under ``no_grad``, gradients zeroed through ``.data``."""
    for i, (x, y) in enumerate(data):
        crit(model(x), y).backward()
        for p in model.parameters():
            if i % 2:
                p.data -= 0.1 * p.grad.data
                p.grad.data.zero_()
            else:
                with torch.no_grad():
                    p -= 0.1 * p.grad
                p.grad.data *= 0.0


def keeps_an_average_of_the_weights_and_evaluates_with_it(model, net, crit, data):
    """An exponential moving average of every weight, kept in a dict of clones and updated with
    ``mul_().add_(p, alpha=...)``; the model evaluated with it loaded, then trained on."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    average = {name: p.detach().clone() for name, p in model.named_parameters()}
    for x, y in data[:-1]:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for name, p in model.named_parameters():
                average[name].mul_(0.9).add_(p.detach(), alpha=0.1)
    kept = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(average[name])
    model.eval()
    with torch.no_grad():
        evaluated = round(float(crit(model(data[-1][0]), data[-1][1])), 6)
    model.train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(kept[name])
    crit(model(data[-1][0]), data[-1][1]).backward()
    opt.step()
    return [evaluated, *(round(float(v.sum()), 6) for v in average.values())]


def momentum_and_an_average_by_hand_in_buffers_made_like_the_weights(model, net, crit, data):
    """SGD with momentum written out, its buffers and an EMA's made with ``torch.zeros_like(p)``
    (the script's own tensors, as unsplit) and updated from each weight and gradient."""
    params = list(model.parameters())
    momenta = [torch.zeros_like(p) for p in params]
    average = [torch.zeros_like(p, memory_format=torch.preserve_format) for p in params]
    for x, y in data:
        for p in params:
            p.grad = None
        crit(model(x), y).backward()
        with torch.no_grad():
            for p, m, a in zip(params, momenta, average):
                m.mul_(0.9).add_(p.grad)
                p.add_(m, alpha=-0.05)
                a.mul_(0.8).add_(p, alpha=0.2)
    return [a.clone() for a in average]


def steps_by_hand_with_foreach_kernels(model, net, crit, data):
    """SGD written with torch's foreach kernels over the parameter list, as fused optimizers are:
    NaNs in the gradients zeroed, weight decay added to them, the decay of the weights decoupled."""
    params = list(model.parameters())
    for x, y in data:
        for p in params:
            p.grad = None
        crit(model(x), y).backward()
        grads = [p.grad for p in params]
        with torch.no_grad():
            for g in grads:
                torch.nan_to_num_(g, nan=0.0)
            torch._foreach_add_(grads, params, alpha=1e-3)
            torch._foreach_mul_(params, 0.999)
            torch._foreach_add_(params, grads, alpha=-0.05)
    return [round(float(p.detach().sum()), 6) for p in params]


def lookahead_with_slow_weights_cloned_then_detached(model, net, crit, data):
    """Lookahead: slow weights kept as ``p.clone().detach()`` (with gradients on), pulled toward
    the fast ones every second step, which then restart from them."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    params = list(model.parameters())
    slow = [p.clone().detach() for p in params]
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        if i % 2 == 1:
            with torch.no_grad():
                for p, s in zip(params, slow):
                    s.add_(p - s, alpha=0.5)
                    p.copy_(s)
    return [round(float(s.sum()), 6) for s in slow]


def lookahead_writing_its_slow_weights_with_gradients_on(model, net, crit, data):
    """Lookahead as a library writes it, with no ``torch.no_grad()``: the fast weights pulled toward
    the slow ones through ``.data``, then ``slow.data.copy_(fast)`` reads a trainable weight."""
    params = list(model.parameters())
    opt = torch.optim.Adam(params, lr=1e-2)
    slow = [torch.clone(p.data).detach() for p in params]
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        if i % 2 == 1:
            for fast, s in zip(params, slow):
                fast.data.mul_(0.5).add_(s, alpha=0.5)
                s.data.copy_(fast)
    return [round(float(s.sum()), 6) for s in slow]


def sharpness_aware_steps_restoring_weights_by_data_assignment(model, net, crit, data):
    """SAM as its popular implementation writes it: climb to the worst nearby weights, keep the old
    ones as ``p.data.clone()``, and after the second backward put them back with ``p.data = old``."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    old: dict = {}
    for x, y in data:
        crit(model(x), y).backward()
        with torch.no_grad():
            norm = torch.norm(torch.stack([p.grad.norm(2) for p in params]), 2)
            for p in params:
                old[p] = p.data.clone()
                p.add_(p.grad * (0.05 / (norm + 1e-12)))
        opt.zero_grad()
        crit(model(x), y).backward()
        for p in params:
            p.data = old[p]
        opt.step()
        opt.zero_grad()
    return [round(float(o.sum()), 6) for o in old.values()]


class _SharpnessAware(torch.optim.Optimizer):
    """A SAM optimizer as research code writes one: an ``Optimizer`` over the base optimizer's own
    parameter groups, whose ``step(closure)`` climbs, recomputes the loss, comes back and steps the
    base optimizer."""

    def __init__(self, params, base: type[torch.optim.Optimizer], rho: float = 0.05, **settings) -> None:
        super().__init__(params, dict(rho=rho, **settings))
        self.base = base(self.param_groups, **settings)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
        norm = torch.norm(torch.stack([p.grad.norm(2) for p in params]), 2)
        for p in params:
            self.state[p]["climb"] = p.grad * (self.param_groups[0]["rho"] / (norm + 1e-12))
            p.add_(self.state[p]["climb"])
        self.zero_grad()
        with torch.enable_grad():
            loss = closure()
        for p in params:
            p.sub_(self.state[p]["climb"])
        self.base.step()
        return loss


def sharpness_aware_steps_by_a_wrapper_optimizer_with_a_closure(model, net, crit, data):
    """SAM's closure form: ``opt.step(closure)`` on an optimizer that wraps a torch.optim one."""
    opt = _SharpnessAware(model.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    losses = []
    for x, y in data:
        def closure():
            loss = crit(model(x), y)
            loss.backward()
            return loss

        closure()
        losses.append(opt.step(closure).item())
        opt.zero_grad()
    return losses


def normalises_each_gradient_by_its_norm_with_foreach_kernels(model, net, crit, data):
    """Per-layer gradient normalisation over the whole parameter list with torch's foreach kernels:
    each gradient divided by its own norm, then scaled by a number of its own (a layer-wise rate)."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        grads = [p.grad for p in params]
        with torch.no_grad():
            torch._foreach_div_(grads, [n + 1e-6 for n in torch._foreach_norm(grads)])
            torch._foreach_mul_(grads, [0.5 + 0.1 * i for i in range(len(grads))])
        opt.step()


def logs_the_global_gradient_norm_and_similarity_of_flattened_gradients(model, net, crit, data):
    """The global gradient norm and the cosine similarity of successive gradients, computed over the
    gradients flattened into one vector (``p.grad.view(-1)``, ``flatten()``, ``parameters_to_vector``),
    then a step (GEM-style loggers); returns what it logged."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    logged, previous = [], None
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        flat = torch.cat([p.grad.view(-1) for p in params])
        logged.append(flat.norm().item())
        logged.append(torch.cat([p.grad.flatten() for p in params]).abs().max().item())
        vector = torch.nn.utils.parameters_to_vector([p.grad for p in params])
        if previous is not None:
            logged.append(F.cosine_similarity(vector, previous, dim=0).item())
        previous = vector.clone()
        opt.step()
    return logged


def reptile_meta_steps_by_data_assignment(model, net, crit, data):
    """Reptile: a few inner steps, then each weight moved part of the way from where it started
    toward where they took it, written as ``p.data = start + eps * (p.data - start)``."""
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    for task in (data[:3], data[3:]):
        start = [p.data.clone() for p in params]
        for x, y in task:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
        for p, s in zip(params, start):
            p.data = s + 0.5 * (p.data - s)


def averages_weights_in_an_optimizer_post_hook(model, net, crit, data):
    """The same average, updated by ``torch._foreach_lerp_`` in a step post-hook (as EMA helpers do)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    params = list(model.parameters())
    shadow = [p.detach().clone() for p in params]

    def update(optimizer, args, kwargs):
        with torch.no_grad():
            torch._foreach_lerp_(shadow, [p.detach() for p in params], 0.2)

    opt.register_step_post_hook(update)
    for x, y in data:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return shadow


def logs_weight_and_gradient_statistics_moved_to_the_cpu(model, net, crit, data):
    """A logger's habit: every statistic read after ``.detach().cpu()`` or ``.to(p.device)`` (on the
    CPU, each is the tensor itself), the gradients' norms and largest entries, the weights' mean size."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    logged = []
    for x, y in data:
        crit(model(x), y).backward()
        with torch.no_grad():
            logged.append([p.grad.detach().cpu().norm().item() for p in model.parameters()])
            logged.append([p.grad.to(p.device).abs().max().item() for p in model.parameters()])
            logged.append([p.detach().cpu().abs().mean().item() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return logged


def resets_a_layer_with_tensors_made_like_its_weights(model, net, crit, data):
    """A layer set to fixed values mid-run by copying tensors made like its own
    (``w.copy_(torch.zeros_like(w))``, ``b.copy_(torch.full_like(b, 0.1))``), as a reset often reads."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            with torch.no_grad():
                layer = net[2]
                layer.weight.copy_(torch.zeros_like(layer.weight))
                layer.bias.copy_(torch.full_like(layer.bias, 0.1))


def prunes_small_weights_by_hand(model, net, crit, data):
    """Magnitude pruning as tutorials write it: ``p.data[p.data.abs() < t] = 0`` after a few steps,
    then the pruned entries' gradients zeroed the same way, ``p.grad[mask] = 0``, at every step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    masks: list = []
    for i, (x, y) in enumerate(data):
        crit(model(x), y).backward()
        for p, mask in zip(model.parameters(), masks):
            p.grad[mask] = 0
        opt.step()
        opt.zero_grad()
        if i == 2:
            with torch.no_grad():
                masks = [p.data.abs() < 0.05 for p in model.parameters()]
                for p, mask in zip(model.parameters(), masks):
                    p.data[mask] = 0
    return [int(mask.sum()) for mask in masks]


def writes_slices_and_indices_of_weights_and_gradients(model, net, crit, data):
    """Structured pruning and partial freezing by indexing: columns and rows zeroed by slice
    (``w[:, :3] = 0``, ``w[rows] = 0``), a row set from a tensor, ``index_fill_``, a slice of a
    gradient cleared before the step (``p.grad[:, :2] = 0``: the first columns never train)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    layer = net[2]
    for i, (x, y) in enumerate(data):
        crit(model(x), y).backward()
        layer.weight.grad[:, :2] = 0
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            layer.weight[:, 2:4] = 0
            layer.weight.data[i % 3] = torch.linspace(-1, 1, 16)
            layer.weight[torch.tensor([i % 2 == 0] * 8 + [False] * 8)] = 0.25
            layer.bias.index_fill_(0, torch.tensor([1, 5]), -0.5)
            layer.bias[..., 7] = torch.tensor(2.0)


def keeps_the_best_state_of_a_cloud_layer_and_restores_it(model, net, crit, data):
    """Early stopping of one layer: ``best = copy.deepcopy(net[2].state_dict())`` (also saved with
    ``torch.save``) after a few steps, loaded back into the layer at the end, as unsplit."""
    import copy
    import io

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    best, saved = None, io.BytesIO()
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        if i == 2:
            best = copy.deepcopy(net[2].state_dict())
            torch.save(net[2].state_dict(prefix="layer."), saved)
    net[2].load_state_dict(best)
    saved.seek(0)
    return [v.clone() for v in torch.load(saved).values()] + [v.clone() for v in best.values()]


def assigns_gradients_and_fills_in_missing_ones(model, net, crit, data):
    """``p.grad = ...`` by hand: a projection computed from the gradient (PCGrad's ``p.grad =
    projected``), an edge tensor, and once a layer is frozen the unused-parameter fill
    ``if p.grad is None: p.grad = torch.zeros_like(p)``, which Adam then steps with."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(data):
        if i == 3:
            net[2].requires_grad_(False)
        opt.zero_grad()
        crit(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                elif i % 2:
                    p.grad = p.grad - 0.5 * p.grad.clamp(min=0)
                else:
                    p.grad = torch.full(p.shape, 1e-3)
        opt.step()


def unfreezes_layers_not_yet_in_the_optimizer_found_by_torch_equal(model, net, crit, data):
    """A frozen backbone unfrozen after a step into a new parameter group, the parameters already in
    the optimizer left out by ``torch.equal`` with gradients on (Lightning's ``BaseFinetuning``), and
    the two halves compared with ``torch.allclose`` for a log line."""
    params = list(model.parameters())
    for p in params[:4]:
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in params if p.requires_grad], lr=1e-2)
    logged = []
    for step, (x, y) in enumerate(data):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if step == 1:
            fresh = [p for p in params if not any(torch.equal(p, q) for g in opt.param_groups for q in g["params"])]
            for p in fresh:
                p.requires_grad_(True)
            opt.add_param_group({"params": fresh, "lr": 1e-3})
        logged.append([torch.allclose(p, q) for p in params for q in params if p.shape == q.shape])
    return logged


def moves_the_optimizer_state_to_its_device_between_steps(model, net, crit, data):
    """``state[k] = state[k].to(device)`` for every state tensor, where it already is (what Lightning
    does at the end of every fit and when it restores a checkpoint), then training on."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for x, y in data:
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        for state in opt.state.values():
            for key, value in state.items():
                if key != "step":
                    state[key] = value.to(torch.device("cpu"), non_blocking=True)


COMPUTED = [resets_a_layer_with_tensors_made_like_its_weights, prunes_small_weights_by_hand,
            assigns_gradients_and_fills_in_missing_ones,
            keeps_the_best_state_of_a_cloud_layer_and_restores_it,
            writes_slices_and_indices_of_weights_and_gradients, logs_weight_and_gradient_statistics_moved_to_the_cpu,
            skips_a_step_whose_gradients_are_not_finite, sign_sgd_with_weight_decay_added_to_the_gradient,
            logs_the_largest_gradient_and_the_weight_norm, renormalises_rows_and_perturbs_weights_after_each_step,
            prunes_by_magnitude_and_logs_sparsity_with_gradients_on,
            steps_by_hand_as_old_tutorials_do, keeps_an_average_of_the_weights_and_evaluates_with_it,
            averages_weights_in_an_optimizer_post_hook,
            momentum_and_an_average_by_hand_in_buffers_made_like_the_weights, steps_by_hand_with_foreach_kernels,
            lookahead_with_slow_weights_cloned_then_detached,
            unfreezes_layers_not_yet_in_the_optimizer_found_by_torch_equal,
            moves_the_optimizer_state_to_its_device_between_steps,
            lookahead_writing_its_slow_weights_with_gradients_on,
            sharpness_aware_steps_restoring_weights_by_data_assignment, reptile_meta_steps_by_data_assignment,
            sharpness_aware_steps_by_a_wrapper_optimizer_with_a_closure,
            normalises_each_gradient_by_its_norm_with_foreach_kernels,
            logs_the_global_gradient_norm_and_similarity_of_flattened_gradients]


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", MLP,
                                     "--model", DIGITS, "--model", MLP_DROPOUT, "--model", BATCH_LIMITED,
                                     "--model", "tests.models:mlp_dropout_everywhere",
                                     "--model", "tests.models:lambda_block_mlp", "--model", "tests.models:root_dropout_net",
                                     "--model", "tests.models:detached_probe_mlp", "--model", "tests.models:aux_out_net",
                                     "--model", "tests.models:self_attention_net")
    yield address
    stop(proc)


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda f: f.__name__)
def test_a_script_trains_split_exactly_as_locally(cloud, script, rejoin):
    _trains_exactly_as_locally(cloud, script, rejoin)


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("script", COMPUTED, ids=lambda f: f.__name__)
def test_what_a_script_computes_from_cloud_tensors_is_computed_in_the_cloud(cloud, script, rejoin):
    """Torch calls on cloud gradients and weights (a NaN guard, sign SGD, values logged, rows
    rescaled) are computed in the cloud with the same functions: the unsplit run's values, bitwise."""
    _trains_exactly_as_locally(cloud, script, rejoin)


def _trains_exactly_as_locally(cloud, script, rejoin):
    data = _data(6)
    local = mlp()
    expected = script(local, local, nn.CrossEntropyLoss(), data)
    net = mlp()
    model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud)
    with model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        got = script(model, net, crit, data)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())
    assert any(not torch.equal(v, mlp().state_dict()[k]) for k, v in state.items())  # it trained
    if isinstance(expected, list) and expected and isinstance(expected[0], torch.Tensor):
        assert all(torch.equal(a, b) for a, b in zip(got, expected))
    else:
        assert got == expected  # what the script read along the way (norms it logged), to the last bit


@pytest.mark.parametrize("loss", [nn.functional.cross_entropy, nn.functional.multi_margin_loss],
                         ids=lambda f: f.__name__)
def test_a_functional_loss_as_the_remote_loss_computes_what_it_computes_unsplit(cloud, loss):
    """``model.remote_loss(F.cross_entropy)``: the cloud computes the torch.nn loss that calls it with
    its defaults, so training is bitwise the unsplit script's ``F.cross_entropy(model(x), y)``."""
    def train(model, crit):
        opt, losses = torch.optim.SGD(model.parameters(), lr=0.1), []
        for x, y in _data(3):
            opt.zero_grad()
            value = crit(model(x), y)
            value.backward()
            opt.step()
            losses.append(value.item())
        return losses

    local = mlp()
    expected = train(local, loss)
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        assert train(model, model.remote_loss(loss)) == expected
        assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("make", [
    lambda: nn.CrossEntropyLoss(weight=torch.tensor([0.2, 0.3, 0.5]), label_smoothing=0.1),
    lambda: nn.BCEWithLogitsLoss(pos_weight=torch.tensor([3.0, 1.0, 0.25])),
], ids=["class-weighted cross-entropy", "BCE with pos_weight"])
def test_a_loss_with_tensor_settings_is_computed_in_the_cloud_exactly(cloud, make):
    """Class weights and ``pos_weight`` (imbalanced data) travel with the loss; the cloud's loss
    uses the same numbers, so training is bitwise the unsplit model's."""
    multilabel = isinstance(make(), nn.BCEWithLogitsLoss)
    data = [(x, nn.functional.one_hot(y, 3).float() if multilabel else y) for x, y in _data(4)]

    def train(model, crit):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for x, y in data:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    local = mlp()
    train(local, make())
    model = splitft.split(mlp(), 2, factory=MLP, connect=cloud)
    with model:
        train(model, model.remote_loss(make()))
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("change", [
    lambda ce, step: setattr(ce, "label_smoothing", 0.05 * step),
    lambda ce, step: ce.weight.mul_(1.5),
    lambda ce, step: setattr(ce, "weight", torch.tensor([0.6, 0.3, 0.1])),
], ids=["label_smoothing by a curriculum", "class weights changed in place", "class weights set anew"])
@pytest.mark.parametrize("through", ["criterion", "remote loss"])
def test_a_criterion_changed_after_remote_loss_is_followed_by_the_cloud(cloud, change, through):
    """The script keeps its criterion and changes it between steps, or changes it through what
    ``remote_loss`` returned (which it uses as the criterion); the cloud's loss must follow."""
    data = _data(4)

    def train(model, ce, crit):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step, (x, y) in enumerate(data):
            if step:
                change(ce, step)
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    def criterion():
        return nn.CrossEntropyLoss(weight=torch.tensor([0.2, 0.3, 0.5]))

    local, ce = mlp(), criterion()
    train(local, ce, ce)
    model, ce = splitft.split(mlp(), 2, factory=MLP, connect=cloud), criterion()
    with model:
        crit = model.remote_loss(ce)
        train(model, ce if through == "criterion" else crit, crit)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("use", [
    lambda crit: crit.to("cpu"), lambda crit: crit.train(), lambda crit: crit.float(),
    lambda crit: crit.requires_grad_(False), lambda crit: crit.forward,
], ids=["crit = crit.to(device)", "crit = crit.train()", "crit = crit.float()", "crit = crit.requires_grad_(False)",
        "crit.forward(out, y)"])
def test_a_remote_loss_moved_or_set_to_a_mode_as_a_module_is_still_the_remote_loss(cloud, use):
    """Scripts treat the criterion as the module it is: ``crit = crit.to(device)`` keeps what the
    call returns, ``crit.forward(out, y)`` computes it. Those are the remote loss, not the torch
    criterion it stands for (which, called on a plain split's ``model(x)``, refuses the activation)."""
    data = _data(3)

    def train(model, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            use(crit)(model(x), y).backward()
            opt.step()

    local = mlp()
    train(local, nn.CrossEntropyLoss())
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        train(model, model.remote_loss(nn.CrossEntropyLoss()))
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


def test_a_remote_loss_kept_as_a_child_module_trains_and_saves_as_the_criterion_it_replaced(cloud):
    """A LightningModule-style holder keeps its criterion as a child (``self.crit = nn.CrossEntropyLoss(
    weight=w)``) and a plain split replaces it with the remote loss (``self.crit = model.remote_loss(
    self.crit)``): a module, whose tensors are the criterion's, so the holder trains, moves and saves
    (``crit.weight`` in its state dict) as unsplit; frameworks that take a criterion module (skorch)
    use it as it is."""
    data = _data(3)

    class Holder(nn.Module):
        def __init__(self, model: nn.Module) -> None:
            super().__init__()
            self.model, self.crit = model, nn.CrossEntropyLoss(weight=torch.tensor([0.2, 0.3, 0.5]))

        def training_step(self, x, y):
            return self.crit(self.model(x), y)

    def train(holder: Holder) -> None:
        holder.to("cpu").train()
        opt = torch.optim.SGD(holder.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            holder.training_step(x, y).backward()
            opt.step()

    local = Holder(mlp())
    train(local)
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        holder = Holder(model)
        holder.crit = model.remote_loss(holder.crit)
        assert isinstance(holder.crit, nn.Module) and "crit" in dict(holder.named_children())
        train(holder)
        assert holder.crit.training and holder.crit.weight is holder.crit.criterion.weight
        state = holder.state_dict()
    assert_bitwise(state, local.state_dict())


def test_a_loss_setting_that_requires_a_gradient_is_refused_at_the_call_as_torch_refuses_it(cloud):
    """A learned ``pos_weight`` (an ``nn.Parameter``): torch's loss is not differentiable in it and
    the unsplit call raises; the cloud's copy would take its values and train on silently."""
    x, y = _data(1)[0]
    target = nn.functional.one_hot(y, 3).float()
    weight = nn.Parameter(torch.ones(3))
    with pytest.raises(RuntimeError, match="not differentiable"):
        nn.BCEWithLogitsLoss(pos_weight=weight)(mlp()(x), target)
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        crit = model.remote_loss(nn.BCEWithLogitsLoss(pos_weight=weight))
        with pytest.raises(splitft.ConfigError, match="pos_weight requires a gradient"):
            crit(model(x), target)
        with torch.no_grad():  # no gradient asked: torch computes it, and so does the cloud
            crit(model(x), target)


def _double(module, args, output):
    return output * 2


CRITERION_ADDITIONS = {
    "a forward hook": lambda ce, crit, patch: ce.register_forward_hook(_double),
    "a pre-hook through the remote loss": lambda ce, crit, patch: crit.register_forward_pre_hook(lambda m, a: None),
    "its forward replaced": lambda ce, crit, patch: setattr(ce, "forward", lambda a, b: F.cross_entropy(a, b) * 2),
    "its class's forward replaced": lambda ce, crit, patch: patch.setattr(
        nn.CrossEntropyLoss, "forward", lambda self, a, b: F.cross_entropy(a, b) * 2),
}


@pytest.mark.parametrize("when", ["before remote_loss", "after a step"])
@pytest.mark.parametrize("addition", sorted(CRITERION_ADDITIONS))
def test_a_criterion_that_does_more_than_torchs_loss_is_refused(cloud, monkeypatch, addition, when):
    """A hook on the criterion, or its forward replaced, changes what the unsplit loss computes;
    the cloud computes torch's own loss by name, so it is refused before the loss it would change."""
    add = CRITERION_ADDITIONS[addition]
    (x, y), = _data(1)
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        ce = nn.CrossEntropyLoss()
        if when == "before remote_loss":
            add(ce, ce, monkeypatch)
            with pytest.raises(ConfigError, match=r"criterion of model\.remote_loss \(CrossEntropyLoss\) has "
                                                  r"(a hook|its forward replaced).*rejoin="):
                model.remote_loss(ce)
            return
        crit = model.remote_loss(ce)
        crit(model(x), y).backward()
        add(ce, crit, monkeypatch)
        with pytest.raises(ConfigError, match=r"(a hook|its forward replaced).*never run"):
            crit(model(x), y)


@pytest.mark.parametrize("call", [lambda crit, out, y: crit(out, y, weight=torch.ones(3)),
                                  lambda crit, out, y: crit(out, y, torch.ones(3))], ids=["keyword", "positional"])
def test_a_remote_loss_called_with_more_than_out_and_target_names_where_its_settings_go(cloud, call):
    """``F.cross_entropy(out, y, weight=w)`` unsplit; its remote loss takes (out, target) and the
    settings from the loss module: refused naming that, and training goes on exactly."""
    data = _data(2)
    local = mlp()
    _train_adam(local, nn.CrossEntropyLoss(), data)
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        crit = model.remote_loss(F.cross_entropy)
        with pytest.raises(ConfigError, match=r"crit\(out, target\).*nn\.CrossEntropyLoss\(weight=w\)"):
            call(crit, model(data[0][0]), data[0][1])
        _train_adam(model, crit, data)
        assert_bitwise(model.state_dict(), local.state_dict())


def _train_adam(model, crit, data):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for x, y in data:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


@pytest.mark.parametrize("rejoin", [None, 5], ids=["plain", "ushape"])
def test_a_loop_that_halves_its_batch_when_out_of_memory_trains_as_unsplit(cloud, rejoin):
    """The out-of-memory retry (catch ``torch.OutOfMemoryError``, accumulate the batch in halves):
    the cloud half running out of memory reaches the script as torch's error, as unsplit, and
    the retry trains exactly."""
    from tests.models import batch_limited_mlp

    data = [(x if i % 2 else x[:8], y if i % 2 else y[:8]) for i, (x, y) in enumerate(_data(4))]  # 16 rows fail
    retries = []

    def train(model, crit):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for x, y in data:
            try:
                opt.zero_grad()
                crit(model(x), y).backward()
            except torch.OutOfMemoryError as exc:
                retries.append(type(exc))
                opt.zero_grad()
                for xs, ys in zip(x.chunk(2), y.chunk(2)):
                    (crit(model(xs), ys) / 2).backward()
            opt.step()

    local = batch_limited_mlp()
    train(local, nn.CrossEntropyLoss())
    with splitft.split(batch_limited_mlp(), 2, rejoin, factory=BATCH_LIMITED, connect=cloud) as model:
        train(model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()))
        assert_bitwise(model.state_dict(), local.state_dict())
    assert retries[:2] == [torch.OutOfMemoryError] * 2 and retries[2:] == [splitft.errors.CloudOutOfMemory] * 2


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_block_calling_its_modules_through_a_lambda_trains_as_unsplit(cloud, rejoin):
    """minGPT's ``self.mlpf = lambda x: m.c_proj(m.act(m.c_fc(x)))`` and a bound method kept as an
    attribute: the edge's copy of the cloud half (which a U-shape's first call runs to check the
    trunk) calls its own modules through them, as the cloud's freshly built one does."""
    from tests.models import lambda_block_mlp

    local = lambda_block_mlp()
    _train_adam(local, nn.CrossEntropyLoss(), _data(3))
    with splitft.split(lambda_block_mlp(), 2, rejoin, factory="tests.models:lambda_block_mlp",
                       connect=cloud) as model:
        _train_adam(model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()), _data(3))
        assert_bitwise(model.state_dict(), local.state_dict())


def _swap_activations(module: nn.Module, below: int) -> None:
    """An activation-replacement walk as libraries write it: ``module._modules[name] = new``."""
    for name, child in module.named_children():
        if isinstance(child, nn.ReLU) and int(name) < below:
            module._modules[name] = nn.GELU()


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_walk_that_swaps_layers_through_modules_trains_as_unsplit(cloud, rejoin):
    """``module._modules[name] = new`` over the split model's ``named_children()``: the model's
    edge layer is replaced, as unsplit (it was written into the split model's own table, which
    nothing calls, and training went on with the old layer); a cloud layer's swap is refused."""
    local = mlp()
    _swap_activations(local, 2)
    _train_adam(local, nn.CrossEntropyLoss(), _data(3))
    with splitft.split(mlp(), 2, rejoin, factory=MLP, connect=cloud) as model:
        _swap_activations(model, 2)
        assert isinstance(model.wrapped[1], nn.GELU) and list(model._modules) == ["model"]
        _train_adam(model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()), _data(3))
        assert_bitwise(model.state_dict(), local.state_dict())
        _swap_activations(model, 4)
        with pytest.raises(ConfigError, match="'3' runs in the cloud, but the model's forward would call another"):
            model(_data(1)[0][0])


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded before the retry", "not seeded"])
@pytest.mark.parametrize("first", [True, False], ids=["at the first step", "at a later step"])
def test_an_out_of_memory_retry_after_the_cloud_half_drew_is_exact(cloud, first, seeded):
    """Dropout before the point where memory ran out: unsplit, its draws moved the generator; the
    cloud's error brings back where they left it, and the retry trains exactly, seeded or not."""
    from tests.models import batch_limited_mlp

    sizes = [16, 8, 8] if first else [8, 16, 8]
    data = [(x[:n], y[:n]) for (x, y), n in zip(_data(3), sizes)]

    def train(model, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            try:
                opt.zero_grad()
                crit(model(x), y).backward()
            except torch.OutOfMemoryError:
                opt.zero_grad()
                if seeded:
                    torch.manual_seed(7)
                for xs, ys in zip(x.chunk(2), y.chunk(2)):
                    (crit(model(xs), ys) / 2).backward()
            opt.step()

    torch.manual_seed(0)
    local = batch_limited_mlp(dropout=0.5)
    train(local, nn.CrossEntropyLoss())
    local_rng = torch.get_rng_state()
    factory = splitft.Factory(BATCH_LIMITED, {"dropout": 0.5})
    torch.manual_seed(0)
    with splitft.split(batch_limited_mlp(dropout=0.5), 2, factory=factory, connect=cloud) as model:
        train(model, model.remote_loss(nn.CrossEntropyLoss()))
        assert_bitwise(model.state_dict(), local.state_dict())
        assert torch.equal(torch.get_rng_state(), local_rng)


@pytest.mark.parametrize("bad, caught", [
    (lambda y: y + 3, IndexError), (lambda y: y[:-1], ValueError), (lambda y: y + 3, RuntimeError),
], ids=["a target out of range, except IndexError", "a short target, except ValueError",
        "a target out of range, except RuntimeError (which it is not)"])
def test_a_loop_that_skips_a_batch_the_loss_refuses_trains_as_unsplit(cloud, bad, caught):
    """A loop catching the loss's error on a malformed batch and going on: the cloud's error is the
    Python exception the unsplit loss raises (its class, for ``except``), and the draws its dropout
    made before the loss failed move the edge's generator, as they move the unsplit one."""
    data = _data(5)

    def train(model, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        outcomes = []
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            try:
                loss = crit(model(x), bad(y) if i == 2 else y)
            except caught:
                outcomes.append("skipped")
                continue
            loss.backward()
            opt.step()
            outcomes.append(float(loss))
        return outcomes

    torch.manual_seed(0)
    local = mlp_dropout()
    try:
        expected = train(local, nn.CrossEntropyLoss())
    except Exception as exc:  # noqa: BLE001 - not the class caught: the split loop must raise it too
        expected = type(exc)
    local_rng = torch.get_rng_state()
    torch.manual_seed(0)
    with splitft.split(mlp_dropout(), 2, factory=MLP_DROPOUT, connect=cloud) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        if isinstance(expected, type):
            with pytest.raises(expected):
                train(model, crit)
            return
        assert train(model, crit) == expected
        assert_bitwise(model.state_dict(), local.state_dict())
    assert torch.equal(torch.get_rng_state(), local_rng)


def test_a_forward_left_without_its_loss_is_not_swallowed_by_a_loop_that_skips_failed_batches(cloud):
    """The script's own check fails between ``model(x)`` and the loss (a dropout in the cloud half
    drew at that forward unsplit): the refusal at the next forward is no ValueError or RuntimeError,
    so the loop's ``except`` for its own failures does not skip it and train on apart from the
    unsplit run. A request refused so keeps the step queued before it for the next message."""
    data = _data(4)

    def train(model, crit, opt, batches):
        for i, (x, y) in enumerate(batches):
            try:
                out = model(x)
                if i == 1:
                    raise ValueError("corrupt labels in this batch")
                crit(out, y).backward()
                opt.step()
                opt.zero_grad()
            except (IndexError, ValueError, RuntimeError):
                continue

    torch.manual_seed(0)
    local = mlp_dropout()
    opt = torch.optim.SGD(local.parameters(), lr=0.1)
    train(local, nn.CrossEntropyLoss(), opt, data[:2])
    train(local, nn.CrossEntropyLoss(), opt, data[3:])
    local(data[2][0])
    torch.manual_seed(0)
    with splitft.split(mlp_dropout(), 2, factory=MLP_DROPOUT, connect=cloud) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(UnfinishedForwardError, match="had not reached the cloud half"):
            train(model, crit, opt, data[:3])
        model.predict(data[1][0])  # the left forward run whole, as unsplit: its dropout draws
        train(model, crit, opt, data[3:])
        model(data[2][0])
        with pytest.raises(UnfinishedForwardError):  # a request refused: the queued step waits for the next
            model.state_dict()
        model.predict(data[2][0])
        assert_bitwise(model.state_dict(), local.state_dict())


def test_what_the_cloud_halfs_backward_does_not_reach_gets_no_gradient_as_unsplit(cloud):
    """A probe on detached features in the cloud (plain split), an auxiliary output a U-shape's loss
    uses at the first step only: unsplit, the layers the backward does not reach keep ``grad`` None,
    and AdamW's weight decay and moments pass them by; they got zeros, and moved."""
    from tests.models import aux_out_net, detached_probe_mlp

    data = _data(3)

    def probe(model, crit):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reached = []
        for x, y in data:
            crit(model(x), y).backward()
            reached.append(next(model.parameters()).grad is not None)
            opt.step()
            opt.zero_grad()
        return reached

    def aux(model, crit):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        reached = []
        for i, (x, y) in enumerate(data):
            out, logits = model(x)
            (crit(out, y) + (0.3 * crit(logits, y) if i == 0 else 0)).backward()
            reached.append(model.blk.aux_head.weight.grad is not None)
            opt.step()
            opt.zero_grad()
        return reached

    for factory, script, cut, rejoin in ((detached_probe_mlp, probe, 1, None), (aux_out_net, aux, "blk", "head")):
        local = factory()
        expected = script(local, nn.CrossEntropyLoss())
        assert expected == ([False] * 3 if script is probe else [True, False, False])
        model = splitft.split(factory(), cut, rejoin, factory=f"tests.models:{factory.__name__}", connect=cloud)
        with model:
            crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
            assert script(model, crit) == expected
            assert_bitwise(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("cut, rejoin", [("attn", "mix"), ("mix", "head")])
def test_a_tensor_given_to_the_cloud_half_in_several_places_is_one_tensor_there_as_unsplit(cloud, cut, rejoin):
    """``attn(h, h, h)`` as a U-shape's trunk: torch's attention takes its self-attention path only when query,
    key and value are one tensor, and the gradients of the three places sum in the cloud's backward.
    They crossed as three tensors, and training drifted from the unsplit model by the last bits;
    ``mix(h, context=h)`` passes it as an argument and a keyword."""
    from tests.models import self_attention_net

    torch.manual_seed(0)
    data = [(torch.randn(4, 5, 12), torch.randint(0, 3, (4,))) for _ in range(4)]

    def train(model, crit):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for x, y in data:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    local = self_attention_net()
    train(local, nn.CrossEntropyLoss())
    with splitft.split(self_attention_net(), cut, rejoin, factory="tests.models:self_attention_net",
                       connect=cloud) as model:
        train(model, nn.CrossEntropyLoss())
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_backward_through_a_forward_made_before_unsplit_is_refused(cloud):
    """A plain split's loss computed, then ``unsplit()``, then its backward: the cloud half's part
    of it went with the session, and the step would leave the cloud layers out. Refused (it filled
    the edge's gradients alone, silently)."""
    (x, y), = _data(1)
    model = splitft.split(mlp(), 2, factory=MLP, connect=cloud)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    left = model.remote_loss(nn.CrossEntropyLoss())(model(x), y)
    whole = model.unsplit()
    with pytest.raises(splitft.errors.PeerGone, match=r"a backward through a forward made before.*run the forward "
                                                      r"again on it"):
        left.backward()
    assert all(p.grad is None for p in whole.parameters())
    nn.CrossEntropyLoss()(whole(x), y).backward()  # the forward again, on the whole model: it trains
    opt.step()


def test_a_caught_loss_error_in_micro_batches_with_dropout_in_the_cloud_is_refused_until_reseeded(cloud):
    """In micro-batches the parts after the failing one ran and drew too, which the error's state
    does not cover: the next forward that draws is refused, naming the fix, and goes on once the
    script sets the generator."""
    (x, y), (x2, y2) = _data(2)
    torch.manual_seed(0)
    with splitft.split(mlp_dropout(), 2, factory=MLP_DROPOUT, connect=cloud,
                       schedule=splitft.Schedule(micro_batches=2)) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        with pytest.raises(IndexError):
            crit(model(x), y + 3)
        with pytest.raises(ConfigError, match=r"ran in micro-batches.*torch\.manual_seed"):
            crit(model(x2), y2)
        torch.manual_seed(1)
        assert torch.isfinite(crit(model(x2), y2))


GENERATOR_READS = {"torch.get_rng_state()": lambda: torch.get_rng_state(),
                   "torch.random.get_rng_state()": lambda: torch.random.get_rng_state(),
                   "torch.random.fork_rng()": lambda: torch.random.fork_rng(devices=[]).__enter__()}


@pytest.mark.parametrize("read", sorted(GENERATOR_READS))
def test_the_generators_state_read_between_model_x_and_the_loss_with_dropout_in_the_cloud_is_refused(cloud, read):
    """Unsplit the cloud half's dropout drew at model(x), so a state read before the loss (saved for
    a checkpoint, or by fork_rng around a teacher's forward, which puts it back) is after those
    draws; split the half draws at the loss. Refused there; before model(x) and after the loss,
    and with no dropout in the cloud, read as usual."""
    (x, y), = _data(1)
    with splitft.split(mlp_dropout(), 2, factory=MLP_DROPOUT, connect=cloud) as model:
        crit = model.remote_loss(nn.CrossEntropyLoss())
        crit(model(x), y).backward()  # the cloud half is known to draw from here on
        out = model(x)
        with pytest.raises(ConfigError, match=r"generator's state read .* between a plain split's model\(x\) and "
                                              r"its remote loss, while the cloud half draws"):
            GENERATOR_READS[read]()
        crit(out, y).backward()
        GENERATOR_READS[read]()
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        out = model(x)
        with torch.random.fork_rng(devices=[]):
            torch.rand(3)
        assert torch.isfinite(model.remote_loss(nn.CrossEntropyLoss())(out, y))


DROPOUT_TOGGLES = {
    "eval, then train": (lambda drop: drop.eval(), lambda drop: drop.train()),
    "p set to 0, then back": (lambda drop: setattr(drop, "p", 0.0), lambda drop: setattr(drop, "p", 0.5)),
}


DROPOUT_CUTS = {"plain": ("mlp_dropout", 2, None, 3), "ushape": ("mlp_dropout", 2, 4, 3),
                "plain, the edge draws too": ("mlp_dropout_everywhere", 3, None, 4),
                "ushape, the edge draws too": ("mlp_dropout_everywhere", 3, 6, 4)}


@pytest.mark.parametrize("cut", sorted(DROPOUT_CUTS))
@pytest.mark.parametrize("toggle", sorted(DROPOUT_TOGGLES))
def test_a_cloud_dropout_turned_off_and_on_again_draws_the_unsplit_masks(cloud, toggle, cut):
    """A dropout of the cloud half off for a step (``eval()``, or ``p = 0``) and on again: both
    halves learnt it draws nothing while off, and must learn again that it draws once it is back,
    or its masks come from the cloud process's generator, or a stale state, instead of the edge's."""
    from tests import models

    off, on = DROPOUT_TOGGLES[toggle]
    name, at, rejoin, dropout = DROPOUT_CUTS[cut]
    build = getattr(models, name)
    data = _data(4)

    def train(model, net, crit):
        torch.manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for i, (x, y) in enumerate(data):
            if i == 1:
                off(net[dropout])
            if i == 2:
                on(net[dropout])
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    local = build()
    train(local, local, nn.CrossEntropyLoss())
    net = build()
    with splitft.split(net, at, rejoin, factory=f"tests.models:{name}", connect=cloud) as model:
        train(model, net, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()))
        assert_bitwise(model.state_dict(), local.state_dict())


def test_an_edge_layer_replaced_by_index_trains_as_unsplit(cloud):
    """``model[1] = nn.Tanh()`` on a split Sequential replaces an edge module in place, as unsplit
    (and as ``setattr(model, "1", ...)`` does); a cloud module's index stays refused."""
    data = _data(3)

    def train(model, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for i, (x, y) in enumerate(data):
            if i == 1:
                model[1] = nn.Tanh()
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    local = mlp()
    train(local, nn.CrossEntropyLoss())
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        train(model, model.remote_loss(nn.CrossEntropyLoss()))
        assert_bitwise(model.state_dict(), local.state_dict())
        with pytest.raises(ConfigError, match="cannot be added, replaced or removed"):
            model[3] = nn.Tanh()


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
@pytest.mark.parametrize("average", ["ema", "swa"])
def test_an_averaged_model_built_before_split_averages_the_split_models_weights(cloud, average, rejoin):
    """``AveragedModel(net)`` made on the unsplit model, as the refusal of one made after split()
    advises, then updated from the split model after each step: torch groups the two models'
    tensors by device (in C++, which asks the cloud tensors theirs), then averages them."""
    data = _data(4)
    swa_utils = torch.optim.swa_utils

    def train(net, split):
        averaged = swa_utils.AveragedModel(net, multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9) if average == "ema"
                                           else None)
        model = splitft.split(net, 2, rejoin, factory=MLP, connect=cloud) if split else net
        crit = model.remote_loss(nn.CrossEntropyLoss()) if split and not rejoin else nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
            averaged.update_parameters(model)
        state = model.state_dict()
        if split:
            model.close()
        return state, averaged.state_dict()

    local, local_average = train(mlp(), False)
    state, averaged = train(mlp(), True)
    assert_bitwise(state, local)
    assert_bitwise(averaged, local_average)
    assert not torch.equal(averaged["module.2.weight"], state["2.weight"])  # an average, not the last weights


@pytest.mark.parametrize("weights", ["push", "factory"])
def test_a_bfloat16_model_cast_before_split_trains_as_unsplit(cloud, weights):
    """A model cast to bfloat16 before split() (and in its factory): its weights go to the cloud as
    float32, which holds them exactly, or are hashed as the bytes they are."""
    data = [(x.bfloat16(), y) for x, y in _data(3)]

    def train(model, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in data:
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    local = mlp(dtype="bfloat16")
    train(local, nn.CrossEntropyLoss())
    factory = splitft.Factory(MLP, {"dtype": "bfloat16"}, weights=weights)
    with splitft.split(mlp(dtype="bfloat16"), 2, factory=factory, connect=cloud) as model:
        train(model, model.remote_loss(nn.CrossEntropyLoss()))
        state = model.state_dict()
    assert state["2.weight"].dtype == torch.bfloat16
    assert_bitwise(state, local.state_dict())


def test_two_remote_losses_called_in_turn_each_compute_their_own(cloud):
    """A script with two criteria (a smoothed loss on some batches, a plain one on others): the
    second ``remote_loss`` must not replace the first for good."""
    data = _data(4)

    def train(model, crits):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for step, (x, y) in enumerate(data):
            opt.zero_grad()
            crits[step % 2](model(x), y).backward()
            opt.step()

    def criteria():
        return nn.CrossEntropyLoss(label_smoothing=0.2), nn.CrossEntropyLoss(reduction="sum")

    local = mlp()
    train(local, criteria())
    model = splitft.split(mlp(), 2, factory=MLP, connect=cloud)
    with model:
        train(model, [model.remote_loss(c) for c in criteria()])
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


def test_a_loss_tensor_setting_the_cloud_cannot_trust_is_refused():
    from splitft.cloud.handlers import MAX_LOSS_TENSOR, loss_tensor
    from splitft.errors import ProtocolError

    good = {"tensor": [0.5, 2.0], "dtype": "float32", "shape": [2]}
    assert torch.equal(loss_tensor(good, "weight"), torch.tensor([0.5, 2.0]))
    for bad in ({**good, "dtype": "int64"}, {**good, "shape": [3]}, {**good, "tensor": [0.5, float("nan")]},
                {**good, "tensor": [1, 2]}, {**good, "shape": [-2]}, {**good, "extra": 1}, {"tensor": "x"},
                {"tensor": [0.0] * (MAX_LOSS_TENSOR + 1), "dtype": "float32", "shape": [MAX_LOSS_TENSOR + 1]}):
        with pytest.raises(ProtocolError):
            loss_tensor(bad, "weight")


def test_a_cloud_layer_put_in_eval_mode_by_name_runs_in_eval_mode_in_the_cloud(cloud):
    """digits_cnn's block2 holds a BatchNorm: in eval mode it uses (and keeps) its running statistics."""
    from splitft.app.models import digits_cnn

    g = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 1, 8, 8, generator=g), torch.randint(0, 10, (8,), generator=g)) for _ in range(3)]

    def script(model, net, crit):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        net.block2[1].eval()
        for x, y in data:
            if model.training is False:
                model.train()
                net.block2[1].eval()
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    local = digits_cnn()
    script(local, local, nn.CrossEntropyLoss())
    net = digits_cnn()
    model = splitft.split(net, "block2", "head", factory=DIGITS, connect=cloud)
    with model:
        script(model, net, nn.CrossEntropyLoss())
        state = model.state_dict()
    assert_same(state, local.state_dict())
    assert int(state["block2.1.num_batches_tracked"]) == 0  # the BatchNorm really ran in eval mode


def test_functional_call_with_tensors_of_its_own_for_cloud_parameters_is_refused(cloud):
    """``functional_call`` with the model's own parameters runs as ``model(x)`` (a script of
    :data:`SCRIPTS`); with another tensor for a cloud parameter it is refused."""
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        with pytest.raises(splitft.CutError, match="changing the parameters of '2'"):
            torch.func.functional_call(model, {"2.weight": torch.zeros(16, 16)}, (_data(1)[0][0],))


@pytest.mark.parametrize("how", ["model.training = False", "isinstance(model, RootDropoutNet)"])
def test_what_a_script_reads_or_sets_on_the_model_object_itself_is_the_unsplit_models(cloud, how):
    """The split model answers as the model it wraps: ``model.training = False`` set directly turns
    off the dropout its own forward reads from ``self.training`` (it set the split model's flag
    only), and ``isinstance(model, RootDropoutNet)`` holds, so parameter groups picked by class
    are the unsplit script's."""
    from tests.models import RootDropoutNet, root_dropout_net

    def train(model):
        torch.manual_seed(1)
        if isinstance(model, RootDropoutNet):  # the body at its own rate
            groups = [{"params": model.body.parameters(), "lr": 0.01},
                      {"params": [*model.inp.parameters(), *model.head.parameters()]}]
        else:
            groups = [{"params": model.parameters()}]
        opt = torch.optim.SGD(groups, lr=0.1)
        for i, (x, y) in enumerate(_data(4)):
            if i == 2 and how == "model.training = False":
                model.training = False
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return model.training

    local = root_dropout_net()
    flag = train(local)
    with splitft.split(root_dropout_net(), "body", "head", factory="tests.models:root_dropout_net",
                       connect=cloud) as model:
        assert train(model) == flag and model.wrapped.training == flag
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_second_backward_after_a_step_is_refused_at_the_backward_as_torch_refuses_it(cloud):
    """``loss.backward(retain_graph=True); opt.step(); loss.backward()``: unsplit torch raises a
    RuntimeError at the second backward (the step changed saved weights in place); split, it is
    raised there too, as a RuntimeError (it went through, and the next request failed)."""
    local = mlp()
    _train_adam(local, nn.CrossEntropyLoss(), _data(1))
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        (x, y), = _data(1)
        loss = model.remote_loss(nn.CrossEntropyLoss())(model(x), y)
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match="a second backward through a forward after an optimizer step"):
            loss.backward()
        assert_bitwise(model.state_dict(), local.state_dict())


def test_a_weight_written_through_data_between_loss_and_backward_is_refused_saying_why(cloud):
    """``p.data.mul_(0.99)`` between the loss and its backward: unsplit, torch does not see a write
    through ``.data`` and its backward reads the changed weight, which the cloud's backward cannot
    repeat; the refusal says so (it said torch refuses it too)."""
    with splitft.split(mlp(), 2, factory=MLP, connect=cloud) as model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        (x, y), = _data(1)
        opt.zero_grad()
        loss = model.remote_loss(nn.CrossEntropyLoss())(model(x), y)
        for p in model.parameters():
            p.data.mul_(0.99)
        with pytest.raises(splitft.errors.ModelError, match=r"but for a write through p.data.*after loss.backward"):
            loss.backward()
            opt.step()
            model.sync()  # the cloud applies the backward with the next message


def test_two_optimizers_beside_each_other_over_the_cloud_half_are_refused_naming_it(cloud):
    """Muon for the matrices and AdamW for the rest, both holding cloud parameters: the cloud
    keeps one optimizer, so the older one's step is refused before it runs, saying that two over
    different parts are not supported (not that one replaced the other)."""
    net = mlp()
    with splitft.split(net, 2, factory=MLP, connect=cloud) as model:
        matrices = torch.optim.Muon([p for p in model.parameters() if p.ndim == 2], lr=0.02)
        rest = torch.optim.AdamW([p for p in model.parameters() if p.ndim != 2], lr=1e-3)
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for i, (x, y) in enumerate(_data(2)):
            crit(model(x), y).backward()
            if i == 0:  # each is attached at its first step, the AdamW after the Muon
                matrices.step()
                rest.step()
                continue
            before = copy.deepcopy(model.state_dict())
            with pytest.raises(splitft.ConfigError, match="this Muon and the AdamW attached after it each hold "
                                                          "parameters of the cloud half.*not supported yet"):
                matrices.step()
            assert_bitwise(model.state_dict(), before)


def test_an_optimizer_replaced_by_a_newer_one_is_refused_when_it_steps_again(cloud):
    """A second optimizer over the cloud half replaces the first, in the cloud too (the unsplit
    loop steps only the new one); the first stepping again would step a copy the cloud no longer
    keeps, and is refused before it runs."""
    net = mlp()
    model = splitft.split(net, 2, factory=MLP, connect=cloud)
    with model:
        first = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = _data(1)[0]
        model.remote_loss(nn.CrossEntropyLoss())(model(x), y).backward()
        first.step()
        second = torch.optim.SGD(net[4].parameters(), lr=0.1)
        second.step()
        for refused in (first.step, first.state_dict, lambda: first.load_state_dict(first.state_dict())):
            with pytest.raises(splitft.ConfigError, match="this SGD was replaced by the SGD attached after it"):
                refused()
        second.param_groups[0]["params"].pop()  # a group's parameters edited in place: not a group added
        with pytest.raises(splitft.ConfigError, match="parameter groups changed"):
            second.step()
        edge_only = torch.optim.SGD(net[0].parameters(), lr=0.1)  # the edge's own: local, as unsplit
        edge_only.step()
        with pytest.raises(splitft.ConfigError, match="parameter groups changed"):
            second.step()  # still


def _images(batches: int = 5) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(16, 1, 8, 8, generator=g), torch.randint(0, 10, (16,), generator=g)) for _ in range(batches)]


def _steps_around(model, crit, data, between) -> None:
    """SGD steps on ``data``, with ``between()`` after the third: a change made mid-run."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, (x, y) in enumerate(data):
        if i == 3:
            between()
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def batch_norm_settings_changed_mid_run(model, net, crit, data):
    def change():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.momentum, module.eps = 0.01, 1e-2

    _steps_around(model, crit, data, change)


def swa_with_update_bn(model, net, crit, data):
    # momentum None, statistics reset, then forwards alone
    _steps_around(model, crit, data, lambda: torch.optim.swa_utils.update_bn([x for x, _ in data], model))


def statistics_recomputed_with_predict(model, net, crit, data):
    predict = getattr(model, "predict", model)  # a plain split's whole forward; unsplit, model(x)

    def recompute():
        with torch.no_grad():
            for x, _ in data:
                predict(x)

    _steps_around(model, crit, data, recompute)


@pytest.mark.parametrize("script, rejoin", [(batch_norm_settings_changed_mid_run, None),
                                            (batch_norm_settings_changed_mid_run, "head"),
                                            (swa_with_update_bn, "head"),
                                            (statistics_recomputed_with_predict, None)],
                         ids=["bn-settings-plain", "bn-settings-ushape", "update_bn-ushape", "predict-plain"])
def test_settings_a_script_gives_cloud_layers_are_theirs_in_the_cloud_too(cloud, script, rejoin):
    """Batch norm's momentum and eps set mid-run, swa_utils.update_bn (momentum None, statistics
    reset, forwards alone), statistics recomputed with model.predict: the cloud's batch norm does
    what the unsplit one does (digits_cnn cut at block2: its BatchNorm runs in the cloud)."""
    from splitft.app.models import digits_cnn

    data = _images()
    local = digits_cnn()
    script(local, local, nn.CrossEntropyLoss(), data)
    net = digits_cnn()
    model = splitft.split(net, "block2", rejoin, factory=DIGITS, connect=cloud)
    with model:
        crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
        script(model, net, crit, data)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())
    assert not torch.equal(state["block2.1.running_mean"], digits_cnn().state_dict()["block2.1.running_mean"])


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_dropout_turned_off_by_a_module_walk_is_off_in_the_cloud(cloud, rejoin):
    """What RLHF trainers do to a policy (``disable_dropout_in_model``): p = 0 on every Dropout,
    here after two steps with it, the cloud's among them."""
    from tests.models import mlp_dropout

    def script(model, crit, data):
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for i, (x, y) in enumerate(data):
            if i == 2:
                for module in model.modules():
                    if isinstance(module, nn.Dropout):
                        module.p = 0.0
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    data = _data(6)
    torch.manual_seed(3)
    local = mlp_dropout()
    script(local, nn.CrossEntropyLoss(), data)
    torch.manual_seed(3)
    model = splitft.split(mlp_dropout(), 2, rejoin, factory=MLP_DROPOUT, connect=cloud)
    with model:
        script(model, nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss()), data)
        state = model.state_dict()
    assert_bitwise(state, local.state_dict())


@pytest.mark.parametrize("rejoin", [None, 4], ids=["plain", "ushape"])
def test_a_setting_one_session_changes_leaves_other_sessions_drawing_as_before(cloud, rejoin):
    """Sessions of one model share what the cloud learnt of whether its half draws; a session that
    turns its dropout off draws nothing, which must not teach the others that theirs does not."""
    data = _data(4)

    def train(model, crit, dropout_off=None):
        torch.manual_seed(5)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if dropout_off is not None:
            dropout_off.p = 0.0
        for x, y in data:
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()

    net = mlp_dropout()
    with splitft.split(net, 2, rejoin, factory=MLP_DROPOUT, connect=cloud) as first:
        train(first, nn.CrossEntropyLoss() if rejoin else first.remote_loss(nn.CrossEntropyLoss()), net[3])
    local = mlp_dropout()
    train(local, nn.CrossEntropyLoss())
    net = mlp_dropout()
    with splitft.split(net, 2, rejoin, factory=MLP_DROPOUT, connect=cloud) as second:
        train(second, nn.CrossEntropyLoss() if rejoin else second.remote_loss(nn.CrossEntropyLoss()))
        state = second.state_dict()
    assert_bitwise(state, local.state_dict())

