"""`splitft cloud --metrics-port`: a running cloud scraped over HTTP, as Prometheus would."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
import torch
from torch import nn

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

import splitft  # noqa: E402
from splitft import Faults  # noqa: E402
from splitft.app.data import batches, load_digits  # noqa: E402
from splitft.app.models import digits_cnn  # noqa: E402
from splitft.cloud import CloudServer, serve_in_thread  # noqa: E402
from splitft.cloud.prometheus import Endpoint  # noqa: E402
from splitft.errors import SplitFTError  # noqa: E402
from tests.conftest import DIGITS, ROOT, start_cloud, stop  # noqa: E402
from tests.models import mlp  # noqa: E402
from tests.test_faults import MLP  # noqa: E402
from transports import InprocListener  # noqa: E402

URL = re.compile(r"metrics at (http://\S+/metrics)")
FAULTS = Faults(timeout=30, heartbeat=0)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample the endpoint serves: (name, sorted labels) → value."""
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def total(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def _train(model: splitft.SplitModel, steps: int) -> None:
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.05))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    for (x, y, _), _ in zip(batches(load_digits()[0], 32, shuffle=True), range(steps)):
        crit(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    model.sync()


def test_a_running_cloud_is_scraped_after_a_real_edge_trained(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", DIGITS, "--metrics-port", "0",
                                     "--checkpoint-dir", str(tmp_path / "ckpt"))
    try:
        assert err.wait_for("metrics at http://127.0.0.1:", 30), err.text  # loopback unless told
        url = URL.search(err.text).group(1)
        with pytest.raises(SplitFTError):  # a refusal, counted by its code
            splitft.split(digits_cnn(), "block3", factory="tests.models:not_served", connect=address, faults=FAULTS)
        model = splitft.split(digits_cnn(), "block3", factory=DIGITS, codecs="fp16", connect=address, faults=FAULTS)
        _train(model, 3)
        during = scrape(url)
        model.close()
        after = scrape(url)
    finally:
        stop(proc)
    assert value(during, "splitft_sessions_open") == 1 and value(after, "splitft_sessions_open") == 0
    assert value(during, "splitft_memory_booked_bytes") > 0 and value(after, "splitft_memory_booked_bytes") == 0
    assert value(during, "splitft_checkpoint_folder_bytes") > 0
    assert value(after, "splitft_memory_limit_bytes") > 0 and value(after, "splitft_memory_resident_bytes") > 2**20
    assert value(after, "splitft_sessions_opened_total") == 1 and value(after, "splitft_sessions_ended_total") == 1
    assert value(after, "splitft_optimizer_steps_total") == 3
    assert value(after, "splitft_requests_total", type="forward") == 3
    assert value(after, "splitft_requests_total", type="hello") == 2
    assert value(after, "splitft_request_seconds_count", type="forward") == 3
    assert 0 < value(after, "splitft_request_seconds_sum", type="forward") < 60
    assert value(after, "splitft_request_seconds_bucket", type="forward", le="+Inf") == 3
    assert total(after, "splitft_refusals_total") == 1
    # the bytes the edge counted, per direction and the codec that carried them, are the cloud's
    for direction, kind in (("up", "activation"), ("down", "gradient")):
        edge = model.metrics.bytes[(direction, kind)].wire
        assert edge > 0 and value(after, "splitft_wire_bytes_total", direction=direction, kind=kind,
                                  codec="fp16") == edge
    up, down = model.metrics.direction("up").wire, model.metrics.direction("down").wire
    cloud_up = sum(v for (n, labels), v in after.items() if n == "splitft_wire_bytes_total" and ("direction", "up") in labels)
    assert cloud_up == up and value(during, "splitft_wire_bytes_total", direction="down", kind="gradient",
                                    codec="fp16") > 0 and down > 0


def test_each_cloud_in_a_process_has_its_own_registry():
    clouds = []
    for sessions in (1, 2):
        listener = InprocListener()
        server = CloudServer(listener, [MLP])
        endpoint = Endpoint(0)
        endpoint.watch(server)
        clouds.append((listener, server, endpoint, serve_in_thread(server)))
        for _ in range(sessions):
            with splitft.split(mlp(), 2, factory=MLP, connect=listener.connect, faults=FAULTS) as model:
                _train_mlp(model)
    try:
        counts = [value(scrape(endpoint.url), "splitft_sessions_ended_total") for _, _, endpoint, _ in clouds]
        assert counts == [1, 2]
        assert "send" not in vars(CloudServer(InprocListener(), [MLP]))  # a cloud without metrics is untouched
    finally:
        for listener, server, endpoint, thread in clouds:
            server.stop()
            thread.join(10)
            endpoint.close()


def _train_mlp(model: splitft.SplitModel) -> None:
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    crit = model.remote_loss(nn.CrossEntropyLoss())
    crit(model(torch.randn(4, 12)), torch.tensor([0, 1, 2, 0])).backward()
    opt.step()


def test_metrics_asked_for_without_prometheus_client_is_a_clear_error(tmp_path):
    hidden = tmp_path / "hidden" / "prometheus_client"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError('not installed here')\n")
    env = os.environ | {"PYTHONPATH": f"{hidden.parent}{os.pathsep}{ROOT}", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "splitft", "cloud", "--bind", "tcp://127.0.0.1:0",
                           "--metrics-port", "0"], cwd=ROOT, env=env, text=True, capture_output=True,
                          stdin=subprocess.DEVNULL, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "pip install 'splitft[metrics]'" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_rank_liveness_on_a_cloud_of_two_ranks(tmp_path):
    from tests.test_ranks import Job, _cloud_args, _env

    job = Job()
    try:
        job.start(_cloud_args(tmp_path / "ready", "--workers", "2", "--metrics-port", "0"), _env())
        job.wait_ready(tmp_path / "ready")
        deadline = time.monotonic() + 60
        while len(URL.findall(job.text)) < 2 or len(job.ranks()) < 2:
            assert time.monotonic() < deadline, job.text
            time.sleep(0.1)
        front = re.search(r"rank 0/2 \(pid \d+\): metrics at (\S+)", job.text).group(1)
        ranks = dict(job.ranks())
        assert _until(front, lambda s: value(s, "splitft_rank_up", rank="1") == 1), job.text
        os.kill(ranks[1], signal.SIGSTOP)  # its heartbeat stands still
        try:
            assert _until(front, lambda s: value(s, "splitft_rank_up", rank="1") == 0
                          and value(s, "splitft_rank_up", rank="0") == 1), job.text
        finally:
            os.kill(ranks[1], signal.SIGCONT)
        assert _until(front, lambda s: value(s, "splitft_rank_up", rank="1") == 1), job.text
    finally:
        job.close()


def _until(url: str, ok, timeout: float = 45) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ok(scrape(url)):
            return True
        time.sleep(0.2)
    return False
