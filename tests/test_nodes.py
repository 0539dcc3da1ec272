"""Several machines, played by two torchrun agents on this one: the README's several-machines
command (a c10d rendezvous, one rank per "node", each node's own --rank-port), edges placed on
both nodes' ranks, each training exactly as it would alone against a one-process cloud.

What this does not test: separate hosts (their names, firewalls, clocks); the two agents here
share the loopback interface, told apart by their --local-addr (127.0.0.1 and 127.0.0.2)."""

from __future__ import annotations

import collections
import secrets
import sys

import pytest

from tests.test_batch_split import _free_port
from tests.test_faults import assert_same
from tests.test_ranks import Job, _alone, _cloud_args, _edges, _env

NODES = ("127.0.0.1", "127.0.0.2")  # the first sorts first: its rank is global rank 0, the front door


def _agent(rdzv_port: int, rdzv_id: str, local_addr: str, rank_port: int, ready) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{rdzv_port}", "--rdzv-id", rdzv_id,
            "--local-addr", local_addr, "--max-restarts", "0",
            *_cloud_args(ready, "--rank-host", "127.0.0.1", "--rank-port", str(rank_port))[1:]]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_two_rendezvous_agents_serve_edges_on_both_nodes_each_as_alone(tmp_path):
    job = Job()
    rdzv_port, rdzv_id = _free_port(), f"splitft-test-{secrets.token_hex(4)}"
    try:
        for addr in NODES:
            job.start(_agent(rdzv_port, rdzv_id, addr, _free_port(), tmp_path / "ready"), _env())
        address = job.wait_ready(tmp_path / "ready")
        # each rank's line is read off its pipe by a thread of its own: the ready file may come first
        assert job.logs[0].wait_for("cloud rank 0/2", 10) and job.logs[1].wait_for("cloud rank 1/2", 10), job.text
        out = _edges(address)
        assert collections.Counter(r["placed"] for r in out.values()) == {0: 2, 1: 2}, job.text
        for i, r in out.items():
            assert_same(r["weights"], _alone(i))
            assert r["recoveries"] == 0
        assert job.wait(30) == [0, 0], job.text  # --sessions counts the sessions ended on both nodes
    finally:
        job.close()
