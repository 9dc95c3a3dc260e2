"""GPU check of the fused global amax (max |x| and the Hadamard-columnwise amax, one read).

(a) Bit-exact: `kernels.amax_fused(x)` against the formats/ reference computed on the same
    GPU tensors: `x.float().abs().amax()` and `nvfp4.quantize(x, hadamard=True,
    transpose=True).amax` (the FP64 transform, rounded to FP32 then BF16), on 8192x5120,
    8192x11328 (K not a multiple of the tile), 14336x16384 and 16384x8192 BF16 randn with
    outliers (about 1e-3 of the values x50-500), a shape whose last strip re-reads its last
    row group, and Inf/NaN/huge/zero cases, including those the CPU interpreter cannot tell
    apart (its max propagates NaN whatever the kernel asks for; the GPU's need not).
(b) Speed on 16384x8192 (the shape of docs/KERNELS.md): CUDA-graph replays timed with CUDA
    events (median), as benchmarks/bench_quantize.py does, against the device-to-device copy
    measured in the same run; the default tile config and a few others, each also checked
    bit for bit. The old tensor-core kernel is not kept: its figure is quoted from
    docs/KERNELS.md (205 us, 43.5% of the copy, H100, 2026-11-22).

    python benchmarks/research/check_amax_gpu.py

Prints a table and exits non-zero on any mismatch. Under 2 minutes on an H100.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parents[1]  # benchmarks/
sys.path.insert(0, str(HERE))  # harness and bench_quantize, from anywhere
sys.path.insert(1, str(HERE.parent))  # the blockscale next to this script, not an installed one

import harness  # noqa: E402
from bench_quantize import graphed, make_input  # noqa: E402

from blockscale import kernels  # noqa: E402
from blockscale.formats import nvfp4  # noqa: E402

amax_module = importlib.import_module("blockscale.kernels.amax")

SHAPES = [(8192, 5120), (8192, 11328), (14336, 16384), (16384, 8192), (4112, 1000)]
TIMED_SHAPE = (16384, 8192)
SPECIAL_SHAPE = (8192, 5120)
TAIL_SHAPE = (8192, 11328)  # 11328 = 22 * 512 + 64
# (BM, BK, num_warps, tiles per program): a program covers BM * tiles rows by BK columns
CONFIGS = [
    amax_module.TILES["hadamard"],
    (16, 512, 4, 8),
    (16, 512, 4, 16),
    (16, 256, 4, 8),
    (16, 1024, 8, 8),
    (16, 512, 8, 8),
]
OLD = {"kernel": "old: tensor-core dot (docs/KERNELS.md)", "time_us": 205.0, "% of copy": 43.5}

failures: list[str] = []


def bits(t: torch.Tensor) -> str:
    return f"{t.float().item()!r} (0x{t.float().view(torch.int32).item() & 0xFFFFFFFF:08x})"


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, except that any NaN equals any NaN (the reference's NaN payload is
    torch's, the kernel's the GPU's)."""
    a, b = a.float().reshape(()), b.float().reshape(())
    if a.isnan() or b.isnan():
        return bool(a.isnan() and b.isnan())
    return bool(a.view(torch.int32) == b.view(torch.int32))


def check(name: str, x: torch.Tensor) -> None:
    plain, had = kernels.amax_fused(x)
    only_had = kernels.amax_hadamard_t(x)
    ref_plain = x.float().abs().amax()
    ref_had = nvfp4.quantize(x, hadamard=True, transpose=True).amax
    ok = same(plain, ref_plain) and same(had, ref_had) and same(only_had, ref_had)
    status = "ok" if ok else "MISMATCH"
    print(
        f"  {status:8} {name}: max|x| {bits(plain)} ref {bits(ref_plain)}; "
        f"RHT {bits(had)} / alone {bits(only_had)} ref {bits(ref_had)}"
    )
    if not ok:
        failures.append(name)


def special_cases(device: torch.device) -> None:
    base = make_input(SPECIAL_SHAPE, device)
    m, k = base.shape
    r, c = m // 2 + 5, k * 3 // 5
    inf, nan = float("inf"), float("nan")
    cases = {
        "+Inf": [(r, c, inf)],
        "-Inf": [(r, c, -inf)],
        "+Inf and -Inf in different blocks": [(r, c, inf), (r + 16, c, -inf)],
        "two Infs 2 rows apart (NaN)": [(r, c, inf), (r + 2, c, inf)],
        "Inf, -Inf 8 rows apart (NaN in the last stage)": [(r, c, inf), (r + 8, c, -inf)],
        "NaN mid-tensor": [(r, c, nan)],
        "NaN first element": [(0, 0, nan)],
        "NaN last element": [(m - 1, k - 1, nan)],
        "huge (2^126, -3e38)": [(r, c, 2.0**126), (r + 1, c + 1, -3e38)],
        "2^123 (exact path bound)": [(r, c, 2.0**123)],
    }
    for name, hits in cases.items():
        x = base.clone()
        for i, j, v in hits:
            x[i, j] = v
        check(name, x)
    x = base.clone()
    x[m // 2 : m // 2 + 16, c] = 2.0**123 - 2.0**115  # a whole block just below the bound
    check("a block of 2^123 - ulp (fast path)", x)
    check("all zero", torch.zeros_like(base))
    x = make_input(TAIL_SHAPE, device)
    x[x.shape[0] // 3, -1] = nan
    check(f"NaN in the K tail of {TAIL_SHAPE[0]}x{TAIL_SHAPE[1]}", x)


def timed(fn, device) -> float:
    return harness.time_fn(graphed(fn, device), warmup=5, reps=50, device=device).median_ms


def main() -> int:
    if not torch.cuda.is_available():
        print("needs a CUDA GPU (the CPU tests cover the interpreter)")
        return 2
    device = torch.device("cuda")
    harness.banner(device)
    print("(a) bit-exact against the formats/ reference, on the GPU")
    for shape in SHAPES:
        check(f"{shape[0]}x{shape[1]} randn + outliers", make_input(shape, device))
    special_cases(device)

    print("(b) speed, tile configs checked bit for bit as well")
    x = make_input(TIMED_SHAPE, device)
    ref_plain = x.float().abs().amax()
    ref_had = nvfp4.quantize(x, hadamard=True, transpose=True).amax
    copy = harness.copy_bandwidth(device)
    nbytes = 2 * x.numel()  # what bench_quantize counts for its two amax rows
    rows = [{"kernel": "device-to-device copy", "GB/s": copy / 1e9, "% of copy": 100.0}]
    default = amax_module.TILES["hadamard"]
    for cfg in CONFIGS:
        amax_module.TILES["hadamard"] = cfg
        plain, had = kernels.amax_fused(x)
        if not (same(plain, ref_plain) and same(had, ref_had)):
            failures.append(f"tiles {cfg}")
            print(f"  MISMATCH with tiles {cfg}: {bits(plain)} {bits(had)}")
        t = timed(lambda: kernels.amax_fused(x), device)
        gbs = nbytes / (t * 1e-3) / 1e9
        tag = " (default)" if cfg == default else ""
        rows.append(
            {
                "kernel": f"fused slab {cfg}{tag}",
                "time_us": t * 1e3,
                "GB/s": gbs,
                "% of copy": 100 * gbs * 1e9 / copy,
            }
        )
    amax_module.TILES["hadamard"] = default
    t = timed(lambda: kernels.amax(x), device)
    gbs = nbytes / (t * 1e-3) / 1e9
    rows.append(
        {"kernel": "plain amax (reference point)", "time_us": t * 1e3, "GB/s": gbs,
         "% of copy": 100 * gbs * 1e9 / copy}
    )  # fmt: skip
    rows.append(OLD)
    print(f"shape {TIMED_SHAPE[0]}x{TIMED_SHAPE[1]} BF16, {nbytes / 1e6:.0f} MB read")
    harness.print_table(rows, ["kernel", "time_us", "GB/s", "% of copy"])
    if failures:
        print(f"FAILED: {len(failures)} mismatches: {failures}")
        return 1
    print("all bit-exact")
    return 0


if __name__ == "__main__":
    sys.exit(main())
