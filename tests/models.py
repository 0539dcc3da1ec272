"""Small models for tests, importable by a cloud process as ``tests.models:NAME``."""

from __future__ import annotations

import abc
import collections
import contextlib
import dataclasses
import random
import types
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.nn.utils.prune
import torch.utils.checkpoint
from numpy.random import normal as _numpy_normal
from torch import nn
from torch.nn import functional as F


class ResidualNet(nn.Module):
    """Not a chain: functional ops and a skip connection between children, like a ResNet."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.stage1 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.stage2 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.stem(x))
        h = self.stage2(self.stage1(h))
        return self.head(h + 0.5 * torch.flatten(h, 1))


def residual_net(seed: int = 0) -> ResidualNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ResidualNet()


def mlp(seed: int = 0, width: int = 16, dtype: str = "float32") -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                             nn.Linear(width, 3)).to(getattr(torch, dtype))


class TinyBertClassifier(nn.Module):
    """A randomly initialised 4-layer BERT (no download) with mean pooling and a linear head."""

    def __init__(self, num_classes: int = 3, **config: object) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        settings = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                        vocab_size=100, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
        settings.update(config)
        self.bert = BertModel(BertConfig(**settings), add_pooling_layer=False)
        self.head = nn.Linear(settings["hidden_size"], num_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if attention_mask is None:
            return self.head(hidden.mean(dim=1))
        weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0))


def tiny_bert(seed: int = 0, **config: object) -> TinyBertClassifier:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TinyBertClassifier(**config)


def tiny_bert_pretrained(seed: int = 0) -> nn.Module:
    """A randomly initialised 4-layer ``BertForSequenceClassification``: a transformers
    ``PreTrainedModel`` (``save_pretrained``, ``from_pretrained``), no download."""
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=37, max_position_embeddings=64, num_labels=3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BertForSequenceClassification(config).eval()


def tiny_hf(kind: str = "bert", seed: int = 0, dropout: float = 0.0, attn_implementation: str | None = None) -> nn.Module:
    """A randomly initialised transformers model, without dropout unless asked for (hidden and
    attention): ``"bert"`` for sequence classification, ``"llama"`` a causal LM, ``"mistral"`` one
    with a sliding window, ``"gemma2"`` one whose layers alternate a sliding window and full attention; with
    ``attn_implementation``, that attention kernel instead of transformers' default."""
    import transformers

    if kind == "bert":
        config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
                                         intermediate_size=37, max_position_embeddings=64, num_labels=3,
                                         hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
        cls = transformers.BertForSequenceClassification
    elif kind == "llama":
        config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                          tie_word_embeddings=False, attention_dropout=dropout)
        cls = transformers.LlamaForCausalLM
    elif kind == "mistral":  # a causal LM whose layers attend to the last 4 tokens only (a sliding window)
        config = transformers.MistralConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                            tie_word_embeddings=False, attention_dropout=dropout, sliding_window=4)
        cls = transformers.MistralForCausalLM
    elif kind == "gemma2":  # layers alternate a sliding window of 4 tokens (0, 2) and full attention (1, 3)
        config = transformers.Gemma2Config(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           max_position_embeddings=64, pad_token_id=0, sliding_window=4,
                                           query_pre_attn_scalar=8, attention_dropout=dropout)
        cls = transformers.Gemma2ForCausalLM
    elif kind == "t5":  # an encoder-decoder whose blocks share a relative position bias
        config = transformers.T5Config(vocab_size=64, d_model=16, d_kv=4, d_ff=32, num_layers=3, num_decoder_layers=3,
                                       num_heads=4, dropout_rate=dropout, decoder_start_token_id=0, pad_token_id=0)
        cls = transformers.T5ForConditionalGeneration
    else:
        raise ValueError(f"tiny_hf knows 'bert', 'llama', 'mistral', 'gemma2' and 't5', not {kind!r}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config).eval()
    if attn_implementation is not None:
        model.set_attn_implementation(attn_implementation)
    return model


class CountingLinear(nn.Linear):
    """A layer that counts its calls in a plain attribute and halves its output after the third
    (a warm-up the layer keeps itself, as it runs)."""

    def __init__(self, *args, buffer: bool = False, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if buffer:  # the count as the layer's state: a buffer the split model reads back
            self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        else:
            self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return super().forward(x) * (0.5 if self.calls > 3 else 1.0)


def counting_mlp(seed: int = 0, buffer: bool = False) -> nn.Sequential:
    """An MLP whose layer 2 (the cloud's, cut at 2) counts its calls as it runs (in a buffer with ``buffer``)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), CountingLinear(16, 16, buffer=buffer), nn.ReLU(),
                             nn.Linear(16, 3))


def parametrized_mlp(seed: int = 0, how: str = "weight_norm") -> nn.Sequential:
    """The MLP with its middle layer (the first of the cloud half, cut at 2) parametrized by
    ``torch.nn.utils.parametrizations.<how>`` (spectral_norm's starting vectors drawn from ``seed``)."""
    model = mlp(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        getattr(nn.utils.parametrizations, how)(model[2])
    return model


def old_norm_mlp(seed: int = 0, how: str = "weight_norm") -> nn.Sequential:
    """The MLP with its middle layer under torch's old, hook-based ``torch.nn.utils.<how>``."""
    model = mlp(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        getattr(nn.utils, how)(model[2])
    return model


class SequenceOf(nn.Module):
    """What an RNN returns, reduced to its output sequence (``last``: the output at the last step)."""

    def __init__(self, last: bool = False) -> None:
        super().__init__()
        self.last = last

    def forward(self, out: tuple[torch.Tensor, Any]) -> torch.Tensor:
        return out[0][:, -1] if self.last else out[0]


def recurrent_net(seed: int = 0) -> nn.Sequential:
    """Twelve features read as a sequence of four steps by a two-layer GRU and an LSTM (cut at 2:
    both in the cloud half; rejoin at 6: the head on the edge)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.Unflatten(1, (4, 4)), nn.GRU(4, 8, num_layers=2, batch_first=True),
                             SequenceOf(), nn.LSTM(8, 8, batch_first=True), SequenceOf(last=True), nn.Linear(8, 3))


class ActivatedRecurrent(nn.Module):
    """A projection, an activation in the model's forward, and a GRU (returning a tuple): a trunk
    cut from ``a`` to ``rnn`` leaves the activation on the edge, between two cloud modules."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.rnn, self.head = nn.Linear(6, 4), nn.GRU(4, 4, batch_first=True), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(torch.tanh(self.a(x)))
        return self.head(out[:, -1])


def activated_recurrent(seed: int = 0) -> ActivatedRecurrent:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ActivatedRecurrent()


class RandomSkip(nn.Module):
    """Stochastic depth drawn from Python's ``random``: in training, skips its layer with
    probability ``p`` (the generator a cloud process has its own of)."""

    def __init__(self, width: int, p: float = 0.5) -> None:
        super().__init__()
        self.layer, self.p = nn.Linear(width, width), p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and random.random() < self.p:
            return x
        return x + self.layer(x)


class NumpyNoise(nn.Module):
    """Noise from NumPy's global generator, its method imported by name (``from numpy.random import normal``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return x + torch.as_tensor(_numpy_normal(0.0, 0.1, size=tuple(x.shape)), dtype=x.dtype)
        return x


class Skipper:
    """A plain helper a layer holds, deciding with Python's ``random`` whether to skip it."""

    def __init__(self, p: float) -> None:
        self.p = p

    def skip(self) -> bool:
        return random.random() < self.p


class HelpedSkip(nn.Module):
    """Stochastic depth decided by a :class:`Skipper` it holds (its forward calls no generator itself)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer, self.skipper = nn.Linear(width, width), Skipper(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.training and self.skipper.skip() else x + self.layer(x)


def random_skip_mlp(seed: int = 0, numpy: bool = False, helper: bool = False) -> nn.Sequential:
    """The MLP with a :class:`RandomSkip` block (or :class:`NumpyNoise`, or :class:`HelpedSkip`) in its
    cloud half (cut at 2)."""
    model = mlp(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.insert(3, NumpyNoise() if numpy else HelpedSkip(16) if helper else RandomSkip(16))
    return model


#: What :class:`GlobalCounter` and :class:`GlobalCollector` count and collect as they run, at the module's top.
CALLS = 0
SEEN: list[tuple[int, ...]] = []


class GlobalCounter(nn.Linear):
    """A linear layer that counts its calls in a module-level number (``global CALLS``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        global CALLS
        CALLS += 1
        return super().forward(x)


class GlobalCollector(nn.Linear):
    """A linear layer that collects the shapes it saw in a module-level list, through a method of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._collect(x)
        return super().forward(x)

    def _collect(self, x: torch.Tensor) -> None:
        SEEN.append(tuple(x.shape))


class LocalCollector(nn.Linear):
    """A linear layer whose forward keeps shapes in a list of its own that merely shares a module-level name."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        SEEN = [tuple(x.shape)]  # noqa: N806 - a local that shadows the module's list
        SEEN.append(tuple(x.shape))
        return super().forward(x)


def global_writer_mlp(seed: int = 0, kind: str = "count") -> nn.Sequential:
    """The MLP with a :class:`GlobalCounter` (``kind="count"``), :class:`GlobalCollector`
    (``"collect"``) or :class:`LocalCollector` (``"local"``) in its cloud half (cut at 2)."""
    layer = {"count": GlobalCounter, "collect": GlobalCollector, "local": LocalCollector}[kind]
    model = mlp(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model.insert(3, layer(16, 16))
    return model


def channels_last_cnn(seed: int = 0) -> nn.Sequential:
    """The digits CNN converted whole to ``channels_last`` (as timm's ``--channels-last`` converts a model)."""
    from splitft.app.models import digits_cnn

    return digits_cnn(seed).to(memory_format=torch.channels_last)


class PositiveRows(nn.Module):
    """Keeps the rows whose first value is positive: an output whose shape depends on the values."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[x[:, 0] > 0]


def positive_rows_mlp(seed: int = 0) -> nn.Sequential:
    """The MLP ending in :class:`PositiveRows` (in the cloud half when cut at 2)."""
    return nn.Sequential(*mlp(seed), PositiveRows())


class MaskedNoise(nn.Module):
    """Adds noise to the rows whose first value is positive, in training: whether it draws depends on the data."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x[:, 0] > 0
        if self.training and bool(rows.any()):
            x = x.clone()
            x[rows] = x[rows] + 0.1 * torch.randn_like(x[rows])
        return x


def masked_noise_mlp(seed: int = 0) -> nn.Sequential:
    """The MLP after :class:`MaskedNoise` on its input, all in the cloud half when cut at 2."""
    return nn.Sequential(nn.Flatten(), nn.Identity(), MaskedNoise(), *mlp(seed))


class SumOverTime(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(1)


class TransposedFrontEnd(nn.Module):
    """An audio front end's idiom: a Conv1d's output transposed to (batch, time, channels), not
    contiguous, reduced over time by the module after it (the first of a U-shape trunk at ``pool``)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(8, 16, 3, padding=1)
        self.pool = SumOverTime()
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.pool(self.conv(x).transpose(1, 2))))


def transposed_front_end(seed: int = 0) -> TransposedFrontEnd:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TransposedFrontEnd()


class RepeatedStateDecoder(nn.Module):
    """An LSTM autoencoder: the encoder's last state repeated over time into a decoder LSTM (the
    trunk at ``dec``), whose gradient for that input is not contiguous."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.LSTM(3, 8, batch_first=True)
        self.dec = nn.LSTM(8, 8, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, (h, _) = self.enc(x)
        o, _ = self.dec(h[-1].unsqueeze(1).repeat(1, x.size(1), 1))
        return self.out(o)


def repeated_state_decoder(seed: int = 0) -> RepeatedStateDecoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RepeatedStateDecoder()


class PaddedTextEncoder(nn.Module):
    """Token ids through an nn.TransformerEncoder (batch first, nested-tensor fast path on, as by
    default) with a padding mask, mean-pooled into three classes."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, 16)
        layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True)
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        h = self.encoder(self.embed(x), src_key_padding_mask=pad)
        return self.head(h.masked_fill(pad[..., None], 0.0).sum(1) / (~pad).sum(1, keepdim=True))


def padded_text_encoder(seed: int = 0) -> PaddedTextEncoder:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PaddedTextEncoder()


class PackedTagger(nn.Module):
    """Padded sequences packed for an LSTM (the trunk at ``lstm``) and unpacked for a per-step head."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 8, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        return self.head(nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0])


def packed_tagger(seed: int = 0) -> PackedTagger:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return PackedTagger()


def inplace_relu_mlp(seed: int = 0) -> nn.Sequential:
    """The MLP with an in-place ReLU at 1, the first module of the cloud half when cut at 1."""
    model = mlp(seed)
    model[1] = nn.ReLU(inplace=True)
    return model


class AuxLossBlock(nn.Module):
    """A block that appends an auxiliary loss to a list it is handed (the mixture-of-experts idiom)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor, losses: list) -> torch.Tensor:
        losses.append(h.pow(2).mean())
        return torch.relu(self.lin(h))


class AuxLossNet(nn.Module):
    """Blocks handed one list of auxiliary losses, which the forward adds to the output."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.blocks, self.head = nn.Linear(12, 16), nn.ModuleList(AuxLossBlock() for _ in range(3)), nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        losses: list = []
        h = self.inp(x)
        for block in self.blocks:
            h = block(h, losses)
        return self.head(h) + sum(losses)


def aux_loss_net(seed: int = 0) -> AuxLossNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AuxLossNet()


def mlp_dropout(seed: int = 0) -> nn.Sequential:
    """An MLP with dropout in its cloud half (cut at 2): its masks come from the cloud's generator."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.5), nn.Linear(16, 3))


def mlp_dropout_everywhere(seed: int = 0) -> nn.Sequential:
    """Dropout before every cut and after: cut at 3 (and rejoined at 6 for a U-shape), each piece draws."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.5),
                             nn.ReLU(), nn.Linear(16, 16), nn.Dropout(0.2), nn.Linear(16, 3))


def mlp_batchnorm(seed: int = 0) -> nn.Sequential:
    """An MLP whose cloud half normalizes over the batch: a half ``--split-batch`` must refuse."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))



class Bypass(nn.Module):
    """A layer whose own code skips it on a private flag, as PEFT's layers skip their adapters."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self._bypass = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x if self._bypass else self.linear(x)


def bypass_batchnorm_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2, the cloud half holds a layer a script may bypass (a flag) and a batch norm it may
    put in eval mode while the rest trains (a mode)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), Bypass(16), nn.BatchNorm1d(16), nn.Linear(16, 3))


class Masked(nn.Module):
    """A layer that keeps a mask and a temperature as plain tensors (no buffers) and reads them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.mask = torch.ones(width)
        self.temperature = torch.tensor(1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.mask / self.temperature


def masked_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2, the cloud half's first layer reads tensors that are neither parameters nor buffers."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), Masked(16), nn.ReLU(), nn.Linear(16, 3))

class DeepSupervised(nn.Module):
    """An auxiliary head reads the output of ``l2``, the first of the two layers ``l2``, ``l3``."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(12, 16)
        self.l2 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.l3 = nn.Sequential(nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h2 = self.l2(F.relu(self.stem(x)))
        return self.head(self.l3(h2)), self.aux(h2)


def deep_supervised(seed: int = 0) -> DeepSupervised:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DeepSupervised()


def pruned_mlp(seed: int = 0) -> nn.Sequential:
    """:func:`mlp` whose layer 2 is pruned by torch.nn.utils.prune (its weight computed by a hook)."""
    net = mlp(seed)
    torch.nn.utils.prune.l1_unstructured(net[2], "weight", amount=0.3)
    return net


class SparseLookup(nn.Module):
    """Token ids to vectors through ``F.embedding(..., sparse=True)``: a sparse gradient no layer class shows."""

    def __init__(self, sparse: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(20, 4))
        self.sparse = sparse

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight, sparse=self.sparse).flatten(1)


def lookup_mlp(seed: int = 0, layer: str = "functional") -> nn.Sequential:
    """Ids in, a lookup at 1 (the cloud's first module for a cut at 1), then a classifier;
    ``layer``: "functional" (a sparse F.embedding), "embedding" (nn.Embedding(sparse=True))."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        lookup = SparseLookup(True) if layer == "functional" else nn.Embedding(20, 4, sparse=True)
        return nn.Sequential(nn.Identity(), lookup, nn.Flatten(), nn.Linear(16, 3))


class StackBlock(nn.Module):
    """A layer of :class:`LayerStack`: ``settings["scale"]`` scales its output when given."""

    def __init__(self, p: float, most: int | None = None, norm: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16) if norm else nn.Identity()
        self.drop = nn.Dropout(p)
        self.most = most  # a batch larger than this runs out of memory (as a GPU's would)

    def forward(self, h: torch.Tensor, settings: dict | None = None) -> torch.Tensor:
        if self.most is not None and len(h) > self.most:
            raise torch.OutOfMemoryError(f"out of memory at a batch of {len(h)} (at most {self.most} fit)")
        h = self.drop(torch.tanh(self.norm(self.fc(h))))
        return h if settings is None else h * settings["scale"]


class LayerStack(nn.Module):
    """A stack of layers its forward runs in the order ``plan`` gives (None: each once, in order):
    a plan that skips some is LayerDrop's forward in training (BART, Wav2Vec2, Whisper). A script
    may set what runs around each layer's call (``around(i)``: a context, a grad mode or autocast
    switched per layer) and before it (``between(i, settings)``: a draw, a setting changed)."""

    def __init__(self, p: float = 0.0, most: int | None = None, norm: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.layers = nn.ModuleList([StackBlock(p, most, norm) for _ in range(4)])
        self.head = nn.Linear(16, 3)
        self.plan: list[int] | None = None
        self.by_keyword = False  # each layer called as layer(h=h, settings=...)
        self.checkpointed: str | None = None  # each layer in a checkpoint region of its own: "reentrant" or not
        self.around: Callable[[int], Any] | None = None
        self.between: Callable[[int, dict], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        settings = {"scale": 1.0}
        for i in range(len(self.layers)) if self.plan is None else self.plan:
            if self.between is not None:
                self.between(i, settings)
            with self.around(i) if self.around is not None else contextlib.nullcontext():
                if self.checkpointed:
                    h = torch.utils.checkpoint.checkpoint(self.layers[i], h, settings,
                                                          use_reentrant=self.checkpointed == "reentrant")
                else:
                    h = self.layers[i](h=h, settings=settings) if self.by_keyword else self.layers[i](h, settings)
        return self.head(h)


def layer_stack(seed: int = 0, p: float = 0.0, most: int | None = None, norm: bool = False) -> LayerStack:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LayerStack(p, most, norm)


class CheckpointedMLP(nn.Module):
    """:func:`mlp` whose first layer, on the edge, is checkpointed (and compiled, if asked)."""

    def __init__(self, compile_stem: bool = False) -> None:
        super().__init__()
        self.body = mlp()
        if compile_stem:
            self.body[0] = torch.compile(self.body[0], backend="aot_eager")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stem = torch.utils.checkpoint.checkpoint(lambda t: self.body[1](self.body[0](t)), x, use_reentrant=False)
        return self.body[4](self.body[3](self.body[2](stem)))


def checkpointed_mlp(compile_stem: bool = False) -> CheckpointedMLP:
    return CheckpointedMLP(compile_stem)


def tiny_tied_lora(seed: int = 0) -> nn.Module:
    """A randomly initialised causal LM whose lm_head is tied to its embeddings (as most are),
    with seeded PEFT LoRA adapters and its base frozen: the shape of the smollm task's model."""
    import transformers
    from peft import LoraConfig, get_peft_model

    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=True)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.LlamaForCausalLM(config).eval()
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], bias="none",
                          task_type="CAUSAL_LM")
        return get_peft_model(model, lora)


class ScaledLinear(nn.Module):
    """A layer that reads a setting of a shared config object each time it runs, as transformers
    layers read theirs: ``config.scale`` multiplies its output."""

    def __init__(self, config: types.SimpleNamespace, width: int) -> None:
        super().__init__()
        self.config = config
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.config.scale


class ConfiguredMLP(nn.Sequential):
    """An MLP whose layers share one config object (``model.config``), as a transformers model's do."""

    def __init__(self, scale: float) -> None:
        config = types.SimpleNamespace(scale=scale, note="read by no layer")
        super().__init__(nn.Linear(12, 16), nn.ReLU(), ScaledLinear(config, 16), nn.ReLU(), nn.Linear(16, 3))
        self.config = config


def configured_mlp(seed: int = 0, scale: float = 1.0) -> ConfiguredMLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return ConfiguredMLP(scale)


@dataclasses.dataclass
class GainSettings:
    """A script's own settings object, kept under another name than ``config``."""

    gain: float = 1.0
    note: str = "read by no layer"


class Gain(nn.Module):
    """A layer reading ``self.cfg.gain`` each time it runs."""

    def __init__(self, cfg: GainSettings, width: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.cfg.gain


class GainMLP(nn.Sequential):
    """An MLP whose layers share one settings object as ``cfg``."""

    def __init__(self, gain: float) -> None:
        cfg = GainSettings(gain)
        super().__init__(nn.Linear(12, 16), nn.ReLU(), Gain(cfg, 16), nn.ReLU(), nn.Linear(16, 3))
        self.cfg = cfg


def gain_mlp(seed: int = 0, gain: float = 1.0) -> GainMLP:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GainMLP(gain)


#: A module-level setting a layer reads each time it runs (a script may set ``tests.models.GATE_GAIN``).
GATE_GAIN = 1.0
#: Module-level settings in a dict, which a script may change in place (``GATE_SETTINGS["scale"] = 2.0``).
GATE_SETTINGS = {"scale": 1.0}


class GlobalGain(nn.Module):
    """A layer multiplying its output by the module-level :data:`GATE_GAIN`."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * GATE_GAIN * GATE_SETTINGS["scale"]


def global_gain_mlp(seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), GlobalGain(16), nn.ReLU(), nn.Linear(16, 3))


class TemperatureClassifier(nn.Module):
    """A learned temperature on the root module itself (as CLIP's ``logit_scale``), not in any
    child; called with keyword arguments and returning its loss, as a ``transformers.Trainer``
    model does."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))
        self.logit_scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.body(x) * self.logit_scale.exp()
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        return out


def temperature_classifier(seed: int = 0) -> TemperatureClassifier:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return TemperatureClassifier()


class NoisyLinear(nn.Module):
    """A linear layer that adds noise drawn from a generator of its own, seeded where it is built:
    torch's, Python's ``random.Random`` or NumPy's ``default_rng``."""

    def __init__(self, width: int, kind: str = "torch") -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.kind = kind
        self.noise: Any = {"torch": lambda: torch.Generator().manual_seed(0), "random": lambda: random.Random(0),
                           "numpy": lambda: np.random.default_rng(0)}[kind]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "torch":
            noise = torch.randn(x.shape, generator=self.noise)
        elif self.kind == "random":
            noise = torch.tensor([self.noise.gauss(0.0, 1.0) for _ in range(x.numel())]).reshape(x.shape)
        else:
            noise = torch.from_numpy(self.noise.standard_normal(tuple(x.shape), dtype=np.float32))
        return self.lin(x) + 0.1 * noise


def noisy_mlp(seed: int = 0, kind: str = "torch") -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), NoisyLinear(16, kind), nn.ReLU(), nn.Linear(16, 3))


class TwinBias(nn.Module):
    """Two biases of a whole batch's shape added to it: backward hands one gradient tensor to the
    input and to both (what a cloud must not give two parameters as their ``grad``)."""

    def __init__(self, rows: int, width: int) -> None:
        super().__init__()
        self.first = nn.Parameter(torch.randn(rows, width) * 0.1)
        self.second = nn.Parameter(torch.randn(rows, width) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.first + self.second


def twin_bias_mlp(seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 8), nn.ReLU(), TwinBias(4, 8), nn.Linear(8, 3))


class BatchLimited(nn.Module):
    """Runs out of memory above ``most`` rows, as a GPU does: the model of an out-of-memory retry
    (halve the batch, accumulate), which finds its batch size by catching torch's error."""

    def __init__(self, most: int) -> None:
        super().__init__()
        self.most = most

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.most:
            raise torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {x.shape[0]} rows")
        return x


def batch_limited_mlp(seed: int = 0, most: int = 8, dropout: float | None = None) -> nn.Sequential:
    """mlp with a :class:`BatchLimited` at index 2, its cloud half's first module; with ``dropout``,
    a dropout before it (index 2, the limit at 3), whose draws come before memory runs out."""
    net = mlp(seed)
    drop = [] if dropout is None else [nn.Dropout(dropout)]
    return nn.Sequential(net[0], net[1], *drop, BatchLimited(most), net[2], net[3], net[4])


class SpectralMix(nn.Module):
    """A Fourier layer as neural operators write it: complex weights mixing the lowest modes."""

    def __init__(self, width: int = 12, modes: int = 4) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(torch.randn(width, width, modes, dtype=torch.cfloat) / width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        spectrum = torch.fft.rfft(x, dim=-1)
        mixed = torch.zeros_like(spectrum)
        mixed[..., :self.modes] = torch.einsum("bix,iox->box", spectrum[..., :self.modes], self.weight)
        return torch.fft.irfft(mixed, n=x.shape[-1], dim=-1)


class Spectrum(nn.Module):
    """``torch.fft.rfft``'s complex output, handed on as it is."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.fft.rfft(x, dim=-1)


class Magnitude(nn.Module):
    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return (z.abs() + z.real).flatten(1)


def spectral_net(seed: int = 0, spectrum_first: bool = False) -> nn.Sequential:
    """Cut at 1 (rejoin 3): a complex-weighted Fourier layer in the cloud; ``spectrum_first``: the
    edge's complex spectrum crosses the cut instead, and the cloud's output is complex."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if spectrum_first:
            return nn.Sequential(nn.Conv1d(2, 12, 1), Spectrum(), Magnitude(), nn.Linear(12 * 9, 3))
        return nn.Sequential(nn.Conv1d(2, 12, 1), SpectralMix(), nn.Tanh(), nn.Flatten(), nn.Linear(12 * 16, 3))


class SparseGraph(nn.Module):
    """A fixed graph's normalised adjacency kept as a sparse buffer, applied with torch.sparse.mm."""

    def __init__(self, nodes: int = 6, width: int = 12) -> None:
        super().__init__()
        ring = torch.arange(nodes)
        edges = torch.stack([torch.cat([ring, ring]), torch.cat([(ring + 1) % nodes, (ring - 1) % nodes])])
        self.register_buffer("adj", torch.sparse_coo_tensor(edges, torch.full((2 * nodes,), 0.5), (nodes, nodes),
                                                            check_invariants=True))
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(self.adj, self.lin(x))


def sparse_graph_mlp(seed: int = 0) -> nn.Sequential:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 12), nn.ReLU(), SparseGraph(), nn.Linear(12, 3))


class ToSparse(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to_sparse()


class SparseInputLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sparse.mm(x, self.weight.t()) + self.bias


def sparse_activation_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2: the activation at the cut is a sparse tensor."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 12), ToSparse(), SparseInputLinear(12, 3))


class KeptAuxLoss(nn.Module):
    """A gate that keeps its load-balancing loss on itself as its forward runs (fairseq's l_aux,
    DeepSpeed's MoE): the training loop collects ``m.aux_loss`` from the modules that have one."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.gate = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.gate(x).softmax(-1)
        self.aux_loss = (probs.mean(0) ** 2).sum() * 4
        return x * probs.max(-1, keepdim=True).values


def aux_loss_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2 (rejoin 4 for a U-shape): the module keeping its aux loss is in the cloud."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), KeptAuxLoss(), nn.Linear(16, 16), nn.Linear(16, 3))


Scored = collections.namedtuple("Scored", ["logits", "features"])


class ScoredHead(nn.Module):
    """Returns a named tuple (as detection and retrieval heads do): logits and the features."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 3)

    def forward(self, h: torch.Tensor) -> Scored:
        return Scored(self.fc(h), h)


class ScoredLogits(nn.Module):
    def forward(self, out: Scored) -> torch.Tensor:
        return out.logits + 0.0 * out.features.sum()


def scored_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2, rejoin 3: the cloud's module returns a named tuple the edge reads by field."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), ScoredHead(), ScoredLogits())


def _halve_output(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
    return output * 0.5


def _double_input(module: nn.Module, args: Any) -> tuple:
    return (args[0] * 2.0,)


def self_hooked_mlp(seed: int = 0, forward_hook: bool = True) -> nn.Sequential:
    """:func:`mlp` that hooks its own layer 2 as it is built (so the cloud's copy has the hooks too):
    a forward pre-hook doubling its input and (``forward_hook``) a forward hook halving its output."""
    net = mlp(seed)
    net[2].register_forward_pre_hook(_double_input)
    if forward_hook:
        net[2].register_forward_hook(_halve_output)
    return net


class KeptState(nn.Module):
    """A layer whose training forward moves state it keeps: an average of its activations (a buffer
    updated in place, which its output reads), a step counter, or a generator of its own."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.register_buffer("average", torch.zeros(16))
        self.calls = 0
        self.noise = torch.Generator().manual_seed(3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return h
        if self.kind == "average":
            with torch.no_grad():
                self.average.mul_(0.9).add_(h.mean(0), alpha=0.1)
            return h - self.average
        if self.kind == "counter":
            self.calls += 1
            return h * min(1.0, self.calls / 4)
        return h + 0.01 * torch.randn(h.shape, generator=self.noise)


def kept_state_mlp(seed: int = 0, kind: str = "average") -> nn.Sequential:
    """Cut at 2: the layer keeping state is the cloud half's first; a batch norm follows it."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), KeptState(kind), nn.BatchNorm1d(16), nn.Linear(16, 3))


class MaskedSoftmax(nn.Module):
    """Attention-style weights under an additive mask of ``-inf`` kept as a buffer (a causal mask)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)
        self.register_buffer("mask", torch.zeros(16).masked_fill(torch.arange(16) % 3 == 0, float("-inf")))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.lin(h) + self.mask, dim=-1)


def minus_inf_mask_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2: the masked layer is the cloud half's first."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), MaskedSoftmax(), nn.Linear(16, 3))


class SlottedBase(abc.ABC, nn.Module):
    """A layer base class listing abc.ABC before nn.Module (as torch.ao's FakeQuantizeBase does)."""

    @abc.abstractmethod
    def forward(self, h: torch.Tensor) -> torch.Tensor: ...


class SlottedLinear(SlottedBase):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h)


def abc_mlp(seed: int = 0, scripted: bool = False) -> nn.Sequential:
    """Cut at 2: the cloud half's first layer is of a class listing abc.ABC first, or scripted."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        layer = torch.jit.script(nn.Linear(16, 16)) if scripted else SlottedLinear()
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), layer, nn.ReLU(), nn.Linear(16, 3))


class ClassSwitchedNoise(nn.Module):
    """Noise in training, switched for every layer of the class at once (``ClassSwitchedNoise.noise_on``)."""

    noise_on = True
    scale = 0.1

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = self.lin(h)
        if self.training and self.noise_on:
            h = h + self.scale * torch.randn_like(h)
        return h


def class_switched_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2: the class-switched layers are in the cloud half (the last one also on the edge with rejoin 4)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), ClassSwitchedNoise(), ClassSwitchedNoise(), nn.Linear(16, 3))


class LambdaBlock(nn.Module):
    """minGPT's block: its MLP called through a lambda over the block's own modules, and a bound
    method kept as an attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(16)
        self.mlp = nn.ModuleDict(dict(fc=nn.Linear(16, 16), act=nn.GELU()))
        m = self.mlp
        self.mlpf = lambda x: m.act(m.fc(x))
        self.pre = self._normed

    def _normed(self, h: torch.Tensor) -> torch.Tensor:
        return self.ln(h)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.mlpf(self.pre(h))


def lambda_block_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 2 (a U-shape rejoins at 4): two minGPT-style blocks in the cloud half."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), nn.ReLU(), LambdaBlock(), LambdaBlock(), nn.Linear(16, 3))


class RootDropoutNet(nn.Module):
    """A model whose own forward reads its root's ``self.training`` (dropout after its first layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.body = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.relu(self.inp(x)), 0.5, self.training)
        return self.head(torch.relu(self.body(h)))


def root_dropout_net(seed: int = 0) -> RootDropoutNet:
    """Cut U-shape at ``body``, rejoining at ``head``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return RootDropoutNet()


class DetachedProbe(nn.Module):
    """An online linear probe: a head trained on features it does not backpropagate into."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(16, 3)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.lin(h.detach())


def detached_probe_mlp(seed: int = 0) -> nn.Sequential:
    """Cut at 1: the cloud half's backward reaches none of the edge's layers."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(12, 16), DetachedProbe())


class AuxOutBlock(nn.Module):
    """A block that returns its features and an auxiliary head's logits of them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.aux_head = nn.Linear(16, 3)

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(h))
        return h, self.aux_head(h)


class AuxOutNet(nn.Module):
    """U-shape at ``blk`` (rejoin ``head``): a script may leave the auxiliary output out of its loss."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.blk = AuxOutBlock()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h, aux = self.blk(self.inp(x))
        return self.head(h), aux


def aux_out_net(seed: int = 0) -> AuxOutNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AuxOutNet()


class SelfAttentionNet(nn.Module):
    """Cut at ``attn``, which the model calls on one tensor three times (``attn(h, h, h)``), or at
    ``mix``, given it as an argument and a keyword (``mix(h, context=h)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.mix = ContextMix()
        self.head = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.mix(h, context=h).mean(1))


class ContextMix(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(16, 16)
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)

    def forward(self, h: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return h * self.attn(self.q(h), context, context, need_weights=False)[0]


def self_attention_net(seed: int = 0) -> SelfAttentionNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SelfAttentionNet()
