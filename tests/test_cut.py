"""Cutting models by name: what moves, what stays, and clear errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitft.errors import CutError
from splitft.app.models import digits_cnn
from splitft.cut import cloud_module_names, cut_text, extract, fingerprint, parse_cut
from splitft.edge.ghosts import install, standin_of
from tests.models import mlp, residual_net


def test_plain_cut_by_name_and_by_index():
    model = digits_cnn()
    assert cloud_module_names(model, parse_cut(model, "block3")) == ["block3", "head"]
    assert cloud_module_names(model, parse_cut(model, 2)) == ["block3", "head"]


def test_nested_plain_cut_takes_the_rest_of_every_enclosing_sequential():
    model = digits_cnn()
    assert cloud_module_names(model, parse_cut(model, "block2.1")) == ["block2.1", "block2.2", "block3", "head"]


def test_ushape_by_rejoin_and_by_slice():
    model = digits_cnn()
    assert cloud_module_names(model, parse_cut(model, "block2", "head")) == ["block2", "block3"]
    assert cloud_module_names(model, parse_cut(model, "block2.0:2")) == ["block2.0", "block2.1"]
    assert cloud_module_names(model, parse_cut(model, "block2.1:")) == ["block2.1", "block2.2"]


def test_unknown_name_lists_close_matches():
    with pytest.raises(CutError, match="close matches: block3"):
        parse_cut(digits_cnn(), "blok3")


def test_plain_cut_of_a_non_chain_is_refused_with_the_fix():
    with pytest.raises(CutError, match="U-shape"):
        cloud_module_names(residual_net(), parse_cut(residual_net(), "stage1"))


def _reused_activation() -> nn.Sequential:
    act = nn.ReLU()
    return nn.Sequential(nn.Linear(4, 8), act, nn.Linear(8, 8), act, nn.Linear(8, 8), act, nn.Linear(8, 2))


def test_a_module_put_in_two_places_is_counted_at_each_and_refused_in_the_cloud_half():
    """``act = nn.ReLU()`` reused: ``nn.Sequential`` calls it at each place, where torch's
    ``named_children()`` lists it once. Cuts name and count every place (the cloud half ran the
    layers without the ones between them, and index 3 cut at '4'); the cloud half holding one of
    them is refused, naming the other place."""
    model = _reused_activation()
    assert cloud_module_names(model, parse_cut(model, 6)) == ["6"]
    assert cloud_module_names(model, parse_cut(model, "2", "4")) == ["2", "3"]
    assert cut_text(parse_cut(model, 3), model) == ("3", None)
    extract(model, parse_cut(model, 6))  # the last layer alone: nothing shared
    for cut, rejoin in ((2, None), ("2", "4"), ("3:5", None)):
        with pytest.raises(CutError, match=r"'3', which runs in the cloud, is the same module object as '1'.*its "
                                           r"own instance"):
            extract(model, parse_cut(model, cut, rejoin))
    shared = nn.Linear(8, 8)
    twice_in_the_cloud = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), shared, nn.Tanh(), shared, nn.Linear(8, 2))
    with pytest.raises(CutError, match=r"'2', which runs in the cloud, is the same module object as '4'"):
        extract(twice_in_the_cloud, parse_cut(twice_in_the_cloud, 2))


def test_a_container_reached_through_a_wrappers_attribute_is_cut_at_its_own_name():
    """peft's PeftModel hands attribute reads on to the model it wraps: ``model.model.layers`` reaches
    the layers, whose parameters go by ``base_model.model.model.layers...``. Refused naming that."""
    pytest.importorskip("peft")
    from tests.models import tiny_tied_lora

    model = tiny_tied_lora()
    with pytest.raises(CutError, match=r"'model\.model\.layers' reaches 'base_model\.model\.model\.layers' by "
                                       r"another name .* cut there"):
        parse_cut(model, "model.model.layers.1:3")
    assert parse_cut(model, "base_model.model.model.layers.1:3").parent == "base_model.model.model.layers"


def test_rejoin_must_be_a_later_sibling():
    with pytest.raises(CutError, match="after"):
        parse_cut(digits_cnn(), "block3", "block1")
    with pytest.raises(CutError, match="sibling"):
        parse_cut(digits_cnn(), "block3", "head.1")


def test_installed_edge_holds_no_cloud_values_only_named_placeholders():
    model = digits_cnn()
    total = {n: (p.shape, p.dtype) for n, p in model.named_parameters()}
    chain = install(model, parse_cut(model, "block3", "head"), remote=lambda *a, **k: None)
    after = dict(model.named_parameters())
    assert {n: (p.shape, p.dtype) for n, p in after.items()} == total  # same names, shapes, dtypes
    cloud = set(chain.qualified_parameters())
    assert cloud and all(after[n].device.type == "meta" for n in cloud)
    assert not any(p.device.type == "meta" for n, p in after.items() if n not in cloud)
    assert isinstance(model.block3, type(chain.stages[0])) and type(model.block3).__name__ == "Sequential"
    assert standin_of(model.block3) is not None


def test_the_fingerprint_tells_weights_tied_in_the_cloud_half_from_untied_ones():
    """``net[4].weight = net[2].weight`` made before split() but not by the factory: the cloud
    would train two weights where the model has one; the handshake's fingerprint differs. Tied
    alike, it is the same, before the cut and after it (a resumed session's handshake)."""
    def net(tied: bool) -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
        if tied:
            model[4].weight = model[2].weight
        return model

    prints = {tied: fingerprint(extract(net(tied), parse_cut(net(tied), 2))) for tied in (False, True)}
    assert prints[False] != prints[True]
    model = net(True)
    install(model, parse_cut(model, 2), remote=lambda *a, **k: None)
    assert fingerprint(extract(model, parse_cut(model, 2))) == prints[True]


@pytest.mark.parametrize("how", ["a view made a parameter", ".data assigned"])
def test_a_cloud_weight_sharing_memory_with_an_edge_weight_is_refused(how):
    """A tied autoencoder, its decoder's weight the encoder's transposed (``nn.Parameter(enc.weight.t())``),
    or a weight's ``.data`` taken from another: two parameters over one memory, trained apart once
    cut between them (only the one-object tie was refused)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 12))
    if how == ".data assigned":
        model[4].weight.data = model[0].weight.data.t()
    else:
        model[4].weight = nn.Parameter(model[0].weight.t())
    with pytest.raises(CutError, match=r"'0\.weight' runs on the edge but is the same tensor as '4\.weight', or "
                                       r"shares its memory"):
        install(model, parse_cut(model, 2), remote=lambda *a, **k: None)
    assert all(p.device.type != "meta" for p in model.parameters())  # refused before anything was cut


def test_a_trunk_whose_modules_are_not_chained_is_detected():
    class Parallel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)
            self.c = nn.Linear(4, 4)

        def forward(self, x):
            return self.c(self.a(x) + self.b(x))  # b does not consume a's output

    model = Parallel()
    install(model, parse_cut(model, "a", "c"), remote=lambda x: x * 2)
    with pytest.raises(CutError, match="does not feed"):
        model(torch.ones(2, 4))


class Counted(nn.Module):
    """A layer that counts the layers before it: takes ``h`` or ``(h, count)``, returns both."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inp):
        h, count = inp if isinstance(inp, tuple) else (inp, 0)
        return self.lin(h), count + 1


def test_a_chain_under_sequential_hands_on_whole_tuples_and_one_under_a_loop_their_first_element():
    """nn.Sequential passes a module's tuple on whole (a GRU's output and state); a model's loop
    over its decoder layers takes their first element: the cloud's chain does as its parent does."""
    seq = nn.Sequential(nn.Linear(4, 4), Counted(), Counted(), Counted())
    x = torch.ones(2, 4)
    assert extract(seq, parse_cut(seq, "1")).whole and extract(seq, parse_cut(seq, "1", "3")).whole
    h, count = extract(seq, parse_cut(seq, "1"))(seq[0](x))
    assert count == 3 and torch.equal(h, seq(x)[0])

    class Loop(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Counted() for _ in range(3))

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)  # whole tuples, where the cloud's chain would hand on the first element
            return x[1]

    model = Loop()
    assert not extract(model, parse_cut(model, "layers.0:2")).whole
    install(model, parse_cut(model, "layers.0:2"), remote=lambda x: (x, 1))
    with pytest.raises(CutError, match=r"feeds 'layers.1' the whole tuple .* hands on its first element"):
        model(x)


def test_edge_cannot_call_cloud_modules_after_a_plain_cut():
    model = mlp()
    install(model, parse_cut(model, "2"))
    assert [type(standin_of(m)).__name__ for m in model] == ["NoneType", "NoneType", "CutPoint", "Unreachable", "Unreachable"]


@pytest.mark.parametrize("cut, rejoin", [("block3", None), ("block2", "head"), ("block2.0:2", None),
                                         ("block2.1:", None), ("block1:4", None)])
def test_the_handshake_text_of_a_cut_parses_back_to_the_same_cut(cut, rejoin):
    model = digits_cnn()
    spec = parse_cut(model, cut, rejoin)
    assert parse_cut(model, *cut_text(spec, model)) == spec
