"""Linear layer forward + backward: time and peak memory of each recipe as ratios to BF16.

One step is `y = linear(x, w, None, recipe); y.backward(grad_output)` with BF16 input, BF16
weight and BF16 grad_output, input and weight both requiring grad (so all three GEMMs run).
For each shape the script measures, in the same run:

- the BF16 GEMM floor: the three GEMMs of the step (output, grad_input, grad_weight, each in
  its own layout) timed alone with cuBLAS; "% floor" is that sum over the step's time;
- the copy-bandwidth ceiling (reported in the banner for the quantization kernels' budget);
- each recipe's median step time, its ratio to the BF16 step, effective TFLOP/s (6*M*N*K per
  step), and the peak memory of one step above what was allocated before, as a ratio to BF16.

The GEMM backend is whatever `recipe.backend="auto"` picks (emulated on Hopper), printed per
row. `--compile` adds rows for the step under torch.compile (one compilation per shape and
recipe, with Inductor's eager-numerics options so the compiled step stays exact).
`--cuda-graph` adds rows for the eager step captured once in a CUDA graph and replayed: the
step's GPU time without the host's launch cost (what `mode="reduce-overhead"` or a captured
training step gets; it tells a launch-bound step from a GPU-bound one). `--quick`
runs tiny shapes with few repetitions: a smoke test that runs on the CPU.

    python benchmarks/bench_linear.py --json results/bench_linear_h100.json
    python benchmarks/bench_linear.py --quick            # CPU smoke test
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere

import harness  # noqa: E402

import blockscale.nn as bsnn  # noqa: E402
from blockscale import recipes  # noqa: E402
from blockscale.gemm import dispatch, resolve_backend  # noqa: E402
from blockscale.ops import EXACT_INDUCTOR_OPTIONS  # noqa: E402

SHAPES = [(16384, 4096, 4096), (16384, 4096, 14336), (16384, 14336, 4096)]
QUICK_SHAPES = [(128, 128, 128), (128, 128, 256)]
RECIPES = ["bf16", "nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"]


def gemm_floor_ms(m: int, k: int, n: int, device: torch.device, warmup: int, reps: int) -> float:
    """Sum of the median times of the step's three BF16 GEMMs, each in the layout it has."""
    bf = torch.bfloat16
    x, w = torch.randn(m, k, device=device, dtype=bf), torch.randn(n, k, device=device, dtype=bf)
    go = torch.randn(m, n, device=device, dtype=bf)
    gemms = [
        lambda: x @ w.t(),  # output      [M, N], contracting K
        lambda: go @ w,  # grad_input  [M, K], contracting N
        lambda: go.t() @ x,  # grad_weight [N, K], contracting M
    ]
    return sum(harness.time_fn(g, warmup=warmup, reps=reps, device=device).median_ms for g in gemms)


def make_step(layer: torch.nn.Module, fn: Any):
    def step(x: torch.Tensor, go: torch.Tensor) -> None:
        layer.weight.grad = None
        x.grad = None
        fn(x).backward(go)

    return step


def captured(step: Any, x: torch.Tensor, go: torch.Tensor) -> torch.cuda.CUDAGraph:
    """`step(x, go)` captured in a CUDA graph (warmed up on a side stream first, as capture
    requires); each replay runs the whole forward + backward with the same input tensors."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step(x, go)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step(x, go)
    return graph


def bench_shape(
    m: int, k: int, n: int, names: list[str], args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    warmup, reps = args.warmup, args.reps
    floor = gemm_floor_ms(m, k, n, device, warmup, reps)
    bf = torch.bfloat16
    weight = torch.nn.Parameter(torch.randn(n, k, device=device, dtype=bf) / k**0.5)
    per_set = 2 * (m * k + m * n)
    inputs = harness.rotating_inputs(
        lambda: (
            torch.randn(m, k, device=device, dtype=bf).requires_grad_(True),
            torch.randn(m, n, device=device, dtype=bf),
        ),
        per_set,
        device,
    )
    rows: list[dict[str, Any]] = []
    variants = [(name, "") for name in names]
    variants += [(name, "compile") for name in names] if args.compile else []
    variants += [(name, "cuda-graph") for name in names] if args.cuda_graph else []
    for name, mode in variants:
        compiled = mode == "compile"
        recipe = recipes.get(name)
        layer = bsnn.Linear(k, n, bias=False, device="meta", recipe=recipe)
        layer.weight = weight
        fn = layer
        if compiled:
            # Every variant compiles the same forward code; without a reset, Dynamo's per-code
            # recompile limit (8) would silently send later variants to eager.
            torch._dynamo.reset()
            fn = torch.compile(layer, fullgraph=True, options=EXACT_INDUCTOR_OPTIONS)
        step = make_step(layer, fn)
        if mode == "cuda-graph":
            graph = captured(step, *inputs[0])
            timing = harness.time_fn(graph.replay, warmup=warmup, reps=reps, device=device)
            peak = None  # the graph's memory pool is allocated once, at capture
            del graph
        else:
            timing = harness.time_fn(step, inputs, warmup=warmup, reps=reps, device=device)
            peak = harness.peak_memory(lambda step=step: step(*inputs[0]), device)
        backend = resolve_backend(recipe.backend, device).value if recipe.quantized else "F.linear"
        rows.append(
            {
                "shape": f"{m}x{k}x{n}",
                "recipe": name + (f" +{mode}" if mode else ""),
                "backend": backend,
                "ms": timing.median_ms,
                "p20_ms": timing.p20_ms,
                "p80_ms": timing.p80_ms,
                "tflops": 6 * m * n * k / (timing.median_ms * 1e-3) / 1e12,
                "gemm_floor_ms": floor,
                "pct_floor": 100 * floor / timing.median_ms,
                "peak_mib": None if peak is None else peak / 2**20,
            }
        )
        # Progress, so a run cut short still shows what it measured.
        print(f"  {rows[-1]['shape']} {rows[-1]['recipe']}: {timing.median_ms:.3f} ms", flush=True)
    base = next(r for r in rows if r["recipe"] == "bf16")
    for r in rows:
        r["time_vs_bf16"] = r["ms"] / base["ms"]  # against eager BF16
        mode = r["recipe"].partition(" ")[2]  # "", "+compile" or "+cuda-graph"
        same = next(
            (q for q in rows if q["recipe"] == " ".join(filter(None, ["bf16", mode]))), None
        )
        r["vs_bf16_same_mode"] = r["ms"] / same["ms"] if same else None
        r["mem_vs_bf16"] = None if r["peak_mib"] is None else r["peak_mib"] / base["peak_mib"]
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument(
        "--shapes", nargs="+", default=None, help="M,K,N triples, e.g. 8192,4096,4096"
    )
    parser.add_argument(
        "--compile", action="store_true", help="also time each step under torch.compile"
    )
    parser.add_argument(
        "--cuda-graph",
        action="store_true",
        help="also time each eager step captured in a CUDA graph (GPU time without launches)",
    )
    parser.add_argument(
        "--acc-chunk-mib",
        type=float,
        default=None,
        help="rows of the emulated GEMM's FP32 accumulator per cuBLAS call, in MiB (0: whole)",
    )
    parser.add_argument(
        "--gemm",
        choices=["fused", "cublas"],
        default="fused",
        help="emulated GEMMs as one Triton kernel with the epilogue (default), or cuBLAS with an "
        "FP32 output and the epilogue kernel after it",
    )
    args = parser.parse_args(argv)
    if args.cuda_graph and not torch.cuda.is_available():
        parser.error("--cuda-graph needs a CUDA device")
    dispatch.FUSED_GEMM = args.gemm == "fused"
    if args.acc_chunk_mib is not None:
        dispatch.ACC_CHUNK_BYTES = int(args.acc_chunk_mib * 2**20)
    device = harness.pick_device(args.device)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 5)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 30)
    if args.shapes:
        shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    else:
        shapes = QUICK_SHAPES if args.quick else SHAPES
    names = ["bf16"] + [r for r in args.recipes if r != "bf16"]

    info = harness.banner(device)
    copy_bytes = 2**26 if args.quick else 2**30
    copy_tbps = harness.copy_bandwidth(device, copy_bytes, reps=args.reps) / 1e12
    print(f"copy ceiling: {copy_tbps:.3g} TB/s (read + write)")
    rows: list[dict[str, Any]] = []
    for m, k, n in shapes:
        rows += bench_shape(m, k, n, names, args, device)
    columns = ["shape", "recipe", "backend", "ms", "time_vs_bf16", "vs_bf16_same_mode", "tflops",
               "pct_floor", "peak_mib", "mem_vs_bf16"]  # fmt: skip
    harness.print_table(rows, columns)
    if args.json:
        record = {"benchmark": "linear", "banner": info, "copy_tbps": copy_tbps, "rows": rows,
                  "acc_chunk_bytes": dispatch.ACC_CHUNK_BYTES, "gemm": args.gemm,
                  "argv": sys.argv[1:] if argv is None else argv}  # fmt: skip
        harness.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
