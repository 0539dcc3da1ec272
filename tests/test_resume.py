"""Checkpoints and resume: a cloud that dies mid-run, or an edge restarted from its checkpoint,
continues to the same final weights as a run that never stopped."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

import splitft
from splitft import Faults
from splitft.cloud import CloudServer, serve_in_thread
from splitft.app.data import batches, load_digits
from splitft.app.models import digits_cnn
from tests.conftest import DIGITS, start_cloud, stop
from tests.test_faults import MLP, _data, assert_same, local_weights, split_weights
from tests.models import bypass_batchnorm_mlp, mlp
from transports import InprocListener

BYPASS = "tests.models:bypass_batchnorm_mlp"


class RestartableCloud:
    """An in-process cloud that can 'crash' (vanish without a goodbye) and start again on the
    same checkpoint folder; edges reach whichever instance is current."""

    def __init__(self, folder, models: tuple[str, ...] = (MLP,)) -> None:
        self.folder, self.models = folder, list(models)
        self.start()

    def start(self) -> None:
        self.listener = InprocListener()
        self.server = CloudServer(self.listener, self.models, checkpoint_dir=str(self.folder), fsync=False)
        self.thread = serve_in_thread(self.server)

    def crash(self) -> None:
        self.listener.close()  # closed first: the shutdown's goodbyes reach no one
        self.thread.join(timeout=10)

    def connect(self):
        return self.listener.connect()


@pytest.mark.parametrize("buffers", [False, True], ids=["fresh inputs", "inputs in reused buffers"])
def test_cloud_crash_mid_step_resumes_from_its_checkpoint(tmp_path, buffers):
    """The cloud dies after a forward, before its backward, and comes back from its checkpoint; the
    edge replays what it sent since. Also for a script that fills the same input and label tensors
    in place for every micro-batch: what is replayed is what was sent, not what the buffers hold
    by the time the cloud is back."""
    data = _data(6)
    cloud = RestartableCloud(tmp_path / "ck")
    model = splitft.split(mlp(), 2, factory=MLP, connect=cloud.connect, faults=Faults(timeout=0.5, heartbeat=0))
    xb, yb = torch.empty(8, 12), torch.empty(8, dtype=torch.int64)
    try:
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
        crit = model.remote_loss(nn.CrossEntropyLoss())
        for i, (x, y) in enumerate(data):
            for j, part in enumerate(torch.chunk(torch.arange(len(y)), 2)):
                inputs, labels = (xb.copy_(x[part]), yb.copy_(y[part])) if buffers else (x[part], y[part])
                loss = crit(model(inputs), labels) / 2
                if (i, j) in ((2, 1), (4, 0)):  # after a forward, before its backward
                    cloud.crash()
                    cloud.start()
                loss.backward()
            opt.step()
            opt.zero_grad()
        weights = {**model.edge_state_dict(), **model.cloud_state_dict()}
        # each crash forces a recovery; a loaded machine may add one more through the 0.5 s timeout
        assert model.session.recoveries >= 2
    finally:
        model.close()
        cloud.crash()
    assert_same(weights, local_weights(data, accumulate=2))



def test_a_layer_bypassed_and_a_batch_norm_in_eval_mode_stay_so_in_a_cloud_restarted_from_its_checkpoint(tmp_path):
    """What the script set on cloud modules once, and the edge sends once (a private flag its code
    reads, a module in the other mode than the model's), is part of the cloud's checkpoint: a
    restarted cloud computes on as the script left them, not as the factory built them."""
    data = _data(6)

    def train(model, crit, on_step=lambda i: None) -> None:
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for i, (x, y) in enumerate(data):
            if i == 2:
                net_of(model)[2]._bypass = True
                net_of(model)[3].eval()  # frozen batch statistics while the rest trains
            on_step(i)
            opt.zero_grad()
            crit(model(x), y).backward()
            opt.step()

    def net_of(model):
        return model.wrapped if isinstance(model, splitft.SplitModel) else model

    local = bypass_batchnorm_mlp().train()
    train(local, nn.CrossEntropyLoss())
    cloud = RestartableCloud(tmp_path / "ck", models=(BYPASS,))
    model = splitft.split(bypass_batchnorm_mlp().train(), 2, factory=BYPASS, connect=cloud.connect,
                          faults=Faults(timeout=0.5, heartbeat=0))

    def crash_after_the_change(i: int) -> None:
        if i == 4:
            cloud.crash()
            cloud.start()

    try:
        train(model, model.remote_loss(nn.CrossEntropyLoss()), crash_after_the_change)
        state = model.state_dict()
        assert model.session.recoveries >= 1
    finally:
        model.close()
        cloud.crash()
    assert set(state) == set(local.state_dict())
    assert all(torch.equal(state[k], v) for k, v in local.state_dict().items())

def test_a_goodbye_to_a_cloud_that_restarted_ends_the_session_there(tmp_path):
    """The cloud restarts between the last step and the goodbye: the edge gets the session back
    to end it, so the cloud counts it as ended (``--sessions N`` exits) and drops its checkpoints,
    instead of keeping a session nobody will resume."""
    data = _data(3)
    cloud = RestartableCloud(tmp_path / "ck")
    model = splitft.split(mlp(), 2, factory=MLP, connect=cloud.connect, faults=Faults(timeout=30, heartbeat=0))
    try:
        # Reading the cloud's weights carries the last step: nothing rides on the goodbye.
        assert_same(split_weights(model, data), local_weights(data))
        assert [p for p in (tmp_path / "ck").rglob("*") if p.is_file()]  # the session's checkpoints
        cloud.crash()
        cloud.start()
        model.close()
        assert model.session.recoveries == 1
        assert cloud.server.ended == 1, cloud.server.finished
        assert [f["reason"] for f in cloud.server.finished] == [f"ended after {len(data)} steps: done"]
        assert [p for p in (tmp_path / "ck").rglob("*") if p.is_file()] == []
    finally:
        model.close()
        cloud.crash()


def test_edge_restarted_from_its_checkpoint_continues_exactly(tmp_path):
    data = _data(7)
    listener = InprocListener()
    server = CloudServer(listener, [MLP], checkpoint_dir=str(tmp_path / "ck"), fsync=False)
    thread = serve_in_thread(server)
    try:
        first = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
        opt = first.attach(torch.optim.Adam(first.parameters(), lr=0.01))
        crit = first.remote_loss(nn.CrossEntropyLoss())
        for i, (x, y) in enumerate(data):
            crit(first(x), y).backward()
            opt.step()
            opt.zero_grad()
            if i == 2:
                first.save_checkpoint(tmp_path / "edge")
            if i == 4:
                break  # the edge "crashes": steps 3 and 4 are lost with it
        first.session.drop()

        second = splitft.split(mlp(seed=5), 2, factory=MLP, connect=listener.connect,
                               resume_from=tmp_path / "edge")
        with second:
            assert second.stage.step == 3
            opt = second.attach(torch.optim.Adam(second.parameters(), lr=0.01))
            crit = second.remote_loss(nn.CrossEntropyLoss())
            for x, y in data[3:]:
                crit(second(x), y).backward()
                opt.step()
                opt.zero_grad()
            weights = {**second.edge_state_dict(), **second.cloud_state_dict()}
    finally:
        server.stop()
        thread.join(timeout=10)
    assert_same(weights, local_weights(data))


def _train(model, opt, crit, part):
    """A loop that clears the gradients first: zero_grad, forward, backward, step."""
    for x, y in part:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()


def _warmup(epoch: int) -> float:
    return min(1.0, (epoch + 1) / 4)


def _scheduled(model, opt, sched, crit, part) -> None:
    """:func:`_train` with the scheduler stepping after each step."""
    for x, y in part:
        opt.zero_grad()
        crit(model(x), y).backward()
        opt.step()
        sched.step()


def _warmed_up_locally(data) -> dict:
    """The unsplit model's weights after ``data`` under Adam and the warm-up scheduler, never stopped."""
    local = mlp()
    opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _scheduled(local, opt, torch.optim.lr_scheduler.LambdaLR(opt, _warmup), nn.CrossEntropyLoss(), data)
    return local.state_dict()


def _checkpointed_then(tmp_path, data, resumed, scheduled: bool = False, after_three=lambda opt: None):
    """Three steps of ``data`` (a warm-up scheduler stepping after each when ``scheduled``),
    ``after_three(opt)``, an edge checkpoint, then ``resumed(model, scheduler_state)`` on a split
    model resumed from it: what that returns."""
    listener = InprocListener()
    server = CloudServer(listener, [MLP], checkpoint_dir=str(tmp_path / "ck"), fsync=False)
    thread = serve_in_thread(server)
    try:
        first = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
        opt = torch.optim.Adam(first.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup) if scheduled else None
        crit = first.remote_loss(nn.CrossEntropyLoss())
        for x, y in data[:3]:
            opt.zero_grad()
            crit(first(x), y).backward()
            opt.step()
            if sched is not None:
                sched.step()
        after_three(opt)
        first.save_checkpoint(tmp_path / "edge")
        first.session.drop()
        second = splitft.split(mlp(seed=5), 2, factory=MLP, connect=listener.connect, resume_from=tmp_path / "edge")
        with second:
            return resumed(second, sched.state_dict() if sched is not None else None)
    finally:
        server.stop()
        thread.join(timeout=10)


def _resumed_run(tmp_path, data, after_three=lambda opt: None, on_resume=lambda model: None) -> dict:
    """Three steps of ``data``, ``after_three(opt)``, an edge checkpoint, then a new split model
    resumed from it (``on_resume(model)``) trains on the rest: its weights."""
    def resumed(model, _):
        on_resume(model)
        _train(model, torch.optim.Adam(model.parameters(), lr=0.01), model.remote_loss(nn.CrossEntropyLoss()),
               data[3:])
        return model.state_dict()

    return _checkpointed_then(tmp_path, data, resumed, after_three=after_three)


def test_an_edge_resumed_before_its_next_zero_grad_clears_the_gradients_the_cloud_kept(tmp_path):
    """A loop that clears gradients first (zero_grad, forward, backward, step) is checkpointed with
    the step's gradients still in place; the cloud's checkpoint keeps them, so the resumed edge
    must know of them for its first zero_grad to clear them, as a fresh unsplit process would
    find none."""
    data = _data(6)
    local = mlp()
    _train(local, torch.optim.Adam(local.parameters(), lr=0.01), nn.CrossEntropyLoss(), data)

    def cloud_kept_the_gradient(model):
        assert model.model[2].weight.grad is not None  # the cloud still holds step 3's gradient

    weights = _resumed_run(tmp_path, data, on_resume=cloud_kept_the_gradient)
    assert all(torch.equal(weights[k], v) for k, v in local.state_dict().items())


def test_a_checkpoint_saved_right_after_a_reset_of_the_optimizer_resumes_reset(tmp_path):
    """``opt.state.clear()`` then ``save_checkpoint``: the cloud's checkpoint, written at that
    boundary, holds no moment either, so the resumed run starts them afresh, as the unsplit one."""
    data = _data(6)
    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:3])
    local_opt.state.clear()
    _train(local, local_opt, nn.CrossEntropyLoss(), data[3:])
    weights = _resumed_run(tmp_path, data, after_three=lambda opt: opt.state.clear())
    assert all(torch.equal(weights[k], v) for k, v in local.state_dict().items())


def test_a_learning_rate_set_by_hand_on_a_resumed_models_new_optimizer_is_refused_not_replaced(tmp_path):
    """The checkpoint's optimizer state loads when the optimizer is attached, at its first step:
    a learning rate the script set between building it and that step would be replaced by the
    checkpoint's, unseen. Refused, naming the fix, which then trains as the unsplit run."""
    data = _data(6)
    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:3])
    local_opt.param_groups[0]["lr"] = 0.005
    _train(local, local_opt, nn.CrossEntropyLoss(), data[3:])

    def resumed(model, _):
        crit = model.remote_loss(nn.CrossEntropyLoss())
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for group in opt.param_groups:
            group["lr"] = 0.005
        crit(model(data[3][0]), data[3][1]).backward()
        with pytest.raises(splitft.ConfigError, match=r"lr=0\.005 was set on param group 0 .* checkpoint's lr=0\.01"
                                                      r".* model\.attach\(opt\) right after building"):
            opt.step()
        opt = model.attach(torch.optim.Adam(model.parameters(), lr=0.01))
        for group in opt.param_groups:
            group["lr"] = 0.005
        _train(model, opt, crit, data[3:])
        return model.state_dict()

    weights = _checkpointed_then(tmp_path, data, resumed)
    assert all(torch.equal(weights[k], v) for k, v in local.state_dict().items())


def test_a_scheduler_built_over_a_resumed_models_new_optimizer_goes_on_with_the_checkpoints_learning_rate(tmp_path):
    """A warm-up scheduler built over the new optimizer sets its learning rate, and its state is
    loaded from the first run's: the checkpoint's learning rate is the one to go on with (as a
    script that loads both states after building both), and the run ends as one never stopped."""
    data = _data(6)

    def resumed(model, sched_state):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup)
        sched.load_state_dict(sched_state)
        _scheduled(model, opt, sched, model.remote_loss(nn.CrossEntropyLoss()), data[3:])
        return model.state_dict()

    weights = _checkpointed_then(tmp_path, data, resumed, scheduled=True)
    assert all(torch.equal(weights[k], v) for k, v in _warmed_up_locally(data).items())


def _same_state(got: dict, want: dict) -> bool:
    """Two optimizer state dicts hold equal entries and settings."""
    return got["param_groups"] == want["param_groups"] and got["state"].keys() == want["state"].keys() and all(
        torch.equal(torch.as_tensor(got["state"][i][k]), torch.as_tensor(v))
        for i, entry in want["state"].items() for k, v in entry.items())


def test_a_resumed_models_new_optimizer_holds_the_checkpoints_state_before_its_first_step(tmp_path):
    """``opt.state_dict()`` right after resuming (a script that saves its optimizer at the top of
    each epoch): the checkpoint's state loads then, as after the unsplit script's
    ``opt.load_state_dict``, not at the first step; before, the state saved was empty."""
    data = _data(6)
    local = mlp()
    local_opt = torch.optim.Adam(local.parameters(), lr=0.01)
    _train(local, local_opt, nn.CrossEntropyLoss(), data[:3])

    def resumed(model, _):
        return torch.optim.Adam(model.parameters(), lr=0.01).state_dict()

    assert _same_state(_checkpointed_then(tmp_path, data, resumed), local_opt.state_dict())


def test_a_scheduler_resumed_with_last_epoch_over_a_resumed_models_new_optimizer_goes_on(tmp_path):
    """A scheduler rebuilt with ``last_epoch=`` (torch's way to resume one) reads the
    ``initial_lr`` of the loaded optimizer state: the checkpoint's loads as the scheduler is
    built (torch raised KeyError before), and the run ends as one never stopped."""
    data = _data(6)

    def resumed(model, _):
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _warmup, last_epoch=2)
        _scheduled(model, opt, sched, model.remote_loss(nn.CrossEntropyLoss()), data[3:])
        return model.state_dict()

    weights = _checkpointed_then(tmp_path, data, resumed, scheduled=True)
    assert all(torch.equal(weights[k], v) for k, v in _warmed_up_locally(data).items())


def test_resume_with_a_wrong_token_is_refused(tmp_path):
    listener = InprocListener()
    server = CloudServer(listener, [MLP], checkpoint_dir=str(tmp_path / "ck"), fsync=False)
    thread = serve_in_thread(server)
    try:
        model = splitft.split(mlp(), 2, factory=MLP, connect=listener.connect)
        model.attach(torch.optim.SGD(model.parameters(), lr=0.1))
        model.save_checkpoint(tmp_path / "edge")
        model.session.drop()
        text = (tmp_path / "edge.json").read_text()
        (tmp_path / "edge.json").write_text(text.replace(model.session.token, "0" * 32))
        with pytest.raises(splitft.HandshakeError, match="wrong resume token"):
            splitft.split(mlp(), 2, factory=MLP, connect=listener.connect, resume_from=tmp_path / "edge")
    finally:
        server.stop()
        thread.join(timeout=10)


# ---------------------------------------------------------------- a real cloud process, SIGKILLed

STEPS = 8


def _digits_run(model, opt, crit, data, on_event=None) -> None:
    it = batches(data, 32, shuffle=True, seed=1)
    for i in range(STEPS):
        x, y, _ = next(it)
        for j, part in enumerate(torch.chunk(torch.arange(len(y)), 2)):
            loss = crit(model(x[part]), y[part]) / 2
            if on_event:
                on_event(i, j, "forward")
            loss.backward()
        opt.step()
        if on_event:
            on_event(i, 0, "step")
        opt.zero_grad()


def test_cloud_process_killed_twice_and_restarted_from_its_checkpoint(tmp_path):
    data = load_digits()[0]
    local = digits_cnn()
    opt = torch.optim.Adam(local.parameters(), lr=3e-3)
    _digits_run(local, opt, nn.CrossEntropyLoss(), data)

    folder = str(tmp_path / "checkpoints")
    args = ("--sessions", "0", "--model", DIGITS, "--checkpoint-dir", folder, "--no-fsync")
    cloud, address, _ = start_cloud(tmp_path, *args)
    clouds = [cloud]

    def kill_and_restart(i: int, j: int, where: str) -> None:
        # Mid-step (a forward whose backward has not been sent) and between steps (a step that
        # only rides on the next message): both must survive.
        if (i, j, where) in ((2, 0, "forward"), (5, 0, "step")):
            os.kill(clouds[-1].pid, signal.SIGKILL)
            clouds[-1].wait(timeout=10)
            clouds.append(start_cloud(tmp_path, *args, "--bind", address)[0])

    try:
        model = splitft.split(digits_cnn(), "block3", factory=DIGITS, connect=address,
                              faults=Faults(timeout=10, reconnect_timeout=60, heartbeat=0))
        with model:
            opt = model.attach(torch.optim.Adam(model.parameters(), lr=3e-3))
            _digits_run(model, opt, model.remote_loss(nn.CrossEntropyLoss()), data, kill_and_restart)
            weights = {**model.edge_state_dict(), **model.cloud_state_dict()}
            assert model.session.recoveries == 2
    finally:
        for proc in clouds:
            stop(proc)
    assert len(clouds) == 3
    assert_same(weights, local.state_dict())


def test_replay_log_stays_bounded_when_the_edge_never_steps(tmp_path):
    """A long evaluation sends requests but no step; the edge asks for checkpoints to let them go."""
    cloud = RestartableCloud(tmp_path / "ck")
    # The crash closes the listener, which the edge sees at once: a long timeout keeps a loaded
    # machine's slow reply from counting as a second recovery.
    model = splitft.split(mlp(), 2, factory=MLP, connect=cloud.connect, faults=Faults(timeout=30, heartbeat=0))
    model.session.max_log_bytes = 20_000
    try:
        x = _data(1)[0][0]
        model.eval()
        with torch.no_grad():
            expected = model.predict(x)
            for i in range(60):
                if i == 45:
                    cloud.crash()
                    cloud.start()
                torch.testing.assert_close(model.predict(x), expected)
                assert model.session._log.nbytes <= 20_000 + 5_000
        assert model.session.recoveries == 1
    finally:
        model.close()
        cloud.crash()
