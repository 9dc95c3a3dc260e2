"""The emulated GEMM of a linear step three ways: cuBLAS with a BF16 output (the floor, but it
cannot apply alpha before rounding), cuBLAS with an FP32 output plus the epilogue kernel (what
the emulated backend runs), and the fused Triton GEMM of kernels/gemm.py over a few tile
configs. Same operands and layouts as the step's output, grad_input and grad_weight GEMMs.

    python benchmarks/bench_gemm.py --json results/bench_gemm_h100.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import harness  # noqa: E402

from blockscale import kernels  # noqa: E402
from blockscale.gemm import emulated  # noqa: E402
from blockscale.kernels.gemm import gemm_fused  # noqa: E402

CONFIGS = [
    (128, 256, 64, 8, 8, 3),
    (128, 256, 64, 8, 8, 4),
    (256, 128, 64, 8, 8, 3),
    (128, 128, 64, 8, 4, 4),
]
STEP_SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336)]


def gemms(m: int, k: int, n: int, device) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, a [rows, contraction], b [cols, contraction] view) for the step's three GEMMs."""
    bf = torch.bfloat16
    x = torch.randn(m, k, device=device, dtype=bf)
    w = torch.randn(n, k, device=device, dtype=bf)
    go = torch.randn(m, n, device=device, dtype=bf)
    x_t = torch.randn(k, m, device=device, dtype=bf)
    go_t = torch.randn(n, m, device=device, dtype=bf)
    return [
        (f"output {m}x{k}x{n}", x, w),
        (f"grad_input {m}x{n}x{k}", go, w.t()),
        (f"grad_weight {n}x{m}x{k}", go_t, x_t),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--shapes", nargs="+", default=None, help="step shapes M,K,N")
    args = parser.parse_args(argv)
    shapes = STEP_SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    device = harness.pick_device(args.device)
    if device.type != "cuda":
        print("bench_gemm needs a CUDA device")
        return 1
    reps, warmup = args.reps or 20, args.warmup or 3
    info = harness.banner(device)
    amax = torch.tensor([3.0, 5.0], device=device)
    rows: list[dict[str, Any]] = []
    for m, k, n in shapes:
        for name, a, b in gemms(m, k, n, device):
            flops = 2 * a.shape[0] * b.shape[0] * a.shape[1]

            def current(a=a, b=b):
                acc = emulated.mm_fp32_accumulate(a, b)
                return kernels.gemm_epilogue(acc, amax)

            variants = {
                "cuBLAS BF16 out (no alpha)": lambda a=a, b=b: a @ b.t(),
                "cuBLAS FP32 out + epilogue": current,
            }
            for cfg in CONFIGS:
                variants[f"fused {cfg}"] = lambda a=a, b=b, cfg=cfg: gemm_fused(
                    a, b, amax, config=cfg
                )
            want = current().float()
            base = None
            for label, fn in variants.items():
                try:
                    got = fn().float()
                    t = harness.time_fn(fn, warmup=warmup, reps=reps, device=device).median_ms
                except Exception as e:  # a config that does not fit shared memory
                    print(f"  {name} {label}: {type(e).__name__}: {str(e)[:120]}")
                    continue
                base = t if label.startswith("cuBLAS FP32") else base
                rel = ((got - want).abs().max() / want.abs().max()).item()
                rows.append(dict(gemm=name, variant=label, us=1e3 * t,
                                 tflops=flops / (t * 1e-3) / 1e12, max_rel_diff=rel))  # fmt: skip
                print(f"  {name} {label}: {1e3 * t:.1f} us", flush=True)
            for r in rows:
                if r["gemm"] == name and base:
                    r["vs_current"] = 1e3 * base / r["us"]
    harness.print_table(rows, ["gemm", "variant", "us", "tflops", "vs_current", "max_rel_diff"])
    if args.json:
        harness.write_json(args.json, {"benchmark": "gemm", "banner": info, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
