"""What the two example scripts share: options, data, evaluation and, for the split one, a cloud.

``finetune_local.py`` and ``finetune_split.py`` differ only in the lines that hand the model to
splitft; everything else they need is here, so their diff shows exactly what splitft asks of a
training script.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib

import torch
from torch.utils.data import DataLoader, TensorDataset

FACTORY = "splitft.app.tasks.bbc:minilm_classifier"  # how the cloud builds the same model


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="Fine-tune all-MiniLM-L6-v2 on BBC News (5 topics).")
    parser.add_argument("--epochs", type=int, default=1, help="passes over the 1781 training articles (default: 1)")
    parser.add_argument("--batch-size", type=int, default=32, help="articles per step (default: 32)")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: 3e-4)")
    parser.add_argument("--max-length", type=int, default=128, help="tokens kept per article (default: 128)")
    parser.add_argument("--limit", type=int, default=None, help="train on the first N articles only (a quick run)")
    parser.add_argument("--seed", type=int, default=0, help="data order and head initialisation (default: 0)")
    split = parser.add_argument_group("finetune_split.py only")
    split.add_argument("--connect", default=None, metavar="ADDRESS",
                       help="a running cloud ('splitft cloud --task bbc' serves this model); by default a "
                            "cloud process is started on 127.0.0.1 for this run")
    split.add_argument("--fwd", default="identity", metavar="SPEC",
                       help="codec for what crosses the cut, e.g. 'lowrank:rank=1' (default: identity)")
    return parser.parse_args()


def datasets(args: argparse.Namespace) -> tuple[TensorDataset, TensorDataset]:
    """Tokenised (input_ids, attention_mask, label) train and test sets; a fixed, seeded split."""
    from splitft.app.data import first
    from splitft.app.tasks.bbc import load_bbc

    train, test = load_bbc(max_length=args.max_length)
    if args.limit:
        train = first(train, args.limit)
    return tuple(TensorDataset(s.x["input_ids"], s.x["attention_mask"], s.y) for s in (train, test))


@torch.no_grad()
def evaluate(model: torch.nn.Module, test: TensorDataset, batch_size: int) -> float:
    """Share of the test articles whose predicted topic is right."""
    model.eval()
    correct = 0
    for input_ids, attention_mask, labels in DataLoader(test, batch_size):
        correct += int((model(input_ids, attention_mask).argmax(dim=1) == labels).sum())
    return correct / len(test)


_clouds = contextlib.ExitStack()
atexit.register(_clouds.close)


def cloud(args: argparse.Namespace) -> str:
    """The cloud's address: ``--connect``, or a cloud process started here for this run."""
    if args.connect:
        return args.connect
    from splitft.app.launch import local_cloud

    return _clouds.enter_context(local_cloud([FACTORY]))
