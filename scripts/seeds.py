"""The seed papers' claims on ground close to their own, where the other benchmarks do not reach.

C3-SL reports 16x batch compression at a negligible accuracy drop on CIFAR-class CNNs whose cloud
half is deep. The digits CNN's cloud half is one convolution and a linear head (docs/ablation.md:
0.78 at r=16 after 5 epochs). This trains the digits task split after the same two edge blocks
but with a four-convolution cloud half (``splitft.app.models:digits_deep``), through identity and
C3-SL at several r, each for several seeds, with the cloud in this process, and prints test
accuracy and bytes per run and a markdown table (docs/seeds.md: the deeper half does not rescue
r=16, whose loss comes from 16 samples sharing 2048 values).

    python scripts/seeds.py                                   # identity, c3sl:r=4,8,16; 3 seeds, 15 epochs
    python scripts/seeds.py c3sl:r=16 --model cnn             # the same on digits_cnn's one-conv cloud half
    python scripts/seeds.py c3sl:r=16 --seeds 1 --epochs 2    # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

DEFAULT_RUNS = ["identity", "c3sl:r=4", "c3sl:r=8", "c3sl:r=16"]
MODELS = {"deep": "splitft.app.models:digits_deep", "cnn": "splitft.app.models:digits_cnn"}


def run_one(fwd: str, seed: int, epochs: int, model: str = "deep"):
    """The digits task through ``fwd`` (and its gradient partner) on the deep (or the usual) cloud half."""
    import transports
    from splitft.app.runner import TaskRun, run
    from splitft.cloud import CloudServer, serve_in_thread
    from splitft.options import Codecs, Factory, Faults, Link

    factory = Factory(MODELS[model], kwargs={"seed": seed}, weights="factory")
    task_run = TaskRun(task="digits", factory=factory, epochs=epochs, seed=seed, codecs=Codecs(fwd, seed=seed),
                       faults=Faults(timeout=120))
    listener = transports.InprocListener()
    server = CloudServer(listener, [factory.name])
    thread = serve_in_thread(server)
    try:
        return run(task_run, Link(listener.connect()))
    finally:
        server.stop()
        thread.join(timeout=10)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="*", default=None, help=f"forward codecs (default: {' '.join(DEFAULT_RUNS)})")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per run (default: 3)")
    parser.add_argument("--epochs", type=int, default=15, help="epochs per run (default: 15, the task's)")
    parser.add_argument("--model", choices=sorted(MODELS), default="deep",
                        help="cloud half: deep (four convolutions, default) or cnn (digits_cnn's one)")
    args = parser.parse_args(argv)
    rows = []
    start = time.perf_counter()
    for fwd in args.runs or DEFAULT_RUNS:
        results = []
        for seed in range(args.seeds):
            result = run_one(fwd, seed, args.epochs, args.model)
            results.append(result)
            print(f"{fwd} seed {seed}: test accuracy {result.accuracy:.4f}, fwd {result.fwd_ratio:.1f}x, "
                  f"bwd {result.bwd_ratio:.1f}x, {result.seconds:.0f} s", flush=True)
        acc = [r.accuracy for r in results]
        spread = f" ± {statistics.stdev(acc):.4f}" if len(acc) > 1 else ""
        rows.append(f"| {args.model} | `{fwd}` | `{results[0].bwd}` | {len(acc)} | {statistics.mean(acc):.4f}{spread} | "
                    f"{statistics.mean(r.fwd_ratio for r in results):.1f}x | "
                    f"{statistics.mean(r.bwd_ratio for r in results):.1f}x |")
    print(f"\n{len(rows)} runs in {time.perf_counter() - start:.0f} s\n")
    print(f"| cloud half | codec | gradient codec | seeds | test accuracy after {args.epochs} epochs | fwd ratio | bwd ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
