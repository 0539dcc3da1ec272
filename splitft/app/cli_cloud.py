"""``splitft cloud``: its flags and the command, from one process to a torch.distributed job."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..cloud import CloudServer

DEFAULT_MODEL = "splitft.app.models:digits_cnn"
DEFAULT_BIND = "tcp://127.0.0.1:5555"


def task_names() -> list[str]:
    from .tasks import TASKS

    return list(TASKS)


def add_cloud_parser(sub: argparse._SubParsersAction) -> None:
    cloud = sub.add_parser("cloud", help="serve cloud halves of models to edges",
                           description="Serve the cloud half of the allowed models. Each edge that connects "
                                       "gets its own session (weights, optimizer, codec state).")
    cloud.add_argument("--bind", default=DEFAULT_BIND,
                       help="address to listen on: tcp://HOST:PORT (port 0 picks one) or ipc://PATH "
                            f"(default: {DEFAULT_BIND})")
    cloud.add_argument("--model", action="append", default=None, metavar="FACTORY",
                       help="a model factory edges may ask for; repeat for several (default: the task's model)")
    cloud.add_argument("--task", choices=sorted(task_names()), default="digits",
                       help=f"serve this task's model when no --model is given (default: digits, {DEFAULT_MODEL})")
    cloud.add_argument("--sessions", type=int, default=1,
                       help="exit after this many edge sessions have ended; 0 serves until Ctrl-C (default: 1)")
    cloud.add_argument("--max-message-mb", type=float, default=1024.0,
                       help="refuse bigger messages with a 'too_large' error (default: 1024)")
    cloud.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)
    g = cloud.add_argument_group("security (CurveZMQ: encrypted, and only known edges get in)")
    g.add_argument("--secret-key", default=None, metavar="FILE",
                   help="this cloud's secret key file (NAME.key_secret from 'splitft keys')")
    g.add_argument("--allow-edge-keys", nargs="+", default=None, metavar="DIR_OR_FILE",
                   help="edge public keys allowed in: .key files, or folders of them")
    g.add_argument("--allow-any-edge", action="store_true",
                   help="serve a public (non-loopback) --bind address without --allow-edge-keys: anyone who "
                        "reaches the port may open sessions, and ZeroMQ buffers what they send before the cloud's "
                        "checks see it (refused without this flag)")
    _add_checkpoint_options(cloud)
    _add_policy_options(cloud)
    _add_hardware_options(cloud)
    g = cloud.add_argument_group("many edges")
    g.add_argument("--max-open-sessions", type=int, default=256,
                   help="sessions served at once; beyond it a hello takes the place of an idle session, or of "
                        "one of an origin holding more places, and is refused if there is none (default: 256)")
    g.add_argument("--sessions-per-peer", type=int, default=64, metavar="N",
                   help="sessions open at once from one address, or from one allowed edge key with "
                        "--allow-edge-keys (default: 64)")
    g.add_argument("--handshake-timeout", type=float, default=30.0, metavar="S",
                   help="free a session that has not sent a training request after this many silent seconds "
                        "(default: 30)")
    g.add_argument("--evictable-after", type=float, default=30.0, metavar="S",
                   help="when the cloud is full, a session whose hello or last training request (pings and "
                        "failed requests do not count) is older than this may be evicted for a new one; sessions "
                        "of an origin holding more than the newcomer's may be at once (default: 30)")
    g.add_argument("--shared-model", action="store_true",
                   help="edges asking for the same model and cut train one shared cloud half, in the order "
                        "their requests arrive (sequential split learning); default: a cloud half per edge")
    g.add_argument("--shared-optimizer", default=None, metavar="NAME[:{SETTINGS}]",
                   help="with --shared-model: the shared half's optimizer, the cloud's choice, as a torch.optim "
                        "name and JSON settings ('SGD:{\"lr\": 0.1, \"momentum\": 0.9}'); an edge must attach "
                        "the same, and steps at most at that lr (default: none, the half serves forward calls only)")
    g.add_argument("--shared-frozen", default=None, metavar="NAME,...",
                   help="with --shared-model: the shared half's parameters that do not train, by their names in "
                        "the unsplit model; an edge must freeze the same (default: none)")
    g.add_argument("--sync-rounds", type=int, default=0, metavar="N",
                   help="with --shared-model: train each shared half data-parallel in synchronous rounds of N "
                        "edges (on this process): the mean of their gradients, one optimizer step per round "
                        "(SplitFed); across the ranks of a torch.distributed launch, N edges per rank (default: "
                        "0, steps in arrival order)")
    g.add_argument("--round-timeout", type=float, default=30.0, metavar="S",
                   help="a round lasts at most this long; edges that sent no gradient by then are dropped from "
                        "it (default: 30; keep it below the edges' reply timeout)")
    g.add_argument("--average-cut-grads", action="store_true",
                   help="with --sync-rounds (SGLR): answer every edge's backward with the mean of its round's "
                        "cut-layer gradients instead of its own, once every edge of the round has sent its "
                        "backward (edges send batches of one size, one backward per step; one process)")
    g.add_argument("--server-lr", type=float, default=None, metavar="LR",
                   help="with --shared-optimizer: split learning rates (SGLR). The shared half steps at LR, "
                        "whatever rate the edges' steps carry; an edge's rate (its optimizer's, e.g. splitft "
                        "edge --lr) is its own half's alone (default: the edges' steps set the half's rate)")
    g.add_argument("--grad-compression", default="none", metavar="SPEC",
                   help="how ranks all-reduce a shared half's gradient: none, fp16 or "
                        "powersgd:rank=R[,start=S][,min_rate=M] (DDP communication hooks; default: none)")
    g.add_argument("--split-batch", action="store_true",
                   help="launched as N ranks (torchrun): one edge's heavy half is replicated on every rank and "
                        "each of its batches split by rows across them; rank 0 serves the edge, one at a time")
    g.add_argument("--shard", action="store_true",
                   help="with --split-batch: for a half that does not fit one device's memory, each rank holds "
                        "1/N of its parameters, gradients and optimizer state (FSDP2) instead of a replica; "
                        "every layer's weights are gathered for its forward and backward, so each step moves "
                        "about 3x the half's weights between ranks (a replica's all-reduce moves 2x)")
    _add_rank_options(cloud)
    g = cloud.add_argument_group("watching it (Prometheus; needs the 'metrics' extra)")
    g.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (splitft_*: sessions, requests, "
                        "bytes, latencies, memory, refusals, checkpoints, ranks); each rank of a cloud of several "
                        "on PORT + its local rank; 0 picks a free port (default: off)")
    g.add_argument("--metrics-host", default="127.0.0.1", metavar="HOST",
                   help="the address the metrics endpoint listens on; another machine's scraper needs a "
                        "non-loopback one, e.g. 0.0.0.0 (default: 127.0.0.1)")


def _add_checkpoint_options(cloud: argparse.ArgumentParser) -> None:
    """Faults and checkpoints: what survives a crash of the cloud, and what a session may leave."""
    g = cloud.add_argument_group("faults and checkpoints")
    g.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                   help="checkpoint every session there; a restarted cloud given the same folder lets its "
                        "edges resume where they were (default: no checkpoints)")
    g.add_argument("--checkpoint-every", type=int, default=1, metavar="N",
                   help="checkpoint at every N-th optimizer step; 1 loses nothing on a crash, larger is cheaper "
                        "and makes edges keep N steps to re-send (default: 1)")
    g.add_argument("--no-fsync", action="store_true",
                   help="do not flush checkpoints to disk: survives a crash of the process, not of the machine")
    g.add_argument("--session-timeout", type=float, default=300.0,
                   help="free a session after this many seconds without a message; its checkpoints go with it "
                        "(default: 300)")
    g.add_argument("--checkpoint-max-mb", type=float, default=65536.0, metavar="MB",
                   help="what the checkpoint folder may hold in all; new sessions are refused beyond it "
                        "(default: 65536)")
    g.add_argument("--pin-quota-mb", type=float, default=4096.0, metavar="MB",
                   help="what the pinned checkpoints of one origin (address, or edge key) may hold; pins are "
                        "kept after their session ends, for edges that saved their own checkpoint (default: 4096)")
    g.add_argument("--pin-hours", type=float, default=168.0, metavar="H",
                   help="a pinned checkpoint is deleted this long after it was written (default: 168, a week)")
    g.add_argument("--train-fraction", type=float, default=1.0, metavar="F",
                   help="a selective server (AdaSplit): train the cloud half on about F of each edge's backward "
                        "requests, those whose loss is among the highest it lately sent; the others are answered "
                        "with zero gradients and cost no backward (default: 1, every one)")
    g.add_argument("--max-move-mb", type=float, default=1024.0, metavar="MB",
                   help="the most state a session moving here from another cloud may bring (its half's weights, "
                        "gradients, optimizer and codec state), checked before any of it is built; it must also "
                        "fit --session-memory-mb (default: 1024)")


def _add_rank_options(cloud: argparse.ArgumentParser) -> None:
    """A cloud of several processes: torchrun, or --workers on torch's launcher (splitft.cloud.workers)."""
    g = cloud.add_argument_group(
        "several processes (torch.distributed)", "Under torchrun (or with --workers) every rank serves its own "
        "edges; rank 0 listens on --bind and places each new edge on the least-loaded live rank.")
    g.add_argument("--workers", type=int, default=1, metavar="N",
                   help="start N ranks on this machine with torch's launcher (as 'torchrun --standalone "
                        "--nproc-per-node N -m splitft cloud ...' would); ignored under torchrun (default: 1)")
    g.add_argument("--max-restarts", type=int, default=3, metavar="N",
                   help="with --workers: times the launcher starts the group again after a rank dies (default: 3)")
    g.add_argument("--rank-timeout", type=float, default=5.0, metavar="S",
                   help="a rank whose heartbeat did not move for this long gets no more edges (default: 5)")
    g.add_argument("--rank-host", default=None, metavar="HOST",
                   help="the host name edges reach this machine's ranks at (default: the --bind host; "
                        "needed when --bind listens on every interface)")
    g.add_argument("--rank-port", type=int, default=None, metavar="PORT",
                   help="ranks other than the front door listen on PORT + their local rank (default: free ports)")


def _add_hardware_options(cloud: argparse.ArgumentParser) -> None:
    """Where the cloud halves compute, and in which dtype."""
    g = cloud.add_argument_group("hardware")
    g.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the cloud halves compute: cpu, cuda, cuda:N or mps (default: the first GPU when "
                        "there is one, else cpu); a device this machine lacks is refused at start-up")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="keep the cloud halves in this dtype: bfloat16 halves their memory (the edge's tensors "
                        "are cast on the way in and back on the way out) (default: float32, the model's own)")
    g.add_argument("--offload-optimizer", action="store_true",
                   help="keep each half's optimizer state (Adam: twice its weights) in host memory between steps, "
                        "copied onto the device for each step: a half whose state does not fit beside it")


def _add_policy_options(cloud: argparse.ArgumentParser) -> None:
    """What an edge may make this cloud do: codecs, codec options, work and memory per message."""
    from compressors import Bounds
    from ..cloud.limits import Limits

    g = cloud.add_argument_group(
        "what edges may ask for", "Every codec option an edge sends is bounded here; options naming local "
        "resources (files) are never accepted. Requests over a budget get a typed 'capacity' or 'policy' error "
        "and the cloud keeps serving everyone else.")
    g.add_argument("--allow-codecs", action="append", default=None, metavar="[DIR=]NAME,...",
                   help="codecs edges may use: 'fp16,lowrank' for every direction, or per direction "
                        "('fwd=lowrank', 'bwd=identity'; directions fwd, bwd, ret, ret_bwd); repeatable "
                        "(default: every codec)")
    for name, f in Bounds.__dataclass_fields__.items():
        flag = "--" + name.replace("_", "-")
        g.add_argument(flag, type=type(f.default), default=f.default, metavar="N", dest=f"bound_{name}",
                       help=f"{Bounds.describe(name)} (default: {f.default})")
    limits = Limits()
    g.add_argument("--max-decoded-mb", type=float, default=limits.max_decoded_bytes / 2**20, metavar="MB",
                   help="what one message's tensors may take once decoded (default: %(default).0f)")
    g.add_argument("--max-header-kb", type=float, default=limits.max_header_bytes / 2**10, metavar="KB",
                   help="biggest header frame (a message's fields, arrays excluded) this cloud parses; a parse "
                        "takes up to ~90x the header's size in memory, for a moment (default: %(default).0f)")
    g.add_argument("--max-request-gflop", type=float, default=limits.max_request_flops / 1e9, metavar="GFLOP",
                   help="the arithmetic one request may cost (decode, the half's forward and backward, encoding "
                        "the reply), priced before it starts (default: %(default).0f)")
    g.add_argument("--max-ops", type=int, default=limits.max_ops, metavar="N",
                   help="mirrored operations (optimizer steps, zero_grad...) one message may carry "
                        "(default: %(default)s)")
    g.add_argument("--session-memory-mb", type=float, default=limits.session_memory_bytes / 2**20, metavar="MB",
                   help="what one session may hold: its model copy, codec state, pending graphs, cached "
                        "replies (default: %(default).0f)")
    g.add_argument("--memory-mb", type=float, default=limits.memory_bytes / 2**20, metavar="MB",
                   help="what all sessions may hold together (default: half of this machine's memory, "
                        "%(default).0f)")


def _limits_and_policy(args: argparse.Namespace) -> tuple:
    from compressors import Bounds
    from ..cloud.limits import Limits
    from ..cloud.codec_policy import Policy, parse_slot_codecs

    mb = 2**20
    limits = Limits(max_message_bytes=int(args.max_message_mb * mb), session_timeout=args.session_timeout,
                    max_sessions=args.max_open_sessions, sessions_per_peer=args.sessions_per_peer,
                    handshake_timeout=args.handshake_timeout, evictable_after=args.evictable_after,
                    max_ops=args.max_ops, max_decoded_bytes=int(args.max_decoded_mb * mb),
                    max_header_bytes=int(args.max_header_kb * 2**10),
                    session_memory_bytes=int(args.session_memory_mb * mb), memory_bytes=int(args.memory_mb * mb),
                    checkpoint_bytes=int(args.checkpoint_max_mb * mb),
                    max_request_flops=int(args.max_request_gflop * 1e9), pin_bytes=int(args.pin_quota_mb * mb),
                    pin_seconds=args.pin_hours * 3600, max_move_bytes=int(args.max_move_mb * mb),
                    train_fraction=args.train_fraction)
    bounds = Bounds(**{name: getattr(args, f"bound_{name}") for name in Bounds.__dataclass_fields__})
    every, per_slot = parse_slot_codecs(args.allow_codecs or [])
    return limits, Policy.allowing(every, per_slot=per_slot, bounds=bounds)


def _stop_on_ctrl_c(server: CloudServer) -> list[bool]:
    """Ctrl-C asks the serve loop to stop between messages (rather than a KeyboardInterrupt raised
    wherever the main thread is, which could leave a lock held and the shutdown waiting on it); a
    second Ctrl-C interrupts at once. Returns a list that holds True once it was pressed."""
    pressed: list[bool] = []

    def on_ctrl_c(signum: int, frame: Any) -> None:
        if pressed:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise KeyboardInterrupt
        pressed.append(True)
        server.stop("the cloud was interrupted (Ctrl-C)")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, on_ctrl_c)
    return pressed


def run_cloud(args: argparse.Namespace) -> int:
    import transports
    from ..cloud import CloudServer, workers
    from ..devices import Placement
    from ..errors import SplitFTError

    if args.metrics_port is not None:
        from ..cloud import prometheus

        if not prometheus.available():  # said once, before any rank starts
            print("cloud: error: --metrics-port needs the prometheus_client package: install the 'metrics' "
                  "extra (pip install 'splitft[metrics]')", file=sys.stderr, flush=True)
            return 2
    if args.workers > 1 and not workers.launched():
        try:
            workers.launch_for(args)
        except SplitFTError as exc:
            print(f"cloud: error: {exc}", file=sys.stderr, flush=True)
            return 1 if isinstance(exc, workers.RanksFailed) else 2
        return 0
    group = None

    def say(text: str) -> None:
        print(f"cloud{workers.tag(group)}: {text}", file=sys.stderr, flush=True)

    try:
        group = workers.join(args)
        _check_open(workers.bind_address(group, args), args, say)
        options = _listener_options(args, say)
        placement = Placement(workers.device(group, args.device), None if args.dtype == "float32" else args.dtype,
                              offload=args.offload_optimizer)
        batch = _batch_split(args, placement, say)
        if batch is not None and batch.rank > 0:
            return _batch_worker(args, batch, placement)
        endpoint = _metrics_endpoint(args, group, say)  # a port in use is refused before the cloud starts
        listener = transports.listen(workers.bind_address(group, args), **options)
        limits, policy = _limits_and_policy(args)
        rounds = _rounds(args, placement)
        from .tasks import get_task

        server_class, limits = workers.server_class(group, CloudServer, listener, args, limits)
        server = server_class(listener, args.model or [get_task(args.task).model], max_sessions=args.sessions,
                             on_event=say,
                             limits=limits, checkpoint_dir=args.checkpoint_dir,
                             checkpoint_every=args.checkpoint_every, fsync=not args.no_fsync,
                             shared_model=args.shared_model, policy=policy, placement=placement, rounds=rounds,
                             shared_policy=_shared_policy(args),
                             **({"make_session": batch.make_session()} if batch is not None else {}))
        if endpoint is not None:
            endpoint.watch(server)
    except (SplitFTError, transports.TransportError) as exc:
        say(f"error: {exc}")
        return 2
    _announce(args, say, listener, server, rounds, batch, placement, len(options.get("allowed_keys", ())))
    if workers.ready(group, say) and args.ready_file:
        Path(args.ready_file).write_text(listener.address)
    interrupted = _stop_on_ctrl_c(server)
    try:
        server.serve()
        if interrupted:
            say("interrupted; connected edges were told")
            return 130
    except KeyboardInterrupt:
        say("interrupted; connected edges were told")
        return 130
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if batch is not None:
            batch.stop()
        if endpoint is not None:
            endpoint.close()
        workers.leave(group)
    return 1 if rounds is not None and rounds.failure else 0


def _metrics_endpoint(args: argparse.Namespace, group: Any, say: Any) -> Any:
    """The Prometheus endpoint ``--metrics-port`` asks for (None without it), on PORT + the local rank."""
    if args.metrics_port is None:
        return None
    from ..cloud.prometheus import Endpoint

    port = args.metrics_port + (group.env.local_rank if group is not None and args.metrics_port else 0)
    endpoint = Endpoint(port, args.metrics_host)
    if is_public(f"tcp://{args.metrics_host}:0"):
        say(f"warning: the metrics at {endpoint.url} are open to any machine that reaches them (--metrics-host)")
    say(f"metrics at {endpoint.url}")
    return endpoint


def _listener_options(args: argparse.Namespace, say: Any) -> dict:
    """The listener's message limit and, with keys, CurveZMQ (both or neither key option)."""
    import transports
    from ..errors import ConfigError

    # ZeroMQ cuts off a peer whose single frame exceeds twice the limit (before buffering it
    # whole); anything smaller is read and, if over the limit, refused with a typed reply.
    options: dict = {"max_message_bytes": 2 * int(args.max_message_mb * 2**20)}
    if args.secret_key or args.allow_edge_keys:
        if not (args.secret_key and args.allow_edge_keys):
            raise ConfigError("an encrypted cloud needs both --secret-key and --allow-edge-keys")
        _, secret = transports.load_secret_key(args.secret_key)
        allowed = transports.load_allowed_keys(args.allow_edge_keys)
        options |= {"secret_key": secret, "allowed_keys": allowed, "on_refused": say}
    return options


def _check_open(address: str, args: argparse.Namespace, say: Any) -> None:
    """Refuse to serve a public address to anyone unless the operator says so (``--allow-any-edge``).

    Whoever can open a connection can make the process buffer what they send before any check
    runs (README: the trust boundary); an allow-list drops a stranger at the handshake.
    """
    from ..errors import ConfigError

    if args.allow_edge_keys or not is_public(address):
        return
    if not args.allow_any_edge:
        raise ConfigError(
            f"{address} is reachable from other machines, and without --allow-edge-keys anyone who reaches it may "
            "connect and make this process buffer what they send. Give --secret-key and --allow-edge-keys (make "
            "keys with `splitft keys`), bind 127.0.0.1, or add --allow-any-edge to serve an open cloud anyway")
    say(f"warning: {address} is open to any edge that reaches it (--allow-any-edge)")


def is_public(address: str) -> bool:
    """Whether a ``tcp://`` bind address may be reached from other machines (ipc:// never is; a
    host that is not an IP address or a name of this machine's loopback counts as public)."""
    import ipaddress
    import socket

    if not address.startswith("tcp://"):
        return False
    host: str = address[len("tcp://"):].split(";")[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("", "*"):
        return True
    try:
        found = {str(info[4][0]) for info in socket.getaddrinfo(host, None)}
    except (OSError, UnicodeError):
        return True  # an interface name, or a name this machine cannot resolve
    return not found or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in found)


def _announce(args: argparse.Namespace, say: Any, listener: Any, server: Any, rounds: Any, batch: Any,
              placement: Any, keys: int) -> None:
    """The line that says what this cloud serves, where, and how."""
    extras = []
    if args.secret_key:
        extras.append(f"CurveZMQ, {keys} edge key(s) allowed")
    if args.checkpoint_dir:
        extras.append(f"checkpoints in {args.checkpoint_dir} every {args.checkpoint_every} step(s)")
    if args.shared_model:
        extras.append("one shared cloud half per model" + (
            f", in rounds of {args.sync_rounds} edge(s) (rank {rounds.rank} of {rounds.world}, all-reduce "
            f"{args.grad_compression}" + (", cut gradients averaged" if args.average_cut_grads else "") + ")"
            if rounds else "") + (f", its learning rate {args.server_lr:g} (--server-lr)"
                                  if args.server_lr is not None else ""))
    if batch is not None:
        extras.append(f"each batch split over {batch.world} rank(s), one edge at a time"
                      + (", the half sharded across them" if batch.mesh is not None else ""))
    extras.append(f"halves on {placement.device}" + (f" in {args.dtype}" if placement.dtype else ""))
    say(f"listening on {listener.address}, serving {', '.join(server.factories)}"
        + (f" ({'; '.join(extras)})" if extras else "")
        + (f"; exits after {args.sessions} session(s)" if args.sessions else "; Ctrl-C to stop"))


def _shared_policy(args: argparse.Namespace) -> Any:
    """What edges of a shared half may set (``--shared-optimizer``, ``--shared-frozen``); None without them."""
    if args.shared_optimizer is None and args.shared_frozen is None and args.server_lr is None:
        return None
    from ..cloud.shared_policy import SharedPolicy

    return SharedPolicy.parse(args.shared_optimizer, args.shared_frozen, args.server_lr)


def _rounds(args: argparse.Namespace, placement: Any) -> Any:
    """Synchronous data-parallel rounds (``--sync-rounds``), on the ranks torchrun's variables describe."""
    if not args.sync_rounds:
        if args.average_cut_grads:
            from ..errors import ConfigError
            raise ConfigError("--average-cut-grads averages the cut gradients of a round: add --sync-rounds N")
        return None
    from ..cloud.allreduce import GradCompression, group_from_env
    from ..cloud.rounds import Rounds, RoundSettings
    from ..errors import ConfigError

    if not args.shared_model:
        raise ConfigError("--sync-rounds trains a shared cloud half: add --shared-model")
    settings = RoundSettings(args.sync_rounds, args.round_timeout, GradCompression.parse(args.grad_compression),
                             average_cut=args.average_cut_grads)
    group_from_env("nccl" if placement.device.type == "cuda" else "gloo")
    return Rounds(settings)


def _batch_split(args: argparse.Namespace, placement: Any, say: Any) -> Any:
    """Each batch split across the ranks torchrun's variables describe (``--split-batch``)."""
    from ..errors import ConfigError

    if args.shard and not args.split_batch:
        raise ConfigError("--shard shards the half that --split-batch splits each batch of: add --split-batch "
                          "(and launch the cloud as N ranks, with torchrun)")
    if not args.split_batch:
        return None
    from datetime import timedelta

    from ..cloud.allreduce import group_from_env
    from ..cloud.batch_split import BatchSplit

    if args.shared_model or args.sync_rounds or args.checkpoint_dir:
        raise ConfigError("--split-batch splits one edge's batches across ranks; it does not combine with "
                          "--shared-model, --sync-rounds or --checkpoint-dir")
    # The other ranks wait for rank 0's next command as long as the cloud is idle.
    group_from_env("nccl" if placement.device.type == "cuda" else "gloo", timeout=timedelta(days=30))
    args.max_open_sessions = 1
    return BatchSplit(shard=args.shard, device=placement.device, report=say)


def _batch_worker(args: argparse.Namespace, batch: Any, placement: Any) -> int:
    """A rank >= 1 of a --split-batch cloud: replicas of rank 0's session, until rank 0 stops."""
    from ..factories import load_factory
    from .tasks import get_task

    factories = {name: load_factory(name) for name in args.model or [get_task(args.task).model]}
    limits, _ = _limits_and_policy(args)
    def say(text: str) -> None:
        print(f"cloud: {text}", file=sys.stderr, flush=True)

    say(f"rank {batch.rank} of {batch.world}: computes its rows of rank 0's batches"
        + (", holding a shard of the half" if batch.mesh is not None else ""))
    batch.report = say
    batch.serve_worker(factories, limits, placement)
    return 0


__all__ = ["DEFAULT_BIND", "DEFAULT_MODEL", "add_cloud_parser", "run_cloud", "task_names"]
