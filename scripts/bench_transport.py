"""splitft's message path vs raw pyzmq, between two OS processes over tcp loopback.

For each tensor size the sender streams a batch of messages and the receiver acknowledges the
last one; throughput is bytes over that time. "raw" sends ``[header, array]`` with pyzmq
zero-copy and receives with ``copy=False``; "splitft" runs the product's path on both ends:
codec encode + protocol encode (msgpack header, array frames) + ``ZmqConnection.send``, and
``ZmqListener.recv`` + protocol decode + codec decode to a torch tensor. Rounds of the two
alternate against the same receiver process, so machine noise hits both alike; each round's
throughput ratio to the raw round beside it is taken, and their median and range are printed. A
third column, "transport", sends the raw round's ``[tag, array]`` frames
through ``ZmqConnection.send`` / ``ZmqListener.recv`` with no codec and no protocol: it shows
what the transport itself costs, apart from encoding and decoding. The last column is the
message path's fixed cost: its median time per message minus raw's.

Both processes set glibc's allocator thresholds as the ``splitft`` commands do
(``splitft.app.allocator.tune()``; ``--glibc-defaults`` leaves them): the product's receiver
copies a frame into aligned memory, and where that memory comes from is the allocator's choice.
The raw receiver shares the process, so every variant runs under the same settings.

    python scripts/bench_transport.py            # 64 KiB, 1 MiB, 16 MiB; median of 11 rounds each
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import socket
import statistics
import time

SIZES = {"64KiB": 64 * 1024, "1MiB": 2**20, "16MiB": 16 * 2**20}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _receiver(raw_address: str, splitft_address: str, transport_address: str, tune: bool) -> None:
    """Echo an acknowledgement for every message marked last, on all sockets, until told to stop."""
    if tune:
        from splitft.app import allocator

        allocator.tune()
    import numpy as np
    import zmq

    import compressors
    from splitft.wire import protocol
    from transports import ZmqListener

    raw = zmq.Context.instance().socket(zmq.ROUTER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.bind(raw_address)
    listener = ZmqListener(splitft_address)
    plain = ZmqListener(transport_address)
    codec, ctx = compressors.make_codec("identity"), compressors.CodecContext()
    poller = zmq.Poller()
    poller.register(raw, zmq.POLLIN)
    poller.register(listener._sock, zmq.POLLIN)
    poller.register(plain._sock, zmq.POLLIN)
    while True:
        ready = dict(poller.poll(60_000))
        if not ready:
            break
        if raw in ready:
            parts = raw.recv_multipart(copy=False)
            np.frombuffer(parts[2].buffer, dtype=np.float32)
            if parts[1].bytes == b"stop":
                break
            if parts[1].bytes == b"last":
                raw.send_multipart([parts[0], b"ack"])
        elif plain._sock in ready:
            peer, frames = plain.recv(timeout=0)
            np.frombuffer(frames[1], dtype=np.float32)
            if bytes(frames[0]) == b"last":
                plain.send(peer, [b"ack"])
        else:
            peer, frames = listener.recv(timeout=0)
            msg = protocol.decode(frames)
            payload, _ = protocol.payload_from_wire(msg.args[0])
            codec.decode(payload, ctx)
            if msg.call < 0:
                listener.send(peer, protocol.encode(protocol.Ack()))
    raw.close(linger=0)
    listener.close()
    plain.close()


def _paired(raw: list[float], other: list[float]) -> str:
    """Throughput against raw's in the same round (raw's time over the other's), as the median of
    the rounds and their range: a slow moment of the machine hits both sides of a round alike."""
    ratios = [r / o for r, o in zip(raw, other, strict=True)]
    return f"{statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=11, help="timed rounds per cell; medians are compared (default: 11)")
    parser.add_argument("--megabytes", type=int, default=128, help="data streamed per round (default 128)")
    parser.add_argument("--glibc-defaults", action="store_true",
                        help="leave glibc's allocator thresholds as they are, rather than as the splitft commands set them")
    args = parser.parse_args(argv)
    if not args.glibc_defaults:
        from splitft.app import allocator

        allocator.tune()

    import torch
    import zmq

    import compressors
    from splitft.wire import protocol
    from transports import ZmqConnection

    raw_address, splitft_address, transport_address = (f"tcp://127.0.0.1:{_free_port()}" for _ in range(3))
    proc = mp.get_context("spawn").Process(target=_receiver, args=(raw_address, splitft_address, transport_address,
                                                 not args.glibc_defaults),
                                           daemon=True)
    proc.start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(raw_address)
    conn = ZmqConnection(splitft_address)
    plain = ZmqConnection(transport_address)
    codec, ctx = compressors.make_codec("identity"), compressors.CodecContext()

    def raw_round(tensor: torch.Tensor, count: int) -> None:
        for i in range(count):
            sock.send_multipart([b"last" if i == count - 1 else b"more", tensor.numpy()], copy=False)
        if not sock.poll(60_000):
            raise TimeoutError("receiver did not acknowledge")
        sock.recv_multipart()

    def transport_round(tensor: torch.Tensor, count: int) -> None:
        array = tensor.numpy()
        for i in range(count):
            plain.send([b"last" if i == count - 1 else b"more", array])
        plain.recv(60)

    def splitft_round(tensor: torch.Tensor, count: int) -> None:
        for i in range(count):
            entry = protocol.payload_to_wire(codec.encode(tensor, ctx), True)
            conn.send(protocol.encode(protocol.Forward(call=-1 if i == count - 1 else 1, train=True, grad=True,
                                                       args=[entry], kwargs={})))
        protocol.decode(conn.recv(60))

    rounds = {"raw": raw_round, "transport": transport_round, "splitft": splitft_round}
    print(f"{'size':>6s} {'raw GB/s':>9s} {'transport GB/s':>15s} {'ratio [range]':>17s} {'splitft GB/s':>13s}"
          f" {'ratio [range]':>17s} {'us/msg over raw':>16s}   (medians of {args.rounds} rounds)")
    for label, nbytes in SIZES.items():
        tensor = torch.ones(nbytes // 4)
        count = max(8, args.megabytes * 2**20 // nbytes)
        for run in rounds.values():  # warm-up: connections, first-touch of buffers
            run(tensor, count)
        times: dict[str, list[float]] = {name: [] for name in rounds}
        order = list(rounds)
        for i in range(args.rounds):
            for name in order[i % 3:] + order[:i % 3]:  # each goes first in turn: no place in the cycle favours one
                start = time.perf_counter()
                rounds[name](tensor, count)
                times[name].append(time.perf_counter() - start)
        rate = {name: nbytes * count / statistics.median(t) / 1e9 for name, t in times.items()}
        ratio = {name: _paired(times["raw"], times[name]) for name in ("transport", "splitft")}
        extra = statistics.median(s - r for s, r in zip(times["splitft"], times["raw"], strict=True)) / count * 1e6
        print(f"{label:>6s} {rate['raw']:9.2f} {rate['transport']:15.2f} {ratio['transport']:>17s} "
              f"{rate['splitft']:13.2f} {ratio['splitft']:>17s} {extra:16.1f}", flush=True)
    sock.send_multipart([b"stop", b""])
    proc.join(timeout=10)
    sock.close(linger=0)
    conn.close()
    plain.close()


if __name__ == "__main__":
    main()
