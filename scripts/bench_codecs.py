"""Codec cost: encode + decode time per codec, as a share of the model's training step.

Two cut sizes: the digits CNN's (64x32x8x8, step = that CNN's local training step) and a
MiniLM-sized one (32x128x384, step = a 6-layer, 384-wide transformer encoder's training step at
batch 32 and length 128, built from torch.nn so no download is needed). Each codec runs
encode -> decode -> decode_adjoint -> encode_adjoint (the full per-step path on both ends, one
direction's codec plus its default gradient codec). Medians over repeats; one torch thread.

    python scripts/bench_codecs.py
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from torch import nn

import compressors
from compressors import CodecContext
from splitft.wire.coding import resolve_codecs
from splitft.app.models import digits_cnn

SPECS = ["identity", "fp16", "fixpoint:bits=8", "fixpoint:bits=4", "lowrank:rank=1", "lowrank:rank=4",
         "c3sl:r=4", "c3sl:r=16", "binary", "acsgd:bits=4", "acsgd:bits=2"]


def median_time(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def digits_step(repeats: int) -> float:
    model = digits_cnn()
    opt = torch.optim.Adam(model.parameters(), 1e-3)
    x, y = torch.randn(64, 1, 8, 8), torch.randint(0, 10, (64,))

    def step() -> None:
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return median_time(step, repeats)


def minilm_sized_step(repeats: int) -> float:
    layer = nn.TransformerEncoderLayer(384, 12, 1536, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 6, enable_nested_tensor=False)
    opt = torch.optim.AdamW(model.parameters(), 1e-4)
    x = torch.randn(32, 128, 384)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return median_time(step, repeats)


def codec_round(spec: str, shape: tuple[int, ...], repeats: int) -> float:
    specs = resolve_codecs(spec)
    fwd_send, fwd_recv = (compressors.make_codec(specs["fwd"], seed=1) for _ in range(2))
    bwd_send, bwd_recv = (compressors.make_codec(specs["bwd"], seed=2) for _ in range(2))
    ids = np.arange(shape[0], dtype=np.int64)
    x = torch.randn(shape)
    if spec.startswith("binary"):
        x = torch.where(x >= 0, 1.0, -1.0)
    g = torch.randn(shape)
    act = CodecContext("activation", sample_ids=ids)
    grad = CodecContext("gradient", sample_ids=ids)
    first = fwd_send.encode(x, act)  # fills per-sample state (AC-SGD warm-up) before timing
    fwd_recv.decode(first, act)

    def path() -> None:
        payload = fwd_send.encode(x, act)
        fwd_recv.decode(payload, act)
        small = fwd_recv.decode_adjoint(g, payload, grad)
        back = bwd_send.encode(small, grad)
        fwd_send.encode_adjoint(bwd_recv.decode(back, grad), payload, grad)
    return median_time(path, repeats)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = {"digits 64x32x8x8": ((64, 32, 8, 8), digits_step(args.repeats * 4)),
             "MiniLM 32x128x384": ((32, 128, 384), minilm_sized_step(max(3, args.repeats // 5)))}
    for label, (_, step) in cases.items():
        print(f"{label}: model step {step * 1e3:.2f} ms")
    print(f"\n{'codec':18s}" + "".join(f"{label:>28s}" for label in cases))
    for spec in SPECS:
        row = f"{spec:18s}"
        for shape, step in cases.values():
            seconds = codec_round(spec, shape, args.repeats)
            row += f"{seconds * 1e3:12.2f} ms {100 * seconds / step:8.1f}%  "
        print(row, flush=True)


if __name__ == "__main__":
    main()
