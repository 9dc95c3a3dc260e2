"""Quantize a normal and an outlier-heavy tensor with every format and print the error table.

    python -m blockscale.demo

SQNR (signal to quantization noise, dB) = 10 log10(sum x^2 / sum (x - dq(q(x)))^2); higher is
better. "zeros" is the fraction of nonzero inputs that quantize to zero.
"""

import torch

from blockscale.formats import mxfp8, nvfp4


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    noise = (x.double() - y.double()).pow(2).sum()
    return float(10 * torch.log10(x.double().pow(2).sum() / noise))


def quantizers():
    yield "nvfp4 1x16", lambda x: nvfp4.quantize(x)
    yield "nvfp4 1x16 stochastic", lambda x: nvfp4.quantize(x, rounding="stochastic")
    yield "nvfp4 16x16", lambda x: nvfp4.quantize(x, block="16x16")
    yield "mxfp8 1x32", lambda x: mxfp8.quantize(x)


def tensors(rows: int = 512, cols: int = 1024, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, cols, generator=g)
    yield "normal", normal
    outliers = normal.clone()
    picks = torch.randint(0, outliers.numel(), (outliers.numel() // 1000,), generator=g)
    outliers.view(-1)[picks] *= 100.0  # 0.1% of values 100x larger, as in LLM activations
    yield "outliers (0.1% x100)", outliers


def main() -> None:
    torch.manual_seed(0)
    print(f"{'tensor':<22} {'format':<24} {'SQNR dB':>8} {'zeros':>7}")
    for name, x in tensors():
        for fmt, quantize in quantizers():
            dq = quantize(x).dequantize()
            zeros = float(((dq == 0) & (x != 0)).float().mean())
            print(f"{name:<22} {fmt:<24} {sqnr_db(x, dq):8.2f} {zeros:7.2%}")


if __name__ == "__main__":
    main()
