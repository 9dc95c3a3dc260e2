"""One bench_quantize case under Nsight Compute: which pipe bounds a quantize kernel.

Runs the named cases of bench_quantize.py once to warm up, then once more inside an NVTX range
"target", so ncu can select that launch (building the cases runs a rowwise quantization of its
own, which a plain --kernel-name filter would catch first). Run on the GPU machine:

    ncu --nvtx --nvtx-include "target/" --kernel-name regex:quantize_kernel --launch-count 1 \\
        --section SpeedOfLight --section Occupancy \\
        --metrics regex:sm__inst_executed_pipe_.*\\.avg\\.pct_of_peak_sustained_active \\
        python benchmarks/research/ncu_quantize.py "mxfp8 both + dq"

A per-group kernel of bench_grouped_mm.py takes `--grouped M,K,E` (tokens, hidden size,
experts; uneven splits as that benchmark's), e.g. `--grouped 65536,7168,8 "nvfp4 bwd: rows
SR+dq, Hadamard tokens SR+dq"`.

(2026-11-26, H100: the ALU pipe 74-88% busy in the both-direction kernels, docs/KERNELS.md.)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/, from anywhere

from bench_quantize import SHAPE, cases, make_input  # noqa: E402


def main(names: list[str]) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ncu_quantize.py needs a CUDA GPU")
    if names[:1] == ["--grouped"] and len(names) > 1:
        from bench_grouped_mm import kernel_cases

        m, k, e = (int(v) for v in names[1].split(","))
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        known = {name: fn for name, (fn, _bytes) in kernel_cases(x, e).items()}
        names = names[2:]
    else:
        x = make_input(SHAPE, torch.device("cuda"))
        known = {name: fn for name, _family, fn, _bytes in cases(x)}
    missing = [n for n in names if n not in known]
    if not names or missing:
        raise SystemExit(f"name one or more of: {', '.join(known)} (unknown: {missing})")
    for name in names:
        known[name]()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("target")
        known[name]()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print("ran", name, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
