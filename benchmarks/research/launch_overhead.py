"""Host cost of launching each kernel entry point: microseconds of Python + launch per call.

On tiny inputs the GPU work is negligible, so back-to-back calls without synchronization
measure what the CPU spends per call. A layer whose GPU work per step is smaller than the
sum of these costs is launch-bound (docs/KERNELS.md). A plain PyTorch op is the reference.

    python benchmarks/research/launch_overhead.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

import harness  # noqa: E402

from blockscale import kernels  # noqa: E402
from blockscale.kernels import _launch  # noqa: E402
from blockscale.kernels.amax import _amax_kernel  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    args = parser.parse_args(argv)
    device = harness.pick_device(args.device)
    if device.type != "cuda":
        print("launch_overhead needs a CUDA device")
        return 1
    reps = args.reps or 200
    info = harness.banner(device)
    x = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    acc = torch.randn(256, 256, device=device)
    amax = (torch.ones((), device=device), torch.ones((), device=device))
    q = kernels.nvfp4_quantize(x)
    out = torch.zeros(2, dtype=torch.int32, device=device)
    cases = {
        "torch: x.abs().amax()": lambda: x.abs().amax(),
        "torch: x.mul_(1)": lambda: x.mul_(1),
        "triton: raw _amax_kernel launch": lambda: _amax_kernel[(1,)](
            x, 256, 1, 256, 256, out, 2, 16, BM=32, BK=128, TILES=16, num_warps=4
        ),
        "direct launch of it (kernels/_launch.py)": lambda: _launch.direct(
            _amax_kernel,
            (1,),
            x,
            256,
            1,
            256,
            256,
            out,
            2,
            16,
            BM=32,
            BK=128,
            TILES=16,
            num_warps=4,
        ),  # fmt: skip
        "op: torch.ops.blockscale.amax_2d": lambda: torch.ops.blockscale.amax_2d(x, True, False),
        "kernels.amax": lambda: kernels.amax(x),
        "kernels.nvfp4_quantize (+amax)": lambda: kernels.nvfp4_quantize(x),
        "kernels.nvfp4_quantize_both (+amax)": lambda: kernels.nvfp4_quantize_both(x),
        "kernels.nvfp4_dequantize_dq": lambda: kernels.nvfp4_dequantize_dq(q),
        "kernels.mxfp8_quantize_both": lambda: kernels.mxfp8_quantize_both(x),
        "kernels.gemm_epilogue": lambda: kernels.gemm_epilogue(acc, amax),
    }
    rows = []
    for name, fn in cases.items():
        try:
            rows.append({"call": name, "host_us": harness.host_us(fn, reps, device, warmup=10)})
        except Exception as e:  # a signature drift in the raw launch must not hide the rest
            rows.append({"call": name, "host_us": None, "error": f"{type(e).__name__}: {e}"})
    harness.print_table(rows, ["call", "host_us", "error"])
    if args.json:
        harness.write_json(
            args.json, {"benchmark": "launch_overhead", "banner": info, "rows": rows}
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
