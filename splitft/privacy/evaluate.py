"""One digits run per privacy setting: accuracy and bytes next to what the attacks recover.

The digits CNN is split U-shape (edge: block1-2, cloud: block3, edge: head), so labels stay on
the edge and the label-leak attack has something to measure. The training images are divided
once: the edge trains on the first part; the rest is the cloud's auxiliary data for the
inversion attack (same distribution, never trained on); the attacks are scored on the test set.

What the attacks see is what the cloud decodes: the activation after the defences, through the
run's forward codec (its randomized response included), and the label gradients the edge
handed to its gradient codec during the last epoch.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

import transports

from ..app.data import Split, batches, load_digits
from .attacks import dcor_score, inversion_attack, label_leak, through_codec
from .defences import Budget, Defences, Noise, protect

FACTORIES = ("splitft.app.models:digits_cnn", "splitft.app.models:digits_bsl", "splitft.privacy.models:digits_deep_edge")
AUX = 360  # training images held back as the attacker's auxiliary data


@dataclass(frozen=True)
class Setting:
    """One row of the privacy table: a codec and the defences on top of it."""

    name: str
    codec: str = "identity"
    leak_loss: float = 0.0
    epsilon: float | None = None  # total budget the noise is calibrated to (None: no noise)
    noise_multiplier: float | None = None  # a fixed multiplier instead (epsilon then only reported)
    noise_activations: bool = True  # with epsilon: noise on the activation edge -> cloud
    noise_labels: bool = False  # with epsilon: noise on the label gradient edge -> cloud
    clip: float = 1.0  # per-sample L2 clip of the activation (its norm is ~30 unclipped)
    label_clip: float = 1e-3  # per-sample L2 clip of the label gradient (~1e-2 unclipped, batch 64)
    adversarial: float = 0.0  # weight of adversarial training against the edge's own decoder
    deep: bool = False  # cut later: the edge pools to 4x4 before the cut (digits_deep_edge)

    @property
    def factory(self) -> str:
        if self.deep:
            return FACTORIES[2]
        return FACTORIES[1] if self.codec.split(":")[0] == "binary" else FACTORIES[0]

    @property
    def cut(self) -> str:
        return "block4" if self.deep else "block3"


PRESETS: dict[str, Setting] = {s.name: s for s in [
    Setting("identity"),
    Setting("bsl", codec="binary"),
    Setting("bsl-rr", codec="binary:flip_eps=1"),
    Setting("bsl-leak", codec="binary", leak_loss=2.0),
    Setting("leak", leak_loss=2.0),
    Setting("leak-strong", leak_loss=10.0),
    Setting("dp-eps1", epsilon=1.0),
    Setting("dp-eps3", epsilon=3.0),
    Setting("dp-eps8", epsilon=8.0),
    Setting("noise-0.05", noise_multiplier=0.05),
    Setting("noise-0.2", noise_multiplier=0.2),
    Setting("label-dp-eps3", epsilon=3.0, noise_activations=False, noise_labels=True),
    Setting("fixpoint:bits=4", codec="fixpoint:bits=4"),
    Setting("c3sl:r=4", codec="c3sl:r=4"),
]}


#: Defences against inversion, measured with the stronger attacks too (``privacy_eval.py --frontier``),
#: beside the table's settings that stand for each kind of defence.
FRONTIER_PRESETS: dict[str, Setting] = {s.name: s for s in [
    Setting("noise-0.1", noise_multiplier=0.1),
    Setting("adversarial-1", adversarial=1.0),
    Setting("deep", deep=True),
    Setting("deep-noise-0.1", deep=True, noise_multiplier=0.1),
    Setting("deep-noise-0.2", deep=True, noise_multiplier=0.2),
]}
FRONTIER = ["identity", "noise-0.1", "noise-0.2", "c3sl:r=4", "adversarial-1", "deep", "deep-noise-0.1",
            "deep-noise-0.2"]


def setting(name: str) -> Setting:
    """A preset by name, or a codec spec (``fixpoint:bits=4``) as a row with no defence."""
    if name in PRESETS:
        return PRESETS[name]
    if name in FRONTIER_PRESETS:
        return FRONTIER_PRESETS[name]
    import compressors

    try:
        compressors.canonical_spec(name)
    except compressors.CompressionError as exc:
        raise ValueError(f"{name!r} is neither a preset ({', '.join(PRESETS)}) nor a codec spec: {exc}") from None
    if supported(name):
        return Setting(name, codec=name)
    raise ValueError(f"codec {name!r} keeps per-sample state, which the privacy runs do not measure yet")


def supported(codec: str) -> bool:
    """Whether the privacy runs can measure ``codec`` (stateless codecs: the attack replays them)."""
    import compressors

    return not compressors.codec_class(compressors.parse_spec(codec)[0]).needs_sample_ids


def data(seed: int = 0) -> tuple[Split, Split, Split]:
    """(edge training set, attacker's auxiliary set, test set) of the digits."""
    train, test = load_digits(seed=seed)
    n = len(train) - AUX
    edge = Split(train.tensor()[:n], train.y[:n], torch.arange(n))
    aux = Split(train.tensor()[n:], train.y[n:], torch.arange(AUX))
    return edge, aux, test


def _defences(s: Setting, *, seed: int, epochs: int, sample_rate: float, delta: float) -> Defences:
    noisy = s.epsilon is not None or s.noise_multiplier is not None
    return Defences(
        leak_loss=s.leak_loss,
        activations=Noise(s.clip, s.noise_multiplier) if noisy and s.noise_activations else None,
        label_gradients=Noise(s.label_clip, s.noise_multiplier) if noisy and s.noise_labels else None,
        budget=Budget(epsilon=s.epsilon if s.epsilon is not None else math.inf, delta=delta,
                      sample_rate=sample_rate, epochs=epochs),
        seed=10_000 + seed,
        adversarial=s.adversarial,
    )


def _train(model: Any, protection: Any, train: Split, *, epochs: int, batch_size: int, lr: float,
           seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], float]:
    """Train the split model; return the label gradients seen in the last epoch, their labels, seconds."""
    from compressors.binary import keep_latent_weights_clipped

    optimizer = model.attach(torch.optim.Adam(model.parameters(), lr=lr))
    keep_latent_weights_clipped(optimizer, model)
    criterion = nn.CrossEntropyLoss()
    grads: list[torch.Tensor] = []
    labels: list[torch.Tensor] = []
    current: list[torch.Tensor] = []

    def record(kind: str, tensor: torch.Tensor) -> None:
        if kind == "label_gradient":
            grads.append(tensor.reshape(tensor.shape[0], -1).clone())
            labels.append(current[0])

    start = time.perf_counter()
    for epoch in range(epochs):
        model.train()
        stop = protection.watch(record) if epoch == epochs - 1 else None
        for x, y, _ in batches(train, batch_size, shuffle=True, seed=seed, epoch=epoch):
            current[:] = [y]
            loss = criterion(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        if stop is not None:
            stop()
    return grads, labels, time.perf_counter() - start


def _crossed(model: Any, protection: Any, aux: Split, test: Split) -> tuple[list[torch.Tensor], torch.Tensor]:
    """What crossed for the auxiliary and the test images (as the cloud would see it), and the logits."""
    crossed: list[torch.Tensor] = []
    stop = protection.watch(lambda kind, t: crossed.append(t.clone()) if kind == "activation" else None)
    model.eval()
    with torch.no_grad():
        model(aux.x)
        logits = model(test.x)
    stop()
    return crossed, logits


def run_setting(s: Setting, *, seed: int = 0, epochs: int = 10, batch_size: int = 64, lr: float = 1e-3,
                delta: float = 1e-5, address: str | None = None, inversion_steps: int = 600,
                strong_steps: int = 1500, timeout: float = 60.0) -> dict[str, Any]:
    """Train one setting split between edge and cloud, then attack what crossed; one result row.

    ``address``: a ``splitft cloud`` serving :data:`FACTORIES`; None runs the cloud on a thread.
    """
    import splitft

    from ..cloud import CloudServer, load_factory, serve_in_thread

    train, aux, test = data()
    defences = _defences(s, seed=seed, epochs=epochs, sample_rate=batch_size / len(train), delta=delta)
    server = thread = None
    if address is None:
        listener = transports.InprocListener()
        server = CloudServer(listener, list(FACTORIES))
        thread = serve_in_thread(server)
        connection: Any = listener.connect()
    else:
        connection = transports.connect(address)
    try:
        model = splitft.split(load_factory(s.factory)(seed=seed), s.cut, "head",
                              factory=splitft.Factory(s.factory, kwargs={"seed": seed}), connect=connection,
                              codecs=splitft.Codecs(s.codec, ret="identity", seed=seed),
                              faults=splitft.Faults(timeout=timeout))
        with model:
            protection = protect(model, defences)
            grads, labels, seconds = _train(model, protection, train, epochs=epochs, batch_size=batch_size,
                                            lr=lr, seed=seed)
            traffic = {"bytes_up": model.metrics.direction("up").wire,
                       "bytes_down": model.metrics.direction("down").wire,
                       "activation_bytes": model.metrics.bytes[("up", "activation")].wire,
                       "fwd_ratio": model.metrics.bytes[("up", "activation")].ratio}
            spent, multipliers = protection.spent(), dict(protection.noise_multipliers)
            crossed, logits = _crossed(model, protection, aux, test)
            fwd_spec = model.session.codecs.specs["fwd"]
    finally:
        if server is not None and thread is not None:
            server.stop()
            thread.join(timeout=10)
    aux_z = through_codec(crossed[0], fwd_spec, seed=seed + 1)
    test_z = through_codec(crossed[1], fwd_spec, seed=seed + 2)
    inversion = inversion_attack(aux_z, aux.tensor(), test_z, test.tensor(), steps=inversion_steps, seed=seed)
    leak = label_leak(torch.cat(grads), torch.cat(labels)) if grads else {}
    strong = _strong_attacks(aux_z, aux, test_z, test, steps=strong_steps, seed=seed)
    return {
        **asdict(s), "seed": seed, "epochs": epochs,
        "accuracy": float((logits.argmax(1) == test.y).double().mean()),
        **traffic, "train_seconds": seconds,
        "dcor": dcor_score(test.tensor(), test_z),
        "inversion_mse": inversion.mse, "inversion_ssim": inversion.ssim,
        "baseline_mse": inversion.baseline_mse, "baseline_ssim": inversion.baseline_ssim,
        "label_leak": leak.get("direction_accuracy", float("nan")), "label_chance": leak.get("chance", float("nan")),
        "epsilon_spent": spent, "noise_multipliers": multipliers, **strong,
        "best_ssim": max(inversion.ssim or 0.0, strong.get("strong_ssim", 0.0), strong.get("class_mean_ssim", 0.0)),
    }


def _strong_attacks(aux_z: torch.Tensor, aux: Split, test_z: torch.Tensor, test: Split, *, steps: int,
                    seed: int) -> dict[str, float]:
    """The attacks of :mod:`splitft.privacy.strong` on what crossed (none when ``steps`` is 0)."""
    from .strong import class_mean_attack, class_mean_floor, learned_decoder_attack

    if steps <= 0:
        return {}
    decoder = learned_decoder_attack(aux_z, aux.tensor(), test_z, test.tensor(), steps=steps, seed=seed)
    by_class, class_accuracy = class_mean_attack(aux_z, aux.tensor(), aux.y, test_z, test.tensor(), test.y,
                                                 steps=steps // 2, seed=seed)
    floor = class_mean_floor(aux.tensor(), aux.y, test.tensor(), test.y)
    return {"strong_mse": decoder.mse, "strong_ssim": decoder.ssim or 0.0, "class_mean_ssim": by_class.ssim or 0.0,
            "attacker_class_accuracy": class_accuracy, "class_floor_ssim": floor.ssim or 0.0}


TOKEN_SETTINGS = ["identity", "fp16", "fixpoint:bits=8", "fixpoint:bits=4", "fixpoint:bits=2", "noise-0.003",
                  "noise-0.01", "noise-0.03", "noise-0.1", "layer4", "layer6", "layer4-noise-0.01",
                  "layer6-noise-0.01"]


def token_recovery(settings: list[str] = TOKEN_SETTINGS, *, aux: int = 200, target: int = 100, max_length: int = 64,
                   seed: int = 0) -> list[dict[str, Any]]:
    """Token recovery from the MiniLM hidden states that cross the BBC task's cut (input of layer 2).

    The pre-trained edge, before any fine-tuning: the cloud can run the public model itself, so
    its auxiliary states are BBC training articles passed through the edge, and its targets are
    test articles. ``noise-S``: per-sample clipping to the median norm and Gaussian noise of
    multiplier S; ``layerK`` (and ``layerK-noise-S``): the cut later, at the input of encoder
    layer K (K = 6: the encoder's output); anything else is a codec spec. Needs the ``nlp`` extra.
    """
    from ..app.tasks.bbc import load_bbc, minilm_classifier
    from .attacks import token_recovery_accuracy
    from .defences import clip_and_noise

    train, test = load_bbc(max_length=max_length, limit=aux)
    model = minilm_classifier().eval()

    def states(split: Split, count: int) -> tuple[tuple[torch.Tensor, ...], torch.Tensor, torch.Tensor]:
        ids, mask = split.field("input_ids")[:count], split.field("attention_mask")[:count]
        with torch.no_grad():
            hidden = model.bert(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        return hidden, ids, mask

    (all_aux, i_aux, m_aux), (all_tgt, i_tgt, m_tgt) = states(train, aux), states(test, target)
    rows = []
    for name in settings:
        layer, _, rest = name.partition("-") if name.startswith("layer") else ("layer2", "", name)
        h_aux, h_tgt = all_aux[int(layer[5:])], all_tgt[int(layer[5:])]
        if name.startswith("layer") and not rest:
            rest = "identity"
        if rest.startswith("noise-"):
            clip = float(h_aux.reshape(h_aux.shape[0], -1).norm(dim=1).median())
            generator = torch.Generator().manual_seed(seed)
            sigma = float(rest.split("-", 1)[1])
            a, t = (clip_and_noise(h, clip, sigma, generator) for h in (h_aux, h_tgt))
        else:
            a, t = through_codec(h_aux, rest, seed=seed), through_codec(h_tgt, rest, seed=seed + 1)
        accuracy = token_recovery_accuracy(a, i_aux, t, i_tgt, aux_mask=m_aux, target_mask=m_tgt)
        rows.append({"setting": name, "token_recovery": accuracy})
    # references: always guessing the commonest auxiliary token, and the best any lookup can do
    real_aux, real_tgt = i_aux[m_aux.bool()], i_tgt[m_tgt.bool()]
    commonest = torch.mode(real_aux).values
    rows.append({"setting": "(guess the commonest token)", "token_recovery": float((real_tgt == commonest).double().mean())})
    rows.append({"setting": "(target tokens present in the auxiliary text)",
                 "token_recovery": float(torch.isin(real_tgt, real_aux).double().mean())})
    return rows
