"""Many edges against one cloud on loopback: steps lost or repeated, throughput, memory per session.

A cloud process serves a tiny MLP (``splitft.app.models:tiny_mlp``, cut at 2) over tcp on 127.0.0.1.
Edge processes each run several edges as threads; every edge trains its own session for the given
number of steps on its own random data, with Adam. Afterwards:

* **lost / repeated steps**: the optimizer steps the cloud applied for each session (from
  ``CloudServer.finished``) against the steps the edge took, and each edge's final cloud-half
  weights against the same model trained in one process on the same data (``--no-verify`` skips
  this second check);
* **throughput**: all edges' steps over the wall time of the training phase, and the per-step
  latency an edge sees;
* **memory per session**: the cloud's resident memory with every session open, minus its
  memory before the first edge connected, over the number of sessions.

``--drop P`` loses each reply with probability P on its way to the edge, so every lost reply
costs the edge a timeout, a reconnection and a resumed session; the step counts must still match.
``--checkpoint-every N`` makes the cloud checkpoint each session (to a temporary folder).

``--ranks N`` runs the same load twice in one go: against a one-process cloud, then against a
cloud of N ranks (a torch.distributed job on gloo, started by torch's launcher; rank 0 places each
edge on the least-loaded rank). The figures are the N-rank run's, with the one-process run's
throughput, latency and memory beside them and the ratio of the two throughputs.

    python scripts/load_cloud.py                          # 32 edges x 200 steps
    python scripts/load_cloud.py --drop 0.01 --timeout 0.5
    python scripts/load_cloud.py --checkpoint-every 1 --json result.json
    python scripts/load_cloud.py --ranks 2 --edges 16 --steps 50
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

FACTORY = "splitft.app.models:tiny_mlp"
CUT = 2


def _rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


# ---------------------------------------------------------------- the cloud process


def _warm_up() -> None:
    """One short session in this process, so that what torch and splitft load on first use is in
    the baseline memory rather than charged to the first session."""
    import torch
    from torch import nn

    import splitft
    import transports
    from splitft.cloud import CloudServer, serve_in_thread
    from splitft.app.models import tiny_mlp

    listener = transports.InprocListener()
    server = CloudServer(listener, [FACTORY], on_event=lambda text: None)
    thread = serve_in_thread(server)
    with splitft.split(tiny_mlp(), CUT, factory=FACTORY, connect=listener.connect,
                       faults=splitft.Faults(heartbeat=0)) as model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-2))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for x, y in _data(0, 3, 16):
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    server.stop()
    thread.join(timeout=10)


def _cloud_main(conn, checkpoint_every: int, folder: str | None) -> None:
    import gc

    import torch

    import transports
    from splitft.cloud import CloudServer, serve_in_thread

    torch.set_num_threads(1)
    _warm_up()
    gc.collect()
    listener = transports.listen("tcp://127.0.0.1:0")
    server = CloudServer(listener, [FACTORY], checkpoint_dir=folder, checkpoint_every=max(1, checkpoint_every),
                         fsync=False, on_event=lambda text: None)
    thread = serve_in_thread(server)
    time.sleep(0.2)
    base = _rss_bytes()
    conn.send(listener.address)
    peak, peak_sessions, stop = base, 0, False
    while not stop:
        open_now = len(server.by_id)
        rss = _rss_bytes()
        if open_now > peak_sessions or (open_now == peak_sessions and rss > peak):
            peak, peak_sessions = max(peak, rss), max(peak_sessions, open_now)
        stop = conn.poll(0.05)
    server.stop()
    thread.join(timeout=30)
    conn.send({"base_rss": base, "peak_rss": peak, "peak_sessions": peak_sessions, "finished": list(server.finished)})


def _rank_main(checkpoint_every: int, folder: str | None, sessions: int, ready: str) -> dict:
    """One rank of an N-rank cloud (torch's launcher runs it); its memory and finished sessions."""
    import gc

    import torch

    import transports
    from splitft.cloud import serve_in_thread
    from splitft.cloud.rank_server import RankServer
    from splitft.cloud.ranks import RankEnv, RankGroup

    torch.set_num_threads(1)
    group = RankGroup.join(RankEnv.from_environ())
    _warm_up()
    gc.collect()
    listener = transports.listen(group.bind_address("tcp://127.0.0.1:0"))
    group.publish(listener.address)
    # The job ends itself: every rank stops once the job has ended ``sessions`` sessions.
    server = RankServer(listener, [FACTORY], group=group, max_sessions=sessions, checkpoint_dir=folder,
                        checkpoint_every=max(1, checkpoint_every), fsync=False, on_event=lambda text: None)
    thread = serve_in_thread(server)
    time.sleep(0.2)
    base = _rss_bytes()
    if group.rank == 0:
        group.wait_for_ranks(60)
        Path(ready).write_text(listener.address)
    peak, peak_sessions = base, 0
    while thread.is_alive():
        open_now, rss = len(server.by_id), _rss_bytes()
        if open_now > peak_sessions or (open_now == peak_sessions and rss > peak):
            peak, peak_sessions = max(peak, rss), max(peak_sessions, open_now)
        thread.join(0.05)
    group.close()
    return {"base_rss": base, "peak_rss": peak, "peak_sessions": peak_sessions, "finished": list(server.finished)}


def _ranks_main(conn, ranks: int, checkpoint_every: int, folder: str | None, sessions: int, ready: str) -> None:
    import uuid

    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from splitft.cloud.job_store import ensure_job_secret

    ensure_job_secret()  # the ranks sign what they write in the job's store with it
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=ranks, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2,
                          start_method="spawn")
    conn.send(elastic_launch(config, _rank_main)(checkpoint_every, folder, sessions, ready))


# ---------------------------------------------------------------- edge processes


def _data(edge: int, steps: int, batch: int):
    import torch

    g = torch.Generator().manual_seed(1000 + edge)
    return [(torch.randn(batch, 16, generator=g), torch.randint(0, 4, (batch,), generator=g)) for _ in range(steps)]


class _Lossy:
    """Loses each received message with probability ``p`` (a reply that never arrives)."""

    def __init__(self, inner, p: float, seed: int) -> None:
        import random

        self.inner, self.p, self.address = inner, p, inner.address
        self.rng = random.Random(seed)

    def send(self, frames):
        return self.inner.send(frames)

    def recv(self, timeout):
        import transports

        deadline = time.monotonic() + timeout
        while True:
            frames = self.inner.recv(max(0.0, deadline - time.monotonic()))
            if self.rng.random() >= self.p:
                return frames
            if time.monotonic() >= deadline:
                raise transports.TransportTimeout("reply lost on purpose")

    def close(self):
        self.inner.close()


_BUILD = threading.Lock()  # model factories seed torch's global RNG: one thread at a time


def _edge(i: int, address: str, args, out: dict) -> None:
    import torch
    from torch import nn

    import splitft
    import transports
    from splitft.app.models import tiny_mlp

    torch.set_num_threads(1)
    data = _data(i, args.steps, args.batch)
    with _BUILD:
        full = tiny_mlp(seed=i)
    if args.drop:
        connection = lambda: _Lossy(transports.connect(address), args.drop, seed=i)  # noqa: E731
    else:
        connection = address
    model = splitft.split(full, CUT, factory=FACTORY, connect=connection,
                          faults=splitft.Faults(timeout=args.timeout, heartbeat=0))
    latencies = []
    with model:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=1e-2))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        start = time.perf_counter()
        for x, y in data:
            t = time.perf_counter()
            crit(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            latencies.append(time.perf_counter() - t)
        model.sync()
        end = time.perf_counter()
        weights = {**model.edge_state_dict(), **model.cloud_state_dict()}
        out[i] = {"session": model.session.session_id, "steps": model.stage.step, "start": start, "end": end,
                  "latencies": latencies, "recoveries": model.session.recoveries, "weights": weights}


def _verify(i: int, result: dict, steps: int, batch: int) -> bool:
    """The same model trained in one process on the same data: equal weights, or a step went wrong."""
    import torch
    from torch import nn

    from splitft.app.models import tiny_mlp

    local = tiny_mlp(seed=i)
    opt = torch.optim.Adam(local.parameters(), lr=1e-2)
    for x, y in _data(i, steps, batch):
        nn.functional.cross_entropy(local(x), y).backward()
        opt.step()
        opt.zero_grad()
    return all(torch.allclose(result["weights"][k], v, rtol=1e-5, atol=1e-6) for k, v in local.state_dict().items())


def _edges_main(conn, ids: list[int], address: str, args) -> None:
    import torch

    torch.set_num_threads(1)
    out: dict = {}
    threads = [threading.Thread(target=_edge, args=(i, address, args, out)) for i in ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    verified = {i: _verify(i, r, args.steps, args.batch) for i, r in out.items()} if args.verify else {}
    for r in out.values():
        del r["weights"]
    conn.send({"results": out, "verified": verified, "missing": sorted(set(ids) - set(out))})


# ---------------------------------------------------------------- driver


def run(args: argparse.Namespace) -> dict:
    """Run the benchmark; returns the figures (also what ``--json`` writes)."""
    # One thread of torch per thread of ours: OpenMP's thread count is per calling thread, and a
    # pool of spinning OpenMP workers per edge thread would swamp two cores.
    os.environ["OMP_NUM_THREADS"] = "1"
    ctx = mp.get_context("spawn")
    figures = _run_once(args, ctx, ranks=1)
    if args.ranks <= 1:
        return figures
    several = _run_once(args, ctx, ranks=args.ranks)
    baseline = {f"one_rank_{k}": figures[k] for k in ("steps_lost", "steps_repeated", "weights_equal_to_local",
                                                      "steps_per_s", "step_latency_ms_median", "cloud_kib_per_session")}
    return {**several, **baseline, "throughput_vs_one_rank": several["steps_per_s"] / figures["steps_per_s"]}


def _start_cloud(ctx, args: argparse.Namespace, ranks: int, tmp: str):
    """The cloud's address, and a function that waits for its report once the edges are done."""
    folder = os.path.join(tmp, "checkpoints") if args.checkpoint_every else None
    cloud_end, here = ctx.Pipe()
    if ranks == 1:
        cloud = ctx.Process(target=_cloud_main, args=(cloud_end, args.checkpoint_every, folder), daemon=True)
        cloud.start()
        if not here.poll(120):
            raise RuntimeError("the cloud process did not start")
        address = here.recv()

        def finish() -> dict:
            here.send("stop")
            report = here.recv()
            cloud.join(timeout=60)
            return report

        return address, finish
    ready = Path(tmp) / "address"
    cloud = ctx.Process(target=_ranks_main, args=(cloud_end, ranks, args.checkpoint_every, folder, args.edges,
                                                   str(ready)))
    cloud.start()
    deadline = time.monotonic() + 120
    while not (ready.exists() and ready.read_text()):
        if time.monotonic() > deadline or not cloud.is_alive():
            raise RuntimeError(f"the cloud of {ranks} ranks did not start")
        time.sleep(0.05)

    def finish_ranks() -> dict:
        if not here.poll(120):
            cloud.terminate()
            raise RuntimeError("the ranks did not stop after the last session ended")
        per_rank = here.recv()
        cloud.join(timeout=60)
        reports = [per_rank[r] for r in sorted(per_rank)]
        return {"base_rss": sum(r["base_rss"] for r in reports), "peak_rss": sum(r["peak_rss"] for r in reports),
                "peak_sessions": sum(r["peak_sessions"] for r in reports),
                "sessions_per_rank": [len(r["finished"]) for r in reports],
                "finished": [f for r in reports for f in r["finished"]]}

    return ready.read_text(), finish_ranks


def _run_once(args: argparse.Namespace, ctx, ranks: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="splitft-load-") as tmp:
        address, finish = _start_cloud(ctx, args, ranks, tmp)
        groups = [list(range(args.edges))[p::args.procs] for p in range(args.procs)]
        pipes, procs = [], []
        for ids in groups:
            a, b = ctx.Pipe()
            proc = ctx.Process(target=_edges_main, args=(a, ids, address, args), daemon=True)
            proc.start()
            pipes.append(b)
            procs.append(proc)
        reports = [p.recv() for p in pipes]
        for proc in procs:
            proc.join(timeout=60)
        cloud_report = finish()

    results = {i: r for rep in reports for i, r in rep["results"].items()}
    verified = {i: ok for rep in reports for i, ok in rep["verified"].items()}
    cloud_steps = {f["session"]: f for f in cloud_report["finished"]}
    lost = repeated = 0
    for r in results.values():
        applied = cloud_steps.get(r["session"], {}).get("steps", 0)
        lost += max(0, r["steps"] - applied)
        repeated += max(0, applied - r["steps"])
    lost += args.steps * sum(len(rep["missing"]) for rep in reports)
    wall = max(r["end"] for r in results.values()) - min(r["start"] for r in results.values())
    latencies = sorted(x for r in results.values() for x in r["latencies"])
    sessions = max(1, cloud_report["peak_sessions"])
    return {
        "ranks": ranks, "edges": args.edges, "steps_per_edge": args.steps, "edge_processes": args.procs, "batch": args.batch,
        "drop": args.drop, "checkpoint_every": args.checkpoint_every,
        "steps_total": sum(r["steps"] for r in results.values()),
        "steps_applied_by_cloud": sum(cloud_steps.get(r["session"], {}).get("steps", 0) for r in results.values()),
        "steps_lost": lost, "steps_repeated": repeated,
        "requests_repeated_and_answered_from_cache": sum(f["repeats"] for f in cloud_report["finished"]),
        "recoveries": sum(r["recoveries"] for r in results.values()),
        "weights_equal_to_local": f"{sum(verified.values())}/{len(verified)}" if verified else "not checked",
        "wall_s": wall, "steps_per_s": sum(r["steps"] for r in results.values()) / wall,
        "step_latency_ms_median": 1000 * statistics.median(latencies),
        "step_latency_ms_p95": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
        "cloud_rss_base_mib": cloud_report["base_rss"] / 2**20,
        "cloud_rss_peak_mib": cloud_report["peak_rss"] / 2**20,
        "sessions_open_at_peak": cloud_report["peak_sessions"],
        "cloud_kib_per_session": (cloud_report["peak_rss"] - cloud_report["base_rss"]) / sessions / 1024,
        **({"sessions_per_rank": cloud_report["sessions_per_rank"]} if "sessions_per_rank" in cloud_report else {}),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    parser.add_argument("--edges", type=int, default=32, help="edges, one session each (default: 32)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per edge (default: 200)")
    parser.add_argument("--procs", type=int, default=4,
                        help="edge processes; edges run as threads in them (default: 4)")
    parser.add_argument("--batch", type=int, default=16, help="samples per step (default: 16)")
    parser.add_argument("--drop", type=float, default=0.0, help="probability that a reply is lost (default: 0)")
    parser.add_argument("--timeout", type=float, default=30.0,
                        help="seconds an edge waits for a reply before it reconnects (default: 30)")
    parser.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                        help="cloud checkpoints every N steps into a temporary folder (default: 0, none)")
    parser.add_argument("--no-verify", dest="verify", action="store_false",
                        help="skip comparing each edge's final weights with a one-process run")
    parser.add_argument("--ranks", type=int, default=1, metavar="N",
                        help="also run the load against a cloud of N ranks (torch.distributed, gloo) and compare "
                             "(default: 1, one process only)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    if args.edges < 1 or args.steps < 1 or not 1 <= args.procs <= args.edges or not 0 <= args.drop < 1:
        parser.error("need edges >= 1, steps >= 1, 1 <= procs <= edges and 0 <= drop < 1")
    if args.ranks > 1 and args.drop:
        parser.error("--drop wraps each edge's link in a lossy opener, which cannot follow a rank's redirect; "
                     "use --drop without --ranks")
    figures = run(args)
    width = max(map(len, figures))
    for key, value in figures.items():
        print(f"{key:<{width}}  {value:.2f}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    ok = all(figures.get(f"{run}{k}", 0) == 0 for run in ("", "one_rank_") for k in ("steps_lost", "steps_repeated")) \
        and all(figures.get(f"{run}weights_equal_to_local", "not checked") in ("not checked", f"{args.edges}/{args.edges}")
                for run in ("", "one_rank_"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
