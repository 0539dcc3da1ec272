"""The training loops people already have, unchanged but for the split() line: a
``transformers.Trainer`` with its defaults (its own AdamW with no-decay groups, linear warmup,
clipping at 1.0, accumulation, column removal, evaluation, save_model) and a Hugging Face
Accelerate loop. Each runs on the unsplit model and split against a real cloud process; the
final full state_dict must be equal."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

import splitft
from tests.conftest import start_cloud, stop
from tests.models import temperature_classifier, tiny_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

FACTORY = "tests.models:tiny_hf"
TEMPERATURE = "tests.models:temperature_classifier"
CUTS = {"bert": "bert.encoder.layer.1:3", "llama": "model.layers.1:3"}


def _examples(kind: str, n: int = 24, length: int = 10) -> list[dict]:
    """Padded examples with an extra column the model does not take (Trainer must drop it)."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        ids = torch.randint(1, 100, (length,), generator=gen)
        mask = torch.ones(length, dtype=torch.long)
        mask[length - i % 4:] = 0  # some rows padded
        labels = (ids.masked_fill(mask == 0, -100) if kind == "llama"
                  else torch.tensor(int(ids[0]) % 3))
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels, "note": i})
    return out


def _trainer(model, kind: str, out: Path):
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, per_device_eval_batch_size=8,
        gradient_accumulation_steps=3, num_train_epochs=2, learning_rate=5e-3, weight_decay=0.1, warmup_steps=2,
        seed=0, use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_examples(kind),
                                eval_dataset=_examples(kind, n=8))


def _train(model, kind: str, out: Path) -> tuple[dict, dict]:
    trainer = _trainer(model, kind, out)
    trainer.train()
    metrics = trainer.evaluate()
    trainer.save_model(str(out / "saved"))
    return metrics, model.state_dict()


@pytest.fixture(scope="module")
def hf_cloud(tmp_path_factory):
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", FACTORY,
                                     "--model", TEMPERATURE)
    yield address
    stop(proc)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_trainer_with_its_defaults_trains_the_split_model_exactly_like_the_unsplit_one(hf_cloud, tmp_path, kind):
    local_metrics, local_state = _train(tiny_hf(kind), kind, tmp_path / "local")
    model = splitft.split(tiny_hf(kind), CUTS[kind], factory=splitft.Factory(FACTORY, {"kind": kind}),
                          connect=hf_cloud)
    assert model.num_parameters() == tiny_hf(kind).num_parameters()  # the whole model, placeholders included
    with model:
        metrics, state = _train(model, kind, tmp_path / "split")
    assert set(state) == set(local_state)
    for name, value in local_state.items():  # bitwise, with the loss divided by 3 for accumulation
        assert torch.equal(state[name], value), name
    assert metrics["eval_loss"] == pytest.approx(local_metrics["eval_loss"], rel=1e-4)
    moved = max(float((state[n] - tiny_hf(kind).state_dict()[n]).abs().max()) for n in state)
    assert moved > 1e-3  # it really trained
    from safetensors.torch import load_file

    files = sorted((tmp_path / "split" / "saved").glob("*.safetensors"))
    assert files, "save_model wrote no weights"
    written = {k: v for f in files for k, v in load_file(f).items()}
    for name, value in local_state.items():
        if name in written:
            assert torch.equal(written[name], value), name
    assert len(written) >= len(local_state) - 1  # (a tied weight may be written once)


@pytest.mark.parametrize("kind", ["bert", "llama"])
def test_trainer_trains_a_model_with_dropout_split_exactly_like_the_unsplit_one(hf_cloud, tmp_path, kind):
    """Dropout on the edge's layers, in the cloud's and in the edge's again after them (attention
    and hidden dropout): the masks are the unsplit run's, so the weights are too, bit for bit."""
    _, local_state = _train(tiny_hf(kind, dropout=0.1), kind, tmp_path / "local")
    _, no_dropout = _train(tiny_hf(kind), kind, tmp_path / "plain")
    model = splitft.split(tiny_hf(kind, dropout=0.1), CUTS[kind],
                          factory=splitft.Factory(FACTORY, {"kind": kind, "dropout": 0.1}), connect=hf_cloud)
    with model:
        _, state = _train(model, kind, tmp_path / "split")
    for name, value in local_state.items():
        assert torch.equal(state[name], value), name
    assert any(not torch.equal(value, no_dropout[name]) for name, value in local_state.items())  # it dropped


def test_trainer_with_adafactor_trains_checkpoints_and_resumes_the_split_model_as_unsplit(hf_cloud, tmp_path):
    """``optim="adafactor"``: the cloud builds transformers' Adafactor at the edge's release of it.
    The optimizer state Trainer's checkpoint saves holds the cloud parameters' entries as unsplit,
    with the step counts Adafactor keeps as Python ints, and a new Adafactor that loads it goes on
    training as the unsplit one does."""
    from transformers.optimization import Adafactor

    rows = _examples("bert", 8)
    batches = [{k: torch.stack([torch.as_tensor(r[k]) for r in rows[i:i + 4]])
                for k in ("input_ids", "attention_mask", "labels")} for i in (0, 4)]

    def train(model, out: Path) -> tuple[dict, dict]:
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=1, learning_rate=5e-3,
            optim="adafactor", seed=0, use_cpu=True, report_to="none", save_strategy="steps", save_steps=3,
            logging_strategy="no", disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=_examples("bert"))
        trainer.train()
        saved = torch.load(out / "checkpoint-6" / "optimizer.pt", weights_only=True)
        kept = copy.deepcopy(saved)  # a loaded state dict is the optimizer's state, moved by the steps after
        resumed = Adafactor([{"params": group["params"], "weight_decay": group["weight_decay"]}
                             for group in trainer.optimizer.param_groups],  # Trainer's groups: no decay for some
                            lr=5e-3, scale_parameter=False, relative_step=False)
        resumed.load_state_dict(saved)
        for batch in batches:
            resumed.zero_grad()
            model(**batch).loss.backward()
            resumed.step()
        return model.state_dict(), kept

    local_state, local_saved = train(tiny_hf("bert"), tmp_path / "local")
    model = splitft.split(tiny_hf("bert"), CUTS["bert"], factory=splitft.Factory(FACTORY, {"kind": "bert"}),
                          connect=hf_cloud)
    with model:
        state, saved = train(model, tmp_path / "split")
    for name, value in local_state.items():
        assert torch.equal(state[name], value), name
    assert saved["param_groups"] == local_saved["param_groups"]
    assert saved["state"].keys() == local_saved["state"].keys()
    for index, entry in local_saved["state"].items():
        assert saved["state"][index].keys() == entry.keys(), index
        for key, value in entry.items():
            assert type(saved["state"][index][key]) is type(value), (index, key)
            assert (torch.equal(saved["state"][index][key], value) if isinstance(value, torch.Tensor)
                    else saved["state"][index][key] == value), (index, key)
    assert {entry["step"] for entry in saved["state"].values()} == {6}


def test_t5_cut_at_an_inner_encoder_block_trains_as_unsplit_and_a_decoder_cut_names_the_encoder(tmp_path):
    """T5's blocks after the first take the relative position bias the first computes, a permuted
    tensor (it was refused as a channels_last activation); a decoder block meets the
    EncoderDecoderCache T5 makes whenever use_cache is on, training included, refused naming the
    encoder cut."""
    proc, address, _ = start_cloud(tmp_path, "--sessions", "0", "--model", FACTORY)
    factory = splitft.Factory(FACTORY, {"kind": "t5"})
    ids = torch.randint(1, 64, (2, 7), generator=torch.Generator().manual_seed(0))

    def train(model) -> dict:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for _ in range(2):
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
        return model.state_dict()

    try:
        local = train(tiny_hf("t5"))
        with splitft.split(tiny_hf("t5"), "encoder.block.1:2", factory=factory, connect=address) as model:
            state = train(model)
        for name, value in local.items():
            assert torch.equal(state[name], value), name
        with splitft.split(tiny_hf("t5"), "decoder.block.1:2", factory=factory, connect=address) as model:
            with pytest.raises(splitft.ConfigError, match="EncoderDecoderCache.*use_cache is on.*Cut inside the encoder"):
                model(input_ids=ids, labels=ids)
    finally:
        stop(proc)


def test_an_accelerate_loop_trains_the_split_model_exactly_like_the_unsplit_one(hf_cloud):
    from accelerate import Accelerator

    def run(model):
        accelerator = Accelerator(cpu=True, gradient_accumulation_steps=3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        data = torch.utils.data.DataLoader(_examples("bert", 16), batch_size=4,
                                           collate_fn=lambda rows: {k: torch.stack([torch.as_tensor(r[k]) for r in rows])
                                                                    for k in ("input_ids", "attention_mask", "labels")})
        model, opt, data = accelerator.prepare(model, opt, data)
        model.train()
        for batch in data:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 0.5)
                opt.step()
                opt.zero_grad()
        return model.state_dict()

    local = run(tiny_hf("bert"))
    model = splitft.split(tiny_hf("bert"), CUTS["bert"], factory=splitft.Factory(FACTORY, {"kind": "bert"}),
                          connect=hf_cloud)
    with model:
        state = run(model)
    for name, value in local.items():  # bitwise, with the loss divided by 3 for accumulation
        assert torch.equal(state[name], value), name


def test_trainer_decays_a_parameter_of_the_model_root_itself_as_unsplit(hf_cloud, tmp_path):
    """A learned temperature set on the root module (CLIP's ``logit_scale``): Trainer finds the
    parameters to decay in ``named_children()`` and the root's ``_parameters``; split, the root's
    must be found there too, or it trains without weight decay."""
    gen = torch.Generator().manual_seed(1)
    rows = [{"x": torch.randn(12, generator=gen), "labels": torch.tensor(i % 3)} for i in range(24)]

    def run(model, out: Path) -> dict:
        args = transformers.TrainingArguments(
            output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=2, learning_rate=5e-2,
            weight_decay=0.5, seed=0, use_cpu=True, report_to="none", save_strategy="no", logging_strategy="no",
            disable_tqdm=True)
        transformers.Trainer(model=model, args=args, train_dataset=rows).train()
        return model.state_dict()

    local = run(temperature_classifier(), tmp_path / "local")
    model = splitft.split(temperature_classifier(), "body.1:3", factory=TEMPERATURE, connect=hf_cloud)
    with model:
        state = run(model, tmp_path / "split")
        assert set(state) == set(local)
        for name, value in local.items():
            assert torch.equal(state[name], value), name
        assert float(state["logit_scale"]) != float(temperature_classifier().logit_scale)  # it trained
        assert model._parameters is model.wrapped._parameters
        model.to("cpu")  # the root's parameters are cast once, with the wrapped model
        assert model.logit_scale is model.wrapped.logit_scale


def _lm_examples(n: int = 16, length: int = 12) -> list[dict]:
    gen = torch.Generator().manual_seed(2)
    out = []
    for _ in range(n):
        ids = torch.randint(1, 128, (length,), generator=gen)
        out.append({"input_ids": ids, "attention_mask": torch.ones(length, dtype=torch.long), "labels": ids.clone()})
    return out


def _default_trainer(model, out: Path):
    """Trainer as a LoRA fine-tuning script builds it: its defaults but for where, how long, on what."""
    args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=1,
                                          use_cpu=True, report_to="none", disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_lm_examples())


def test_trainer_saves_a_split_peft_model_with_tied_embeddings_as_it_saves_the_unsplit_one(tmp_path):
    """Trainer's end-of-training checkpoint and save_model write adapter files (not a raw state_dict,
    which safetensors refuses for tied weights); they load back into an unsplit model with the
    split run's logits."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from tests.models import tiny_tied_lora

    (tmp_path / "cloud").mkdir()
    proc, address, err = start_cloud(tmp_path / "cloud", "--sessions", "0", "--model", "tests.models:tiny_tied_lora")
    try:
        local = _default_trainer(tiny_tied_lora(), tmp_path / "local")
        local.train()
        local.save_model(str(tmp_path / "local" / "saved"))
        model = splitft.split(tiny_tied_lora(), "base_model.model.model.layers.1:3",
                              factory="tests.models:tiny_tied_lora", connect=address)
        with model:
            trainer = _default_trainer(model, tmp_path / "split")
            trainer.train()
            trainer.save_model(str(tmp_path / "split" / "saved"))
    finally:
        stop(proc)
    for folder in ("checkpoint-4", "saved"):
        written = {p.name for p in (tmp_path / "split" / folder).iterdir()}
        assert written == {p.name for p in (tmp_path / "local" / folder).iterdir()}, folder
        assert "adapter_model.safetensors" in written and "model.safetensors" not in written
        split_adapter = load_file(tmp_path / "split" / folder / "adapter_model.safetensors")
        local_adapter = load_file(tmp_path / "local" / folder / "adapter_model.safetensors")
        assert split_adapter.keys() == local_adapter.keys() and len(split_adapter) == 16  # q, v: A, B, 4 layers
        for name, value in local_adapter.items():
            torch.testing.assert_close(split_adapter[name], value, rtol=1e-5, atol=1e-6, msg=name)
    reloaded = PeftModel.from_pretrained(tiny_tied_lora().unload(), str(tmp_path / "split" / "saved")).eval()
    ids = torch.randint(1, 128, (2, 12), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, local.model.eval()(input_ids=ids).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no dropout", "dropout"])
def test_trainer_with_activation_checkpointing_trains_the_split_model_bitwise(hf_cloud, tmp_path, dropout):
    """gradient_checkpointing_enable() marks every layer, the cloud's ghosts too: those are called
    plainly (the cloud computes the same values), the edge's own layers checkpoint (and recompute
    with the masks they drew)."""
    fields = transformers.TrainingArguments.__dataclass_fields__
    flag = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"

    def run(model, out: Path) -> dict:
        args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=4, num_train_epochs=1,
                                              use_cpu=True, report_to="none", disable_tqdm=True, save_strategy="no",
                                              **{flag: True})
        transformers.Trainer(model=model, args=args, train_dataset=_examples("llama")).train()
        return model.state_dict()

    local = run(tiny_hf("llama", dropout=dropout), tmp_path / "local")
    model = splitft.split(tiny_hf("llama", dropout=dropout), CUTS["llama"],
                          factory=splitft.Factory(FACTORY, {"kind": "llama", "dropout": dropout}), connect=hf_cloud)
    with model:
        split = run(model, tmp_path / "split")
    assert split.keys() == local.keys()
    assert [k for k, v in local.items() if not torch.equal(split[k], v)] == []


def _resumable(model, kind: str, out: Path, max_steps: int):
    args = transformers.TrainingArguments(
        output_dir=str(out), per_device_train_batch_size=4, gradient_accumulation_steps=3, max_steps=max_steps,
        learning_rate=5e-3, weight_decay=0.1, warmup_steps=2, seed=0, use_cpu=True, report_to="none",
        save_strategy="steps", save_steps=2, logging_strategy="no", disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=_examples(kind))


def _stopped_and_resumed(make, kind: str, out: Path) -> dict:
    """Train to a checkpoint at step 2 and stop; a new model and Trainer resume it to step 4."""
    first = make()
    _resumable(first, kind, out, max_steps=2).train()
    getattr(first, "close", lambda: None)()
    second = make()
    _resumable(second, kind, out, max_steps=4).train(resume_from_checkpoint=str(out / "checkpoint-2"))
    state = second.state_dict()
    getattr(second, "close", lambda: None)()
    return state


@pytest.mark.parametrize("dropout", [0.0, 0.1], ids=["no dropout", "dropout"])
@pytest.mark.parametrize("kind", ["bert"])
def test_trainer_resumes_a_split_run_from_its_checkpoint_as_it_resumes_the_unsplit_one(hf_cloud, tmp_path, kind,
                                                                                        dropout):
    """Its checkpoint's optimizer.pt holds the cloud half's moments too (``opt.state_dict()``
    fetches them), and ``resume_from_checkpoint`` loads them back into a new session's optimizer:
    the resumed split run ends where the resumed unsplit run ends, bitwise. With dropout too: the
    checkpoint's generator state, restored on the edge, goes with the next forward."""
    local = _stopped_and_resumed(lambda: tiny_hf(kind, dropout=dropout), kind, tmp_path / "local")
    saved = torch.load(tmp_path / "local" / "checkpoint-2" / "optimizer.pt")
    factory = splitft.Factory(FACTORY, {"kind": kind, "dropout": dropout})
    split = _stopped_and_resumed(lambda: splitft.split(tiny_hf(kind, dropout=dropout), CUTS[kind], connect=hf_cloud,
                                                       factory=factory), kind, tmp_path / "split")
    split_saved = torch.load(tmp_path / "split" / "checkpoint-2" / "optimizer.pt")
    assert split_saved["state"].keys() == saved["state"].keys()  # the cloud half's entries are in it
    for index, entry in saved["state"].items():
        assert all(torch.equal(split_saved["state"][index][key], value) for key, value in entry.items()), index
    assert set(split) == set(local)
    for name, value in local.items():
        assert torch.equal(split[name], value), name


def test_a_model_asked_for_its_hidden_states_before_split_still_splits(hf_cloud):
    """transformers installs output-recording hooks on its layers the first time a forward asks
    for hidden states: they record and never change an output, so split() keeps them (hooks a
    script registers on cloud modules are refused)."""
    kind = "bert"
    net = tiny_hf(kind)
    example = _examples(kind, n=2)
    ids = torch.stack([e["input_ids"] for e in example])
    net(input_ids=ids, output_hidden_states=True)
    hooked = [m for m in net.modules() if m._forward_hooks]
    if not hooked:
        pytest.skip("this transformers version records hidden states without hooks")
    model = splitft.split(net, CUTS[kind], factory=splitft.Factory(FACTORY, {"kind": kind}), connect=hf_cloud)
    with model:
        out = model(input_ids=ids, labels=torch.tensor([0, 1]))
        out.loss.backward()
        assert torch.isfinite(out.loss)
