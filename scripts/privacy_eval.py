"""How much does what crosses the cut give away? Accuracy and bytes beside attacks, per codec and defence.

Trains the digits CNN split U-shape between this process and a real ``splitft cloud`` process on
loopback, for every setting (a codec, plus leak loss, DP noise on activations or on label
gradients, randomized response), several seeds each. Then it attacks what the cloud received:
distance correlation, a model-inversion decoder trained on held-back images (MSE, SSIM), and
the label-leak direction attack on the returned gradients; the epsilon spent comes from the
accountant. Writes privacy.csv, privacy.md and privacy.png into --out (see docs/privacy.md).

    python scripts/privacy_eval.py --out docs/privacy --seeds 3 --epochs 10
    python scripts/privacy_eval.py --settings identity,bsl,dp-eps3 --seeds 1 --epochs 2 --inproc
    python scripts/privacy_eval.py --frontier --out docs/privacy/frontier --seeds 3 --epochs 10
    python scripts/privacy_eval.py --tokens --train --out docs/privacy --seeds 2

``--frontier`` runs the defences against inversion with the stronger attacks too (a learned
decoder, the class-mean attack) and draws frontier.png: accuracy against the strongest attack.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # edge and cloud share this machine's cores

import argparse  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the grid (settings x seeds), then write the CSV, the markdown table and the plot."""
    from splitft.privacy.evaluate import FRONTIER, PRESETS
    from splitft.privacy.report import INVERSION_STEPS, run_grid, token_table
    from splitft.privacy.text import TEXT_SETTINGS, text_table

    parser = argparse.ArgumentParser(
        prog="privacy_eval.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Digits split U-shape between two processes, per codec and defence: accuracy, bytes, distance "
                    "correlation, inversion MSE/SSIM, label leakage and the epsilon spent.",
        epilog="presets: " + ", ".join(PRESETS) + "\n\nexample:\n  python scripts/privacy_eval.py --out docs/privacy "
               "--seeds 3 --epochs 10\n  python scripts/privacy_eval.py --settings identity,bsl,dp-eps3 --seeds 1 "
               "--epochs 2 --inproc")
    parser.add_argument("--out", default="privacy", help="folder for privacy.csv, privacy.md and privacy.png "
                                                         "(default: privacy)")
    parser.add_argument("--settings", default=None,
                        help="comma-separated presets or codec specs (a codec spec is a row with no defence; default: "
                             "every preset of the table)")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per setting (default: 3)")
    parser.add_argument("--epochs", type=int, default=None,
                        help="training epochs per run (default: 10; 1 with --tokens --train)")
    parser.add_argument("--inversion-steps", type=int, default=INVERSION_STEPS,
                        help=f"decoder training steps (default: {INVERSION_STEPS})")
    parser.add_argument("--strong-steps", type=int, default=None,
                        help="training steps of the stronger attacks (learned decoder, class-mean); 0: off "
                             "(default: 0, or 1500 with --frontier)")
    parser.add_argument("--frontier", action="store_true",
                        help="the frontier settings (" + ", ".join(FRONTIER) + ") with the stronger attacks, "
                             "unless --settings names others; draws frontier.png")
    parser.add_argument("--inproc", action="store_true", help="run the cloud on a thread of this process")
    parser.add_argument("--summary-only", action="store_true", help="rebuild the table and plot from the CSV")
    parser.add_argument("--tokens", action="store_true",
                        help="only measure token recovery from MiniLM's hidden states at the BBC cut (needs the nlp "
                             "extra); writes tokens.md")
    parser.add_argument("--train", action="store_true",
                        help="with --tokens: fine-tune the BBC classifier split U-shape per defence (--settings: "
                             "identity, noise-S, layerK, layerK-noise-S; default: " + ", ".join(TEXT_SETTINGS) +
                             "), and write its test accuracy and token recovery from the pre-trained and the "
                             "fine-tuned edge to tokens_trained.csv and tokens_trained.md (~3 min per run on 2 cores)")
    parser.add_argument("--limit", type=int, default=None,
                        help="with --tokens --train: train on this many BBC articles (default: all 1781)")
    args = parser.parse_args(argv)
    if args.train and not args.tokens:
        parser.error("--train goes with --tokens (the digits grid always trains)")
    if args.tokens:
        command = "python scripts/privacy_eval.py " + " ".join(sys.argv[1:] if argv is None else argv)
        if args.train:
            names = [n.strip() for n in (args.settings or ",".join(TEXT_SETTINGS)).split(",") if n.strip()]
            print(text_table(Path(args.out), names, seeds=args.seeds, epochs=args.epochs or 1, command=command,
                             progress=_stderr, limit=args.limit), end="")
        else:
            print(token_table(Path(args.out), command), end="")
        return 0
    args.epochs = args.epochs or 10
    chosen = args.settings if args.settings is not None else ",".join(FRONTIER if args.frontier else PRESETS)
    names = [n.strip() for n in chosen.split(",") if n.strip()]
    strong = args.strong_steps if args.strong_steps is not None else (1500 if args.frontier else 0)
    print(run_grid(Path(args.out), names, seeds=args.seeds, epochs=args.epochs, inversion_steps=args.inversion_steps,
                   strong_steps=strong, inproc=args.inproc, summary_only=args.summary_only, progress=_stderr))
    return 0


if __name__ == "__main__":
    sys.exit(main())
