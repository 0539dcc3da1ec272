"""Generation through the split: ``model.generate()`` on a split causal LM keeps the cloud layers'
key/value cache in the cloud (only its number crosses), gives the unsplit model's tokens, counts the
cache against the session's memory, and frees it when the generation's cache goes or the session ends."""

from __future__ import annotations

import gc
import io

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

    handle = model.model.layers[3].register_forward_pre_hook(look)  # the decoder, as unsplit
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


@pytest.mark.parametrize("options", [{"num_beams": 2}, {"num_beams": 3, "num_return_sequences": 2},
                                     {"prompt_lookup_num_tokens": 3}, {"assistant_model": "tiny llama"}],
                         ids=["two beams", "three beams, two returned", "prompt lookup", "assisted"])
def test_beam_search_and_speculative_decoding_equal_the_unsplit_model(cloud, options):
    """Beam search reorders the key/value cache at every token, and speculative decoding (prompt
    lookup, an assistant model) crops the draft tokens it rejects: the cloud layers' part of the
    cache, kept in the cloud, changes there too (it kept its order and its rejected tokens: other
    tokens than the unsplit model's, or a failure in the cloud)."""
    ids, mask = _prompts()
    if "assistant_model" in options:
        options = {"assistant_model": tiny_hf("llama", seed=1)}
    if "num_beams" not in options:  # speculative decoding takes one prompt at a time
        ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])  # repeats: prompt lookup finds drafts in it
        mask = torch.ones_like(ids)
    expected = tiny_hf("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                         pad_token_id=0, **options)
    with splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect) as model:
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                                pad_token_id=0, **options)
    assert torch.equal(tokens, expected)


def test_speculative_decoding_equals_the_unsplit_model_where_transformers_crops_every_layer(cloud, monkeypatch):
    """The transformers of Python 3.10 (5.20) crop every layer of a cache, one that holds nothing
    too (later versions pass it by): on each half, the other half's layers hold nothing, and a
    crop of the rejected drafts must pass them by on both (it failed on the first)."""
    from transformers.cache_utils import DynamicLayer

    def crop_every_layer(self, tokens_to_remove: int) -> None:  # transformers 5.20's DynamicLayer.crop
        if tokens_to_remove == 0:
            return
        self.keys = self.keys[..., : -abs(tokens_to_remove), :]
        self.values = self.values[..., : -abs(tokens_to_remove), :]

    monkeypatch.setattr(DynamicLayer, "crop", crop_every_layer)
    ids = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]])
    options = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "max_new_tokens": 8, "do_sample": False,
               "pad_token_id": 0, "prompt_lookup_num_tokens": 3}
    expected = tiny_hf("llama").generate(**options)
    with splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect) as model:
        assert torch.equal(model.generate(**options), expected)


def test_a_cache_change_is_checked_against_the_cache_and_the_memory_before_it_is_made():
    from transformers import DynamicCache

    from splitft.cloud.caches import SessionCaches
    from splitft.errors import CapacityError, ProtocolError

    caches = SessionCaches()
    cache = caches._get(1)
    assert isinstance(cache, DynamicCache)
    keys = torch.arange(2 * 2 * 3 * 4, dtype=torch.float32).reshape(2, 2, 3, 4)  # batch 2, 3 tokens
    cache.update(keys, keys + 100, 0)
    held = caches.nbytes()

    def fits(extra: int, what: str) -> None:
        if extra > held:
            raise CapacityError(f"{what} does not fit")

    for kind, indices, count in (("reorder", [0, 2], None), ("reorder", [True, 0], None), ("reorder", "01", None),
                                 ("select", [], None), ("repeat", None, 0), ("repeat", None, 10**6),
                                 ("crop", None, 1), ("shuffle", [0, 1], None), (["reorder"], [1, 0], None)):
        with pytest.raises(ProtocolError):
            caches.change(1, kind, indices, count, fits)
    with pytest.raises(ProtocolError):
        caches.change([1], "reorder", [1, 0], None, fits)  # a cache number that is no number
    with pytest.raises(CapacityError, match="repeated does not fit"):
        caches.change(1, "repeat", None, 3, fits)  # three times the cache: over what fits
    assert caches.nbytes() == held and torch.equal(cache.layers[0].keys, keys)  # nothing changed by a refusal
    caches.change(1, "reorder", [1, 0], None, fits)
    assert torch.equal(cache.layers[0].keys, keys.flip(0))
    caches.change(1, "crop", None, -1, fits)
    assert cache.layers[0].keys.shape[2] == 2
    caches.change(2, "reorder", [5], None, fits)  # a cache the cloud's layers never wrote: nothing to change
    for number, source in ((1, 1), (1, 3), (3, "1"), (3, True)):  # onto a cache it has, or from no number
        with pytest.raises(ProtocolError):
            caches.change(number, "copy", None, None, fits, source=source)
    caches.change(3, "copy", None, None, fits, source=9)  # from a cache its layers never wrote: nothing to copy
    with pytest.raises(CapacityError, match="copied does not fit"):
        caches.change(3, "copy", None, None, lambda extra, what: fits(extra + held, what), source=1)
    caches.change(3, "copy", None, None, fits, source=1)
    copied = caches._get(3)
    assert copied is not cache and torch.equal(copied.layers[0].keys, cache.layers[0].keys)
    caches.change(3, "crop", None, -1, fits)
    assert cache.layers[0].keys.shape[2] == 2  # the copy changes alone
    with pytest.raises(ProtocolError):
        caches.change(3, "whole", None, None, fits)  # a cache is made whole as it begins, not after


def test_a_followed_cache_sends_its_changes_and_a_deep_copy_is_followed_as_a_copy_of_it():
    import copy

    from transformers import DynamicCache

    from splitft.edge.remote_call import CacheRefs

    sent: list = []
    refs = CacheRefs(sent.append, lambda: False)
    cache = DynamicCache()
    keys = torch.arange(16.0).reshape(2, 1, 2, 4)
    cache.update(keys, keys, 0)  # the edge's layer wrote this call's 2 tokens
    with pytest.raises(splitft.ConfigError, match=r"already holds 2 tokens .* never saw them"):
        refs.ref(cache, (), new_tokens=1)  # one more than the call wrote: filled before it
    assert refs.ref(cache, (), new_tokens=2).id == 1
    assert isinstance(cache, DynamicCache) and type(cache).__name__ == "DynamicCache"
    twin = copy.deepcopy(cache)  # a prompt cache copied for another continuation: the cloud copies its part
    twin.reorder_cache(torch.tensor([1, 0]))
    assert torch.equal(cache.layers[0].keys, keys) and refs.ref(twin, ()).id == 2
    cache.reorder_cache(torch.tensor([1, 0]))
    cache.batch_select_indices(torch.tensor([True, False]))
    cache.crop(-1)
    assert [(op.id, op.kind, op.indices, op.count, op.source) for op in sent] == [
        (1, "whole", None, None, None),  # made without a model config: the cloud's keeps every token too
        (2, "copy", None, None, 1), (2, "reorder", [1, 0], None, None), (1, "reorder", [1, 0], None, None),
        (1, "select", [0], None, None), (1, "crop", None, -1, None)]
    assert torch.equal(cache.layers[0].keys, keys[1:, :, :1])
    with pytest.raises(splitft.ConfigError, match=r"copy\.copy of a key/value cache .* copy\.deepcopy"):
        copy.copy(cache)
    with pytest.raises(splitft.ConfigError, match=r"saving \(pickling\) a key/value cache the cloud keeps part of"):
        torch.save(cache, io.BytesIO())


def test_a_deep_copy_of_a_prompts_cache_continues_each_branch_as_the_unsplit_model(cloud):
    """transformers' prefix reuse: one prompt's cache, copied for each continuation; each copy's
    cloud layers start from the prompt's keys and values, as the unsplit model's do."""
    import copy

    ids, mask = _prompts()
    branches = torch.tensor([[5], [6], [9]]), torch.tensor([[7], [8], [10]])

    def continuations(model):
        with torch.no_grad():
            prompt = model(input_ids=ids, attention_mask=mask, use_cache=True).past_key_values
            return [model(input_ids=t, past_key_values=copy.deepcopy(prompt), use_cache=True).logits
                    for t in branches]

    expected = continuations(tiny_hf("llama").eval())
    with splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect) as model:
        got = continuations(model.eval())
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_step_after_the_token_embeddings_were_resized_trains_as_the_unsplit_model(cloud):
    """``resize_token_embeddings`` between steps (new special tokens): the split model holds no
    graph of the last step once the script let it go, so the next backward meets the resized
    embedding's gradient accumulator afresh, as the unsplit model's does (a held graph kept the old
    shape's and failed)."""
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))

    def train(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for resized in (False, True):
            if resized:
                model.resize_token_embeddings(136, mean_resizing=False)
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            del loss
        return losses

    torch.manual_seed(1)
    expected = train(tiny_hf("llama"))
    torch.manual_seed(1)
    with splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect) as model:
        assert train(model) == expected


def test_a_backward_through_a_cache_filled_with_gradients_on_is_refused(cloud):
    """A continuation run on a prompt's cache, both with gradients on, then one backward: unsplit
    it runs through the prompt's graph too; the cloud backpropagates each call at its own backward,
    so the prompt's part would not reach the edge (a loss of the continuation alone) or would run
    twice. Refused at the backward; decoding with gradients on, never backpropagated, runs on."""
    ids = torch.randint(3, 128, (2, 8), generator=torch.Generator().manual_seed(0))

    def continued(model):
        prompt = model(input_ids=ids[:, :5], use_cache=True)
        return model(input_ids=ids[:, 5:], past_key_values=prompt.past_key_values, use_cache=True)

    expected = continued(tiny_hf("llama")).logits
    with splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect) as model:
        out = continued(model)
        assert torch.equal(out.logits, expected)
        with pytest.raises(splitft.ConfigError, match=r"a backward through a key/value cache an earlier call filled "
                                                      r"with gradients on"):
            out.logits.sum().backward()


GEMMA2 = splitft.Factory("tests.models:tiny_hf", {"kind": "gemma2"})


def test_a_model_whose_first_full_attention_layer_runs_in_the_cloud_generates_as_the_unsplit_model(cloud):
    """Gemma 2 interleaves sliding-window and full-attention layers, and transformers sizes the full
    attention's masks from its first full layer's cache entry, here a cloud layer's: the edge's
    cache holds that entry's shape, so padded generation and a chunked continuation attend where the
    unsplit model does; the entry's values stay unreadable, a hand edit of it is refused, and a reset
    reaches the cloud."""
    import copy

    ids, mask = _prompts()

    def run(model):
        with torch.no_grad():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0,
                                 output_logits=True, return_dict_in_generate=True)
            cache = model(input_ids=ids[:, :4], use_cache=True).past_key_values
            chunked = model(input_ids=ids[:, 4:], past_key_values=copy.deepcopy(cache), use_cache=True).logits
            cache.reset()
            again = model(input_ids=ids[:, :2], past_key_values=cache, use_cache=True).logits
        return out.sequences, out.logits, chunked, again, cache

    *expected, _ = run(tiny_hf("gemma2"))
    with splitft.split(tiny_hf("gemma2"), "model.layers.1:2", factory=GEMMA2, connect=cloud.connect) as model:
        *got, cache = run(model)
        assert cache.get_seq_length(1) == cache.get_seq_length(0) == 2  # the cloud layer's length, as unsplit
        with pytest.raises(splitft.CutError, match=r"on the keys or values of a decoder layer that runs in the cloud"):
            cache.layers[1].keys.clone()
        for layer in (cache.layers[1], cache.layers[3]):  # the full layers' oldest token evicted by hand
            layer.keys, layer.values = layer.keys[:, :, 1:], layer.values[:, :, 1:]
        with pytest.raises(splitft.CutError, match=r"cache layer 1, a decoder layer that runs in the cloud, were "
                                                   r"changed outside the cache's own methods"):
            model(input_ids=ids[:, 2:3], past_key_values=cache, use_cache=True)
    assert all(torch.equal(a, b) for a, b in zip([got[0], *got[1], *got[2:]], [expected[0], *expected[1], *expected[2:]]))


def test_a_cache_made_without_the_models_config_keeps_every_token_in_the_cloud_too(cloud):
    """``DynamicCache()`` built by a manual decoding loop keeps all tokens of every layer, where
    generate() builds one from the config (a sliding window's layers keep the window): the cloud's
    part of it is made the same way, past the window."""
    from transformers import DynamicCache

    ids = torch.randint(3, 128, (2, 3), generator=torch.Generator().manual_seed(0))

    def decode(model):
        cache, logits, tokens = DynamicCache(), [], ids
        with torch.no_grad():
            for _ in range(4):  # 3 + 4 tokens: past the window of 4
                out = model(input_ids=tokens, past_key_values=cache, use_cache=True)
                logits.append(out.logits)
                tokens = out.logits[:, -1:].argmax(-1)
        return logits

    expected = decode(tiny_hf("mistral"))
    factory = splitft.Factory("tests.models:tiny_hf", {"kind": "mistral"})
    with splitft.split(tiny_hf("mistral"), "model.layers.1:3", factory=factory, connect=cloud.connect) as model:
        got = decode(model)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_split_model_drafts_for_an_unsplit_targets_assisted_generation(cloud):
    """``target.generate(..., assistant_model=split_model)``: transformers asks the assistant for
    private methods of its class (``_supports_logits_to_keep``), which the split model hands on to
    the model it wraps, as for any attribute of its own it lacks."""
    ids, mask = _prompts()

    def drafted(assistant):
        with torch.no_grad():
            return tiny_hf("llama", seed=5).generate(input_ids=ids[:1], max_new_tokens=6, do_sample=False,
                                                      pad_token_id=0, assistant_model=assistant)

    expected = drafted(tiny_hf("llama"))
    with splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect) as model:
        assert torch.equal(drafted(model.eval()), expected)


def test_a_static_cache_is_refused_by_name_before_the_cloud_runs(cloud):
    ids, mask = _prompts()
    with splitft.split(tiny_hf("llama"), "model.layers.1:3", factory=FACTORY, connect=cloud.connect) as model:
        with pytest.raises(splitft.ConfigError, match=r"in a DynamicCache, not a StaticCache"):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0,
                           cache_implementation="static")
        tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    expected = tiny_hf("llama").generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, do_sample=False,
                                         pad_token_id=0)
    assert torch.equal(tokens, expected)  # the session goes on


def test_a_sliding_window_model_generates_past_its_window_as_the_unsplit_model():
    """The cloud's cache takes the model's kind of layer from its config: a sliding window's keep
    only the window, as the edge's do (its layers kept every token, and the masks did not fit)."""
    server = InprocCloud(["tests.models:tiny_hf"])
    try:
        ids, mask = _prompts()
        expected = tiny_hf("mistral").generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                               pad_token_id=0)
        factory = splitft.Factory("tests.models:tiny_hf", {"kind": "mistral"})
        with splitft.split(tiny_hf("mistral"), "model.layers.1:3", factory=factory, connect=server.connect) as model:
            tokens = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                                    pad_token_id=0)
        assert torch.equal(tokens, expected) and tokens.shape[1] > 4 + ids.shape[1]  # well past the window of 4
    finally:
        server.close()
