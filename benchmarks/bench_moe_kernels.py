"""The per-group quantization launches of one compiled MoE training step, at the transformers
MoE models' own shapes (bench_moe_model.py), each alone against the copy ceiling, at each tile
config given: which tile each launch wants, and what one read of an expert weight for both of
MXFP8's copies saves against two.

The launches are those the compiled step makes (docs/MODELS.md, "Where the compiled MoE step's
extra time goes"; benchmarks/research/moe_kernel_bytes_cpu.py lists them from the traced
graphs): with FP32 masters under BF16 autocast the forward's activations and the expert
weights arrive in FP32, the backward's gradients in BF16. Per model, one MoE layer:

- `act fw up` / `act fw down`: the experts' input (FP32 [M, hidden] / [M, width], gathered
  through the token layout): the row copy with its `_dq` and the token copy (NVFP4: Hadamard);
- `weight up` / `weight down`: the expert weights as [E*N, K] FP32 rows: NVFP4 16x16 with
  `_dq`; MXFP8 the row copy with `_dq` (`row`), the copy along N (`col`), and both from one
  read (`row+col`);
- `act bw up` / `act bw down`: grad_output (BF16 [M, 2*width] / [M, hidden]): both copies with
  their `_dq` (NVFP4: stochastic rounding, Hadamard token copy);
- each `act` launch again as `..., dq only`: every copy made with its `_dq` written without its
  codes and scales, as the emulated step makes them since 2026-11-29 (gemm/dispatch.py,
  DQ_ONLY_ACTIVATIONS); MXFP8's `weight ... row` and `row+col` too, their copy along K without
  codes, as a step with no weight cache makes it where nothing keeps that copy (compiled);
- NVFP4's group amax passes (activations: plain and Hadamard; weights: plain), timed once
  (their tile is kernels.grouped.AMAX_TILE, not swept).

Routing: M = tokens x top-k rows split over the experts by a seeded multinomial draw (each
expert near M/E rows), as a balanced router gives. Each launch is captured in a CUDA graph and
replayed; bytes are the input read once (8 bytes a position more for a gathered layout) plus
every output written, over the median time, as a % of the device-to-device copy measured in
the same run.

    python benchmarks/bench_moe_kernels.py --models deepseek-v3 mixtral \\
        --kernel-tiles '32,128,4;64,64,4;64,128,8' --json docs/results/moe_kernels_h200.json
    python benchmarks/bench_moe_kernels.py --quick     # CPU smoke test (Triton's interpreter)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
if not torch.cuda.is_available():  # the CPU smoke test (--quick) runs Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import harness  # noqa: E402
import tiles  # noqa: E402
from bench_quantize import graphed  # noqa: E402

from blockscale.formats import grouped as G  # noqa: E402
from blockscale.kernels import grouped as kg  # noqa: E402
from blockscale.kernels import mxfp8 as mx  # noqa: E402
from blockscale.kernels import nvfp4 as nv  # noqa: E402
from blockscale.kernels._common import launch_kind, sr_seed  # noqa: E402

# model -> (tokens routed x top-k = M, hidden, expert width, experts): bench_moe_model.py's
# shapes at B=8, T=2048
MODELS = {
    "deepseek-v3": (16384 * 8, 2048, 512, 256),
    "qwen3-30b-a3b": (16384 * 8, 2048, 768, 128),
    "mixtral": (16384 * 2, 4096, 14336, 8),
}
QUICK = {"tiny": (200, 64, 32, 4)}
# --dense: transformers Llama's weight shapes [N, K] (bench_model.py's llama-1b and llama-8b)
DENSE = [(5632, 2048), (2048, 5632), (14336, 4096), (4096, 14336)]
DENSE_QUICK = [(64, 96)]
# tile configs tried when --kernel-tiles is not given: (BM, BK, num_warps[, maxnreg])
DEFAULT_CONFIGS = "32,64,4;32,128,4;32,128,8;64,64,4;64,64,8;64,128,8;128,64,8;32,256,8"


def _nbytes(*tensors: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _routing(m: int, e: int, device: torch.device) -> G.TokenLayout:
    gen = torch.Generator().manual_seed(0)
    counts = torch.multinomial(torch.full((e,), 1.0 / e), m, replacement=True, generator=gen)
    sizes = torch.bincount(counts, minlength=e)
    offs = sizes.cumsum(0).to(torch.int32).to(device)
    return offs, G.token_layout(offs, m)


class Launch:
    """One quantize launch: `fmt`:`kind` picks its entry in kernels.grouped.TILES (`table`
    None) or `kind` its entry in a dense launcher's TILES (`table`); `call()` runs it and
    returns its outputs; `read` is the bytes it reads."""

    def __init__(self, name: str, fmt: str, kind: str | None, call: Callable, read: int,
                 table: dict | None = None):  # fmt: skip
        self.name, self.fmt, self.kind, self.call, self.read = name, fmt, kind, call, read
        self.table = table

    def entry(self) -> tuple[dict, str]:
        """(the TILES table, its key) this launch takes its tile from."""
        if self.table is not None:
            return self.table, self.kind
        return kg.TILES, f"{self.fmt}:{self.kind}"


def _dense_launches(shape: tuple, recipe: str, device: torch.device) -> list[Launch]:
    """A dense linear's weight launches ([N, K] FP32 master and BF16): MXFP8's row copy with
    its `_dq` (forward) and the copy along N with and without it (grad_input's, rebuilt in
    the backward or saved); NVFP4's 16x16 copy with its `_dq`."""
    n, k = shape
    out: list[Launch] = []
    gen = torch.Generator(device=device).manual_seed(2)
    for dtype in (torch.float32, torch.bfloat16):
        w = (torch.randn(n, k, device=device, generator=gen) * 0.02).to(dtype)
        tag = f"{n}x{k} {str(dtype).split('.')[-1]}"
        if recipe == "mxfp8":
            for label, row, col, dq in (("row+dq", True, False, True), ("col+dq", False, True, True),
                                        ("col", False, True, False)):  # fmt: skip
                out.append(Launch(
                    f"dense {tag} {label}", "mxfp8", launch_kind(row, col, dq),
                    lambda w=w, row=row, col=col, dq=dq: mx._mxfp8_quantize_2d(w, row, col, dq, dq),
                    _nbytes(w), mx.TILES,
                ))  # fmt: skip
        else:
            amax = w.abs().amax().float().reshape(1)
            out.append(Launch(
                f"dense {tag} 16x16+dq", "nvfp4", launch_kind(True, False, True),
                lambda w=w, amax=amax: nv._nvfp4_quantize_2d(
                    w, amax, amax, None, None, None, row=True, col=False, row_2d=True,
                    col_2d=False, row_sr=False, col_sr=False, col_hadamard=False, dq_row=True,
                    dq_col=False),
                _nbytes(w), nv.TILES,
            ))  # fmt: skip
    return out


def _launches(model: str, shape: tuple, recipe: str, device: torch.device) -> list[Launch]:
    m, hidden, width, e = shape
    offs, layout = _routing(m, e, device)
    src, grp = layout.source, layout.group
    p = src.shape[0]
    gen = torch.Generator(device=device).manual_seed(1)
    act = {
        "act fw up": torch.randn(m, hidden, device=device, generator=gen),
        "act fw down": torch.randn(m, width, device=device, generator=gen),
        "act bw up": torch.randn(m, 2 * width, device=device, generator=gen).bfloat16(),
        "act bw down": torch.randn(m, hidden, device=device, generator=gen).bfloat16(),
    }
    # [E, N, K] expert weights as [E*N, K] FP32 rows: up [E, 2*width, hidden], down
    # [E, hidden, width]
    weights = {
        "weight up": torch.randn(e * 2 * width, hidden, device=device, generator=gen) * 0.02,
        "weight down": torch.randn(e * hidden, width, device=device, generator=gen) * 0.02,
    }
    # blockscale's own MoE models quantize a BF16 cast of their FP32 experts
    weights["weight up bf16"] = weights["weight up"].bfloat16()
    per_row = {"weight up": 2 * width, "weight down": hidden, "weight up bf16": 2 * width}
    out: list[Launch] = []
    if recipe == "mxfp8":
        for name, x in act.items():
            dq_col = "bw" in name
            for codes, label in ((True, ""), (False, ", dq only")):
                out.append(Launch(
                    name + label, "mxfp8", launch_kind(True, True, True),
                    lambda x=x, dq_col=dq_col, codes=codes: kg._mxfp8_quantize_grouped_2d(
                        x, src, True, True, True, dq_col, codes, codes),
                    _nbytes(x) + 8 * p,
                ))  # fmt: skip
        for name, w in weights.items():
            for label, row, col, codes in (("row", True, False, True), ("col", False, True, True),
                                           ("row+col", True, True, True),
                                           ("row, dq only", True, False, False),
                                           ("row+col, dq only", True, True, False)):  # fmt: skip
                out.append(Launch(
                    f"{name} {label}", "mxfp8", launch_kind(row, col, row),
                    lambda w=w, row=row, col=col, codes=codes: kg._mxfp8_quantize_grouped_2d(
                        w, None, row, col, row, False, codes, True),
                    _nbytes(w),
                ))  # fmt: skip
        return out
    # nvfp4: the group amaxes first (not swept), then the quantize launches reusing them
    seed = sr_seed(device, None)
    for name, x in act.items():
        bw = "bw" in name
        amax = kg._group_amax_2d(x, src, grp, e, True, True)
        out.append(Launch(
            f"{name} amax", "amax", None,
            lambda x=x: (kg._group_amax_2d(x, src, grp, e, True, True),), _nbytes(x) + 8 * p,
        ))  # fmt: skip
        for codes, label in ((True, ""), (False, ", dq only")):
            out.append(Launch(
                name + label, "nvfp4", launch_kind(True, True, True, bw),
                lambda x=x, amax=amax, bw=bw, codes=codes: kg._nvfp4_quantize_grouped_2d(
                    x, src, grp, amax[0].contiguous(), amax[1].contiguous(), seed if bw else None,
                    row=True, col=True, row_2d=False, row_sr=bw, col_sr=bw, col_hadamard=True,
                    dq_row=True, dq_col=bw, row_codes=codes, col_codes=codes),
                _nbytes(x) + 8 * p,
            ))  # fmt: skip
    for name, w in weights.items():
        group = torch.arange(w.shape[0], device=device, dtype=torch.int32) // per_row[name]
        amax = kg._group_amax_2d(w, None, group, e, True, False)[0].contiguous()
        out.append(Launch(
            f"{name} amax", "amax", None,
            lambda w=w, group=group: (kg._group_amax_2d(w, None, group, e, True, False),),
            _nbytes(w) + 4 * w.shape[0],
        ))  # fmt: skip
        out.append(Launch(
            f"{name} 16x16", "nvfp4", launch_kind(True, False, True),
            lambda w=w, group=group, amax=amax: kg._nvfp4_quantize_grouped_2d(
                w, None, group, amax, amax, None, row=True, col=False, row_2d=True,
                row_sr=False, col_sr=False, col_hadamard=False, dq_row=True, dq_col=False),
            _nbytes(w) + 4 * w.shape[0],
        ))  # fmt: skip
    return out


def _time(launch: Launch, device: torch.device, args) -> tuple[float, int]:
    """(median us, bytes written) of one launch alone (a CUDA graph's replays on CUDA)."""
    outs = launch.call()
    written = _nbytes(*outs)
    del outs
    timing = harness.time_fn(
        graphed(launch.call, device), warmup=args.warmup, reps=args.reps, device=device
    )
    return timing.median_ms * 1e3, written


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--recipes", nargs="+", default=["nvfp4", "mxfp8"],
                        choices=["nvfp4", "mxfp8"])  # fmt: skip
    parser.add_argument(
        "--kernel-tiles", default=None, metavar="BM,BK,WARPS[,MAXNREG][;...]",
        help=f"tile configs each launch is timed at (default: {DEFAULT_CONFIGS}); 'default' "
        "times the launchers' own tables only",
    )  # fmt: skip
    parser.add_argument(
        "--dense", action="store_true",
        help="also dense linears' weight launches at Llama's shapes (FP32 and BF16 weights)",
    )  # fmt: skip
    parser.add_argument(
        "--time-limit", type=float, default=540.0, metavar="S",
        help="stop starting new launches after S seconds (the JSON keeps what ran)",
    )  # fmt: skip
    tiles.add_arg(parser)
    args = parser.parse_args(argv)
    tiles.apply(args)
    device = harness.pick_device(args.device)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 10)
    spec = args.kernel_tiles if args.kernel_tiles is not None else (
        "32,64,4;64,64,4" if args.quick else DEFAULT_CONFIGS)  # fmt: skip
    configs: list[tuple | None] = [None] + (
        [] if spec == "default" else tiles.configs(spec)
    )  # None: the launchers' own tables
    models = QUICK if args.quick else {name: MODELS[name] for name in args.models}

    info = harness.banner(device)
    copy_bps = harness.copy_bandwidth(device, 2**26 if args.quick else 2**30, reps=args.reps)
    print(f"copy ceiling: {copy_bps / 1e12:.3g} TB/s (read + write)")
    start = time.monotonic()
    rows: list[dict[str, Any]] = []
    stopped = False

    def write() -> None:
        if args.json:
            harness.write_json(args.json, {
                "benchmark": "moe_kernels", "banner": info, "copy_tbps": copy_bps / 1e12,
                "models": {k: list(v) for k, v in models.items()}, "configs": spec,
                "stopped_early": stopped, "rows": rows,
                "argv": sys.argv[1:] if argv is None else argv,
            })  # fmt: skip

    work = [(model, recipe, lambda m=model, s=shape, r=recipe: _launches(m, s, r, device))
            for model, shape in models.items() for recipe in args.recipes]  # fmt: skip
    if args.dense:
        work += [(f"dense {n}x{k}", recipe, lambda s=(n, k), r=recipe: _dense_launches(s, r, device))
                 for n, k in (DENSE_QUICK if args.quick else DENSE) for recipe in args.recipes]  # fmt: skip
    for model, recipe, make in work:
        for launch in make():
            table, key = launch.entry()
            own = table.get(key)
            for cfg in configs if launch.kind is not None else [None]:
                if time.monotonic() - start > args.time_limit:
                    stopped = True
                    break
                if cfg is not None:
                    table[key] = cfg
                try:
                    us, written = _time(launch, device, args)
                    error = None
                except Exception as exc:  # a tile that does not compile or fit
                    us, written, error = None, 0, f"{type(exc).__name__}: {exc}"[:200]
                finally:
                    if own is None:
                        table.pop(key, None)
                    else:
                        table[key] = own
                nbytes = launch.read + written
                row = {
                    "model": model, "recipe": recipe, "launch": launch.name,
                    "kind": launch.kind or "-",
                    "tiles": "default" if cfg is None else ",".join(map(str, cfg)),
                    "us": us, "GB": nbytes / 1e9,
                    "pct_copy": None if us is None else 100 * nbytes / (us * 1e-6) / copy_bps,
                    "error": error,
                }  # fmt: skip
                rows.append(row)
                print(" | ".join(harness.fmt(row[c]) for c in
                                 ("model", "recipe", "launch", "tiles", "us", "pct_copy")),
                      flush=True)  # fmt: skip
            if device.type == "cuda":
                torch.cuda.empty_cache()
        write()
    best = []
    for key in dict.fromkeys((r["model"], r["recipe"], r["launch"]) for r in rows):
        found = [r for r in rows if (r["model"], r["recipe"], r["launch"]) == key and r["us"]]
        if found:
            own = next((r for r in found if r["tiles"] == "default"), None)
            fastest = min(found, key=lambda r: r["us"])
            best.append({**fastest, "default_us": own and own["us"],
                         "default_pct": own and own["pct_copy"]})  # fmt: skip
    print()
    harness.print_table(best, ["model", "recipe", "launch", "kind", "GB", "default_us",
                               "default_pct", "tiles", "us", "pct_copy"])  # fmt: skip
    write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
