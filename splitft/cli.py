"""Command line: ``splitft demo``, ``splitft cloud``, ``splitft edge``, ``splitft codecs``."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

DEFAULT_MODEL = "splitft.models:digits_cnn"
DEFAULT_BIND = "tcp://127.0.0.1:5555"


def _add_training_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--task", choices=sorted(_task_names()), default="digits",
                   help="digits: scikit-learn's 8x8 images, a small CNN; bbc: BBC News articles, pre-trained "
                        "MiniLM (needs the 'nlp' extra) (default: digits)")
    g.add_argument("--epochs", type=int, default=None, help="passes over the training data (default: digits 15, bbc 1)")
    g.add_argument("--batch-size", type=int, default=None, help="samples per step (default: digits 64, bbc 32)")
    g.add_argument("--lr", type=float, default=None,
                   help="learning rate (Adam for digits, AdamW for bbc), mirrored to the cloud "
                        "(default: digits 1e-3, bbc 3e-4)")
    g.add_argument("--seed", type=int, default=0, help="seed for data order and codec randomness (default: 0)")
    g.add_argument("--limit", type=int, default=None, metavar="N", help="train on the first N training samples only")
    g.add_argument("--max-length", type=int, default=None,
                   help="bbc only: tokens per article, longer ones are truncated (default: 128)")
    g = p.add_argument_group("the cut")
    g.add_argument("--model", default=None,
                   help="model factory 'package.module:function' both sides build (default: the task's, "
                        f"{DEFAULT_MODEL} for digits)")
    g.add_argument("--cut", default=None,
                   help="first module that runs in the cloud, or a slice 'parent.i:j' of a container "
                        "(default: digits block3, bbc bert.encoder.layer.2:6)")
    g.add_argument("--topology", choices=("plain", "ushape"), default=None,
                   help="plain: the cloud computes the loss and sees labels; ushape: the head, loss and "
                        "labels stay on the edge (default: digits plain, bbc ushape)")
    g.add_argument("--rejoin", default=None,
                   help="ushape with a cut that is not a slice: where the edge takes over again (default: digits head)")
    g.add_argument("--freeze-edge", action="store_true",
                   help="train no edge module before the cut, so no gradient crosses back from the cloud "
                        "(SFT's eliminated link); a U-shape head still trains")
    g = p.add_argument_group("traffic")
    g.add_argument("--fwd", default="identity", metavar="SPEC",
                   help="codec for activations, e.g. 'fp16' or 'lowrank:rank=4' (default: identity); run "
                        "'splitft codecs' for the list")
    g.add_argument("--bwd", default=None, metavar="SPEC",
                   help="codec for gradients (default: the forward codec's usual partner)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any cloud reply (default: 60)")
    g.add_argument("--metrics", default=None, metavar="PATH", help="append one JSON record per step to PATH")


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

    cloud = sub.add_parser("cloud", help="serve cloud halves of models to edges",
                           description="Serve the cloud half of the allowed models. Each edge that connects "
                                       "gets its own session (weights, optimizer, codec state).")
    cloud.add_argument("--bind", default=DEFAULT_BIND,
                       help=f"address to listen on: tcp://HOST:PORT (port 0 picks one) or ipc://PATH (default: {DEFAULT_BIND})")
    cloud.add_argument("--model", action="append", default=None, metavar="FACTORY",
                       help="a model factory edges may ask for; repeat for several (default: the task's model)")
    cloud.add_argument("--task", choices=sorted(_task_names()), default="digits",
                       help=f"serve this task's model when no --model is given (default: digits, {DEFAULT_MODEL})")
    cloud.add_argument("--sessions", type=int, default=1,
                       help="exit after this many edge sessions have ended; 0 serves until Ctrl-C (default: 1)")
    cloud.add_argument("--max-message-mb", type=float, default=1024.0,
                       help="drop peers that send a bigger message (default: 1024)")
    cloud.add_argument("--ready-file", default=None, help=argparse.SUPPRESS)

    edge = sub.add_parser("edge", help="train the edge half against a running cloud",
                          description="Connect to a cloud started with 'splitft cloud' and train a task "
                                      "(the cloud must serve its model: 'splitft cloud --task bbc').")
    edge.add_argument("--connect", default=DEFAULT_BIND, help=f"the cloud's address (default: {DEFAULT_BIND})")
    _add_training_options(edge)

    sub.add_parser("codecs", help="list the available codecs and their options")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "codecs":
        return _codecs()
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


def _cloud(args: argparse.Namespace) -> int:
    import transports
    from .cloud import CloudServer
    from .errors import SplitFTError

    def say(text: str) -> None:
        print(f"cloud: {text}", file=sys.stderr, flush=True)

    try:
        listener = transports.listen(args.bind, max_message_bytes=int(args.max_message_mb * 2**20))
        from .tasks import get_task

        server = CloudServer(listener, args.model or [get_task(args.task).model], max_sessions=args.sessions,
                             on_event=say)
    except (SplitFTError, transports.TransportError) as exc:
        say(f"error: {exc}")
        return 2
    say(f"listening on {listener.address}, serving {', '.join(server.factories)}"
        + (f"; exits after {args.sessions} session(s)" if args.sessions else "; Ctrl-C to stop"))
    if args.ready_file:
        Path(args.ready_file).write_text(listener.address)
    try:
        server.serve()
    except KeyboardInterrupt:
        say("interrupted; connected edges were told")
        return 130
    return 0


def _edge(args: argparse.Namespace, address: str) -> int:
    import torch
    from torch import nn

    from .cloud import load_factory
    from .data import first
    from .edge import split
    from .errors import PeerGone, SplitFTError
    from .metrics import format_report
    from .tasks import get_task
    from .train import fit

    task = get_task(args.task)
    factory = args.model or task.model
    cut = args.cut or task.cut
    topology = args.topology or task.topology
    ushape = topology == "ushape"
    rejoin = (args.rejoin or task.rejoin) if ushape and ":" not in cut else None
    epochs = args.epochs if args.epochs is not None else task.epochs
    batch_size = args.batch_size or task.batch_size
    torch.manual_seed(args.seed)
    try:
        train, test = task.load(max_length=args.max_length)
        if args.limit:
            train = first(train, args.limit)
        model = load_factory(factory)()
        model = split(model, cut, rejoin, factory=factory, connect=address, fwd=args.fwd, bwd=args.bwd,
                      seed=args.seed, timeout=args.timeout, metrics_path=args.metrics, freeze_edge=args.freeze_edge,
                      weights=task.weights if factory == task.model else "push")
    except SplitFTError as exc:
        print(f"edge: cannot start: {exc}", file=sys.stderr)
        return 2
    print(f"edge: connected to {address} (session {model.session.session_id}); {task.name}: {topology} split at "
          f"{cut}{' rejoin ' + rejoin if rejoin else ''}, codecs {model.session.codecs.specs['fwd']} / "
          f"{model.session.codecs.specs['bwd']}{', edge frozen' if args.freeze_edge else ''}", file=sys.stderr)
    optimizer_class = getattr(torch.optim, task.optimizer)
    optimizer = model.attach(optimizer_class(model.parameters(), lr=args.lr or task.lr))
    criterion = nn.CrossEntropyLoss() if ushape else model.remote_loss(nn.CrossEntropyLoss())
    start = time.perf_counter()
    try:
        with model:
            result = fit(model, optimizer, criterion, train, test, epochs=epochs, batch_size=batch_size,
                         seed=args.seed, predict=model.predict, progress=True, pass_ids=True)
    except KeyboardInterrupt:
        print("\nedge: interrupted; the cloud was told and ended the session", file=sys.stderr)
        return 130
    except PeerGone as exc:
        print(f"\nedge: {exc}", file=sys.stderr)
        return 1
    except SplitFTError as exc:
        print(f"\nedge: error: {exc}", file=sys.stderr)
        return 1
    wall = time.perf_counter() - start
    print(f"\ntest accuracy {result.accuracy:.4f} after {epochs} epochs ({result.steps} steps)")
    print(format_report(model.metrics, wall))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from .launch import CloudStartError, local_cloud
    from .tasks import get_task

    try:
        with local_cloud([args.model or get_task(args.task).model]) as address:
            return _edge(args, address)
    except CloudStartError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
