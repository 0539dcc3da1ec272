"""One split training step four ways, side by side: local, torch RPC, splitft and a raw pyzmq floor.

Every variant trains the same model from the same initial weights on the same batch with Adam,
the loss computed where the model's second half runs:

  local    the unsplit model in one process;
  rpc      torch.distributed.rpc with distributed autograd and DistributedOptimizer, the second
           half in a peer process (TensorPipe; over TCP unless --rpc-transport default, which lets
           TensorPipe pick shared memory);
  splitft  splitft.split() against a real `splitft cloud` process on tcp loopback, identity codecs;
  raw      the floor: a hand-written pyzmq REQ/REP pair, the activation and the labels up and the
           gradient down as bare zero-copy frames, no header, one round trip a step.

Each variant's edge runs in a process of its own (so no variant's threads run during another's
round), and rounds alternate A B C D A B C D ..., so noise on a shared machine hits all alike. A
round reports wall time per step, CPU time per step summed over every thread of the edge process
and of its peer process (the process CPU clocks, nanosecond resolution), and minor page faults per
step of both ("faults": the allocator returning memory to the OS and faulting it back in). Ratios
to raw and to local are taken per round; their medians and ranges [min-max] are printed. At the
end each variant's whole model is fetched and compared to the local one (they do the same
arithmetic, so they should be equal bit for bit; the exit status is 1 if not, except torch RPC's
on an accelerator, whose TorchScript Adam has no foreach path), and the empty round trip of each
transport is timed.

Every process gets half the machine's cores as torch threads (``--threads``). An edge and its peer
run at once where the peer's optimizer step overlaps the edge's backward; with more threads than
their share the two wait for each other's cores, and oneDNN's convolution kernels wait on their
threads in spinning barriers, so the wait shows up as CPU time. With each process at the whole
2-core machine, batch 64 swung between steps of ~8 and ~15 ms on the raw floor itself (its edge's
CPU 4.5 against 9.5 ms), which made every ratio there a matter of luck: an artifact of putting both
machines on one, which two machines do not have.

With ``--device cuda`` every variant runs the model's second half on the GPU: the splitft cloud,
the two peers, and the local model's layers after the cut (its first half stays on the CPU, as the
edge's does), so all four still do the same arithmetic on the same devices.

Workloads are MODEL:BATCH: `cnn` is the digits CNN (splitft.app.models:digits_cnn) cut at block3;
`encoder` is a transformer encoder of --encoder-layers layers (token embedding, post-norm layers,
a linear head over the flattened sequence) cut after its first layer, so the cloud half does most
of the work.

    python scripts/bench_peers.py                                  # cnn:8 cnn:64 cnn:256 encoder:16
    python scripts/bench_peers.py cnn:64 --rounds 15 --json out.json
    python scripts/bench_peers.py cnn:64 cnn:256 encoder:16 --device cuda   # the second half on a GPU
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does: the processes share the cores

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
from contextlib import ExitStack, contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from peer_variants import CNN, ENCODER, REPLY_TIMEOUT, edge_worker, raw_peer, rpc_peer  # noqa: E402

from splitft.app.launch import half_the_cores  # noqa: E402

VARIANTS = ("local", "rpc", "splitft", "raw")


def workload(spec: str, args: argparse.Namespace) -> dict[str, Any]:
    """``cnn:64`` or ``encoder:16`` as a plain dict every process can rebuild the model and batch from."""
    model, _, batch = spec.partition(":")
    if model not in ("cnn", "encoder") or not batch.isdigit() or int(batch) < 1:
        raise ValueError(f"a workload is cnn:BATCH or encoder:BATCH, got {spec!r}")
    on = "" if args.device == "cpu" else f", second half on {args.device}"
    if model == "cnn":
        return {"label": f"cnn b{batch}{on}", "factory": CNN, "kwargs": {}, "cut": "block3", "batch": int(batch),
                "device": args.device}
    kwargs = {"layers": args.encoder_layers, "width": args.encoder_width, "seq": args.seq}
    return {"label": f"encoder{args.encoder_layers} b{batch}{on}", "factory": ENCODER, "kwargs": kwargs,
            "cut": "layer1", "batch": int(batch), "device": args.device}


# ---------------------------------------------------------------- the coordinator


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ask(conn: Any, cmd: str, arg: Any = None) -> Any:
    conn.send((cmd, arg))
    return _answer(conn)


def _answer(conn: Any) -> Any:
    if not conn.poll(REPLY_TIMEOUT):
        raise TimeoutError(f"no answer from an edge process within {REPLY_TIMEOUT:g} s")
    status, reply = conn.recv()
    if status != "ok":
        raise RuntimeError(reply)
    return reply


def _cloud_pid(address: str) -> int:
    """The ``splitft cloud`` process that local_cloud started (a child of this process)."""
    me = str(os.getpid())
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and (entry / "stat").read_text().rpartition(")")[2].split()[1] == me:
                cmd = (entry / "cmdline").read_bytes().split(b"\0")
                if b"splitft" in cmd and b"cloud" in cmd:
                    return int(entry.name)
        except OSError:
            continue
    raise RuntimeError(f"cannot find the cloud process serving {address}")


@contextmanager
def _processes(args: argparse.Namespace):
    """Start every peer and edge process at once (their imports overlap), then the cloud; yields
    the edge connections and each variant's peer; ends them all on the way out."""
    ctx, procs = mp.get_context("spawn"), []
    rpc_port, conns, peers = _free_port(), {}, {"local": {}}

    def start(target: Any, *a: Any) -> Any:
        proc = ctx.Process(target=target, args=a, daemon=True)
        proc.start()
        procs.append(proc)
        return proc

    for v in args.variants:
        conns[v], theirs = ctx.Pipe()
        start(edge_worker, v, theirs, args.threads, rpc_port, args.rpc_transport)
    if "raw" in args.variants:
        mine, theirs = ctx.Pipe()
        raw = start(raw_peer, theirs, args.threads)
    if "rpc" in args.variants:
        peers["rpc"] = {"pid": start(rpc_peer, rpc_port, args.rpc_transport, args.threads).pid}
    with ExitStack() as stack:
        try:
            if "splitft" in args.variants:
                from splitft.app.launch import local_cloud

                address = stack.enter_context(local_cloud([CNN, ENCODER], sessions=0, exit_timeout=0, quiet=True,
                                                                device=args.device))
                peers["splitft"] = {"address": address, "pid": _cloud_pid(address)}
            if "raw" in args.variants:
                if not mine.poll(REPLY_TIMEOUT):
                    raise TimeoutError("the raw peer did not start")
                peers["raw"] = {"address": mine.recv(), "pid": raw.pid}
            yield conns, peers
            for conn in conns.values():
                conn.send(("exit", None))
        finally:
            if "raw" in args.variants:
                raw.terminate()  # it serves until stopped; the edges exit when told, the RPC peer with its edge
            for proc in procs:
                proc.join(timeout=10)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(timeout=5)


def run_workload(w: dict[str, Any], conns: dict[str, Any], peers: dict[str, Any], args: argparse.Namespace,
                 pings: int) -> dict[str, Any]:
    """Set every variant up (in parallel), alternate their rounds, then time pings and compare weights."""
    for v, conn in conns.items():
        conn.send(("setup", {"workload": w, "peer": peers[v], "warmup": args.warmup}))
    for conn in conns.values():
        _answer(conn)
    rounds = [{v: _ask(conn, "round", args.steps) for v, conn in conns.items()} for _ in range(args.rounds)]
    linked = [v for v in conns if v != "local"]
    times: dict[str, list[float]] = {v: [] for v in linked}
    for _ in range(5 if pings else 0):  # five alternating blocks
        for v in linked:
            times[v] += _ask(conns[v], "ping", max(1, pings // 5))
    states = {v: _ask(conn, "state") for v, conn in conns.items()}
    for conn in conns.values():
        _ask(conn, "teardown")
    return {"workload": w, "rounds": rounds, "summary": summarize(rounds), "weights": compare(states),
            "round_trip_us": {v: statistics.median(t) * 1e6 for v, t in times.items() if t}}


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, Any]]:
    """Per variant: medians over rounds, and the per-round ratios to raw and to local."""
    def cpu(m: dict[str, float]) -> float:
        return m["cpu_edge"] + m["cpu_peer"]

    out = {}
    for v in rounds[0]:
        col = [r[v] for r in rounds]
        row: dict[str, Any] = {"wall_ms": _spread([m["wall"] * 1e3 for m in col]),
                               "cpu_ms": _spread([cpu(m) * 1e3 for m in col]),
                               "cpu_edge_ms": statistics.median(m["cpu_edge"] * 1e3 for m in col),
                               "cpu_peer_ms": statistics.median(m["cpu_peer"] * 1e3 for m in col),
                               "faults_per_step": statistics.median(m["faults"] for m in col)}
        for base in ("raw", "local"):
            if base in rounds[0] and base != v:
                row[f"wall/{base}"] = _spread([r[v]["wall"] / r[base]["wall"] for r in rounds])
                row[f"cpu/{base}"] = _spread([cpu(r[v]) / cpu(r[base]) for r in rounds])
        out[v] = row
    return out


def compare(states: dict[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Each variant's trained model against the first variant's (local's): bit for bit, else by how much."""
    ref_name, ref = next(iter(states.items()))
    out = {}
    for v, state in states.items():
        if set(state) != set(ref):
            out[v] = {"equal": False, "max_abs_diff": float("nan"), "differ": sorted(set(state) ^ set(ref))}
            continue
        differ = [k for k in ref if not torch.equal(state[k], ref[k])]
        diff = max((float((state[k].double() - ref[k].double()).abs().max()) for k in differ), default=0.0)
        out[v] = {"equal": not differ, "max_abs_diff": diff, "differ": differ, "against": ref_name}
    return out


def _ratio(row: dict[str, Any], key: str) -> str:
    r = row.get(key)
    return f"{r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}]" if r else "-"


def table(result: dict[str, Any], args: argparse.Namespace) -> str:
    w = result["workload"]
    header = (f"{'variant':8s} {'wall ms':>8s} {'cpu ms (edge+peer)':>19s} {'wall/raw':>17s} {'cpu/raw':>17s} "
              f"{'wall/local':>17s} {'cpu/local':>17s} {'faults':>7s}  weights vs {next(iter(result['weights']))}")
    lines = [f"{w['label']} (cut {w['cut']}, {args.rounds} rounds x {args.steps} steps)", header]
    for v, row in result["summary"].items():
        weights = result["weights"][v]
        same = ("bitwise" if weights["equal"] else
                f"differ: max |d| {weights['max_abs_diff']:.2g} in {len(weights['differ'])} tensor(s)"
                + (" (expected: no foreach Adam)" if v in rounding_apart(args) else ""))
        cpu = f"{row['cpu_ms']['median']:.2f} ({row['cpu_edge_ms']:.2f}+{row['cpu_peer_ms']:.2f})"
        lines.append(f"{v:8s} {row['wall_ms']['median']:8.2f} {cpu:>19s} {_ratio(row, 'wall/raw'):>17s} "
                     f"{_ratio(row, 'cpu/raw'):>17s} {_ratio(row, 'wall/local'):>17s} {_ratio(row, 'cpu/local'):>17s} "
                     f"{row['faults_per_step']:7.1f}  {same}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workloads", nargs="*", default=["cnn:8", "cnn:64", "cnn:256", "encoder:16"],
                        help="MODEL:BATCH, MODEL cnn or encoder (default: cnn:8 cnn:64 cnn:256 encoder:16)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS),
                        help="which variants, in round order; local first to compare weights (default: all four)")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per workload (default: 9)")
    parser.add_argument("--steps", type=int, default=20, help="training steps per round (default: 20)")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per variant first (default: 5)")
    parser.add_argument("--pings", type=int, default=500,
                        help="empty round trips per transport, timed on the first workload (default: 500; 0: none)")
    parser.add_argument("--threads", type=int, default=half_the_cores(),
                        help="torch threads in every process (default: half the cores this process may use, "
                             f"{half_the_cores()} here: the edge and its peer each get their share, as on two "
                             "machines; see the module docstring)")
    parser.add_argument("--rpc-transport", choices=("tcp", "default"), default="tcp",
                        help="tcp: TensorPipe's uv transport and basic channel, so its bytes go over tcp "
                             "loopback like the others; default: TensorPipe's own choice (shared memory)")
    parser.add_argument("--encoder-layers", type=int, default=6,
                        help="encoder layers (default: 6; cut after the first)")
    parser.add_argument("--encoder-width", type=int, default=64, help="encoder model width (default: 64)")
    parser.add_argument("--seq", type=int, default=32, help="encoder tokens per sample (default: 32)")
    parser.add_argument("--malloc-thresholds", action="store_true",
                        help="fix glibc's trim and mmap thresholds in every process (MALLOC_TRIM_THRESHOLD_, "
                             "MALLOC_MMAP_THRESHOLD_), so freed buffers are not returned to the OS and faulted back")
    parser.add_argument("--device", default="cpu",
                        help="where every variant runs the model's second half: the splitft cloud, the RPC and "
                             "raw peers, and the local model's layers after the cut (e.g. cuda; default: cpu). "
                             "The first half and the data stay on the CPU, as on an edge device")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every round here")
    args = parser.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.device != "cpu":
        from splitft.devices import resolve_device
        from splitft.errors import ConfigError

        try:
            args.device = str(resolve_device(args.device))
        except ConfigError as exc:
            parser.error(str(exc))
    try:
        args.specs = [workload(spec, args) for spec in args.workloads]
    except ValueError as exc:
        parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # every process started below inherits these
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    if args.malloc_thresholds:
        os.environ.update(MALLOC_TRIM_THRESHOLD_=str(2**30), MALLOC_MMAP_THRESHOLD_=str(2**25))
    results = []
    with _processes(args) as (conns, peers):
        print(f"{len(args.variants)} variants, {args.threads} torch thread(s) per process, "
              f"rpc over {args.rpc_transport}; medians over rounds, ratios per round [min-max]", flush=True)
        for i, w in enumerate(args.specs):
            results.append(run_workload(w, conns, peers, args, args.pings if i == 0 else 0))
            print("\n" + table(results[-1], args), flush=True)
    trips = results[0]["round_trip_us"]
    if trips:
        print("\nempty round trip, median: " + ", ".join(f"{v} {us:.0f} us" for v, us in trips.items()))
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k not in ("json", "specs")}
        args.json.write_text(json.dumps({"settings": settings, "results": results}, indent=1))
    return 0 if all(r["weights"][v]["equal"] for r in results for v in r["weights"] if v not in rounding_apart(args)) else 1


def rounding_apart(args: argparse.Namespace) -> set[str]:
    """Variants whose weights may differ from local's by rounding: on an accelerator, torch RPC's
    TorchScript Adam cannot take the foreach path the others take (see peer_variants.adam_settings)."""
    return {"rpc"} if torch.device(args.device).type != "cpu" else set()


if __name__ == "__main__":
    sys.exit(main())
