"""Grouped GEMM forward + backward (a mixture-of-experts layer's experts): time and peak memory
of each recipe as ratios to BF16 `torch._grouped_mm` in the same run, plus the per-group
quantization kernels against the copy ceiling.

One step is `y = grouped_mm(x, w.transpose(-2, -1), offs, recipe); y.backward(grad)` with
BF16 x [M, K], expert weights w [E, N, K] (BF16 parameters) and grad [M, N], all three GEMMs
running. BF16 is the same step through `torch._grouped_mm` (differentiable in PyTorch).
Splits are uneven, with empty experts from 4 experts up: expert sizes are drawn from a fixed
generator (Dirichlet-like, skewed), then expert 1 (and, at 64 experts, every 8th) gets 0
tokens, and offs[-1] = M. Nothing is a multiple of 16, 32 or 128 unless by chance.

Shapes (BENCHMARKS.md): DeepSeek-V3-like (K=7168, N=2048) and Llama-4-like (K=5120, N=8192),
32768 and 65536 tokens, 1, 2, 4, 8 and 64 experts. `--kernels` adds the breakdown table: each
per-group quantization kernel of a step alone (captured in a CUDA graph and replayed), its
bytes (read + write, counted as in bench_quantize.py, plus 8 bytes a position for the layout)
over its time, against the copy ceiling of the same run.

    python benchmarks/bench_grouped_mm.py --json results/bench_grouped_mm_h100.json
    python benchmarks/bench_grouped_mm.py --quick          # CPU smoke test
    python benchmarks/bench_grouped_mm.py --kernels --recipes bf16 --shapes deepseek-v3 \
        --tokens 32768 --experts 8 --kernel-tiles '64,64,4;64,64,4,168;32,64,4'
                                    # the per-group kernels at each tile (both-direction kinds)
    python benchmarks/bench_grouped_mm.py --gemms --recipes bf16 --tokens 65536 --experts 1 8
                                    # the grouped GEMMs alone: CUTLASS, each tile config, and
                                    # each tile order (bands of row tiles, persistent or not),
                                    # and grad_weight with an FP32 output, each launch of
                                    # kernels/grouped_gemm.py's TOKENS_FP32_LAUNCHES
    python benchmarks/bench_grouped_mm.py --packed --json results/packed_h200.json
                                    # the rows GEMMs (output, grad_input) reading the expert
                                    # weights packed, against the `_dq` path (dequantize +
                                    # GEMM) and BF16 torch._grouped_mm, at many small experts
    python benchmarks/bench_grouped_mm.py --dequantize --json results/dq_h200.json
                                    # the `_dq` of each expert-weight copy at those shapes,
                                    # read in place against the old copy-first path

`--packed` (docs/KERNELS.md, "Rows GEMMs that read the expert weights packed"): 128 experts of
2048 x 768 (Qwen3-30B-A3B-like) and 256 of 2048 x 512 (DeepSeek-V3-like), 16384 tokens routed
top-8 (131072 rows, split unevenly as above), both projections (up: K = hidden, N = width;
down: K = width, N = hidden). For each recipe and GEMM: BF16 `torch._grouped_mm`; the `_dq`
path as a cached packed weight takes it (the dequantize kernel making the weight's `_dq`,
then the rows kernel; also each alone); the packed kernel at each tile config in
PACKED_CONFIGS (whether its output equals the `_dq` path's bit for bit is in `equal`); and the
peak memory of the two paths. The activation's `_dq` is made beforehand in both.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script from anywhere
if not torch.cuda.is_available():  # the CPU smoke test (--quick) runs Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

import harness  # noqa: E402
import replaced  # noqa: E402
import tiles  # noqa: E402

import blockscale as bs  # noqa: E402
from blockscale import _library, recipes  # noqa: E402
from blockscale.formats import grouped as G  # noqa: E402
from blockscale.kernels.grouped import TILES as G_TILES  # noqa: E402

SHAPES = {"deepseek-v3": (7168, 2048), "llama-4": (5120, 8192)}
# shapes run only when named (--shapes), (K, N) of the transformers MoE models' expert GEMMs
# (bench_moe_model.py): Mixtral-like up projection (hidden 4096, N = 2 x width 14336), and the
# fine-grained ones' up and down projections, Qwen3-30B-A3B-like (hidden 2048, width 768; 128
# experts) and DeepSeek-V3-like (hidden 2048, width 512; 256 experts): with B=8 x 2048 tokens
# routed top-8, --tokens 131072
NAMED_SHAPES = {
    "mixtral-up": (4096, 28672),
    "qwen3-up": (2048, 1536),
    "qwen3-down": (768, 2048),
    "deepseek-up": (2048, 1024),
    "deepseek-down": (512, 2048),
}
TOKENS = [32768, 65536]
EXPERTS = [1, 2, 4, 8, 64]
QUICK = {"shapes": {"tiny": (64, 64)}, "tokens": [200], "experts": [1, 4]}
RECIPES = ["bf16", "nvfp4", "nvfp4_fwd_mxfp8_bwd", "mxfp8"]


def split(m: int, experts: int, seed: int = 0) -> list[int]:
    """Uneven group sizes summing to m, with empty experts from 4 experts up."""
    if experts == 1:
        return [m]
    g = torch.Generator().manual_seed(seed + experts)
    weights = torch.rand(experts, generator=g) ** 3 + 0.05  # skewed
    if experts >= 4:
        weights[1] = 0
    if experts >= 64:
        weights[::8] = 0
    sizes = (weights / weights.sum() * m).floor().long()
    sizes[int(weights.argmax())] += m - int(sizes.sum())
    return sizes.tolist()


def grouped_step(recipe_name: str):
    recipe = recipes.get(recipe_name)

    def step(x: torch.Tensor, w: torch.nn.Parameter, offs: torch.Tensor, go: torch.Tensor):
        w.grad = None
        x.grad = None
        if recipe.quantized:
            out = bs.grouped_mm(x, w.transpose(-2, -1), offs, recipe)
        else:
            out = torch._grouped_mm(x, w.transpose(-2, -1), offs=offs)
        out.backward(go)

    return step


def bench_case(
    label: str, k: int, n: int, m: int, e: int, args: argparse.Namespace, device: torch.device
) -> list[dict[str, Any]]:
    bf = torch.bfloat16
    sizes = split(m, e)
    offs = torch.tensor(sizes, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    w = torch.nn.Parameter(torch.randn(e, n, k, device=device, dtype=bf) / k**0.5)
    inputs = harness.rotating_inputs(
        lambda: (
            torch.randn(m, k, device=device, dtype=bf).requires_grad_(True),
            w,
            offs,
            torch.randn(m, n, device=device, dtype=bf),
        ),
        2 * (m * k + m * n),
        device,
        max_sets=3,
    )
    rows = []
    for name in args.recipes:
        step = grouped_step(name)
        timing = harness.time_fn(step, inputs, warmup=args.warmup, reps=args.reps, device=device)
        peak = harness.peak_memory(lambda step=step: step(*inputs[0]), device)
        rows.append(
            {
                "shape": label,
                "K,N": f"{k},{n}",
                "tokens": m,
                "experts": e,
                "empty": sum(s == 0 for s in sizes),
                "recipe": name,
                "ms": timing.median_ms,
                "p20_ms": timing.p20_ms,
                "p80_ms": timing.p80_ms,
                "tflops": 6 * m * n * k / (timing.median_ms * 1e-3) / 1e12,
                "peak_mib": None if peak is None else peak / 2**20,
            }
        )
        print(f"  {label} M={m} E={e} {name}: {timing.median_ms:.3f} ms", flush=True)
    base = rows[0]
    for r in rows:
        r["time_vs_bf16"] = r["ms"] / base["ms"]
        r["mem_vs_bf16"] = None if r["peak_mib"] is None else r["peak_mib"] / base["peak_mib"]
    return rows


def kernel_cases(x: torch.Tensor, e: int) -> dict[str, tuple[Any, float]]:
    """name -> (call, bytes moved) for each per-group quantization kernel of a step, on the
    rows of x [M, K] split unevenly over e experts (also read by sass_cpu.py)."""
    kg = _library.kernels()
    m, k = x.shape
    offs = torch.tensor(split(m, e), dtype=torch.int64).cumsum(0).to(torch.int32).to(x.device)
    layout = G.token_layout(offs, m)
    p = layout.capacity
    amax = tuple(a for a in kg.group_amax(x, layout, plain=True, hadamard=True))
    nvfp4_copy = lambda rows, cols: rows * cols // 2 + rows * cols // 16  # noqa: E731
    mx_copy = lambda rows, cols: rows * cols + rows * cols // 32  # noqa: E731
    cases = {
        "group amax (plain + Hadamard tokens)": (
            lambda: kg.group_amax(x, layout, plain=True, hadamard=True),
            2 * m * k,
        ),
        "nvfp4 fwd: rows+dq, Hadamard tokens": (
            lambda: kg.nvfp4_quantize_grouped(
                x, layout, "nearest", "nearest", True, (True, False), amax
            ),
            2 * m * k + nvfp4_copy(m, k) + 2 * m * k + nvfp4_copy(k, p),
        ),
        "nvfp4 bwd: rows SR+dq, Hadamard tokens SR+dq": (
            lambda: kg.nvfp4_quantize_grouped(
                x, layout, "stochastic", "stochastic", True, (True, True), amax
            ),
            2 * m * k + nvfp4_copy(m, k) + 2 * m * k + nvfp4_copy(k, p) + 2 * k * p,
        ),
        "mxfp8: rows+dq, tokens+dq": (
            lambda: kg.mxfp8_quantize_grouped(x, layout, True, True, (True, True)),
            2 * m * k + mx_copy(m, k) + 2 * m * k + mx_copy(k, p) + 2 * k * p,
        ),
        # as the emulated step makes them (gemm/dispatch.py, DQ_ONLY_ACTIVATIONS): each copy
        # made with its `_dq` written without its codes and scales
        "nvfp4 fwd, dq only: rows dq, Hadamard tokens": (
            lambda: kg.nvfp4_quantize_grouped(
                x, layout, "nearest", "nearest", True, (True, False), amax, codes=(False, False)
            ),
            2 * m * k + 2 * m * k + nvfp4_copy(k, p),
        ),
        "nvfp4 bwd, dq only: rows SR dq, Hadamard tokens SR dq": (
            lambda: kg.nvfp4_quantize_grouped(
                x,
                layout,
                "stochastic",
                "stochastic",
                True,
                (True, True),
                amax,
                codes=(False, False),
            ),  # fmt: skip
            2 * m * k + 2 * m * k + 2 * k * p,
        ),
        "mxfp8, dq only: rows dq, tokens dq": (
            lambda: kg.mxfp8_quantize_grouped(x, layout, True, True, (True, True), (False, False)),
            2 * m * k + 2 * m * k + 2 * k * p,
        ),
    }
    # the layout: source and group of every position
    return {name: (fn, nbytes + 8 * p) for name, (fn, nbytes) in cases.items()}


def kernel_rows(m: int, k: int, e: int, device: torch.device, args, copy_bps: float) -> list[dict]:
    """Each per-group quantization kernel of a step alone, % of the copy ceiling."""
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    rows = []
    for name, (fn, nbytes) in kernel_cases(x, e).items():
        if device.type == "cuda":
            fn()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            timing = harness.time_fn(
                graph.replay, warmup=args.warmup, reps=args.reps, device=device
            )
        else:
            timing = harness.time_fn(fn, warmup=args.warmup, reps=args.reps, device=device)
        bps = nbytes / (timing.median_ms * 1e-3)
        rows.append(
            {
                "kernel": name,
                "M,K,E": f"{m},{k},{e}",
                "us": timing.median_ms * 1e3,
                "GB/s": bps / 1e9,
                "pct_copy": 100 * bps / copy_bps,
            }
        )
    return rows


def profile_case(k: int, n: int, m: int, e: int, names: list[str], device: torch.device) -> None:
    """The GPU kernels of one step per recipe, by total time (torch.profiler), to see where a
    step's time goes; printed, not recorded."""
    bf = torch.bfloat16
    offs = torch.tensor(split(m, e), dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    w = torch.nn.Parameter(torch.randn(e, n, k, device=device, dtype=bf) / k**0.5)
    x = torch.randn(m, k, device=device, dtype=bf).requires_grad_(True)
    go = torch.randn(m, n, device=device, dtype=bf)
    for name in names:
        step = grouped_step(name)
        for _ in range(3):
            step(x, w, offs, go)
        harness.synchronize(device)
        activities = [torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(5):
                step(x, w, offs, go)
            harness.synchronize(device)
        print(f"profile K={k} N={n} M={m} E={e} {name} (5 steps):")
        print(
            prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=14, max_name_column_width=60
            )
        )


GEMM_GROUP_M = [1, 4, 8, 16]
GEMM_CONFIGS = [
    (128, 128, 64, 8, 3),
    (128, 256, 64, 8, 3),
    (128, 256, 64, 8, 4),
    (64, 256, 64, 4, 4),
]


def _gemm_configs(text: str) -> list[tuple[int, ...]]:
    """'BM,BN,BK,WARPS,STAGES[,WS];...' -> the configs, for --gemm-configs (WS 1: the rows
    GEMMs warp-specialized, kernels/grouped_gemm.py ROWS_WARP_SPECIALIZE)."""
    configs = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        cfg = tuple(int(v) for v in part.split(","))
        if len(cfg) not in (5, 6) or min(cfg[:5]) < 1 or cfg[5:] not in ((), (0,), (1,)):
            raise argparse.ArgumentTypeError(f"{part!r} is not BM,BN,BK,WARPS,STAGES[,WS]")
        configs.append(cfg if cfg[5:] != (0,) else cfg[:5])
    if not configs:
        raise argparse.ArgumentTypeError("no config given")
    return configs


def gemm_rows(k: int, n: int, m: int, e: int, device: torch.device, args) -> list[dict]:
    """The grouped GEMMs alone (BF16 operands): cuBLAS/CUTLASS `torch._grouped_mm` against
    the emulated kernels (with the per-group alpha) under each tile config."""
    from blockscale.kernels import grouped_gemm as gg

    defaults = gg.ROWS_CONFIG, gg.TOKENS_CONFIG
    bf = torch.bfloat16
    offs = torch.tensor(split(m, e), dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    layout = G.token_layout(offs, m)
    x = torch.randn(m, k, device=device, dtype=bf)
    w = torch.randn(e, n, k, device=device, dtype=bf)
    go = torch.randn(m, n, device=device, dtype=bf)
    xt = torch.randn(k, layout.capacity, device=device, dtype=bf)
    got = torch.randn(n, layout.capacity, device=device, dtype=bf)
    amax = (torch.rand(e, device=device) + 1, torch.rand(e, device=device) + 1)
    t = lambda fn: harness.time_fn(fn, warmup=args.warmup, reps=args.reps, device=device)  # noqa: E731
    flop = 2 * m * n * k
    cases = {
        "torch bf16 output": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs),
        "torch bf16 grad_input": lambda: torch._grouped_mm(go, w, offs=offs),
        "torch bf16 grad_weight": lambda: torch._grouped_mm(go.t(), x, offs=offs),
    }
    try:
        torch._grouped_mm(x, w.transpose(-2, -1), offs=offs, out_dtype=torch.float32)
        cases["torch fp32-out output"] = lambda: torch._grouped_mm(
            x, w.transpose(-2, -1), offs=offs, out_dtype=torch.float32
        )
        cases["torch fp32-out grad_weight"] = lambda: torch._grouped_mm(
            go.t(), x, offs=offs, out_dtype=torch.float32
        )
    except RuntimeError as err:
        print(f"torch._grouped_mm with out_dtype=float32: {str(err).splitlines()[0]}")
    for cfg in args.gemm_configs or GEMM_CONFIGS:
        c = ",".join(map(str, cfg[:5])) + (", warp-specialized" if len(cfg) == 6 else "")
        cases[f"ours output {c}"] = lambda: gg.grouped_gemm_rows(x, w, offs, amax)
        cases[f"ours grad_input {c}"] = lambda: gg.grouped_gemm_rows(
            go, w.transpose(-2, -1), offs, amax
        )
        names = [f"ours output {c}", f"ours grad_input {c}"]
        # grad_weight's K is the tokens: BK must divide a segment; it has no warp-specialized
        # launch
        if G.TOKEN_ALIGN % cfg[2] == 0 and len(cfg) == 5:
            cases[f"ours grad_weight {c}"] = lambda: gg.grouped_gemm_tokens(
                got, xt, layout.seg_ends, amax, torch.bfloat16
            )
            names.append(f"ours grad_weight {c}")
            # the FP32 output of FP32 master weights (TOKENS_FP32_LAUNCH's launch, these tiles)
            cases[f"ours grad_weight fp32-out {c}"] = lambda: gg.grouped_gemm_tokens(
                got, xt, layout.seg_ends, amax, torch.float32
            )
            names.append(f"ours grad_weight fp32-out {c}")
        for name in names:
            fn = cases.pop(name)
            cases[name] = (cfg, fn)
    rows = []

    def record(name: str, fn) -> None:
        row = {"gemm": name, "M,K,N,E": f"{m},{k},{n},{e}"}
        try:
            timing = t(fn)
        except Exception as err:  # a swept config that does not fit (shared memory, registers)
            rows.append({**row, "us": None, "tflops": None, "error": str(err).splitlines()[0]})
            return
        rows.append({**row, "us": timing.median_ms * 1e3,
                     "tflops": flop / (timing.median_ms * 1e-3) / 1e12})  # fmt: skip

    ws_defaults = gg.ROWS_WARP_SPECIALIZE, gg.ROWS_WS_CONFIG
    for name, fn in cases.items():
        if isinstance(fn, tuple):
            cfg, fn = fn
            gg.ROWS_CONFIG = gg.TOKENS_CONFIG = gg.ROWS_WS_CONFIG = cfg[:5]
            gg.ROWS_WARP_SPECIALIZE = len(cfg) == 6
        record(name, fn)
        if gg.ROWS_WARP_SPECIALIZE and rows[-1]["us"] is not None:
            # `equal`: the bits of the same tiles without warp specialization (one sum order)
            ws_out = fn()
            gg.ROWS_WARP_SPECIALIZE = False
            rows[-1]["equal"] = torch.equal(ws_out, fn())
    gg.ROWS_CONFIG, gg.TOKENS_CONFIG = defaults
    gg.ROWS_WARP_SPECIALIZE, gg.ROWS_WS_CONFIG = ws_defaults
    # the tile orders (bands of GROUP_M row tiles; kernels/grouped_gemm.py) at the default tiles
    orders = ("ROWS_GROUP_M_KMAJOR", "ROWS_GROUP_M_NMAJOR", "TOKENS_GROUP_M", "TOKENS_PERSISTENT")
    saved = {name: getattr(gg, name) for name in orders}
    for group_m in GEMM_GROUP_M:
        for persistent in (True, False):
            gg.ROWS_GROUP_M_KMAJOR = gg.ROWS_GROUP_M_NMAJOR = gg.TOKENS_GROUP_M = group_m
            gg.TOKENS_PERSISTENT = persistent
            fns = {
                "grad_weight": lambda: gg.grouped_gemm_tokens(got, xt, layout.seg_ends, amax, bf)
            }
            if persistent:  # the row GEMMs' persistence is per weight layout, not varied here
                fns["output"] = lambda: gg.grouped_gemm_rows(x, w, offs, amax)
                fns["grad_input"] = lambda: gg.grouped_gemm_rows(
                    go, w.transpose(-2, -1), offs, amax
                )
            for gemm, fn in fns.items():
                kind = ", persistent" if gemm == "grad_weight" and persistent else ""
                record(f"ours {gemm}, bands of {group_m}{kind}", fn)
    for name, value in saved.items():
        setattr(gg, name, value)
    # grad_weight with an FP32 output (FP32 master weights, what users train with): each of
    # kernels/grouped_gemm.py's TOKENS_FP32_LAUNCHES at the default tiles and order; `equal`:
    # the same bits as one program a tile
    saved_fp32 = gg.TOKENS_FP32_LAUNCH
    outs = {}
    for launch in gg.TOKENS_FP32_LAUNCHES:
        gg.TOKENS_FP32_LAUNCH = launch
        fn = lambda: gg.grouped_gemm_tokens(got, xt, layout.seg_ends, amax, torch.float32)  # noqa: E731
        record(f"ours grad_weight fp32-out, {launch}", fn)
        outs[launch] = fn()
        rows[-1]["equal"] = torch.equal(outs[launch], outs["per_tile"])
    gg.TOKENS_FP32_LAUNCH = saved_fp32
    # the rows GEMMs' tile loop fused with the K loop or not, grad_input (N-major weight)
    # persistent or one program a tile (kernels/grouped_gemm.py ROWS_FUSED_LOOPS,
    # ROWS_PERSISTENT_NMAJOR), at the default tiles; `equal`: the default launch's bits
    switches = ("ROWS_FUSED_LOOPS", "ROWS_PERSISTENT_NMAJOR")
    saved = {name: getattr(gg, name) for name in switches}
    gemms = {
        "output": lambda: gg.grouped_gemm_rows(x, w, offs, amax),
        "grad_input": lambda: gg.grouped_gemm_rows(go, w.transpose(-2, -1), offs, amax),
    }
    base = {gemm: fn() for gemm, fn in gemms.items()}
    for fused in (False, True):
        for persistent in (False, True):
            gg.ROWS_FUSED_LOOPS, gg.ROWS_PERSISTENT_NMAJOR = fused, persistent
            for gemm, fn in gemms.items():
                if gemm == "output" and not persistent:
                    continue  # (the output GEMM's weight is K-major: ROWS_PERSISTENT_KMAJOR)
                launch = "persistent" if gemm == "output" or persistent else "one program a tile"
                record(
                    f"ours {gemm} rows launch, {launch}, loops {'' if fused else 'not '}fused", fn
                )
                rows[-1]["equal"] = torch.equal(fn(), base[gemm])
    for name, value in saved.items():
        setattr(gg, name, value)
    return rows


# (experts, hidden, width) of the fine-grained MoE shapes where the weights outweigh the tokens
PACKED_SHAPES = {"qwen3-30b-a3b": (128, 2048, 768), "deepseek-v3": (256, 2048, 512)}
PACKED_ROWS = 16384 * 8  # 16384 tokens, top-8
PACKED_QUICK = {"tiny": (4, 64, 32)}
# the packed rows kernel's tiles (kernels/grouped_gemm.py ROWS_PACKED_CONFIG), the first the
# default; (BM, BN, BK, warps, stages)
PACKED_CONFIGS = [
    (128, 256, 64, 8, 3),
    (128, 128, 64, 8, 3),
    (128, 128, 64, 4, 4),
    (64, 256, 64, 4, 3),
]


@contextlib.contextmanager
def _kernels_everywhere(device: torch.device):
    """The CPU smoke test runs the kernel path in Triton's interpreter (as the tests do)."""
    if device.type == "cuda":
        yield
        return
    saved = _library.use_kernels
    _library.use_kernels = lambda t: True
    try:
        yield
    finally:
        _library.use_kernels = saved


def _packed_operands(recipe, gemm: str, k: int, n: int, e: int, m: int, device):
    """(a, b, bf16 call args) of one rows GEMM: output (x [M, K] against w [E, N, K]) or
    grad_input (grad [M, N] against w read transposed), quantized as `recipe` quantizes them
    in grouped_mm; the weight copy packed (no `_dq`), as a cached copy is."""
    from blockscale.formats.grouped import token_layout
    from blockscale.gemm.grouped import TransposedExperts
    from blockscale.ops.quantize import quantize_experts, quantize_grouped

    bf = torch.bfloat16
    offs = torch.tensor(split(m, e), dtype=torch.int64).cumsum(0).to(torch.int32).to(device)
    w = torch.randn(e, n, k, device=device, dtype=bf) / k**0.5
    layout = token_layout(offs, m)
    if gemm == "output":
        x = torch.randn(m, k, device=device, dtype=bf)
        a, _ = quantize_grouped(x, offs, layout, recipe.output.input, None)
        b = quantize_experts(w, recipe.output.weight, dq=False)
        return a, b, offs, (x, w.transpose(-2, -1))
    go = torch.randn(m, n, device=device, dtype=bf)
    a, _ = quantize_grouped(go, offs, layout, recipe.grad_input.grad_output, None)
    cfg = recipe.grad_input.weight
    if cfg.block == "16x16" and cfg == recipe.output.weight:
        b = TransposedExperts(quantize_experts(w, cfg, dq=False))
    else:
        b = quantize_experts(w, cfg, transpose=True, dq=False)
    return a, b, offs, (go, w)


def packed_rows(label: str, shape: tuple[int, int, int], m: int, args, device) -> list[dict]:
    """The rows GEMMs with the expert weight read packed, against the `_dq` path and BF16."""
    e, hidden, width = shape
    rows = []
    for proj, (k, n) in (("up", (hidden, width)), ("down", (width, hidden))):
        for name in [r for r in args.recipes if r != "bf16"]:
            for gemm in ("output", "grad_input"):
                case = {"shape": label, "proj": proj, "gemm": gemm, "recipe": name}
                rows += packed_case(case, k, n, e, m, args, device)
    return rows


def packed_case(case: dict, k: int, n: int, e: int, m: int, args, device) -> list[dict]:
    """One rows GEMM (`case`: its GEMM and recipe) by each path: BF16, the `_dq` path (with
    and without the dequantize) and the packed kernel at each of PACKED_CONFIGS."""
    from blockscale.gemm import grouped as gemm_grouped
    from blockscale.kernels import grouped_gemm as gg

    name = case["recipe"]
    a, b, offs, (x, w_t) = _packed_operands(recipes.get(name), case["gemm"], k, n, e, m, device)
    a_dq, b_dq = a.dq(), b.dq()  # the activation's `_dq` exists in both paths
    amax = (a.amax, b.amax) if hasattr(a, "amax") else None  # (NVFP4: per-expert alphas)

    def rows_call(packed: bool) -> torch.Tensor:
        gemm_grouped.PACKED_WEIGHT = packed
        try:
            return gemm_grouped.grouped_mm_rows(a, b, offs)
        finally:
            gemm_grouped.PACKED_WEIGHT = False

    cases = {
        "bf16 torch._grouped_mm": (lambda: torch._grouped_mm(x, w_t, offs=offs), None),
        "dq: dequantize + GEMM": (lambda: rows_call(False), None),
        "dq: dequantize alone": (b.dq, None),
        "dq: GEMM alone": (lambda: gg.grouped_gemm_rows(a_dq, b_dq, offs, amax), None),
    }
    for cfg in PACKED_CONFIGS[: 1 if args.quick else None]:
        cases[f"packed {','.join(map(str, cfg))}"] = (lambda: rows_call(True), cfg)
    want = rows_call(False)
    rows = []
    default_cfg = gg.ROWS_PACKED_CONFIG
    for path, (fn, cfg) in cases.items():
        gg.ROWS_PACKED_CONFIG = cfg or default_cfg
        try:
            timing = harness.time_fn(fn, warmup=args.warmup, reps=args.reps, device=device)
            equal = bool(torch.equal(fn(), want)) if cfg else None
            measure_peak = path == "dq: dequantize + GEMM" or cfg == PACKED_CONFIGS[0]
            peak = harness.peak_memory(fn, device) if measure_peak else None
        finally:
            gg.ROWS_PACKED_CONFIG = default_cfg
        us = timing.median_ms * 1e3
        rows.append({
            **case, "E,K,N": f"{e},{x.shape[1]},{w_t.shape[2]}", "path": path, "us": us,
            "tflops": 2 * m * k * n / (us * 1e-6) / 1e12, "vs_bf16": us / rows[0]["us"] if rows
            else 1.0, "equal": equal, "peak_mib": None if peak is None else peak / 2**20,
        })  # fmt: skip
        print(f"  {case} {path}: {us:.0f} us", flush=True)
    return rows


# the expert weights' copies whose `_dq` a rows GEMM makes from a packed (cached or saved)
# copy: (format, block, along N); the copies along N are strided views, one per expert
DQ_COPIES = {
    "mxfp8 along K": ("mxfp8", "1x32", False),
    "mxfp8 along N": ("mxfp8", "1x32", True),
    "nvfp4 16x16 along K": ("nvfp4", "16x16", False),
    "nvfp4 1x16 along K": ("nvfp4", "1x16", False),
    "nvfp4 1x16 along N": ("nvfp4", "1x16", True),
}


def dequantize_rows(label: str, shape: tuple, args, device, copy_bps: float) -> list[dict]:
    """The `_dq` of each expert-weight copy (`--packed`'s "dq: dequantize alone"): the
    kernels reading the copy in place, against the path before 2026-11-28 (replaced.py's
    `dq-copy-first`: a contiguous copy of the codes and scales, then the kernel) and those
    copies alone; `equal`: the two `_dq` bit for bit."""
    from blockscale.ops.quantize import quantize_experts
    from blockscale.recipes import OperandConfig

    e, hidden, width = shape
    rows = []
    for proj, (k, n) in (("up", (hidden, width)), ("down", (width, hidden))):
        w = torch.randn(e, n, k, device=device, dtype=torch.bfloat16) / k**0.5
        for name, (fmt, block, along_n) in DQ_COPIES.items():
            q = quantize_experts(w, OperandConfig(fmt, block), transpose=along_n, dq=False)
            now, old = q.dq(), replaced.old_dequantize_dq(q)
            equal = torch.equal(now.view(torch.int16), old.view(torch.int16))
            del now, old
            packed = 0.5 + 1 / 16 if fmt == "nvfp4" else 1 + 1 / 32  # codes + scales, a value
            # bytes read + written a value: the dequantize's; the copies' (none for a view)
            per_value = {"old: its copies alone": 2 * packed if along_n else 0.0}
            cases = {
                "now: read in place": q.dq,
                "old: copy first": lambda q=q: replaced.old_dequantize_dq(q),
                "old: its copies alone": lambda q=q: replaced.contiguous_rows(q),
            }
            for path, fn in cases.items():
                timing = harness.time_fn(fn, warmup=args.warmup, reps=args.reps, device=device)
                us = timing.median_ms * 1e3
                bps = e * n * k * per_value.get(path, 2 + packed) / (us * 1e-6)
                rows.append({
                    "shape": label, "proj": proj, "E,N,K": f"{e},{n},{k}", "copy": name,
                    "path": path, "us": us, "GB/s": bps / 1e9, "pct_copy": 100 * bps / copy_bps,
                    "equal": equal,
                })  # fmt: skip
                print(f"  {label} {proj} {name} {path}: {us:.0f} us", flush=True)
        del w
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = harness.add_common_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    parser.add_argument("--recipes", nargs="+", default=RECIPES, choices=RECIPES)
    parser.add_argument("--shapes", nargs="+", default=None,
                        choices=list(SHAPES) + list(NAMED_SHAPES))  # fmt: skip
    parser.add_argument("--tokens", nargs="+", type=int, default=None)
    parser.add_argument("--experts", nargs="+", type=int, default=None)
    parser.add_argument("--kernels", action="store_true", help="also the kernel breakdown table")
    parser.add_argument(
        "--profile", action="store_true", help="only profile the first case's kernels per recipe"
    )
    parser.add_argument(
        "--gemms", action="store_true", help="only the grouped GEMMs alone, per tile config"
    )
    parser.add_argument(
        "--packed",
        action="store_true",
        help="only the rows GEMMs with packed expert weights against the `_dq` path and BF16",
    )
    parser.add_argument(
        "--dequantize",
        action="store_true",
        help="only the `_dq` of each expert-weight copy at the --packed shapes, now against "
        "the path before 2026-11-28 (replaced.py dq-copy-first), in one process",
    )
    parser.add_argument(
        "--kernel-tiles",
        default="",
        metavar="BM,BK,WARPS[,MAXNREG][;...]",
        help="with --kernels: time the per-group kernels once per tile given, set for the "
        "nvfp4 and mxfp8 both-direction kinds, stochastic or not (kernels.grouped.TILES)",
    )
    parser.add_argument(
        "--gemm-configs",
        type=_gemm_configs,
        default=None,
        metavar="BM,BN,BK,WARPS,STAGES[;...]",
        help="with --gemms: these tile configs instead of GEMM_CONFIGS (grad_weight only for "
        "a BK dividing 64, its segments' alignment), e.g. '128,256,128,8,2;256,128,64,8,3' "
        "for the short-K output GEMM of the down projections",
    )
    replaced.add_arg(parser)
    tiles.add_arg(parser)
    args = parser.parse_args(argv)
    replaced.apply(args)
    tiles.apply(args)
    kernel_tiles = tiles.configs(args.kernel_tiles)
    device = harness.pick_device(args.device)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.reps = args.reps if args.reps is not None else (2 if args.quick else 15)
    args.recipes = ["bf16"] + [r for r in args.recipes if r != "bf16"]
    known = SHAPES | NAMED_SHAPES
    shapes = QUICK["shapes"] if args.quick else {s: known[s] for s in args.shapes or SHAPES}
    tokens = args.tokens or (QUICK["tokens"] if args.quick else TOKENS)
    experts = args.experts or (QUICK["experts"] if args.quick else EXPERTS)

    info = harness.banner(device)
    copy_bps = harness.copy_bandwidth(device, 2**26 if args.quick else 2**30, reps=args.reps)
    print(f"copy ceiling: {copy_bps / 1e12:.3g} TB/s (read + write)")
    if device.type == "cuda":
        print(
            f"bf16 GEMM ceiling 8192^3: {harness.gemm_tflops(8192, 8192, 8192, device):.0f} TFLOP/s"
        )
    if args.gemms:
        out = []
        for k, n in shapes.values():
            for m in tokens:
                for e in experts:
                    out += gemm_rows(k, n, m, e, device, args)
        harness.print_table(out, ["gemm", "M,K,N,E", "us", "tflops", "equal", "error"])
        if args.json:
            harness.write_json(
                args.json, {"benchmark": "grouped_gemms", "banner": info, "rows": out}
            )
        return 0
    if args.dequantize:
        out = []
        with _kernels_everywhere(device):
            for label, shape in (PACKED_QUICK if args.quick else PACKED_SHAPES).items():
                out += dequantize_rows(label, shape, args, device, copy_bps)
        harness.print_table(
            out, ["shape", "proj", "E,N,K", "copy", "path", "us", "GB/s", "pct_copy", "equal"]
        )
        if args.json:
            record = {"benchmark": "grouped_expert_dequantize", "banner": info,
                      "copy_tbps": copy_bps / 1e12, "rows": out,
                      "argv": sys.argv[1:] if argv is None else argv}  # fmt: skip
            harness.write_json(args.json, record)
        return 0
    if args.packed:
        packed = PACKED_QUICK if args.quick else PACKED_SHAPES
        m = 200 if args.quick else PACKED_ROWS
        out = []
        with _kernels_everywhere(device):
            for label, shape in packed.items():
                out += packed_rows(label, shape, m, args, device)
        harness.print_table(
            out, ["shape", "E,K,N", "proj", "gemm", "recipe", "path", "us", "tflops", "vs_bf16",
                  "equal", "peak_mib"],
        )  # fmt: skip
        if args.json:
            record = {"benchmark": "grouped_rows_packed", "banner": info, "rows_m": m,
                      "configs": PACKED_CONFIGS, "rows": out,
                      "argv": sys.argv[1:] if argv is None else argv}  # fmt: skip
            harness.write_json(args.json, record)
        return 0
    if args.profile:
        k, n = next(iter(shapes.values()))
        profile_case(k, n, tokens[0], experts[0], args.recipes, device)
        return 0
    rows: list[dict[str, Any]] = []
    kernels: list[dict[str, Any]] = []
    if args.kernels:
        for cfg in kernel_tiles or [None]:
            if cfg is not None:  # both formats' both-direction launches (with and without dq)
                for key in ("nvfp4:both", "nvfp4:both_dq", "nvfp4:both_sr_dq", "mxfp8:both",
                            "mxfp8:both_dq"):  # fmt: skip
                    G_TILES[key] = cfg
            for k, _ in shapes.values():
                for m in tokens:
                    found = kernel_rows(m, k, 8 if not args.quick else 4, device, args, copy_bps)
                    kernels += [
                        # the group amax has its own tile (kernels.grouped.AMAX_TILE)
                        {**r, "tiles": "-" if "amax" in r["kernel"] else str(cfg or "default")}
                        for r in found
                    ]
        harness.print_table(kernels, ["kernel", "M,K,E", "tiles", "us", "GB/s", "pct_copy"])
        if len(kernel_tiles) > 1:  # the fastest tile of each kernel and shape
            for key in dict.fromkeys((r["kernel"], r["M,K,E"]) for r in kernels):
                if "amax" not in key[0]:
                    fastest = min((r for r in kernels if (r["kernel"], r["M,K,E"]) == key),
                                  key=lambda r: r["us"])  # fmt: skip
                    print(
                        f"fastest {key[0]} ({key[1]}): {fastest['tiles']}, {fastest['us']:.0f} us"
                    )
    for label, (k, n) in shapes.items():
        for m in tokens:
            for e in experts:
                rows += bench_case(label, k, n, m, e, args, device)
    harness.print_table(
        rows,
        ["shape", "K,N", "tokens", "experts", "empty", "recipe", "ms", "time_vs_bf16", "tflops",
         "peak_mib", "mem_vs_bf16"],
    )  # fmt: skip
    if args.json:
        record = {"benchmark": "grouped_mm", "banner": info, "copy_tbps": copy_bps / 1e12,
                  "tiles": args.tiles, "kernel_tiles": args.kernel_tiles, "band": tiles.band(),
                  "rows": rows, "kernels": kernels,
                  "argv": sys.argv[1:] if argv is None else argv}  # fmt: skip
        harness.write_json(args.json, record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
