"""Generation through the split: ``model.generate()`` on a split causal LM keeps the cloud layers'
key/value cache in the cloud (only its number crosses), gives the unsplit model's tokens, counts the
cache against the session's memory, and frees it when the generation's cache goes or the session ends."""

from __future__ import annotations

import gc

import pytest
import torch

import splitft
from tests.conftest import InprocCloud
from tests.models import tiny_hf

pytest.importorskip("transformers")

FACTORY = splitft.Factory("tests.models:tiny_hf", {"kind": "llama"})


@pytest.fixture
def cloud():
    server = InprocCloud(["tests.models:tiny_hf"])
    yield server
    server.close()


def _prompts():
    ids = torch.randint(3, 128, (3, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding, as generation pads
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def test_greedy_generation_equals_the_unsplit_model_with_the_cache_in_the_cloud(cloud):
    ids, mask = _prompts()
    local = tiny_hf("llama")
    expected = local.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
    model = splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect)
    seen = []

    def look(*_):  # after each step's cloud trunk: what the cloud session holds
        session = next(iter(cloud.server.sessions.values()))
        seen.append((len(session.caches._caches), session.caches.nbytes(), session.held_bytes()))

    handle = model.model.model.layers[3].register_forward_pre_hook(look)
    with model:
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        handle.remove()
        assert torch.equal(tokens, expected)
        assert len(seen) == 10 and all(count == 1 for count, _, _ in seen)
        grown = [nbytes for _, nbytes, _ in seen]
        assert grown == sorted(grown) and grown[0] > 0  # the cache grows in the cloud, token by token
        assert all(held >= nbytes for _, nbytes, held in seen)  # and counts against the session
        gc.collect()
        model.sync()
        session = next(iter(cloud.server.sessions.values()))
        assert session.caches.nbytes() == 0 and not session.caches._caches  # freed with the edge's cache
        again = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
        torch.testing.assert_close(again, expected[:, :ids.shape[1] + 4], rtol=0, atol=0)
    assert not cloud.server.sessions  # the session ended, and its caches with it


def test_training_after_generation_is_unchanged(cloud):
    """A generation between steps neither trains nor leaves anything behind that changes training."""
    ids, mask = _prompts()

    def run(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for i in range(3):
            loss = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(mask == 0, -100),
                         use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 1:
                model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
                model.train()
        return model.state_dict()

    expected = run(tiny_hf("llama").train())
    model = splitft.split(tiny_hf("llama").train(), "model.layers.1:3", factory=FACTORY, connect=cloud.connect)
    with model:
        state = run(model)
    for name, value in expected.items():
        torch.testing.assert_close(state[name], value, rtol=1e-4, atol=1e-5, msg=name)
