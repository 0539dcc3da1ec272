"""What the BBC task's defences cost in accuracy, and what they hide once the edge is fine-tuned.

:func:`splitft.privacy.evaluate.token_recovery` reads tokens from the hidden states of the public
pre-trained edge. A run fine-tunes that edge, so the states that cross during and after training
are not the public ones. Here each setting trains the MiniLM classifier split U-shape (the cloud
runs encoder layers K-5, on a thread of this process) with the defence installed by
:func:`~splitft.privacy.defences.protect`, and then runs the same nearest-neighbour lookup on what
crossed the trained cut. Two attackers: one whose auxiliary states come from the public edge (all
an honest-but-curious cloud has), and one with auxiliary text it knows passed through the trained
edge (states it saw in training whose text it learned: the stronger case).

The noise is the token table's: per-sample clipping at the median norm of the auxiliary states
through the public edge, and Gaussian noise of standard deviation ``sigma * clip``, in training,
at evaluation and in the attack alike.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..app.data import Split, batches, call, first
from ..errors import ConfigError
from .attacks import token_recovery_accuracy
from .defences import Budget, Defences, Noise, clip_and_noise, protect
from .report import append_row, read_rows

#: The token table's rows that are defences a U-shape run can train with.
TEXT_SETTINGS = ["identity", "noise-0.01", "noise-0.03", "layer4", "layer4-noise-0.01", "layer5",
                 "layer5-noise-0.01"]
LAYERS = 6  # all-MiniLM-L6-v2's encoder layers


@dataclass(frozen=True)
class TextSetting:
    """A cut (the input of encoder layer ``layer``) and the noise on what crosses it (None: none)."""

    name: str
    layer: int = 2
    sigma: float | None = None

    @property
    def cut(self) -> str:
        return f"bert.encoder.layer.{self.layer}:{LAYERS}"


def text_setting(name: str) -> TextSetting:
    """``identity``, ``noise-S``, ``layerK`` or ``layerK-noise-S`` (K in 1-5: the cloud must run at
    least one encoder layer, so the encoder's output, K = 6, is no U-shape cut of this model)."""
    layer, rest = 2, name
    if name.startswith("layer"):
        head, _, rest = name.partition("-")
        try:
            layer = int(head[5:])
        except ValueError:
            raise ConfigError(f"{name!r}: expected layerK with K a number") from None
        rest = rest or "identity"
    if not 1 <= layer < LAYERS:
        raise ConfigError(f"{name!r}: the cut must be the input of encoder layer 1-{LAYERS - 1} (the cloud runs "
                          f"layers K-{LAYERS - 1}); at layer {layer} it would run no layer of the encoder")
    if rest == "identity":
        return TextSetting(name, layer)
    kind, _, value = rest.partition("-")
    try:
        sigma = float(value) if kind == "noise" else math.nan
    except ValueError:
        sigma = math.nan
    if not (math.isfinite(sigma) and sigma > 0):
        raise ConfigError(f"{name!r}: expected identity, noise-S, layerK or layerK-noise-S with S > 0")
    return TextSetting(name, layer, sigma)


def _public_states(model: Any, split: Split, layer: int) -> torch.Tensor:
    """Hidden states at the input of ``layer`` through the pre-trained (not yet trained) encoder."""
    model.eval()
    with torch.no_grad():
        hidden = model.bert(input_ids=split.field("input_ids"), attention_mask=split.field("attention_mask"),
                            output_hidden_states=True).hidden_states
    return hidden[layer]


def _tokens(split: Split) -> tuple[torch.Tensor, torch.Tensor]:
    return split.field("input_ids"), split.field("attention_mask")


def _train(model: Any, train: Split, *, epochs: int, batch_size: int, lr: float, seed: int) -> float:
    """AdamW over ``train``; returns the seconds it took."""
    optimizer = model.attach(torch.optim.AdamW(model.parameters(), lr=lr))
    criterion = nn.CrossEntropyLoss()
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        for x, y, _ in batches(train, batch_size, shuffle=True, seed=seed, epoch=epoch):
            criterion(call(model, x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return time.perf_counter() - start


def _crossed(model: Any, protection: Any, split: Split, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What crossed the cut for ``split`` (after the defences, as the cloud sees it), and the logits."""
    crossed: list[torch.Tensor] = []
    stop = protection.watch(lambda kind, t: crossed.append(t.detach().clone()) if kind == "activation" else None)
    model.eval()
    try:
        with torch.no_grad():
            logits = torch.cat([call(model, x) for x, _, _ in batches(split, batch_size, shuffle=False)])
    finally:
        stop()
    return torch.cat(crossed), logits


def run_text_setting(name: str, *, seed: int = 0, epochs: int = 1, limit: int | None = None, max_length: int = 64,
                     batch_size: int = 16, lr: float = 3e-4, aux: int = 200, target: int = 100) -> dict[str, Any]:
    """Train the BBC task split U-shape with setting ``name``; its test accuracy beside token recovery
    from the public edge's states, and from the trained edge's (both attackers). One result row.

    ``limit`` training articles (the first ``aux`` of them are the attacker's known text) of
    ``max_length`` tokens; the ``target`` first test articles are the attacked ones; all 444 are scored.
    """
    import splitft
    import transports

    from ..app.tasks.bbc import FACTORY, load_bbc, minilm_classifier
    from ..cloud import CloudServer, serve_in_thread

    s = text_setting(name)
    if limit is not None and limit < aux:
        raise ConfigError(f"limit={limit} must be at least aux={aux}: the attacker's text is training text")
    train, test = load_bbc(max_length=max_length, limit=limit)
    known, attacked = first(train, aux), first(test, target)
    model = minilm_classifier(seed=seed)
    public_aux, public_tgt = _public_states(model, known, s.layer), _public_states(model, attacked, s.layer)
    clip = float(public_aux.reshape(aux, -1).norm(dim=1).median())
    if s.sigma is not None:
        generator = torch.Generator().manual_seed(seed)
        public_aux, public_tgt = (clip_and_noise(h, clip, s.sigma, generator) for h in (public_aux, public_tgt))
    (ids_aux, m_aux), (ids_tgt, m_tgt) = _tokens(known), _tokens(attacked)
    defences = Defences(activations=Noise(clip, s.sigma) if s.sigma is not None else None,
                        budget=Budget(epsilon=math.inf, delta=1e-5, sample_rate=min(1.0, batch_size / len(train)),
                                      epochs=epochs), seed=10_000 + seed)
    listener = transports.InprocListener()
    server = CloudServer(listener, [FACTORY])
    thread = serve_in_thread(server)
    try:
        torch.manual_seed(seed)
        split_model = splitft.split(model, s.cut, factory=splitft.Factory(FACTORY, {"seed": seed}, weights="factory"),
                                    connect=listener.connect(), codecs=splitft.Codecs("identity", seed=seed),
                                    faults=splitft.Faults(timeout=300))
        with split_model:
            protection = protect(split_model, defences)
            seconds = _train(split_model, train, epochs=epochs, batch_size=batch_size, lr=lr, seed=seed)
            trained_aux, _ = _crossed(split_model, protection, known, batch_size)
            crossed_test, logits = _crossed(split_model, protection, test, batch_size)
    finally:
        server.stop()
        thread.join(timeout=10)
    trained_tgt = crossed_test[:target]
    return {
        "setting": name, "layer": s.layer, "sigma": s.sigma if s.sigma is not None else 0.0, "clip": clip,
        "seed": seed, "epochs": epochs, "train_articles": len(train), "max_length": max_length,
        "accuracy": float((logits.argmax(1) == test.y).double().mean()), "train_seconds": seconds,
        "tokens_pretrained": token_recovery_accuracy(public_aux, ids_aux, public_tgt, ids_tgt,
                                                     aux_mask=m_aux, target_mask=m_tgt),
        "tokens_finetuned_public_aux": token_recovery_accuracy(public_aux, ids_aux, trained_tgt, ids_tgt,
                                                               aux_mask=m_aux, target_mask=m_tgt),
        "tokens_finetuned": token_recovery_accuracy(trained_aux, ids_aux, trained_tgt, ids_tgt,
                                                    aux_mask=m_aux, target_mask=m_tgt),
    }


FIELDS = ["setting", "layer", "sigma", "clip", "seed", "epochs", "train_articles", "max_length", "accuracy",
          "train_seconds", "tokens_pretrained", "tokens_finetuned_public_aux", "tokens_finetuned"]
COLUMNS = [("accuracy", "BBC test accuracy"), ("tokens_pretrained", "token recovery, pre-trained edge"),
           ("tokens_finetuned_public_aux", "token recovery, fine-tuned edge (public auxiliary states)"),
           ("tokens_finetuned", "token recovery, fine-tuned edge (auxiliary states through it)")]




def _cell(values: list[float]) -> str:
    if len(values) < 2:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


def text_table(out: Path, names: list[str], *, seeds: int, epochs: int = 1, command: str = "",
               progress: Callable[[str], None] = lambda line: None, **options: Any) -> str:
    """Run the cells (setting x seed) that ``out``/tokens_trained.csv does not hold yet, each
    appended as it finishes (a re-run goes on where one stopped), then write tokens_trained.md,
    headed by ``command``, what made it; returns the table. ``options`` go to :func:`run_text_setting`."""
    out.mkdir(parents=True, exist_ok=True)
    csv_path = out / "tokens_trained.csv"
    settings = [text_setting(n).name for n in names]
    done = {(r["setting"], int(r["seed"]), int(r["epochs"])) for r in read_rows(csv_path)}
    todo = [(n, seed) for seed in range(seeds) for n in settings if (n, seed, epochs) not in done]  # a seed at a time
    for i, (name, seed) in enumerate(todo, 1):
        progress(f"[{i}/{len(todo)}] {name} seed {seed}")
        append_row(csv_path, run_text_setting(name, seed=seed, epochs=epochs, **options), FIELDS)
    rows = [r for r in read_rows(csv_path) if r["setting"] in settings and int(r["epochs"]) == epochs]
    lines = ["| setting | seeds | " + " | ".join(title for _, title in COLUMNS) + " |",
             "|---|---|" + "---|" * len(COLUMNS)]
    for name in settings:
        mine = [r for r in rows if r["setting"] == name]
        if mine:
            cells = [_cell([float(r[key]) for r in mine]) for key, _ in COLUMNS]
            lines.append(f"| {name} | {len(mine)} | " + " | ".join(cells) + " |")
    table = "\n".join(lines) + "\n"
    (out / "tokens_trained.md").write_text(f"<!-- made by: {command} -->\n\n{table}")
    return table
