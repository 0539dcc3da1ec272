"""Dropout in the cloud half draws the unsplit model's masks, and no other edge's traffic changes them.

The host generator runs through both halves in the unsplit model's order (the edge sends its state
when it changed, the cloud sends back the state its dropout left): a script seeded with
``torch.manual_seed`` trains a model with dropout on both sides of the cut to the unsplit run's
weights, bit for bit. Between two draws of one edge, the cloud keeps the session's stream apart
from the process's generator, which its other sessions draw from.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import splitft
from splitft import Codecs, Faults
from tests.conftest import start_cloud, stop
from tests.models import mlp_dropout

MODEL = "tests.models:mlp_dropout"
STEPS = 6


def _edge(address: str, seed: int) -> tuple[splitft.SplitModel, torch.optim.Optimizer, list]:
    model = splitft.split(mlp_dropout(), 2, factory=MODEL, connect=address, codecs=Codecs(seed=seed),
                          faults=Faults(timeout=30))
    opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
    return model, opt, _edge_data(seed)


def _step(model: splitft.SplitModel, opt: torch.optim.Optimizer, crit: nn.Module, x: torch.Tensor,
          y: torch.Tensor) -> None:
    crit(model(x), y).backward()
    opt.step()
    opt.zero_grad()


@pytest.mark.timeout(120)
def test_an_edge_draws_the_same_dropout_masks_whoever_else_trains(tmp_path):
    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", MODEL)
    try:
        finals = []
        for other in (False, True):
            model, opt, data = _edge(address, seed=0)
            crit = model.remote_loss(nn.CrossEntropyLoss())
            neighbour = _edge(address, seed=1) if other else None
            if neighbour is not None:
                neighbour_crit = neighbour[0].remote_loss(nn.CrossEntropyLoss())
            torch.manual_seed(0)
            for i, (x, y) in enumerate(data):
                if neighbour is not None:  # the other edge's dropout runs between this edge's steps
                    with torch.random.fork_rng(devices=[]):  # its own generator, as in a process of its own
                        _step(neighbour[0], neighbour[1], neighbour_crit, *neighbour[2][i])
                _step(model, opt, crit, x, y)
            finals.append(model.cloud_state_dict())
            model.close()
            if neighbour is not None:
                neighbour[0].close()
        for name, value in finals[0].items():
            assert torch.equal(value, finals[1][name]), name
        # and dropout did act: an edge whose generator is seeded otherwise draws other masks
        model, opt, data = _edge(address, seed=0)
        crit = model.remote_loss(nn.CrossEntropyLoss())
        torch.manual_seed(2)
        for x, y in _edge_data(seed=0):
            _step(model, opt, crit, x, y)
        other_seed = model.cloud_state_dict()
        model.close()
        assert any(not torch.equal(v, other_seed[n]) for n, v in finals[0].items())
    finally:
        stop(proc)
        print(err.text[-2000:])


def _edge_data(seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=gen), torch.randint(0, 3, (16,), generator=gen)) for _ in range(STEPS)]


def test_starting_a_cloud_in_this_process_leaves_its_generator_alone():
    """The server warms its FLOP counter up on a thread of its own: building anything on the host
    there would draw from the process's generator under a caller that seeded it (it did)."""
    import threading

    import transports
    from splitft.cloud import CloudServer

    torch.manual_seed(123)
    before = torch.get_rng_state()
    server = CloudServer(transports.InprocListener(), ["splitft.app.models:digits_cnn"])
    try:
        for thread in threading.enumerate():
            if thread.name == "splitft-warm-up":
                thread.join(timeout=60)
        assert torch.equal(torch.get_rng_state(), before)
    finally:
        server.stop()


EVERYWHERE = "tests.models:mlp_dropout_everywhere"


def _seeded_loop(model: nn.Module, crit: nn.Module, seed: int) -> torch.Tensor:
    """A user's loop: seeded, a shuffling DataLoader (it draws its order from the same generator),
    dropout on the edge, in the cloud and (U-shape) after it again. Returns the generator's state."""
    from torch.utils.data import DataLoader, TensorDataset

    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(5)
    data = TensorDataset(torch.randn(48, 12, generator=gen), torch.randint(0, 3, (48,), generator=gen))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        for x, y in DataLoader(data, batch_size=16, shuffle=True):
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()
    return torch.get_rng_state()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("rejoin", [None, 6], ids=["plain", "ushape"])
def test_dropout_on_both_sides_trains_as_the_unsplit_model_bit_for_bit(tmp_path, rejoin):
    from tests.models import mlp_dropout_everywhere

    proc, address, err = start_cloud(tmp_path, "--sessions", "0", "--model", EVERYWHERE)
    try:
        local = mlp_dropout_everywhere()
        local_rng = _seeded_loop(local, nn.CrossEntropyLoss(), seed=3)
        net = mlp_dropout_everywhere()
        model = splitft.split(net, 3, rejoin, factory=EVERYWHERE, connect=address, faults=Faults(timeout=30))
        with model:
            crit = nn.CrossEntropyLoss() if rejoin else model.remote_loss(nn.CrossEntropyLoss())
            split_rng = _seeded_loop(model, crit, seed=3)
            state = model.state_dict()
        for name, value in local.state_dict().items():
            assert torch.equal(state[name], value), name
        assert torch.equal(split_rng, local_rng)  # the script's generator went on as unsplit
        # the masks mattered: another seed trains other weights
        other = mlp_dropout_everywhere()
        _seeded_loop(other, nn.CrossEntropyLoss(), seed=4)
        assert any(not torch.equal(v, other.state_dict()[n]) for n, v in state.items())
    finally:
        stop(proc)
        print(err.text[-2000:])


def _inproc_cloud(*factories: str):
    from splitft.cloud import CloudServer, serve_in_thread
    from transports import InprocListener

    listener = InprocListener()
    server = CloudServer(listener, list(factories))
    return listener, server, serve_in_thread(server)


def test_a_generator_state_is_checked_before_the_cloud_takes_it():
    from splitft.edge import stage as stage_module
    from splitft.errors import ProtocolError
    from splitft.generator_state import HOST_STATE_BYTES, checked_host_state

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        fresh = torch.get_rng_state().numpy()
        torch.rand(3)
        drawn = torch.get_rng_state().numpy()
    for good in (fresh, drawn):
        assert torch.equal(checked_host_state(good, "forward.rng"), torch.from_numpy(good))
    shifted = drawn.copy()
    shifted[16:24] = np.array([624], dtype=np.uint64).view(np.uint8)  # reads would run past the state
    unseeded = drawn.copy()
    unseeded[12:16] = 0
    for bad in (drawn[:-1], drawn.astype(np.int16), drawn.reshape(2, -1), list(drawn), shifted, unseeded,
                np.zeros(HOST_STATE_BYTES, np.uint8)):
        with pytest.raises(ProtocolError, match="forward.rng"):
            checked_host_state(bad, "forward.rng")


def test_a_malformed_generator_state_is_refused_and_the_session_goes_on(monkeypatch):
    from splitft.edge import stage as stage_module
    from splitft.errors import ProtocolError

    listener, server, thread = _inproc_cloud(MODEL)
    try:
        model, opt, data = _edge(listener.connect, seed=0)
        with model:
            crit = model.remote_loss(nn.CrossEntropyLoss())
            x, y = data[0]
            tampered = torch.zeros(torch.get_rng_state().numel(), dtype=torch.uint8)
            with monkeypatch.context() as patch:
                patch.setattr(stage_module, "host_state", lambda: tampered)  # where the edge reads it
                with pytest.raises(ProtocolError, match="generator state"):
                    crit(model(x), y)
            _step(model, opt, crit, x, y)  # the edge's real state goes with the next forward
            model.sync()  # the step rides on the next message
            (session,) = server.sessions.values()
            assert session.mirrored.steps == 1
    finally:
        server.stop()
        thread.join(timeout=10)


def test_the_state_goes_with_a_forward_only_where_the_edges_generator_moved():
    """The edge's state goes with the first training forward and then only after the script's
    generator moved (it reseeds before every step): also to a half that drew nothing so far, whose
    draws may depend on the data; a half whose stream the edge's has not left gets nothing."""
    from splitft.wire import protocol
    from tests.faulty import FaultyConnection
    from tests.models import mlp

    listener, server, thread = _inproc_cloud("tests.models:mlp", MODEL)
    sent: dict[tuple[str, bool], list[bool]] = {}
    try:
        for factory, make, reseed in (("tests.models:mlp", mlp, True), ("tests.models:mlp", mlp, False),
                                      (MODEL, mlp_dropout, True)):
            seen = sent[factory, reseed] = []

            def note(frames, seen=seen) -> int:
                msg = protocol.decode([bytes(memoryview(f)) for f in frames])
                if isinstance(msg, protocol.Forward):
                    seen.append(msg.rng is not None)
                return 1

            model = splitft.split(make(), 2, factory=factory, connect=lambda: FaultyConnection(listener.connect(),
                                                                                               note))
            with model:
                opt = model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
                crit = model.remote_loss(nn.CrossEntropyLoss())
                for i, (x, y) in enumerate(_edge_data(seed=0)):
                    if reseed:
                        torch.manual_seed(100 + i)  # no state the session's own stream starts from
                    _step(model, opt, crit, x, y)
        assert sent["tests.models:mlp", True] == [True] * STEPS
        assert sent["tests.models:mlp", False] == [True] + [False] * (STEPS - 1)
        assert sent[MODEL, True] == [True] * STEPS
    finally:
        server.stop()
        thread.join(timeout=10)


def test_a_cloud_layer_whose_draws_depend_on_the_data_is_refused_once_and_then_draws_the_unsplit_numbers(tmp_path):
    """Noise added only to the rows a mask selects: a batch that selects none draws nothing, and the
    cloud learns the half does not draw; the next one that draws ran on the cloud process's
    generator, not the edge's stream: refused, and from then on its forwards draw the unsplit numbers."""
    from splitft.errors import ModelError
    from tests.models import masked_noise_mlp

    refused = []

    def run(model, crit) -> list[torch.Tensor]:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for i, (x, y) in enumerate(_edge_data(seed=0)):
            torch.randn(3)  # the script draws (an augmentation) before every step
            x = -x.abs() if i in (0, 3) else x.abs()  # the half adds noise to rows with a positive first value
            try:
                loss = crit(model(x), y)
            except ModelError as error:
                assert "drew random numbers in a forward in training mode, where its forwards so far" in str(error)
                refused.append(i)
                loss = crit(model(x), y)  # the step again
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        return losses

    torch.manual_seed(0)
    local = masked_noise_mlp()
    expected = run(local, nn.CrossEntropyLoss())
    proc, address, _ = start_cloud(tmp_path, "--model", "tests.models:masked_noise_mlp")  # a generator of its own
    try:
        torch.manual_seed(0)
        with splitft.split(masked_noise_mlp(), 2, factory="tests.models:masked_noise_mlp", connect=address) as model:
            got = run(model, model.remote_loss(nn.CrossEntropyLoss()))
            state = model.state_dict()
    finally:
        stop(proc)
    assert [float(v) for v in got] == [float(v) for v in expected]
    assert all(torch.equal(state[k], v) for k, v in local.state_dict().items())
    assert refused == [1]


def test_monte_carlo_dropout_at_inference_draws_the_unsplit_masks():
    """``model.eval()`` with the dropout layers put back in training mode (Monte Carlo dropout for
    an uncertainty estimate): the cloud half's predictions are the unsplit model's, sample by sample."""
    def mc_predictions(model, predict) -> list[torch.Tensor]:
        model.eval()
        for module in model.modules():
            if isinstance(module, nn.Dropout):
                module.train()
        torch.manual_seed(11)
        x = _edge_data(seed=3)[0][0]
        with torch.no_grad():
            return [predict(x) for _ in range(4)]

    local = mlp_dropout()
    expected = mc_predictions(local, local)
    listener, server, thread = _inproc_cloud(MODEL)
    try:
        model = splitft.split(mlp_dropout(), 2, factory=MODEL, connect=listener.connect)
        with model:
            got = mc_predictions(model, model.predict)
    finally:
        server.stop()
        thread.join(timeout=10)
    assert not torch.equal(expected[0], expected[1])  # the masks differ from sample to sample
    for a, b in zip(got, expected):
        assert torch.equal(a, b)
