"""Split ≡ local on a real transformers model: a tiny, randomly initialised BERT cut inside its
encoder, U-shape, with padded attention masks; the model's own forward runs on the edge."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import splitft
from splitft import Factory
from splitft.errors import ConfigError, CutError
from splitft.cut import parse_cut
from splitft.edge.ghosts import install

pytest.importorskip("transformers")

from tests.models import tiny_bert  # noqa: E402  (needs transformers)

FACTORY = "tests.models:tiny_bert"
CUT = "bert.encoder.layer.1:3"  # edge: embeddings + layer 0, cloud: layers 1-2, edge: layer 3 + head
STEPS = 12
ACCUMULATE = 2


def _batches(seed: int = 0, batch: int = 6, length: int = 10):
    """Token ids with padding of random lengths, so the attention mask matters."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        ids = torch.randint(1, 100, (batch, length), generator=g)
        lengths = torch.randint(2, length + 1, (batch,), generator=g)
        lengths[0] = length  # one full row, so the batch is not trimmed by accident
        mask = (torch.arange(length) < lengths[:, None]).long()
        yield ids * mask, mask, torch.randint(0, 3, (batch,), generator=g)


def _train(model, opt) -> list[float]:
    losses = []
    for ids, mask, y in _batches():
        for part in torch.chunk(torch.arange(len(y)), ACCUMULATE):
            loss = nn.functional.cross_entropy(model(ids[part], mask[part]), y[part]) / ACCUMULATE
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_tiny_bert_ushape_split_equals_local(inproc_cloud, attn):
    local = tiny_bert(attn_implementation=attn)
    local_losses = _train(local, torch.optim.AdamW(local.parameters(), lr=1e-3))

    model = splitft.split(tiny_bert(attn_implementation=attn), CUT,
                          factory=Factory(FACTORY, kwargs={"attn_implementation": attn}), connect=inproc_cloud.connect())
    with model:
        losses = _train(model, model.attach(torch.optim.AdamW(model.parameters(), lr=1e-3)))
        edge, cloud = model.edge_state_dict(), model.cloud_state_dict()
        sent = model.metrics.bytes[("up", "activation")]
    assert set(cloud) == {k for k in local.state_dict() if k.startswith(("bert.encoder.layer.1.", "bert.encoder.layer.2."))}
    assert set(edge) | set(cloud) == set(local.state_dict()) and set(edge).isdisjoint(cloud)
    for name, value in local.state_dict().items():
        torch.testing.assert_close({**edge, **cloud}[name], value, msg=lambda m: f"{name}: {m}")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(local_losses))
    # The (B, 1, L, L) attention mask crossed as its (B, 1, 1, L) rows: far less than its raw size.
    hidden = sum(3 * 10 * 32 * 4 for _ in range(STEPS * ACCUMULATE))
    assert sent.raw - hidden >= 3 * 10 * 10 * STEPS * ACCUMULATE * 0.9
    assert sent.payload - hidden <= 3 * 10 * 4 * STEPS * ACCUMULATE


def test_tiny_bert_under_bfloat16_autocast_trains_bitwise_as_local(inproc_cloud):
    """What Trainer(bf16=True) on the CPU does: the received activation is no autocast cache's leaf in
    the cloud (its query, key and value layers cast it each, as unsplit, and their input gradients
    add in float32), so the gradient crossing back, and every edge weight, are the unsplit ones."""
    def train(model, opt):  # the forward and loss under autocast, as Trainer runs them
        losses = []
        for ids, mask, y in _batches():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = nn.functional.cross_entropy(model(ids, mask), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        return losses

    local = tiny_bert()
    local_losses = train(local, torch.optim.AdamW(local.parameters(), lr=1e-3))
    with splitft.split(tiny_bert(), CUT, factory=FACTORY, connect=inproc_cloud.connect()) as model:
        losses = train(model, model.attach(torch.optim.AdamW(model.parameters(), lr=1e-3)))
        state = model.state_dict()
    assert losses == local_losses
    assert all(torch.equal(state[k], v) for k, v in local.state_dict().items())


def test_frozen_edge_sends_no_gradient_and_equals_local_with_a_frozen_bottom(inproc_cloud):
    """SFT's eliminated link: the cut's input needs no gradient, so none crosses back; the head
    after the trunk still trains, exactly like local training with the bottom frozen."""
    local = tiny_bert()
    for p in [*local.bert.embeddings.parameters(), *local.bert.encoder.layer[0].parameters()]:
        p.requires_grad_(False)
    _train(local, torch.optim.AdamW([p for p in local.parameters() if p.requires_grad], lr=1e-3))

    start = tiny_bert().state_dict()
    model = splitft.split(tiny_bert(), CUT, factory=FACTORY, connect=inproc_cloud.connect(), freeze_edge=True)
    with model:
        _train(model, model.attach(torch.optim.AdamW(model.parameters(), lr=1e-3)))
        state = {**model.edge_state_dict(), **model.cloud_state_dict()}
        back = model.metrics.bytes[("down", "gradient")]
    assert back.raw == 0 and back.payload == 0
    for name, value in local.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m: f"{name}: {m}")
    assert torch.equal(state["bert.embeddings.word_embeddings.weight"], start["bert.embeddings.word_embeddings.weight"])
    assert not torch.equal(state["head.weight"], start["head.weight"])
    assert not torch.equal(state["bert.encoder.layer.1.output.dense.weight"],
                           start["bert.encoder.layer.1.output.dense.weight"])


def test_a_misspelt_layer_lists_close_matches():
    with pytest.raises(CutError, match=r"close matches: .*bert\.encoder\.layer\.2"):
        parse_cut(tiny_bert(), "bert.encoder.layers.2")


def test_a_cache_reaches_the_trunk_as_a_cache_and_other_objects_are_refused_by_name():
    """A decoder BERT passes a DynamicCache to every layer: the cloud keeps its own (only a number
    crosses, see test_generation_split); an object that is not a cache cannot cross at all."""
    model = tiny_bert(is_decoder=True)
    seen = []
    install(model, parse_cut(model, CUT), remote=lambda *a, **k: seen.append(k) or a[0])
    ids = torch.randint(1, 100, (2, 5))
    model(ids, torch.ones_like(ids))
    # the keyword's name follows the transformers release ("past_key_values", later "cache")
    assert [k for k, v in seen[0].items() if type(v).__name__.endswith("Cache")]

    class Opaque:
        pass

    layer = model.bert.encoder.layer[1]
    with pytest.raises(ConfigError, match=r"keyword argument 'extra' of 'bert.encoder.layer.1' is a Opaque"):
        layer(torch.zeros(2, 5, 32), extra=Opaque())
