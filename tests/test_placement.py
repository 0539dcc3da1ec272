"""Placement in a cloud of several ranks: the front door sends a hello to the least-loaded live rank,
a resuming edge to the rank that holds its session while it lives; and the edge follows one
redirect, only from the address it was given, over real ZeroMQ."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

import splitft
import transports
from splitft.wire import protocol
from splitft.cloud.ranks import BEAT_EVERY, RankEnv, RankGroup
from tests.models import mlp
from tests.test_faults import MLP

TIMEOUT = 3.0
SECRET = b"a secret of this job's ranks"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _group(store: dist.Store, rank: int, clock: Clock, world: int = 3) -> RankGroup:
    env = RankEnv(rank=rank, world_size=world, local_rank=rank, local_world_size=world, master_addr="127.0.0.1",
                  master_port=0, attempt=0)
    return RankGroup(env, store, rank_timeout=2.0, clock=clock, secret=SECRET)


@pytest.fixture
def ranks():
    """Three ranks over one real torch.distributed store (in memory), the front door first."""
    store, clock = dist.HashStore(), Clock()
    groups = [_group(store, r, clock) for r in range(3)]
    for r, g in enumerate(groups):
        g.publish(f"tcp://127.0.0.1:{7000 + r}")
    return groups, clock


def _beat(groups, clock, *sessions, step: float = BEAT_EVERY) -> None:
    """Rank r beats with sessions[r - 1] (None: it is silent); the front door looks."""
    clock.now += step
    for g, n in zip(groups[1:], sessions):
        if n is not None:
            g.beat(n)
    groups[0].observe()


def test_a_hello_goes_to_the_least_loaded_rank_counting_placements_still_on_their_way(ranks):
    groups, clock = ranks
    front = groups[0]
    _beat(groups, clock, 3, 1)
    assert front.place(own=2, capacity=10) == 2  # loads 2, 3, 1
    assert front.place(own=2, capacity=10) == 0  # rank 2's edge has not arrived yet: 2, 3, 2 -> lowest rank
    groups[2].hellos += 1  # that hello arrived and its session opened there
    _beat(groups, clock, 3, 2)
    assert front.load(2, own=2) == 2


def test_a_rank_whose_beat_stood_still_gets_no_edge_and_its_sessions_are_placed_anew(ranks):
    groups, clock = ranks
    front = groups[0]
    _beat(groups, clock, 0, 0)
    groups[2].claim("0123456789abcdef")
    assert front.route("0123456789abcdef", own=5, capacity=10) == 2  # its holder lives
    for _ in range(6):  # rank 2 is silent for 3 s, rank 1 beats on
        _beat(groups, clock, 4, None)
    assert not front.live(2) and front.live(1)
    assert front.place(own=5, capacity=10) == 1
    assert front.route("0123456789abcdef", own=0, capacity=10) == 0  # placed on a live rank instead


def test_a_front_door_that_did_not_look_for_a_while_takes_no_live_rank_for_dead(ranks):
    groups, clock = ranks
    front = groups[0]
    _beat(groups, clock, 0, 0)
    clock.now += 60  # the front door was busy; the ranks beat on meanwhile
    for g in groups[1:]:
        g.beat(0)
    assert front.place(own=3, capacity=10) == 1  # it looks again before it decides


def test_stopped_and_full_ranks_are_skipped_and_a_full_cloud_falls_back_on_the_front_door(ranks):
    groups, clock = ranks
    front = groups[0]
    groups[1].beat(0, stopped=True)
    _beat(groups, clock, None, 4)
    assert not front.live(1)
    assert front.place(own=4, capacity=4) == 0  # nobody has room: the front door's admission refuses it


def test_only_the_holder_ends_a_session_for_good(ranks):
    groups, _ = ranks
    groups[1].claim("00000000000000aa")
    groups[2].claim("00000000000000aa")  # it moved to rank 2
    assert groups[2].owns("00000000000000aa") and not groups[1].owns("00000000000000aa")
    groups[1].release("00000000000000aa")  # a stale copy's end does not free rank 2's claim
    assert groups[0].owner("00000000000000aa") == 2
    assert groups[0].owner("../../etc/passwd") is None  # a peer's session id never becomes a store key


def test_the_environment_of_one_process_changes_nothing():
    assert RankEnv.from_environ({}) is None
    assert RankEnv.from_environ({"RANK": "0", "WORLD_SIZE": "1"}) is None
    env = RankEnv.from_environ({"RANK": "1", "WORLD_SIZE": "2", "MASTER_PORT": "29500", "TORCHELASTIC_RESTART_COUNT": "3"})
    assert (env.rank, env.world_size, env.attempt) == (1, 2, 3)
    with pytest.raises(splitft.ConfigError, match="RANK 2 is not below WORLD_SIZE 2"):
        RankEnv.from_environ({"RANK": "2", "WORLD_SIZE": "2"})


# ---------------------------------------------------------------- the edge's side, over ZeroMQ


class Redirector:
    """A real ZeroMQ listener that answers every hello with a redirect to ``target``."""

    def __init__(self, target: str = "") -> None:
        self.listener = transports.listen("tcp://127.0.0.1:0")
        self.address = self.listener.address
        self.target = target
        self.hellos = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                peer, frames = self.listener.recv(0.05)
            except transports.TransportTimeout:
                continue
            if isinstance(protocol.decode(frames), protocol.Hello):
                self.hellos += 1
                self.listener.send(peer, protocol.encode(protocol.Redirect(address=self.target, rank=1)))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.listener.close()


def _split(connect):
    return splitft.split(mlp(), 2, factory=MLP, connect=connect,
                         faults=splitft.Faults(timeout=TIMEOUT, reconnect_timeout=0, heartbeat=0))


def test_an_edge_follows_one_redirect_and_refuses_a_second_hop():
    second = Redirector()
    first = Redirector(target=second.address)
    second.target = first.address  # a loop, if the edge followed it
    try:
        with pytest.raises(splitft.errors.RedirectError, match="redirected this edge again"):
            _split(first.address)
        assert (first.hellos, second.hellos) == (1, 1)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("target", ["http://example.org/", "tcp://127.0.0.1", "ipc://", "x" * 300])
def test_a_redirect_to_something_that_is_not_a_rank_address_is_refused(target):
    door = Redirector(target=target)
    try:
        with pytest.raises(splitft.errors.RedirectError, match="expected tcp://HOST:PORT or ipc://PATH"):
            _split(door.address)
    finally:
        door.close()


def test_an_edge_given_a_function_that_opens_its_link_cannot_be_sent_elsewhere():
    rank = Redirector()
    door = Redirector(target=rank.address)
    try:
        with pytest.raises(splitft.errors.RedirectError, match="give split\\(\\) the cloud's address"):
            _split(lambda: transports.connect(door.address))
        assert rank.hellos == 0
    finally:
        door.close()
        rank.close()


def test_ranks_read_only_what_this_jobs_ranks_signed(ranks, monkeypatch):
    groups, clock = ranks
    front = groups[0]
    _beat(groups, clock, 0, 0)
    store = front._now._store  # the job's store, as anyone who reaches it sees it
    store.set("beat/1", '{"n": 99999999999999999999, "boot": "x", "sessions": 0, "hellos": 0, "stopped": true}')
    store.set("addr/2", "tcp://evil.example:1")
    _beat(groups, clock, None, None)
    assert front.live(1) and front.addresses[2] == "tcp://127.0.0.1:7002"
    stranger = _group(dist.HashStore(), 0, clock)  # another secret, the same keys
    stranger._run._secret = b"not this job's"
    front._run._store.set("ended/1", stranger._run.sealed("ended/1", "100"))
    assert front.add_ended(0) == 0
    monkeypatch.delenv("SPLITFT_JOB_SECRET", raising=False)
    with pytest.raises(splitft.ConfigError, match="SPLITFT_JOB_SECRET"):
        RankGroup(front.env, dist.HashStore())
