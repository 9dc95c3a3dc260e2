"""Quantization kernels: achieved bytes/s against the device-to-device copy, same run.

Each kernel runs on a 16384 x 8192 BF16 tensor (randn with about one value in a thousand
50-500x larger) through the public functions of blockscale.kernels. The figure of merit is
(bytes the kernel must read + bytes it must write) / time, over the copy ceiling measured in
the same run (harness.copy_bandwidth, bytes read + written). Byte counts (N = rows * cols):

    amax                      read 2N
    NVFP4 one direction       read 2N, write N/2 codes + N/16 scales (+ 2N with the BF16 dq)
    NVFP4 both directions     read 2N, write 2 * (N/2 + N/16)        (+ 4N with both dq)
    MXFP8 one direction       read 2N, write N + N/32                 (+ 2N with dq)
    NVFP4 dequantize          read N/2 + N/16, write 2N
    16x16 transpose           read and write N/2 + N/16 each

Quantize rows take the tensor amax as given (amax=...), as the linear layer does once the
amax is known; the "+ amax pass" rows include the separate amax kernel and count its read
too. Each function is captured in a CUDA graph and the replays are timed (CUDA events, median),
so Python and launch overhead stay out of a memory-bound kernel's figure; `--eager` times the
plain calls instead. `--sweep` tries a few tile shapes per kernel family and keeps the best.

    python benchmarks/bench_quantize.py --json results/bench_quantize_h100.json
    python benchmarks/bench_quantize.py --sweep
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
if not torch.cuda.is_available():  # the CPU smoke test (--quick) runs Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import harness  # noqa: E402
import replaced  # noqa: E402
import tiles as tile_args  # noqa: E402

from blockscale import kernels  # noqa: E402
from blockscale.formats import nvfp4 as nvfp4_ref  # noqa: E402

SHAPE = (16384, 8192)
QUICK_SHAPE = (128, 256)
# (BM, BK, warps[, maxnreg]). (32, 128, 4) and (32, 64, 4) give a thread 32 and 16 values of a
# [32, *] tile with 4 warps: compiled for sm_90 on the CPU (sass_cpu.py), MXFP8 both + dq at
# (32, 128, 4) issues ~20% fewer instructions a value than at its (32, 128, 8) with no spill and
# the same warps an SM (docs/LOG.md, 2026-11-25 evening). The last caps 64x64/4 at 128
# registers: 4 programs an SM where the both-direction kernels (162-168 registers) fit 3, for
# some spill (docs/LOG.md, 2026-11-25 night). Timed 2026-11-25 late (docs/KERNELS.md): the
# winners are the launchers' defaults.
SWEEP = [(64, 128, 8), (32, 128, 8), (64, 64, 4), (64, 64, 8), (32, 128, 4), (32, 64, 4),
         (64, 64, 4, 128)]  # fmt: skip
# Families whose tiles an earlier sweep settled (docs/LOG.md): not swept again by default.
SETTLED = {"amax:plain", "nvfp4:row", "mxfp8:row"}
AMAX_SWEEP = [(32, 256, 8, 2), (32, 128, 4, 16), (64, 64, 4, 2), (32, 64, 4, 4)]


def make_input(shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(shape, generator=g, device=device)
    hit = torch.rand(shape, generator=g, device=device) < 1e-3
    x = torch.where(hit, x * (50 + 450 * torch.rand(shape, generator=g, device=device)), x)
    return x.to(torch.bfloat16)


def cases(x: torch.Tensor) -> list[tuple[str, str, Callable[[], Any], float]]:
    """(name, tile family, call, bytes moved) for every kernel."""
    n = x.numel()
    amax = kernels.amax(x)
    amax_t = kernels.amax_hadamard_t(x)
    q16 = nvfp4_ref.quantize(x, block="16x16")
    q1 = nvfp4_ref.quantize(x)
    m1 = kernels.mxfp8_quantize(x)
    nv1 = 2 * n + n / 2 + n / 16  # one NVFP4 direction, no dq
    mx1 = 2 * n + n + n / 32
    col = {"hadamard": True, "amax": amax_t}
    col_sr = {**col, "rounding": "stochastic"}
    return [
        ("amax", "amax:plain", lambda: kernels.amax(x), 2 * n),
        ("amax fused |x| + RHT columnwise", "amax:hadamard", lambda: kernels.amax_fused(x), 2 * n),
        ("nvfp4 1x16 rowwise", "nvfp4:row", lambda: kernels.nvfp4_quantize(x, amax=amax), nv1),
        (
            "nvfp4 1x16 rowwise + dq",
            "nvfp4:row_dq",
            lambda: kernels.nvfp4_quantize(x, amax=amax, return_dq=True),
            nv1 + 2 * n,
        ),
        (
            "nvfp4 1x16 rowwise SR + dq",
            "nvfp4:row_dq",
            lambda: kernels.nvfp4_quantize(x, amax=amax, rounding="stochastic", return_dq=True),
            nv1 + 2 * n,
        ),
        (
            "nvfp4 16x16 weight + dq",
            "nvfp4:row_dq",
            lambda: kernels.nvfp4_quantize(x, block="16x16", amax=amax, return_dq=True),
            nv1 + 2 * n,
        ),
        (
            "nvfp4 columnwise RHT",
            "nvfp4:col",
            lambda: kernels.nvfp4_quantize(x, transpose=True, hadamard=True, amax=amax_t),
            nv1,
        ),
        (
            "nvfp4 columnwise RHT SR",
            "nvfp4:col",
            lambda: kernels.nvfp4_quantize(
                x, transpose=True, hadamard=True, amax=amax_t, rounding="stochastic"
            ),
            nv1,
        ),
        (
            "nvfp4 both (row + col RHT)",
            "nvfp4:both",
            lambda: kernels.nvfp4_quantize_both(x, {"amax": amax}, col),
            2 * nv1 - 2 * n,
        ),
        (
            "nvfp4 both (row + col RHT) + dq",
            "nvfp4:both_dq",
            lambda: kernels.nvfp4_quantize_both(x, {"amax": amax}, col, return_dq=True),
            2 * nv1 - 2 * n + 4 * n,
        ),
        (
            "nvfp4 both + row dq (forward input)",
            "nvfp4:both_dq",
            lambda: kernels.nvfp4_quantize_both(x, {"amax": amax}, col, return_dq=(True, False)),
            2 * nv1 - 2 * n + 2 * n,
        ),
        (
            "nvfp4 both SR (grad_output) + dq",
            "nvfp4:both_sr_dq",
            lambda: kernels.nvfp4_quantize_both(
                x, {"amax": amax, "rounding": "stochastic"}, col_sr, return_dq=True
            ),
            2 * nv1 - 2 * n + 4 * n,
        ),
        # as the emulated linear makes them (gemm/dispatch.py, DQ_ONLY_ACTIVATIONS): each copy
        # with its `_dq` written without its codes and scales (named so that sass_cpu.py's
        # `--only "both SR"` still picks one launch)
        (
            "nvfp4 dq only: both, row dq (forward input)",
            "nvfp4:both_dq",
            lambda: kernels.quantize_both_2d(
                x, False, False, False, False, True, amax, amax_t, True, False, None, False
            ),
            nv1 + 2 * n,
        ),
        (
            "nvfp4 dq only: both stochastic + dq (grad_output)",
            "nvfp4:both_sr_dq",
            lambda: kernels.quantize_both_2d(
                x, False, True, False, True, True, amax, amax_t, True, True, None, False
            ),
            2 * n + 4 * n,
        ),
        (
            "nvfp4 rowwise + amax pass",
            "nvfp4:row",
            lambda: kernels.nvfp4_quantize(x),
            nv1 + 2 * n,
        ),
        (
            "nvfp4 both + fused amax pass",
            "nvfp4:both",
            lambda: kernels.nvfp4_quantize_both(x, {}, {"hadamard": True}),
            2 * nv1 - 2 * n + 2 * n,
        ),
        (
            "nvfp4 dequantize dq",
            "-",
            lambda: kernels.nvfp4_dequantize_dq(q1),
            n / 2 + n / 16 + 2 * n,
        ),
        (
            "nvfp4 16x16 transpose",
            "-",
            lambda: kernels.nvfp4_transpose_16x16(q16),
            2 * (n / 2 + n / 16),
        ),
        ("mxfp8 rowwise", "mxfp8:row", lambda: kernels.mxfp8_quantize(x), mx1),
        ("mxfp8 columnwise", "mxfp8:col", lambda: kernels.mxfp8_quantize(x, transpose=True), mx1),
        ("mxfp8 both", "mxfp8:both", lambda: kernels.mxfp8_quantize_both(x), 2 * mx1 - 2 * n),
        (
            "mxfp8 both + dq",
            "mxfp8:both_dq",
            lambda: kernels.mxfp8_quantize_both(x, return_dq=True),
            2 * mx1 - 2 * n + 4 * n,
        ),
        (
            "mxfp8 dq only: both + dq (grad_output)",
            "mxfp8:both_dq",
            lambda: kernels.mxfp8_quantize_both(x, return_dq=True, codes=False),
            2 * n + 4 * n,
        ),
        (
            "mxfp8 dequantize dq",
            "-",
            lambda: kernels.mxfp8_dequantize_dq(m1),
            n + n / 32 + 2 * n,
        ),
        (
            "swizzle scales (tiny)",
            "-",
            lambda: kernels.swizzle_scales(q1.scale),
            2 * q1.scale.numel(),
        ),
    ]


def graphed(fn: Callable[[], Any], device: torch.device) -> Callable[[], Any]:
    """fn captured in a CUDA graph (its outputs live in the graph's pool); replay it."""
    if device.type != "cuda":
        return fn
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def set_tiles(family: str, cfg: tuple) -> None:
    group, kind = family.split(":")
    tile_args.TABLES[group][kind] = cfg


def get_tiles(family: str) -> tuple:
    group, kind = family.split(":")
    return tile_args.TABLES[group][kind]


def measure(fn, device, warmup, reps, eager) -> harness.Timing:
    call = fn if eager else graphed(fn, device)
    return harness.time_fn(call, warmup=warmup, reps=reps, device=device)


def sweep(x, device, warmup, reps) -> dict[str, tuple]:
    """Best tile config per family, timed on that family's first (cheapest) case."""
    best: dict[str, tuple] = {}
    seen = set()
    for name, family, fn, _ in cases(x):
        if family == "-" or family in seen or family in SETTLED:
            continue
        seen.add(family)
        # the default first, always: a sweep whose list lacks it could "win" with a slower tile
        # (2026-11-25 late: amax:hadamard's default was not in AMAX_SWEEP)
        default = get_tiles(family)
        options = [default] + [
            c for c in (AMAX_SWEEP if family.startswith("amax") else SWEEP) if c != default
        ]
        results = []
        for cfg in options:
            set_tiles(family, cfg)
            try:
                t = measure(fn, device, warmup, max(10, reps // 3), eager=False).median_ms
            except Exception as e:  # a config the compiler rejects (e.g. out of resources)
                print(f"  {family} {cfg}: failed ({type(e).__name__}: {str(e)[:80]})")
                continue
            results.append((t, cfg))
            print(f"  {family} {cfg}: {t * 1e3:.1f} us ({name})")
        t, cfg = min(results)
        best[family] = cfg
        set_tiles(family, cfg)
    print("best tiles:", best)
    print(
        f"as an option for bench_model.py (or any kernel benchmark): --tiles '{tile_args.spec(best)}'"
    )
    return best


def timed_rows(selected, device, warmup, reps, eager, copy) -> list[dict[str, Any]]:
    rows = []
    for name, family, fn, nbytes in selected:
        t = measure(fn, device, warmup, reps, eager)
        gbs = nbytes / (t.median_ms * 1e-3) / 1e9
        tiles = get_tiles(family) if family != "-" else "-"
        rows.append(
            {
                "kernel": name,
                "time_us": t.median_ms * 1e3,
                "GB/s": gbs,
                "% of copy": 100 * gbs * 1e9 / copy,
                "MB moved": nbytes / 1e6,
                "tiles": tiles,
                "p20_us": t.p20_ms * 1e3,
                "p80_us": t.p80_ms * 1e3,
            }
        )
    return rows


def main() -> None:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--sweep", action="store_true", help="try tile shapes per family")
    parser.add_argument("--eager", action="store_true", help="time plain calls, no CUDA graph")
    parser.add_argument(
        "--only", default="", help="comma-separated: only kernels whose name contains one"
    )
    parser.add_argument("--shape", default="", help="ROWS,COLS of the BF16 input (default: "
                        f"{SHAPE[0]},{SHAPE[1]})")  # fmt: skip
    replaced.add_arg(parser)
    tile_args.add_arg(parser)
    args = parser.parse_args()
    replaced.apply(args)
    tile_args.apply(args)
    device = harness.pick_device(args.device)
    info = harness.banner(device)
    shape = QUICK_SHAPE if args.quick or device.type != "cuda" else SHAPE
    if args.shape:
        shape = tuple(int(v) for v in args.shape.split(","))
    warmup = args.warmup or (1 if args.quick else 5)
    reps = args.reps or (3 if args.quick else 50)
    x = make_input(shape, device)
    copy = harness.copy_bandwidth(device, reps=3 if args.quick else 20)
    print(f"copy ceiling: {copy / 1e9:.0f} GB/s (read + write); shape {shape} bf16")
    tiles = sweep(x, device, warmup, reps) if args.sweep else {}
    wanted = args.only.split(",")
    selected = [c for c in cases(x) if any(w in c[0] for w in wanted)]
    rows = timed_rows(selected, device, warmup, reps, args.eager, copy)
    harness.print_table(rows, ["kernel", "time_us", "GB/s", "% of copy", "MB moved", "tiles"])
    if args.json:
        harness.write_json(
            args.json,
            {
                "info": info,
                "shape": shape,
                "copy_GBps": copy / 1e9,
                "timing": "eager" if args.eager else "cuda graph replay",
                "replaced": args.replaced,
                "tiles_given": args.tiles,
                "band": tile_args.band(),
                "tiles": {k: list(v) for k, v in tiles.items()},
                "rows": rows,
            },
        )


if __name__ == "__main__":
    main()
