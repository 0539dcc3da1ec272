"""CurveZMQ: only allowed edges train, refusals are clear on both sides, and the bytes on the wire
do not contain the activations they carry."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time

import pytest
import torch
import zmq
from torch import nn

import splitft
from splitft import Faults, Link
import transports
from splitft.app.cli import main as cli
from splitft.cloud import CloudServer, serve_in_thread
from tests.conftest import PipeReader, splitft_process, start_cloud, stop
from tests.test_faults import MLP, _data, assert_same, local_weights, split_weights
from tests.models import mlp


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    folder = tmp_path_factory.mktemp("keys")
    assert cli(["keys", "--dir", str(folder), "cloud", "edge1", "stranger"]) == 0
    return folder


def test_keys_are_written_as_a_public_and_a_private_file(keys, capsys):
    for name in ("cloud", "edge1", "stranger"):
        assert (keys / f"{name}.key").is_file()
        assert stat.S_IMODE(os.stat(keys / f"{name}.key_secret").st_mode) == 0o600
        assert "secret" not in (keys / f"{name}.key").read_text().split("curve")[1]
    assert cli(["keys", "--dir", str(keys), "edge1"]) == 2  # never overwrites a key
    assert "exists" in capsys.readouterr().err


class Relay:
    """A TCP relay on 127.0.0.1 that records every byte it passes on, both ways."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("tcp://").rsplit(":", 1)
        self.upstream = (host, int(port))
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = f"tcp://127.0.0.1:{self.server.getsockname()[1]}"
        self.captured = bytearray()
        self.lock = threading.Lock()
        self.sockets: list[socket.socket] = [self.server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.upstream)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                with self.lock:
                    self.captured += chunk
                sink.sendall(chunk)
        except OSError:
            pass

    def close(self) -> None:
        for s in self.sockets:
            s.close()


def _curve_cloud(keys, refused: list[str]):
    _, secret = transports.load_secret_key(keys / "cloud.key_secret")
    listener = transports.listen("tcp://127.0.0.1:0", secret_key=secret,
                                 allowed_keys=transports.load_allowed_keys([keys / "edge1.key"]),
                                 on_refused=refused.append)
    server = CloudServer(listener, [MLP])
    return listener, server, serve_in_thread(server)


def _activations(data) -> bytes:
    """What crosses the cut, computed locally: the edge part (first layer and ReLU) of each batch."""
    model = mlp()
    return b"".join(torch.relu(model[0](x)).detach().numpy().tobytes() for x, _ in data[:1])


@pytest.mark.parametrize("mode", ["curve", "curve-any-key", "plain"])
def test_captured_stream_holds_no_raw_activation_when_encrypted(keys, mode, caplog):
    data = _data(1)
    refused: list[str] = []
    if mode == "curve":
        listener, server, thread = _curve_cloud(keys, refused)
        options = {"cloud_key": keys / "cloud.key", "key": keys / "edge1.key_secret"}
    elif mode == "curve-any-key":  # no allow-list: encrypted, not authenticated, and said so at start
        _, secret = transports.load_secret_key(keys / "cloud.key_secret")
        listener = transports.listen("tcp://127.0.0.1:0", secret_key=secret)
        assert "any edge key may connect" in caplog.text
        server = CloudServer(listener, [MLP])
        thread = serve_in_thread(server)
        options = {"cloud_key": keys / "cloud.key", "key": keys / "stranger.key_secret"}
    else:
        listener = transports.listen("tcp://127.0.0.1:0")
        server = CloudServer(listener, [MLP])
        thread, options = serve_in_thread(server), {}
    relay = Relay(listener.address)
    try:
        model = splitft.split(mlp(), 2, factory=MLP, connect=Link(relay.address, **options), faults=Faults(timeout=10))
        with model:
            weights = split_weights(model, data)
        assert_same(weights, local_weights(data))  # trains exactly, encrypted or not
    finally:
        relay.close()
        server.stop()
        thread.join(timeout=10)
    secret = _activations(data)
    assert len(relay.captured) > len(secret)
    # The activation's first 64 bytes: present in the clear, absent from the encrypted stream.
    assert (secret[:64] in relay.captured) is (mode == "plain")
    assert not refused


def test_an_edge_with_an_unknown_key_is_refused_clearly_on_both_sides(keys):
    refused: list[str] = []
    listener, server, thread = _curve_cloud(keys, refused)
    try:
        start = time.monotonic()
        with pytest.raises(splitft.errors.AuthError, match="refused this edge's key"):
            splitft.split(mlp(), 2, factory=MLP, faults=Faults(timeout=20),
                          connect=Link(listener.address, cloud_key=keys / "cloud.key",
                                       key=keys / "stranger.key_secret"))
        assert time.monotonic() - start < 5  # the refusal is seen, not waited out
        stranger = transports.load_public_key(keys / "stranger.key").decode()
        assert any(stranger in text and "not in the allow-list" in text for text in refused)
        with pytest.raises(splitft.errors.AuthError, match="is --cloud-key the cloud's public key"):
            splitft.split(mlp(), 2, factory=MLP, faults=Faults(timeout=20),
                          connect=Link(listener.address, cloud_key=keys / "stranger.key",
                                       key=keys / "edge1.key_secret"))
        with pytest.raises(splitft.errors.AuthError, match="expects an encrypted link"):
            splitft.split(mlp(), 2, factory=MLP, connect=listener.address, faults=Faults(timeout=20))
        assert not server.by_id  # none of them got a session
    finally:
        server.stop()
        thread.join(timeout=10)


def test_a_send_that_cannot_leave_because_the_handshake_failed_says_so():
    """A plain edge against an encrypted cloud: its sends queue until the queue is full, and
    the send that finds no room raises the refused handshake, not a timeout that hides it."""
    _, cloud_secret = zmq.curve_keypair()
    edge_public, _ = zmq.curve_keypair()
    listener = transports.listen("tcp://127.0.0.1:0", secret_key=cloud_secret, allowed_keys=[edge_public])
    conn = transports.ZmqConnection(listener.address, send_timeout=0.2)
    try:
        time.sleep(0.5)  # the handshake is refused meanwhile
        with pytest.raises(transports.TransportRefused, match="expects an encrypted link"):
            for _ in range(5000):  # more than ZeroMQ queues for a peer (1000)
                conn.send([bytes(100)])
    finally:
        conn.close()
        listener.close()


def test_cli_refusal_is_a_clear_message_in_both_terminals(keys, tmp_path):
    cloud, address, cloud_err = start_cloud(tmp_path, "--sessions", "0", "--secret-key", str(keys / "cloud.key_secret"),
                                            "--allow-edge-keys", str(keys / "edge1.key"))
    edge = splitft_process("edge", "--connect", address, "--cloud-key", str(keys / "cloud.key"),
                           "--key", str(keys / "stranger.key_secret"), "--epochs", "1")
    try:
        out, err = edge.communicate(timeout=60)
    finally:
        stop(edge)
        stop(cloud)
    assert edge.returncode == 2
    assert "refused this edge's key" in err and "Traceback" not in err
    assert "refused an edge whose key" in cloud_err.text and "Traceback" not in cloud_err.text
