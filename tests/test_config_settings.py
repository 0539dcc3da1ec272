"""Config settings the cloud's layers read while they run (a transformers layer's attention
kernel, a user's layer reading ``self.config.scale``): the cloud builds its half with its own
config, so such a setting must agree at the handshake and must not change on the edge after
split(); settings only the edge's code reads may still change. Scripts written as users write
them, against a real cloud process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft.config_reads import ModuleFlags, globals_read, keys_read
from splitft.errors import ConfigError, HandshakeError, PlaceholderError
from tests.conftest import start_cloud, stop
import tests.models
from tests.models import Gain, GlobalGain, ScaledLinear, configured_mlp, gain_mlp, global_gain_mlp, tiny_hf

pytest.importorskip("transformers")

LLAMA = "tests.models:tiny_hf"
CUT = "model.layers.1:3"
MLP = "tests.models:configured_mlp"
GAIN_MLP = "tests.models:gain_mlp"
GLOBAL_MLP = "tests.models:global_gain_mlp"
LORA = "tests.models:tiny_tied_lora"
MASKED = "tests.models:masked_mlp"


@pytest.fixture(scope="module")
def cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", LLAMA,
                                     "--model", MLP, "--model", GAIN_MLP,
                                     "--model", GLOBAL_MLP, "--model", LORA, "--model", MASKED)
    yield address
    stop(proc)


def _ids() -> torch.Tensor:
    return torch.randint(0, 128, (2, 10), generator=torch.Generator().manual_seed(3))


def _step(model, opt) -> float:
    """One training step of a causal LM on the same batch; its loss."""
    ids = _ids()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _llama(cloud, **factory):
    return splitft.split(tiny_hf("llama", **factory).train(), CUT, connect=cloud,
                         factory=splitft.Factory(LLAMA, {"kind": "llama", **factory}))


def _assert_same(split_state: dict, local_state: dict) -> None:
    assert set(split_state) == set(local_state)
    for name, value in local_state.items():
        assert torch.equal(split_state[name], value), name


def test_the_attention_kernel_set_after_split_is_refused_before_the_cloud_runs_and_set_back_trains_exactly(cloud):
    local = tiny_hf("llama").train()
    local_opt = torch.optim.AdamW(local.parameters(), lr=1e-2)
    for _ in range(2):
        _step(local, local_opt)
    model = _llama(cloud)
    with model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, opt)
        model.set_attn_implementation("eager")  # the public method; the cloud's layers would keep sdpa
        with pytest.raises(ConfigError, match=r"config\._attn_implementation changed after split\(\) \('sdpa' -> "
                                              r"'eager'\): 'model\.layers\.1\.self_attn' reads it"):
            _step(model, opt)
        model.config._attn_implementation = "sdpa"
        _step(model, opt)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_same(state, local.state_dict())


def test_settings_only_the_edge_reads_may_change_after_split_and_train_exactly(cloud):
    def script(model) -> dict:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        _step(model, opt)
        model.config.use_cache = False  # what fine-tuning scripts and Trainer do
        model.config.pad_token_id = 0
        model.generation_config.pad_token_id = 0
        _step(model, opt)
        return {k: v.clone() for k, v in model.state_dict().items()}

    local = script(tiny_hf("llama").train())
    with _llama(cloud) as model:
        split = script(model)
    _assert_same(split, local)


def test_an_attention_kernel_the_factory_does_not_build_is_refused_at_the_handshake_and_one_it_builds_is_exact(cloud):
    edited = tiny_hf("llama").train()
    edited.set_attn_implementation("eager")  # before split(), but the factory builds sdpa
    with pytest.raises(HandshakeError, match=r"the cloud's 'model\.layers\.1' differs.*config setting it reads.*"
                                             r"'_attn_implementation': '\"sdpa\"'"):
        splitft.split(edited, CUT, connect=cloud, factory=splitft.Factory(LLAMA, {"kind": "llama"}))

    local = tiny_hf("llama", attn_implementation="eager").train()
    local_opt = torch.optim.AdamW(local.parameters(), lr=1e-2)
    with _llama(cloud, attn_implementation="eager") as model:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            _step(local, local_opt)
            _step(model, opt)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    _assert_same(state, local.state_dict())


def test_a_users_layer_reading_its_config_as_it_runs_is_guarded_too(cloud):
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    net = configured_mlp()
    model = splitft.split(net, 2, factory=MLP, connect=cloud)
    with model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        crit = model.remote_loss(torch.nn.CrossEntropyLoss())
        crit(model(x), y).backward()
        opt.step()
        net.config.note = "changed"  # no layer reads it
        model(x)
        net.config.scale = 2.0  # the cloud's ScaledLinear would go on multiplying by 1.0
        with pytest.raises(ConfigError, match=r"config\.scale changed after split\(\) \(1\.0 -> 2\.0\): '2' reads it"):
            model(x)
    with pytest.raises(HandshakeError, match=r"config setting it reads.*'scale': '1\.0'"):
        splitft.split(configured_mlp(scale=2.0), 2, factory=MLP, connect=cloud)


def test_a_settings_object_under_another_name_is_guarded_too(cloud):
    """A script's own dataclass kept as ``self.cfg`` and read as ``self.cfg.gain``."""
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    net = gain_mlp()
    model = splitft.split(net, 2, factory=GAIN_MLP, connect=cloud)
    with model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.remote_loss(torch.nn.CrossEntropyLoss())(model(x), y).backward()
        opt.step()
        net.cfg.note = "changed"  # no layer reads it
        model(x)
        net.cfg.gain = 2.0
        with pytest.raises(ConfigError, match=r"cfg\.gain changed after split\(\) \(1\.0 -> 2\.0\): '2' reads it"):
            model(x)
    with pytest.raises(HandshakeError, match=r"config setting it reads.*'cfg\.gain': '1\.0'"):
        splitft.split(gain_mlp(gain=2.0), 2, factory=GAIN_MLP, connect=cloud)
    assert keys_read(Gain, "cfg") == {"gain"} and not keys_read(Gain)


def test_a_module_level_dict_a_cloud_layer_reads_changed_in_place_is_guarded_too(cloud, monkeypatch):
    """``mymodels.SETTINGS["scale"] = 2.0``: the same object, changed; the cloud's copy is its import's."""
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    with splitft.split(global_gain_mlp(), 2, factory=GLOBAL_MLP, connect=cloud) as model:
        model.remote_loss(torch.nn.CrossEntropyLoss())(model(x), y).backward()
        monkeypatch.setitem(tests.models.GATE_SETTINGS, "scale", 2.0)
        with pytest.raises(ConfigError, match=r"tests\.models\.GATE_SETTINGS changed after split\(\) "
                                              r"\(\{'scale': 1\.0\} -> \{'scale': 2\.0\}\)"):
            model(x)
        monkeypatch.setitem(tests.models.GATE_SETTINGS, "scale", 1.0)
        model(x)


def test_a_module_level_setting_a_cloud_layer_reads_is_guarded_too(cloud, monkeypatch):
    """``mymodels.GATE_GAIN = 2.0`` in a script: the cloud's process keeps the value its import gave."""
    x, y = torch.randn(8, 12), torch.randint(0, 3, (8,))
    model = splitft.split(global_gain_mlp(), 2, factory=GLOBAL_MLP, connect=cloud)
    with model:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model.remote_loss(torch.nn.CrossEntropyLoss())(model(x), y).backward()
        opt.step()
        monkeypatch.setattr(tests.models, "GATE_GAIN", 2.0)
        with pytest.raises(ConfigError, match=r"tests\.models\.GATE_GAIN changed after split\(\) \(1\.0 -> 2\.0\): "
                                              r"'2' reads it .* Change it in the module itself"):
            model(x)
        monkeypatch.setattr(tests.models, "GATE_GAIN", 1.0)
        model(x)
    monkeypatch.setattr(tests.models, "GATE_GAIN", 2.0)
    with pytest.raises(HandshakeError, match=r"'tests\.models\.GATE_GAIN': '1\.0'"):
        splitft.split(global_gain_mlp(), 2, factory=GLOBAL_MLP, connect=cloud)
    assert [(m.__name__, set(names)) for m, names in globals_read(GlobalGain)] == [
        ("tests.models", {"GATE_GAIN", "GATE_SETTINGS"})]
    assert globals_read(Gain) == ()  # it reads torch and its own settings object: nothing plain of its module


def test_peft_disable_adapter_on_a_split_model_computes_as_the_unsplit_model_and_training_goes_on(cloud):
    """``with model.disable_adapter():`` (a DPO reference pass) sets a flag on every LoRA layer,
    which each layer's code reads: the cloud's layers get it too (they used to keep their adapters
    on, silently), and get it back when the context ends."""
    pytest.importorskip("peft")
    from tests.models import tiny_tied_lora

    def step(model, opt) -> None:
        ids = _ids()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    def script(model) -> tuple[torch.Tensor, torch.Tensor]:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        step(model, opt)  # the adapters move away from zero: disabling them now changes the logits
        with torch.no_grad():
            with model.disable_adapter():
                reference = model(input_ids=_ids()).logits
            policy = model(input_ids=_ids()).logits
        step(model, opt)
        return reference, policy

    local = tiny_tied_lora()
    expected = script(local)
    model = splitft.split(tiny_tied_lora(), "base_model.model.model.layers.1:3", factory=LORA, connect=cloud)
    with model:
        got = script(model)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    assert not torch.equal(expected[0], expected[1])  # the adapters matter
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    _assert_same(state, local.state_dict())



def test_peft_merge_adapter_names_no_grad_and_under_it_merges_both_halves_as_unsplit(cloud):
    """peft's ``merge_adapter()`` computes each adapter's delta with gradients on, which a cloud
    layer's cannot be (the cloud computes values, not graphs): refused at the first cloud layer,
    naming torch.no_grad(), under which the same call merges the rest (peft skips the edge's layers,
    merged already) and the model computes and trains on as the unsplit one."""
    pytest.importorskip("peft")
    from tests.models import tiny_tied_lora

    def script(model, split: bool) -> torch.Tensor:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        _step(model, opt)  # the adapters move away from zero: merging them changes the weights
        if split:
            with pytest.raises(PlaceholderError, match=r"peft's merge_adapter\(\).*under torch\.no_grad\(\), where peft "
                                                       r"skips the layers merged already"):
                model.merge_adapter()
        with torch.no_grad():
            model.merge_adapter()
            merged = model(input_ids=_ids()).logits
            model.unmerge_adapter()
        _step(model, opt)
        return merged

    local = tiny_tied_lora()
    expected = script(local, False)
    model = splitft.split(tiny_tied_lora(), "base_model.model.model.layers.1:3", factory=LORA, connect=cloud)
    with model:
        got = script(model, True)
        state = {k: v.clone() for k, v in model.state_dict().items()}
    assert torch.equal(got, expected)
    _assert_same(state, local.state_dict())


def test_peft_scale_layer_changes_each_lora_layers_scaling_in_place_and_the_cloud_layers_follow(cloud):
    """``layer.scale_layer(0.5)`` (how PEFT turns an adapter's strength down) changes the dict a
    LoRA layer's code reads, ``scaling``, in place, with no attribute set: the cloud's layers get the
    new scaling (they kept the old one, silently), and ``unscale_layer()`` puts it back."""
    pytest.importorskip("peft")
    from tests.models import tiny_tied_lora

    def script(model) -> list[float]:
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        layers = [m for m in model.modules() if hasattr(m, "scale_layer") and hasattr(m, "scaling")]
        assert len(layers) == 8  # q and v of each of the four decoder layers, cloud ones included
        losses = []
        for i in range(5):
            if i == 1:
                for layer in layers:
                    layer.scale_layer(0.5)
            if i == 3:
                for layer in layers:
                    layer.unscale_layer()
            losses.append(_step(model, opt))
        return losses

    local = tiny_tied_lora()
    expected = script(local)
    model = splitft.split(tiny_tied_lora(), "base_model.model.model.layers.1:3", factory=LORA, connect=cloud)
    with model:
        assert script(model) == expected
        _assert_same(model.state_dict(), local.state_dict())

def test_a_private_flag_set_to_something_the_cloud_cannot_take_is_refused_and_a_hostile_one_too(cloud):
    pytest.importorskip("peft")
    from splitft.config_reads import apply_flags
    from splitft.errors import ProtocolError
    from tests.models import tiny_tied_lora

    model = splitft.split(tiny_tied_lora(), "base_model.model.model.layers.1:3", factory=LORA, connect=cloud)
    layer = model.get_submodule("base_model.model.model.layers.1.self_attn.q_proj")
    with model:
        layer._disable_adapters = object()  # no plain value: nothing the cloud could be sent
        with pytest.raises(ConfigError, match=r"_disable_adapters of 'base_model\.model\.model\.layers\.1\.self_attn"
                                              r"\.q_proj' changed after split\(\)"):
            model(input_ids=_ids())
        layer._disable_adapters = False
        model(input_ids=_ids())
    disabled = tiny_tied_lora()
    disabled.get_submodule("base_model.model.model.layers.1.self_attn.q_proj")._disable_adapters = True
    # before the cut, both sides must start alike: refused at the handshake, the cloud's flags shown
    with pytest.raises(HandshakeError, match=r"q_proj': {.*'_active_adapter': '\[\"default\"\]', .*"
                                             r"'_disable_adapters': 'false'.*'scaling': '{\"default\": 2.0}'"):
        splitft.split(disabled, "base_model.model.model.layers.1:3", factory=LORA, connect=cloud)
    cloud_side = {"q": tiny_tied_lora().get_submodule("base_model.model.model.layers.1.self_attn.q_proj")}
    for flags in ({"q": {"_forward_hooks": {}}}, {"q": {"_disable_adapters": [object]}}, {"nowhere": {}}, ["q"],
                  {"q": {"_disable_adapters": True, "training": False}}):
        with pytest.raises(ProtocolError):
            apply_flags(cloud_side, flags)
    assert cloud_side["q"]._disable_adapters is False  # a refused message set none of its flags
    apply_flags(cloud_side, {"q": {"_disable_adapters": True}})
    assert cloud_side["q"]._disable_adapters is True


class _Cached(nn.Module):
    """A layer whose forward reads a cache its own methods fill (peft's DoRA keeps a weight's norm so)."""

    def __init__(self) -> None:
        super().__init__()
        self._caches: dict = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * len(self._caches)


def test_a_cache_a_cloud_layer_reads_filled_after_split_is_refused_shown_short_naming_unsplit():
    layer = _Cached()
    flags = ModuleFlags([("layer", layer)])
    layer._caches = {"default-weight_norm": torch.arange(1000.0)}
    with pytest.raises(ConfigError, match=r"_caches of 'layer' changed after split\(\) \(\{\} -> [^\n]{0,90}\): "
                                          r".*after model\.unsplit\(\)"):
        flags.changed()


def test_what_a_layer_reads_in_init_is_not_a_setting_it_reads_as_it_runs():
    class Built(torch.nn.Module):
        def __init__(self, config) -> None:
            super().__init__()
            self.config = config
            self.width = config.width  # copied once: the module's repr and parameters carry it

        def forward(self, x):
            return x * self.config.gain

    assert keys_read(Built) == {"gain"}
    assert keys_read(ScaledLinear) == {"scale"}


@pytest.mark.parametrize("how", ["argument", "config"])
def test_hidden_states_asked_of_a_split_model_are_refused_naming_what_asked(cloud, how):
    """transformers records hidden states with hooks on every layer, the cloud's too, where they
    would never run: refused, saying so, rather than as a hook the script never registered."""
    with _llama(cloud) as model:
        ids = _ids()
        kwargs = {"output_hidden_states": True} if how == "argument" else {}
        if how == "config":
            model.config.output_hidden_states = True
        with pytest.raises(splitft.errors.CutError, match=r"asked for hidden states or attentions.*"
                                                           r"'model\.layers\.1\.self_attn' runs in the cloud"):
            model(input_ids=ids, **kwargs)


def test_a_tensor_setting_is_compared_by_its_values():
    from splitft.config_reads import ConfigGuard

    net = configured_mlp()
    net.config.scale = torch.tensor([1.0, 1.0])
    guard = ConfigGuard([("2", net[2])])
    guard.check()  # unchanged: no elementwise truth value asked of it
    net.config.scale[0] = 2.0  # changed in place
    with pytest.raises(ConfigError, match=r"config\.scale changed after split\(\)"):
        guard.check()


def test_model_model_of_a_split_causal_lm_is_its_decoder_and_freezing_it_trains_the_head_alone_as_unsplit(cloud):
    """``model.model`` of a transformers causal LM is its decoder; a script that freezes it to
    train the head alone (a linear probe) must freeze the same parameters split, not the head too."""

    def probe(model) -> list[float]:
        for p in model.model.parameters():
            p.requires_grad = False
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
        return [_step(model, opt) for _ in range(3)]

    local = tiny_hf("llama").train()
    expected = probe(local)
    with _llama(cloud) as model:
        assert type(model.model).__name__ == "LlamaModel" and model.wrapped.model is model.model
        assert probe(model) == expected
        _assert_same(model.state_dict(), local.state_dict())


@pytest.mark.parametrize("change", ["mask", "temperature"])
def test_a_plain_tensor_a_cloud_layer_reads_changed_in_place_is_refused_before_the_cloud_runs_and_set_back_trains_on(
        cloud, change):
    """``layer.mask[:8] = 0`` on a tensor the layer keeps without registering it (no parameter, no
    buffer): nothing carries it to the cloud's layer, so the next forward is refused, naming it;
    set back, training goes on exactly."""
    from tests.models import masked_mlp
    from tests.test_faults import _data

    data = _data(4)

    def step(model, opt, crit, x, y) -> None:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()

    local = masked_mlp()
    local_opt = torch.optim.SGD(local.parameters(), lr=0.1)
    for x, y in data:
        step(local, local_opt, torch.nn.CrossEntropyLoss(), x, y)
    net = masked_mlp()
    with splitft.split(net, 2, factory=MASKED, connect=cloud) as model:
        opt, crit = torch.optim.SGD(model.parameters(), lr=0.1), model.remote_loss(torch.nn.CrossEntropyLoss())
        step(model, opt, crit, *data[0])
        tensor = getattr(net[2], change)
        before = tensor.clone()
        tensor.mul_(0.5) if change == "temperature" else tensor[:8].zero_()
        with pytest.raises(ConfigError, match=rf"{change} of '2', a tensor its code reads that is neither a parameter "
                                              r"nor a buffer, was changed in place after split\(\).*register_buffer"):
            step(model, opt, crit, *data[1])
        tensor.copy_(before)
        for x, y in data[1:]:
            step(model, opt, crit, x, y)
        _assert_same(model.state_dict(), local.state_dict())


def test_a_plain_tensor_changed_before_split_and_not_in_the_factory_is_refused_at_the_handshake(cloud):
    """The cloud builds its layer with the factory's mask: a mask changed on the edge's model
    before the cut (and not in the factory) is refused at the handshake, shown with the cloud's."""
    from tests.models import masked_mlp

    net = masked_mlp()
    net[2].mask[:4] = 0
    with pytest.raises(HandshakeError, match=r"'2': {'mask': 'tensor float32 \[16\] [0-9a-f]{16}'"):
        splitft.split(net, 2, factory=MASKED, connect=cloud)
    splitft.split(masked_mlp(), 2, factory=MASKED, connect=cloud).close()  # as the factory builds it: accepted


def test_a_cloud_takes_settings_only_of_layers_whose_output_they_cannot_grow():
    """A dropout's rate, a batch norm's momentum: set as sent. An upsampling's factor or a pooling's
    size an edge sends would make the cloud's forward hold more than the request was priced for:
    refused, and refused on the edge when the script sets them (as any change the cloud cannot take)."""
    from torch import nn

    from splitft.config_reads import apply_flags
    from splitft.errors import ProtocolError

    cloud_side = {"drop": nn.Dropout(0.5), "norm": nn.BatchNorm1d(4), "up": nn.Upsample(scale_factor=2),
                  "pool": nn.MaxPool2d(2)}
    apply_flags(cloud_side, {"drop": {"p": 0.0}, "norm": {"momentum": None, "eps": 1e-3}})
    assert (cloud_side["drop"].p, cloud_side["norm"].momentum, cloud_side["norm"].eps) == (0.0, None, 1e-3)
    for flags in ({"up": {"scale_factor": 1e6}}, {"pool": {"kernel_size": 1}}, {"drop": {"p": 0.1}, "up": {"size": 9}}):
        with pytest.raises(ProtocolError, match="no flag its code reads"):
            apply_flags(cloud_side, flags)
    assert cloud_side["drop"].p == 0.0 and cloud_side["up"].scale_factor == 2.0  # a refused message set none
