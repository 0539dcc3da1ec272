"""SmolLM2-135M as one chain cut plain: the loss in the cloud, so a frozen edge can stream.

The ``smollm`` task cuts the model U-shape: the LM head and the loss stay on the edge, so every
step waits for the cloud's layers to come back. :func:`smollm_chain` (task ``smollm-plain``) is
the same pre-trained model with the same LoRA adapters rebuilt as one ``nn.Sequential`` —
``embed``, ``layer0``-``layer29``, ``norm``, ``head`` — cut *plain* after ``layer1``: the cloud
runs decoder layers 2-29, the final norm, the LM head and the loss, and only a scalar loss comes
back. With the edge's layers frozen (adapters on the cloud's layers only, see
:func:`factory_kwargs`) nothing has to come back before the edge's next step, so it keeps a window
of steps in flight (``--window``). The price of the plain cut: the labels (the next tokens) cross
to the cloud with the hidden states.

The head returns the next-token logits as (batch, vocabulary, length - 1) and the labels are the
windows' tokens from the second on, so ``nn.CrossEntropyLoss`` — the plain split's remote loss —
is the causal LM's loss (the mean over every predicted token). Windows are full (no padding), so
no attention mask crosses: the decoder layers use the causal mask the model's own config asks for.
"""

from __future__ import annotations

import copy
import math
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..data import Split, batches
from ...errors import ConfigError
from . import smollm
from .rotary import rotary_of

if TYPE_CHECKING:
    from ..runner import Prepared

FACTORY = "splitft.app.tasks.smollm_chain:smollm_chain"
CUT = "layer2"  # the edge runs the embeddings and decoder layers 0-1


class DecoderLink(nn.Module):
    """One decoder layer as a chain link: hidden states in, hidden states out.

    It makes the rotary position tables and the causal mask itself (positions 0..L-1: every
    window starts at its first token), so only the hidden states cross a cut between links.
    """

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = copy.deepcopy(rotary)  # a buffer of inverse frequencies, not a weight
        self.config = config

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers.masking_utils import create_causal_mask

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                                  position_ids=positions)
        out = self.layer(hidden, attention_mask=mask, position_ids=positions,
                         position_embeddings=self.rotary(hidden, positions))
        return out[0] if isinstance(out, tuple) else out


class NextTokenHead(nn.Module):
    """The LM head over every position but the last: logits as (batch, vocabulary, length - 1), the
    layout ``nn.CrossEntropyLoss`` takes with (batch, length - 1) labels."""

    def __init__(self, head: nn.Linear) -> None:
        super().__init__()
        self.head = head

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden[:, :-1]).transpose(1, 2)


def smollm_chain(rank: int = 8, alpha: int = 16, layers: list[int] | None = None, seed: int = 0) -> nn.Sequential:
    """Pre-trained SmolLM2-135M-Instruct with LoRA adapters (:func:`splitft.app.tasks.smollm.smollm_lora`,
    the same adapters for the same arguments) as an ``nn.Sequential`` that can be cut plain.

    The LM head is tied to the embeddings in the pre-trained model; here the head gets its own
    frozen copy of the matrix, since a plain cut puts the embeddings on the edge and the head in
    the cloud, and a weight shared across a cut cannot be.
    """
    peft_model: Any = smollm.smollm_lora(rank=rank, alpha=alpha, layers=layers, seed=seed)
    causal_lm = peft_model.base_model.model
    decoder = causal_lm.model
    head = causal_lm.lm_head
    if head.weight is decoder.embed_tokens.weight:
        untied = nn.Linear(head.in_features, head.out_features, bias=head.bias is not None)
        untied.weight = nn.Parameter(head.weight.detach().clone(), requires_grad=False)
        head = untied
    links = [(f"layer{i}", DecoderLink(layer, rotary_of(decoder), decoder.config))
             for i, layer in enumerate(decoder.layers)]
    return nn.Sequential(OrderedDict([("embed", decoder.embed_tokens), *links, ("norm", decoder.norm),
                                      ("head", NextTokenHead(head))]))


def cloud_layers(cut: str) -> list[int]:
    """The decoder layers a plain cut ``"layerN"`` leaves to the cloud: N to the last."""
    number = cut.removeprefix("layer")
    if not cut.startswith("layer") or not number.isdigit() or not 0 < int(number) < smollm.LAYERS:
        raise ConfigError(f"cloud-only adapters need the chain's cut at a decoder layer, such as {CUT!r}; got {cut!r}")
    return list(range(int(number), smollm.LAYERS))


def factory_kwargs(*, cut: str, freeze_edge: bool) -> dict[str, Any]:
    """With a frozen edge, adapters on the cloud's layers only: the edge has nothing to train, so no
    gradient crosses back and its steps can stream."""
    return {"layers": cloud_layers(cut)} if freeze_edge else {}


def load_windows(max_length: int = 128, seed: int = 0, eval_windows: int = 32) -> tuple[Split, Split]:
    """:func:`splitft.app.tasks.smollm.load_news`'s windows for the chain: ``x`` the token ids, ``y`` the
    next tokens (the ids from the second on), ``ids`` a stable number per window."""
    train, test = smollm.load_news(max_length=max_length, seed=seed, eval_windows=eval_windows)

    def shifted(split: Split) -> Split:
        tokens = split.field("input_ids")
        return Split(tokens, tokens[:, 1:].clone(), split.ids)

    return shifted(train), shifted(test)


def perplexity(criterion: Any, model: nn.Module, data: Split, batch_size: int = 8) -> float:
    """exp of the mean next-token loss over ``data``, each batch's loss computed where the model's
    loss runs (in the cloud for a plain split: only a scalar comes back, never the logits)."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0
    try:
        with torch.no_grad():
            for x, y, _ in batches(data, batch_size, shuffle=False):
                total += float(criterion(model(x), y)) * y.numel()
                tokens += y.numel()
    finally:
        model.train(was_training)
    if tokens == 0:
        raise ConfigError("no tokens to predict in the evaluation data")
    return math.exp(total / tokens)


def train_run(prepared: Prepared) -> smollm.LMFit:
    """The task's training: held-out perplexity before, the ordinary training loop
    (:func:`splitft.app.train.fit`) with the remote loss, and perplexity after."""
    from ..train import fit

    model, criterion, run = prepared.model, prepared.criterion, prepared.run
    before = perplexity(criterion, model, prepared.test)
    fitted = fit(model, prepared.optimizer, criterion, prepared.train, prepared.test, epochs=prepared.epochs,
                 batch_size=prepared.batch_size, seed=run.seed, progress=run.progress, pass_ids=True, evaluate=False)
    after = perplexity(criterion, model, prepared.test)
    tokens = prepared.test.y.numel()
    result = smollm.LMFit(accuracy=0.0, history=fitted.history, seconds=fitted.seconds, steps=fitted.steps,
                          before=smollm.Perplexity(before, math.nan, tokens),
                          after=smollm.Perplexity(after, math.nan, tokens), train_seconds=fitted.seconds)
    result.history[-1]["perplexity"] = after
    return result


__all__ = ["CUT", "FACTORY", "DecoderLink", "NextTokenHead", "cloud_layers", "factory_kwargs", "load_windows",
           "perplexity", "smollm_chain", "train_run"]
