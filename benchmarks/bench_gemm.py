"""The emulated GEMM of a linear step three ways, in the operand layouts the step has:

- cuBLAS with a BF16 output: the floor (it cannot apply alpha before rounding, so it is not
  exact for NVFP4; shown for reference);
- cuBLAS with an FP32 output, then the epilogue kernel: what the emulated backend ran before
  kernels/gemm.py;
- the fused persistent TMA kernel of kernels/gemm.py over a few tile configs.

For each of the step's three GEMMs (output, grad_input with the transposed 16x16 weight,
grad_weight) at each step shape it prints time, TFLOP/s, the speed against cuBLAS + epilogue
("vs cublas_ep", > 1 is faster) and the largest difference from it relative to the output's
largest value (the two differ only in the order of FP32 additions).

    python benchmarks/bench_gemm.py --json results/bench_gemm_h100.json
    python benchmarks/bench_gemm.py --shapes 16384,4096,4096 --configs 128,256,64,8,8,3,1,0

On the GPU, "cublas_bf16_exact" is cuBLAS with a BF16 output and its split-K partial sums reduced in
FP32 (gemm/dispatch.py, CUBLAS_BF16_OUT): exact for MXFP8, which has no alpha (this benchmark's
reference applies an NVFP4 alpha, so its difference column is that alpha's).

`--fp32-grad-weight` times grad_weight again with an FP32 output, as FP32 master weights get it
(ops/linear.py), and `--fp32-grad-input` grad_input, as a layer with an FP32 input gets it:
cuBLAS's FP32 product scaled in place ("cublas_ep") against the fused kernel at
`--fp32-configs` (default: kernels.gemm's two FP32 configs and a few others).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import harness  # noqa: E402

from blockscale import kernels  # noqa: E402
from blockscale.gemm import dispatch, emulated  # noqa: E402
from blockscale.kernels.gemm import (  # noqa: E402
    DEFAULT_CONFIG,
    FP32_OUT_CONFIG,
    gemm_fused,
)

# (BM, BN, BK, GROUP_M, num_warps, num_stages, flatten, warp_specialize)
CONFIGS = [
    DEFAULT_CONFIG,
    (128, 256, 64, 8, 8, 4, 1, 0),
    (128, 256, 64, 8, 8, 3, 0, 0),
    (128, 128, 64, 8, 4, 4, 1, 0),
    (128, 128, 64, 8, 8, 4, 1, 0),
    (256, 128, 64, 8, 8, 3, 1, 0),
    (128, 256, 64, 8, 8, 3, 0, 1),
    (128, 128, 64, 8, 4, 4, 0, 1),
]
FP32_CONFIGS = [
    FP32_OUT_CONFIG,
    (128, 128, 64, 8, 8, 4, 1, 0),  # eight warps (the contraction-512 choice until 2026-12-02)
    (128, 128, 64, 8, 8, 3, 1, 0),
    (64, 256, 64, 8, 4, 3, 1, 0),
    (128, 128, 64, 8, 8, 4, 0, 0),
    (128, 128, 64, 8, 8, 3, 0, 1),
]
SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)]
QUICK_SHAPES = [(256, 128, 256)]
QUICK_CONFIGS = [(64, 64, 32, 4, 4, 2, 1, 0)]


def gemms(
    m: int,
    k: int,
    n: int,
    device: torch.device,
    fp32_grad_weight: bool = False,
    fp32_grad_input: bool = False,
) -> list[tuple[str, Any, Any]]:
    """(name, a [rows, contraction], b [cols, contraction] view) for the step's three GEMMs,
    laid out as the emulated backend gets them (and grad_weight or grad_input again,
    "grad_weight_fp32" / "grad_input_fp32", for an FP32 output)."""
    bf = torch.bfloat16 if device.type == "cuda" else torch.float32
    x = torch.randn(m, k, device=device, dtype=bf)
    w = torch.randn(n, k, device=device, dtype=bf)
    go = torch.randn(m, n, device=device, dtype=bf)
    x_t = torch.randn(k, m, device=device, dtype=bf)
    go_t = torch.randn(n, m, device=device, dtype=bf)
    rows = [
        (f"output {m}x{k}x{n}", x, w),
        (f"grad_input {m}x{n}x{k}", go, w.t()),
        (f"grad_weight {n}x{m}x{k}", go_t, x_t),
    ]
    if fp32_grad_input:
        rows.append((f"grad_input_fp32 {m}x{n}x{k}", go, w.t()))
    if fp32_grad_weight:
        rows.append((f"grad_weight_fp32 {n}x{m}x{k}", go_t, x_t))
    return rows


def cublas_bf16(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[0], dtype=torch.bfloat16, device=a.device)
    assert dispatch._cublas_bf16(a, b, out)
    return out


def parse_configs(
    values: list[str] | None, quick: bool, default: list[tuple[int, ...]] = CONFIGS
) -> list[tuple[int, ...]]:
    if not values:
        return QUICK_CONFIGS if quick else default
    return [tuple(int(v) for v in s.split(",")) for s in values]


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--shapes", nargs="+", default=None, help="step shapes M,K,N")
    parser.add_argument("--configs", nargs="+", default=None, help="8 ints each (see CONFIGS)")
    parser.add_argument(
        "--fp32-grad-weight",
        action="store_true",
        help="also grad_weight with an FP32 output (FP32 master weights)",
    )
    parser.add_argument(
        "--fp32-grad-input",
        action="store_true",
        help="also grad_input with an FP32 output (a layer whose input is FP32: under autocast, "
        "the residual stream's RMSNorm output)",
    )
    parser.add_argument(
        "--device-time",
        action="store_true",
        help="time each call on the device alone, with a spin kernel queued first so no launch "
        "waits for the host (harness.time_host_and_device): small GEMMs are otherwise timed "
        "with the host's launch overhead in them",
    )
    parser.add_argument("--fp32-configs", nargs="+", default=None,
                        help="8 ints each, for the FP32 rows (default FP32_CONFIGS)")  # fmt: skip
    args = parser.parse_args(argv)
    device = harness.pick_device(args.device)
    shapes = QUICK_SHAPES if args.quick else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    configs = parse_configs(args.configs, args.quick)
    fp32_configs = parse_configs(args.fp32_configs, args.quick, FP32_CONFIGS)
    reps = args.reps or (3 if args.quick else 20)
    warmup = args.warmup or (1 if args.quick else 3)
    info = harness.banner(device)
    amax = (torch.tensor(3.0, device=device), torch.tensor(5.0, device=device))
    rows: list[dict[str, Any]] = []
    for m, k, n in shapes:
        for name, a, b in gemms(m, k, n, device, args.fp32_grad_weight, args.fp32_grad_input):
            flops = 2 * a.shape[0] * b.shape[0] * a.shape[1]
            fp32 = "_fp32" in name
            out_dtype = torch.float32 if fp32 else torch.bfloat16

            def current(a=a, b=b, fp32=fp32):
                acc = emulated.mm_fp32_accumulate(a, b)
                # an FP32 output is the accumulator, scaled in place (gemm/dispatch.py)
                return kernels.gemm_epilogue(acc, amax, out=acc if fp32 else None)

            variants = {"cublas_ep": current}
            if fp32:  # the product alone: what an FP32 output without alpha (MXFP8) costs
                variants["cublas_fp32_no_alpha"] = lambda a=a, b=b: emulated.mm_fp32_accumulate(
                    a, b
                )
            if device.type == "cuda" and not fp32:
                # (with `allow_bf16_reduced_precision_reduction` as it is: on by default)
                variants = {"cublas_bf16_no_alpha": lambda a=a, b=b: a @ b.t(), **variants}
                # cast(acc) exactly, split-K reduced in FP32: what MXFP8 can use
                # (gemm/dispatch.py, CUBLAS_BF16_OUT)
                variants["cublas_bf16_exact"] = lambda a=a, b=b: cublas_bf16(a, b)
            for cfg in fp32_configs if fp32 else configs:
                variants[f"fused {','.join(map(str, cfg))}"] = (
                    lambda a=a, b=b, cfg=cfg, dt=out_dtype: gemm_fused(
                        a, b, amax, out_dtype=dt, config=cfg
                    )
                )
            want = current().float()
            base = None
            for label, fn in variants.items():
                try:
                    got = fn().float()
                    if args.device_time:
                        host, span = harness.time_host_and_device(fn, warmup, reps, device)
                        t = (span or host).median_ms  # (span: None off CUDA)
                    else:
                        t = harness.time_fn(fn, warmup=warmup, reps=reps, device=device).median_ms
                except Exception as e:  # a config that does not fit shared memory, or compile
                    print(f"  {name} {label}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                    continue
                base = t if label == "cublas_ep" else base
                rel = ((got - want).abs().max() / want.abs().max()).item()
                rows.append(dict(gemm=name, variant=label, us=1e3 * t,
                                 tflops=flops / (t * 1e-3) / 1e12, max_rel_diff=rel))  # fmt: skip
                print(f"  {name} {label}: {1e3 * t:.1f} us", flush=True)
            for r in rows:
                if r["gemm"] == name and base:
                    r["vs_cublas_ep"] = 1e3 * base / r["us"]
    harness.print_table(rows, ["gemm", "variant", "us", "tflops", "vs_cublas_ep", "max_rel_diff"])
    if args.json:
        harness.write_json(args.json, {"benchmark": "gemm", "banner": info, "rows": rows,
                                       "device_time": args.device_time,
                                       "argv": sys.argv[1:] if argv is None else argv})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
