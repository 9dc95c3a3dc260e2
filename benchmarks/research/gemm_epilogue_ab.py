"""The GEMM epilogues' BF16 rounding, A/B in one process (GPU only): kernels/epilogue.py's
HW_BF16 off (integer rounding) and on (the hardware conversion), and for the dense kernel
kernels/gemm.py's EPILOGUE_HALVES off and on, alternated over five rounds at the Qwen3-like
(128 experts) and DeepSeek-V3-like (256) grouped rows GEMMs, 131072 rows, against CUTLASS's BF16
`torch._grouped_mm`, and at the Llama 1B / 8B dense shapes against cuBLAS BF16. Each variant's
bits are checked against the first one's (docs/KERNELS.md, "The GEMM epilogues' BF16
rounding").

    python benchmarks/research/gemm_epilogue_ab.py --json out.json
"""

# Each lambda below is called within its own loop iteration (by compare), so B023 does not apply.
# ruff: noqa: B023
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/

import bench_grouped_mm as bgm  # noqa: E402
import harness  # noqa: E402

from blockscale.kernels import epilogue, gemm  # noqa: E402
from blockscale.kernels import grouped_gemm as gg  # noqa: E402

GROUPED = (("qwen3-up", 128), ("qwen3-down", 128), ("deepseek-up", 256), ("deepseek-down", 256))
DENSE = (  # (name, M, N, K, b K-major)
    ("output 16384x2048<-2048", 16384, 2048, 2048, True),
    ("output 16384x5632<-2048", 16384, 5632, 2048, True),
    ("output 16384x2048<-5632", 16384, 2048, 5632, True),
    ("grad_input 16384x5632<-2048", 16384, 5632, 2048, False),
    ("output 8192x14336<-4096", 8192, 14336, 4096, True),
)
REFERENCE = "cutlass/cublas"


def switches(hw: bool, halves: bool = True):
    def setup() -> None:
        epilogue.HW_BF16, gemm.EPILOGUE_HALVES = hw, halves

    return setup


def compare(label: str, variants: dict, device: torch.device, rounds: int = 5) -> dict:
    """Each variant's median over `rounds` alternations, and whether its bits equal the first
    of ours."""
    first, bits = None, {}
    for name, (setup, fn) in variants.items():
        setup()
        out = fn()
        if name != REFERENCE:
            out = out.view(torch.int16) if out.dtype == torch.bfloat16 else out
            first = out.clone() if first is None else first
            bits[name] = torch.equal(out, first)
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, (setup, fn) in variants.items():
            setup()
            timing = harness.time_fn(fn, warmup=3, reps=20, device=device)
            times[name].append(timing.median_ms * 1e3)
    median = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    row = {"case": label, "us": median, "all_us": times, "bits_equal_first": bits}
    print(json.dumps({"case": label, "us": {k: round(v, 1) for k, v in median.items()},
                      "bits": bits}), flush=True)  # fmt: skip
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    device = torch.device("cuda")
    info = harness.banner(device)
    torch.manual_seed(0)
    none = lambda: None  # noqa: E731
    rows, m = [], 131072
    for shape, e in GROUPED:
        k, n = bgm.NAMED_SHAPES[shape]
        offs = torch.tensor(bgm.split(m, e), dtype=torch.int64).cumsum(0).to(torch.int32)
        offs = offs.to(device)
        x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
        w = torch.randn(e, n, k, device=device, dtype=torch.bfloat16)
        go = torch.randn(m, n, device=device, dtype=torch.bfloat16)
        amax = (torch.rand(e, device=device) + 1, torch.rand(e, device=device) + 1)
        wt = w.transpose(-2, -1)
        rows.append(compare(f"{shape} {e}x{k}->{n} output", {
            REFERENCE: (none, lambda: torch._grouped_mm(x, wt, offs=offs)),
            "int rounding": (switches(False), lambda: gg.grouped_gemm_rows(x, w, offs, amax)),
            "hw rounding": (switches(True), lambda: gg.grouped_gemm_rows(x, w, offs, amax)),
        }, device))  # fmt: skip
        rows.append(compare(f"{shape} {e}x{n}->{k} grad_input", {
            REFERENCE: (none, lambda: torch._grouped_mm(go, w, offs=offs)),
            "int rounding": (switches(False), lambda: gg.grouped_gemm_rows(go, wt, offs, amax)),
            "hw rounding": (switches(True), lambda: gg.grouped_gemm_rows(go, wt, offs, amax)),
        }, device))  # fmt: skip
        torch.cuda.empty_cache()
    for name, rows_m, n, k, kmajor in DENSE:
        a = torch.randn(rows_m, k, device=device).bfloat16()
        b = torch.randn(n, k, device=device).bfloat16()
        b = b if kmajor else b.t().contiguous().t()
        am = (torch.tensor(37.0, device=device), torch.tensor(11.0, device=device))
        rows.append(compare(name, {
            REFERENCE: (none, lambda: torch.mm(a, b.t())),
            "int, whole": (switches(False, False), lambda: gemm.gemm_fused(a, b, am)),
            "int, halves": (switches(False, True), lambda: gemm.gemm_fused(a, b, am)),
            "hw, whole": (switches(True, False), lambda: gemm.gemm_fused(a, b, am)),
            "hw, halves": (switches(True, True), lambda: gemm.gemm_fused(a, b, am)),
        }, device))  # fmt: skip
        torch.cuda.empty_cache()
    switches(True)()
    if args.json:
        Path(args.json).write_text(json.dumps({"banner": info, "rows": rows}, indent=1))
    for r in rows:
        print(f"| {r['case']} | " + " | ".join(f"{k} {v:.1f}" for k, v in r["us"].items()) + " |")


if __name__ == "__main__":
    main()
