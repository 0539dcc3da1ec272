"""How closely the link emulator matches its own model, over real ZeroMQ between two processes.

An echo process (a plain pyzmq ROUTER, no emulation) answers an edge that talks through
``transports.connect(address, link=...)``. For each link and size it times:

* one-way: send a message; the echo process notes the moment it arrives (CLOCK_MONOTONIC is
  shared by all processes on a machine) and acknowledges with a tiny message;
* round trip: send a message and wait for an equally large echo;
* burst: send several messages back to back and note when the last one arrives (queueing).

Each is compared with the model's figure for an idle link — 8n/bandwidth + one-way delay per
direction (``LinkSpec.up.transfer_s`` / ``LinkSpec.round_trip_s``) — and the median over repeats
of measured/theory is printed, with the median excess in ms. A first "loopback" row per cell
(no emulation) shows what plain ZeroMQ between the processes costs; the excess of an emulated
link is about that plus copying the frames in ``send``, since the emulator adds its delays on
top of the real transfer.

``--cpu`` measures what the emulator costs in CPU: the edge process's CPU seconds (all its
threads, ZeroMQ's included) for streaming ``--cpu-mb`` MB in 1 MiB messages, each acknowledged,
and for one idle second spent in ``recv``. Three rows: no emulation (what moving the bytes costs
at all), the emulator with its polling pump (the design before timers; still what a connection
that cannot be woken gets), and the emulator with timers (the ZeroMQ connection can be woken).

``--kernel`` (root; a benchmark, never a test) runs the same short split training (digits,
identity, 2 epochs) over two network namespaces joined by a veth pair shaped with tc tbf to the
link's rate, and over loopback through the emulator at the same rate, alternating
(``--kernel-repeats``, 3 each); it prints every run and the ratio of the median times. tbf's
bucket (``--kernel-burst``) is kept small, as a line of that rate has none. tbf shapes rate only
(the kernel here has no netem), so the emulator runs with 0 ms delay. The namespaces are deleted
afterwards.

    python scripts/bench_link.py                       # 100mbit,20ms and 10mbit,50ms; 64 KiB, 1 MiB, 8 MiB
    python scripts/bench_link.py --link 1gbit,5ms --sizes 1MiB --repeats 9
    python scripts/bench_link.py --cpu                 # CPU of the emulator at 100mbit,20ms and 100mbit,0ms
    python scripts/bench_link.py --kernel              # kernel-shaped link vs the emulator (root)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import time

SIZES = {"64KiB": 64 * 2**10, "1MiB": 2**20, "8MiB": 8 * 2**20}
LINKS = ["100mbit,20ms", "10mbit,50ms"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _echo(address: str) -> None:
    """The cloud stand-in: stamp arrivals, echo or acknowledge at once, until told to stop."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(address)
    while sock.poll(120_000):
        peer, tag, *body = sock.recv_multipart(copy=False)
        arrived = time.monotonic()
        if tag.bytes == b"s":
            break
        if tag.bytes == b"e":
            sock.send_multipart([peer, tag, *body], copy=False)
        else:
            sock.send_multipart([peer, b"a", struct.pack("<d", arrived)])
    sock.close(linger=0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--link", action="append", help=f"link spec, repeatable (default: {' and '.join(LINKS)})")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES), help="message sizes")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per cell; medians are printed")
    parser.add_argument("--no-baseline", action="store_true", help="skip the loopback (no emulation) rows")
    parser.add_argument("--burst", type=int, default=8,
                        help="messages per burst (bursts run only while the burst holds at most 8 MiB)")
    parser.add_argument("--cpu", action="store_true", help="measure the emulator's CPU cost instead")
    parser.add_argument("--cpu-mb", type=int, default=16, help="MB streamed per --cpu row (default 16)")
    parser.add_argument("--cpu-link", action="append",
                        help="link of the --cpu rows, repeatable (default: 100mbit,20ms and 100mbit,0ms)")
    parser.add_argument("--kernel", action="store_true",
                        help="compare a training run over a tc-shaped veth link with the emulator (root)")
    parser.add_argument("--kernel-rate", default="100mbit", help="rate of the --kernel comparison (default 100mbit)")
    parser.add_argument("--kernel-epochs", type=int, default=2, help="epochs of the --kernel training run")
    parser.add_argument("--kernel-burst", default="15kb",
                        help="tc tbf's bucket: bytes that pass at the veth's own speed after an idle spell (default "
                             "15kb, about 1 ms at 100mbit). The emulator, like a line of that rate, has none; a 64kb "
                             "bucket lets a step's small messages through unshaped after each compute pause")
    parser.add_argument("--kernel-repeats", type=int, default=3,
                        help="--kernel runs of each kind, alternating; their medians are compared (default 3)")
    parser.add_argument("--edge-run", nargs=3, metavar=("ADDRESS", "LINK", "EPOCHS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.edge_run:
        return _edge_run(*args.edge_run)
    if args.kernel:
        return _kernel(args.kernel_rate, args.kernel_epochs, args.kernel_repeats, args.kernel_burst)

    import transports
    from transports import LinkSpec, message_nbytes

    address = f"tcp://127.0.0.1:{_free_port()}"
    proc = mp.get_context("spawn").Process(target=_echo, args=(address,), daemon=True)
    proc.start()
    if args.cpu:
        try:
            for text in args.cpu_link or ["100mbit,20ms", "100mbit,0ms"]:
                _cpu(address, LinkSpec.parse(text), args.cpu_mb)
        finally:
            _stop(address, proc)
        return
    print(f"{'link':>13s} {'size':>6s} {'mode':>10s} {'theory ms':>10s} {'measured ms':>12s} {'ratio':>7s} "
          f"{'excess ms':>10s}   (medians of {args.repeats})")
    try:
        for text in ([] if args.no_baseline else ["loopback"]) + (args.link or LINKS):
            spec = LinkSpec.parse(text)
            conn = transports.connect(address, link=spec)
            try:
                _round_trip(conn, [b"e", b"warm-up"])
                for label in args.sizes:
                    payload = bytes(SIZES[label])
                    one = [b"o", payload]
                    echo = [b"e", payload]
                    cells = {
                        "one-way": (lambda: _one_way(conn, one), spec.up.transfer_s(message_nbytes(one))),
                        "round-trip": (lambda: _round_trip(conn, echo),
                                       spec.round_trip_s(message_nbytes(echo), message_nbytes(echo))),
                    }
                    if args.burst > 1 and args.burst * SIZES[label] <= 8 * 2**20:
                        cells[f"burst x{args.burst}"] = (
                            lambda: _burst(conn, one, args.burst),
                            args.burst * spec.up.serialise_s(message_nbytes(one)) + spec.up.delay_s)
                    for mode, (run, theory) in cells.items():
                        times = [run() for _ in range(args.repeats)]
                        median = statistics.median(times)
                        ratio = f"{median / theory:7.3f}" if theory > 0 else f"{'-':>7s}"
                        print(f"{spec.to_text():>13s} {label:>6s} {mode:>10s} {theory * 1e3:10.1f} {median * 1e3:12.1f} "
                              f"{ratio} {(median - theory) * 1e3:10.2f}", flush=True)
            finally:
                conn.close()
    finally:
        _stop(address, proc)


def _stop(address: str, proc) -> None:
    import transports

    stopper = transports.connect(address)
    stopper.send([b"s"])
    proc.join(timeout=10)
    stopper.close()
    if proc.is_alive():
        proc.kill()


# ------------------------------------------------------------------------------ CPU cost


class _CannotWake:
    """A connection that hides its wake-up support, so the emulator falls back to polling."""

    supports_wake = False

    def __init__(self, inner) -> None:
        self.inner = inner
        self.address = inner.address

    def send(self, frames):
        return self.inner.send(frames)

    def recv(self, timeout):
        return self.inner.recv(timeout)

    def close(self) -> None:
        self.inner.close()


def _cpu(address: str, spec, megabytes: int) -> None:
    """Edge-process CPU seconds: streaming ``megabytes`` MB in acknowledged 1 MiB messages, and
    one idle second in ``recv``; without emulation, with the polling pump, with timers."""
    from transports import EmulatedConnection, TransportTimeout, ZmqConnection

    payload = [b"o", bytes(2**20)]
    count = max(1, megabytes * 10**6 // 2**20)
    rows = {
        "no emulation": lambda: ZmqConnection(address),
        "polling pump": lambda: EmulatedConnection(_CannotWake(ZmqConnection(address)), spec),
        "timers": lambda: EmulatedConnection(ZmqConnection(address), spec),
    }
    theory = count * spec.up.serialise_s(sum(len(f) for f in payload)) + spec.up.delay_s + spec.down.delay_s
    print(f"CPU of moving {count} MiB in 1 MiB messages over {spec} (model: {theory:.2f} s), and of one idle "
          f"second in recv; edge process, all threads")
    print(f"{'pump':>14s} {'wall s':>8s} {'CPU s':>8s} {'CPU/wall':>9s} {'idle CPU s':>11s}")
    for name, make in rows.items():
        conn = make()
        try:
            _round_trip(conn, [b"e", b"warm-up"])
            wall, cpu = time.monotonic(), time.process_time()
            for _ in range(count):
                conn.send(payload)
            for _ in range(count):
                conn.recv(120)
            wall, cpu = time.monotonic() - wall, time.process_time() - cpu
            idle = time.process_time()
            try:
                conn.recv(1.0)
            except TransportTimeout:
                pass
            idle = time.process_time() - idle
        finally:
            conn.close()
        print(f"{name:>14s} {wall:8.2f} {cpu:8.3f} {cpu / wall:9.3f} {idle:11.4f}", flush=True)


# ----------------------------------------------------------------- kernel-shaped link


_NETNS = ("splitft-bench-a", "splitft-bench-b")
_VETH = ("sfbench-a", "sfbench-b")
_ADDRS = ("10.213.77.1", "10.213.77.2")  # a private /24 of this benchmark's own


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True)


def _netns_up(rate: str, burst: str) -> None:
    (a, b), (va, vb) = _NETNS, _VETH
    _netns_down()
    _sh("ip", "netns", "add", a)
    _sh("ip", "netns", "add", b)
    _sh("ip", "link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
    for ns, dev, addr in ((a, va, _ADDRS[0]), (b, vb, _ADDRS[1])):
        _sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
        _sh("ip", "-n", ns, "link", "set", dev, "up")
        _sh("ip", "-n", ns, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
            "burst", burst, "latency", "100ms")


def _netns_down() -> None:
    for ns in _NETNS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _edge_run(address: str, link: str, epochs: str) -> None:
    """One training run of the edge against the cloud at ``address``; prints seconds and CPU."""
    from splitft.app.experiment import run_digits

    cpu = time.process_time()
    result = run_digits("identity", address=address, link=None if link == "none" else link, epochs=int(epochs))
    print(f"RESULT {result.seconds:.3f} {time.process_time() - cpu:.3f} {result.accuracy:.4f} "
          f"{result.bytes_up} {result.bytes_down}", flush=True)


def _train(cloud_prefix: list[str], edge_prefix: list[str], bind: str, address: str, link: str,
           epochs: int) -> tuple[float, ...]:
    """Start a cloud, run one edge to the end, stop the cloud: (seconds, edge CPU s, accuracy,
    bytes up, bytes down)."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    # A private address of the benchmark's own network namespaces: no one else can reach it.
    cloud = subprocess.Popen([*cloud_prefix, sys.executable, "-m", "splitft", "cloud", "--bind", bind,
                              "--allow-any-edge"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True)
    try:
        time.sleep(3)  # the cloud imports torch before it binds; the edge retries its connect anyway
        if cloud.poll() is not None:
            raise RuntimeError(f"the cloud did not start: {cloud.stderr.read()}")
        edge = subprocess.run([*edge_prefix, sys.executable, os.path.abspath(__file__), "--edge-run", address, link,
                               str(epochs)], env=env, capture_output=True, text=True, timeout=1800)
        lines = [ln for ln in edge.stdout.splitlines() if ln.startswith("RESULT ")]
        if edge.returncode or not lines:
            raise RuntimeError(f"the edge failed ({edge.returncode}): {edge.stderr[-2000:]}")
        return tuple(float(x) for x in lines[-1].split()[1:6])
    finally:
        cloud.terminate()
        try:
            cloud.wait(timeout=10)
        except subprocess.TimeoutExpired:
            cloud.kill()


def _kernel(rate: str, epochs: int, repeats: int, burst: str) -> None:
    """Alternate kernel-shaped and emulated runs ``repeats`` times each (machine noise hits both
    alike) and print each run and the ratio of the medians."""
    from transports import LinkSpec

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        raise SystemExit("--kernel needs root and the ip and tc tools (network namespaces, veth, tc tbf)")
    link = LinkSpec.parse(f"{rate},0ms")
    port = 5599
    print(f"digits, identity, {epochs} epoch(s): veth + tc tbf {rate} (burst {burst}) between two namespaces vs "
          f"the emulator at {link.to_text()} over loopback, {repeats} run(s) each, alternating")
    print(f"{'link':>28s} {'seconds':>8s} {'edge CPU s':>11s} {'accuracy':>9s} {'MB up':>7s} {'MB down':>8s}")
    runs: dict[str, list[tuple[float, ...]]] = {"kernel": [], "emulator": []}
    try:
        _netns_up(rate, burst)
        for _ in range(repeats):
            runs["kernel"].append(_train(["ip", "netns", "exec", _NETNS[0]], ["ip", "netns", "exec", _NETNS[1]],
                                         f"tcp://{_ADDRS[0]}:{port}", f"tcp://{_ADDRS[0]}:{port}", "none", epochs))
            local = f"tcp://127.0.0.1:{_free_port()}"
            runs["emulator"].append(_train([], [], local, local, link.to_text(), epochs))
            for name, label in (("kernel", "kernel (veth + tbf)"), ("emulator", f"emulator ({link.to_text()})")):
                seconds, cpu, accuracy, up, down = runs[name][-1]
                print(f"{label:>28s} {seconds:8.2f} {cpu:11.2f} {accuracy:9.4f} {up / 1e6:7.2f} {down / 1e6:8.2f}",
                      flush=True)
    finally:
        _netns_down()
    kernel, emulated = (statistics.median(r[0] for r in runs[name]) for name in ("kernel", "emulator"))
    print(f"median seconds: kernel {kernel:.2f}, emulator {emulated:.2f}; emulator / kernel: {emulated / kernel:.3f}")


def _one_way(conn, frames) -> float:
    start = time.monotonic()
    conn.send(frames)
    (arrived,) = struct.unpack("<d", conn.recv(120)[1])
    return arrived - start


def _round_trip(conn, frames) -> float:
    start = time.monotonic()
    conn.send(frames)
    conn.recv(120)
    return time.monotonic() - start


def _burst(conn, frames, count: int) -> float:
    start = time.monotonic()
    for _ in range(count):
        conn.send(frames)
    last = max(struct.unpack("<d", conn.recv(120)[1])[0] for _ in range(count))
    return last - start


if __name__ == "__main__":
    main()
