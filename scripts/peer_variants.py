"""The four ways scripts/bench_peers.py runs a split training step: each variant's edge side, the
peer processes of the torch RPC and raw pyzmq variants, and the edge process that times rounds.

A module of its own so that every process started for the benchmark (edge processes, peers, and the
`splitft cloud` process, which builds the encoder from ``peer_variants:tiny_encoder``) imports the
same code under the same name.
"""

from __future__ import annotations

import json
import os
import time
import traceback
import warnings
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

CNN = "splitft.app.models:digits_cnn"
ENCODER = "peer_variants:tiny_encoder"  # the cloud imports it from this folder (PYTHONPATH is set for it)
LR = 1e-3
REPLY_TIMEOUT = 600.0  # seconds any process waits for another before giving up


# ---------------------------------------------------------------- workloads


def tiny_encoder(seed: int = 0, layers: int = 6, width: int = 64, heads: int = 4, seq: int = 32,
                 vocab: int = 1000, classes: int = 10) -> nn.Sequential:
    """A small transformer classifier of torch modules only (the cloud builds it from its name)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        parts: OrderedDict[str, nn.Module] = OrderedDict(embed=nn.Embedding(vocab, width))
        for i in range(layers):
            parts[f"layer{i}"] = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        parts["head"] = nn.Sequential(nn.Flatten(), nn.Linear(seq * width, classes))
        return nn.Sequential(parts)


def build(w: dict[str, Any]) -> nn.Sequential:
    from splitft.factories import load_factory

    return load_factory(w["factory"])(**w["kwargs"])


def halves(w: dict[str, Any]) -> tuple[nn.Sequential, nn.Sequential]:
    """The model cut at ``w["cut"]``; both halves keep the unsplit model's parameter names."""
    model = build(w)
    at = list(model._modules).index(w["cut"])
    return model[:at], model[at:]


def batch_of(w: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The one batch every variant trains on, again and again (the same in every process)."""
    gen = torch.Generator().manual_seed(1)
    n = w["batch"]
    if w["factory"] == CNN:
        return torch.randn(n, 1, 8, 8, generator=gen), torch.randint(0, 10, (n,), generator=gen)
    return (torch.randint(0, 1000, (n, w["kwargs"]["seq"]), generator=gen),
            torch.randint(0, 10, (n,), generator=gen))


# ---------------------------------------------------------------- the four variants (edge side)


def device_of(w: dict[str, Any]) -> torch.device:
    """Where the second half runs (``--device``); the first half always runs on the CPU."""
    return torch.device(w.get("device", "cpu"))


def adam_settings(w: dict[str, Any]) -> dict[str, Any]:
    """Adam's settings in every variant. With the second half on an accelerator, ``foreach``: torch
    picks it by itself for an optimizer over accelerator parameters only (the split variants'
    peers), but not for the local model's one optimizer over both halves' devices, and the two
    paths need not round alike there (on the CPU they do)."""
    return {"lr": LR, "foreach": True} if device_of(w).type != "cpu" else {"lr": LR}


def rpc_adam_settings(w: dict[str, Any]) -> dict[str, Any]:
    """The RPC variant's: DistributedOptimizer steps a TorchScript Adam, which refuses ``foreach``,
    so on an accelerator its weights may differ from the others' by rounding."""
    return {"lr": LR}


class LocalRun:
    """The unsplit model in this process: what the split variants are measured against. With the
    second half on an accelerator, the unsplit model has its second half there too, so every
    variant does the same arithmetic on the same devices."""

    def __init__(self, w: dict[str, Any], peer: dict[str, Any]) -> None:
        self.model, self.crit = build(w), nn.CrossEntropyLoss()
        self.device = device_of(w)
        if self.device.type != "cpu":
            edge, half = halves(w)
            self.model = nn.Sequential(edge, _ToDevice(self.device), half.to(self.device))
        self.opt = torch.optim.Adam(self.model.parameters(), **adam_settings(w))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.crit(self.model(x), y.to(self.device)).backward()
        self.opt.step()
        self.opt.zero_grad()

    def ping(self) -> None:
        raise RuntimeError("local has no transport")

    def state(self) -> dict[str, torch.Tensor]:
        if self.device.type == "cpu":
            return self.model.state_dict()
        edge, _, half = self.model
        return {k: v.cpu() for k, v in {**edge.state_dict(), **half.state_dict()}.items()}

    def close(self) -> None:
        pass


class _ToDevice(nn.Module):
    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.device)


class SplitftRun(LocalRun):
    """What a user of splitft writes: the local loop on a split model, the loss in the cloud."""

    def __init__(self, w: dict[str, Any], peer: dict[str, Any]) -> None:
        import splitft

        self.device = torch.device("cpu")  # the edge's; the cloud runs its half where it was told to
        self.model = splitft.split(build(w), w["cut"], factory=splitft.Factory(w["factory"], w["kwargs"]),
                                   connect=peer["address"])
        self.opt = self.model.attach(torch.optim.Adam(self.model.parameters(), **adam_settings(w)))
        self.crit = self.model.remote_loss(nn.CrossEntropyLoss())

    def ping(self) -> None:
        self.model.sync()

    def close(self) -> None:
        self.model.close()


class RawRun(LocalRun):
    """The floor: bare frames over REQ/REP; the peer's replies are the gradient, nothing else."""

    def __init__(self, w: dict[str, Any], peer: dict[str, Any]) -> None:
        import zmq

        self.edge, _ = halves(w)
        self.opt = torch.optim.Adam(self.edge.parameters(), **adam_settings(w))
        self.sock = zmq.Context.instance().socket(zmq.REQ)
        for option, value in ((zmq.LINGER, 0), (zmq.RCVTIMEO, int(REPLY_TIMEOUT * 1000))):
            self.sock.setsockopt(option, value)
        self.sock.connect(peer["address"])
        self.sock.send(json.dumps({"op": "setup", "workload": w}).encode())
        self.sock.recv()

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        act = self.edge(x)
        self.sock.send_multipart([act.detach().numpy(), y.numpy()], copy=False)
        act.backward(torch.frombuffer(self.sock.recv(copy=False).buffer, dtype=torch.float32).view(act.shape))
        self.opt.step()
        self.opt.zero_grad()

    def ping(self) -> None:
        self.sock.send(b"")
        self.sock.recv()

    def state(self) -> dict[str, torch.Tensor]:
        self.sock.send(json.dumps({"op": "state"}).encode())
        header, *frames = self.sock.recv_multipart()
        out = dict(self.edge.state_dict())
        for (name, dtype, shape), frame in zip(json.loads(header), frames, strict=True):
            out[name] = torch.frombuffer(bytearray(frame), dtype=getattr(torch, dtype)).view(shape)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


class RpcRun(LocalRun):
    """What the torch tutorials do: the cloud half behind an RRef, distributed autograd and optimizer."""

    def __init__(self, w: dict[str, Any], peer: dict[str, Any]) -> None:
        from torch.distributed import rpc
        from torch.distributed.optim import DistributedOptimizer

        self.rpc, self.edge = rpc, halves(w)[0]
        self.cloud = rpc.remote("peer", _rpc_build, args=(w,))
        params = [rpc.RRef(p) for p in self.edge.parameters()] + rpc.rpc_sync("peer", _rpc_params, (self.cloud,))
        self.opt = DistributedOptimizer(torch.optim.Adam, params, **rpc_adam_settings(w))

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        from torch.distributed import autograd

        with autograd.context() as ctx:
            loss = self.rpc.rpc_sync("peer", _rpc_forward_loss, (self.cloud, self.edge(x), y))
            autograd.backward(ctx, [loss])
            self.opt.step(ctx)

    def ping(self) -> None:
        self.rpc.rpc_sync("peer", _noop)

    def state(self) -> dict[str, torch.Tensor]:
        return {**self.edge.state_dict(), **self.rpc.rpc_sync("peer", _rpc_state, (self.cloud,))}


def _rpc_build(w: dict[str, Any]) -> nn.Module:
    return halves(w)[1].to(device_of(w))


def _rpc_params(cloud: Any) -> list:
    from torch.distributed import rpc

    return [rpc.RRef(p) for p in cloud.local_value().parameters()]


def _rpc_forward_loss(cloud: Any, act: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    half = cloud.local_value()
    device = next(half.parameters()).device
    # the loss travels back on the CPU: TensorPipe moves accelerator tensors only with device maps
    return nn.functional.cross_entropy(half(act.to(device)), y.to(device)).cpu()


def _rpc_state(cloud: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in cloud.local_value().state_dict().items()}


def _noop() -> None:
    return None


RUNS = {"local": LocalRun, "rpc": RpcRun, "splitft": SplitftRun, "raw": RawRun}


# ---------------------------------------------------------------- the peers (cloud side of rpc and raw)


def _child_setup(threads: int) -> None:
    """Every started process: its torch threads, and no warnings about what is done on purpose
    (read-only received frames are only read; torch's RPC stack warns about its own internals)."""
    torch.set_num_threads(threads)
    for message in ("The given buffer is not writable", "You are using a Backend"):
        warnings.filterwarnings("ignore", message=message)
    show = warnings.showwarning  # torch shows this one with an "always" filter of its own

    def showwarning(message: Any, *rest: Any, **kwargs: Any) -> None:
        if "support for functional optimizers is deprecated" not in str(message):
            show(message, *rest, **kwargs)

    warnings.showwarning = showwarning


def raw_peer(conn: Any, threads: int) -> None:
    """The floor's second half: a REP socket; two frames are a step, one empty frame a ping, one
    JSON frame a control message (set a workload up, send its weights)."""
    import zmq

    _child_setup(threads)
    sock = zmq.Context.instance().socket(zmq.REP)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(REPLY_TIMEOUT * 1000))
    sock.bind("tcp://127.0.0.1:0")
    conn.send(sock.getsockopt(zmq.LAST_ENDPOINT).decode())
    half = opt = shape = None
    device = torch.device("cpu")
    crit = nn.CrossEntropyLoss()
    while True:
        try:
            frames = sock.recv_multipart(copy=False)
        except zmq.Again:
            return
        if len(frames) == 2:
            act = torch.frombuffer(frames[0].buffer, dtype=torch.float32).view(shape).to(device).requires_grad_()
            crit(half(act), torch.frombuffer(frames[1].buffer, dtype=torch.int64).to(device)).backward()
            sock.send(act.grad.cpu().numpy(), copy=False)
            opt.step()
            opt.zero_grad()
        elif not frames[0].bytes:
            sock.send(b"")
        else:
            half, opt, shape = _raw_control(sock, json.loads(frames[0].bytes), half, opt, shape)
            if half is not None:
                device = next(half.parameters()).device


def _raw_control(sock: Any, msg: dict[str, Any], half: Any, opt: Any, shape: Any) -> tuple:
    if msg["op"] == "setup":
        w = msg["workload"]
        edge, half = halves(w)
        half.to(device_of(w))
        x, _ = batch_of(w)
        with torch.no_grad():
            shape = tuple(edge(x).shape)
        opt = torch.optim.Adam(half.parameters(), **adam_settings(w))
        sock.send(b"ok")
    elif msg["op"] == "state":
        state = half.state_dict()
        header = [(k, str(v.dtype).removeprefix("torch."), list(v.shape)) for k, v in state.items()]
        sock.send_multipart([json.dumps(header).encode(), *(v.cpu().contiguous().numpy() for v in state.values())])
    else:
        sock.send(b"unknown operation")
    return half, opt, shape


def _rpc_options(port: int, transport: str) -> Any:
    from torch.distributed import rpc

    extra = {"_transports": ["uv"], "_channels": ["basic"]} if transport == "tcp" else {}
    return rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", rpc_timeout=REPLY_TIMEOUT, **extra)


def rpc_peer(port: int, transport: str, threads: int) -> None:
    """Rank 1 of the RPC pair: it serves what the edge asks for until the edge shuts RPC down."""
    from torch.distributed import rpc

    _child_setup(threads)
    rpc.init_rpc("peer", rank=1, world_size=2, rpc_backend_options=_rpc_options(port, transport))
    rpc.shutdown()
    os._exit(0)  # nothing left to flush: skip torch's teardown


# ---------------------------------------------------------------- an edge process: one variant


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process ``pid``, living or ended (its process CPU clock)."""
    return time.clock_gettime(((~pid) << 3) | 2)  # MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)


def minor_faults(pid: int) -> int:
    """Minor page faults of process ``pid`` so far, all its threads (field 10 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rpartition(")")[2].split()[7])


def _measure(run: Any, x: torch.Tensor, y: torch.Tensor, steps: int, peer: int | None) -> dict[str, float]:
    me = os.getpid()
    pids = [me] if peer is None else [me, peer]
    cpu0, faults0 = [cpu_seconds(p) for p in pids], [minor_faults(p) for p in pids]
    start = time.perf_counter()
    for _ in range(steps):
        run.step(x, y)
    wall = time.perf_counter() - start
    cpu = [cpu_seconds(p) - c for p, c in zip(pids, cpu0, strict=True)]
    faults = [minor_faults(p) - f for p, f in zip(pids, faults0, strict=True)]
    return {"wall": wall / steps, "cpu_edge": cpu[0] / steps, "cpu_peer": sum(cpu[1:]) / steps,
            "faults": sum(faults) / steps}


def edge_worker(variant: str, conn: Any, threads: int, rpc_port: int, rpc_transport: str) -> None:
    """Serve the coordinator's commands for one variant until told to exit (or it goes away)."""
    _child_setup(threads)
    if variant == "rpc":
        from torch.distributed import rpc

        rpc.init_rpc("edge", rank=0, world_size=2, rpc_backend_options=_rpc_options(rpc_port, rpc_transport))
    run = peer = x = y = None
    try:
        while True:
            cmd, arg = conn.recv()
            try:
                if cmd == "setup":
                    w, peer = arg["workload"], arg["peer"]
                    run, (x, y) = RUNS[variant](w, peer), batch_of(w)
                    for _ in range(arg["warmup"]):
                        run.step(x, y)
                    reply: Any = "ready"
                elif cmd == "round":
                    reply = _measure(run, x, y, arg, peer.get("pid"))
                elif cmd == "ping":
                    reply = [_timed(run.ping) for _ in range(arg)]
                elif cmd == "state":
                    reply = {k: v.detach().clone() for k, v in run.state().items()}
                elif cmd == "teardown":
                    run.close()
                    run, reply = None, "done"
                else:
                    break
                conn.send(("ok", reply))
            except Exception:  # noqa: BLE001 — the coordinator prints it and stops
                conn.send(("error", f"{variant}: {traceback.format_exc()}"))
    except EOFError:
        return
    finally:
        if variant == "rpc":
            rpc.shutdown()
    os._exit(0)  # told to exit with nothing left to flush: skip torch's teardown (~0.4 s a process)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start
