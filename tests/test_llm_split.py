"""Split ≡ local for LoRA fine-tuning of a causal LM, edge and cloud in two real processes.

A tiny random Llama (no download) wrapped by peft, cut U-shape inside its decoder as the smollm
task cuts SmolLM2: the edge keeps the embeddings, the first and last decoder layers, the final
norm, the LM head and the loss (computed by the model from ``labels=``), the cloud process runs
the middle layers. Batches are padded on either side, so attention masks and explicit position
ids cross the cut; the losses and every weight must come out as in one process.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import splitft  # noqa: E402
from tests.conftest import start_cloud, stop  # noqa: E402

FACTORY = "tests.test_llm_split:tiny_llama_lora"
CUT = "base_model.model.model.layers.1:3"  # edge: embeddings, layer 0, layer 3, norm, head; cloud: layers 1-2
CLOUD_LAYERS = [1, 2]
STEPS = 6
ACCUMULATE = 2
VOCAB = 128

pytestmark = [pytest.mark.timeout(120),
              # peft asks transformers for a property transformers 5 renamed; nothing here depends on it
              pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.*:FutureWarning")]


def tiny_llama_lora(seed: int = 0, attn: str = "sdpa", layers: list[int] | None = None) -> torch.nn.Module:
    """A 4-layer Llama (hidden 32, vocab 128, tied embeddings, no dropout) with LoRA on every projection.

    The adapters start away from zero (``init_lora_weights=False``), so they change the forward
    from the first step and their gradients are not zero.
    """
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         attention_dropout=0.0, use_cache=False, pad_token_id=0, tie_word_embeddings=True,
                         attn_implementation=attn)
    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      layers_to_transform=layers, layers_pattern="layers" if layers is not None else None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(LlamaForCausalLM(config), lora)


def _batches(batch: int = 4, length: int = 12) -> Iterator[dict[str, torch.Tensor]]:
    """Token ids padded on the right (odd steps) or the left (even steps), with the position ids
    a padded batch needs and labels of -100 where there is no token."""
    g = torch.Generator().manual_seed(0)
    for step in range(STEPS):
        ids = torch.randint(1, VOCAB, (batch, length), generator=g)
        lengths = torch.randint(3, length + 1, (batch,), generator=g)
        lengths[0] = length
        positions = torch.arange(length)
        mask = (positions < lengths[:, None]) if step % 2 else (positions >= length - lengths[:, None])
        mask = mask.long()
        yield {"input_ids": ids * mask, "attention_mask": mask,
               "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "labels": ids.masked_fill(mask == 0, -100)}


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[float]:
    losses = []
    for batch in _batches():
        for part in torch.chunk(torch.arange(len(batch["input_ids"])), ACCUMULATE):
            loss = model(**{k: v[part] for k, v in batch.items()}).loss / ACCUMULATE
            loss.backward()
            losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses


def _trainable(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``splitft cloud`` process serving the tiny LoRA Llama, for every test of this module."""
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", FACTORY)
    yield address
    stop(proc)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_lora_llama_split_across_processes_equals_local(cloud, attn):
    local = tiny_llama_lora(attn=attn)
    start = {k: v.clone() for k, v in local.state_dict().items()}
    local_losses = _train(local, torch.optim.AdamW(_trainable(local), lr=1e-2))

    factory = splitft.Factory(FACTORY, kwargs={"attn": attn}, weights="factory")
    with splitft.split(tiny_llama_lora(attn=attn), CUT, factory=factory, connect=cloud,
                       faults=splitft.Faults(timeout=30)) as model:
        losses = _train(model, model.attach(torch.optim.AdamW(_trainable(model), lr=1e-2)))
        edge, cloud_half = model.edge_state_dict(), model.cloud_state_dict()
        crossed = model.metrics.bytes[("up", "activation")]

    layers = ("base_model.model.model.layers.1.", "base_model.model.model.layers.2.")
    assert set(cloud_half) == {k for k in local.state_dict() if k.startswith(layers)}
    assert set(edge) | set(cloud_half) == set(local.state_dict()) and set(edge).isdisjoint(cloud_half)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(local_losses))
    for name, value in local.state_dict().items():
        torch.testing.assert_close({**edge, **cloud_half}[name], value, msg=lambda m: f"{name}: {m}")
    # the adapters of both halves trained, the pre-trained weights did not
    for name in ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.default.weight",
                 "base_model.model.model.layers.2.mlp.down_proj.lora_A.default.weight"):
        assert not torch.equal(start[name], local.state_dict()[name]), name
    for name in ("base_model.model.model.layers.2.mlp.down_proj.base_layer.weight",
                 "base_model.model.model.embed_tokens.weight"):
        assert torch.equal(start[name], {**edge, **cloud_half}[name]), name
    # the masks and position ids crossed with the hidden states (the labels stayed on the edge)
    hidden = STEPS * 4 * 12 * 32 * 4
    assert crossed.raw > hidden


def test_cloud_only_adapters_with_a_frozen_edge_send_no_gradient_back(cloud):
    """Adapters on the cloud's layers only and ``freeze_edge=True``: the edge trains nothing, no
    gradient crosses to it, and the cloud's adapters train exactly as in one process."""
    local = tiny_llama_lora(layers=CLOUD_LAYERS)
    assert all(".layers.1." in n or ".layers.2." in n for n, p in local.named_parameters() if p.requires_grad)
    local_losses = _train(local, torch.optim.AdamW(_trainable(local), lr=1e-2))

    factory = splitft.Factory(FACTORY, kwargs={"layers": CLOUD_LAYERS}, weights="factory")
    with splitft.split(tiny_llama_lora(layers=CLOUD_LAYERS), CUT, factory=factory, connect=cloud,
                       freeze_edge=True, faults=splitft.Faults(timeout=30)) as model:
        losses = _train(model, model.attach(torch.optim.AdamW(_trainable(model), lr=1e-2)))
        state = {**model.edge_state_dict(), **model.cloud_state_dict()}
        back = model.metrics.bytes[("down", "gradient")]
        returned = model.metrics.bytes[("up", "gradient")]
    assert back.raw == 0 and back.payload == 0
    assert returned.raw > 0  # the gradient of the trunk's output still goes up: the cloud's adapters train
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(local_losses))
    for name, value in local.state_dict().items():
        torch.testing.assert_close(state[name], value, msg=lambda m: f"{name}: {m}")
