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

    python scripts/bench_link.py                       # 100mbit,20ms and 10mbit,50ms; 64 KiB, 1 MiB, 8 MiB
    python scripts/bench_link.py --link 1gbit,5ms --sizes 1MiB --repeats 9
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import struct
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
    args = parser.parse_args(argv)

    import transports
    from transports import LinkSpec, message_nbytes

    address = f"tcp://127.0.0.1:{_free_port()}"
    proc = mp.get_context("spawn").Process(target=_echo, args=(address,), daemon=True)
    proc.start()
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
        stopper = transports.connect(address)
        stopper.send([b"s"])
        proc.join(timeout=10)
        stopper.close()
        if proc.is_alive():
            proc.kill()


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
