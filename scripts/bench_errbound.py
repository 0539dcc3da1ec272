"""What an error bound buys against a bit width: bytes ratio and largest error per codec, on a
MiniLM-sized cut activation (32 x 128 x 384) as it is, with scattered outliers (0.1% of elements
x100), and with outlier channels (4 of 384 channels x50, as transformer activations have).

    python scripts/bench_errbound.py
"""

from __future__ import annotations

import torch

from compressors import CodecContext, make_codec

SPECS = ["fixpoint:bits=8", "fixpoint:bits=4", "errbound:abs=0.01", "errbound:abs=0.05", "errbound:rel=0.01"]


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 128, 384, generator=g)
    scattered = torch.where(torch.rand(x.shape, generator=g) < 0.001, x * 100, x)
    channels = x.clone()
    channels[..., :4] *= 50
    return {"gaussian": x, "scattered outliers": scattered, "outlier channels": channels}


def main() -> None:
    ctx = CodecContext()
    print(f"| tensor | codec | ratio | max error | bound |\n|---|---|---|---|---|")
    for name, x in tensors().items():
        for spec in SPECS:
            codec = make_codec(spec)
            payload = codec.encode(x, ctx)
            err = (codec.decode(payload, ctx) - x).abs().max().item()
            bound = f"{codec.bound(x):.3g}" if spec.startswith("errbound") else "-"
            print(f"| {name} | {spec} | {x.nbytes / payload.nbytes:.1f}x | {err:.3g} | {bound} |")


if __name__ == "__main__":
    main()
